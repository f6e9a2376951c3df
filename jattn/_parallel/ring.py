"""Ring (context-parallel) attention: exact attention over a sequence sharded across devices.

Built on JAX's own SPMD machinery: `ring_attention` runs inside `jax.shard_map` with the query and
key/value sequences sharded along one mesh axis of P devices. Each device keeps its query shard.
For P steps it attends that shard to the key/value shard it currently holds, with the chunked
kernel (`jattn._chunked.forward`), while passing the key/value shard on to its ring neighbour with
`jax.lax.ppermute`; the P partial results are combined exactly through their log-sum-exps (the
rule of `jattn.merge_attention`), and the sinks, if any, join once at the end.

The backward pass rings once more. The chunked backward recomputes probabilities as
exp(S - lse) from the *global* log-sum-exp of each row, so on one key/value shard
`jattn._chunked.backward` returns exactly that shard's share of dQ and the whole of its dK, dV.
The dK/dV accumulators travel around the ring with their shard and are back on its owner after P
steps; dQ stays put. Memory per device: its own shards, one key/value shard (plus, backward, its
dK/dV) in flight, and O(T / P) statistics -- independent of P.

Global positions. Masks, score_mod and dropout are about positions in the whole sequence, but
the kernel sees local positions 0 .. T/P - 1. The call's mask is built once, on global
positions, by the same `jattn.masks.from_arguments` as the single-device call; for each pair of shards
`jattn.masks.remap` evaluates it through tables of the global position of every local row,
computed from the device index and the layout:
  contiguous: device d holds positions [d * T/P, (d + 1) * T/P);
  zigzag:     the sequence is cut into 2P chunks; device d holds chunks d and 2P - 1 - d, so every
              device owns an equal share of the causal triangle (`jattn._parallel.zigzag`).
The same tables reach score_mod and the dropout hash (`jattn._chunked.plan.Positions`), so ring and
single-device calls compute the same scores and drop the same entries. A block's summary
(EMPTY / PARTIAL / FULL) comes from the min and max global position of each block, so a
key/value shard wholly in a query shard's future is an all-EMPTY block map and costs no tile: the
kernel skips it, while the ppermute still runs on every step (every device takes part in every
collective, whatever its share of the work).

This module holds the public functions `ring_attention` and `ring_attention_sharded`; the ring
itself (the operands of one shard pair, the forward and backward loops and their custom VJP,
`tiles_per_device`) is `jattn._parallel.ring_loop`. The layouts themselves are in
`jattn._parallel.zigzag`; merging parts by their log-sum-exp, `jattn.merge_attention`, is in
`jattn._attention`.

Shapes: B batch, T / S global query / key length, N query heads, K key/value heads, G = N // K,
H head dim; Ts = T / P and Ss = S / P are one device's shards.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jattn import _call, _registry, _softmax, _tile, _validation
from jattn import masks as _masks
from jattn._chunked import plan as _plan
from jattn._parallel import ring_loop
from jattn._types import ArrayLike, Implementation, IsCausal, LocalWindowSize, RingOrder

RING_ORDERS = _validation.RING_ORDERS


# --------------------------------------------------------------------------------------------
# Public functions.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _RingOptions:
  """The static (hashable) options of one call: those it shares with `dot_product_attention`
  (``call``) and the ring's own."""

  call: _call.Options
  axis_name: Any
  num_devices: int
  layout: str
  kernel: str  # the per-shard kernel: "chunked" or "dense"


# What ring attention runs on each (query shard, key/value shard) pair. Its loop decides at run
# time which key/value shard a device holds, so the pair's part of the mask is a run-time value;
# the pairs' results are merged through their log-sum-exp, and the backward recomputes each
# pair from the merged one. jattn's own kernels take all three; a backend says why it cannot
# (`jattn._registry.Backend.ring`).
_RING_KERNELS = ("chunked", "dense")
_REFUSAL = (
  "ring_attention cannot run {name} per shard pair: which part of the mask a pair sees "
  "depends on the ring step (a run-time device index), {why}, and the backward must recompute "
  "each pair from the log-sum-exp merged over all pairs"
)


def _ring_kernel(implementation) -> str:
  """The per-shard kernel for ``implementation`` (None, a name or a sequence tried in order):
  "chunked" (None too) or "dense"; the others are skipped with their reason."""
  names = _validation.implementation_names(_validation.implementation(implementation)) or (
    "chunked",
  )
  reasons = []
  for name in names:
    if name in _RING_KERNELS:
      return name
    why = _registry.get(name).ring or "while it is not one of jattn's own kernels"
    reasons.append(_REFUSAL.format(name=repr(name), why=why))
  raise NotImplementedError("; ".join(reasons) + ". Use implementation='chunked' or 'dense'.")


def ring_attention(
  query: ArrayLike,
  key: ArrayLike,
  value: ArrayLike,
  bias: ArrayLike | None = None,
  mask: _masks.Mask | None = None,
  *,
  axis_name,
  scale: float | None = None,
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
  layout: RingOrder = "contiguous",
  block_q: int | None = None,
  block_kv: int | None = None,
  return_residual: bool = False,
  score_mod: Callable | None = None,
  sinks: ArrayLike | None = None,
  implementation: Implementation | Sequence[Implementation] | None = None,
  q_positions: ArrayLike | None = None,
  kv_positions: ArrayLike | None = None,
  return_max_logits: bool = False,
  _index_offsets=None,
):
  r"""Ring (context-parallel) attention; call it inside `jax.shard_map`.

  The query and key/value sequences are sharded along the mesh axis ``axis_name`` of P devices;
  each call sees one device's shards. The result equals
  ``jattn.dot_product_attention`` on the whole (unsharded) sequences, sharded the same way. Each
  device keeps its queries and passes key/value shards around the ring with `jax.lax.ppermute`
  (P steps, each one send of the shard; the backward pass also sends the key/value gradients).
  Memory per device does not grow with P.

  Everything that is a function of positions means what it means in ``dot_product_attention``
  on the whole sequences: mask objects, causal, windows, lengths, ``score_mod``'s indices and
  the dropout hash see *global* positions (ring and single-device drop the same entries).

  Args:
    query: this device's shard (B, Ts, N, H) (or (Ts, N, H)), Ts = T / P.
    key: (B, Ss, K, H), Ss = S / P; K must divide N (GQA / MQA).
    value: same shape as ``key``.
    bias: not supported (NotImplementedError): a (T, S) array cannot be split into the ring's
      blocks without being all-gathered.
    mask: a :mod:`jattn.masks` object built for the whole (T, S) problem (``masks.causal()``,
      windows, ``chunked_local``, ``prefix_lm``, ``from_function``, lengths, and their
      combinations). Boolean arrays and ``masks.from_array`` are not supported
      (NotImplementedError), as for ``bias``.
    axis_name: the `shard_map` mesh axis the sequence is sharded along.
    scale: logit scale; default ``1 / sqrt(H)``.
    is_causal: ``False``, ``True`` / ``"top_left"`` or ``"bottom_right"``, on *global* positions
      (bottom_right aligns the last query with the last key: offset S - T).
    query_seq_lengths, key_value_seq_lengths: int (B,) valid lengths in global positions (not
      sharded: the same on every device of the ring).
    local_window_size: ``w`` or ``(left, right)``, on global positions, as in
      ``dot_product_attention``.
    q_segment_ids: int (B, Ts), this device's shard of the (B, T) ids, in the same layout as the
      queries; kv_segment_ids: int (B, Ss) likewise (they travel with their key/value shard).
    logits_soft_cap: ``cap * tanh(logits / cap)``.
    dropout_rate, dropout_rng, dropout_broadcast: as in ``dot_product_attention``; the same key
      on every device of the ring.
    layout: ``"contiguous"`` (device d holds positions [d * Ts, (d + 1) * Ts)) or ``"zigzag"``
      (the sequence in 2P chunks, device d holding chunks d and 2P-1-d: balanced under a causal
      mask; permute with `zigzag_permute` first). Ts and Ss must be even for zigzag.
    block_q, block_kv: kernel block sizes within a shard (default 512 and 256, at most the
      shard, and for zigzag at most one chunk, so that no block straddles two chunks).
    implementation: the kernel each device runs on a (query shard, key/value shard) pair:
      ``None`` or ``"chunked"`` (blocks of ``block_q`` x ``block_kv``), ``"dense"`` (alias
      ``"xla"``: the pair's whole score matrix at once -- one tile, or one per pair of zigzag
      chunks; ``block_q``/``block_kv`` do not apply), or a sequence of names tried in order.
      ``"splash"`` and ``"cudnn"`` cannot serve a ring (NotImplementedError with the reason;
      in a sequence they are skipped): a pair's part of the mask is known only at run time,
      and the backward recomputes each pair from the merged log-sum-exp.
    return_residual: also return this device's log-sum-exp (B, Ts, N), with its gradient.
    score_mod: as in ``dot_product_attention``, called with global query and key indices.
    sinks: float (N,) per-head sink logits, the same on every device; each row's sink joins its
      softmax once (in the final merge), and its gradient is summed over the ring.
    q_positions, kv_positions: int (B, Ts) and (B, Ss) (or (Ts,), (Ss,) unbatched), this
      device's slices of the (B, T) and (B, S) positions in the layout of the queries and keys,
      as the segment ids (the key positions travel with their shard), given together:
      ``is_causal`` and ``local_window_size`` are then measured in these positions instead of
      array indices (either alignment: key visible iff its position <= the query's) -- a cache
      with padding inside, packed sequences whose positions restart. Blocks are skipped from
      each block's range of positions (`jattn.masks.positions`). Padding still needs its own
      mask (lengths, segment ids).
    return_max_logits: also return this device's rows' max logits over every key they see on
      the ring (B, Ts, N) float32, as in ``dot_product_attention`` (the max of each shard
      pair's; sinks left out; -inf for a row that sees nothing; no gradient).

  Returns:
    This device's output shard, shaped like ``query``; with ``return_residual`` or
    ``return_max_logits`` a tuple: the output, then the lse, then the max logits (each if
    asked for).

  Batch and head indices (seen by ``score_mod``, ``masks.from_function`` and the dropout hash)
  are those of this device's arrays; `ring_attention_sharded` makes them global when it also
  shards the batch or heads. Call it inside ``jax.shard_map`` (``check_vma`` either way), or use
  `ring_attention_sharded`.
  """
  if bias is not None:
    raise NotImplementedError(
      "ring_attention does not support bias: an additive (T, S) array spans every pair of "
      "shards and would have to be all-gathered. Express position-dependent terms with "
      "score_mod (it sees global indices)."
    )
  if mask is not None and not isinstance(mask, _masks.Mask) and not hasattr(mask, "shape"):
    raise TypeError(f"mask must be a jattn.masks object, got {_validation.describe(mask)}")
  if mask is not None and not (isinstance(mask, _masks.Mask) and _masks.is_position_based(mask)):
    raise NotImplementedError(
      "ring_attention supports mask objects that are functions of positions (jattn.masks: "
      "causal, local_window, chunked_local, prefix_lm, from_function, lengths and their "
      "combinations); a boolean mask array (or masks.from_array) spans the whole (T, S) and "
      f"would have to be all-gathered. Got {type(mask).__name__}."
    )
  _validation.one_of("layout", layout, RING_ORDERS)
  _validation.hashable("axis_name", axis_name, "a hashable mesh axis name")
  try:
    num_devices = jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
      f"ring_attention: axis_name={axis_name!r} is not a bound mesh axis; call it inside "
      f"jax.shard_map over a mesh with that axis (or use ring_attention_sharded)"
    ) from e
  kernel = _ring_kernel(implementation)
  call, _ = _call.options(
    _call.Keywords(
      scale=_validation.scale(scale),
      is_causal=is_causal,
      local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap,
      dropout_rate=dropout_rate,
      dropout_rng=dropout_rng,
      dropout_broadcast=dropout_broadcast,
      implementation=kernel,
      block_q=block_q,
      block_kv=block_kv,
      return_residual=return_residual,
      score_mod=score_mod,
      return_max_logits=return_max_logits,
    ),
    tuned=False,
  )
  opts = _RingOptions(
    call=call, axis_name=axis_name, num_devices=int(num_devices), layout=layout, kernel=kernel
  )
  if opts.call.dropout_rate == 0.0:
    dropout_rng = None
  batch0, head0 = (0, 0) if _index_offsets is None else _index_offsets
  # The mask is over the whole sequence: it is not bound with this device's shards.
  given = _call.Given(
    query,
    key,
    value,
    q_lengths=query_seq_lengths,
    kv_lengths=key_value_seq_lengths,
    q_seg=q_segment_ids,
    kv_seg=kv_segment_ids,
    dropout_rng=dropout_rng,
    sinks=sinks,
    q_positions=q_positions,
    kv_positions=kv_positions,
  )
  offsets = (jnp.asarray(batch0, jnp.int32), jnp.asarray(head0, jnp.int32))
  return _ring_attention(given.passable(), mask, offsets, opts=opts)


@functools.partial(jax.jit, static_argnames=("opts",))
def _ring_attention(given: _call.Given, mask, offsets, *, opts: _RingOptions):
  # This device's shards bound as a call of their own (its mask, over the shard, is not used:
  # the ring's mask is over the whole sequence, and the keys' segment ids and positions travel
  # round the ring).
  call = _call.bind(given, opts.call)
  batch0, head0 = offsets
  args, st = call.given, call.static
  assert args is not None  # bound from arrays
  query, key, value = call.query, call.key, call.value
  B, Ts, N, Ss = st.B, st.T, st.N, st.S
  P = opts.num_devices
  zigzag = opts.layout == "zigzag"
  if zigzag and (Ts % 2 or Ss % 2):
    raise ValueError(
      f"layout='zigzag' holds two equal chunks per device, so the shard lengths must be even; "
      f"got query shard Ts={Ts} and key shard Ss={Ss} (query.shape={query.shape}, "
      f"key.shape={key.shape})"
    )
  T, S = Ts * P, Ss * P
  # Masks see the whole problem: global lengths, this device's batch elements and heads.
  global_shape = (B, N, T, S)
  if mask is not None:
    mask.validate(global_shape)
  # Given positions, the bound call's options no longer hold causality and the window: they are
  # measured in the positions, per shard pair (`_pair`), not on global indices.
  global_mask = _masks.from_arguments(
    global_shape,
    mask,
    st.opts.causal,
    st.opts.window,
    lengths=(args.q_lengths, args.kv_lengths),
  )

  rc, score_args = _ring_config(opts, st, query, key)
  if args.q_positions is not None:
    rc = dataclasses.replace(rc, by_position=(opts.call.causal is not None, opts.call.window))
  ro = ring_loop.RingOperands(
    global_mask,
    ring_loop.Tokens(args.q_seg, args.q_positions),
    ring_loop.Tokens(args.kv_seg, args.kv_positions),
    call.seed,
    score_args,
    call.sink,
    batch0,
    head0,
  )

  # Sequence-major as the chunked kernel takes them, padded to whole blocks: (B, Tp, N, H).
  q, k, v, _ = _plan.pad_to_blocks(rc.plan, query, key, value, None)
  out, lse, *mx = (x[:, :Ts] for x in ring_loop.ring(rc, q, k, v, ro))
  if st.unbatched:
    out, lse, mx = out[0], lse[0], [x[0] for x in mx]
  if not (opts.call.return_residual or opts.call.return_max_logits):
    return out
  res: tuple = (out,)
  if opts.call.return_residual:
    res += (_softmax.returned_lse(lse, query.dtype),)
  return res + tuple(mx)


def _ring_config(opts: _RingOptions, st, query, key):
  """(ring_loop.RingConfig, score_mod's arrays) for this device's (Ts, Ss) shard pair: the blocks (one
  tile per zigzag chunk for the dense kernel; no block straddles two chunks) and the plan."""
  Ts, Ss = st.T, st.S
  zigzag = opts.layout == "zigzag"
  if opts.kernel == "dense":
    # The whole pair in one tile (no block may straddle two zigzag chunks).
    bq, bk = (Ts // 2, Ss // 2) if zigzag else (Ts, Ss)
  else:
    bq, bk = _tile.block_sizes(
      Ts,
      Ss,
      opts.call.block_q,
      opts.call.block_kv,
      cap_q=Ts // 2 if zigzag else None,
      cap_kv=Ss // 2 if zigzag else None,
    )
  # score_mod is replayed with its arrays passed in varying (see _sharding.VaryingReplay).
  cfg, score_args = st.config((st.B, st.N, bq, bk), replay=True, varying_like=(query, key))
  # Each pair's output stays in the statistics dtype until the pairs are merged (Plan.out_dtype).
  plan, _ = _plan.make_plan(cfg, None, bq, bk, out_dtype=_tile.stat_dtype(query.dtype))
  # The block map of every pair is computed at run time (it depends on the ring step), so every
  # tile variant is compiled.
  rc = ring_loop.RingConfig(
    dataclasses.replace(
      plan, kinds=(_masks.EMPTY, _masks.PARTIAL, _masks.FULL), q_ranges=None, kv_ranges=None
    ),
    opts.axis_name,
    opts.num_devices,
    opts.layout,
  )
  return rc, score_args


def ring_attention_sharded(
  query,
  key,
  value,
  *,
  mesh,
  seq_axis,
  batch_axis=None,
  head_axis=None,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  q_segment_ids=None,
  kv_segment_ids=None,
  **kwargs,
):
  """`ring_attention` on global arrays: sets up the `jax.shard_map` over ``mesh``.

  Shards query, key and value (B, T, N, H) / (B, S, K, H) as ``P(batch_axis, seq_axis,
  head_axis, None)``: the sequence along ``seq_axis`` (the ring), optionally the batch along
  ``batch_axis`` (data parallel) and the heads along ``head_axis`` (tensor parallel: K must be a
  multiple of that axis's size, so each device keeps whole GQA groups). Mesh axes not named stay
  under the compiler's automatic sharding. Segment ids and positions (B, T) / (B, S) are sharded
  like the sequence; lengths (B,) only along the batch.

  With ``layout="zigzag"`` the arrays (and segment ids) must already be in zigzag order
  (`zigzag_permute`); the output comes back in that order too (`zigzag_unpermute`).

  Args:
    query, key, value: global (B, T, N, H), (B, S, K, H), (B, S, K, H) arrays.
    mesh: a `jax.sharding.Mesh`.
    seq_axis: the mesh axis name of the ring.
    batch_axis, head_axis: optional mesh axis names for B and N/K.
    query_seq_lengths, key_value_seq_lengths, q_segment_ids, kv_segment_ids: as in
      `ring_attention`, global.
    q_positions, kv_positions: (B, T) and (B, S), global (in the layout of the arrays), sharded
      like the segment ids.
    sinks: (N,), sharded like the heads.
    **kwargs: the other keyword arguments of `ring_attention` (is_causal, layout, scale, ...).

  Returns:
    The global (B, T, N, H) output (and with ``return_residual``, the (B, T, N) lse, with
    ``return_max_logits`` the (B, T, N) max logits, in that order), sharded like the query.
  """
  _validation.instance("mesh", mesh, jax.sharding.Mesh, "a jax.sharding.Mesh")
  if "axis_name" in kwargs:
    raise TypeError("ring_attention_sharded takes seq_axis=, not axis_name=")
  if seq_axis is None:
    raise ValueError("seq_axis must name a mesh axis, got None")
  _validation.one_of("layout", kwargs.get("layout", "contiguous"), RING_ORDERS)
  axes = {"seq_axis": seq_axis, "batch_axis": batch_axis, "head_axis": head_axis}
  for name, ax in axes.items():
    _validation.hashable(name, ax, "a mesh axis name")
    if ax is not None and ax not in mesh.axis_names:
      raise ValueError(f"{name}={ax!r} is not an axis of the mesh {mesh.axis_names}")
  used = [ax for ax in axes.values() if ax is not None]
  if len(set(used)) != len(used):
    raise ValueError(f"seq_axis, batch_axis and head_axis must be distinct mesh axes, got {axes}")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if jnp.ndim(x) != 4:
      raise ValueError(f"{name} must be a global (B, T|S, N|K, H) array, got shape {jnp.shape(x)}")
  B, T, N, _ = jnp.shape(query)
  _, S, K, _ = jnp.shape(key)
  size = lambda ax: 1 if ax is None else mesh.shape[ax]
  chunks = size(seq_axis) * (2 if kwargs.get("layout", "contiguous") == "zigzag" else 1)
  for what, n, d in (
    ("T (query.shape[1])", T, chunks),
    ("S (key.shape[1])", S, chunks),
    ("B (query.shape[0])", B, size(batch_axis)),
    ("N (query.shape[2])", N, size(head_axis)),
    ("K (key.shape[2])", K, size(head_axis)),
  ):
    if n % d:
      raise ValueError(
        f"{what} = {n} must be a multiple of {d} to shard over mesh {mesh.shape} "
        f"(seq_axis={seq_axis!r}, batch_axis={batch_axis!r}, "
        f"head_axis={head_axis!r}, layout={kwargs.get('layout', 'contiguous')!r})"
      )

  PS = jax.sharding.PartitionSpec
  seq_spec = PS(batch_axis, seq_axis, head_axis, None)
  extras, extra_specs = {}, {}
  for name, x, spec in (
    ("query_seq_lengths", query_seq_lengths, PS(batch_axis)),
    ("key_value_seq_lengths", key_value_seq_lengths, PS(batch_axis)),
    ("q_segment_ids", q_segment_ids, PS(batch_axis, seq_axis)),
    ("kv_segment_ids", kv_segment_ids, PS(batch_axis, seq_axis)),
    ("q_positions", kwargs.pop("q_positions", None), PS(batch_axis, seq_axis)),
    ("kv_positions", kwargs.pop("kv_positions", None), PS(batch_axis, seq_axis)),
    ("sinks", kwargs.pop("sinks", None), PS(head_axis)),
  ):
    if x is not None:
      extras[name], extra_specs[name] = x, spec
  out_spec: Any = seq_spec  # the output's spec, or (output's, lse's, max logits')
  rows_spec = PS(batch_axis, seq_axis, head_axis)
  stats = [kwargs.get(f"return_{x}", False) for x in ("residual", "max_logits")]
  if any(stats):
    out_spec = (seq_spec,) + (rows_spec,) * sum(map(bool, stats))

  def body(q, k, v, extra):
    # Batch and head indices seen by score_mod, mask functions and the dropout hash are global:
    # this device's first batch element and head.
    offsets = tuple(
      0 if ax is None else jax.lax.axis_index(ax) * n
      for ax, n in ((batch_axis, q.shape[0]), (head_axis, q.shape[2]))
    )
    return ring_attention(q, k, v, axis_name=seq_axis, _index_offsets=offsets, **extra, **kwargs)

  in_specs = (seq_spec, seq_spec, seq_spec, extra_specs)
  args = (query, key, value, extras)
  axis_types = dict(zip(mesh.axis_names, mesh.axis_types))
  if any(axis_types[ax] == jax.sharding.AxisType.Explicit for ax in used):
    # Explicit mesh axes make the sharding part of the array type: shard_map wants inputs
    # already laid out as in_specs say.
    put = lambda x, spec: jax.reshard(x, jax.sharding.NamedSharding(mesh, spec))
    args = (
      put(query, seq_spec),
      put(key, seq_spec),
      put(value, seq_spec),
      {name: put(x, extra_specs[name]) for name, x in extras.items()},
    )
  fn = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=out_spec,
    axis_names=frozenset(used),
    check_vma=False,
  )
  return fn(*args)
