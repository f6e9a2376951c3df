"""`hidden_rows`: a mask in FlashMask's column form. For each key column j, the query rows that may
not see it are at most two intervals, a lower [lower_start_j, lower_end_j) and an upper
[upper_start_j, upper_end_j): O(S) integers per example (and per head) instead of a (T, S) array,
summarised per block at run time from each key block's minima and maxima."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _sharding, _validation
from jattn._types import ArrayLike
from jattn.masks._grid import EMPTY, FULL, PARTIAL
from jattn.masks._protocol import Mask, _register

# "No row": the start and end of an empty interval, and the end of one that runs to the last
# row. Past any T, far from int32's end so that comparisons with block ranges cannot overflow.
_BEYOND = 1 << 30

_NAME = "masks.hidden_rows"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _HiddenRows(Mask):
  """Query row q may not see key column k of example b, head n, iff q lies in
  [lower[0], lower[1]) or [upper[0], upper[1]) at [b, n, k]. ``lower`` and ``upper`` are int32
  (2, B|1, N|1, S) (start, end) pairs, or None where the interval is absent; an empty interval
  is stored as (_BEYOND, _BEYOND), so it meets no block."""

  lower: Any
  upper: Any

  def _pairs(self):
    return [
      (name, p) for name, p in (("lower", self.lower), ("upper", self.upper)) if p is not None
    ]

  def validate(self, shape):
    B, N, _, S = shape
    for name, pair in self._pairs():
      b, n, s = pair.shape[1:]
      if b not in (1, B) or n not in (1, N) or s != S:
        raise ValueError(
          f"{_NAME}: {name}_start and {name}_end must have shape (B, S)=({B}, {S}) or "
          f"(B, N, S)=({B}, {N}, {S}) (B and N may be 1), got (B, N, S)={tuple(pair.shape[1:])}"
        )

  def can_take_part(self):
    return True

  def take_part(self, cut):
    part = lambda p: None if p is None else cut.heads(cut.examples(p, 1), 2)
    return _HiddenRows(part(self.lower), part(self.upper))

  def evaluate(self, q_pos, kv_pos, shape):
    q = q_pos[None, None, :, None]
    hidden: Any = False
    for i, (_, pair) in enumerate(self._pairs()):
      # Keys past the arrays (a block's padding) are hidden from every row by the first interval.
      fill = (0, _BEYOND) if i == 0 else (_BEYOND, _BEYOND)
      start, end = (
        jnp.take(pair[e], kv_pos, axis=-1, mode="fill", fill_value=fill[e])[:, :, None, :]
        for e in (0, 1)
      )
      inside = (q >= start) & (q < end)
      hidden = hidden | inside
    return ~hidden

  def block_states(self, grid, shape):
    r0, r1 = (jnp.asarray(a, jnp.int32)[None, None, :, None] for a in grid.q_ranges())  # [r0, r1)
    positions, valid = grid.kv_blocks()
    pairs = [p for _, p in self._pairs()]
    if len(pairs) == 2:
      pairs.append(_merged(*pairs))
    covered: Any = False
    clear: Any = True
    for k, pair in enumerate(pairs):
      start_lo, start_hi = _block_span(pair[0], positions, valid)
      end_lo, end_hi = _block_span(pair[1], positions, valid)
      # Every row of the block inside every column's interval / no row inside any.
      cov = (start_hi <= r0) & (end_lo >= r1)
      covered = covered | cov
      if k < 2:  # the merged interval adds coverage only
        clr = (end_hi <= r0) | (start_lo >= r1)
        clear = clear & clr
    return jnp.where(covered, EMPTY, jnp.where(clear, FULL, PARTIAL)).astype(jnp.int8)


def _merged(lower, upper):
  """Per column, the union of two intervals that meet or touch (else empty): a column hidden
  from every row of a block by the two together, though by neither alone."""
  start = jnp.minimum(lower[0], upper[0])
  end = jnp.maximum(lower[1], upper[1])
  meet = jnp.maximum(lower[0], upper[0]) <= jnp.minimum(lower[1], upper[1])
  meet = meet & (lower[0] < _BEYOND) & (upper[0] < _BEYOND)
  return jnp.stack([jnp.where(meet, start, _BEYOND), jnp.where(meet, end, _BEYOND)])


def _block_span(x, positions, valid):
  """Min and max of the (B, N, S) ``x`` over each key block's valid columns, (B, N, 1, nk): one
  pass over S, the O(S) part of the summary."""
  blocks = jnp.take(x, jnp.asarray(positions), axis=-1, mode="clip")  # (B, N, nk, bk)
  valid = jnp.asarray(valid)[None, None]
  big = jnp.iinfo(jnp.int32)
  lo = jnp.where(valid, blocks, big.max).min(-1)
  hi = jnp.where(valid, blocks, big.min).max(-1)
  return lo[:, :, None, :], hi[:, :, None, :]


_register(_HiddenRows, data_fields=("lower", "upper"))


def hidden_rows(
  *,
  lower_start: ArrayLike | None = None,
  lower_end: ArrayLike | None = None,
  upper_start: ArrayLike | None = None,
  upper_end: ArrayLike | None = None,
) -> Mask:
  """Query rows hidden from each key column, as at most two intervals per column (FlashMask's
  form): row q may not see key k iff ``lower_start[k] <= q < lower_end[k]`` or
  ``upper_start[k] <= q < upper_end[k]``.

  Each argument is an int array (B, S), or (B, N, S) for a mask per query head (B and N may be
  1, broadcast), all of one shape; they may be traced. ``lower_end`` defaults to "to the last
  row" and ``upper_start`` to row 0; an interval is absent when its defining argument is
  (``lower_start``, ``upper_end``). An empty interval (start == end) hides nothing; values past
  T mean past the last row. Known values are checked: ValueError naming the argument and the
  first bad column where one is negative or a start exceeds its end.

  Below the diagonal the lower interval, above it the upper one: a causal document mask is
  ``causal() & hidden_rows(lower_start=doc_end)`` (each key hidden from the rows past its
  document). Block states come at run time from each key block's minima and maxima of the
  four arrays, O(S) work and no (T, S) array. See docs/prefix_trees.md."""
  given = dict(
    lower_start=lower_start, lower_end=lower_end, upper_start=upper_start, upper_end=upper_end
  )
  arrays = {k: _array(k, x) for k, x in given.items() if x is not None}
  if not arrays:
    raise ValueError(f"{_NAME}: give lower_start or upper_end (or both), got neither")
  for needs, name in (("lower_start", "lower_end"), ("upper_end", "upper_start")):
    if name in arrays and needs not in arrays:
      raise ValueError(
        f"{_NAME}: {name} without {needs}: an interval is given by {needs}, "
        f"{name} only moves its {'end' if name == 'lower_end' else 'start'}"
      )
  shapes = {k: tuple(x.shape) for k, x in arrays.items()}
  if len(set(shapes.values())) > 1:
    raise ValueError(f"{_NAME}: the arrays must have one shape, got {shapes}")
  _check_known(arrays)
  lower = _pair(arrays, "lower", 0, _BEYOND)
  upper = _pair(arrays, "upper", 0, 0)
  return _HiddenRows(lower, upper)


def _array(name, x):
  x = _validation.int_array(f"{_NAME}: {name}", x)
  if x.ndim not in (2, 3):
    raise ValueError(f"{_NAME}: {name} must be (B, S) or (B, N, S), got shape {x.shape}")
  return x


def _pair(arrays, side, default_start, default_end):
  """The (2, B, N, S) int32 (start, end) of one side (None if absent), empty intervals moved
  out of every block's way."""
  if f"{side}_start" not in arrays and f"{side}_end" not in arrays:
    return None
  # Under an Explicit mesh the arrays stack as the first given one is sharded.
  like = next(iter(arrays.values()))
  start, end = (
    _sharding.reshard_to(arrays[k].astype(jnp.int32), _sharding.spec_of(like))
    if k in arrays
    else jnp.full_like(like, d, jnp.int32)
    for k, d in ((f"{side}_start", default_start), (f"{side}_end", default_end))
  )
  pair = jnp.stack([start, end])
  if pair.ndim == 3:
    pair = pair[:, :, None, :]
  empty = pair[0] >= pair[1]
  return jnp.where(empty[None], _BEYOND, pair)


def _check_known(arrays) -> None:
  """Negative values and starts past their ends, where the arrays are known now: ValueError
  naming the argument and the first bad column."""
  known = {k: np.asarray(x) for k, x in arrays.items() if not isinstance(x, jax.core.Tracer)}
  for name, x in known.items():
    bad = np.argwhere(x < 0)
    if bad.size:
      i = tuple(int(a) for a in bad[0])
      raise ValueError(
        f"{_NAME}: {name} must be >= 0 (a row), got {name}[{', '.join(map(str, i))}]="
        f"{int(x[i])} (key column {i[-1]})"
      )
  for start, end in (("lower_start", "lower_end"), ("upper_start", "upper_end")):
    if start in known and end in known:
      bad = np.argwhere(known[start] > known[end])
      if bad.size:
        i = tuple(int(a) for a in bad[0])
        at = ", ".join(map(str, i))
        raise ValueError(
          f"{_NAME}: an interval [{start}, {end}) must have start <= end, got "
          f"{start}[{at}]={int(known[start][i])} > {end}[{at}]={int(known[end][i])} "
          f"(key column {i[-1]})"
        )
