"""jattn's Pallas GPU (Triton) flash attention for training: forward and backward kernels.

Why jattn's own kernel: cuDNN's (through jax.nn) takes no soft cap, sinks, segment ids or
bottom-right causal mask, and only 16-bit inputs; jax's Pallas GPU kernel
(`jax.experimental.pallas.ops.gpu.attention`) takes only top-left causal masks and segment ids,
no GQA, windows, lengths, sinks or soft cap, and returns no differentiable log-sum-exp. This one
takes every option of jattn's call that is a function of positions and per-example arrays:

- causal (either alignment) and windows, as one band ``q + lo <= k <= q + hi``: the loops visit
  only the key (or query) blocks that meet the band, and only the blocks its edges cross are
  masked by position (`_walk`);
- lengths, padding of the keys to whole blocks and segment ids, folded into one pair of int32
  id vectors (`jattn._backends.splash.segment_ids`): query t sees key s iff their ids are equal (and the
  band allows it), compared in every tile when any of them is in play; the key loop also stops
  at the example's key length;
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import _derivatives, _lowering, _sharding, _softmax
from jattn._backends import foreign, splash
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


class Padded(NamedTuple):
  """The arrays every kernel reads, on the problem padded to whole blocks (one pytree: the custom
  VJP's operand and residual): q (B, Tp, N, H), k (B, Sp, K, H), v (B, Sp, K, Hv), sinks (N,)
  float32 or None, q_ids (B, Tp) and kv_ids (B, Sp) int32 (query t sees key s iff their ids are
  equal), info (B, 8) int32 (column 0: the example's key length)."""

  q: Any
  k: Any
  v: Any
  sinks: Any
  q_ids: Any
  kv_ids: Any
  info: Any


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
    for x in splash.segment_ids(B, T, S, Tp, Sp, lengths, segments)
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
  out, lse = _flash(plan, Padded(q, k, v, sinks, q_ids, kv_ids, info))
  return out[:, :T], jnp.transpose(lse, (0, 2, 1))[:, :T]


def _flash(plan, ops: Padded):
  """(out (B, Tp, N, Hv), lse (B, N, Tp) float32) on the padded problem (see `Padded`):
  differentiable in every mode (`jattn._derivatives.with_derivatives`): reverse mode by the backward
  kernels from the saved output and log-sum-exp, forward mode by `_definition`'s jvp."""
  return _derivatives.with_derivatives(
    lambda diff, aux: (_forward(plan, Padded(*diff, *aux)), ()),
    lambda diff, aux, saved: _definition(plan, Padded(*diff, *aux)),
    lambda diff, aux, outs, saved, cts: _cotangents(plan, Padded(*diff, *aux), outs, cts),
    (ops.q, ops.k, ops.v, ops.sinks),
    (ops.q_ids, ops.kv_ids, ops.info),
  )


def _cotangents(plan, ops: Padded, outs, cts):
  out, lse = outs
  d_out, d_lse = (jnp.zeros_like(x) if ct is None else ct for ct, x in zip(cts, outs))
  return _backward(plan, ops, out, lse, d_out, d_lse)


def _definition(plan, ops: Padded):
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


def _refuse_derivative(plan, primals, tangents):
  del plan, primals, tangents
  raise NotImplementedError(
    "higher-order AD (a derivative of the gradient) of implementation='pallas_gpu': its "
    "kernels have no derivative of their own beyond the gradient; use "
    "implementation='chunked' or 'dense'"
  )


def _without_derivative(fn):
  """``fn(plan, *arrays)`` whose derivative raises NotImplementedError: the kernels' own
  (pallas_call's) would fail with an unhelpful message in a gradient of the gradient."""
  fn = jax.custom_jvp(fn, nondiff_argnums=(0,))
  fn.defjvp(_refuse_derivative)
  return fn


@_without_derivative
def _backward(plan, ops: Padded, out, lse, d_out, d_lse):
  """(dq, dk, dv, d_sinks or None) of the padded problem for the cotangents of out and lse."""
  sinks = ops.sinks
  sd = jnp.float32
  # dS = P * (dP - delta): delta = rowsum(dO * O) for the output, minus the lse's cotangent
  # (d lse / d s = P adds dlse * P).
  delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(sd), out.astype(sd)) - d_lse.astype(sd)
  # Rows that saw nothing: +inf, so that their recomputed probabilities are exact zeros.
  lse_r = _softmax.lse_for_recompute(lse)
  d_out = d_out.astype(ops.q.dtype)
  dk, dv = _backward_kv(plan, ops, d_out, lse_r, delta)
  dq = _backward_q(plan, ops, d_out, lse_r, delta)
  d_sinks = None
  if sinks is not None:
    N = sinks.shape[0]
    K = N // plan.G
    d_sinks = _softmax.sink_gradient(
      sinks.reshape(1, K, plan.G, 1), jnp.transpose(lse, (0, 2, 1)), jnp.transpose(delta, (0, 2, 1))
    ).reshape(N)
  return dq, dk, dv, d_sinks


# --------------------------------------------------------------------------------------------
# The kernels.
# --------------------------------------------------------------------------------------------


def _dot(a, b, contract):
  """a @ b in float32 with a's axis contract[0] against b's contract[1] (2-D operands)."""
  return jax.lax.dot_general(
    a, b, ((contract[:1], contract[1:]), ((), ())), preferred_element_type=jnp.float32
  )


def _logits(plan, q, k):
  """(s, t): the (rows, keys) float32 logits scaled and soft-capped, and tanh(s / cap) (None
  without a cap) for the backward's derivative cap * tanh' = 1 - t^2."""
  s = _dot(q, k, (1, 1)) * plan.scale
  if plan.cap is None:
    return s, None
  t = jnp.tanh(s / plan.cap)
  return plan.cap * t, t


def _masked(plan, s, rows, cols, q_id, kv_id, band: bool):
  """The (rows, keys) logits ``s`` with NEG where the ids differ (if the plan compares ids) or,
  for a tile the band crosses (``band``), where the band hides the key; rows, cols: positions.
  A tile inside the band with nothing to compare is returned as it is."""
  vis = None
  if plan.ids:
    vis = q_id[:, None] == kv_id[None, :]
  for edge, inside in (
    (plan.lo, lambda e: cols[None, :] >= rows[:, None] + e),
    (plan.hi, lambda e: cols[None, :] <= rows[:, None] + e),
  ):
    if band and edge is not None:
      vis = inside(edge) if vis is None else vis & inside(edge)
  return s if vis is None else jnp.where(vis, s, NEG)


def _walk(plan, blocks, step, carry):
  """fori_loop of ``step(j, carry, band)`` over the blocks [lo, hi), ``band`` False on the blocks
  [inside_lo, inside_hi) that lie inside the band (clipped to [lo, hi)), ``blocks`` = (lo, hi,
  inside_lo, inside_hi): only the blocks the band's edges cross pay for its mask."""
  lo, hi, inside_lo, inside_hi = blocks
  if plan.lo is None and plan.hi is None:
    return jax.lax.fori_loop(lo, hi, functools.partial(step, band=False), carry)
  a = jnp.clip(inside_lo, lo, hi)
  b = jnp.clip(inside_hi, a, hi)
  carry = jax.lax.fori_loop(lo, a, functools.partial(step, band=True), carry)
  carry = jax.lax.fori_loop(a, b, functools.partial(step, band=False), carry)
  return jax.lax.fori_loop(b, hi, functools.partial(step, band=True), carry)


def _key_blocks(plan, first_row, last_row, kv_len):
  """(j0, j1, ja, jb): the key blocks [j0, j1) rows first_row..last_row may see (band and key
  length), and [ja, jb) those whose every key every row's band holds."""
  bk = plan.bk
  start = 0 if plan.lo is None else jnp.maximum(first_row + plan.lo, 0)
  stop = kv_len if plan.hi is None else jnp.minimum(kv_len, last_row + plan.hi + 1)
  j0 = start // bk
  j1 = jnp.maximum((stop + bk - 1) // bk, j0)
  # Inside: the block's first key at or after the last row's left edge, its last key at or
  # before the first row's right edge (clipped at 0 first: the divisions round down).
  ja = j0 if plan.lo is None else (jnp.maximum(last_row + plan.lo, 0) + bk - 1) // bk
  jb = j1 if plan.hi is None else jnp.maximum(first_row + plan.hi + 1, 0) // bk
  return j0, j1, ja, jb


def _query_blocks(plan, first_col, last_col):
  """(i0, i1, ia, ib): the query blocks [i0, i1) whose rows may see keys first_col..last_col
  (the band), and [ia, ib) those whose every row's band holds every one of these keys."""
  bq = plan.bq
  start = 0 if plan.hi is None else jnp.maximum(first_col - plan.hi, 0)
  stop = plan.Tp if plan.lo is None else jnp.clip(last_col - plan.lo + 1, 0, plan.Tp)
  i0 = start // bq
  i1 = jnp.maximum((stop + bq - 1) // bq, i0)
  # Inside: the block's first row at or after last_col - hi, its last row at or before
  # first_col - lo.
  ia = i0 if plan.hi is None else (jnp.maximum(last_col - plan.hi, 0) + bq - 1) // bq
  ib = i1 if plan.lo is None else jnp.maximum(first_col - plan.lo + 1, 0) // bq
  return i0, i1, ia, ib


def _pallas_call(plan, kernel, *, grid, in_specs, out_specs, out_shape, name, operands):
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    interpret=plan.interpret,
    name=name,
    compiler_params=plgpu.CompilerParams(num_warps=plan.warps(), num_stages=2),
  )(*operands)


@_without_derivative
def _forward(plan, ops: Padded):
  from jax.experimental import pallas as pl

  q, k, v, sinks, q_ids, kv_ids, info = ops
  B, Tp, N, H = q.shape
  Sp, Hv = k.shape[1], v.shape[3]
  bq, G = plan.bq, plan.G
  rows = lambda i, b, n: (b, i)
  specs = [
    pl.BlockSpec((None, 8), lambda i, b, n: (b, 0)),
    pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0)),
    pl.BlockSpec((None, Sp, None, H), lambda i, b, n: (b, 0, n // G, 0)),
    pl.BlockSpec((None, Sp, None, Hv), lambda i, b, n: (b, 0, n // G, 0)),
    pl.BlockSpec((None, bq), rows),
    pl.BlockSpec((None, Sp), lambda i, b, n: (b, 0)),
  ]
  operands = [info, q, k, v, q_ids, kv_ids]
  if sinks is not None:
    # One row of bq copies per head: the kernel starts its running max from a vector.
    operands.append(jnp.broadcast_to(sinks.astype(jnp.float32)[:, None], (N, bq)))
    specs.append(pl.BlockSpec((None, bq), lambda i, b, n: (n, 0)))
  return _pallas_call(
    plan,
    functools.partial(_forward_kernel, plan),
    grid=(Tp // bq, B, N),
    in_specs=specs,
    out_specs=[
      pl.BlockSpec((None, bq, None, Hv), lambda i, b, n: (b, i, n, 0)),
      pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((B, Tp, N, Hv), q.dtype),
      jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
    ],
    name="jattn_flash_forward",
    operands=operands,
  )


def _forward_kernel(plan, info_ref, q_ref, k_ref, v_ref, qid_ref, kvid_ref, *refs):
  """One (query block, example, head) program: the online softmax over its key blocks."""
  from jax.experimental import pallas as pl

  *sink_ref, o_ref, lse_ref = refs
  bq, bk = plan.bq, plan.bk
  i = pl.program_id(0)
  rows = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)
  q, q_id = q_ref[...], qid_ref[...]

  def step(j, carry, band):
    m, l, acc = carry
    keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
    v = v_ref[keys, :]
    s, _ = _logits(plan, q, k_ref[keys, :])
    cols = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
    s = _masked(plan, s, rows, cols, q_id, kvid_ref[keys], band)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_new[:, None])
    corr = jnp.exp(m - m_new)
    return (
      m_new,
      l * corr + p.sum(axis=1),
      acc * corr[:, None] + _dot(p.astype(v.dtype), v, (1, 0)),
    )

  # A sink starts each row as its first logit (m = sink, l = 1); else nothing seen (m = NEG).
  if sink_ref:
    m0, l0 = sink_ref[0][...], jnp.ones((bq,), jnp.float32)
  else:
    m0, l0 = jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32)
  m, l, acc = _walk(
    plan,
    _key_blocks(plan, i * bq, i * bq + bq - 1, info_ref[0]),
    step,
    (m0, l0, jnp.zeros((bq, o_ref.shape[-1]), jnp.float32)),
  )
  # A row that saw no key keeps m = NEG (with a sink m >= sink, and its masked entries added
  # exact zeros): output 0, lse NEG. Its l counted junk exp(NEG - NEG) = 1s, discarded here.
  ok = ~_softmax.empty_rows(m, l)
  denom = jnp.where(ok, l, 1.0)
  o_ref[...] = jnp.where(ok[:, None], acc / denom[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(ok, m + jnp.log(denom), NEG)


def _backward_kv(plan, ops: Padded, d_out, lse, delta):
  """(dK (B, Sp, K, H), dV (B, Sp, K, Hv)) in k's and v's dtypes: one program per key block of
  each key/value head, looping over the G query heads of its group. ``d_out`` (B, Tp, N, Hv) in
  q's dtype; ``lse`` (for recomputing) and ``delta`` (B, N, Tp) float32."""
  from jax.experimental import pallas as pl

  q, k, v, q_ids, kv_ids = ops.q, ops.k, ops.v, ops.q_ids, ops.kv_ids
  B, Tp, _N, H = q.shape
  Sp, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  bk, G = plan.bk, plan.G
  group = lambda *rest: pl.BlockSpec((None, Tp, G) + rest, lambda j, b, h: (b, 0, h, 0))
  stat = pl.BlockSpec((None, G, Tp), lambda j, b, h: (b, h, 0))
  block = lambda X: pl.BlockSpec((None, bk, None, X), lambda j, b, h: (b, j, h, 0))
  return _pallas_call(
    plan,
    functools.partial(_backward_kv_kernel, plan),
    grid=(Sp // bk, B, K),
    in_specs=[
      group(H),
      block(H),
      block(Hv),
      group(Hv),
      stat,
      stat,
      pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),
      pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
    ],
    out_specs=[block(H), block(Hv)],
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    name="jattn_flash_backward_kv",
    operands=[q, k, v, d_out, lse, delta, q_ids, kv_ids],
  )


def _backward_kv_kernel(
  plan, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qid_ref, kvid_ref, dk_ref, dv_ref
):
  """One (key block, example, key/value head) program: dK and dV summed over the G query
  heads of the group and the query blocks that see the keys."""
  from jax.experimental import pallas as pl

  bq, bk = plan.bq, plan.bk
  j = pl.program_id(0)
  cols = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
  k, v, kv_id = k_ref[...], v_ref[...], kvid_ref[...]
  blocks = _query_blocks(plan, j * bk, j * bk + bk - 1)

  def step(i, carry, g, band):
    dk, dv = carry
    at = pl.ds(pl.multiple_of(i * bq, bq), bq)
    q, do = q_ref[at, g, :], do_ref[at, g, :]
    rows = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)
    s, t = _logits(plan, q, k)
    s = _masked(plan, s, rows, cols, qid_ref[at], kv_id, band)
    p = jnp.exp(s - lse_ref[g, at][:, None])
    dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
    ds = p * (_dot(do, v, (1, 1)) - delta_ref[g, at][:, None])
    if t is not None:
      ds = ds * (1.0 - t * t)
    return dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv

  def head(g, carry):
    return _walk(plan, blocks, functools.partial(step, g=g), carry)

  dk, dv = jax.lax.fori_loop(
    0,
    plan.G,
    head,
    (jnp.zeros((bk, k.shape[-1]), jnp.float32), jnp.zeros((bk, v.shape[-1]), jnp.float32)),
  )
  dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward_q(plan, ops: Padded, d_out, lse, delta):
  """dQ (B, Tp, N, H) in q's dtype: one program per query block of each head (``d_out``,
  ``lse``, ``delta`` as for `_backward_kv`)."""
  from jax.experimental import pallas as pl

  q, k, v, _, q_ids, kv_ids, info = ops
  B, Tp, N, H = q.shape
  Sp, Hv = k.shape[1], v.shape[3]
  bq, G = plan.bq, plan.G
  rows = lambda X: pl.BlockSpec((None, bq, None, X), lambda i, b, n: (b, i, n, 0))
  whole = lambda X: pl.BlockSpec((None, Sp, None, X), lambda i, b, n: (b, 0, n // G, 0))
  stat = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
  return _pallas_call(
    plan,
    functools.partial(_backward_q_kernel, plan),
    grid=(Tp // bq, B, N),
    in_specs=[
      pl.BlockSpec((None, 8), lambda i, b, n: (b, 0)),
      rows(H),
      whole(H),
      whole(Hv),
      rows(Hv),
      stat,
      stat,
      pl.BlockSpec((None, bq), lambda i, b, n: (b, i)),
      pl.BlockSpec((None, Sp), lambda i, b, n: (b, 0)),
    ],
    out_specs=rows(H),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    name="jattn_flash_backward_q",
    operands=[info, q, k, v, d_out, lse, delta, q_ids, kv_ids],
  )


def _backward_q_kernel(
  plan, info_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qid_ref, kvid_ref, dq_ref
):
  """One (query block, example, head) program: dQ over the key blocks its rows see."""
  from jax.experimental import pallas as pl

  bq, bk = plan.bq, plan.bk
  i = pl.program_id(0)
  rows = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)
  q, do, q_id = q_ref[...], do_ref[...], qid_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]

  def step(j, dq, band):
    keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
    k = k_ref[keys, :]
    s, t = _logits(plan, q, k)
    cols = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
    s = _masked(plan, s, rows, cols, q_id, kvid_ref[keys], band)
    p = jnp.exp(s - lse[:, None])
    ds = p * (_dot(do, v_ref[keys, :], (1, 1)) - delta[:, None])
    if t is not None:
      ds = ds * (1.0 - t * t)
    return dq + _dot(ds.astype(k.dtype), k, (1, 0))

  dq = _walk(
    plan,
    _key_blocks(plan, i * bq, i * bq + bq - 1, info_ref[0]),
    step,
    jnp.zeros((bq, q_ref.shape[-1]), jnp.float32),
  )
  dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)
