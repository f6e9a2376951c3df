"""The public attention function: validation, defaults, and the choice of implementation.

Shape vocabulary (as in `jax.nn.dot_product_attention`):
  B batch, T query length, S key/value length, N query heads, K key/value heads,
  H head dimension, G = N // K query heads per key/value head.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jattn import (_chunked, _cudnn, _dense, _dropout, _fused, _partition, _plan, _ring,
                   _sharding, _splash, _tile, _tuning, _validation)
from jattn._plan import Operands
from jattn import masks as _masks
from jattn._tile import Config
from jattn._types import (ArrayLike, Implementation, IsCausal, LocalWindowSize, Schedule,
                          concrete)


@dataclasses.dataclass(frozen=True, slots=True)
class _Options:
  """The static (hashable) options of one call; the jit cache key besides array shapes."""

  scale: float | None
  causal: str | None  # None | "top_left" | "bottom_right"
  window: tuple[int | None, int | None] | None
  logits_soft_cap: float | None
  dropout_rate: float
  dropout_broadcast: bool
  implementation: str | tuple[str, ...] | None
  block_q: int | None
  block_kv: int | None
  schedule: str | None
  step_width: int | None
  return_residual: bool
  score_mod: Callable | None
  # Return the (B, N, T, S) softmax weights instead of the output (for flax's sow_weights).
  return_weights: bool = False
  # The fused kernel a tuning table found fastest on this device for the call (implementation
  # None only): tried first on its platform.
  tuned_implementation: str | None = None
  # (block_q, block_kv) for splash: the caller's, else a tuning table's where they are
  # multiples of 128 (`jattn-bench tune` times splash with those), else splash's default.
  splash_blocks: tuple[int | None, int | None] = (None, None)


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
    _return_weights: bool = False,
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
    query_seq_lengths: int (B,) valid query lengths; rows past it output 0.
    key_value_seq_lengths: int (B,) valid key/value lengths.
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
    block_q, block_kv: chunked block sizes (default 512 and 256, clipped to T and S); splash's
      (multiples of 128, default 512).
    schedule: how the chunked kernels walk their blocks: ``"serial"`` (one tile per step, the
      CPU's default), ``"parallel"`` (every lane's next block per step, block lists instead of
      branches: the GPU's and TPU's default), or ``None`` (the platform's default, chosen where
      the program is lowered). Same results either way.
    step_width: the parallel schedule's lanes per step (default 64); a step holds one
      (block_q, block_kv) tile per lane, so this bounds its memory; more lanes run group after
      group.
    return_residual: also return the log-sum-exp of each row, shaped (B, T, N) (or (T, N)) like
      jax.nn's. Unlike jax.nn's it carries its gradient (d lse / d logits = the softmax), so a
      `merge_attention` of parts differentiates exactly. A row with nothing to attend to has a
      large negative value (and no gradient).
    score_mod: ``f(score, batch, head, q_index, kv_index) -> score`` on the fp32 logits after
      bias, before masking; ``score`` is (B, N, tq, tk) and the indices broadcast to it. Arrays it
      closes over receive gradients. Define it once: a new function object recompiles.
    sinks: optional float (N,) per-head sink logits that join every row's softmax denominator and
      take no value (attention sinks); they receive gradients.

  Returns:
    The output, shaped like ``query`` (value has key's shape), in the query dtype; with
    ``return_residual`` a tuple (output, lse).

  Differences from jax.nn: a query row with nothing to attend to returns 0 (jax.nn returns the
  mean of V); its gradients are 0; masked positions never contribute inf or NaN.
  """
  static_scale, scale_operand = _validation.scale_operand(scale)
  tuned_implementation = None
  splash_blocks = (_validation.block("block_q", block_q), _validation.block("block_kv", block_kv))
  if ((implementation is None or None in (block_q, block_kv, schedule, step_width))
      and implementation not in ("dense", "xla")):
    # A tuning table (jattn.tuning, $JATTN_TUNING) fills what the call leaves open.
    shape, kv_shape = jnp.shape(query), jnp.shape(key)
    if len(shape) in (3, 4) and len(kv_shape) == len(shape) and hasattr(query, "dtype"):
      masked = any(x is not None for x in (mask, query_seq_lengths, key_value_seq_lengths,
                                           q_segment_ids))
      kind = _tuning.mask_kind(_validation.causal(is_causal),
                               _validation.window(local_window_size), masked)
      tuned = _tuning.options_for(query.dtype, shape[-1], kind, shape[-3], kv_shape[-3])
      block_q = block_q if block_q is not None else tuned.get("block_q")
      block_kv = block_kv if block_kv is not None else tuned.get("block_kv")
      schedule = schedule if schedule is not None else tuned.get("schedule")
      step_width = step_width if step_width is not None else tuned.get("step_width")
      if implementation is None:
        tuned_implementation = tuned.get("implementation")
      splash_blocks = tuple(_splash.tuned_block(given, tuned.get(name))
                            for given, name in zip(splash_blocks, ("block_q", "block_kv")))
  opts = _Options(
      scale=static_scale,
      causal=_validation.causal(is_causal),
      window=_validation.window(local_window_size),
      logits_soft_cap=_validation.soft_cap(logits_soft_cap),
      dropout_rate=_validation.dropout(dropout_rate, dropout_rng),
      dropout_broadcast=_validation.flag("dropout_broadcast", dropout_broadcast),
      implementation=_validation.implementation(implementation),
      block_q=_validation.block("block_q", block_q),
      block_kv=_validation.block("block_kv", block_kv),
      schedule=_validation.one_of("schedule", schedule, _validation.SCHEDULES + (None,)),
      step_width=_validation.positive_int("step_width", step_width, optional=True),
      return_residual=_validation.flag("return_residual", return_residual),
      score_mod=_validation.callable_or_none("score_mod", score_mod),
      return_weights=bool(_return_weights),
      tuned_implementation=tuned_implementation,
      splash_blocks=splash_blocks,
  )
  if opts.dropout_rate == 0.0:
    dropout_rng = None
  if (isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.ndim <= 4
      and "splash" in _validation.implementation_names(opts.implementation)):
    # Splash builds its block lists from the mask when the call is traced: a NumPy boolean mask
    # asked to run there becomes part of the program instead of a run-time argument.
    mask = _masks.static_array(mask)
  return _attention(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                    q_segment_ids, kv_segment_ids, dropout_rng, sinks, scale_operand, opts=opts)


@functools.partial(jax.jit, static_argnames=("opts",))
def _attention(query, key, value, bias, mask, q_lengths, kv_lengths, q_seg, kv_seg, dropout_rng,
               sinks, scale_operand, *, opts: _Options):
  args = _validation.arrays(query, key, value, bias, mask, q_lengths, kv_lengths, q_seg, kv_seg,
                            sinks)
  args = _sharding.aligned_to_query(args)
  query, key, value = args.query, args.key, args.value
  seq_spec = None
  q_shards = kv_shards = None
  if _sharding.explicit_mesh():
    # Sequence-sharded inputs under an Explicit mesh: every query needs every key, so K and V
    # are gathered along S (as jax.nn's XLA path does); the query stays sharded (the chunked
    # kernels run per query shard: see sequence_sharded). With the query whole and K, V
    # sharded along S (a decoding step against a sharded cache), the chunked kernels instead run
    # per key/value shard and merge. Batch- and head-sharded inputs pass unchanged.
    seq_spec = _sharding.spec_of(query)
    q_shards = _sharding.sequence_shards(query)
    if q_shards is not None and not _sharding.sharded_only_over((query, key, value),
                                                                q_shards[0]):
      q_shards = None  # other axes in use too: the gather path (see sharded_only_over)
    if (q_shards is None and _sharding.spec_of(key) is not None
        and _sharding.spec_of(key) == _sharding.spec_of(value)):
      kv_shards = _sharding.sequence_shards(key)
      if kv_shards is not None and not _sharding.sharded_only_over((query, key, value),
                                                                   kv_shards[0]):
        kv_shards = None
    key, value = _sharding.unshard_axis(key, 1), _sharding.unshard_axis(value, 1)
  if scale_operand is not None:
    # A scale given as an array (traced under jit) is an operand, not a compile-time constant:
    # it scales the query (in its dtype, as splash attention folds its scale), q.k * s = (s q).k,
    # and autodiff through this product gives its gradient. The kernels then scale by 1.
    query = query * scale_operand.astype(query.dtype)
  B, T, N, H = query.shape
  _, S, K, Hv = value.shape
  G = N // K
  if scale_operand is not None:
    scale = 1.0
  else:
    scale = opts.scale if opts.scale is not None else _plan.default_scale(H)
  shape = (B, N, T, S)

  combined = _plan.build_mask(shape, args.mask, opts.causal, opts.window,
                              q_lengths=args.q_lengths, kv_lengths=args.kv_lengths,
                              q_segment_ids=args.q_seg, kv_segment_ids=args.kv_seg)

  bq, bk = _plan.block_sizes(T, S, opts.block_q, opts.block_kv)
  sd = _tile.stat_dtype(query.dtype)
  bias5 = None if args.bias is None else _tile.group_heads(args.bias, K, G)
  sink = None if args.sinks is None else args.sinks.astype(sd).reshape(1, K, G, 1)
  seed = (_dropout.seed_words(dropout_rng) if opts.dropout_rate > 0
          else jnp.zeros((2,), jnp.uint32))

  def config(tile_shape, T=T, S=S, replay=False, B=B, K=K):
    """The static config for tiles of ``tile_shape`` (score_mod's arrays are hoisted for it)
    over ``T`` query rows and ``S`` keys; ``replay``: score_mod to be called inside a
    shard_map."""
    score_mod, score_args = None, ()
    if opts.score_mod is not None:
      score_mod, score_args = _plan.closure_convert_score_mod(opts.score_mod, tile_shape, sd,
                                                              replay=replay)
      score_args = _sharding.replicated(score_args)
    cfg = Config(B=B, T=T, S=S, K=K, G=G, H=H, scale=scale,
                 logits_soft_cap=opts.logits_soft_cap, dropout_rate=opts.dropout_rate,
                 score_mod=score_mod, dropout_broadcast=opts.dropout_broadcast)
    return cfg, score_args

  def head_major(x, groups):
    """(B, L, n, X) -> (B, K, G, L, X) for the query, (B, K, L, X) for key and value."""
    x = jnp.transpose(x, (0, 2, 1, 3))
    return x.reshape(B, K, G, x.shape[2], x.shape[3]) if groups else x

  if opts.return_weights:
    cfg, score_args = config((B, N, T, S))
    w = _dense.attention_weights(cfg, head_major(query, True), head_major(key, False), bias5,
                                 combined, score_args, sink)
    w = w.reshape(B, N, T, S)
    return w[0] if args.unbatched else w

  def run_dense():
    # Head-major, GQA-grouped: one (T, S) matmul per head.
    cfg, score_args = config((B, N, T, S))
    out, lse = _dense.dense_attention(cfg, head_major(query, True), head_major(key, False),
                                      head_major(value, False), bias5, combined, seed,
                                      score_args, sink)
    return (jnp.transpose(out.reshape(B, N, T, Hv), (0, 2, 1, 3)),
            jnp.transpose(lse.reshape(B, N, T), (0, 2, 1)))

  def chunked(q, k, v, bias, mask, seed, sink, score_args, cfg, q_offset=None, kv_offset=None,
              batch0=None, head0=None, saved=None):
    """The chunked kernels on queries (B, cfg.T, N, H) and keys (B, cfg.S, K, H); ``q_offset``,
    ``kv_offset``: the global position of the first row when q, or k and v, are one device's
    shard of the sequence (masks, score_mod and dropout then see global positions);
    ``batch0``, ``head0``: the global index of the first example and query head when they are
    one device's part of the batch and heads (score_mod and dropout see global indices; the
    mask is already cut to them). ``saved``: (out, lse, dout, dlse) of an earlier call on the
    same operands; the operands' cotangents (an `Operands`) are returned instead."""
    bq_, bk_ = _plan.block_sizes(cfg.T, cfg.S, opts.block_q, opts.block_kv)
    positions = None
    if batch0 is not None or q_offset is not None or kv_offset is not None:
      def table(offset, n, block):
        # Padding rows repeat the last row's position (hidden, or sliced off).
        rows = jnp.minimum(jnp.arange(-(-n // block) * block, dtype=jnp.int32), n - 1)
        return rows if offset is None else offset + rows
      q_table, kv_table = table(q_offset, cfg.T, bq_), table(kv_offset, cfg.S, bk_)
      if mask is not None and (q_offset is not None or kv_offset is not None):
        mask = _masks.remap(mask, q_table, kv_table)
      if cfg.score_mod is not None or cfg.dropout_rate > 0:
        positions = _plan.Positions(q_table, kv_table, 0 if batch0 is None else batch0,
                                    0 if head0 is None else head0)
    run = {}
    for schedule in (opts.schedule,) if opts.schedule else _plan.SCHEDULES:
      plan, states = _plan.make_plan(cfg, mask, bq_, bk_, schedule, opts.step_width)
      ops = Operands(q=q, k=k, v=v, bias=bias, mask=mask, states=states, seed=seed,
                     score_args=score_args, sink=sink, positions=positions)
      run[schedule] = (functools.partial(_chunked.chunked_attention, plan, ops) if saved is None
                       else functools.partial(_chunked.chunked_attention_grads, plan, ops,
                                              *saved))
    if opts.schedule:
      return run[opts.schedule]()
    return _by_platform({p: run[s] for p, s in _plan.SCHEDULE_DEFAULTS.items()})

  def run_chunked():
    # The chunked kernels read blocks of the (B, T, N, H) arrays as they are (see _chunked).
    if q_shards is not None:
      out, lse = sequence_sharded(*q_shards, split_query=True)
    elif kv_shards is not None:
      out, lse = sequence_sharded(*kv_shards, split_query=False)
    else:
      cfg, score_args = config((B, N, bq, bk))
      q = query if seq_spec is None else _sharding.unshard_axis(query, 1)
      if seq_spec is None and _partition.applies(combined, score_args):
        out, lse = _partition.attention(
            _partition.Problem(B, T, S, N, K, partitioned_part,
                               None if bias5 is None else bias5.shape),
            (q, key, value, bias5, combined, seed, sink))
      else:
        out, lse = chunked(q, key, value, bias5, combined, seed, sink, score_args, cfg)
    if seq_spec is not None and _sharding.spec_of(out) != seq_spec:
      out = jax.sharding.reshard(out, seq_spec)
    return out, lse

  def partitioned_part(q, k, v, bias, mask, seed, sink, part, saved=None):
    """The chunked kernels on one device's part of the call (``part``: a `_partition.Part`, or
    None for the whole), as `_partition` runs them when XLA partitions the program: (out, lse),
    or with ``saved`` (see `chunked`) the operands' cotangents."""
    Bl, Tl, Nl, _ = q.shape
    Sl, Kl = k.shape[1], k.shape[2]
    tile = (Bl, Nl) + _plan.block_sizes(Tl, Sl, opts.block_q, opts.block_kv)
    cfg, score_args = config(tile, T=Tl, S=Sl, B=Bl, K=Kl)
    if part is None:
      return chunked(q, k, v, bias, mask, seed, sink, score_args, cfg, saved=saved)
    return chunked(q, k, v, bias, mask, seed, sink, score_args, cfg,
                   q_offset=part.row0 if Tl != T else None,
                   kv_offset=part.key0 if Sl != S else None, batch0=part.batch0,
                   head0=part.head0, saved=saved)

  def sequence_sharded(axes, count, split_query: bool):
    """The chunked kernels per shard of the sequence under an Explicit mesh, inside a shard_map
    over its mesh ``axes`` (``count`` shards), with masks, score_mod and dropout at global
    positions.

    ``split_query``: the query is sharded along T. Each device runs its own rows against the
    whole (gathered) K and V, as dense attention's partitioned matmuls do: the query and output
    stay sharded, each device does 1/count of the work (the kernels take query blocks out of Q
    at loop indices, so otherwise the partitioner would need the whole Q on every device). The
    devices' dK/dV partial sums are added by the shard_map's transpose (a psum, as jax.nn's
    backward all-reduces them).

    Else the query is whole and K, V are sharded along S (a decoding step against a sharded
    cache): each device attends all queries to its own keys, and the parts are merged through
    their log-sum-exps across the devices (split-KV over devices): a (B, T, N, H) partial
    output moves instead of the whole cache. The sinks join once, after the merge; gradients
    flow through it (the kernels' VJP takes the lse's cotangent)."""
    Tl, Sl = (T // count, S) if split_query else (T, S // count)
    tile = (B, N) + _plan.block_sizes(Tl, Sl, opts.block_q, opts.block_kv)
    cfg, score_args = config(tile, T=Tl, S=Sl, replay=True)
    P = jax.sharding.PartitionSpec
    seq = _sharding.spec_entry(axes)
    split = (query,) if split_query else (args.key, args.value)
    split = tuple(_sharding.shard_dim(x, 1, axes) for x in split)
    bias_dim = 3 if split_query else 4  # T or S of (B|1, K|1, G|1, T|1, S|1)
    local_bias = bias5 is not None and bias5.shape[bias_dim] != 1
    bias = (_sharding.shard_dim(bias5, bias_dim, axes) if local_bias
            else _sharding.replicate_over(bias5, axes))
    # Sinks join the kernels per query row, or the merged result once.
    whole = (key, value) if split_query else (query,)
    whole = _sharding.replicate_over(
        (whole, combined, seed, sink if split_query else None, score_args), axes)

    def body(split, bias, whole):
      whole, mask, seed, sink, score_args = whole
      q, k, v = split + whole if split_query else whole + split
      offset = jax.lax.axis_index(axes) * (Tl if split_query else Sl)
      out, lse = chunked(q, k, v, bias, mask, seed, sink, score_args, cfg,
                         **{"q_offset" if split_query else "kv_offset": offset})
      return (out, lse) if split_query else _ring.merge_over_devices(out, lse, axes)

    rows = P(None, seq) if split_query else P()
    fn = jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(),
                       in_specs=(P(None, seq),
                                 P(*(None,) * bias_dim, seq) if local_bias else P(), P()),
                       out_specs=(rows, rows), axis_names=frozenset(axes), check_vma=False)
    out, lse = fn(split, bias, whole)
    if not split_query and args.sinks is not None:
      out, lse = _ring.add_sink(out, lse, args.sinks)
    return out.astype(query.dtype), lse

  def splash_shards():
    """Under an Explicit mesh, the (batch, head) mesh axes splash runs split over, or a
    phrase saying why it cannot be split (see `_sharding.examples_and_heads`); else None."""
    if seq_spec is None:
      return None
    return _sharding.examples_and_heads(query, args.key, args.value)

  def run_splash():
    _fused.refuse_given("splash", (
        ("bias", args.bias is not None), ("dropout", opts.dropout_rate > 0),
        ("score_mod", opts.score_mod is not None)),
        "the fused kernel has no such input")
    if not concrete(B, N):
      _fused.refuse("splash", f"a symbolic batch or head count (B={B}, N={N})",
                    "its block masks are built per head while the call is traced")
    shard = splash_shards()
    if isinstance(shard, str):
      _fused.refuse("splash", shard + " under an Explicit mesh",
                    "XLA cannot partition a Pallas kernel, and jattn splits the call over "
                    "devices only by examples and heads")
    if _sharding.checks_vma(query):
      _fused.refuse("splash", "jax.shard_map(check_vma=True)",
                    "its Pallas kernels do not type their outputs as device-varying (JAX's "
                    "pallas_call raises); use check_vma=False")
    run = functools.partial(_splash.splash_attention, query, key, value, combined, args.sinks,
                            scale=scale, soft_cap=opts.logits_soft_cap,
                            block_q=opts.splash_blocks[0], block_kv=opts.splash_blocks[1],
                            shard=shard)
    if _splash.interpreting():
      return run()
    # Lowered for another platform than a TPU, the call fails there with this message (where
    # the program is lowered: one exported for tpu from a CPU is traced here too).
    like = (jax.ShapeDtypeStruct((B, T, N, Hv), query.dtype),
            jax.ShapeDtypeStruct((B, T, N), jnp.float32))
    message = ("implementation='splash' needs a TPU: this program is lowered for {platform}. "
               "Run it on a TPU, or on a CPU inside "
               "jax.experimental.pallas.tpu.force_tpu_interpret_mode() (slow; for tests), or "
               "name a fallback: implementation=('splash', 'chunked')")
    return _by_platform({"tpu": run, "default": lambda: _fused.unavailable(
        message, like, query, key, value)})

  def run_cudnn():
    _fused.refuse_given("cudnn", (
        ("mask objects", isinstance(args.mask, _masks.Mask)),
        ("q_segment_ids", args.q_seg is not None), ("sinks", args.sinks is not None),
        ("score_mod", opts.score_mod is not None), ("dropout", opts.dropout_rate > 0),
        ("logits_soft_cap", opts.logits_soft_cap is not None)),
        "jax.nn's cuDNN call has no such input")
    return _cudnn.cudnn_attention(query, key, value, args.bias, args.mask, scale=scale,
                                  causal=opts.causal, window=opts.window,
                                  q_lengths=args.q_lengths, kv_lengths=args.kv_lengths)

  def run_automatic():
    if kv_shards is not None:
      # K and V sharded along S: the chunked kernels merge per-shard parts across devices,
      # where dense would gather the whole of K and V (a decoding step's whole cache).
      return run_chunked()
    # Splash only where the program cannot be partitioned: a Pallas (Mosaic) kernel lowered
    # into a multi-device program outside shard_map is refused by TPU lowering, and under an
    # Auto mesh whether the program will be partitioned is not known while the call is traced.
    # And only for masks splash builds lazily: a (T, S) evaluation per head at trace time would
    # be paid on every platform (platform_dependent traces every branch).
    unpartitioned = _sharding.unpartitioned()
    lazy = _splash.builds_lazily(combined)
    # Splash also where an Explicit mesh shards only examples and heads: the shardings are in
    # the types, so it runs per device inside a shard_map (see run_splash).
    splits = isinstance(splash_shards(), tuple)
    choice = _plan.implementation_by_platform(B, N, T, S, G, query.dtype, combined,
                                              fused=(unpartitioned or splits) and lazy)
    tuned = opts.tuned_implementation
    if (tuned is not None and unpartitioned and not _plan.decoding(T, S, G)
        and (tuned != "splash" or lazy)):
      # The device's tuning table measured its fused kernel faster for calls like this one
      # (square ones: decoding-shaped calls share a length bucket but were not measured). Only
      # where the program cannot be partitioned, as for splash above: jax.nn's cuDNN call
      # refuses sequence-sharded inputs when the program is partitioned, after tracing.
      for platform in PLATFORMS[tuned]:
        rest = choice.get(platform, choice["default"])
        choice[platform] = (tuned,) + tuple(n for n in rest if n != tuned)
    fns = {}
    for platform, names in choice.items():
      takers = _takers(names, runners)
      fns[platform] = takers.get(platform, takers.get("default"))
    return _by_platform(fns)

  runners = {"dense": run_dense, "chunked": run_chunked, "splash": run_splash,
             "cudnn": run_cudnn, "automatic": run_automatic}
  out, lse = _in_order(_validation.implementation_names(opts.implementation) or ("automatic",),
                       runners)

  if args.unbatched:
    out = out[0]
  if not opts.return_residual:
    return out
  lse = _plan.clamp_lse(lse, query.dtype)
  if args.unbatched:
    lse = lse[0]
  return out, lse


# The implementations and the platforms each lowers for (None: every platform; jattn's own
# kernels are XLA programs). What each supports it declares by raising NotImplementedError, at
# trace time, for what it cannot do.
PLATFORMS = {"dense": None, "chunked": None, "automatic": None, "splash": ("tpu",),
             "cudnn": ("cuda",)}


def _in_order(names, runners):
  """The first implementation of ``names`` that takes the call, per platform (tokamax's rule:
  fall through on NotImplementedError), chosen where the program is lowered (see `_takers`).
  A name given alone runs as asked."""
  if len(names) == 1:
    return runners[names[0]]()
  return _by_platform(_takers(names, runners))


def _takers(names, runners):
  """{platform or "default": runner}: per platform, the first of ``names`` that takes the call.
  One that lowers only for some platforms serves those; the first that lowers anywhere serves
  the rest ("default").

  Whether an implementation takes the call is found by tracing it once aside
  (`jax.eval_shape`): inside `platform_dependent` an error could not be told from its siblings'.
  The last universal candidate is not tried aside: its own error, if any, is the call's."""
  if len(names) == 1:
    return {"default": runners[names[0]]}
  fns, errors = {}, []
  for i, name in enumerate(names):
    platforms = PLATFORMS[name]
    if platforms is not None and all(p in fns for p in platforms):
      continue
    if platforms is not None or i < len(names) - 1:
      try:
        jax.eval_shape(runners[name])
      except NotImplementedError as e:
        errors.append(str(e))
        continue
    if platforms is None:
      fns["default"] = runners[name]
      break
    for p in platforms:
      fns.setdefault(p, runners[name])
  if not fns:
    raise NotImplementedError("no implementation takes this call: " + "; ".join(errors))
  return fns


def _by_platform(fns):
  """Call ``fns[platform]`` (a "default" entry, if any, for the rest), chosen where the program
  is lowered, not where it is traced: a program exported for cuda or tpu from this CPU gets the
  accelerator's choice. One distinct function for every platform is simply called."""
  if len(set(fns.values())) == 1 and "default" in fns:
    return next(iter(fns.values()))()
  rest = {p: f for p, f in fns.items() if p != "default"}
  return jax.lax.platform_dependent(**rest, default=fns.get("default"))


def attention_weights(query, key, value, bias=None, mask=None, **kwargs):
  """The (B, N, T, S) softmax weights (float32 for 16-bit inputs) that
  :func:`dot_product_attention` with the same arguments applies to ``value``, before dropout.

  Rows with nothing to attend to are 0. O(T x S) memory by nature: for inspecting weights
  (flax's ``sow_weights``), not for computing attention. ``value`` is checked against the others
  but not used; dropout and ``return_residual`` do not apply.
  """
  for name in ("dropout_rate", "dropout_rng", "dropout_broadcast", "return_residual",
               "implementation", "block_q", "block_kv", "schedule", "step_width"):
    kwargs.pop(name, None)
  return dot_product_attention(query, key, value, bias, mask, _return_weights=True, **kwargs)
