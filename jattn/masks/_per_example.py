"""Mask kinds made of per-example arrays (pytree leaves), summarised at run time from per-block
ranges without a (T, S) array: `lengths` (padding), `segments` (packed documents) and `positions`
(causality and a window measured in positions, with `visible_by_position`, the rule the paged
kernels share)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jattn import _validation
from jattn._types import ArrayLike
from jattn.masks._grid import EMPTY, FULL, PARTIAL
from jattn.masks._protocol import Mask, _register


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
  """Padding mask from per-example valid lengths, int arrays of shape (B,), >= 0 (a length
  past the sequence means all of it)."""
  q = _int_array("masks.lengths: q_lengths", q_lengths)
  kv = _int_array("masks.lengths: kv_lengths", kv_lengths)
  _validation.known_lengths("masks.lengths: q_lengths", q)
  _validation.known_lengths("masks.lengths: kv_lengths", kv)
  return _Lengths(q, kv)


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
  mask and the paged walks and kernels (`jattn._paged.fold`) use it."""
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
  _given_together(q_positions, kv_positions)
  q = _int_array("masks.positions: q_positions", q_positions)
  kv = _int_array("masks.positions: kv_positions", kv_positions)
  return _Positions(q, kv, bool(causal), _validation.window(window))


def _given_together(q_positions, kv_positions) -> None:
  """The one error for a missing half of the positions, whichever function is called (`positions`,
  or the ``q_positions``/``kv_positions`` keywords of a call, which `positions` checks too):
  ValueError naming it."""
  if q_positions is None or kv_positions is None:
    got = (
      "neither"
      if q_positions is None and kv_positions is None
      else "q_positions without kv_positions"
      if kv_positions is None
      else "kv_positions without q_positions"
    )
    raise ValueError(f"q_positions and kv_positions must be given together, got {got}")


def segments(q_segment_ids: ArrayLike, kv_segment_ids: ArrayLike | None = None) -> Mask:
  """Packed-document mask from integer segment ids, q (B, T) and kv (B, S)."""
  q = _int_array("masks.segments: q_segment_ids", q_segment_ids)
  kv = q if kv_segment_ids is None else _int_array("masks.segments: kv_segment_ids", kv_segment_ids)
  return _Segments(q, kv)
