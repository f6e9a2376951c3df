"""The public attention functions: `dot_product_attention`, its arguments bound once
(`jattn._call`), then dispatched; and `merge_attention`, which merges results over disjoint key
sets by their log-sum-exp.

Shape vocabulary (as in `jax.nn.dot_product_attention`):
  B batch, T query length, S key/value length, N query heads, K key/value heads,
  H head dimension, G = N // K query heads per key/value head.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jattn import _call, _dispatch, _sharding, _softmax, _tile, _validation
from jattn import masks as _masks
from jattn._backends import dense as _dense
from jattn._types import ArrayLike, Implementation, IsCausal, LocalWindowSize, Schedule


def dot_product_attention(
  query: ArrayLike,
  key: ArrayLike,
  value: ArrayLike,
  bias: ArrayLike | None = None,
  mask: ArrayLike | _masks.Mask | None = None,
  *,
  scale: float | ArrayLike | None = None,
  is_causal: IsCausal = False,
  query_seq_lengths: ArrayLike | None = None,
  key_value_seq_lengths: ArrayLike | None = None,
  local_window_size: LocalWindowSize | None = None,
  q_segment_ids: ArrayLike | None = None,
  kv_segment_ids: ArrayLike | None = None,
  logits_soft_cap: float | None = None,
  dropout_rate: float = 0.0,
  dropout_rng: ArrayLike | None = None,
  dropout_broadcast: bool = False,
  implementation: Implementation | Sequence[Implementation] | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
  schedule: Schedule | None = None,
  step_width: int | None = None,
  return_residual: bool = False,
  score_mod: Callable | None = None,
  sinks: ArrayLike | None = None,
  q_positions: ArrayLike | None = None,
  kv_positions: ArrayLike | None = None,
  return_max_logits: bool = False,
):
  r"""Scaled dot-product attention, numerically stable, dense or chunked.

  Computes, for each head, ``softmax(mask(score_mod(cap(Q K^T * scale) + bias))) V``:
  logits and softmax statistics in float32 (for 16-bit inputs), the output in the input dtype.
  Arguments shared with :func:`jax.nn.dot_product_attention` mean exactly what they mean there.

  Args:
    query: (B, T, N, H) or (T, N, H).
    key: (B, S, K, H) or (S, K, H); K must divide N (K < N is GQA, K = 1 is MQA).
    value: same shape as ``key``.
    bias: additive float bias of rank <= 4, broadcastable to (B, N, T, S) (each dim 1 or full).
      In the chunked implementation a full (B, N, T, S) bias is read block by block but still
      costs its own O(T x S) memory.
    mask: boolean array of rank <= 4 broadcastable to (B, N, T, S), True = attend; or a
      :mod:`jattn.masks` object (``masks.causal() & masks.local_window(128)`` ...).
    scale: logit scale; default ``1 / sqrt(H)``. A Python or NumPy number is a compile-time
      constant applied to the float32 logits; a jax array scalar (e.g. traced under ``jit``, or
      a learned temperature) is an operand that multiplies the query in its dtype and receives
      a gradient.
    is_causal: ``False``, ``True`` / ``"top_left"`` (query i sees keys <= i, as jax.nn), or
      ``"bottom_right"`` (query i sees keys <= i + S - T: the last query aligns with the last
      key, as when decoding with a KV cache or prefilling in chunks). The alignment also sets
      the diagonal that ``local_window_size`` is measured from.
    query_seq_lengths: int (B,) valid query lengths, >= 0; rows at and past it output 0. A
      length above T means all T rows (jax.nn's reading); a known negative one raises.
    key_value_seq_lengths: int (B,) valid key/value lengths, >= 0 (above S: all S keys).
    local_window_size: ``w`` or ``(left, right)``: query i sees keys in [i - left, i + right]
      (relative to the causal diagonal when ``is_causal="bottom_right"``).
    q_segment_ids: int (B, T) packed-document ids; a query sees only keys with an equal id.
    kv_segment_ids: int (B, S); required together with ``q_segment_ids``.
    logits_soft_cap: ``cap > 0``: logits become ``cap * tanh(logits / cap)`` (before bias).
    dropout_rate: in [0, 1): drop attention weights, scale the kept ones by 1 / (1 - rate).
      Which weights drop is a pure function of (dropout_rng, b, n, t, s), identical for every
      implementation and block size.
    dropout_rng: a PRNG key, required when ``dropout_rate > 0``.
    dropout_broadcast: share one (T, S) dropout mask across batch and heads (the mask of batch
      0, head 0), as flax's ``broadcast_dropout=True``.
    implementation: jattn's own ``"dense"`` (alias ``"xla"``) or ``"chunked"``; ``"splash"``
      (JAX's Pallas TPU kernel; on a CPU only under Pallas's TPU interpret mode); ``"cudnn"``
      (jax.nn's cuDNN kernel, 16-bit inputs on an NVIDIA GPU); a sequence of these, tried in
      order, skipping one that cannot take the call (NotImplementedError) and one that lowers
      for another platform than the program's; or ``None``: dense or chunked by problem size
      and platform, on a TPU splash first for long calls where the program cannot be
      partitioned (see the README). Every path keeps jattn's semantics (empty rows 0, float32
      statistics).
    block_q, block_kv: chunked block sizes (default 512 and 256; 256 and 256 under a
      ``local_window_size`` at most 1024 keys wide; clipped to T and S); splash's
      (multiples of 128, default 512).
    schedule: how the chunked kernels walk their blocks: ``"serial"`` (one tile per step, the
      CPU's default), ``"parallel"`` (every lane's next block per step, block lists instead of
      branches: the GPU's and TPU's default), or ``None`` (the platform's default, chosen where
      the program is lowered). Same results either way.
    step_width: the parallel schedule's lanes per step (default: as many as fit 256 MiB of
      (B, N, block_q, block_kv) float32 tiles, four per lane); more lanes run group after
      group, so this bounds a step's memory.
    return_residual: also return the log-sum-exp of each row, shaped (B, T, N) (or (T, N)) like
      jax.nn's. Unlike jax.nn's it carries its gradient (d lse / d logits = the softmax), so a
      `merge_attention` of parts differentiates exactly. A row with nothing to attend to has a
      large negative value (and no gradient).
    score_mod: ``f(score, batch, head, q_index, kv_index) -> score`` on the fp32 logits after
      bias, before masking; ``score`` is (B, N, tq, tk) and the indices broadcast to it. Arrays it
      closes over receive gradients. Define it once: a new function object recompiles.
    sinks: optional float (N,) per-head sink logits that join every row's softmax denominator and
      take no value (attention sinks); they receive gradients.
    q_positions, kv_positions: int (B, T) and (B, S) (or (T,), (S,) unbatched), given together:
      ``is_causal`` and ``local_window_size`` are then measured in these positions instead of
      array indices (either alignment: key visible iff its position <= the query's) -- a cache
      with padding inside, packed sequences whose positions restart. Blocks are skipped from
      each block's range of positions (`jattn.masks.positions`). Padding still needs its own
      mask (lengths, segment ids).
    return_max_logits: also return each row's max logit over the keys it sees, (B, T, N) (or
      (T, N)) float32 (float64 for float64 inputs): the logits the softmax takes, after scale,
      soft cap, bias and score_mod, before dropout (QK-Clip / MuonClip). It is the running max
      of the same pass, not another walk over the keys. A sink is not a key: it is left out. A
      row that sees no key gets -inf. No gradient flows through it. Only "dense" and "chunked"
      return it: a fused kernel named alone raises NotImplementedError; a sequence or ``None``
      skips them.

  Returns:
    The output, shaped like ``query`` (value has key's shape), in the query dtype; with
    ``return_residual`` or ``return_max_logits`` a tuple: the output, then the lse (if
    ``return_residual``), then the max logits (if ``return_max_logits``). Empty sizes give
    jax.nn's answer: B, N, T = 0 an empty output; S = 0 (no keys) every row's empty-row 0.

  Differences from jax.nn: a query row with nothing to attend to returns 0 (jax.nn returns the
  mean of V); its gradients are 0; masked positions never contribute inf or NaN.
  """
  opts, scale_operand = _call.options(
    _call.Keywords(
      scale=scale,
      is_causal=is_causal,
      local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap,
      dropout_rate=dropout_rate,
      dropout_rng=dropout_rng,
      dropout_broadcast=dropout_broadcast,
      implementation=implementation,
      block_q=block_q,
      block_kv=block_kv,
      schedule=schedule,
      step_width=step_width,
      return_residual=return_residual,
      score_mod=score_mod,
      return_max_logits=return_max_logits,
    )
  )
  if opts.dropout_rate == 0.0:
    dropout_rng = None
  given = _call.Given(
    query,
    key,
    value,
    bias,
    _call.static_mask(mask, opts),
    query_seq_lengths,
    key_value_seq_lengths,
    q_segment_ids,
    kv_segment_ids,
    dropout_rng,
    sinks,
    scale_operand,
    q_positions,
    kv_positions,
  )
  return _attention(given.passable(), opts=opts)


@functools.partial(jax.jit, static_argnames=("opts",))
def _attention(given: _call.Given, *, opts: _call.Options):
  with _call.inputs_mesh(given):
    call = _call.bind(given, opts, empty_sequences=True)
    out, lse, mx = _dispatch.run(call)  # (B, T, N, Hv), (B, T, N), (B, T, N) or None
  if call.static.unbatched:
    out, lse, mx = out[0], lse[0], None if mx is None else mx[0]
  if not (opts.return_residual or opts.return_max_logits):
    return out
  res: tuple = (out,)
  if opts.return_residual:
    res += (_softmax.returned_lse(lse, call.static.dtype),)
  return res + ((mx,) if opts.return_max_logits else ())


_NOT_FOR_WEIGHTS = (
  "dropout_rate",
  "dropout_rng",
  "dropout_broadcast",
  "return_residual",
  "return_max_logits",
  "implementation",
  "block_q",
  "block_kv",
  "schedule",
  "step_width",
)


def attention_weights(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  scale=None,
  is_causal=False,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  q_segment_ids=None,
  kv_segment_ids=None,
  logits_soft_cap=None,
  score_mod=None,
  sinks=None,
  q_positions=None,
  kv_positions=None,
  **ignored,
):
  """The (B, N, T, S) softmax weights (float32 for 16-bit inputs) that
  :func:`dot_product_attention` with the same arguments applies to ``value``, before dropout.

  Rows with nothing to attend to are 0. O(T x S) memory by nature: for inspecting weights
  (flax's ``sow_weights``), not for computing attention. ``value`` is checked against the others
  but not used; dropout, ``return_residual`` and the choice of implementation do not apply (the
  keywords are accepted and ignored).
  """
  for name in ignored:
    if name not in _NOT_FOR_WEIGHTS:
      raise TypeError(f"attention_weights() got an unexpected keyword argument {name!r}")
  opts, scale_operand = _call.options(
    _call.Keywords(
      scale=scale,
      is_causal=is_causal,
      local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap,
      implementation="dense",
      score_mod=score_mod,
    )
  )
  given = _call.Given(
    query,
    key,
    value,
    bias,
    mask,
    query_seq_lengths,
    key_value_seq_lengths,
    q_segment_ids,
    kv_segment_ids,
    sinks=sinks,
    scale_operand=scale_operand,
    q_positions=q_positions,
    kv_positions=kv_positions,
  )
  return _weights(given.passable(), opts=opts)


@functools.partial(jax.jit, static_argnames=("opts",))
def _weights(given: _call.Given, *, opts: _call.Options):
  call = _call.bind(given, opts, empty_sequences=True)
  w = _dense.weights(call)
  return w[0] if call.static.unbatched else w


# --------------------------------------------------------------------------------------------
# The attention each key receives.
# --------------------------------------------------------------------------------------------
#
# The attention each key receives: per query head, the sum over queries of the key's softmax
# weight, for KV-cache eviction (H2O, SnapKV, TOVA) and token pruning.
#
#     received[b, s, n] = sum_t P[b, n, t, s],   P = softmax(scale * q.k + bias, masked)
#
# Why it is a gradient: with values of one feature, all ones, the output is out = P @ 1, and the
# derivative of sum(out) with respect to that value is P^T @ 1, the column sums. The backward of
# `jattn.dot_product_attention` computes it: dense from its (T, S) matrix; chunked key block by key
# block from the forward's log-sum-exp, never holding the (T, S) matrix (O(T + S) memory). The keys
# are repeated per query head first, so that a grouped head's column sums are not added together
# over its group.
#
# Cost: one forward and one backward (the queries' and keys' gradients are computed too and
# discarded), in float32 whatever the inputs' dtype, so that the sums come out in float32.


def attention_received(
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
  q_positions: ArrayLike | None = None,
  kv_positions: ArrayLike | None = None,
  implementation: Implementation | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
) -> jax.Array:
  """(B, S, N) float32: for each key and query head, the sum over the queries of the key's
  softmax weight in the attention `jattn.dot_product_attention` computes with these arguments
  (no dropout). Unbatched (T, N, H) / (S, K, H) inputs give (S, N).

  Args:
    query: (B, T, N, H) or unbatched (T, N, H).
    key: (B, S, K, H) or (S, K, H), N a multiple of K (GQA: each query head's own sums).
    bias, mask, and the keywords: as in `jattn.dot_product_attention`. A query that sees no
      key adds nothing; with ``sinks`` the sink's share is no key's.
    implementation: None, "dense" (the (T, S) weights) or "chunked" (O(T + S) memory), or any
      name of dot_product_attention with a backward.

  Each query row's weights sum to 1 (less the sink's share), so the result summed over keys is
  the number of queries that see a key.
  """
  qa = _validation.float_array("query", query)
  ka = _validation.float_array("key", key)
  if ka.ndim != qa.ndim or qa.ndim not in (3, 4):
    raise ValueError(
      f"query and key must be (B, T, N, H) and (B, S, K, H) (or both unbatched), got "
      f"query.shape={qa.shape}, key.shape={ka.shape}"
    )
  N, K = qa.shape[-2], ka.shape[-2]
  if K == 0 or N % K:
    raise ValueError(f"the query heads N={N} must be a multiple of the key/value heads K={K}")
  # Float32 throughout: the sums are returned in float32, and dot_product_attention returns its
  # value gradient in the value's dtype.
  q = qa.astype(jnp.float32)
  k = ka.astype(jnp.float32)
  if N != K:
    # (B, S, N, H): head n sees n // G. Head-sharded keys stay sharded on the head axis (an
    # Explicit mesh makes the sharding part of the type, and repeat must be told).
    spec = _sharding.spec_of(k) if _sharding.explicit_mesh() else None
    k = jnp.repeat(k, N // K, axis=-2, out_sharding=spec)
  # Typed like the keys: under an Explicit mesh the values' sharding is the kernels' carry's.
  ones = jnp.ones_like(k[..., :1])

  def total(v):
    out = dot_product_attention(
      q,
      k,
      v,
      None if bias is None else _validation.float_array("bias", bias).astype(jnp.float32),
      mask,
      scale=scale,
      is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size,
      q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids,
      logits_soft_cap=logits_soft_cap,
      score_mod=score_mod,
      sinks=sinks,
      q_positions=q_positions,
      kv_positions=kv_positions,
      implementation=implementation,
      block_q=block_q,
      block_kv=block_kv,
    )
    return out.sum()

  return jax.grad(total)(ones)[..., 0]


# merge_attention: attention over disjoint key sets merged into attention over their union, each
# part combined through its log-sum-exp (_softmax.merge_stacked): split-KV decoding, cascades
# (a shared prefix attended once, each suffix on its own), or any other partition of the keys.


def merge_attention(outs, lses):
  """Merge attention results over disjoint key sets into the result over their union.

  If ``out_i, lse_i`` is attention of the same queries over key set ``S_i`` (as returned by
  ``dot_product_attention(..., return_residual=True)``), the merged result is attention over the
  union of the ``S_i``: ``lse = log(sum_i exp(lse_i))`` and
  ``out = sum_i exp(lse_i - lse) * out_i``, computed with the max subtracted and in float32 (or
  wider). Split-KV decoding uses it to combine partial results over pieces of a KV cache.

  A row with nothing to attend to in one part (its lse very negative: -inf, or jattn's finite
  sentinel) gets weight 0 there; a row with nothing in any part returns out 0 and keeps its very
  negative lse, without NaN.

  Gradients: the log-sum-exp that ``dot_product_attention(..., return_residual=True)`` and
  `ring_attention` return carries its gradient, so a merge of such parts differentiates exactly
  (dQ, dK and dV of one call over the union of the keys).

  Args:
    outs: a sequence of n arrays (B, T, N, H) -- or any (..., H) -- or one stacked (n, ..., H)
      array.
    lses: the matching log-sum-exps, a sequence of n arrays (B, T, N) or one (n, ...) array.

  Returns:
    (out, lse): out (B, T, N, H) in the dtype of ``outs``, lse (B, T, N) in the dtype of ``lses``.
  """
  outs = _stack("outs", outs)
  lses = _stack("lses", lses)
  for name, x in (("outs", outs), ("lses", lses)):
    _validation.float_array(name, x)
  if outs.ndim < 2 or lses.shape != outs.shape[:-1]:
    raise ValueError(
      f"lses must have the shape of outs without its last (H) axis: stacked "
      f"outs.shape={outs.shape}, lses.shape={lses.shape}"
    )
  if outs.shape[0] == 0:
    raise ValueError("merge_attention needs at least one partial result, got 0")
  return _merge(outs, lses)


@jax.jit
def _merge(outs, lses):
  sd = _tile.stat_dtype(jnp.promote_types(outs.dtype, lses.dtype))
  out, lse = _softmax.merge_stacked(outs, lses, sd)
  return out.astype(outs.dtype), lse.astype(lses.dtype)


def _stack(name, xs):
  if isinstance(xs, (list, tuple)):
    if not xs:
      raise ValueError(f"{name} must hold at least one partial result, got an empty sequence")
    xs = [jnp.asarray(x) for x in xs]
    if len({x.dtype for x in xs}) > 1:
      raise TypeError(f"all {name} must share one dtype, got {[str(x.dtype) for x in xs]}")
    if len({x.shape for x in xs}) > 1:
      raise ValueError(f"all {name} must share one shape, got {[x.shape for x in xs]}")
    return jnp.stack(xs)
  return jnp.asarray(xs)
