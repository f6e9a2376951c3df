"""Writing a step's new tokens into a paged KV cache: `jattn.write_pages`, the writer that
`jattn.paged_attention` reads after, and its core (`store`), which the Flax modules' paged
caches write through too (`write_cache`).

The metadata is paged_attention's: sequence b's tokens 0 .. kv_lengths[b] - 1 live in pages
page_table[b, 0], page_table[b, 1], ... and the new ones are its last: padded (B, T, K, H), the
T tokens at positions kv_lengths[b] - T .. kv_lengths[b] - 1, or ragged (total, K, H) with
``query_start``. So one set of metadata serves both calls of a serving step: write, then attend.

A page id is data: read plainly, an id past the pool would be clamped onto the last page, i.e.
another request's cache. The rules of `jattn._paged.metadata` hold here too: concrete metadata
that breaks them raises a ValueError naming the sequence; traced metadata cannot raise, so a
faulty sequence's tokens are not written at all (and paged_attention returns NaN for it).

Shapes: B sequences, T new tokens each (or ``total`` ragged rows), K key/value heads, H key and
Hv value head sizes, P pages of ``page_size`` tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from jattn import _validation
from jattn._paged import metadata
from jattn._paged import pool as _pool
from jattn._paged.pool import Pool


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
  metadata.check_on_invalid("write_pages", on_invalid)
  # As passed: NumPy metadata stays concrete under jit, and is checked by its values.
  given = metadata.Metadata(page_table, kv_lengths, query_start, None, new_lengths)
  same = key_pages is value_pages and key_pages is not None
  declared = _pool.Declared(kv_layout, page_size, num_kv_heads, None, same)
  raw = Pool(key_pages, value_pages, page_table, kv_lengths, k_scale, v_scale)
  pool, key, value, md = _as_arrays(raw, key, value, given)
  ragged = md.query_start is not None
  pool, sizes = _pool.check(pool, _pool.Tokens(key=key, value=value, ragged=ragged), declared)
  _, _, rows = metadata.check_shapes(md, key.shape, ragged, "key")
  g = metadata.Geometry(sizes.P, sizes.page_size, rows, ragged)
  metadata.check(g, given)
  faults = metadata.faults(jnp, g, md)
  if on_invalid == "checkify":
    metadata.checkify("write_pages", faults)
  at = metadata.owners(jnp, md.query_start, rows, faults != metadata.OK, md.new_lengths)
  written = store(pool, kv_layout, at, key, value, (sizes.k_scale, sizes.v_scale))
  return KVPages(
    written.key_pages,
    written.value_pages if value_pages is not None else None,
    written.k_scale,
    written.v_scale,
  )


def _as_arrays(pool: Pool, key, value, given: metadata.Metadata):
  """Every array of a call as an array of its kind (TypeError naming the argument; shapes are
  the pool's and the metadata's to check): (pool, key, value, metadata)."""
  key = _validation.float_array("key", key)
  value = None if value is None else _validation.float_array("value", value)
  # NumPy pools are taken (paged_attention takes them): the write returns jax arrays.
  pages = jnp.asarray(_validation.as_array("key_pages", pool.key_pages, "an array of pages"))
  vpages = pool.value_pages
  if vpages is not None:
    vpages = jnp.asarray(_validation.as_array("value_pages", vpages, "an array of pages"))
  scales = [
    None if x is None else _validation.float_array(name, x)
    for name, x in (("k_scale", pool.k_scale), ("v_scale", pool.v_scale))
  ]
  table = _validation.int_array("page_table", pool.page_table)
  lens = _validation.int_array("kv_lengths", pool.kv_lengths)
  md = metadata.Metadata(
    table,
    lens,
    _validation.int_array("query_start", given.query_start, optional=True),
    None,
    _validation.int_array("new_lengths", given.new_lengths, optional=True),
  )
  ragged = md.query_start is not None
  if not _validation.concrete(*key.shape[1 - ragged : -2], *pages.shape):
    raise NotImplementedError(
      f"write_pages takes known token and pool sizes (only B may be symbolic), got "
      f"key.shape={key.shape}, key_pages.shape={pages.shape}"
    )
  return Pool(pages, vpages, table, lens, scales[0], scales[1]), key, value, md


def write_cache(pool: Pool, key, value) -> Pool:
  """A decoding module's write (the Flax modules' paged and quantised caches): new keys key
  (B, T, K, H) and values (B, T, K, Hv), checked against the token-major pool as write_pages
  checks them, stored as it stores them -- row t of example b at cache position
  kv_lengths[b] - T + t. The module's own table has no faults to skip: a position past it (a
  full cache) is dropped, token by token."""
  pool, sizes = _pool.check(pool, _pool.Tokens(key=key, value=value), _pool.Declared())
  md = metadata.Metadata(pool.page_table, pool.kv_lengths)
  B, _, T = metadata.check_shapes(md, key.shape, False, "key")
  at = metadata.owners(jnp, None, T, jnp.zeros((B,), bool))
  return store(pool, "NHD", at, key, value, (sizes.k_scale, sizes.v_scale))


def store(pool: Pool, kv_layout: str, at: metadata.Owners, key, value, kinds) -> Pool:
  """``pool`` (its pages and scales; the table and lengths untouched) with the new keys (B, T,
  K, H) or (total, K, H) and values likewise with Hv (None: a pool of keys only) written: row
  r, the i-th of sequence b's n new rows (``at``), at cache position kv_lengths[b] - n + i; a
  row not live, or at a position outside the table, nowhere. ``kinds`` = (k_scale's, v_scale's)
  kind (`_pool.scale_kind`): quantised tokens take a per-token scale computed from them
  ("token", written beside them) or the given per-tensor / per-head one. A combined pool's
  values go to the odd heads of the key pages."""
  page_size = pool.key_pages.shape[2 if kv_layout == "HND" else 1]
  dest = _slots(pool, at, pool.key_pages.shape[0], page_size)
  flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[-2:])
  k, v = flat(key), flat(value)

  def put(pages, x, heads=None):
    # NHD pages (P, page_size, K', X), HND (P, K', page_size, X); ``heads`` a combined pool's
    # key (0) or value (1) heads.
    idx: tuple[Any, ...] = (
      (dest.page, slice(None), dest.offset) if kv_layout == "HND" else (dest.page, dest.offset)
    )
    if heads is not None:
      idx = idx + (slice(heads, None, 2),)
    return pages.at[idx].set(x, mode="drop", unique_indices=True)

  def encode(pages, x, scale, kind):
    if kind is None:
      return x, scale, None
    given = None if kind == "token" else _heads_last(scale, kind)
    q, s = quantize(x, pages.dtype, given, scale.dtype)
    return q, scale, s if kind == "token" else None

  combined = kv_layout == "combined"
  kq, k_scale, k_token = encode(pool.key_pages, k, pool.k_scale, kinds[0])
  values = pool.key_pages if combined else pool.value_pages
  vq, v_scale, v_token = None, pool.v_scale, None
  if v is not None:
    vq, v_scale, v_token = encode(values, v, pool.v_scale, kinds[1])
  key_pages = put(pool.key_pages, kq, 0 if combined else None)
  value_pages = pool.value_pages
  if v is not None and combined:
    key_pages = put(key_pages, vq, 1)
  elif v is not None:
    value_pages = put(value_pages, vq)
  if k_token is not None:
    k_scale = put(k_scale[..., None], k_token[..., None])[..., 0]
  if v_token is not None:
    v_scale = put(v_scale[..., None], v_token[..., None])[..., 0]
  return pool._replace(
    key_pages=key_pages, value_pages=value_pages, k_scale=k_scale, v_scale=v_scale
  )


class Written(NamedTuple):
  """Where each of n new tokens goes: pool page ``page`` (n,) -- an id past the pool (each
  its own: P + i) for a token not written -- and ``offset`` (n,) within it."""

  page: Any
  offset: Any


def _slots(pool: Pool, at: metadata.Owners, P: int, page_size: int) -> Written:
  """The pages and offsets of the new rows (``at``): row r, the i-th of sequence b's n, at cache
  position kv_lengths[b] - n + i, through the page table (B, max_pages). Rows not live, and
  positions outside the table (negative, or past a full cache), go nowhere (never clamped onto
  a page of another sequence)."""
  # Distinct ids past the pool for the dropped tokens: the scatter's indices are then unique
  # (no atomics on a GPU) and every one of them out of bounds is dropped.
  nowhere = P + jnp.arange(at.seq.shape[0], dtype=jnp.int32)
  table, seq = pool.page_table.astype(jnp.int32), at.seq
  B, cols = table.shape
  if B == 0 or cols == 0:  # no sequence, or no page: every row is padding
    return Written(nowhere, jnp.zeros_like(nowhere))
  position = pool.kv_lengths.astype(jnp.int32)[seq] - at.count[seq] + at.within
  col = position // page_size
  page = table[seq, jnp.clip(col, 0, cols - 1)]
  live = at.live & (position >= 0) & (col < cols) & (page >= 0) & (page < P)
  return Written(jnp.where(live, page, nowhere), position % page_size)


def quantize(x, dtype, scale=None, scale_dtype=jnp.float32):
  """(x in ``dtype``, scale): ``scale`` None: each token and head scaled so its largest
  magnitude is the dtype's largest value (int8: 127, rounded to the nearest integer), the scale
  (..., K) returned in ``scale_dtype`` (the tokens divided by the scale as stored, so that
  stored scale times stored token is the dequantised value); a given scale (broadcasting
  against x without its last axis: a per-tensor or per-head calibration) is used as it is."""
  dtype = jnp.dtype(dtype)
  top = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
  if scale is None:
    amax = jnp.abs(x.astype(jnp.float32)).max(axis=-1)
    scale = jnp.where(amax > 0, amax / top, jnp.ones((), jnp.float32)).astype(scale_dtype)
  y = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)[..., None]
  if dtype == jnp.int8:
    y = jnp.round(y)
  # Clipped first: a value past the dtype's range would become inf / NaN in float8.
  return jnp.clip(y, -top, top).astype(dtype), scale


def _heads_last(scale, kind):
  """A per-tensor () or per-head (K,) scale as it broadcasts against tokens (n, K)."""
  return scale.astype(jnp.float32) if kind == "tensor" else scale.astype(jnp.float32)[None, :]
