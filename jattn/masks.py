"""Attention masks as small lazy objects, with a per-block summary.

A mask says, for batch b, query head n, query position q and key position k, whether query q may
attend to key k (True = attend, as in ``jax.nn.dot_product_attention``). jattn never needs the
dense (B, N, T, S) boolean array: a mask is evaluated on one (q-range, kv-range) window at a time
(``mask.evaluate``), and summarised per block of a (block_q, block_kv) grid as EMPTY (nothing
visible: the block is skipped), PARTIAL (mask arithmetic needed) or FULL (everything visible: no
mask arithmetic) by ``mask.block_states``.

Structural masks (causal, window, chunked-local, prefix-LM) know their block summary from index
ranges alone, so it is computed in NumPy at trace time in O(number of blocks). Masks that depend on
data (lengths, segment ids, a boolean array, a user function) compute it at run time from per-block
ranges, still without a (T, S) array.

Masks combine with ``&``, ``|`` and ``~``. ``bool(mask)`` raises, so ``m1 and m2`` (which would
silently pick one of them) fails loudly.

Shapes: B batch, T query length, S key length, N query heads.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _sharding, _validation
from jattn._types import ArrayLike, CausalAlignment

__all__ = [
  "EMPTY",
  "FULL",
  "PARTIAL",
  "BlockGrid",
  "CausalAlignment",
  "Mask",
  "causal",
  "chunked_local",
  "from_array",
  "from_function",
  "full",
  "lengths",
  "local_window",
  "prefix_lm",
  "segments",
]

# Block states. The numeric order matters: AND of two states is their minimum, OR their maximum,
# NOT is 2 - state (see `_combine`).
EMPTY, PARTIAL, FULL = 0, 1, 2

# CausalAlignment (Literal["top_left", "bottom_right"]) is re-exported from jattn._types.


@dataclasses.dataclass(frozen=True, slots=True)
class BlockGrid:
  """A (block_q, block_kv) tiling of a (T, S) score matrix; the last blocks may be ragged."""

  T: int
  S: int
  block_q: int
  block_kv: int

  @property
  def num_q_blocks(self) -> int:
    return -(-self.T // self.block_q)

  @property
  def num_kv_blocks(self) -> int:
    return -(-self.S // self.block_kv)

  def q_ranges(self) -> tuple[np.ndarray, np.ndarray]:
    """First and one-past-last query position of every query block, shape (nq,)."""
    start = np.arange(self.num_q_blocks, dtype=np.int64) * self.block_q
    return start, np.minimum(start + self.block_q, self.T)

  def kv_ranges(self) -> tuple[np.ndarray, np.ndarray]:
    start = np.arange(self.num_kv_blocks, dtype=np.int64) * self.block_kv
    return start, np.minimum(start + self.block_kv, self.S)

  def q_blocks(self) -> tuple[np.ndarray, np.ndarray]:
    """(nq, block_q) query position of every row of every block, and whether it is < T (the
    last block's rows past T are padding)."""
    pos = np.arange(self.num_q_blocks * self.block_q, dtype=np.int32)
    return pos.reshape(self.num_q_blocks, self.block_q), (pos < self.T).reshape(
      self.num_q_blocks, self.block_q
    )

  def kv_blocks(self) -> tuple[np.ndarray, np.ndarray]:
    pos = np.arange(self.num_kv_blocks * self.block_kv, dtype=np.int32)
    return pos.reshape(self.num_kv_blocks, self.block_kv), (pos < self.S).reshape(
      self.num_kv_blocks, self.block_kv
    )


def _xp(*arrays):
  """NumPy when every array is (a summary known at trace time), else jax.numpy."""
  return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


def _summary(xp, empty, full):
  """int8 EMPTY / PARTIAL / FULL from two boolean arrays (empty wins)."""
  return xp.where(empty, EMPTY, xp.where(full, FULL, PARTIAL)).astype(xp.int8)


class Mask:
  """Base class. Subclasses are frozen dataclasses and JAX pytrees (arrays are leaves).

  Subclasses implement:
    evaluate(q_pos, kv_pos, shape): bool array broadcastable to (B, N, len(q_pos), len(kv_pos)),
      where q_pos (tq,) and kv_pos (tk,) are int32 absolute positions (possibly traced) and
      shape = (B, N, T, S) is the full problem.
    block_states(grid, shape): int8 array broadcastable to (B, N, nq, nk); a NumPy array when
      the summary is known at trace time, a jax array otherwise. The grid's ranges and block
      tables (`BlockGrid.q_ranges`, `q_blocks`, ...) are NumPy arrays for a call's own grid,
      and jax arrays when the blocks sit at run-time positions (ring attention, `remap`).
    validate(shape): raise ValueError/TypeError, at trace time, if the mask's arrays do not fit
      the call's (B, N, T, S) (same messages as the keyword arguments); masks without arrays
      fit every call.
  """

  def evaluate(self, q_pos, kv_pos, shape):  # pragma: no cover - abstract
    raise NotImplementedError

  def validate(self, shape) -> None:
    del shape

  def block_states(self, grid: BlockGrid | _TableGrid, shape):  # pragma: no cover - abstract
    raise NotImplementedError

  # What kernels and the parallel layer ask of a mask. The defaults fit a mask that is a function
  # of positions and heads holding no arrays; kinds that differ override them.

  def conjuncts(self) -> tuple[Mask, ...]:
    """The masks ANDed together to make this one (itself, unless it is an AND)."""
    return (self,)

  def band(self) -> tuple[int | None, int | None] | None:
    """(lo, hi) when this mask is the diagonal band q + lo <= k <= q + hi (None: that side
    open), else None: a kernel with its own causal or window masks takes it as one of those."""
    return None

  def ids(self) -> tuple[str, Any, Any] | None:
    """("lengths", q_lengths, kv_lengths) or ("segments", q_ids, kv_ids) for the masks made of
    per-example arrays (a kernel may take them as ids), else None."""
    return None

  def is_position_based(self) -> bool:
    """Whether this mask is a function of (batch, head, position) indices alone -- everything
    but an array laid out over the whole (T, S), which a shard's positions cannot index without
    gathering it."""
    return True

  def can_take_part(self) -> bool:
    """Whether `take_part` knows where each of this mask's arrays keeps its batch and head axes
    (by default: it holds none, so it is the same on every part)."""
    return not jax.tree.leaves(self)

  def take_part(self, cut: Cut) -> Mask:
    """This mask on one device's examples and heads (``cut``), positions unchanged."""
    return self

  def shift_indices(self, batch0, head0) -> Mask:
    """This mask with its local example and head 0 at global ``batch0`` and ``head0``."""
    return self

  def unshifted(self) -> Mask:
    """This mask with any shift of its example and head indices dropped (a single-device call
    whose shift reached it traced, see `jattn._splash`)."""
    return self

  def __and__(self, other: Mask) -> Mask:
    _check_is_mask(other, "&")
    return _And(self, other)

  def __or__(self, other: Mask) -> Mask:
    _check_is_mask(other, "|")
    return _Or(self, other)

  def __invert__(self) -> Mask:
    return _Not(self)

  def __bool__(self):
    raise TypeError(
      f"The truth value of a jattn mask ({type(self).__name__}) is ambiguous: use `m1 & m2` or "
      "`m1 | m2` to combine masks, not `and`/`or`."
    )


def _check_is_mask(other, op):
  if not isinstance(other, Mask):
    raise TypeError(f"mask {op} needs another jattn mask, got {type(other).__name__}")


@dataclasses.dataclass(frozen=True)
class Cut:
  """Examples batch0 .. batch0 + nb - 1 and query heads head0 .. head0 + nh - 1 of a problem of
  B examples and N heads (``batch0`` and ``head0`` may be traced)."""

  batch0: Any
  nb: int
  head0: Any
  nh: int
  B: int
  N: int

  def examples(self, x, axis: int = 0):
    return _cut(x, axis, self.batch0, self.nb, self.B)

  def heads(self, x, axis: int = 1):
    return _cut(x, axis, self.head0, self.nh, self.N)


def _cut(x, axis, start, n, whole):
  if x is None or n == whole or jnp.ndim(x) <= axis or jnp.shape(x)[axis] != whole:
    return x  # absent, not split, or broadcast along this axis
  return jax.lax.dynamic_slice_in_dim(jnp.asarray(x), start, n, axis)


def _register(cls, data_fields=()):
  """Frozen dataclass + pytree: `data_fields` are array leaves, the rest is static structure."""
  meta = [f.name for f in dataclasses.fields(cls) if f.name not in data_fields]
  return jax.tree_util.register_dataclass(cls, data_fields=list(data_fields), meta_fields=meta)


# --------------------------------------------------------------------------------------------
# Structural masks: a band of diagonals  q + lo <= k <= q + hi.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, eq=True)
class _Band(Mask):
  """Keys k with ``q + lo <= k <= q + hi`` (``None`` = unbounded on that side).

  Causal attention is ``lo=None, hi=offset``; a (left, right) window around the diagonal at
  ``offset`` is ``lo=offset-left, hi=offset+right``. The intersection of two bands is a band, so
  ``causal & window`` stays exact.
  """

  lo: int | None
  hi: int | None

  def evaluate(self, q_pos, kv_pos, shape):
    q = q_pos[:, None]
    k = kv_pos[None, :]
    ok = jnp.ones((q_pos.shape[0], kv_pos.shape[0]), bool)
    if self.lo is not None:
      ok = ok & (k >= q + self.lo)
    if self.hi is not None:
      ok = ok & (k <= q + self.hi)
    return ok[None, None]

  def block_states(self, grid, shape):
    q0, q1 = grid.q_ranges()
    k0, k1 = grid.kv_ranges()
    xp = _xp(q0, k0)
    q0, q1 = q0[:, None], q1[:, None] - 1  # inclusive last query
    k0, k1 = k0[None, :], k1[None, :] - 1  # inclusive last key
    full = xp.ones((q0.shape[0], k0.shape[1]), bool)
    empty = xp.zeros((q0.shape[0], k0.shape[1]), bool)
    # Every (q, k) in the block lies inside the band: the tightest corners are inside. No
    # (q, k) inside: the keys are all left of the left edge for the last query (q1 + lo), or
    # all right of the right edge for the first query's reach (q0 + hi).
    if self.lo is not None:
      full = full & (k0 >= q1 + self.lo)
      empty = empty | (k1 < q0 + self.lo)
    if self.hi is not None:
      full = full & (k1 <= q0 + self.hi)
      empty = empty | (k0 > q1 + self.hi)
    return _summary(xp, empty, full)[None, None]

  def band(self):
    return self.lo, self.hi

  def __and__(self, other):
    if isinstance(other, _Band):
      return _Band(_max_opt(self.lo, other.lo), _min_opt(self.hi, other.hi))
    return Mask.__and__(self, other)


def _max_opt(a, b):
  return b if a is None else a if b is None else max(a, b)


def _min_opt(a, b):
  return b if a is None else a if b is None else min(a, b)


_register(_Band)


def band(lo: int | None, hi: int | None) -> Mask:
  """Keys k with ``q + lo <= k <= q + hi`` (``None``: unbounded on that side): the diagonal band
  that causal masks and windows are made of, given by its two edges."""
  return _Band(
    _validation.integer("band: lo", lo, optional=True),
    _validation.integer("band: hi", hi, optional=True),
  )


def _alignment_offset(alignment: str, shape) -> int:
  T, S = shape[2], shape[3]
  if alignment == "top_left":
    return 0
  if alignment == "bottom_right":
    return S - T
  raise ValueError(f"alignment must be 'top_left' or 'bottom_right', got {alignment!r}")


def causal(
  shape: Sequence[int] | None = None,
  *,
  alignment: CausalAlignment = "top_left",
  offset: int | ArrayLike | None = None,
) -> Mask:
  """Causal mask: query q sees keys k <= q + offset.

  ``alignment="top_left"`` (offset 0) is `jax.nn`'s convention: query i sees keys <= i.
  ``alignment="bottom_right"`` (offset S - T) aligns the last query with the last key, the
  convention for decoding with a KV cache and for chunked prefill; it needs ``shape`` (B, N, T, S)
  or ``(T, S)``. An explicit ``offset`` overrides the alignment; an int array offset (shape () or
  (B,)) gives a run-time diagonal, e.g. the fill level of a KV cache under `jit`.
  """
  _validation.one_of("masks.causal: alignment", alignment, _validation.CAUSAL_ALIGNMENTS)
  if shape is not None:
    if not isinstance(shape, (tuple, list)) or not all(_validation.is_int(d) for d in shape):
      raise TypeError(
        f"masks.causal: shape must be a (T, S) or (B, N, T, S) tuple of ints, got "
        f"{_validation.describe(shape)}"
      )
    if len(shape) not in (2, 4) or any(d < 0 for d in shape):
      raise ValueError(
        f"masks.causal: shape must be a (T, S) or (B, N, T, S) tuple of "
        f"non-negative ints, got {tuple(shape)}"
      )
  if offset is None and alignment == "bottom_right" and shape is None:
    raise ValueError(
      "masks.causal: alignment='bottom_right' needs shape, the problem's (T, S) "
      "or (B, N, T, S) (or an explicit offset), got shape=None"
    )
  if offset is None:
    offset = 0 if alignment == "top_left" else _alignment_offset(alignment, _shape4(shape))
  if _validation.is_int(offset):
    return _Band(None, int(offset))  # type: ignore[arg-type]  # is_int: an int or an int array of shape ()
  expected = "an int or an integer array of shape () or (B,)"
  if not hasattr(offset, "dtype") and not isinstance(offset, (list, tuple)):
    raise TypeError(f"masks.causal: offset must be {expected}, got {_validation.describe(offset)}")
  offsets = _validation.int_array("masks.causal: offset", offset)
  if offsets.ndim > 1:
    raise ValueError(f"masks.causal: offset must be {expected}, got shape {offsets.shape}")
  return _DynamicCausal(offsets)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _DynamicCausal(Mask):
  """Causal with a run-time diagonal: query q sees keys k <= q + offset[b].

  For decoding with a KV cache under `jit`: the T new queries sit at cache positions
  offset[b] .. offset[b] + T - 1 of a fixed-size cache, so the offset is the cache's fill level
  and changes every step without recompiling.
  """

  offset: Any  # int32 (B,) or ()

  def validate(self, shape):
    B = shape[0]
    if self.offset.ndim == 1 and self.offset.shape[0] not in (1, B):
      raise ValueError(
        f"masks.causal: offset must be an int or an int array of shape () or "
        f"(B,)=({B},), got shape {self.offset.shape}"
      )

  def can_take_part(self):
    return True

  def take_part(self, cut):
    return _DynamicCausal(cut.examples(self.offset))

  def evaluate(self, q_pos, kv_pos, shape):
    off = jnp.reshape(self.offset, (-1, 1, 1)).astype(jnp.int32)
    return (kv_pos[None, None, :] <= q_pos[None, :, None] + off)[:, None]

  def block_states(self, grid, shape):
    off = jnp.reshape(self.offset, (-1, 1, 1)).astype(jnp.int32)
    q0, q1 = (jnp.asarray(a, jnp.int32) for a in grid.q_ranges())
    k0, k1 = (jnp.asarray(a, jnp.int32) for a in grid.kv_ranges())
    full = k1[None, None, :] - 1 <= q0[None, :, None] + off
    empty = k0[None, None, :] > q1[None, :, None] - 1 + off
    return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)[:, None]


_register(_DynamicCausal, data_fields=("offset",))


_SAME = object()


def local_window(left: int | None, right: int | object | None = _SAME, *, offset: int = 0) -> Mask:
  """Sliding window: query q sees keys with ``q + offset - left <= k <= q + offset + right``.

  One int means the same on both sides, as jax.nn's ``local_window_size=w``:
  ``local_window(w)`` is ``local_window(w, w)`` and equals ``local_window_size=w``;
  ``local_window(3, 2)`` is ``local_window_size=(3, 2)``. ``None`` on a side means unbounded.
  Causal sliding-window attention is ``local_window(w, 0)`` (or ``causal() & local_window(w)``).
  """
  before = _validation.non_negative_int("masks.local_window: left", left, optional=True)
  after = _validation.non_negative_int(
    "masks.local_window: right", left if right is _SAME else right, optional=True
  )
  offset = _validation.integer("masks.local_window: offset", offset)
  return _Band(
    None if before is None else offset - before, None if after is None else offset + after
  )


def _shape4(shape):
  if shape is None:
    raise ValueError("bottom_right alignment needs the problem shape (T, S) or (B, N, T, S)")
  shape = tuple(shape)
  return (1, 1) + shape if len(shape) == 2 else shape


# --------------------------------------------------------------------------------------------
# Chunked-local and prefix-LM: static, but not bands.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _ChunkedLocal(Mask):
  """Query q sees keys in the same fixed-size chunk: q // chunk == k // chunk (Llama 4)."""

  chunk: int

  def evaluate(self, q_pos, kv_pos, shape):
    return ((q_pos[:, None] // self.chunk) == (kv_pos[None, :] // self.chunk))[None, None]

  def block_states(self, grid, shape):
    q0, q1 = grid.q_ranges()
    k0, k1 = grid.kv_ranges()
    qc0, qc1 = q0[:, None] // self.chunk, (q1[:, None] - 1) // self.chunk
    kc0, kc1 = k0[None, :] // self.chunk, (k1[None, :] - 1) // self.chunk
    empty = (qc1 < kc0) | (kc1 < qc0)
    full = (qc0 == qc1) & (kc0 == kc1) & (qc0 == kc0)
    return _summary(_xp(q0, k0), empty, full)[None, None]


_register(_ChunkedLocal)


def chunked_local(chunk_size: int) -> Mask:
  """Attend only within fixed chunks of ``chunk_size`` positions (combine with causal)."""
  return _ChunkedLocal(_validation.positive_int("masks.chunked_local: chunk_size", chunk_size))


@dataclasses.dataclass(frozen=True, slots=True)
class _Prefix(Mask):
  """Keys k < prefix are visible to every query (the bidirectional prefix of a prefix-LM)."""

  prefix: int

  def evaluate(self, q_pos, kv_pos, shape):
    return jnp.broadcast_to(kv_pos[None, :] < self.prefix, (q_pos.shape[0], kv_pos.shape[0]))[
      None, None
    ]

  def block_states(self, grid, shape):
    k0, k1 = grid.kv_ranges()
    xp = _xp(k0)
    st = _summary(xp, k0 >= self.prefix, k1 <= self.prefix)
    return xp.broadcast_to(st[None, :], (grid.num_q_blocks, st.shape[0]))[None, None]


_register(_Prefix)


def prefix_lm(prefix_length: int, *, offset: int = 0) -> Mask:
  """Prefix-LM: the first ``prefix_length`` keys are seen by all queries, the rest causally."""
  prefix_length = _validation.non_negative_int("masks.prefix_lm: prefix_length", prefix_length)
  offset = _validation.integer("masks.prefix_lm: offset", offset)
  return _Prefix(prefix_length) | _Band(None, offset)


@dataclasses.dataclass(frozen=True, slots=True)
class _Full(Mask):
  """Everything visible (the neutral element of `&`)."""

  def evaluate(self, q_pos, kv_pos, shape):
    return jnp.ones((1, 1, q_pos.shape[0], kv_pos.shape[0]), bool)

  def block_states(self, grid, shape):
    return np.full((1, 1, grid.num_q_blocks, grid.num_kv_blocks), FULL, np.int8)

  def band(self):
    return None, None


_register(_Full)


def full() -> Mask:
  """The mask that hides nothing."""
  return _Full()


# --------------------------------------------------------------------------------------------
# Data-dependent masks: the arrays are pytree leaves, the summary is computed at run time.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Lengths(Mask):
  """Padding: query q < q_lengths[b] and key k < kv_lengths[b] (either may be None)."""

  q_lengths: Any
  kv_lengths: Any

  def validate(self, shape):

    _validation.int_vector("masks.lengths: q_lengths", self.q_lengths, shape[0], checked=True)
    _validation.int_vector("masks.lengths: kv_lengths", self.kv_lengths, shape[0], checked=True)

  def ids(self):
    return "lengths", self.q_lengths, self.kv_lengths

  def can_take_part(self):
    return True

  def take_part(self, cut):
    return _Lengths(cut.examples(self.q_lengths), cut.examples(self.kv_lengths))

  def evaluate(self, q_pos, kv_pos, shape):
    ok = jnp.ones((1, q_pos.shape[0], kv_pos.shape[0]), bool)
    if self.q_lengths is not None:
      ok = ok & (q_pos[None, :, None] < self.q_lengths[:, None, None])
    if self.kv_lengths is not None:
      ok = ok & (kv_pos[None, None, :] < self.kv_lengths[:, None, None])
    return ok[:, None]

  def block_states(self, grid, shape):
    full = jnp.ones((1, grid.num_q_blocks, grid.num_kv_blocks), bool)
    empty = jnp.zeros((1, grid.num_q_blocks, grid.num_kv_blocks), bool)
    for lens, (lo, hi), axis in (
      (self.q_lengths, grid.q_ranges(), 2),
      (self.kv_lengths, grid.kv_ranges(), 1),
    ):
      if lens is None:
        continue
      lo = jnp.asarray(lo, jnp.int32)
      hi = jnp.asarray(hi, jnp.int32)
      lens = lens[:, None].astype(jnp.int32)
      f = jnp.expand_dims(hi[None, :] <= lens, axis)
      e = jnp.expand_dims(lo[None, :] >= lens, axis)
      full = full & f
      empty = empty | e
    return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)[:, None]


_register(_Lengths, data_fields=("q_lengths", "kv_lengths"))


def lengths(q_lengths: ArrayLike | None = None, kv_lengths: ArrayLike | None = None) -> Mask:
  """Padding mask from per-example valid lengths, int arrays of shape (B,)."""
  return _Lengths(
    _int_array("masks.lengths: q_lengths", q_lengths),
    _int_array("masks.lengths: kv_lengths", kv_lengths),
  )


def _int_array(name, x):
  """An integer array (or None); floats are refused here, where the mask is built (TypeError).
  Shapes are checked against the call, by ``validate`` (ValueError)."""
  return _validation.int_array(name, x, optional=True)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Segments(Mask):
  """Packed documents: query q sees key k iff q_ids[b, q] == kv_ids[b, k]."""

  q_ids: Any
  kv_ids: Any

  def validate(self, shape):

    B, _, T, S = shape
    _validation.segment_ids("masks.segments: q_segment_ids", self.q_ids, B, T, "T", checked=True)
    _validation.segment_ids("masks.segments: kv_segment_ids", self.kv_ids, B, S, "S", checked=True)

  def ids(self):
    return "segments", self.q_ids, self.kv_ids

  def can_take_part(self):
    return True

  def take_part(self, cut):
    return _Segments(cut.examples(self.q_ids), cut.examples(self.kv_ids))

  def evaluate(self, q_pos, kv_pos, shape):
    qi = jnp.take(self.q_ids, q_pos, axis=1, mode="fill", fill_value=-1)
    ki = jnp.take(self.kv_ids, kv_pos, axis=1, mode="fill", fill_value=-2)
    return (qi[:, :, None] == ki[:, None, :])[:, None]

  def block_states(self, grid, shape):
    # Per-block id ranges. Two blocks can share a document only if their [min, max] id ranges
    # meet; that is exact for sorted ids (packed documents) and still sound for unsorted ones.
    qmin, qmax = _block_min_max(self.q_ids, *grid.q_blocks())
    kmin, kmax = _block_min_max(self.kv_ids, *grid.kv_blocks())
    qmin, qmax = qmin[:, :, None], qmax[:, :, None]
    kmin, kmax = kmin[:, None, :], kmax[:, None, :]
    empty = (qmax < kmin) | (kmax < qmin)
    full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
    return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)[:, None]


def _block_min_max(ids, positions, valid):
  """(B, n) min and max of the (B, L) ids over each block's valid positions ((n, block))."""
  blocks = jnp.take(ids, jnp.asarray(positions), axis=1, mode="clip")  # (B, n, block)
  valid = jnp.asarray(valid)[None]
  return (
    jnp.where(valid, blocks, jnp.iinfo(ids.dtype).max).min(-1),
    jnp.where(valid, blocks, jnp.iinfo(ids.dtype).min).max(-1),
  )


_register(_Segments, data_fields=("q_ids", "kv_ids"))


# Positions given to blocks past the sequence's end: far apart, so no window reaches across
# them, yet far from int32's ends, so q - k cannot overflow.
_FAR = 1 << 29


def visible_by_position(q, k, causal: bool, window):
  """Whether queries at positions ``q`` see keys at positions ``k`` (broadcast): causality and a
  (left, right) window measured in positions. The one statement of the rule: the positions
  mask and the paged walks and kernels (`jattn._paged_fold`) use it."""
  ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q), jnp.shape(k)), bool)
  if causal:
    ok = ok & (k <= q)
  if window is not None:
    left, right = window
    if left is not None:
      ok = ok & (k >= q - left)
    if right is not None:
      ok = ok & (k <= q + right)
  return ok


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Positions(Mask):
  """Causality and a window measured in positions, not array indices: query t of example b sits
  at q_positions[b, t], key s at kv_positions[b, s]. Key k is visible to query q iff
  kv <= q (causal) and q - left <= kv <= q + right (window; None on a side: unbounded).

  What a cache with padding inside needs (prompts of different lengths in one buffer, each
  left-padded), and packed sequences whose positions restart. Blocks are skipped from each
  block's range of positions (its min and max), so nothing of size (T, S) is built."""

  q_positions: Any
  kv_positions: Any
  causal: bool = True
  window: tuple | None = None

  def validate(self, shape):
    B, _, T, S = shape
    _validation.segment_ids(
      "masks.positions: q_positions", self.q_positions, B, T, "T", checked=True
    )
    _validation.segment_ids(
      "masks.positions: kv_positions", self.kv_positions, B, S, "S", checked=True
    )

  def can_take_part(self):
    return True

  def take_part(self, cut):
    return _Positions(
      cut.examples(self.q_positions), cut.examples(self.kv_positions), self.causal, self.window
    )

  def _visible(self, q, k):
    """Visibility of keys at positions k from queries at positions q (broadcast)."""
    return visible_by_position(q, k, self.causal, self.window)

  def evaluate(self, q_pos, kv_pos, shape):
    q = jnp.take(self.q_positions.astype(jnp.int32), q_pos, axis=1, mode="fill", fill_value=-_FAR)
    k = jnp.take(self.kv_positions.astype(jnp.int32), kv_pos, axis=1, mode="fill", fill_value=_FAR)
    ok = self._visible(q[:, :, None], k[:, None, :])
    # A query or key past the arrays (a block's padding) sees nothing.
    ok = ok & (q > -_FAR)[:, :, None] & (k < _FAR)[:, None, :]
    return ok[:, None]

  def block_states(self, grid, shape):
    qmin, qmax = _block_min_max(self.q_positions.astype(jnp.int32), *grid.q_blocks())
    kmin, kmax = _block_min_max(self.kv_positions.astype(jnp.int32), *grid.kv_blocks())
    qmin, qmax = qmin[:, :, None], qmax[:, :, None]
    kmin, kmax = kmin[:, None, :], kmax[:, None, :]
    # Every pair of a block sees the other iff its extreme pairs do (each condition is one
    # inequality between q and k); none does iff the closest pairs do not.
    full = jnp.ones(jnp.broadcast_shapes(qmin.shape, kmin.shape), bool)
    empty = jnp.zeros_like(full)
    if self.causal:
      full, empty = full & (kmax <= qmin), empty | (kmin > qmax)
    if self.window is not None:
      left, right = self.window
      if left is not None:
        full, empty = full & (kmin >= qmax - left), empty | (kmax < qmin - left)
      if right is not None:
        full, empty = full & (kmax <= qmin + right), empty | (kmin > qmax + right)
    return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int8)[:, None]


_register(_Positions, data_fields=("q_positions", "kv_positions"))


def positions(
  q_positions: ArrayLike,
  kv_positions: ArrayLike,
  *,
  causal: bool = True,
  window: int | tuple | None = None,
) -> Mask:
  """Causality and a ``window`` (``w`` or ``(left, right)``, as ``local_window_size``)
  measured in positions: int arrays q_positions (B, T) and kv_positions (B, S). Combine with
  `lengths` or `segments` to hide padding (a position alone does not say a slot is empty)."""
  q = _int_array("masks.positions: q_positions", q_positions)
  kv = _int_array("masks.positions: kv_positions", kv_positions)
  if q is None or kv is None:
    raise TypeError("masks.positions needs both q_positions and kv_positions (int arrays)")
  return _Positions(q, kv, bool(causal), _validation.window(window))


def segments(q_segment_ids: ArrayLike, kv_segment_ids: ArrayLike | None = None) -> Mask:
  """Packed-document mask from integer segment ids, q (B, T) and kv (B, S)."""
  q = _int_array("masks.segments: q_segment_ids", q_segment_ids)
  kv = q if kv_segment_ids is None else _int_array("masks.segments: kv_segment_ids", kv_segment_ids)
  return _Segments(q, kv)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _ArrayMask(Mask):
  """A boolean array broadcastable to (B, N, T, S), as jax.nn's ``mask`` argument."""

  array: Any

  def validate(self, shape):

    _validation.broadcastable("masks.from_array: mask", self.array, shape, "(B, N, T, S)")

  def is_position_based(self):
    return False

  def can_take_part(self):
    return True

  def take_part(self, cut):
    return _array_part(self, cut)

  def evaluate(self, q_pos, kv_pos, shape):
    a = self.array
    if a.shape[2] != 1:
      a = jnp.take(a, q_pos, axis=2, mode="fill", fill_value=False)
    if a.shape[3] != 1:
      a = jnp.take(a, kv_pos, axis=3, mode="fill", fill_value=False)
    return a

  def block_states(self, grid, shape):
    return _array_block_states(jnp, self.array, grid)


def _array_block_states(xp, a, grid):
  """EMPTY/PARTIAL/FULL per block of a (b, n, t, s) boolean array (t, s: 1 or the full length),
  in NumPy for an array known at trace time, else in jax. On a `_TableGrid` (a `remap`ped mask)
  the array's rows and columns are first taken where the kernel's rows sit."""
  if isinstance(grid, _TableGrid):
    a, grid, xp = _table_rows(a, grid), grid.grid, jnp
  b, n, t, s = a.shape
  nq = grid.num_q_blocks if t != 1 else 1
  nk = grid.num_kv_blocks if s != 1 else 1
  bq = grid.block_q if t != 1 else 1
  bk = grid.block_kv if s != 1 else 1
  # Padding positions count as "visible" for FULL and "hidden" for EMPTY: they are neither.
  pad = ((0, 0), (0, 0), (0, nq * bq - t), (0, nk * bk - s))
  # Under an Explicit mesh a traced mask sharded along B or N keeps that sharding (_sharding's
  # reshape spells it out: jnp's cannot infer it for a split of T and S).
  blocks = (
    (lambda x: x.reshape(b, n, nq, bq, nk, bk))
    if xp is np
    else (lambda x: _sharding.reshape(x, (b, n, nq, bq, nk, bk)))
  )
  anyv = blocks(xp.pad(a, pad, constant_values=False)).any(axis=(3, 5))
  allv = blocks(xp.pad(a, pad, constant_values=True)).all(axis=(3, 5))
  return _summary(xp, ~anyv, allv)


def _array_part(mask, cut: Cut) -> Mask:
  """An array mask's examples and heads of ``cut`` (the mask itself where it has none to cut)."""
  a = mask.array
  if (cut.nb == cut.B or a.shape[0] != cut.B) and (cut.nh == cut.N or a.shape[1] != cut.N):
    return mask
  return _ArrayMask(cut.heads(cut.examples(a)))


def _table_rows(a, grid):
  """The rows (axis 2) and columns (axis 3) of a (b, n, t, s) array at a `_TableGrid`'s
  positions (of its T and S valid rows; axes of length 1 stay)."""
  a = jnp.asarray(a)
  if a.shape[2] != 1:
    a = jnp.take(a, grid.q_table[: grid.grid.T], axis=2, mode="clip")
  if a.shape[3] != 1:
    a = jnp.take(a, grid.kv_table[: grid.grid.S], axis=3, mode="clip")
  return a


_register(_ArrayMask, data_fields=("array",))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _StaticArrayMask(Mask):
  """A boolean NumPy array known when the call is traced, kept out of the traced arguments:
  part of the compiled program (a new array compiles anew), so its block map is static. What
  a kernel that needs the mask when it is built takes (splash attention)."""

  array: np.ndarray
  digest: str

  def validate(self, shape):

    _validation.broadcastable("mask", self.array, shape, "(B, N, T, S)")

  def take_part(self, cut):
    return _array_part(self, cut)

  def evaluate(self, q_pos, kv_pos, shape):
    return _ArrayMask(jnp.asarray(self.array)).evaluate(q_pos, kv_pos, shape)

  def block_states(self, grid, shape):
    return _array_block_states(np, self.array, grid)

  def __eq__(self, other):
    return isinstance(other, _StaticArrayMask) and self.digest == other.digest

  def __hash__(self):
    return hash(("static array", self.digest))


# No array leaves: the whole mask is static structure, compared and hashed by its digest.
jax.tree_util.register_pytree_node(_StaticArrayMask, lambda m: ((), m), lambda m, _: m)


def static_array(mask: np.ndarray) -> Mask:
  """``mask`` (a boolean NumPy array of rank <= 4 broadcastable to (B, N, T, S)) as a mask
  known at trace time (see `_StaticArrayMask`)."""
  import hashlib

  m = np.asarray(mask)
  m = m.reshape((1,) * (4 - m.ndim) + m.shape)
  digest = hashlib.sha1(repr(m.shape).encode() + np.packbits(m).tobytes()).hexdigest()
  return _StaticArrayMask(m, digest)


def from_array(mask: ArrayLike) -> Mask:
  """Wrap a boolean array broadcastable to (B, N, T, S) (True = attend)."""
  m = _validation.bool_array("masks.from_array: mask", mask, "a boolean array (True = attend)")
  if m.ndim > 4:
    raise ValueError(
      f"masks.from_array: mask must have rank <= 4, broadcastable to "
      f"(B, N, T, S), got shape {m.shape}"
    )
  return _ArrayMask(m.reshape((1,) * (4 - m.ndim) + m.shape))


@dataclasses.dataclass(frozen=True, slots=True)
class _FnMask(Mask):
  """A user predicate ``fn(batch, head, q_index, kv_index) -> bool`` written with jnp ops.

  The four index arguments are int32 arrays broadcastable against each other, of shapes
  (B,1,1,1), (1,N,1,1), (1,1,tq,1), (1,1,1,tk). Its block summary is evaluated block by block at
  run time (one (B, N, block_q, block_kv) window at a time, never a (T, S) array).
  """

  fn: Callable
  # Global index of local batch element 0 and query head 0 (one shard of a ring call).
  batch0: Any = 0
  head0: Any = 0

  def can_take_part(self):
    return True

  def take_part(self, cut):
    return self.shift_indices(cut.batch0, cut.head0)

  def shift_indices(self, batch0, head0):
    # Added to the mask's own shift (one already cut to a device's examples and heads).
    return _FnMask(self.fn, self.batch0 + batch0, self.head0 + head0)

  def unshifted(self):
    return dataclasses.replace(self, batch0=0, head0=0)

  def evaluate(self, q_pos, kv_pos, shape):
    B, N = shape[0], shape[1]
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None] + self.batch0
    h = jnp.arange(N, dtype=jnp.int32)[None, :, None, None] + self.head0
    out = self.fn(b, h, q_pos[None, None, :, None], kv_pos[None, None, None, :])
    out = jnp.asarray(out)
    if out.dtype != jnp.bool_:
      raise TypeError(f"mask_fn must return booleans, got dtype {out.dtype}")
    return jnp.broadcast_to(out, (B, N, q_pos.shape[0], kv_pos.shape[0]))

  def block_states(self, grid, shape):
    nq, nk = grid.num_q_blocks, grid.num_kv_blocks
    q_pos, q_ok = (jnp.asarray(a) for a in grid.q_blocks())
    kv_pos, kv_ok = (jnp.asarray(a) for a in grid.kv_blocks())

    def one(ij):
      i, j = ij // nk, ij % nk
      q, k = q_pos[i], kv_pos[j]
      inside = (q_ok[i][:, None] & kv_ok[j][None, :])[None, None]
      m = self.evaluate(q, k, shape)
      anyv = (m & inside).any(axis=(2, 3))
      allv = (m | ~inside).all(axis=(2, 3))
      return jnp.where(anyv, jnp.where(allv, FULL, PARTIAL), EMPTY).astype(jnp.int8)

    st = jax.lax.map(one, jnp.arange(nq * nk, dtype=jnp.int32))  # (nq*nk, B, N)
    return jnp.moveaxis(st.reshape(nq, nk, *st.shape[1:]), (0, 1), (2, 3))


_register(_FnMask, data_fields=("batch0", "head0"))


def from_function(mask_fn: Callable) -> Mask:
  """Mask from ``mask_fn(batch, head, q_index, kv_index) -> bool`` (jnp ops, broadcasting)."""
  return _FnMask(_validation.function("masks.from_function: mask_fn", mask_fn))


# --------------------------------------------------------------------------------------------
# Combinations.
# --------------------------------------------------------------------------------------------


def _combine(op, a, b):
  """Combine block states; stays NumPy when both sides are static."""
  xp = np if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) else jnp
  if op == "and":
    return xp.minimum(a, b)
  return xp.maximum(a, b)


class _Composite(Mask):
  """A mask made of masks (`&`, `|`, `~`): each question goes to its parts."""

  __slots__ = ()

  def parts(self) -> tuple[Mask, ...]:  # pragma: no cover - abstract
    raise NotImplementedError

  def rebuilt(self, parts) -> Mask:  # pragma: no cover - abstract
    raise NotImplementedError

  def validate(self, shape):
    for m in self.parts():
      m.validate(shape)

  def is_position_based(self):
    return all(m.is_position_based() for m in self.parts())

  def can_take_part(self):
    return all(m.can_take_part() for m in self.parts())

  def take_part(self, cut):
    return self.rebuilt([m.take_part(cut) for m in self.parts()])

  def shift_indices(self, batch0, head0):
    return self.rebuilt([m.shift_indices(batch0, head0) for m in self.parts()])

  def unshifted(self):
    return self.rebuilt([m.unshifted() for m in self.parts()])


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _And(_Composite):
  a: Mask
  b: Mask

  def parts(self):
    return self.a, self.b

  def rebuilt(self, parts):
    return _And(*parts)

  def conjuncts(self):
    return self.a.conjuncts() + self.b.conjuncts()

  def evaluate(self, q_pos, kv_pos, shape):
    return self.a.evaluate(q_pos, kv_pos, shape) & self.b.evaluate(q_pos, kv_pos, shape)

  def block_states(self, grid, shape):
    return _combine("and", self.a.block_states(grid, shape), self.b.block_states(grid, shape))

  def __hash__(self):
    return hash(("and", self.a, self.b))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Or(_Composite):
  a: Mask
  b: Mask

  def parts(self):
    return self.a, self.b

  def rebuilt(self, parts):
    return _Or(*parts)

  def evaluate(self, q_pos, kv_pos, shape):
    return self.a.evaluate(q_pos, kv_pos, shape) | self.b.evaluate(q_pos, kv_pos, shape)

  def block_states(self, grid, shape):
    return _combine("or", self.a.block_states(grid, shape), self.b.block_states(grid, shape))

  def __hash__(self):
    return hash(("or", self.a, self.b))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Not(_Composite):
  a: Mask

  def parts(self):
    return (self.a,)

  def rebuilt(self, parts):
    return _Not(*parts)

  def evaluate(self, q_pos, kv_pos, shape):
    return ~self.a.evaluate(q_pos, kv_pos, shape)

  def block_states(self, grid, shape):
    st = self.a.block_states(grid, shape)
    return (2 - st).astype(np.int8) if isinstance(st, np.ndarray) else (2 - st).astype(jnp.int8)

  def __hash__(self):
    return hash(("not", self.a))


# Combinations hold masks, which may hold arrays: their children are pytree leaves-or-nodes.
jax.tree_util.register_dataclass(_And, data_fields=["a", "b"], meta_fields=[])
jax.tree_util.register_dataclass(_Or, data_fields=["a", "b"], meta_fields=[])
jax.tree_util.register_dataclass(_Not, data_fields=["a"], meta_fields=[])


# --------------------------------------------------------------------------------------------
# The call's masking keywords as one mask.
# --------------------------------------------------------------------------------------------


def keyword_band(shape, causal=None, window=None) -> tuple[int | None, int | None] | None:
  """The diagonal band ``lo <= k - q <= hi`` of ``is_causal`` and ``local_window_size`` on a
  (.., T, S) problem, or None when neither is given. The alignment sets the diagonal both are
  measured from: 0 (top-left) or S - T (bottom-right)."""
  if causal is None and window is None:
    return None
  offset = 0 if causal in (None, "top_left") else shape[3] - shape[2]
  lo = hi = None
  if causal is not None:
    hi = offset
  if window is not None:
    left, right = window
    lo = None if left is None else offset - left
    if right is not None:
      hi = offset + right if hi is None else min(hi, offset + right)
  return lo, hi


def from_arguments(
  shape,
  mask=None,
  causal=None,
  window=None,
  *,
  q_lengths=None,
  kv_lengths=None,
  q_segment_ids=None,
  kv_segment_ids=None,
):
  """Turn the keyword arguments into one `jattn.masks` object (None when nothing is hidden).

  The keywords are thin ways to build mask objects, so every implementation sees one mechanism.
  The arrays are the call's, checked already (`jattn._call.arrays`), so they are not again.
  """
  parts = []
  if mask is not None:
    parts.append(mask if isinstance(mask, Mask) else _ArrayMask(mask))
  lohi = keyword_band(shape, causal, window)
  if lohi is not None:
    parts.append(_Band(*lohi))
  if q_lengths is not None or kv_lengths is not None:
    parts.append(_Lengths(q_lengths, kv_lengths))
  if q_segment_ids is not None:
    parts.append(_Segments(q_segment_ids, kv_segment_ids))
  return combine(parts)


def combine(parts):
  """The AND of a list of masks (None entries skipped); None when nothing is left."""
  parts = [p for p in parts if p is not None]
  return functools.reduce(lambda a, b: a & b, parts) if parts else None


# --------------------------------------------------------------------------------------------
# A mask for one device's examples and heads (the chunked kernels partitioned under an Auto mesh).
# --------------------------------------------------------------------------------------------


def can_take_part(mask: Mask | None) -> bool:
  """Whether `take_part` knows where every array of ``mask`` keeps its batch and head axes."""
  return mask is None or mask.can_take_part()


def take_part(mask: Mask | None, batch0, nb: int, head0, nh: int, shape) -> Mask | None:
  """``mask`` of the (B, N, T, S) problem ``shape`` restricted to batch elements
  batch0 .. batch0 + nb - 1 and query heads head0 .. head0 + nh - 1 (``batch0`` and ``head0``
  may be traced). Positions along T and S are unchanged (see `remap` for those)."""
  return None if mask is None else mask.take_part(Cut(batch0, nb, head0, nh, shape[0], shape[1]))


# --------------------------------------------------------------------------------------------
# A mask at other positions: one shard of a sequence (ring attention).
# --------------------------------------------------------------------------------------------


def is_position_based(mask: Mask) -> bool:
  """See `Mask.is_position_based`."""
  return mask.is_position_based()


def remap(mask: Mask, q_table, kv_table, batch0=0, head0=0) -> Mask:
  """``mask`` evaluated where a kernel's rows sit in the problem it was built for.

  Local query row r (key row c) of the kernel is position ``q_table[r]`` (``kv_table[c]``) of
  that problem, and local batch element / query head 0 is ``batch0`` / ``head0``. Ring attention
  builds the mask once on global positions and remaps it for every pair of shards. Block
  summaries come from each block's [min, max] of global positions: exact for blocks of
  consecutive positions, and sound (only more PARTIAL) for a block that straddles a jump.
  """
  return _Remapped(
    mask.shift_indices(batch0, head0),
    jnp.asarray(q_table, jnp.int32),
    jnp.asarray(kv_table, jnp.int32),
  )


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Remapped(Mask):
  mask: Mask
  q_table: Any  # (Tp,) int32
  kv_table: Any  # (Sp,) int32

  def evaluate(self, q_pos, kv_pos, shape):
    return self.mask.evaluate(
      jnp.take(self.q_table, q_pos, mode="clip"),
      jnp.take(self.kv_table, kv_pos, mode="clip"),
      shape,
    )

  def block_states(self, grid, shape):
    return self.mask.block_states(_TableGrid(grid, self.q_table, self.kv_table), shape)


_register(_Remapped, data_fields=("mask", "q_table", "kv_table"))


class _TableGrid:
  """A `BlockGrid` whose rows sit at the positions of two tables (the grid masks see in
  `_Remapped.block_states`): ranges and block tables are jax arrays."""

  def __init__(self, grid: BlockGrid, q_table, kv_table):
    self.grid, self.q_table, self.kv_table = grid, q_table, kv_table
    self.num_q_blocks, self.num_kv_blocks = grid.num_q_blocks, grid.num_kv_blocks
    self.block_q, self.block_kv = grid.block_q, grid.block_kv

  def q_blocks(self):
    return self.q_table.reshape(self.num_q_blocks, self.block_q), self.grid.q_blocks()[1]

  def kv_blocks(self):
    return self.kv_table.reshape(self.num_kv_blocks, self.block_kv), self.grid.kv_blocks()[1]

  def q_ranges(self):
    return self._hull(*self.q_blocks())

  def kv_ranges(self):
    return self._hull(*self.kv_blocks())

  @staticmethod
  def _hull(pos, valid):
    """[min, max + 1) of each block's valid positions."""
    big = jnp.iinfo(jnp.int32)
    return (
      jnp.where(valid, pos, big.max).min(axis=1),
      jnp.where(valid, pos, big.min).max(axis=1) + 1,
    )


# The mask kinds `take_part` knows (the structural ones hold no arrays).


def reduce_states(states, shape) -> Any:
  """Summarise (B|1, N|1, nq, nk) states over batch and heads into one (nq, nk) map.

  The kernels process all batch elements and heads of a block together, so a block is skipped
  only if it is EMPTY for every (b, n), and is mask-free only if it is FULL for every (b, n).
  """
  xp = np if isinstance(states, np.ndarray) else jnp
  lo = states.min(axis=(0, 1))
  hi = states.max(axis=(0, 1))
  return xp.where(hi == EMPTY, EMPTY, xp.where(lo == FULL, FULL, PARTIAL)).astype(xp.int8)
