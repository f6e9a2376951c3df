"""The KV pool's format, one home for every reader and writer of pages (`jattn.paged_attention`,
its Pallas kernels and the Flax modules' caches): the layouts, the quantised dtypes with their
scales, the checks of a pool passed in, writing new tokens into pages and decoding 8- and 16-bit
floats from their bits."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# Pool layouts (FlashInfer's names): NHD pages are (page_size, K, H), token-major as vLLM and
# FlashAttention keep them; HND pages are (K, page_size, H), head-major, so that a page's keys
# of one head are contiguous and reach the matmuls without a relayout. "combined" is one pool
# of token-major pages (page_size, 2K, H) holding key head k at 2k and its values at 2k + 1, as
# vLLM's TPU backend stores its cache (read where it lies, never split into two pools).
LAYOUTS = ("NHD", "HND", "combined")
DIMS = {
  "NHD": "(P, page_size, K, H)",
  "HND": "(P, K, page_size, H)",
  "combined": "(P, page_size, 2K, H)",
}


class Pool(NamedTuple):
  """What a paged walk (XLA or Pallas) reads of the cache: the pools, the page table
  (B, max_pages), the sequences' lengths (B,) and the scales of quantised pages (None for float
  pages)."""

  key_pages: Any
  value_pages: Any
  page_table: Any
  kv_lengths: Any
  k_scale: Any = None
  v_scale: Any = None


QUANTIZED = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)


def is_quantized(dtype) -> bool:
  return any(jnp.dtype(dtype) == jnp.dtype(d) for d in QUANTIZED)


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


class Written(NamedTuple):
  """Where each of n new tokens goes: pool page ``page`` (n,) -- an id past the pool (each
  its own: P + i) for a token not written -- and ``offset`` (n,) within it."""

  page: Any
  offset: Any


def slots(page_table, seq, position, live, P: int, page_size: int) -> Written:
  """The pages and offsets of tokens at cache positions ``position`` (n,) of sequences ``seq``
  (n,) through ``page_table`` (B, max_pages); tokens not ``live`` (n,) bool, and positions past
  the table (a full cache), go nowhere (never clamped onto a page of another sequence)."""
  col = position // page_size
  cols = page_table.shape[1]
  page = page_table.astype(jnp.int32)[seq, jnp.clip(col, 0, cols - 1)]
  live = live & (position >= 0) & (col < cols) & (page >= 0) & (page < P)
  # Distinct ids past the pool for the dropped tokens: the scatter's indices are then unique
  # (no atomics on a GPU) and every one of them out of bounds is dropped.
  nowhere = P + jnp.arange(seq.shape[0], dtype=jnp.int32)
  return Written(jnp.where(live, page, nowhere), position % page_size)


def write(pool: Pool, layout: str, at: Written, k, v, kinds) -> Pool:
  """``pool`` (its pages and scales; the table and lengths untouched) with new keys k
  (n, K, H) and values v (n, K, Hv) (None: a pool of keys only, absorbed MLA's latent) written
  at ``at``. ``kinds`` = (k_scale's, v_scale's) `scale_kind`: quantised tokens take a per-token
  scale computed from them ("token", written beside them) or the given per-tensor / per-head
  one. A combined pool's values go to the odd heads of the key pages."""

  def put(pages, x, heads=None):
    # NHD pages (P, page_size, K', X), HND (P, K', page_size, X); ``heads`` a combined pool's
    # key (0) or value (1) heads.
    idx: tuple[Any, ...] = (
      (at.page, slice(None), at.offset) if layout == "HND" else (at.page, at.offset)
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

  kq, k_scale, k_token = encode(pool.key_pages, k, pool.k_scale, kinds[0])
  values = pool.value_pages if layout != "combined" else pool.key_pages
  vq, v_scale, v_token = None, pool.v_scale, None
  if v is not None:
    vq, v_scale, v_token = encode(values, v, pool.v_scale, kinds[1])
  key_pages = put(pool.key_pages, kq, 0 if layout == "combined" else None)
  value_pages = pool.value_pages
  if v is not None and layout == "combined":
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


def _heads_last(scale, kind):
  """A per-tensor () or per-head (K,) scale as it broadcasts against tokens (n, K)."""
  return scale.astype(jnp.float32) if kind == "tensor" else scale.astype(jnp.float32)[None, :]


# float8 layouts: (mantissa bits, exponent bias); the exponent takes the other bits but the sign.
_FLOAT8 = {jnp.dtype(jnp.float8_e4m3fn): (3, 7), jnp.dtype(jnp.float8_e5m2): (2, 15)}
UINT = {1: jnp.uint8, 2: jnp.uint16}


def float32_from_bits(u, dtype):
  """Floats of ``dtype`` given as their bits ``u`` (unsigned ints), as float32, exactly; by
  integer arithmetic on the bits where XLA's CPU backend would convert element by element in
  software (float8: about ten times slower)."""
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


def checked_pools(key_pages, value_pages, kv_layout):
  """The pools (arrays, or value_pages None) checked, and their (P, page_size, K, H) (a combined
  pool is both pools)."""
  dims = DIMS[kv_layout]
  key_pages = checked_pages("key_pages", key_pages, dims)
  if kv_layout == "combined":
    if value_pages is not None:
      raise ValueError(
        "kv_layout='combined' keeps values in key_pages (heads 1, 3, ...): pass value_pages=None"
      )
    if key_pages.shape[2] % 2:
      raise ValueError(
        f"a combined pool has 2K heads (key, value, key, ...): key_pages.shape="
        f"{key_pages.shape} has {key_pages.shape[2]}"
      )
    value_pages = key_pages
  value_pages = checked_pages("value_pages", value_pages, dims)
  if kv_layout == "HND":
    P, K, page_size, H = key_pages.shape
  else:
    P, page_size, K, H = key_pages.shape
    K = K // 2 if kv_layout == "combined" else K
  if value_pages.shape[:3] != key_pages.shape[:3]:
    raise ValueError(
      f"value_pages must have key_pages' first three sizes {dims[:-4]}): "
      f"key_pages.shape={key_pages.shape}, value_pages.shape={value_pages.shape}"
    )
  return key_pages, value_pages, (P, page_size, K, H)


def check_layout_name(kv_layout) -> None:
  """``kv_layout`` is one of LAYOUTS, else a ValueError naming them."""
  if kv_layout not in LAYOUTS:
    raise ValueError(
      f"kv_layout must be one of {LAYOUTS} (pages {DIMS}), got kv_layout={kv_layout!r}"
    )


def check_layout(key_pages, value_pages, kv_layout, page_size, num_kv_heads):
  """What shapes cannot tell: one pool passed as both keys and values, and (when the caller
  says page_size / num_kv_heads) a pool of the other layout whose sizes happen to fit."""
  if key_pages is value_pages and key_pages is not None:
    raise ValueError(
      "key_pages and value_pages are the same array: a pool holding keys and "
      "values together, heads interleaved (vLLM's TPU cache), is "
      "kv_layout='combined' with value_pages=None; one whose keys' first Hv features are "
      "the values (absorbed MLA's latent pool) is value_pages=None with value_head_dim=Hv"
    )
  heads = 2 if kv_layout == "combined" else 1  # a combined pool holds K key and K value heads
  for name, want, axis in (
    ("page_size", page_size, 2 if kv_layout == "HND" else 1),
    ("num_kv_heads", num_kv_heads and num_kv_heads * heads, 1 if kv_layout == "HND" else 2),
  ):
    shape = getattr(key_pages, "shape", ())
    if want is not None and len(shape) == 4 and shape[axis] != want:
      raise ValueError(
        f"{name}={want} but key_pages.shape={tuple(shape)} has {shape[axis]} on "
        f"the axis kv_layout={kv_layout!r} puts it (pages (P, page_size, K, H) "
        f"for 'NHD', (P, K, page_size, H) for 'HND'): is the pool in the other "
        f"layout?"
      )


def check_value_head_dim(key_pages, value_pages, kv_layout, value_head_dim, v_scale) -> bool:
  """Whether a call is absorbed MLA (value_pages None, values the latent pool's first
  ``value_head_dim`` features), ``value_head_dim`` checked against the other arguments (its
  upper bound, the pool's H, where the pool is checked)."""
  if value_head_dim is None:
    if value_pages is None and kv_layout != "combined":
      raise TypeError(
        "value_pages must be an array of pages, got None (absorbed MLA, a latent pool whose "
        "first Hv features are the values, takes value_pages=None with value_head_dim=Hv; a "
        "pool of interleaved key and value heads is kv_layout='combined')"
      )
    return False
  if isinstance(value_head_dim, bool) or not hasattr(value_head_dim, "__index__"):
    raise TypeError(f"value_head_dim must be an int (Hv), got {value_head_dim!r}")
  if kv_layout == "combined":
    raise ValueError(
      "value_head_dim is for absorbed MLA (value_pages=None, one latent pool whose first Hv "
      "features are the values); kv_layout='combined' interleaves key and value heads of "
      "equal size: pass value_head_dim=None"
    )
  if value_head_dim <= 0:
    raise ValueError(f"value_head_dim must be in 1 .. H, got value_head_dim={value_head_dim}")
  if value_pages is not None:  # a cross-check of a value pool's last size, no MLA
    shape = getattr(value_pages, "shape", ())
    if shape and shape[-1] != value_head_dim:
      raise ValueError(
        f"value_head_dim={value_head_dim} but value_pages.shape={tuple(shape)} has Hv="
        f"{shape[-1]}; for absorbed MLA (values inside the latent pool) pass value_pages=None"
      )
    return False
  if v_scale is not None:
    raise ValueError(
      "v_scale must be None with value_pages=None (absorbed MLA): the values are the latent "
      "pool's first value_head_dim features and share its k_scale"
    )
  return True


def checked_pages(name, x, dims):
  if x is None:
    raise TypeError(f"{name} must be an array of pages, got None")
  if x.ndim != 4:
    raise ValueError(f"{name} must be {dims}, got {name}.shape={x.shape}")
  return x


def scale_kind(name, scale, pages, dtype, dims, K):
  """How ``scale`` (a float array or None) broadcasts against quantised ``pages``: "tensor", "head" or "token"; None for
  float pages (which must have the query's dtype and no scale)."""
  pages_name = "key_pages" if name == "k_scale" else "value_pages"
  quantized = is_quantized(pages.dtype)
  if not quantized:
    if pages.dtype != dtype:
      raise TypeError(
        f"query and {pages_name} must have one dtype (or the pages int8 / float8 with "
        f"{name}): query.dtype={dtype}, {pages_name}.dtype={pages.dtype}; cast one of them"
      )
    if scale is not None:
      raise ValueError(f"{name} is for int8 / float8 pages; {pages_name} are {pages.dtype}")
    return None
  if scale is None:
    raise ValueError(
      f"{pages_name} of dtype {pages.dtype} need {name} (their dequantisation scale)"
    )
  token = pages.shape[:3] if "2K" not in dims else pages.shape[:2] + (K,)  # combined: K of 2K
  for kind, shape in (("tensor", ()), ("head", (K,)), ("token", token)):
    if scale.shape == shape:
      return kind
  per_token = dims[:-4].replace("2K", "K")
  raise ValueError(
    f"{name} must be () per tensor, (K,) = ({K},) per head or {per_token}) = "
    f"{token} per token and head, got shape {scale.shape}"
  )
