"""Mask specifications of a sweep, and the exact number of (query, key) pairs each one leaves
visible.

A spec is a string of ``+``-joined parts, as written in a config's ``masks`` list:

  ``full``                        nothing masked
  ``causal``                      query i sees keys k <= i (jax.nn's top-left alignment)
  ``causal:bottom_right``         query i sees keys k <= i + S - T (KV-cache alignment)
  ``window:W`` / ``window:L,R``   query i sees keys in [i + d - L, i + d + R], d the causal
                                  diagonal (0, or S - T when bottom-right); W means (W, W) as in
                                  jax.nn's ``local_window_size``
  ``segments:M``                  M packed documents of equal length: query i sees key k only if
                                  ``i * M // T == k * M // S``

e.g. ``causal+window:512`` is causal sliding-window attention over the last 513 keys.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class MaskSpec:
  causal: str | None = None  # None | "top_left" | "bottom_right"
  window: tuple[int, int] | None = None  # (left, right)
  segments: int | None = None

  @property
  def name(self) -> str:
    parts = []
    if self.causal == "top_left":
      parts.append("causal")
    elif self.causal == "bottom_right":
      parts.append("causal:bottom_right")
    if self.window is not None:
      left, right = self.window
      parts.append(f"window:{left}" if left == right else f"window:{left},{right}")
    if self.segments is not None:
      parts.append(f"segments:{self.segments}")
    return "+".join(parts) or "full"

  def offset(self, T: int, S: int) -> int:
    """The diagonal that causal masking and windows are measured from: key = query + offset."""
    return S - T if self.causal == "bottom_right" else 0


def parse(spec: str) -> MaskSpec:
  """Parse a mask spec string (see the module docstring); ValueError names what is wrong."""
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"mask spec must be a non-empty string, got {spec!r}")
  causal = window = segments = None
  parts = [p.strip() for p in spec.split("+")]
  if parts == ["full"]:
    return MaskSpec()
  for part in parts:
    kind, _, arg = part.partition(":")
    if kind == "causal":
      if causal is not None:
        raise ValueError(f"mask spec {spec!r}: 'causal' given twice")
      if arg in ("", "top_left"):
        causal = "top_left"
      elif arg == "bottom_right":
        causal = "bottom_right"
      else:
        raise ValueError(
          f"mask spec {spec!r}: causal alignment must be 'top_left' or 'bottom_right', got {arg!r}"
        )
    elif kind == "window":
      if window is not None:
        raise ValueError(f"mask spec {spec!r}: 'window' given twice")
      window = _parse_window(spec, arg)
    elif kind == "segments":
      if segments is not None:
        raise ValueError(f"mask spec {spec!r}: 'segments' given twice")
      segments = _parse_int(spec, "segments", arg, minimum=1)
    else:
      raise ValueError(
        f"mask spec {spec!r}: unknown part {part!r}; expected full, causal[:"
        f"bottom_right], window:W, window:L,R or segments:M"
      )
  return MaskSpec(causal=causal, window=window, segments=segments)


def _parse_int(spec, what, text, minimum):
  try:
    value = int(text)
  except ValueError:
    raise ValueError(f"mask spec {spec!r}: {what} needs an integer, got {text!r}") from None
  if value < minimum:
    raise ValueError(f"mask spec {spec!r}: {what} must be >= {minimum}, got {value}")
  return value


def _parse_window(spec, arg):
  sides = arg.split(",")
  if len(sides) == 1:
    w = _parse_int(spec, "window", sides[0], minimum=0)
    return (w, w)
  if len(sides) == 2:
    return (
      _parse_int(spec, "window left", sides[0], minimum=0),
      _parse_int(spec, "window right", sides[1], minimum=0),
    )
  raise ValueError(f"mask spec {spec!r}: window takes W or L,R, got {arg!r}")


def segment_ids(length: int, segments: int) -> np.ndarray:
  """int32 (length,) ids of ``segments`` equal packed documents: position i is in i*M // length."""
  return (np.arange(length, dtype=np.int64) * segments // length).astype(np.int32)


def visible_per_query(T: int, S: int, spec: MaskSpec) -> np.ndarray:
  """int64 (T,): how many keys each query sees, counted exactly in O(T) (no (T, S) matrix).

  Each part hides everything outside one contiguous key range per query, so the visible keys are
  the intersection of those ranges.
  """
  q = np.arange(T, dtype=np.int64)
  lo = np.zeros(T, np.int64)
  hi = np.full(T, S - 1, np.int64)  # inclusive
  d = spec.offset(T, S)
  if spec.causal is not None:
    hi = np.minimum(hi, q + d)
  if spec.window is not None:
    left, right = spec.window
    lo = np.maximum(lo, q + d - left)
    hi = np.minimum(hi, q + d + right)
  if spec.segments is not None:
    m = spec.segments
    seg = q * m // T
    # Keys of segment j are k with k*m // S == j, i.e. ceil(j*S/m) <= k < ceil((j+1)*S/m).
    lo = np.maximum(lo, -((-seg * S) // m))
    hi = np.minimum(hi, -((-(seg + 1) * S) // m) - 1)
  return np.maximum(hi - lo + 1, 0)


def visible_pairs(T: int, S: int, spec: MaskSpec) -> int:
  """The exact number of visible (query, key) pairs of one (batch, head)."""
  return int(visible_per_query(T, S, spec).sum())


def mask_array(spec: MaskSpec, T: int, S: int, q_seg=None, kv_seg=None):
  """The spec as a boolean array broadcastable to (B, N, T, S), True = attend; None for ``full``.

  Built with jnp inside the benchmarked function, as a jax.nn or flax user would build it; shape
  (1, 1, T, S), or (B, 1, T, S) with segments (``q_seg`` (B, T), ``kv_seg`` (B, S)).
  """
  if spec == MaskSpec():
    return None
  q = jnp.arange(T, dtype=jnp.int32)[:, None]
  k = jnp.arange(S, dtype=jnp.int32)[None, :]
  d = spec.offset(T, S)
  ok = jnp.ones((T, S), bool)
  if spec.causal is not None:
    ok = ok & (k <= q + d)
  if spec.window is not None:
    left, right = spec.window
    ok = ok & (k >= q + (d - left)) & (k <= q + (d + right))
  ok = ok[None, None]
  if spec.segments is not None:
    ok = ok & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  return ok
