"""Reading a key block of every tile's sequence from the pool, where it lies: its page ids
through the page table, the pages gathered (a pool page longer than a block cut into pieces), the
keys laid out as the matmuls take them -- pieces of keys batched with the tile and the head, so
that no head-major pool is relaid out -- and quantised pages converted, their scales beside them.

Shapes: M tiles, K key/value heads, c pieces of bk / c keys per block (bk = ``PagedPlan.block``),
X the head size read (H keys, Hv values), P pages of ``page_size`` tokens, ppb pages per block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn._paged.plan import PagedPlan

# float8 layouts: (mantissa bits, exponent bias); the exponent takes the other bits but the sign.
_FLOAT8 = {jnp.dtype(jnp.float8_e4m3fn): (3, 7), jnp.dtype(jnp.float8_e5m2): (2, 15)}
_UINT = {1: jnp.uint8, 2: jnp.uint16}


def page_ids(st: PagedPlan, page_table, seq, j, P):
  """(M, pages per block): the pages of key block j of each tile's sequence, counted as
  `_take_pages` reads them (pool page p cut into ``st.sub`` pieces: pages p * sub + i)."""
  cols = j * st.pages_per_block + jnp.arange(st.pages_per_block, dtype=jnp.int32)
  cols = jnp.minimum(cols, st.max_pages - 1)
  ids = jnp.take(page_table, seq, axis=0)  # (M, max_pages of the pool)
  ids = jnp.take(ids, cols // st.sub, axis=1, mode="clip")
  # Entries past a sequence's last page may be anything: read a page that exists; the mask
  # hides what it holds.
  return jnp.clip(ids.astype(jnp.int32), 0, P - 1) * st.sub + (cols % st.sub)[None, :]


def read(st: PagedPlan, pages, ids, scale, scale_kind, dtype, keep=None, heads=0):
  """A block of the pool as (M, c, K, bk / c, X) and its scale as (M, c, K, 1, bk / c) (or one
  that broadcasts so; None for float pages). Quantised pages become float32, float pages stay
  in the query's dtype; ``keep`` (M, c, 1, bk / c, 1) zeroes the keys it marks False; ``heads``
  (0 keys, 1 values) picks the pages' half of a combined pool."""
  if st.upcast and pages.dtype.itemsize < 4 and jnp.issubdtype(pages.dtype, jnp.floating):
    # Gathered as unsigned integers of their width and converted by arithmetic on their bits
    # (`float32_from_bits`): XLA's CPU gather of 16- and 8-bit floats, and its float8
    # converts, are slower (docs/benchmarks.md, "Tuning constants").
    raw = jax.lax.bitcast_convert_type(pages, _UINT[pages.dtype.itemsize])
    x = float32_from_bits(_half(st, _take_pages(st, raw, ids), heads), pages.dtype)
  else:
    x = _half(st, _take_pages(st, pages, ids), heads)  # (M, ppb, ps, K, X) | (M, ppb, K, ps, X)
  x = _as_pieces(st, x)
  x = x.astype(jnp.float32) if scale_kind is not None else x
  if keep is not None:
    x = jnp.where(keep, x, jnp.zeros((), x.dtype))
  if scale_kind is None:
    return x.astype(jnp.float32 if st.upcast else dtype), None
  if scale_kind == "tensor":
    return x, scale.astype(jnp.float32)
  if scale_kind == "head":
    return x, scale.astype(jnp.float32).reshape(1, 1, st.K, 1, 1)
  # Per token and head: laid out as the block is, one value per key.
  sc = jnp.swapaxes(_as_pieces(st, _take_pages(st, scale, ids)[..., None]), -1, -2)
  sc = sc.astype(jnp.float32)  # (M, c, K, 1, bk / c)
  if keep is not None:  # a hidden key's scale may be garbage too: 0 * NaN is NaN
    sc = jnp.where(jnp.swapaxes(keep, -1, -2), sc, jnp.zeros((), sc.dtype))
  return x, sc


def latent_values(st: PagedPlan, k, ks, keep):
  """Absorbed MLA's values and their scale from the block's keys (M, c, K, bk / c, H) as read:
  their first Hv features and the keys' scale (no second gather of the pages), hidden keys'
  values and per-token scales zeroed as `read` zeroes a value pool's."""
  v = jnp.where(keep, k[..., : st.Hv], jnp.zeros((), k.dtype))
  if ks is not None and st.k_scale_kind == "token":
    ks = jnp.where(jnp.swapaxes(keep, -1, -2), ks, jnp.zeros((), ks.dtype))
  return v, ks


def _take_pages(st: PagedPlan, pages, ids):
  """Pages ``ids`` (M, ppb) of the pool (or of its per-token scales), cut into ``st.sub``
  pieces each: piece i of pool page p is page p * sub + i."""
  if st.sub == 1:
    return jnp.take(pages, ids, axis=0)
  if st.token_major:  # (P, sub * ps, ...) is (P * sub, ps, ...) as it lies
    return jnp.take(pages.reshape((-1, st.page_size) + pages.shape[2:]), ids, axis=0)
  cut = pages.reshape(pages.shape[:2] + (st.sub, st.page_size) + pages.shape[3:])
  return cut[ids // st.sub, :, ids % st.sub]  # (M, ppb, K, ps, ...)


def _as_pieces(st: PagedPlan, x):
  """Gathered pages (M, ppb, page_size, K, X) (NHD) or (M, ppb, K, page_size, X) (HND) as the
  block's pieces, (M, c, K, bk / c, X)."""
  M, X = x.shape[0], x.shape[-1]
  if st.token_major:
    return jnp.moveaxis(x, 3, 1).reshape(M, 1, st.K, st.block, X)
  if st.pieces == 1:
    return jnp.moveaxis(x, 2, 1).reshape(M, 1, st.K, st.block, X)
  return x  # HND page by page: the pages are the pieces


def _half(st: PagedPlan, x, heads):
  """Gathered pages' key (heads=0) or value (1) heads: a combined pool's 2K heads alternate."""
  return x[..., heads::2, :] if st.kv_layout == "combined" else x


def float32_from_bits(u, dtype):
  """Floats of ``dtype`` given as their bits ``u`` (unsigned ints), as float32, exactly; by
  integer arithmetic on the bits where XLA's CPU backend would convert element by element in
  software."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bfloat16:  # the high half of a float32
    return jax.lax.bitcast_convert_type(u.astype(jnp.uint32) << 16, jnp.float32)
  if dtype not in _FLOAT8:
    return jax.lax.bitcast_convert_type(u.astype(jnp.uint16), dtype).astype(jnp.float32)
  m_bits, bias = _FLOAT8[dtype]
  u = u.astype(jnp.uint32)
  em = u & 0x7F  # exponent and mantissa
  # A normal number's bits moved into float32's fields, its exponent re-biased; a subnormal
  # one (exponent 0) is its mantissa times the smallest subnormal (float32 subnormals may be
  # flushed to zero on the CPU, so they are not used).
  normal = jax.lax.bitcast_convert_type((em << (23 - m_bits)) + ((127 - bias) << 23), jnp.float32)
  sub = em.astype(jnp.float32) * jnp.float32(2.0 ** (1 - bias - m_bits))
  v = jnp.where(em < (1 << m_bits), sub, normal)
  if dtype == jnp.float8_e4m3fn:  # all ones: NaN (no infinities)
    v = jnp.where(em == 0x7F, jnp.float32(jnp.nan), v)
  else:  # the top exponent: infinity (mantissa 0) or NaN
    v = jnp.where(em >= 0x7C, jnp.where(em == 0x7C, jnp.float32(jnp.inf), jnp.float32(jnp.nan)), v)
  return jnp.where(u >= 0x80, -v, v)
