"""Writing a step's new tokens into a paged KV cache: `jattn.write_pages`, the writer that
`jattn.paged_attention` reads after (and the Flax modules' paged caches use).

The metadata is paged_attention's: sequence b's tokens 0 .. kv_lengths[b] - 1 live in pages
page_table[b, 0], page_table[b, 1], ... and the new ones are its last: padded (B, T, K, H), the
T tokens at positions kv_lengths[b] - T .. kv_lengths[b] - 1, or ragged (total, K, H) with
``query_start``. So one set of metadata serves both calls of a serving step: write, then attend.

A page id is data: read plainly, an id past the pool would be clamped onto the last page, i.e.
another request's cache. The rules of `jattn._page_metadata` hold here too: concrete metadata
that breaks them raises a ValueError naming the sequence; traced metadata cannot raise, so a
faulty sequence's tokens are not written at all (and paged_attention returns NaN for it).

Shapes: B sequences, T new tokens each (or ``total`` ragged rows), K key/value heads, H key and
Hv value head sizes, P pages of ``page_size`` tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _validation
from jattn._paged import metadata as _page_metadata
from jattn._paged import pool as _pool
from jattn._validation import concrete

ON_INVALID = ("skip", "checkify")


class KVPages(NamedTuple):
  """A paged cache's arrays after a write: the pools and their scales (None where the call had
  none: float pages, a combined pool's value_pages, absorbed MLA's values)."""

  key_pages: Any
  value_pages: Any
  k_scale: Any
  v_scale: Any


def write_pages(
  key_pages,
  value_pages,
  page_table,
  kv_lengths,
  key,
  value,
  *,
  query_start=None,
  new_lengths=None,
  k_scale=None,
  v_scale=None,
  kv_layout="NHD",
  page_size=None,
  num_kv_heads=None,
  on_invalid="skip",
) -> KVPages:
  """Write new keys and values into a paged KV cache (the pools' layout as paged_attention's).

  Under ``jax.jit`` with the pools (and scales) donated -- ``jax.jit(step,
  donate_argnames=...)`` -- the write happens in place: the compiled program aliases each pool
  to its update and copies nothing. Each new token must have a slot of its own: pages that
  several sequences share (a prefix, a forked beam) are read-only until copied (the scatter
  assumes unique destinations; two tokens on one slot leave either).

  Args:
    key_pages: (P, page_size, K, H) pool (``kv_layout="HND"``: (P, K, page_size, H);
      "combined": (P, page_size, 2K, H), values in the odd heads, ``value_pages=None``): float,
      or int8 / float8_e4m3fn / float8_e5m2 with ``k_scale``.
    value_pages: (P, page_size, K, Hv) (HND: (P, K, page_size, Hv)), likewise with ``v_scale``;
      None with ``value=None`` for a pool of keys only (absorbed MLA's latent, whose values are
      its first features) or with ``kv_layout="combined"``.
    page_table: int (B, max_pages), kv_lengths: int (B,): as in paged_attention, the lengths
      counting the new tokens (FlashAttention's cache_seqlens + new tokens).
    key: the new keys in the pool's dtype (a quantised pool: any float dtype), (B, T, K, H) --
      sequence b's row t at position kv_lengths[b] - T + t; with ``new_lengths`` only its last
      new_lengths[b] rows are written; a row at a negative position is not written -- or ragged
      (total, K, H) with ``query_start``.
    value: the new values, (B, T, K, Hv) or (total, K, Hv); None for a pool of keys only.
    query_start: int (B + 1,) offsets of ragged tokens (paged_attention's): sequence b's are
      rows query_start[b] .. query_start[b + 1] - 1, the last at position kv_lengths[b] - 1;
      rows past query_start[B] are not written.
    new_lengths: int (B,), padded form only: how many new tokens sequence b has, in [0, T] and
      at most kv_lengths[b]. They are its last rows (left padding: rows T - new_lengths[b] ..
      T - 1, at positions kv_lengths[b] - new_lengths[b] .. kv_lengths[b] - 1); the rows before
      them are padding and are not written, so a sequence that accepted fewer draft tokens than
      another keeps its cached tokens. None: every row of every sequence is new (T each).
    k_scale, v_scale: a quantised pool's scales as paged_attention takes them. Per token and
      head ((P, page_size, K); HND (P, K, page_size)): each new token and head is scaled so its
      largest magnitude is the dtype's largest (int8: 127), its scale (rounded to the scales'
      dtype first) written beside it. Per tensor () or per head (K,) (a calibration, > 0):
      tokens are divided by it, rounded (int8) and clipped, the scale returned unchanged.
    kv_layout, page_size, num_kv_heads: as in paged_attention.
    on_invalid: traced metadata that breaks paged_attention's rules (concrete metadata raises
      a ValueError first): "skip" (the faulty sequence's tokens are not written; every other
      sequence's are) or "checkify" (the same, and an error through
      `jax.experimental.checkify`).

  Returns:
    ``KVPages(key_pages, value_pages, k_scale, v_scale)``: the updated arrays, None where the
    call passed None.
  """
  _pool.check_layout(key_pages, value_pages, kv_layout, page_size, num_kv_heads)
  if on_invalid not in ON_INVALID:
    raise ValueError(f"on_invalid must be one of {ON_INVALID}, got on_invalid={on_invalid!r}")
  metadata = (page_table, kv_lengths, query_start)  # NumPy stays concrete under jit
  pool, key, value, query_start, kinds = _check(
    _pool.Pool(key_pages, value_pages, page_table, kv_lengths, k_scale, v_scale),
    key,
    value,
    query_start,
    kv_layout,
  )
  new_lengths = _new_lengths(new_lengths, key, query_start, pool.kv_lengths)
  P = pool.key_pages.shape[0]
  ps = pool.key_pages.shape[2 if kv_layout == "HND" else 1]
  geometry = _page_metadata.Geometry(
    P, ps, key.shape[0] if query_start is not None else key.shape[1], query_start is not None
  )
  _page_metadata.check_concrete(geometry, *metadata)
  faults = _page_metadata.faults(jnp, geometry, pool.page_table, pool.kv_lengths, query_start)
  if on_invalid == "checkify":
    _page_metadata.checkify_faults(faults)
  bad = faults != _page_metadata.OK
  if new_lengths is not None:
    # Traced counts out of [0, min(T, kv_lengths[b])]: that sequence writes nothing.
    n = new_lengths.astype(jnp.int32)
    bad = bad | (n < 0) | (n > key.shape[1]) | (n > pool.kv_lengths.astype(jnp.int32))
  at = _destinations(pool, query_start, bad, geometry, key.shape, new_lengths)
  flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[-2:])
  written = _pool.write(pool, kv_layout, at, flat(key), flat(value), kinds)
  return KVPages(
    written.key_pages,
    written.value_pages if value_pages is not None else None,
    written.k_scale,
    written.v_scale,
  )


def _destinations(
  pool: _pool.Pool, query_start, bad, g: _page_metadata.Geometry, shape, new_lengths=None
):
  """Each new token's page and offset (`_pool.Written`): position kv_lengths[b] - n_b + i for
  the i-th of sequence b's n_b tokens; nowhere for a faulty sequence's, a padded row before its
  sequence's ``new_lengths`` last ones, a ragged row past the last sequence's, or one at a
  negative position."""
  lens = pool.kv_lengths.astype(jnp.int32)
  B = lens.shape[0]
  if query_start is None:
    T = shape[1]
    r = jnp.arange(B * T, dtype=jnp.int32)  # (by arithmetic, so that B may be symbolic)
    seq, within = r // T, r % T
    count = jnp.full((B,), T, jnp.int32)
    live = jnp.ones(seq.shape, bool)
    if new_lengths is not None:
      live = within >= T - new_lengths.astype(jnp.int32)[seq]  # left padding is not written
  else:
    qs = query_start.astype(jnp.int32)
    r = jnp.arange(shape[0], dtype=jnp.int32)[:, None]
    # A row's sequence: the sound one whose run holds it. A faulty sequence's offsets (a start
    # out of order) must not move a sound sequence's rows, so runs are matched, not counted.
    own = (qs[None, :-1] <= r) & (r < qs[None, 1:]) & ~bad[None, :]  # (total, B)
    if B == 0:  # no sequences: every row is padding (argmax has nothing to reduce)
      return _pool.slots(
        jnp.zeros((1, 1), jnp.int32), r[:, 0] * 0, r[:, 0], jnp.zeros(r.shape[:1], bool), g.P, 1
      )
    seq = jnp.argmax(own, axis=1).astype(jnp.int32)
    live = own.any(axis=1)
    within = r[:, 0] - qs[seq]
    count = qs[1:] - qs[:-1]
  live = live & ~bad[seq]
  position = lens[seq] - count[seq] + within
  return _pool.slots(pool.page_table, seq, position, live, g.P, g.page_size)


def _new_lengths(new_lengths, key, query_start, kv_lengths):
  """``new_lengths`` checked: int (B,), padded form only; concrete counts within [0, T] and at
  most kv_lengths[b] (a ValueError naming the first faulty sequence)."""
  if new_lengths is None:
    return None
  if query_start is not None:
    raise ValueError(
      "new_lengths is for the padded form (B, T, K, H); ragged rows count their new tokens "
      "by query_start: pass one or the other"
    )
  new_lengths = _validation.int_array("new_lengths", new_lengths)
  B, T = key.shape[:2]
  if new_lengths.shape != (B,):
    raise ValueError(
      f"new_lengths must be (B,) = ({B},), one count per sequence of key's (B, T, K, H), got "
      f"shape {new_lengths.shape}"
    )
  if not any(isinstance(x, jax.core.Tracer) for x in (new_lengths, kv_lengths)):
    n, lens = np.asarray(new_lengths), np.asarray(kv_lengths)
    wrong = np.flatnonzero((n < 0) | (n > T) | (n > lens))
    if wrong.size:
      b = int(wrong[0])
      raise ValueError(
        f"new_lengths[{b}]={int(n[b])} must be in [0, T={T}] and at most "
        f"kv_lengths[{b}]={int(lens[b])} (the new tokens are the last cached ones)"
      )
  return new_lengths


def _check(pool: _pool.Pool, key, value, query_start, kv_layout):
  """The call's arrays checked (errors name the argument and what was passed): (pool, key,
  value, query_start, (k_scale's kind, v_scale's kind))."""
  _pool.check_layout_name(kv_layout)
  keys_only = pool.value_pages is None and kv_layout != "combined"
  if keys_only and value is not None:
    raise ValueError(
      "value_pages=None is a pool of keys only (absorbed MLA's latent, its values the keys' "
      f"first features): pass value=None, or pass the value pool; got value of shape "
      f"{getattr(value, 'shape', type(value).__name__)}"
    )
  if not keys_only and value is None:
    raise TypeError(
      "value must be the new values, (B, T, K, Hv) or ragged (total, K, Hv), got None (None "
      "only with value_pages=None: a pool of keys only)"
    )
  key = _validation.float_array("key", key)
  value = None if value is None else _validation.float_array("value", value)
  # NumPy pools are taken (paged_attention takes them): the write returns jax arrays.
  pages = jnp.asarray(_validation.as_array("key_pages", pool.key_pages, "an array of pages"))
  vpages = pool.value_pages
  if vpages is not None:
    vpages = jnp.asarray(_validation.as_array("value_pages", vpages, "an array of pages"))
  # A pool of keys only is checked as its own values (absorbed MLA's latent).
  pages, vpages_checked, (_, _, K, _) = _pool.checked_pools(
    pages, pages if keys_only else vpages, kv_layout
  )
  H, Hv = pages.shape[-1], vpages_checked.shape[-1]
  pool = _pool.Pool(
    pages,
    vpages,
    _validation.int_array("page_table", pool.page_table),
    _validation.int_array("kv_lengths", pool.kv_lengths),
    None if pool.k_scale is None else _validation.float_array("k_scale", pool.k_scale),
    None if pool.v_scale is None else _validation.float_array("v_scale", pool.v_scale),
  )
  query_start = _validation.int_array("query_start", query_start, optional=True)
  ragged = query_start is not None
  _page_metadata.check_shapes(
    pool.page_table, pool.kv_lengths, query_start, None if ragged else key.shape[0], "key"
  )
  _check_tokens(key, value, ragged, (K, H, Hv), pages)
  if value is None and pool.v_scale is not None:
    raise ValueError("v_scale is for value pages; a pool of keys only has none: pass v_scale=None")
  kinds = _scale_kinds(pool, (pages, vpages_checked), key, value, kv_layout, K)
  return pool, key, value, query_start, kinds


def _check_tokens(key, value, ragged: bool, heads: tuple, pages) -> None:
  """The new tokens against the pool's heads ``heads`` = (K, H, Hv): key (B, T, K, H) or ragged
  (total, K, H), value likewise with Hv and the same tokens, sizes known but B."""
  K, H, Hv = heads
  lead = "(total, " if ragged else "(B, T, "
  for name, x, X in (("key", key, H), ("value", value, Hv)):
    if x is not None and (x.ndim != (3 if ragged else 4) or x.shape[-2:] != (K, X)):
      raise ValueError(
        f"{name} must be {lead}K, {'H' if name == 'key' else 'Hv'}) = {lead}{K}, {X}) like "
        f"the pool's heads{' with query_start' if ragged else ''}, got {name}.shape={x.shape}"
      )
  if value is not None and value.shape[:-2] != key.shape[:-2]:
    raise ValueError(
      f"value must have key's tokens: key.shape={key.shape}, value.shape={value.shape}"
    )
  if not concrete(*key.shape[1 - ragged : -2], *pages.shape):
    raise NotImplementedError(
      f"write_pages takes known token and pool sizes (only B may be symbolic), got "
      f"key.shape={key.shape}, key_pages.shape={pages.shape}"
    )


def _scale_kinds(pool: _pool.Pool, pools: tuple, key, value, kv_layout, K: int):
  """(k_scale's kind, v_scale's kind) (`_pool.scale_kind`; v None for a pool of keys only),
  float pools holding the tokens' dtype and calibrations > 0 checked. ``pools`` = the key
  pool and the pool the values go to, as checked."""
  dims = _pool.DIMS[kv_layout]
  pages, vpages_checked = pools
  for name, pages_x, x in (("key_pages", pages, key), ("value_pages", vpages_checked, value)):
    if x is not None and not _pool.is_quantized(pages_x.dtype) and pages_x.dtype != x.dtype:
      raise TypeError(
        f"{name} of dtype {pages_x.dtype} take new tokens of that dtype (a quantised pool: any "
        f"float dtype), got {'key' if name == 'key_pages' else 'value'}.dtype={x.dtype}"
      )
  kinds = (
    _pool.scale_kind("k_scale", pool.k_scale, pages, key.dtype, dims, K),
    None
    if value is None
    else _pool.scale_kind("v_scale", pool.v_scale, vpages_checked, value.dtype, dims, K),
  )
  for name, kind, scale in (
    ("k_scale", kinds[0], pool.k_scale),
    ("v_scale", kinds[1], pool.v_scale),
  ):
    # A calibration divides the tokens: 0 or a negative scale would store inf / NaN / flipped
    # signs without a word (a traced one cannot be checked here).
    if kind in ("tensor", "head") and not isinstance(scale, jax.core.Tracer):
      if not (np.asarray(scale) > 0).all():
        raise ValueError(
          f"{name} must be > 0 (a calibration the tokens are divided by), got {scale}"
        )
  return kinds
