"""Structural mask kinds: functions of positions alone, whose block summary is known from index
ranges at trace time (in NumPy, O(number of blocks)): the diagonal band that causal masks and
sliding windows are made of (`band`, `causal`, `local_window`; `causal` with an array offset is
the one run-time diagonal), `chunked_local`, `prefix_lm` and `full`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jattn import _validation
from jattn._types import ArrayLike, CausalAlignment
from jattn.masks._grid import EMPTY, FULL, PARTIAL, _summary, _xp
from jattn.masks._protocol import Mask, _register

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
