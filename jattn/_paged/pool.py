"""The KV pool's format and its one check, for every reader and writer of pages
(`jattn.paged_attention`, `jattn.write_pages` and the Flax modules' paged caches): the layouts,
the quantised dtypes with their scales, and `check` -- a pool passed in, against the tokens that
meet it (a read's query, a write's new keys and values).

Shapes: P pages of ``page_size`` tokens, K key/value heads (a combined pool holds 2K), H key and
Hv value head sizes; B sequences, T new tokens each (or ``total`` ragged rows), N query heads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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
QUANTIZED = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)


class Pool(NamedTuple):
  """What a paged walk (XLA or Pallas) reads of the cache and a write updates: the pools, the
  page table (B, max_pages), the sequences' lengths (B,) and the scales of quantised pages (None
  for float pages)."""

  key_pages: Any
  value_pages: Any
  page_table: Any
  kv_lengths: Any
  k_scale: Any = None
  v_scale: Any = None


class Declared(NamedTuple):
  """What a call says of its pool beside the arrays, checked against them: the layout, the
  optional cross-checks ``page_size`` and ``num_kv_heads``, a read's ``value_head_dim``
  (absorbed MLA's Hv, or a cross-check of a value pool's) and whether one array came as both
  pools (``same_array``: told before the arrays are converted)."""

  kv_layout: Any = "NHD"
  page_size: Any = None
  num_kv_heads: Any = None
  value_head_dim: Any = None
  same_array: bool = False


class Tokens(NamedTuple):
  """What meets the pool: a read's query, (B, T, N, H) or ragged (total, N, H), or a write's
  new keys (B, T, K, H) or (total, K, H) and values likewise with Hv (None: a pool of keys
  only)."""

  query: Any = None
  key: Any = None
  value: Any = None
  ragged: bool = False


class PoolSizes(NamedTuple):
  """A checked pool's sizes and how its scales apply ("tensor", "head", "token", or None for
  float pages); ``latent``: absorbed MLA's one pool, whose keys' first Hv features are the
  values."""

  P: int
  page_size: int
  K: int
  H: int
  Hv: int
  k_scale: str | None
  v_scale: str | None
  latent: bool = False


def is_quantized(dtype) -> bool:
  return any(jnp.dtype(dtype) == jnp.dtype(d) for d in QUANTIZED)


def check(pool: Pool, tokens: Tokens, declared: Declared) -> tuple[Pool, PoolSizes]:
  """The pool (its arrays already of their kinds) checked against the tokens and what the call
  declared, errors naming the argument: (the pool as the walks read it -- a combined pool is its
  own value pool, absorbed MLA has none -- and its sizes)."""
  kv_layout = declared.kv_layout
  if kv_layout not in LAYOUTS:
    raise ValueError(
      f"kv_layout must be one of {LAYOUTS} (pages {DIMS}), got kv_layout={kv_layout!r}"
    )
  _check_declared(pool.key_pages, declared)
  read = tokens.query is not None
  latent = _latent(pool, tokens, declared) if read else _keys_only(pool, tokens, kv_layout)
  key_pages, value_pages, (P, page_size, K, H) = _checked_pools(
    pool.key_pages, pool.key_pages if latent else pool.value_pages, kv_layout
  )
  Hv = declared.value_head_dim if read and latent else value_pages.shape[-1]
  if read and latent and Hv > H:
    raise ValueError(
      f"value_head_dim={Hv} must be in 1 .. H={H} (the values are the first "
      f"value_head_dim features of the latent pool), key_pages.shape={key_pages.shape}"
    )
  pools = (key_pages, value_pages)
  if read:
    kinds = _check_query(tokens.query, pool, pools, (kv_layout, K, H), latent)
  else:
    kinds = _check_new_tokens(tokens, pool, pools, (kv_layout, K, H, Hv))
  checked = pool._replace(key_pages=key_pages, value_pages=None if latent else value_pages)
  return checked, PoolSizes(P, page_size, K, H, Hv, kinds[0], kinds[1], read and latent)


def _check_declared(key_pages, declared: Declared) -> None:
  """What shapes cannot tell: one pool passed as both keys and values, and (when the caller
  says page_size / num_kv_heads) a pool of the other layout whose sizes happen to fit."""
  if declared.same_array:
    raise ValueError(
      "key_pages and value_pages are the same array: a pool holding keys and "
      "values together, heads interleaved (vLLM's TPU cache), is "
      "kv_layout='combined' with value_pages=None; one whose keys' first Hv features are "
      "the values (absorbed MLA's latent pool) is value_pages=None with value_head_dim=Hv"
    )
  kv_layout = declared.kv_layout
  heads = 2 if kv_layout == "combined" else 1  # a combined pool holds K key and K value heads
  num_kv_heads = declared.num_kv_heads
  for name, want, axis in (
    ("page_size", declared.page_size, 2 if kv_layout == "HND" else 1),
    ("num_kv_heads", num_kv_heads and num_kv_heads * heads, 1 if kv_layout == "HND" else 2),
  ):
    shape = key_pages.shape
    if want is not None and len(shape) == 4 and shape[axis] != want:
      raise ValueError(
        f"{name}={want} but key_pages.shape={tuple(shape)} has {shape[axis]} on "
        f"the axis kv_layout={kv_layout!r} puts it (pages (P, page_size, K, H) "
        f"for 'NHD', (P, K, page_size, H) for 'HND'): is the pool in the other "
        f"layout?"
      )


def _latent(pool: Pool, tokens: Tokens, declared: Declared) -> bool:
  """Whether a read is absorbed MLA (value_pages None, values the latent pool's first
  ``value_head_dim`` features), ``value_head_dim`` checked against the other arguments (its
  upper bound, the pool's H, once the pool is checked)."""
  value_head_dim, kv_layout = declared.value_head_dim, declared.kv_layout
  value_pages = pool.value_pages
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
    shape = value_pages.shape
    if shape and shape[-1] != value_head_dim:
      raise ValueError(
        f"value_head_dim={value_head_dim} but value_pages.shape={tuple(shape)} has Hv="
        f"{shape[-1]}; for absorbed MLA (values inside the latent pool) pass value_pages=None"
      )
    return False
  if pool.v_scale is not None:
    raise ValueError(
      "v_scale must be None with value_pages=None (absorbed MLA): the values are the latent "
      "pool's first value_head_dim features and share its k_scale"
    )
  return True


def _keys_only(pool: Pool, tokens: Tokens, kv_layout) -> bool:
  """Whether a write's pool holds keys only (value_pages None outside a combined pool: absorbed
  MLA's latent), the new values and v_scale checked against it."""
  keys_only = pool.value_pages is None and kv_layout != "combined"
  if keys_only and tokens.value is not None:
    raise ValueError(
      "value_pages=None is a pool of keys only (absorbed MLA's latent, its values the keys' "
      f"first features): pass value=None, or pass the value pool; got value of shape "
      f"{tokens.value.shape}"
    )
  if not keys_only and tokens.value is None:
    raise TypeError(
      "value must be the new values, (B, T, K, Hv) or ragged (total, K, Hv), got None (None "
      "only with value_pages=None: a pool of keys only)"
    )
  if keys_only and pool.v_scale is not None:
    raise ValueError("v_scale is for value pages; a pool of keys only has none: pass v_scale=None")
  return keys_only


def _checked_pools(key_pages, value_pages, kv_layout):
  """The pools (value_pages None in a combined pool) checked, and their (P, page_size, K, H) (a
  combined pool is both pools)."""
  dims = DIMS[kv_layout]
  _check_pages("key_pages", key_pages, dims)
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
  _check_pages("value_pages", value_pages, dims)
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


def _check_pages(name, x, dims) -> None:
  if x is None:
    raise TypeError(f"{name} must be an array of pages, got None")
  if x.ndim != 4:
    raise ValueError(f"{name} must be {dims}, got {name}.shape={x.shape}")


def _check_query(query, pool: Pool, pools: tuple, sizes: tuple, latent: bool) -> tuple:
  """A read's query against the pool's heads (``sizes`` = (kv_layout, K, H)): (k_scale's kind,
  v_scale's kind); float pages must hold the query's dtype."""
  kv_layout, K, H = sizes
  N = query.shape[-2]
  if query.shape[-1] != H:
    raise ValueError(f"query's head size must be key_pages' H={H}: query.shape={query.shape}")
  if N % K:
    raise ValueError(f"the query heads N={N} must be a multiple of the key/value heads K={K}")
  dims = DIMS[kv_layout]
  k_kind = scale_kind("k_scale", pool.k_scale, pools[0], query.dtype, dims, K)
  if latent:  # the values share the latent pool's scale
    return k_kind, None
  return k_kind, scale_kind("v_scale", pool.v_scale, pools[1], query.dtype, dims, K)


def _check_new_tokens(tokens: Tokens, pool: Pool, pools: tuple, sizes: tuple) -> tuple:
  """A write's new keys and values against the pool's heads (``sizes`` = (kv_layout, K, H,
  Hv)): (k_scale's kind, v_scale's kind); float pools take tokens of their own dtype,
  calibrations are > 0."""
  kv_layout, K, H, Hv = sizes
  key, value, ragged = tokens.key, tokens.value, tokens.ragged
  lead = "(total, " if ragged else "(B, T, "
  for name, x, X in (("key", key, H), ("value", value, Hv)):
    if x is not None and x.shape[-2:] != (K, X):  # the rank is the metadata's (check_shapes)
      raise ValueError(
        f"{name} must be {lead}K, {'H' if name == 'key' else 'Hv'}) = {lead}{K}, {X}) like "
        f"the pool's heads{' with query_start' if ragged else ''}, got {name}.shape={x.shape}"
      )
  if value is not None and value.shape[:-2] != key.shape[:-2]:
    raise ValueError(
      f"value must have key's tokens: key.shape={key.shape}, value.shape={value.shape}"
    )
  for name, pages, x in (("key_pages", pools[0], key), ("value_pages", pools[1], value)):
    if x is not None and not is_quantized(pages.dtype) and pages.dtype != x.dtype:
      raise TypeError(
        f"{name} of dtype {pages.dtype} take new tokens of that dtype (a quantised pool: any "
        f"float dtype), got {'key' if name == 'key_pages' else 'value'}.dtype={x.dtype}"
      )
  dims = DIMS[kv_layout]
  kinds = (
    scale_kind("k_scale", pool.k_scale, pools[0], key.dtype, dims, K),
    None if value is None else scale_kind("v_scale", pool.v_scale, pools[1], value.dtype, dims, K),
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


def scale_kind(name, scale, pages, dtype, dims, K):
  """How ``scale`` (a float array or None) broadcasts against quantised ``pages``: "tensor",
  "head" or "token"; None for float pages (which must have the tokens' dtype and no scale)."""
  pages_name = "key_pages" if name == "k_scale" else "value_pages"
  if not is_quantized(pages.dtype):
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
