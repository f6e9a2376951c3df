"""Numerical-stability diagnostics of attention: is the softmax saturated, overflowing, empty?

`attention_stats` computes, per head (or per query), the statistics of the softmax that
`jattn.dot_product_attention` would take, without computing the attention output:

  max_logit, min_logit  extremes of the logits that enter the softmax, over visible keys only
  max_prob              the largest attention weight of a row
  entropy               of the attention distribution, in nats
  entropy_fraction      entropy / log(number of candidates): 1 = uniform, 0 = one-hot
  saturated_fraction    share of rows whose largest weight exceeds a threshold (default 0.99)
  masked_rows           rows with no visible key (jattn returns 0 for them)
  overflow              the naive softmax exp(x) / sum(exp(x)) in the input dtype would overflow

It takes the masking arguments of `jattn.dot_product_attention` and runs dense (one (T, S) tile)
or chunked (an online pass over key blocks that keeps, per row, the running max, the running sum
of exp and the running sum of exp * logit, so no (T, S) matrix exists). The entropy comes from
those running sums: H = lse - sum_i p_i s_i.

`sow_linen` / `sow_nnx` store the statistics from inside a Flax module (see docs/diagnostics.md).

Shapes: B batch, T query length, S key/value length, N query heads, K key/value heads,
H head dimension, G = N // K.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _call, _chunked, _dispatch, _tile, _validation
from jattn import masks as _masks
from jattn._chunked import plan as _plan
from jattn._chunked.plan import Operands
from jattn._tile import Config
from jattn._types import ArrayLike, Implementation, IsCausal, LocalWindowSize

__all__ = ["COLLECTION_NAME", "AttentionStats", "attention_stats", "sow_linen", "sow_nnx"]

# The name under which the Flax helpers store the statistics.
COLLECTION_NAME = "attention_stats"


class AttentionStats(NamedTuple):
  """Softmax statistics of one attention call (a pytree of arrays).

  Per head (``per_query=False``) every field is (B, N); per query (``per_query=True``) it is
  (B, N, T). Without a batch dimension in the query the leading B is dropped. Float fields are in
  the statistics dtype (float32 for 16-bit inputs).

  A "candidate" of a row is a visible key, plus the sink when ``sinks`` is given. Per head, the
  logit extremes run over all visible positions of the head; ``max_prob``, ``entropy``,
  ``entropy_fraction`` and ``saturated_fraction`` are means over the rows with at least two
  candidates (a row with a single candidate has no choice to make: weight 1, entropy 0, and it is
  not a sign of trouble, e.g. the first row of causal attention); they are 0 where no row
  qualifies. Per query, a row without visible keys reports 0 in every float field.

  Fields:
    max_logit: largest visible logit (after scale, soft-cap, bias and score_mod).
    min_logit: smallest visible logit.
    max_prob: largest attention weight on a key, exp(max_logit - lse).
    entropy: -sum p log p in nats (the sink's weight included when there is one).
    entropy_fraction: entropy / log(number of candidates of the row), in [0, 1].
    saturated_fraction: share of rows with max_prob > the saturation threshold (per query: 0/1).
    masked_rows: int32 number of rows with no visible key (per query: 0/1). Rows past
      ``query_seq_lengths`` count here.
    overflow: bool, the log-sum-exp of some row exceeds log(finfo(query.dtype).max): without
      the max trick, exp of a logit or the sum of the exps is inf in the input dtype, and the
      naive softmax returns NaN (inf / inf) or all-zero weights (finite / inf).
  """

  max_logit: Any
  min_logit: Any
  max_prob: Any
  entropy: Any
  entropy_fraction: Any
  saturated_fraction: Any
  masked_rows: Any
  overflow: Any


@dataclasses.dataclass(frozen=True, slots=True)
class _Options:
  """The call's options (those of `jattn.dot_product_attention` it shares) and the statistics'
  own."""

  call: _call.Options
  per_query: bool
  saturation_threshold: float


def attention_stats(
  query: ArrayLike,
  key: ArrayLike,
  bias: ArrayLike | None = None,
  mask: ArrayLike | _masks.Mask | None = None,
  *,
  scale: float | None = None,
  is_causal: IsCausal = False,
  query_seq_lengths: ArrayLike | None = None,
  key_value_seq_lengths: ArrayLike | None = None,
  local_window_size: LocalWindowSize | None = None,
  q_segment_ids: ArrayLike | None = None,
  kv_segment_ids: ArrayLike | None = None,
  logits_soft_cap: float | None = None,
  score_mod: Callable | None = None,
  sinks: ArrayLike | None = None,
  implementation: Implementation | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
  per_query: bool = False,
  saturation_threshold: float = 0.99,
  q_positions: ArrayLike | None = None,
  kv_positions: ArrayLike | None = None,
) -> AttentionStats:
  """Softmax statistics of the attention that `jattn.dot_product_attention` would compute.

  Args:
    query: (B, T, N, H) or (T, N, H).
    key: (B, S, K, H) or (S, K, H); K must divide N.
    bias, mask, scale, is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size,
      q_segment_ids, kv_segment_ids, logits_soft_cap, score_mod, sinks: exactly as in
      `jattn.dot_product_attention` (dropout does not change the softmax, so it is not taken).
      A bias of -inf hides a position like the mask does; any finite bias counts as a logit.
    implementation: ``None`` (dense below ~1M scores per head, else chunked, and chunked for a
      few queries against a long cache: the CPU's rule of `jattn.dot_product_attention`, on
      every platform), ``"dense"`` or ``"chunked"`` (no (T, S) array; memory
      O(B N block_q block_kv)); in a sequence, the first of these two (fused kernels such as
      ``"splash"`` do not expose their logits).
    block_q, block_kv: chunked block sizes (default 512 and 256; 256 and 256 under a
      ``local_window_size`` at most 1024 keys wide; clipped to T and S).
    per_query: return (B, N, T) per-query statistics instead of (B, N) per head.
    saturation_threshold: in (0, 1]; a row is saturated when max_prob > it.
    q_positions, kv_positions: int (B, T) and (B, S) (or (T,), (S,) unbatched), given together:
      ``is_causal`` and ``local_window_size`` are then measured in these positions instead of
      array indices (either alignment: key visible iff its position <= the query's) -- a cache
      with padding inside, packed sequences whose positions restart. Blocks are skipped from
      each block's range of positions (`jattn.masks.positions`). Padding still needs its own
      mask (lengths, segment ids).

  Returns:
    An `AttentionStats` of (B, N) arrays, or (B, N, T) with ``per_query=True``.
  """
  saturation_threshold = _validation.real(
    "saturation_threshold", saturation_threshold, above=0, at_most=1
  )
  call, _ = _call.options(
    _call.Keywords(
      scale=_validation.scale(scale),
      is_causal=is_causal,
      local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap,
      implementation=_own_implementation(_validation.implementation(implementation)),
      block_q=block_q,
      block_kv=block_kv,
      score_mod=score_mod,
    ),
    tuned=False,
  )  # the statistics do not depend on block sizes
  opts = _Options(
    call=call,
    per_query=_validation.flag("per_query", per_query),
    saturation_threshold=float(saturation_threshold),
  )
  # The value is not needed; passing the key in its place reuses every shape check.
  given = _call.Given(
    query,
    key,
    key,
    bias,
    mask,
    query_seq_lengths,
    key_value_seq_lengths,
    q_segment_ids,
    kv_segment_ids,
    sinks=sinks,
    q_positions=q_positions,
    kv_positions=kv_positions,
  )
  return _stats(given.passable(), opts=opts)


def _own_implementation(impl):
  """The statistics read the logits, which only jattn's own kernels expose: the first of dense
  and chunked that ``impl`` names (None: the automatic choice), else NotImplementedError."""
  if impl is None:
    return None
  for name in _validation.implementation_names(impl):
    if name in ("dense", "chunked"):
      return name
  raise NotImplementedError(
    f"diagnostics computes its statistics with jattn's dense or chunked kernels; "
    f"implementation={impl!r} names only fused kernels, whose logits it cannot read"
  )


@functools.partial(jax.jit, static_argnames=("opts",))
def _stats(given: _call.Given, *, opts: _Options):
  call = _call.bind(given, opts.call)
  s = call.static
  B, T, N, H, S, K, G = s.B, s.T, s.N, s.H, s.S, s.K, s.G
  query, key, combined, bias5, sink = call.query, call.key, call.mask, call.bias, call.sink
  sd = s.stat_dtype
  impl = opts.call.implementation or _dispatch.choose_implementation(
    T, S, G, query.dtype, combined, (B, N, T, S)
  )
  bq, bk = (T, S) if impl == "dense" else s.block_sizes()
  cfg, score_args = s.config((B, N, bq, bk))

  if impl == "dense":
    q = jnp.transpose(query, (0, 2, 1, 3)).reshape(B, K, G, T, H)
    k = jnp.transpose(key, (0, 2, 1, 3))
    idx = _tile.Index(jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32))
    vis = _tile.visible(cfg, combined, idx.q, idx.kv, ragged_kv=False)
    rows = _update_rows(cfg, _init_rows(cfg, sd, T, sink), q, k, vis, bias5, idx, score_args)
  else:
    plan, states = _plan.make_plan(cfg, combined, bq, bk)
    ops = Operands(
      q=query,
      k=key,
      v=key,
      bias=bias5,
      mask=combined,
      states=states,
      score_args=score_args,
      sink=sink,
    )
    rows = _chunked_rows(plan, ops)

  out = _finish(rows, sink is not None, float(jnp.finfo(query.dtype).max), opts)
  # (B, K, G, T) -> (B, N, T); per head: (B, N).
  out = AttentionStats(*(x.reshape((B, N, T) if opts.per_query else (B, N)) for x in out))
  if s.unbatched:
    out = AttentionStats(*(x[0] for x in out))
  return out


# --------------------------------------------------------------------------------------------
# Per-row running statistics, updated one (query-block, key-block) tile at a time.
# --------------------------------------------------------------------------------------------


class _Rows(NamedTuple):
  """Running per-row state, each (B, K, G, tq)."""

  m: Any  # running max of the softmax candidates (the sink included): the shift of the sums
  l: Any  # sum of exp(s - m) over candidates
  w: Any  # sum of exp(s - m) * (s - m): gives the entropy, H = log(l) - w / l
  hi: Any  # max visible logit
  lo: Any  # min visible logit
  n: Any  # number of visible keys (int32)


def _init_rows(cfg: Config, sd, tq: int, sink) -> _Rows:
  shape = (cfg.B, cfg.K, cfg.G, tq)
  neg = jnp.full(shape, _tile.NEG, sd)
  if sink is None:
    m, l = neg, jnp.zeros(shape, sd)
  else:
    # The sink is one more candidate: it starts the max and adds exp(sink - m) = 1 to the sum.
    m, l = jnp.broadcast_to(sink, shape), jnp.ones(shape, sd)
  return _Rows(
    m=m,
    l=l,
    w=jnp.zeros(shape, sd),
    hi=neg,
    lo=jnp.full(shape, -_tile.NEG, sd),
    n=jnp.zeros(shape, jnp.int32),
  )


def _update_rows(cfg: Config, rows: _Rows, q, k, vis, bias, idx, score_args) -> _Rows:
  """Fold a tile -- q (B, K, G, tq, H) against k (B, K, tk, H), visibility ``vis`` (None: all
  visible) -- into the running row statistics."""
  s, _ = _tile.logits(cfg, q, k, bias, idx, score_args)  # (B, K, G, tq, tk)
  sd = s.dtype
  # A -inf logit (from a -inf bias) is a hidden position, as in the attention kernels; NaN
  # logits stay visible so that they show up in the statistics.
  finite = s != -jnp.inf
  vis = finite if vis is None else vis & finite
  zero = jnp.zeros((), sd)
  s_hi = jnp.where(vis, s, jnp.asarray(_tile.NEG, sd))
  s_lo = jnp.where(vis, s, jnp.asarray(-_tile.NEG, sd))
  m_new = jnp.maximum(rows.m, s_hi.max(axis=-1))
  d = jnp.where(vis, s - m_new[..., None], zero)  # <= 0 on visible keys
  e = jnp.where(vis, jnp.exp(d), zero)
  corr = jnp.exp(rows.m - m_new)
  # Shifting the reference from m to m_new: exp(s - m_new) (s - m_new)
  #   = corr * exp(s - m) * ((s - m) + (m - m_new)).
  w = corr * (rows.w + rows.l * (rows.m - m_new)) + (e * d).sum(axis=-1)
  l = rows.l * corr + e.sum(axis=-1)
  return _Rows(
    m=m_new,
    l=l,
    w=w,
    hi=jnp.maximum(rows.hi, s_hi.max(axis=-1)),
    lo=jnp.minimum(rows.lo, s_lo.min(axis=-1)),
    n=rows.n + vis.sum(axis=-1, dtype=jnp.int32),
  )


def _chunked_rows(plan, ops: Operands) -> _Rows:
  """The online pass, on the attention kernel's own walk (`_chunked.walk_rows`): the same block
  skipping, loop ranges and per-block slicing of the (B, T, N, H) inputs; only what a tile
  computes differs. Returns the per-row statistics, each (B, K, G, T)."""
  cfg = plan.cfg
  bq, bk = plan.grid.block_q, plan.grid.block_kv
  q, k, _, bias = _plan.pad_to_blocks(plan, ops.q, ops.k, ops.k, ops.bias)
  ops = ops._replace(q=q, k=k, v=k, bias=bias)
  sd = _tile.stat_dtype(q.dtype)

  def start(i):
    return _chunked.q_tile(q, i, bq, cfg.K, cfg.G), _init_rows(cfg, sd, bq, ops.sink)

  def tile(qb, view, rows):
    return _update_rows(
      cfg, rows, qb, _chunked.kv_tile(k, view.j, bk), view.vis, view.bias, view.idx, ops.score_args
    )

  def finish(i, rows):
    return _Rows(*rows)

  B, Tp, N = q.shape[:3]
  outs0 = _Rows(*(jnp.zeros((B, Tp, N), x.dtype) for x in _init_rows(cfg, sd, 1, ops.sink)))
  rows = _chunked.walk_rows(
    plan, ops, start=start, tile=tile, finish=finish, outs=outs0, name="stats"
  )
  # (B, Tp, N) -> (B, K, G, T), as the dense pass gives them.
  return _Rows(*(x[:, : cfg.T].transpose(0, 2, 1).reshape(B, cfg.K, cfg.G, cfg.T) for x in rows))


def _finish(rows: _Rows, has_sink: bool, dtype_max: float, opts: _Options) -> AttentionStats:
  """Per-row statistics from the running sums; reduced over rows unless opts.per_query."""
  sd = rows.l.dtype
  zero, one = jnp.zeros((), sd), jnp.ones((), sd)
  has_key = rows.n > 0
  candidates = rows.n + (1 if has_sink else 0)
  choice = candidates >= 2
  ok = rows.l > 0
  l = jnp.where(ok, rows.l, one)
  log_l = jnp.log(l)
  lse = rows.m + log_l
  entropy = jnp.where(ok, log_l - rows.w / l, zero)
  max_prob = jnp.where(has_key, jnp.exp(jnp.minimum(rows.hi - lse, zero)), zero)
  log_c = jnp.log(jnp.maximum(candidates, 2).astype(sd))
  frac = jnp.where(choice, entropy / log_c, zero)
  saturated = choice & (max_prob > jnp.asarray(opts.saturation_threshold, sd))
  overflow = ok & (lse > jnp.asarray(np.log(float(dtype_max)), sd))
  hi = jnp.where(has_key, rows.hi, zero)
  lo = jnp.where(has_key, rows.lo, zero)
  masked = (~has_key).astype(jnp.int32)

  if opts.per_query:
    return AttentionStats(hi, lo, max_prob, entropy, frac, saturated.astype(sd), masked, overflow)

  def mean(x):
    num = jnp.where(choice, x, zero).sum(axis=-1)
    cnt = choice.sum(axis=-1).astype(sd)
    return jnp.where(cnt > 0, num / jnp.maximum(cnt, one), zero)

  any_key = has_key.any(axis=-1)
  return AttentionStats(
    max_logit=jnp.where(any_key, jnp.where(has_key, rows.hi, -jnp.inf).max(axis=-1), zero),
    min_logit=jnp.where(any_key, jnp.where(has_key, rows.lo, jnp.inf).min(axis=-1), zero),
    max_prob=mean(max_prob),
    entropy=mean(entropy),
    entropy_fraction=mean(frac),
    saturated_fraction=mean(saturated.astype(sd)),
    masked_rows=masked.sum(axis=-1, dtype=jnp.int32),
    overflow=overflow.any(axis=-1),
  )


# --------------------------------------------------------------------------------------------
# Collecting the statistics from inside Flax modules.
# --------------------------------------------------------------------------------------------


def _resolve(stats):
  stats = stats() if callable(stats) else stats
  if not isinstance(stats, AttentionStats):
    raise TypeError(
      f"stats must be an AttentionStats or a function returning one, got {type(stats).__name__}"
    )
  return stats


def sow_linen(module, stats, name: str = COLLECTION_NAME) -> bool:
  """Store ``stats`` in a linen module's ``'intermediates'`` collection under ``name``.

  ``stats`` is an `AttentionStats` or a zero-argument function returning one; a function is only
  called when ``'intermediates'`` is mutable (``module.apply(..., mutable=['intermediates'])``),
  so nothing is computed otherwise. Repeated calls append (flax's default ``sow`` reduction):
  the collection holds a tuple of `AttentionStats`. Returns whether anything was stored.
  """
  if not module.is_mutable_collection("intermediates"):
    return False
  return module.sow("intermediates", name, _resolve(stats))


def sow_nnx(module, stats, name: str = COLLECTION_NAME) -> bool:
  """Store ``stats`` on an nnx module as an ``nnx.Intermediate`` named ``name``.

  ``stats`` as in `sow_linen`. Read them with ``nnx.capture(nnx.Intermediate)`` around the forward
  function (flax >= 0.12; older flax stores them on the module: ``nnx.pop(model,
  nnx.Intermediate)``). Values append into a tuple. Returns whether anything was stored.
  """
  from flax import nnx  # flax is a dependency, but only this helper needs nnx

  return module.sow(nnx.Intermediate, name, _resolve(stats))
