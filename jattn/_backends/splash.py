"""Pallas TPU splash attention behind jattn's call, with jattn's semantics on top.

Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) is JAX's fused TPU kernel:
it skips the blocks its mask hides using block lists computed from the mask when the kernel is
built, and takes segment ids, a logit soft cap, sinks and one key/value head per group of query
heads (its "MQA" kernel). It does not scale the logits, takes (heads, L, H) arrays of one example,
needs block sizes that are multiples of 128, and leaves a row with nothing to attend to
undefined. This module translates one jattn call into it (the mask half in `splash_masks`):

- the position-based part of the mask (causal, windows, chunked-local, prefix-LM, functions of
  positions and heads, their combinations) becomes a splash mask: a band (causal and windows) is
  splash's own lazy mask; anything else is evaluated once, at trace time, into a NumPy (T, S)
  array per head;
- lengths, padding to whole blocks and segment ids become one pair of segment-id vectors (a key
  past its length gets an id no query has), so they stay run-time arrays;
- the scale is folded into the query; batch and the K key/value heads are mapped over; each
  group of G query heads runs the MQA kernel against its key/value head; nothing in the kernels
  depends on the example, so a symbolic batch (`jax.export`) runs the kernels of a concrete one
  (a mask that reads the example index is refused there: see `static_masks`);
- a row with nothing to attend to is found from splash's log-sum-exp (it stays at splash's mask
  value, or -inf) and returns 0; its output cotangent is zeroed before the backward, so it adds
  nothing to any gradient.

Splash returns its log-sum-exp only from a forward-only kernel (`save_residuals=True` cannot be
differentiated), so the backward here recomputes the forward inside splash's own VJP: forward
and backward cost two forward kernels and one backward (splash alone: one and one).

Shape vocabulary: B batch, T query length, S key/value length, N query heads, K key/value heads,
G = N // K, H head dimension.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _lowering, _sharding, _softmax, _tuning
from jattn._backends import foreign
from jattn._backends.splash_masks import (
  HeadMask,
  builds_lazily,
  refuse,
  segment_ids,
  splash_modules,
  split_mask,
  static_masks,
)
from jattn._tile import NEG
from jattn._validation import concrete

TPU_LANES = _tuning.SPLASH_LANES  # splash's block sizes are multiples of the TPU's 128 lanes
DEFAULT_BLOCK = 512


def block_size(name: str, value: int | None, length: int) -> int:
  """A splash block size: the option given (a multiple of 128) or the default, no larger than
  ``length`` rounded up to 128."""
  if value is None:
    return min(DEFAULT_BLOCK, -(-length // TPU_LANES) * TPU_LANES)
  if value % TPU_LANES:
    raise NotImplementedError(
      f"implementation='splash' needs {name} to be a multiple of {TPU_LANES} (the TPU's lanes), "
      f"got {name}={value}"
    )
  return value


# --------------------------------------------------------------------------------------------
# Kernels, built once per static configuration.
# --------------------------------------------------------------------------------------------


_KERNELS: dict = {}


def _kernel(heads: tuple, bq: int, bk: int, soft_cap, save_residuals: bool):
  """Splash's MQA kernel for the G query heads of one key/value head, with the mask of each
  (``heads``: G `HeadMask`), cached: building one computes its block lists in NumPy."""
  key = (tuple(h.key for h in heads), bq, bk, soft_cap, save_residuals)
  if key not in _KERNELS:
    kernel_lib, mask_lib = splash_modules()
    sizes = kernel_lib.BlockSizes(
      block_q=bq,
      block_kv=bk,
      block_kv_compute=bk,
      block_q_dkv=bq,
      block_kv_dkv=bk,
      block_kv_dkv_compute=bk,
      block_q_dq=bq,
      block_kv_dq=bk,
    )
    # Concrete block lists (built in the trace they would be its tracers, and the cache would
    # hand them to the next trace), kept as NumPy arrays: built as jax arrays inside the
    # shard_map that runs the kernel per device they would be typed on its mesh, and jax 0.12.1
    # refuses such constants of a jitted program ("Unexpected XLA sharding override", or a
    # closed-over array "sharded on Explicit axes").
    no_mesh = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))
    with jax.ensure_compile_time_eval(), no_mesh:
      kernel = kernel_lib.make_splash_mqa(
        mask_lib.MultiHeadMask([h.build() for h in heads]),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        save_residuals=save_residuals,
        attn_logits_soft_cap=soft_cap,
      )
    _KERNELS[key] = jax.tree.map(np.asarray, kernel)
  return _KERNELS[key]


def _kernels(groups, bq, bk, soft_cap, save_residuals):
  """f(q (B, K, G, Tp, H), k (B, K, Sp, H), v, sinks (K, G) | None, q_ids (B, Tp),
  kv_ids (B, Sp)) -> (out (B, K, G, Tp, H), lse (B, K, G, Tp) | None): one splash call per
  example and key/value head (``groups``: the G head masks of every key/value head, or one
  tuple that all share).

  The calls run under `lax.map`, not `vmap`: a TPU walks a kernel's grid in sequence anyway, so
  a loop around whole (G, T, S) attentions costs little there, and Pallas's TPU interpret mode
  (how this runs on a CPU) cannot run a vmapped kernel (its grid grows dimensions that its
  dimension semantics do not list).
  """
  kernels = [_kernel(g, bq, bk, soft_cap, save_residuals) for g in groups]
  kernel_lib, _ = splash_modules()

  def one(kern, args):
    q, k, v, q_ids, kv_ids, sinks = args
    out = kern(q, k, v, segment_ids=kernel_lib.SegmentIds(q=q_ids, kv=kv_ids), sinks=sinks)
    return (out[0], out[1][0]) if save_residuals else (out, None)

  def run(q, k, v, sinks, q_ids, kv_ids):
    B, K = q.shape[:2]
    if len(kernels) == 1:  # every key/value head alike: one loop over (B x K)
      flat = lambda x: x.reshape((B * K,) + x.shape[2:])
      per_head = lambda x: jnp.repeat(x, K, axis=0)
      snk = None if sinks is None else jnp.tile(sinks, (B, 1))
      out, lse = jax.lax.map(
        functools.partial(one, kernels[0]),
        (flat(q), flat(k), flat(v), per_head(q_ids), per_head(kv_ids), snk),
      )
      unflat = lambda x: None if x is None else x.reshape((B, K) + x.shape[1:])
      return unflat(out), unflat(lse)
    per_batch = lambda x: None if x is None else jnp.broadcast_to(x, (B,) + x.shape)
    outs = [
      jax.lax.map(
        functools.partial(one, kern),
        (q[:, i], k[:, i], v[:, i], q_ids, kv_ids, per_batch(None if sinks is None else sinks[i])),
      )
      for i, kern in enumerate(kernels)
    ]
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *outs)

  return run


# --------------------------------------------------------------------------------------------
# The call.
# --------------------------------------------------------------------------------------------


def supports(call) -> str | None:
  """None, or what of the bound call (`jattn._call.Call`) splash cannot take and why."""
  s = call.static
  missing = foreign.missing_input(
    "the fused kernel",
    (
      ("bias", call.given.bias is not None),
      ("dropout", s.opts.dropout_rate > 0),
      ("score_mod", s.opts.score_mod is not None),
    ),
  )
  if missing:
    return missing
  if s.Hv != s.H:
    return (
      f"a value head size Hv={s.Hv} other than the key's H={s.H}: splash's kernels take "
      f"value with key's shape"
    )
  if not concrete(s.N):
    # A symbolic batch is taken: the kernels serve every example alike (see `static_masks`).
    return (
      f"a symbolic head count (N={s.N}): its kernels are built for a known number of query "
      f"heads per key/value head, with one block mask each, while the call is traced"
    )
  shard = shards(call)
  if isinstance(shard, str):
    return (
      shard + " under an Explicit mesh: XLA cannot partition a Pallas kernel, and jattn "
      "splits the call over devices only by examples and heads"
    )
  if _sharding.checks_vma(call.query):
    return (
      "jax.shard_map(check_vma=True): its Pallas kernels do not type their outputs as "
      "device-varying (JAX's pallas_call raises); use check_vma=False"
    )
  return None


def shards(call):
  """Under an Explicit mesh, the (batch, head) mesh axes splash runs split over, or a phrase
  saying why it cannot be split (see `_sharding.examples_and_heads`); else None."""
  if call.static.split.spec is None:
    return None
  return _sharding.examples_and_heads(call.query, call.given.key, call.given.value)


def first(call) -> bool:
  """implementation=None tries splash first on a TPU, at every size, only where the program
  cannot be partitioned (a Pallas kernel lowered into a multi-device program outside shard_map
  is refused by TPU lowering, and under an Auto mesh whether the program will be partitioned is
  not known while the call is traced), or where an Explicit mesh shards only examples and heads
  (the shardings are in the types, so it runs per device inside a shard_map); and only for
  masks it builds lazily (see `builds_lazily`)."""
  return (
    supports(call) is None
    and builds_lazily(call.mask)
    and (call.static.split.unpartitioned or isinstance(shards(call), tuple))
  )


def run(call):
  """Splash on a bound call: (out (B, T, N, Hv), lse (B, T, N)). Lowered for another platform
  than a TPU (outside Pallas's interpret mode), the program fails there with a message naming
  the fallbacks (where the program is lowered: one exported for tpu from a CPU is traced here
  too)."""
  go = functools.partial(splash_attention, call, shards(call))
  if _lowering.tpu_interpreting():
    return go()
  message = (
    "implementation='splash' needs a TPU: this program is lowered for {platform}. "
    "Run it on a TPU, or on a CPU inside "
    "jax.experimental.pallas.tpu.force_tpu_interpret_mode() (slow; for tests), or "
    "name a fallback: implementation=('splash', 'chunked')"
  )
  return _lowering.only_on("tpu", go, call, message)


def splash_attention(call, shard=None):
  """(out (B, T, N, H) in the query dtype, lse (B, T, N) float32) of a bound call
  (`jattn._call.Call`) through splash: its query, key and value as given, its one jattn mask
  object (or None), its sinks (N,) (or None), scale and soft cap, in the tuned splash blocks.

  ``shard``: under an Explicit mesh, (batch axes, head axes): the mesh axes the batch and the
  heads of query, key and value are sharded over (the sequences whole). XLA cannot partition a
  Pallas kernel, so each device then runs splash on its own examples and heads inside a
  `jax.shard_map` (manual over every mesh axis): the embarrassingly parallel split, with no
  communication."""
  s = call.static
  query, key, value, sinks = call.query, call.key, call.value, call.given.sinks
  block_q, block_kv = s.tuned.splash_blocks
  B, T, N, _H = query.shape
  _, S, _K, _ = key.shape
  if query.dtype not in (jnp.bfloat16, jnp.float32):
    refuse(f"query dtype {query.dtype}", "splash computes in bfloat16 or float32")
  bq, bk = block_size("block_q", block_q, T), block_size("block_kv", block_kv, S)
  Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
  static, lengths, segments = split_mask(call.mask)
  heads = static_masks(static, (B, N, T, S), (Tp, Sp))
  # q_ids, kv_ids, q_ok, kv_ok, each (B, Tp) or (B, Sp).
  ids = tuple(
    jnp.broadcast_to(x, (B,) + x.shape[1:]) for x in segment_ids(B, T, S, Tp, Sp, lengths, segments)
  )
  attend = functools.partial(_attend, Setup(heads, s.scale, s.opts.logits_soft_cap, bq, bk))
  if shard is None:
    return attend(query, key, value, sinks, ids)
  batch, head = shard
  if head and len(heads) > 1:
    refuse(
      "head-sharded inputs with a mask that differs between heads",
      "each device's kernels are built for the heads it holds, which one shard_map body "
      "cannot tell apart",
    )
  P = jax.sharding.PartitionSpec
  b, h = _sharding.spec_entry(batch), _sharding.spec_entry(head)
  rows, per_example, per_head = P(b, None, h), P(b), P(h)
  put = _sharding.reshard_to
  # Manual over every mesh axis (replicated over those the inputs do not use): a Pallas kernel
  # lowers only where no axis is left for XLA to partition.
  fn = _sharding.per_device(
    attend,
    (rows, rows, rows, None if sinks is None else per_head, (per_example,) * 4),
    (rows, rows),
  )
  return fn(
    put(query, rows),
    put(key, rows),
    put(value, rows),
    put(sinks, per_head),
    tuple(put(x, per_example) for x in ids),
  )


@dataclasses.dataclass(frozen=True)
class Setup:
  """What one call's splash kernels are built from when it is traced: the head masks ``heads``
  (one `HeadMask` that every query head shares, or one per query head), the logit ``scale``
  (folded into the query: splash does not scale), the logit ``soft_cap`` (or None) and the block
  sizes ``bq`` and ``bk`` (multiples of 128)."""

  heads: list[HeadMask]
  scale: float
  soft_cap: float | None
  bq: int
  bk: int


def _attend(setup: Setup, query, key, value, sinks, ids):
  """`splash_attention` on the examples and heads at hand (one device's under ``shard``), with
  the kernels of ``setup``, the segment ids and the rows and columns that the lengths keep
  (``ids``, (B, Tp) and (B, Sp))."""
  heads, scale, soft_cap, bq, bk = setup.heads, setup.scale, setup.soft_cap, setup.bq, setup.bk
  B, T, N, H = query.shape
  _, S, K, _ = key.shape
  G = N // K
  q_ids, kv_ids, q_ok, kv_ok = ids
  Tp, Sp = q_ids.shape[1], kv_ids.shape[1]
  # One group of G head masks when every head shares one, else each key/value head its own.
  groups = (
    [(heads[0],) * G] if len(heads) == 1 else [tuple(heads[g * G : (g + 1) * G]) for g in range(K)]
  )

  # Splash multiplies every key and value of a block it visits (a hidden one by a weight of 0),
  # so inf or NaN at a position hidden from every query (padding, past a length, an empty
  # document, a column or row the mask hides) would reach the output and gradients as 0 * NaN:
  # such positions are zeroed first, as jattn's tiles do.
  per_head = heads * N if len(heads) == 1 else heads
  rows = np.stack([h.rows for h in per_head], axis=-1)  # (Tp, N)
  cols = np.stack(
    [np.any([h.cols for h in per_head[g * G : (g + 1) * G]], axis=0) for g in range(K)], axis=-1
  )  # (Sp, K)
  q_keep = q_ok[:, :, None] & jnp.asarray(rows)[None]
  kv_keep = kv_ok[:, :, None] & jnp.asarray(cols)[None]

  # Splash's layout: (B, K, G, Tp, H) queries (scaled: splash does not scale), (B, K, Sp, H).
  q = (query.astype(jnp.float32) * scale).astype(query.dtype)
  q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
  q = jnp.where(q_keep[..., None], q, jnp.zeros((), q.dtype))
  q = jnp.transpose(q.reshape(B, Tp, K, G, H), (0, 2, 3, 1, 4))
  pad_kv = lambda x: jnp.where(
    kv_keep[..., None], jnp.pad(x, ((0, 0), (0, Sp - S), (0, 0), (0, 0))), jnp.zeros((), x.dtype)
  )
  k = jnp.transpose(pad_kv(key), (0, 2, 1, 3))
  v = jnp.transpose(pad_kv(value), (0, 2, 1, 3))
  snk = None if sinks is None else sinks.astype(jnp.float32).reshape(K, G)

  out, lse = foreign.zero_empty_rows(
    _kernels(groups, bq, bk, soft_cap, True),
    lambda *a: _kernels(groups, bq, bk, soft_cap, False)(*a)[0],
    _pure(groups, soft_cap),
    _empty_rows,
    _pure(groups, soft_cap, lse=True),
    (q, k, v, snk),
    (q_ids, kv_ids),
    int32=True,  # Mosaic: no int64 in the kernels' index arithmetic under jax_enable_x64
  )
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, Tp, N, -1)[:, :T]
  lse = jnp.transpose(lse.reshape(B, K, G, Tp), (0, 3, 1, 2)).reshape(B, Tp, N)[:, :T]
  return out, lse


def _pure(groups, soft_cap, lse: bool = False):
  """What the kernels compute, in plain JAX with (T, S) scores: the derivative of splash's
  backward (a gradient of a gradient), which its kernels do not have (see `foreign`); with
  ``lse``, the log-sum-exp (B, K, G, Tp) instead of the output (its gradient, for a caller
  that uses the lse)."""

  def run(q, k, v, sinks, q_ids, kv_ids):
    masks = jnp.asarray(np.stack([np.stack([h.dense() for h in g]) for g in groups]))
    s = jnp.einsum("bkgth,bksh->bkgts", q.astype(jnp.float32), k.astype(jnp.float32))
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    vis = masks[None] & (q_ids[:, None, None, :, None] == kv_ids[:, None, None, None, :])
    s = jnp.where(vis, s, NEG)
    p, l, m = _softmax.exp_rows(s, None if sinks is None else sinks[None, :, :, None])
    if lse:
      return _softmax.lse(m, l)
    out = _softmax.normalize(jnp.einsum("bkgts,bksh->bkgth", p, v.astype(jnp.float32)), l, m, 0.0)
    return out.astype(q.dtype)

  return run


def _empty_rows(lse):
  """Rows with nothing to attend to: splash leaves their log-sum-exp at its mask value (plus
  the log of the hidden keys it visited) or at -inf when it skipped all their blocks (a NaN
  log-sum-exp, from a NaN at a visible position, is not empty: it propagates)."""
  kernel_lib, _ = splash_modules()
  return lse < kernel_lib.DEFAULT_MASK_VALUE / 2
