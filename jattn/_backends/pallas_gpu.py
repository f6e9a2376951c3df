"""jattn's Pallas GPU (Triton) flash attention for training: forward and backward kernels.

Why jattn's own kernel: cuDNN's (through jax.nn) takes no soft cap, sinks, segment ids or
bottom-right causal mask, and only 16-bit inputs; jax's Pallas GPU kernel
(`jax.experimental.pallas.ops.gpu.attention`) takes only top-left causal masks and segment ids,
no GQA, windows, lengths, sinks or soft cap, and returns no differentiable log-sum-exp. This one
takes every option of jattn's call that is a function of positions and per-example arrays:

- causal (either alignment) and windows, as one band ``q + lo <= k <= q + hi``: the loops visit
  only the key (or query) blocks that meet the band, and only the blocks its edges cross are
  masked by position (`pallas_gpu_kernels._walk`);
- lengths, padding of the keys to whole blocks and segment ids, folded into one pair of int32
  id vectors (`jattn._backends.splash_masks.segment_ids`): query t sees key s iff their ids are
  equal (and the band allows it), compared in every tile when any of them is in play; the key
  loop also stops at the example's key length;
- a logit soft cap ``cap * tanh(s / cap)`` after the scale; sinks (one logit per query head with
  no value) start each row's running max and sum; GQA/MQA (query head n reads key/value head
  n // G); a value head size Hv of its own;
- rows that see nothing give output 0 and log-sum-exp NEG (`jattn._softmax`), and the returned
  log-sum-exp carries its gradient.

Forward: grid (query blocks, B, N); each program walks its key blocks with the online softmax
(float32 statistics, logits from float32-accumulating matmuls) and writes its output and
log-sum-exp. Backward (FlashAttention-2): the probabilities are recomputed from the saved
log-sum-exp; delta = rowsum(dO * O) - dlse (the lse's own cotangent enters as d lse / d s = P);
one kernel per key block of a key/value head (grid (key blocks, B, K)) loops over the G query
heads of its group and their query blocks, accumulating dK and dV in registers, so no two
programs write the same rows and nothing is summed with atomics; one kernel per query block
(grid (query blocks, B, N)) accumulates dQ. The sinks' gradient is plain JAX from lse and delta
(`jattn._softmax.sink_gradient`).

Reasoned, not measured: no GPU was available. The kernels are tested in Pallas's interpret mode
on the CPU (`jattn._lowering.gpu_interpret_mode`) and lowered for CUDA (Pallas to Triton) from the
CPU. Shape vocabulary: B T S N K H, Hv the value head size, G = N // K.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from jattn import _derivatives, _lowering, _sharding, _softmax
from jattn._backends import foreign, splash_masks
from jattn._backends import pallas_gpu_kernels as kernels
from jattn._softmax import NEG
from jattn._validation import concrete

# Default block sizes (reasoned): 64 x 64 tiles keep a block of keys and values of head size 128
# in 16-bit (16 KiB each) within a streaming multiprocessor's shared memory with two pipeline
# stages, and a 64-row query block in registers.
DEFAULT_BLOCK = 64
MIN_BLOCK = 16  # Triton's matmul tiles: powers of two, 16 or more


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


# --------------------------------------------------------------------------------------------
# What the kernel takes.
# --------------------------------------------------------------------------------------------


def mask_parts(mask):
  """(band, lengths, segments) of the call's one mask object (or None): the band (lo, hi) of its
  causal and window parts (None: no band), its (q_lengths, kv_lengths) pairs, its one
  (q_ids, kv_ids) pair (or None); or a string saying which part the kernel cannot take."""
  band, lengths, segments = None, [], []
  for part in () if mask is None else mask.conjuncts():
    ids = part.ids()
    if part.band() is not None:
      lo, hi = part.band()
      band = (
        (lo, hi)
        if band is None
        else (
          lo if band[0] is None else band[0] if lo is None else max(lo, band[0]),
          hi if band[1] is None else band[1] if hi is None else min(hi, band[1]),
        )
      )
    elif ids is not None and ids[0] == "lengths":
      lengths.append(ids[1:])
    elif ids is not None and ids[0] == "segments":
      segments.append(ids[1:])
    else:
      return (
        f"mask: a {type(part).__name__} mask: the kernel takes causal masks, windows, "
        f"lengths and segment ids only (no mask arrays, functions, positions or hidden_rows "
        f"intervals: its block loop reads no per-column bounds)"
      )
  if len(segments) > 1:
    return "mask: two segment-id masks at once: the kernel takes one pair of id vectors"
  return band, lengths, segments[0] if segments else None


def block_sizes(call) -> tuple[int, int]:
  """(bq, bk): the caller's block_q / block_kv, else the default, no larger than T and S rounded
  up to a power of two (a tuning table's blocks were measured for the chunked kernels and are
  not read)."""
  s = call.static
  fit = lambda n: max(MIN_BLOCK, 1 << (n - 1).bit_length())
  bq = s.opts.block_q or min(DEFAULT_BLOCK, fit(s.T))
  bk = s.opts.block_kv or min(DEFAULT_BLOCK, fit(s.S))
  return bq, bk


def supports(call) -> str | None:
  """None, or what of the bound call (`jattn._call.Call`) the kernel cannot take and why."""
  s = call.static
  missing = foreign.missing_input(
    "the Pallas GPU flash kernel",
    (
      ("bias", call.given.bias is not None),
      ("dropout", s.opts.dropout_rate > 0),
      ("score_mod", s.opts.score_mod is not None),
    ),
  )
  if missing:
    return missing
  parts = mask_parts(call.mask)
  if isinstance(parts, str):
    return parts
  if jnp.dtype(s.dtype) not in (
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float16),
    jnp.dtype(jnp.float32),
  ):
    return f"query dtype {jnp.dtype(s.dtype)}: the Triton kernel takes bfloat16, float16, float32"
  for name, size in (("H", s.H), ("Hv", s.Hv)):
    if not _pow2(size) or size < MIN_BLOCK:
      return (
        f"a head size {name}={size}: Triton's loads and matmuls take powers of two, "
        f"{MIN_BLOCK} or more"
      )
  for name, size in (("block_q", s.opts.block_q), ("block_kv", s.opts.block_kv)):
    if size is not None and (not _pow2(size) or size < MIN_BLOCK):
      return f"{name}={size}: Triton's blocks are powers of two, {MIN_BLOCK} or more"
  if not concrete(s.B, s.N):
    return f"a symbolic batch or head count (B={s.B}, N={s.N}): the kernel's grid counts them"
  if s.split.spec is not None:
    return (
      "inputs under an Explicit mesh: XLA cannot partition a Pallas kernel (use "
      "'chunked', or the kernel inside a shard_map)"
    )
  if _sharding.checks_vma(call.query):
    return (
      "jax.shard_map(check_vma=True): its Pallas kernels do not type their outputs as "
      "device-varying (JAX's pallas_call raises); use check_vma=False"
    )
  return None


# --------------------------------------------------------------------------------------------
# The call.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class KernelShape:
  """The static (hashable) description of one kernel call: the true and padded lengths, the
  blocks, the band (None sides open), the logit scale and soft cap, whether sinks are given,
  the group size G, whether the tiles compare ids (``ids``: lengths, segment ids or padded keys
  hide something; padded query rows alone need not be hidden: their output is dropped and their
  zero cotangents add nothing to the gradients) and interpret mode."""

  T: int
  S: int
  Tp: int
  Sp: int
  bq: int
  bk: int
  lo: int | None
  hi: int | None
  scale: float
  cap: float | None
  sinks: bool
  G: int
  ids: bool
  interpret: bool

  def warps(self) -> int:
    return 4 if self.bq * self.bk <= 64 * 64 else 8


def run(call):
  """The kernel on a bound call: (out (B, T, N, Hv), lse (B, T, N) float32). Lowered for another
  platform than CUDA (outside `jattn._lowering.gpu_interpret_mode`), the program fails there with a
  message naming the fallbacks."""
  interpret = _lowering.gpu_interpreting()
  go = functools.partial(flash_attention, call, interpret)
  if interpret:
    return go()
  message = (
    "implementation='pallas_gpu' needs an NVIDIA GPU: this program is lowered for "
    "{platform}. Run it on a GPU, or on a CPU inside jattn._lowering.gpu_interpret_mode() "
    "(slow; for tests), or name a fallback: implementation=('pallas_gpu', 'chunked')"
  )
  return _lowering.only_on("cuda", go, call, message)


def flash_attention(call, interpret: bool = False):
  """(out (B, T, N, Hv) in the query dtype, lse (B, T, N) float32) of a bound call
  (`jattn._call.Call`) through the Triton kernels: its query (B, T, N, H), key (B, S, K, H),
  value (B, S, K, Hv), its one jattn mask object (or None; `supports` has refused what the
  kernel cannot take), its sinks, scale and soft cap, in blocks of `block_sizes`. T and S are
  padded to whole blocks here, the padding hidden by the ids."""
  s = call.static
  query, key, value = call.query, call.key, call.value
  sinks = None if call.sink is None else call.sink.reshape(s.N)
  block_q, block_kv = block_sizes(call)
  soft_cap = s.opts.logits_soft_cap
  B, T, N, _ = query.shape
  _, S, K, _ = key.shape
  parts = mask_parts(call.mask)
  if isinstance(parts, str):
    foreign.refuse("pallas_gpu", *parts.split(": ", 1))
  band, lengths, segments = parts
  lo, hi = band if band is not None else (None, None)
  Tp, Sp = -(-T // block_q) * block_q, -(-S // block_kv) * block_kv
  q_ids, kv_ids, q_ok, kv_ok = (
    jnp.broadcast_to(x, (B,) + x.shape[1:])
    for x in splash_masks.segment_ids(B, T, S, Tp, Sp, lengths, segments)
  )
  # Loop bounds: each example's key length (a block past it is never visited).
  kv_len = jnp.full((B,), S, jnp.int32)
  for _, kv_lengths in lengths:
    if kv_lengths is not None:
      kv_len = jnp.minimum(kv_len, jnp.clip(kv_lengths.astype(jnp.int32), 0, S))
  info = jnp.zeros((B, 8), jnp.int32).at[:, 0].set(kv_len)

  # A query row or key hidden from everything is zeroed (inf or NaN there would reach the
  # matmuls as 0 * NaN); padding is zero already.
  pad = lambda x, L, ok: jnp.where(
    ok[:, :, None, None],
    jnp.pad(x, ((0, 0), (0, L - x.shape[1]), (0, 0), (0, 0))),
    jnp.zeros((), x.dtype),
  )
  q, k, v = pad(query, Tp, q_ok), pad(key, Sp, kv_ok), pad(value, Sp, kv_ok)
  plan = KernelShape(
    T,
    S,
    Tp,
    Sp,
    block_q,
    block_kv,
    lo,
    hi,
    float(s.scale),
    None if soft_cap is None else float(soft_cap),
    sinks is not None,
    N // K,
    bool(lengths) or segments is not None or Sp != S,
    interpret,
  )
  out, lse = _flash(plan, kernels.Padded(q, k, v, sinks, q_ids, kv_ids, info))
  return out[:, :T], jnp.transpose(lse, (0, 2, 1))[:, :T]


def _flash(plan, ops: kernels.Padded):
  """(out (B, Tp, N, Hv), lse (B, N, Tp) float32) on the padded problem (see `kernels.Padded`):
  differentiable in every mode (`jattn._derivatives.with_derivatives`): reverse mode by the backward
  kernels from the saved output and log-sum-exp, forward mode by `_definition`'s jvp."""
  return _derivatives.with_derivatives(
    lambda diff, aux: (kernels.forward(plan, kernels.Padded(*diff, *aux)), ()),
    lambda diff, aux, saved: _definition(plan, kernels.Padded(*diff, *aux)),
    lambda diff, aux, outs, saved, cts: _cotangents(plan, kernels.Padded(*diff, *aux), outs, cts),
    (ops.q, ops.k, ops.v, ops.sinks),
    (ops.q_ids, ops.kv_ids, ops.info),
  )


def _cotangents(plan, ops: kernels.Padded, outs, cts):
  out, lse = outs
  d_out, d_lse = (jnp.zeros_like(x) if ct is None else ct for ct, x in zip(cts, outs))
  return _backward(plan, ops, out, lse, d_out, d_lse)


def _definition(plan, ops: kernels.Padded):
  """What the kernels compute, in plain JAX with (Tp, Sp) scores: (out (B, Tp, N, Hv), lse
  (B, N, Tp)). Forward mode (jvp, jacfwd, linearize) takes its tangent: the Triton kernels have
  no derivative of their own but the gradient."""
  q, k, v, sinks, q_ids, kv_ids, _ = ops
  B, Tp, N, H = q.shape
  Sp, K = k.shape[1], k.shape[2]
  G = plan.G
  f32 = jnp.float32
  qg = q.reshape(B, Tp, K, G, H).astype(f32)
  s = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(f32)) * plan.scale
  if plan.cap is not None:
    s = plan.cap * jnp.tanh(s / plan.cap)
  rows = jnp.arange(Tp).reshape(1, 1, 1, Tp, 1)
  cols = jnp.arange(Sp).reshape(1, 1, 1, 1, Sp)
  vis = jnp.ones((1, 1, 1, Tp, Sp), bool)
  if plan.ids:
    vis = vis & (q_ids[:, None, None, :, None] == kv_ids[:, None, None, None, :])
  if plan.lo is not None:
    vis = vis & (cols >= rows + plan.lo)
  if plan.hi is not None:
    vis = vis & (cols <= rows + plan.hi)
  s = jnp.where(vis, s, NEG)
  sink = None if sinks is None else sinks.astype(f32).reshape(1, K, G, 1)
  p, l, m = _softmax.exp_rows(s, sink)
  out = _softmax.normalize(jnp.einsum("bkgts,bskh->bkgth", p, v.astype(f32)), l, m, 0.0)
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, Tp, N, -1).astype(q.dtype)
  return out, _softmax.lse(m, l).reshape(B, N, Tp)


@kernels.without_derivative
def _backward(plan, ops: kernels.Padded, out, lse, d_out, d_lse):
  """(dq, dk, dv, d_sinks or None) of the padded problem for the cotangents of out and lse."""
  sinks = ops.sinks
  sd = jnp.float32
  # dS = P * (dP - delta): delta = rowsum(dO * O) for the output, minus the lse's cotangent
  # (d lse / d s = P adds dlse * P).
  delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(sd), out.astype(sd)) - d_lse.astype(sd)
  # Rows that saw nothing: +inf, so that their recomputed probabilities are exact zeros.
  lse_r = _softmax.lse_for_recompute(lse)
  d_out = d_out.astype(ops.q.dtype)
  dk, dv = kernels.backward_kv(plan, ops, d_out, lse_r, delta)
  dq = kernels.backward_q(plan, ops, d_out, lse_r, delta)
  d_sinks = None
  if sinks is not None:
    N = sinks.shape[0]
    K = N // plan.G
    d_sinks = _softmax.sink_gradient(
      sinks.reshape(1, K, plan.G, 1), jnp.transpose(lse, (0, 2, 1)), jnp.transpose(delta, (0, 2, 1))
    ).reshape(N)
  return dq, dk, dv, d_sinks
