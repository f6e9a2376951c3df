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


def quantize(x, dtype):
  """(x in ``dtype``, scale (..., K) float32): each token and head scaled so its largest
  magnitude is the dtype's largest value (int8: 127, rounded to the nearest integer)."""
  dtype = jnp.dtype(dtype)
  top = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
  amax = jnp.abs(x.astype(jnp.float32)).max(axis=-1)
  scale = jnp.where(amax > 0, amax / top, jnp.ones((), jnp.float32))
  y = x.astype(jnp.float32) / scale[..., None]
  if dtype == jnp.int8:
    y = jnp.round(y)
  return jnp.clip(y, -top, top).astype(dtype), scale


def write(pools, page_table, slots, k, v):
  """``pools`` with the new keys k (B, T, K, H) and values v (B, T, K, Hv) written at cache
  positions ``slots`` (B, T) through ``page_table`` (B, max_pages); a quantised pool's tokens
  are quantised per token and head, their scales written beside them. A position past the
  table (a full cache) is dropped, not clamped onto the last page."""
  P, ps = pools[0].shape[:2]
  col = slots // ps
  page = jnp.take_along_axis(
    page_table.astype(jnp.int32), jnp.minimum(col, page_table.shape[1] - 1), axis=1
  )
  page, off = jnp.where(col < page_table.shape[1], page, P), slots % ps
  written: tuple[jax.Array, ...]
  if len(pools) == 4:
    (kq, k_scale), (vq, v_scale) = quantize(k, pools[0].dtype), quantize(v, pools[1].dtype)
    written = (kq, vq, k_scale, v_scale)
  else:
    written = (k, v)
  return tuple(pool.at[page, off].set(x, mode="drop") for pool, x in zip(pools, written))


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
        f"{pages_name} must have the query's dtype {dtype} or be int8 / float8 "
        f"(with {name}), got {pages.dtype}"
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
