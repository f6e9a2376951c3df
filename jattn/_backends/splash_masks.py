"""The mask half of the splash backend (`jattn._backends.splash`): a jattn mask split into the
static, position-based part splash builds its block lists from (a band as splash's own lazy mask,
anything else evaluated once at trace time into a NumPy (T, S) array per distinct head) and the
run-time part (lengths, padding to whole blocks, segment ids) as one pair of segment-id vectors,
which the pallas_gpu backend takes too. Refusals name splash and the reason."""

from __future__ import annotations

import functools
import hashlib
from typing import NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from jattn._backends import foreign
from jattn._validation import concrete

# A mask that is not a band is evaluated into a (T, S) NumPy array per distinct head.
MAX_EVALUATED_POSITIONS = 1 << 28

refuse = functools.partial(foreign.refuse, "splash")


def splash_modules():
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask

  return kernel, mask


def split_mask(mask):
  """(static, lengths, segments): the AND of ``mask``'s parts sorted into what is a function of
  positions and heads (a mask object or None), the per-example length parts ((q_lengths,
  kv_lengths) pairs) and the one pair of segment-id arrays (or None). Splash takes one pair of
  segment-id vectors, so two segment masks are refused."""
  parts = [] if mask is None else mask.conjuncts()
  ids = [p.ids() for p in parts]
  lengths = [i[1:] for i in ids if i is not None and i[0] == "lengths"]
  segments = [i[1:] for i in ids if i is not None and i[0] == "segments"]
  if len(segments) > 1:
    refuse("two segment-id masks at once", "it takes one pair of segment-id vectors")
  rest = [p for p, i in zip(parts, ids) if i is None]
  static = functools.reduce(lambda a, b: a & b, rest) if rest else None
  return static, lengths, segments[0] if segments else None


def builds_lazily(mask) -> bool:
  """Whether splash takes ``mask``'s position-based part as one of its own lazy masks (none,
  full, causal, a window), with nothing evaluated into a (T, S) array when the kernel is built:
  what `implementation=None` requires before it tries splash, so that choosing a kernel never
  costs a trace-time evaluation of the whole mask."""
  try:
    static, _, _ = split_mask(mask)
  except NotImplementedError:
    return False
  return static is None or static.band() is not None


class HeadMask:
  """One head's splash mask for a (Tp, Sp) problem: a cache key, how to build it, and its (Tp,)
  rows and (Sp,) columns that see / are seen by anything (NumPy booleans)."""

  def __init__(self, key, build, rows, cols, dense):
    self.key, self.build, self.rows, self.cols, self.dense = key, build, rows, cols, dense


def _band_dense(lo, hi, padded):
  q, k = np.arange(padded[0])[:, None], np.arange(padded[1])[None, :]
  return (k >= q + (-np.inf if lo is None else lo)) & (k <= q + (np.inf if hi is None else hi))


def _band_rows_cols(lo, hi, T, S, padded):
  """Rows q < T with a key in [q + lo, q + hi] within [0, S), and keys with such a row."""
  lo = -np.inf if lo is None else lo
  hi = np.inf if hi is None else hi
  q, k = np.arange(padded[0]), np.arange(padded[1])
  rows = (q < T) & (np.maximum(q + lo, 0) <= np.minimum(q + hi, S - 1))
  cols = (k < S) & (np.maximum(k - hi, 0) <= np.minimum(k - lo, T - 1))
  return rows, cols


def static_masks(static, shape, padded) -> list[HeadMask]:
  """The splash masks of the position-based part ``static`` on the (Tp, Sp) = ``padded``
  problem, one per query head, or a single one that every head shares. Padding rows and columns
  are left visible here: the segment ids hide them."""
  _, mask_lib = splash_modules()
  _B, _N, T, S = shape
  band = None if static is None else static.band()
  if static is None or band is not None:
    return _band_masks((None, None) if static is None else band, T, S, padded)
  if T * S > MAX_EVALUATED_POSITIONS:
    refuse(
      f"a {type(static).__name__} mask at T x S = {T} x {S}",
      "a mask other than causal or a window is evaluated into a (T, S) array when the "
      f"kernel is built, and that is limited to {MAX_EVALUATED_POSITIONS} positions",
    )
  # `masks.from_function`'s batch and head offsets are the global indices of ring attention's
  # shard; in a single-device call they are 0 but reach here traced (pytree leaves of the
  # jitted call), which would keep the mask from evaluating at trace time.
  static = static.unshifted()
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(static)):
    # Arrays it holds are run-time ones (under a symbolic batch their shapes would not even
    # evaluate).
    _refuse_run_time(static)
  values = _evaluated(static, shape) if concrete(_B) else _any_example(static, shape)
  values = np.broadcast_to(values, (values.shape[0], values.shape[1], T, S))
  if values.shape[0] != 1 and not (values == values[:1]).all():
    refuse(
      "a mask that differs between examples of the batch",
      "one kernel serves the whole batch; use segment ids or lengths for per-example masks",
    )
  heads = np.zeros((values.shape[1],) + tuple(padded), bool)
  heads[:, :T, :S] = values[0]
  if not heads.any():
    refuse("a mask that hides every position", "splash's block lists cannot be empty")
  out = []
  for h in heads:
    digest = hashlib.sha1(np.packbits(h).tobytes()).hexdigest()
    out.append(
      HeadMask(
        ("array", padded, digest),
        functools.partial(mask_lib.NumpyMask, h),
        h.any(1),
        h.any(0),
        lambda h=h: h,
      )
    )
  return out[:1] if len({m.key for m in out}) == 1 else out


def _evaluated(static, shape) -> np.ndarray:
  """``static`` evaluated on the whole (B, N, T, S) ``shape`` at trace time, as a NumPy array
  broadcastable to it; refused where it depends on run-time arrays (its function reads
  some)."""
  _B, _N, T, S = shape
  with jax.ensure_compile_time_eval():
    try:
      values = static.evaluate(
        jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32), shape
      )
      return np.asarray(values)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
      _refuse_run_time(static)


def _refuse_run_time(static) -> NoReturn:
  refuse(
    "a mask that depends on run-time arrays",
    f"its block lists are built when the kernel is, so the mask ({type(static).__name__})"
    " must be a function of positions and heads known at trace time; pass lengths and "
    "segment ids as keywords or masks.lengths/masks.segments",
  )


def _any_example(static, shape) -> np.ndarray:
  """``static`` evaluated for a symbolic batch (``shape``'s B, from `jax.export`): on one
  example whose index is a traced value, so a mask that reads the example index (a
  `masks.from_function` using its batch argument) comes out traced and is refused, and one
  that does not is the same for every example, built once for the whole batch."""
  _B, N, T, S = shape
  found = []

  def probe(example):
    found.append(_evaluated(static.shift_indices(example, 0), (1, N, T, S)))
    return example

  try:
    jax.make_jaxpr(probe)(np.int32(0))
  except NotImplementedError:
    _evaluated(static, (1, N, T, S))  # refuses a mask traced for another reason: run-time arrays
    refuse(
      f"a mask that reads the example index with a symbolic batch (B={_B})",
      "one kernel serves the whole batch, its block lists built when the call is traced, "
      "before the batch size is known; use segment ids or lengths for per-example masks",
    )
  return found[0]


def _band_masks(band, T, S, padded) -> list[HeadMask]:
  """The one splash mask of a band ``lo <= s - t <= hi`` (either side None: unbounded; both:
  every position) on the padded problem."""
  _, mask_lib = splash_modules()
  if band == (None, None):
    rows, cols = _band_rows_cols(None, None, T, S, padded)
    return [
      HeadMask(
        ("full", padded),
        lambda: mask_lib.FullMask(padded),
        rows,
        cols,
        lambda: np.ones(padded, bool),
      )
    ]
  lo, hi = band
  rows, cols = _band_rows_cols(lo, hi, T, S, padded)
  if not rows.any():
    refuse("a mask that hides every position", "splash's block lists cannot be empty")
  if lo is None:  # causal-like: keys up to q + hi
    return [
      HeadMask(
        ("causal", padded, hi),
        lambda: mask_lib.CausalMask(padded, offset=hi),
        rows,
        cols,
        lambda: _band_dense(lo, hi, padded),
      )
    ]
  return [
    HeadMask(
      ("band", padded, lo, hi),
      lambda: mask_lib.LocalMask(padded, window_size=(-lo, hi), offset=0),
      rows,
      cols,
      lambda: _band_dense(lo, hi, padded),
    )
  ]


def segment_ids(B, T, S, Tp, Sp, lengths, segments):
  """From ``lengths`` ((q_lengths, kv_lengths) pairs, see `split_mask`) and ``segments`` (one
  (q_ids, kv_ids) pair or None): (q_ids (B, Tp), kv_ids (B, Sp), q_ok, kv_ok): int32 ids
  such that query t sees key s iff the call's lengths, padding and segment ids allow it, and
  which queries and keys those leave any partner. A hidden key gets an id below every query's,
  a hidden query one below that (ids near int32's minimum would wrap)."""
  q = (
    jnp.zeros((B, T), jnp.int32)
    if segments is None
    else jnp.broadcast_to(segments[0].astype(jnp.int32), (B, T))
  )
  kv = (
    jnp.zeros((B, S), jnp.int32)
    if segments is None
    else jnp.broadcast_to(segments[1].astype(jnp.int32), (B, S))
  )
  # int32 positions: under jax_enable_x64 an arange is int64, which strict dtype promotion
  # refuses to compare with int32 lengths.
  q_pos = jnp.arange(Tp, dtype=jnp.int32)[None, :]
  kv_pos = jnp.arange(Sp, dtype=jnp.int32)[None, :]
  q_ok, kv_ok = q_pos < T, kv_pos < S
  for q_lengths, kv_lengths in lengths:
    if q_lengths is not None:
      q_ok = q_ok & (q_pos < q_lengths.astype(jnp.int32)[:, None])
    if kv_lengths is not None:
      kv_ok = kv_ok & (kv_pos < kv_lengths.astype(jnp.int32)[:, None])
  q = jnp.pad(q, ((0, 0), (0, Tp - T)))
  kv = jnp.pad(kv, ((0, 0), (0, Sp - S)))
  low = jnp.minimum(q.min(), kv.min())
  q, kv = jnp.where(q_ok, q, low - 2), jnp.where(kv_ok, kv, low - 1)
  if segments is not None:
    # A key whose document no query is in is hidden from all (and a query's likewise): found by
    # searching each side's ids in the other's sorted ids, O((T + S) log), not a (T, S) table.
    def present(ids, among):
      srt = jnp.sort(among, axis=-1)
      # method="sort": the default scan fails under vmap on arrays typed sharded by an
      # Explicit mesh (jax 0.10: "Resource axis x ... not found in mesh: ()").
      at = jax.vmap(lambda a, v: jnp.searchsorted(a, v, method="sort"))(srt, ids)
      return jnp.take_along_axis(srt, jnp.minimum(at, srt.shape[-1] - 1), axis=-1) == ids

    q_ok, kv_ok = q_ok & present(q, kv), kv_ok & present(kv, q)
  return q, kv, q_ok, kv_ok
