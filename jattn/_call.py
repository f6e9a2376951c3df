"""The bound call: one attention call's arguments, checked once, with what every backend reads.

`options` turns the keyword arguments into `Options` (static, hashable: part of jit's cache key);
`bind` turns the array arguments into a `Call` inside the jitted function: arrays as pytree
leaves, the static description (`Static`: options, shapes, scale, how an Explicit mesh splits the sequence) as
metadata. Backends, the parallel layer and the kernels read the call; none re-validates it.

Shapes: B batch, T query length, S key/value length, N query heads, K key/value heads,
H head dimension, G = N // K query heads per key/value head.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _dropout, _registry, _sharding, _tile, _tuning, _validation
from jattn import masks as _masks
from jattn._tile import Config
from jattn._validation import concrete

# ---- the arrays ----------------------------------------------------------------------------


class Given(NamedTuple):
  """A call's array arguments as the caller passed them (a pytree: jitted functions take it
  whole). Every one but query, key and value may be None."""

  query: Any
  key: Any
  value: Any
  bias: Any = None
  mask: Any = None
  q_lengths: Any = None
  kv_lengths: Any = None
  q_seg: Any = None
  kv_seg: Any = None
  dropout_rng: Any = None
  sinks: Any = None
  # A scale given as an array (see `Options.scale` and `bind`).
  scale_operand: Any = None
  # Causality and the window measured in these positions (see `bind`), given together.
  q_positions: Any = None
  kv_positions: Any = None

  def passable(self) -> Given:
    """Itself, once every argument is something a jitted function takes (an array, a
    `jattn.masks` object, or what `jnp.asarray` converts), else a TypeError naming the
    argument: jit's own error, raised while flattening, names only a path (``given.mask``)."""
    for field, x in zip(self._fields, self):
      if x is None or isinstance(x, _masks.Mask) or (hasattr(x, "shape") and hasattr(x, "dtype")):
        continue
      name = _ARGUMENT_NAMES.get(field, field)
      what = "a boolean array or a jattn.masks object" if field == "mask" else "an array"
      _validation.as_array(name, x, what)
    _validation.known_lengths("query_seq_lengths", self.q_lengths)
    _validation.known_lengths("key_value_seq_lengths", self.kv_lengths)
    if isinstance(self.mask, _masks.Mask) and (shape := self._problem()) is not None:
      self.mask.check_known(shape)
    return self

  def _problem(self):
    """The call's (B, N, T, S) read from the query and key as passed, or None where they are not
    yet of a form to read it from (`bind` names what is wrong)."""
    q, k = self.query, self.key
    if getattr(q, "ndim", None) not in (3, 4) or getattr(k, "ndim", None) != q.ndim:
      return None
    B = q.shape[0] if q.ndim == 4 else 1
    return (B, q.shape[-2], q.shape[-3], k.shape[-3])


# Given's fields by the public keyword they come from, where the two differ.
_ARGUMENT_NAMES = {
  "q_lengths": "query_seq_lengths",
  "kv_lengths": "key_value_seq_lengths",
  "q_seg": "q_segment_ids",
  "kv_seg": "kv_segment_ids",
  "scale_operand": "scale",
}


@dataclasses.dataclass
class Arrays:
  """The array arguments, made rank-4 ((B, T, N, H) etc.), checked against each other."""

  query: Any
  key: Any
  value: Any
  bias: Any
  mask: Any
  q_lengths: Any
  kv_lengths: Any
  q_seg: Any
  kv_seg: Any
  sinks: Any
  unbatched: bool
  q_positions: Any = None
  kv_positions: Any = None


jax.tree_util.register_dataclass(
  Arrays,
  data_fields=[
    "query",
    "key",
    "value",
    "bias",
    "mask",
    "q_lengths",
    "kv_lengths",
    "q_seg",
    "kv_seg",
    "sinks",
    "q_positions",
    "kv_positions",
  ],
  meta_fields=["unbatched"],
)


def _qkv(query, key, value):
  """query, key and value checked in the order that names the wrong one: query alone, key
  against query, value against key."""
  query = _validation.float_array("query", query)
  if query.ndim not in (3, 4):
    raise ValueError(f"query must be (B, T, N, H) or (T, N, H), got shape {query.shape}")
  key = _validation.float_array("key", key)
  shapes = f"query.shape={query.shape}, key.shape={key.shape}"
  if key.ndim != query.ndim:
    raise ValueError(f"key must have the rank of query ({query.ndim}): {shapes}")
  if key.dtype != query.dtype:
    raise TypeError(
      f"key must have the dtype of query: query.dtype={query.dtype}, key.dtype={key.dtype}"
    )
  batched = query.ndim == 4
  if batched and key.shape[0] != query.shape[0]:
    raise ValueError(
      f"key must have the batch size B of query (B={query.shape[0]}), got "
      f"B={key.shape[0]}: {shapes}"
    )
  H, Hk = query.shape[-1], key.shape[-1]
  if Hk != H:
    raise ValueError(f"key must have the head dim H of query (H={H}), got H={Hk}: {shapes}")
  N, K = query.shape[-2], key.shape[-2]
  # No heads at all (N = K = 0) is an empty problem, answered empty (`_dispatch.run`).
  if (K == 0 and N != 0) or (K != 0 and N % K):
    raise ValueError(
      f"the number of query heads N={N} must be a multiple of the number of "
      f"key/value heads K={K} ({shapes})"
    )
  value = _validation.float_array("value", value)
  kv = f"key.shape={key.shape}, value.shape={value.shape}"
  if value.ndim != key.ndim:
    raise ValueError(f"value must have the rank of key ({key.ndim}): {kv}")
  if value.dtype != key.dtype:
    raise TypeError(
      f"value must have the dtype of key (and query): key.dtype={key.dtype}, "
      f"value.dtype={value.dtype}"
    )
  if value.shape[:-1] != key.shape[:-1]:
    # The value's head size Hv is its own (MLA: query/key 192, value 128); the rest is key's.
    raise ValueError(f"value must have key's (B, S, K) before its head size Hv: {kv}")
  if not concrete(value.shape[-1]) or value.shape[-1] < 1:
    raise ValueError(f"value's head size Hv must be a known positive size: {kv}")
  return query, key, value


def arrays(given: Given, empty_sequences: bool = False) -> Arrays:
  """``given``'s arrays checked against each other, rank 4; ``q_positions``/``kv_positions``
  (B, T), (B, S) (or (T,), (S,) unbatched) as `jattn.masks.positions` checks them.
  ``empty_sequences``: T = 0 or S = 0 is taken (the caller answers it), else a ValueError."""
  query, key, value = _qkv(given.query, given.key, given.value)
  bias, mask, sinks = given.bias, given.mask, given.sinks
  q_lengths, kv_lengths, q_seg, kv_seg = (
    given.q_lengths,
    given.kv_lengths,
    given.q_seg,
    given.kv_seg,
  )
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  B, T, N, H = query.shape
  S = key.shape[1]
  for name, letter, size in (("query", "T", T), ("key", "S", S), ("query", "H", H)):
    if not concrete(size):
      # jax.export's symbolic dimensions: the batch and the head count may be symbolic; the
      # block sizes, loop bounds and masks are planned from the lengths while tracing.
      raise NotImplementedError(
        f"{name}'s {'length' if letter != 'H' else 'head dimension'} {letter} is the symbolic "
        f"dimension {str(size)!r}: jattn plans blocks and masks from known lengths and head "
        f"sizes; export one program per length (pad to it and pass key_value_seq_lengths), "
        f"the batch B and heads N may stay symbolic"
      )
  if H == 0 or (min(T, S) == 0 and not empty_sequences):
    raise ValueError(f"empty attention: T={T}, S={S}, H={H} must all be positive")
  full = (B, N, T, S)

  if bias is not None:
    bias = _validation.float_array("bias", bias)
    bias = _validation.broadcastable("bias", bias, full, "(B, N, T, S)")
  if isinstance(mask, _masks.Mask):
    mask.validate(full)
  elif mask is not None:
    mask = _validation.mask_array(mask, full)
  if q_lengths is not None:
    q_lengths = _validation.int_vector("query_seq_lengths", q_lengths, B)
  if kv_lengths is not None:
    kv_lengths = _validation.int_vector("key_value_seq_lengths", kv_lengths, B)
  if (q_seg is None) != (kv_seg is None):
    raise ValueError(
      "q_segment_ids and kv_segment_ids must be given together, got only "
      + ("q_segment_ids" if kv_seg is None else "kv_segment_ids")
    )
  if q_seg is not None:
    q_seg = _validation.segment_ids("q_segment_ids", q_seg, B, T, "T")
    kv_seg = _validation.segment_ids("kv_segment_ids", kv_seg, B, S, "S")
  if sinks is not None:
    sinks = _validation.float_array("sinks", sinks)
    if sinks.shape != (N,):
      raise ValueError(f"sinks must have shape (N,)=({N},), got {sinks.shape}")
  q_positions, kv_positions = given.q_positions, given.kv_positions
  if q_positions is not None or kv_positions is not None:
    # Checked as `jattn.masks.positions` checks its arguments (the one error for a missing
    # half, whichever public function is called), then against the problem.
    if unbatched:  # (T,), (S,)
      q_positions, kv_positions = (
        None if x is None else jnp.asarray(x)[None] for x in (q_positions, kv_positions)
      )
    _masks.positions(q_positions, kv_positions).validate(full)
    q_positions, kv_positions = jnp.asarray(q_positions), jnp.asarray(kv_positions)
  return Arrays(
    query,
    key,
    value,
    bias,
    mask,
    q_lengths,
    kv_lengths,
    q_seg,
    kv_seg,
    sinks,
    unbatched,
    q_positions,
    kv_positions,
  )


# ---- the options ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
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
  # Also return each row's max logit over its visible keys (backends that keep it: dense,
  # chunked; see `jattn._registry.Backend.max_logits`).
  return_max_logits: bool = False
  # The contents of the tuning table that fills what the options leave open, if any (see
  # `jattn._tuning.resolve`): a new table traces the call again.
  tuning: str | None = None

  def tunable(self) -> bool:
    """Whether a tuning table may fill an option of this call."""
    given = (self.block_q, self.block_kv, self.schedule, self.step_width)
    return (self.implementation is None or None in given) and self.implementation != "dense"


class Keywords(NamedTuple):
  """The option keywords of `jattn.dot_product_attention` as the caller passed them (unchecked:
  `options` checks them); the defaults are dot_product_attention's, so a caller names only the
  keywords it takes."""

  scale: Any = None
  is_causal: Any = False
  local_window_size: Any = None
  logits_soft_cap: Any = None
  dropout_rate: Any = 0.0
  dropout_rng: Any = None
  dropout_broadcast: Any = False
  implementation: Any = None
  block_q: Any = None
  block_kv: Any = None
  schedule: Any = None
  step_width: Any = None
  return_residual: Any = False
  score_mod: Any = None
  return_max_logits: Any = False


def options(kw: Keywords, *, tuned=True):
  """(Options, scale operand or None) of the keywords ``kw``, every one checked. What they leave
  open a tuning table may fill (``tuned``), when the call is bound (`jattn._tuning.resolve`)."""
  static_scale, scale_operand = _validation.scale_operand(kw.scale)
  opts = Options(
    scale=static_scale,
    causal=_validation.causal(kw.is_causal),
    window=_validation.window(kw.local_window_size),
    logits_soft_cap=_validation.soft_cap(kw.logits_soft_cap),
    dropout_rate=_validation.dropout(kw.dropout_rate, kw.dropout_rng),
    dropout_broadcast=_validation.flag("dropout_broadcast", kw.dropout_broadcast),
    implementation=_validation.implementation(kw.implementation),
    block_q=_validation.block("block_q", kw.block_q),
    block_kv=_validation.block("block_kv", kw.block_kv),
    schedule=_validation.one_of("schedule", kw.schedule, _validation.SCHEDULES + (None,)),
    step_width=_validation.positive_int("step_width", kw.step_width, optional=True),
    return_residual=_validation.flag("return_residual", kw.return_residual),
    score_mod=_validation.score_function("score_mod", kw.score_mod),
    return_max_logits=_validation.flag("return_max_logits", kw.return_max_logits),
  )
  if tuned and opts.tunable():
    opts = dataclasses.replace(opts, tuning=_tuning.fingerprint())
  return opts, scale_operand


def static_mask(mask, opts: Options):
  """A NumPy boolean ``mask`` for a call that names a backend building its kernels from the mask
  when the call is traced (splash: its block lists) becomes a mask object known at trace time:
  part of the program instead of a run-time argument."""
  if (
    isinstance(mask, np.ndarray)
    and mask.dtype == np.bool_
    and mask.ndim <= 4
    and any(
      _registry.get(n).traced_mask for n in _validation.implementation_names(opts.implementation)
    )
  ):
    return _masks.static_array(mask)
  return mask


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
  """Where an Explicit mesh splits the sequence (else all None): ``spec`` the query's
  PartitionSpec; ``q_shards`` (mesh axes, count) when only the query's T is split (each device
  runs its rows against the whole K, V); ``kv_shards`` likewise when the query is whole and K, V
  are split along S (a decoding step against a sharded cache: each device attends to its own
  keys and the parts merge). ``unpartitioned``: the program runs on one device as written (see
  `jattn._sharding.unpartitioned`), so a kernel XLA cannot partition may stand in it."""

  spec: Any = None
  q_shards: tuple[Any, int] | None = None
  kv_shards: tuple[Any, int] | None = None
  unpartitioned: bool = True


@dataclasses.dataclass(frozen=True)
class Static:
  """The static description of a bound call (hashable: it may travel as a custom_vjp's or a
  custom_partitioning's static argument)."""

  opts: Options
  scale: float
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  Hv: int
  dtype: Any
  split: SequenceSplit
  unbatched: bool
  tuned: _tuning.Tuned = _tuning.Tuned()

  @property
  def G(self) -> int:
    return self.N // self.K if self.K != 0 else 0  # no heads (an empty call): no groups

  @property
  def stat_dtype(self):
    return _tile.stat_dtype(self.dtype)

  def block_sizes(self, T: int | None = None, S: int | None = None) -> tuple[int, int]:
    """The chunked block sizes for T query rows and S keys (the whole call's by default)."""
    return _tile.block_sizes(
      self.T if T is None else T,
      self.S if S is None else S,
      self.tuned.block_q,
      self.tuned.block_kv,
      window=self.opts.window,
    )

  def config(self, tile_shape, *, replay=False, varying_like=()):
    """(Config, score_mod's hoisted arrays) for tiles of ``tile_shape`` over this call (a
    device's part of a call has its own `Static`); ``replay``: score_mod is to be called inside
    a shard_map; ``varying_like``: the arrays (q, k) there that score_mod's arguments are typed
    device-varying like (ring attention, see `jattn._tile.closure_convert_score_mod`)."""
    score_mod, score_args = None, ()
    if self.opts.score_mod is not None:
      score_mod, score_args = _tile.closure_convert_score_mod(
        self.opts.score_mod, tile_shape, self.stat_dtype, varying_like, replay=replay
      )
      if not varying_like:
        # Already inside the shard_map (typed varying there), the arrays stay as traced.
        score_args = _sharding.replicated(score_args)
    opts = self.opts
    cfg = Config(
      B=self.B,
      T=self.T,
      S=self.S,
      K=self.K,
      G=self.G,
      H=self.H,
      scale=self.scale,
      logits_soft_cap=opts.logits_soft_cap,
      dropout_rate=opts.dropout_rate,
      score_mod=score_mod,
      dropout_broadcast=opts.dropout_broadcast,
      max_logits=opts.return_max_logits,
    )
    return cfg, score_args


class Place(NamedTuple):
  """Where one device's part of a call sits in the whole call (None: it is not cut there): the
  global position of its first query row (``q_offset``) and first key (``kv_offset``), the global
  index of its first example (``batch0``) and first query head (``head0``). Masks, score_mod and
  dropout then see the whole call's positions and indices."""

  q_offset: Any = None
  kv_offset: Any = None
  batch0: Any = None
  head0: Any = None


@dataclasses.dataclass(frozen=True)
class Call:
  """One bound call. ``query`` (B, T, N, H) (times an array scale, if given), ``key``, ``value``
  (B, S, K, H) (whole along S under an Explicit mesh: see `SequenceSplit`); ``bias`` grouped
  (B|1, K|1, G|1, T|1, S|1); ``mask`` every masking argument combined (a `jattn.masks` object, or
  None); ``seed`` dropout's (2,) words; ``sink`` (1, K, G, 1) in the statistics dtype; ``given``
  the validated arguments as passed (rank 4), for the kernels that take them as jax.nn does and
  for the parts a sharded call splits; ``place`` where the call sits when it is one device's
  part of a larger one (see `Place`; the parallel layer makes such parts)."""

  query: Any
  key: Any
  value: Any
  bias: Any
  mask: Any
  seed: Any
  sink: Any
  given: Arrays | None
  static: Static
  place: Place = Place()

  @property
  def opts(self) -> Options:
    return self.static.opts

  def head_major(self, x, groups: bool):
    """(B, L, n, X) -> (B, K, G, L, X) for the query (``groups``), (B, K, L, X) for K and V."""
    s = self.static
    x = jnp.transpose(x, (0, 2, 1, 3))
    return x.reshape(s.B, s.K, s.G, x.shape[2], x.shape[3]) if groups else x


jax.tree_util.register_dataclass(
  Call,
  data_fields=["query", "key", "value", "bias", "mask", "seed", "sink", "given", "place"],
  meta_fields=["static"],
)


def inputs_mesh(given: Given):
  """The context to bind and run the call in: the mesh its query's type carries, when no mesh
  is set. Arrays of an Explicit mesh passed to a jitted function without `jax.set_mesh` (jax.nn
  takes them) are then laid out as under it, instead of failing on a reshape whose sharding only
  the mesh decides."""
  x = given.query
  typed = hasattr(x, "shape") and hasattr(x, "dtype")  # not yet checked: may be a list
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None) if typed else None
  if _sharding.current_mesh() is not None or mesh is None or getattr(mesh, "empty", True):
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh)


def bind(given: Given, opts: Options, empty_sequences: bool = False) -> Call:
  """The arrays checked against each other and laid out for the kernels (inside jit).
  ``empty_sequences``: T = 0 or S = 0 is bound (`jattn._dispatch.run` answers it)."""
  args = arrays(given, empty_sequences)
  scale_operand = given.scale_operand
  B, T, N, H = args.query.shape
  S = args.key.shape[1]
  causal, window = opts.causal, opts.window
  if args.q_positions is not None:
    # Causality and the window are measured in positions (the mask built below), so no backend
    # may also apply them by index: the call's options no longer hold them.
    opts = dataclasses.replace(opts, causal=None, window=None)
  masked = any(
    x is not None
    for x in (args.mask, args.q_lengths, args.kv_lengths, args.q_seg, args.q_positions)
  )
  tuned = _tuning.resolve(
    opts.tuning,
    (opts.block_q, opts.block_kv, opts.schedule, opts.step_width),
    opts.implementation,
    _tuning.mask_kind(opts.causal, opts.window, masked),
    args.query.dtype,
    H,
    T,
    S,
  )
  args = _sharding.aligned_to_query(args)
  query, key, value = args.query, args.key, args.value
  split = SequenceSplit(unpartitioned=_sharding.unpartitioned())
  if _sharding.explicit_mesh():
    spec, q_shards, kv_shards = _sharding.sequence_layout(query, key, value)
    split = SequenceSplit(spec, q_shards, kv_shards, unpartitioned=split.unpartitioned)
    # Every query needs every key: K and V are gathered along S (as jax.nn's XLA path does).
    key, value = _sharding.unshard_axis(key, 1), _sharding.unshard_axis(value, 1)
  combined = _masks.from_arguments(
    (B, N, T, S),
    args.mask,
    causal,
    window,
    lengths=(args.q_lengths, args.kv_lengths),
    segment_ids=(args.q_seg, args.kv_seg),
    positions=(args.q_positions, args.kv_positions),
  )
  if scale_operand is not None:
    # A scale given as an array (traced under jit) is an operand, not a compile-time constant:
    # it scales the query (in its dtype, as splash attention folds its scale), q.k * s = (s q).k,
    # and autodiff through this product gives its gradient. The kernels then scale by 1.
    query = query * scale_operand.astype(query.dtype)
    scale = 1.0
  else:
    scale = opts.scale if opts.scale is not None else _tile.default_scale(H)
  K, Hv = value.shape[2], value.shape[3]
  static = Static(opts, scale, B, T, S, N, K, H, Hv, query.dtype, split, args.unbatched, tuned)
  bias5 = None if args.bias is None else _tile.group_heads(args.bias, K, static.G)
  sink = (
    None if args.sinks is None else args.sinks.astype(static.stat_dtype).reshape(1, K, static.G, 1)
  )
  seed = (
    _dropout.seed_words(given.dropout_rng) if opts.dropout_rate > 0 else jnp.zeros((2,), jnp.uint32)
  )
  return Call(query, key, value, bias5, combined, seed, sink, args, static)
