"""The call's masking keywords as one mask: `from_arguments` turns ``mask``, ``is_causal``,
``local_window_size``, the lengths, the segment ids and the positions into one `jattn.masks`
object (so every implementation sees one mechanism), `keyword_band` the band of the causal and window keywords,
`combine` the AND of a list of masks."""

from __future__ import annotations

import functools

from jattn.masks._arrays import _ArrayMask
from jattn.masks._per_example import _Lengths, _Positions, _Segments
from jattn.masks._protocol import Mask
from jattn.masks._structural import _Band


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
  lengths=(None, None),
  segment_ids=(None, None),
  positions=(None, None),
):
  """Turn the keyword arguments into one `jattn.masks` object (None when nothing is hidden).

  The keywords are thin ways to build mask objects, so every implementation sees one mechanism.
  The arrays are the call's, checked already (`jattn._call.arrays`), so they are not again.
  ``lengths``: (q (B,), kv (B,)), either may be None; ``segment_ids`` and ``positions``:
  (q (B, T), kv (B, S)), given together. With positions, ``causal`` (either alignment) and
  ``window`` are measured in them: a `positions` mask instead of the band of array indices.
  """
  parts = []
  if mask is not None:
    parts.append(mask if isinstance(mask, Mask) else _ArrayMask(mask))
  q_positions, kv_positions = positions
  if q_positions is not None:
    parts.append(_Positions(q_positions, kv_positions, causal is not None, window))
  else:
    lohi = keyword_band(shape, causal, window)
    if lohi is not None:
      parts.append(_Band(*lohi))
  if lengths[0] is not None or lengths[1] is not None:
    parts.append(_Lengths(*lengths))
  if segment_ids[0] is not None:
    parts.append(_Segments(*segment_ids))
  return combine(parts)


def combine(parts):
  """The AND of a list of masks (None entries skipped); None when nothing is left."""
  parts = [p for p in parts if p is not None]
  return functools.reduce(lambda a, b: a & b, parts) if parts else None
