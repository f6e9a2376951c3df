"""What jattn's linen and nnx attention modules share: options, RoPE, the KV cache and the call.

The two modules differ only in how flax stores parameters and cache variables; everything that
decides the numbers lives here, so they cannot drift apart.

Shapes: B batch, T query length, S key length, S_max cache length, N query heads, K key/value
heads (K divides N: GQA / MQA), H head dim, D model features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import _paged, _validation
from jattn import masks as _masks
from jattn._attention import attention_weights, dot_product_attention
from jattn._types import CausalAlignment, Implementation


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
  """The validated, static attention options of one module."""

  num_heads: int
  num_kv_heads: int
  head_dim: int
  value_head_dim: int
  is_causal: CausalAlignment | None
  window: tuple[int, int] | None
  logits_soft_cap: float | None
  scale: float | None
  implementation: Implementation | None
  block_q: int | None
  block_kv: int | None
  rope: bool
  rope_base: float
  dropout_rate: float
  broadcast_dropout: bool


class Arguments(NamedTuple):
  """A module's attention arguments as the user gave them, unchecked (linen's attributes, nnx's
  constructor arguments: the same names in both); `options` checks them. ``qkv_features`` is
  resolved already (the queries' input features D when the user left it None)."""

  num_heads: Any
  num_kv_heads: Any
  qkv_features: Any
  is_causal: Any
  local_window_size: Any
  logits_soft_cap: Any
  scale: Any
  implementation: Any
  block_q: Any
  block_kv: Any
  rope: Any
  rope_base: Any
  dropout_rate: Any
  broadcast_dropout: Any
  value_head_dim: Any = None


def options(given: Arguments) -> Options:
  """Check a module's constructor arguments (the `jattn._validation` policy: TypeError for a
  wrong type, ValueError for a wrong value); errors name the argument."""
  num_heads = _validation.positive_int("num_heads", given.num_heads)
  qkv_features = _validation.positive_int("qkv_features", given.qkv_features)
  num_kv_heads = _validation.positive_int("num_kv_heads", given.num_kv_heads, optional=True)
  if num_kv_heads is None:
    num_kv_heads = num_heads
  if num_heads % num_kv_heads:
    raise ValueError(
      f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} (each "
      f"key/value head serves num_heads // num_kv_heads query heads)"
    )
  if qkv_features % num_heads:
    raise ValueError(
      f"qkv_features={qkv_features} must be divisible by num_heads={num_heads} "
      f"(the head dim is qkv_features // num_heads)"
    )
  head_dim = qkv_features // num_heads
  value_head_dim = _validation.positive_int("value_head_dim", given.value_head_dim, optional=True)
  rope = _validation.flag("rope", given.rope)
  if rope and head_dim % 2:
    raise ValueError(
      f"rope=True rotates pairs of features: the head dim qkv_features // "
      f"num_heads = {head_dim} must be even"
    )
  return Options(
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    value_head_dim=head_dim if value_head_dim is None else value_head_dim,
    is_causal=_validation.causal(given.is_causal),
    window=_validation.window(given.local_window_size),
    logits_soft_cap=_validation.soft_cap(given.logits_soft_cap),
    scale=_validation.scale(given.scale),
    implementation=_validation.implementation(given.implementation),
    block_q=_validation.block("block_q", given.block_q),
    block_kv=_validation.block("block_kv", given.block_kv),
    rope=rope,
    rope_base=_validation.real("rope_base", given.rope_base, above=1),
    dropout_rate=_validation.real("dropout_rate", given.dropout_rate, at_least=0, below=1),
    broadcast_dropout=_validation.flag("broadcast_dropout", given.broadcast_dropout),
  )


class Masking(NamedTuple):
  """A call's masking arguments as the module got them (see the modules' ``__call__``): ``mask``
  (a `jattn.masks` object, or an array broadcastable to (B, N, T, S)), RoPE ``positions`` (T,) or
  (B, T) and ``kv_positions`` (S,) or (B, S), ``query_seq_lengths`` and
  ``key_value_seq_lengths`` (B,), ``q_segment_ids`` (B, T) and ``kv_segment_ids`` (B, S); None
  where not given."""

  mask: Any = None
  positions: Any = None
  kv_positions: Any = None
  query_seq_lengths: Any = None
  key_value_seq_lengths: Any = None
  q_segment_ids: Any = None
  kv_segment_ids: Any = None


class PerCall(NamedTuple):
  """What one call of a module adds beyond its arrays and masking: ``deterministic`` (no
  dropout), ``dropout_rng`` (dropout's PRNG key, or None), ``collect`` (None, or it receives a
  thunk computing the call's softmax statistics: `jattn.diagnostics`) and ``sow`` (None, or it
  receives the (B, N, T, S) softmax weights, before dropout: flax's ``sow_weights``) and
  ``sow_max`` (None, or it receives the (B, T, N) max logits of the call's own attention pass:
  ``sow_max_logits``)."""

  deterministic: bool = True
  dropout_rng: Any = None
  collect: Callable | None = None
  sow: Callable | None = None
  sow_max: Callable | None = None


class Cache(NamedTuple):
  """A decoding module's KV cache as one call reads it. ``arrays``: (cached key, cached value)
  or, quantised, (cached key, cached value, key scale, value scale); contiguous
  (B, S_max, K, H|Hv) (scales (B, S_max, K)) or, with ``page_table`` (B, max_pages) int32, pools
  of pages (P, page_size, K, H|Hv) (scales (P, page_size, K)). ``index`` int32 (B,): how many
  positions of each example's cache are filled."""

  arrays: tuple
  index: Any
  page_table: Any = None


def rope(x, positions, base: float):
  """Rotary position embedding, rotate-half convention (GPT-NeoX, Llama).

  x (B, L, heads, H) with H even; positions int (B, L). Feature i < H/2 pairs with i + H/2 and
  rotates by the angle ``position * base ** (-2 i / H)``. Computed in float32, returned in
  x's dtype.
  """
  H = x.shape[-1]
  half = H // 2
  inv_freq = jnp.asarray(base, jnp.float32) ** (
    -jnp.arange(half, dtype=jnp.float32) * jnp.asarray(2.0 / H, jnp.float32)
  )
  angle = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # (B, L, H/2)
  cos = jnp.cos(angle)[:, :, None, :]  # (B, L, 1, H/2)
  sin = jnp.sin(angle)[:, :, None, :]
  x1 = x[..., :half].astype(jnp.float32)
  x2 = x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _positions(name, positions, B, L, offset=None):
  """Explicit (L,) or (B, L) int positions, or offset[b] + arange(L) (offset None: 0)."""
  if positions is None:
    p = jnp.arange(L, dtype=jnp.int32)[None, :]
    if offset is not None:
      p = offset.astype(jnp.int32)[:, None] + p
    return jnp.broadcast_to(p, (B, L))
  positions = _validation.int_array(name, positions)
  if positions.shape not in ((L,), (B, L)):
    raise ValueError(
      f"{name} must have shape (L,)=({L},) or (B, L)=({B}, {L}), got {positions.shape}"
    )
  return jnp.broadcast_to(positions.astype(jnp.int32), (B, L))


def _lengths(name, x, B):
  x = _validation.int_array(name, x)
  if x.shape != (B,):
    raise ValueError(f"{name} must be an int array of shape (B,)=({B},), got shape {x.shape}")
  return x.astype(jnp.int32)


def _dropout(opts: Options, deterministic: bool, dropout_rng):
  """(rate, rng) for jattn: (0, None) unless dropout is on for this call."""
  if opts.dropout_rate == 0.0 or deterministic:
    return 0.0, None
  if dropout_rng is None:
    raise ValueError(
      f"dropout_rate={opts.dropout_rate} with deterministic=False needs a dropout "
      f"PRNG key (linen: a 'dropout' rng or dropout_rng=; nnx: rngs=)"
    )
  return opts.dropout_rate, dropout_rng


def _common(opts: Options, rate, rng):
  return dict(
    scale=opts.scale,
    logits_soft_cap=opts.logits_soft_cap,
    dropout_rate=rate,
    dropout_rng=rng,
    dropout_broadcast=opts.broadcast_dropout,
    implementation=opts.implementation,
    block_q=opts.block_q,
    block_kv=opts.block_kv,
  )


def _attention(opts: Options, q, k, v, per_call: PerCall, **masking):
  """The attention call both paths end in, with dropout as ``per_call`` asks; its ``collect``
  (or None) receives a thunk computing the softmax statistics of exactly this call
  (`jattn.diagnostics`), evaluated only if it stores. Its ``sow`` (or None) receives the
  (B, N, T, S) softmax weights of this call, before dropout (flax's ``sow_weights``); its
  ``sow_max`` (or None) the (B, T, N) max logits, returned by the call itself."""
  rate, rng = _dropout(opts, per_call.deterministic, per_call.dropout_rng)
  if per_call.sow is not None:
    per_call.sow(
      attention_weights(
        q, k, v, scale=opts.scale, logits_soft_cap=opts.logits_soft_cap, **masking
      ).astype(q.dtype)
    )
  if per_call.collect is not None:
    from jattn import diagnostics  # only modules that collect statistics need it

    per_call.collect(
      lambda: diagnostics.attention_stats(
        q,
        k,
        scale=opts.scale,
        logits_soft_cap=opts.logits_soft_cap,
        implementation=opts.implementation,
        block_q=opts.block_q,
        block_kv=opts.block_kv,
        **masking,
      )
    )
  if per_call.sow_max is None:
    return dot_product_attention(q, k, v, **masking, **_common(opts, rate, rng))
  out, max_logits = dot_product_attention(
    q, k, v, **masking, **_common(opts, rate, rng), return_max_logits=True
  )
  per_call.sow_max(max_logits)
  return out


def _boolean_mask(mask):
  """A mask as flax's modules take it -- boolean, or 0/1 numbers from `make_attention_mask` /
  `make_causal_mask` (flax reads it as ``jnp.where(mask, ...)``: nonzero attends) -- or a
  jattn.masks object, as jattn takes it."""
  dtype = getattr(mask, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.number):
    # Booleans, mask objects and anything else go to dot_product_attention as given (its
    # checks name the argument).
    return mask
  return jnp.asarray(mask) != 0


def attend(
  opts: Options,
  q,
  k,
  v,
  *,
  self_attention: bool,
  masking: Masking,
  per_call: PerCall,
):
  """Attention without a cache. q (B, T, N, H), k (B, S, K, H), v (B, S, K, Hv) -> (B, T, N, Hv).

  RoPE positions: ``masking.positions`` for the queries (default arange(T));
  ``masking.kv_positions`` for the keys (default: the query positions in self-attention,
  arange(S) otherwise). ``per_call``: see `_attention`.
  """
  B, T = q.shape[:2]
  S = k.shape[1]
  if opts.rope:
    qp = _positions("positions", masking.positions, B, T)
    if masking.kv_positions is None and self_attention:
      kp = qp
    else:
      kp = _positions("kv_positions", masking.kv_positions, B, S)
    q, k = rope(q, qp, opts.rope_base), rope(k, kp, opts.rope_base)
  return _attention(
    opts,
    q,
    k,
    v,
    per_call,
    mask=_boolean_mask(masking.mask),
    is_causal=opts.is_causal or False,
    local_window_size=opts.window,
    query_seq_lengths=masking.query_seq_lengths,
    key_value_seq_lengths=masking.key_value_seq_lengths,
    q_segment_ids=masking.q_segment_ids,
    kv_segment_ids=masking.kv_segment_ids,
  )


def kv_inputs(inputs_q, inputs_k, inputs_v) -> tuple[Any, Any, bool]:
  """A layer's (inputs_k, inputs_v, self_attention): keys default to the queries' inputs and
  values to the keys'."""
  self_attention = inputs_k is None and inputs_v is None
  if inputs_k is None:
    if inputs_v is not None:
      raise ValueError(
        "inputs_v given without inputs_k; pass inputs_k (and leave inputs_v "
        "None to use it for both)"
      )
    inputs_k = inputs_q
  return inputs_k, inputs_k if inputs_v is None else inputs_v, self_attention


def layer_attention(
  opts: Options,
  q,
  k,
  v,
  cache: Cache | None,
  *,
  self_attention: bool,
  masking: Masking,
  per_call: PerCall,
):
  """The attention of one call of a Flax module (linen or nnx).

  ``cache``: None, or a decoding module's `Cache` (see `decode_step`). Returns (out, new cache
  arrays, new cache_index), the last two None without a cache.
  """
  if cache is None:
    out = attend(opts, q, k, v, self_attention=self_attention, masking=masking, per_call=per_call)
    return out, None, None
  cache_set = ("kv_positions", "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids")
  check_decode_call(self_attention, **{name: getattr(masking, name) for name in cache_set})
  return decode_step(opts, q, k, v, cache, masking, per_call)


def check_decode_call(self_attention: bool, **cache_set):
  """A decoding call takes its keys, their positions and lengths from the cache."""
  if not self_attention:
    raise NotImplementedError(
      "decode=True caches self-attention keys; inputs_k/inputs_v "
      "(cross-attention) while decoding is not supported"
    )
  for name, val in cache_set.items():
    if val is not None:
      raise ValueError(f"{name} is set by the cache while decoding; got a value")


def _at_fill_level(opts: Options, q, k, cache_index, positions, query_seq_lengths):
  """The T new tokens of a decoding step placed at each example's fill level: (q, k with RoPE
  at their positions, index (B,), new tokens per example, rows (B, 1) and slots (B, T): their
  cache positions)."""
  B, T = q.shape[:2]
  index = cache_index.astype(jnp.int32)
  new = T if query_seq_lengths is None else _lengths("query_seq_lengths", query_seq_lengths, B)
  if opts.rope:
    p = _positions("positions", positions, B, T, offset=index)
    q, k = rope(q, p, opts.rope_base), rope(k, p, opts.rope_base)
  slots = index[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  return q, k, index, new, jnp.arange(B, dtype=jnp.int32)[:, None], slots


def attend_cached(opts: Options, q, k, v, cache: Cache, masking: Masking, per_call: PerCall):
  """One decoding step: append T new keys/values to the cache, attend over the cache.

  q (B, T, N, H); k, v (B, T, K, H|Hv); ``cache``: a contiguous float `Cache`, its arrays
  (cached_key, cached_value) (B, S_max, K, H|Hv) and its index cache_index int32 (B,): how many
  positions of each example's cache are filled. Of ``masking`` a step reads the mask, positions
  and query_seq_lengths (the cache sets the rest: see `check_decode_call`). The new tokens take
  cache positions cache_index[b] .. cache_index[b] + T - 1 (also their RoPE positions unless
  ``positions`` is given). Query t sees cache keys k <= cache_index[b] + t (bottom-right aligned
  causality at the fill level: ``masks.causal(offset=cache_index)``), within the valid length
  cache_index[b] + query_seq_lengths[b]. ``query_seq_lengths`` (B,) marks right-padding of a
  batch of prompts of different lengths: only that many new tokens count, padded queries
  return 0, and the next step overwrites the padded cache entries.

  Writes past S_max are dropped (a fixed-size cache under jit cannot raise on values): keep
  cache_index + T <= S_max.

  Returns (out (B, T, N, Hv), new cached_key, new cached_value, new cache_index).
  """
  (cached_key, cached_value), cache_index = cache.arrays, cache.index
  mask, positions, query_seq_lengths = masking.mask, masking.positions, masking.query_seq_lengths
  B, T = q.shape[:2]
  S_max = cached_key.shape[1]
  if T > S_max:
    raise ValueError(f"decode step of T={T} tokens does not fit the cache of S_max={S_max}")
  if k.dtype != cached_key.dtype or v.dtype != cached_value.dtype:
    raise TypeError(
      f"new keys/values ({k.dtype}) must have the cache's dtype "
      f"({cached_key.dtype}); init the cache with the computation dtype"
    )
  for name, new, cached in (("keys", k, cached_key), ("values", v, cached_value)):
    if new.shape[0] != B or cached.shape[0] != B or cached.shape[2:] != new.shape[2:]:
      raise ValueError(
        f"cache of shape {cached.shape} (B, S_max, K, H) does not match new "
        f"{name} of shape {new.shape} (B, T, K, H)"
      )
  q, k, index, new, rows, slots = _at_fill_level(
    opts, q, k, cache_index, positions, query_seq_lengths
  )
  # mode="drop": an out-of-range write is lost rather than clamped onto valid entries.
  cached_key = cached_key.at[rows, slots].set(k, mode="drop")
  cached_value = cached_value.at[rows, slots].set(v, mode="drop")
  valid = index + new  # (B,) filled length after this step

  # The causal diagonal alone already hides every slot past the fill level from the valid
  # queries; the lengths mask adds the same bound for padded queries and zeroes their rows.
  m = _masks.causal(offset=index)
  if opts.window is not None and opts.window[0] is not None:
    # Keys k >= q + index - left: the complement of causal at offset index - left - 1.
    m = m & ~_masks.causal(offset=index - (opts.window[0] + 1))
  m = m & _masks.lengths(None if query_seq_lengths is None else new, valid)
  mask = _boolean_mask(mask)
  if mask is not None:
    m = m & (mask if isinstance(mask, _masks.Mask) else _masks.from_array(mask))
  out = _attention(opts, q, cached_key, cached_value, per_call, mask=m)
  return out, cached_key, cached_value, valid


# --------------------------------------------------------------------------------------------
# Quantised and paged KV caches: int8 / float8 values with a float32 scale per token and head;
# pools of pages with a page table per example.
# --------------------------------------------------------------------------------------------


def _cache_pages(S_max: int) -> int:
  """A page size dividing S_max (the largest power of two up to 256), so the contiguous cache
  is read as pages of a pool without a copy."""
  size = 256
  while S_max % size:
    size //= 2
  return size


def new_cache(opts: Options, batch_size: int, max_length: int, dtype, page_size=None):
  """A module's zero KV cache: (arrays, page_table). Contiguous (page_size None): cached key
  and value (B, S_max, K, H|Hv), table None. Paged: pools (P, page_size, K, H|Hv) and the
  table (B, n = ceil(S_max / page_size)) giving example b pages b * n .. b * n + n - 1 in
  order. A quantised ``dtype`` adds key and value scales, (B, S_max, K) or (P, page_size, K)."""
  if page_size is None:
    lead, table = (batch_size, max_length), None
  else:
    n = -(-max_length // page_size)
    lead = (batch_size * n, page_size)
    table = jnp.arange(batch_size * n, dtype=jnp.int32).reshape(batch_size, n)
  K = opts.num_kv_heads
  arrays: tuple[jax.Array, ...] = (
    jnp.zeros(lead + (K, opts.head_dim), dtype),
    jnp.zeros(lead + (K, opts.value_head_dim), dtype),
  )
  if _paged.is_quantized(dtype):
    arrays += (jnp.ones(lead + (K,), jnp.float32),) * 2
  return arrays, table


def attend_paged(opts: Options, q, k, v, cache: Cache, masking: Masking, per_call: PerCall):
  """A decoding step on a paged cache: ``cache.arrays`` = pools (key pages (P, ps, K, H), value
  pages (P, ps, K, Hv)) in the keys' dtype, or int8 / float8 with (key scales, value scales)
  (P, ps, K) float32; ``cache.page_table`` (B, max_pages): example b's cache positions
  i * ps .. (i + 1) * ps - 1 live in page page_table[b, i]. The T new keys and values
  (quantised per token and head when the pool is) are written at the fill level through the
  table as `jattn.write_pages` writes them, and the step attends through
  `jattn.paged_attention`. Of ``masking`` it reads the positions and query_seq_lengths, and
  refuses a mask; of ``per_call``, it refuses dropout and statistics. Returns (out (B, T, N,
  Hv), new pools, new cache_index)."""
  pools, page_table, cache_index = cache.arrays, cache.page_table, cache.index
  positions, query_seq_lengths = masking.positions, masking.query_seq_lengths
  for what, given in (
    ("a mask", masking.mask is not None),
    ("dropout", not per_call.deterministic and opts.dropout_rate > 0),
    ("collect_stats / sow_weights", per_call.collect is not None or per_call.sow is not None),
    ("sow_max_logits", per_call.sow_max is not None),
  ):
    if given:
      raise NotImplementedError(
        f"decoding with a paged or quantised cache takes causality, windows and soft caps "
        f"(it runs jattn.paged_attention), not {what}; use a contiguous float cache for that"
      )
  T = q.shape[1]
  capacity = page_table.shape[1] * pools[0].shape[1]
  quantized = len(pools) == 4
  q, k, index, new, _, _ = _at_fill_level(opts, q, k, cache_index, positions, query_seq_lengths)
  # The T new tokens, padded or not, at cache positions index .. index + T - 1.
  pool = _paged.Pool(pools[0], pools[1], page_table, index + T, *pools[2:])
  pool = _paged.write_cache(pool, k, v)
  # Query t sits at position index + t: bottom-right against index + T keys (the new ones,
  # padded or not, written), so padded queries see only real keys; their rows are zeroed.
  out = _paged.paged_attention(
    q,
    pool.key_pages,
    pool.value_pages,
    page_table,
    jnp.minimum(index + T, capacity),
    scale=opts.scale,
    is_causal=True,
    local_window_size=opts.window,
    logits_soft_cap=opts.logits_soft_cap,
    k_scale=pool.k_scale,
    v_scale=pool.v_scale,
  )
  if query_seq_lengths is not None:
    live = jnp.arange(T, dtype=jnp.int32)[None, :] < new[:, None]
    out = jnp.where(live[..., None, None], out, jnp.zeros((), out.dtype))
  written = (pool.key_pages, pool.value_pages) + ((pool.k_scale, pool.v_scale) if quantized else ())
  return out, written, index + new


def decode_step(opts: Options, q, k, v, cache: Cache, masking: Masking, per_call: PerCall):
  """A decoding step on a module's `Cache`. Returns (out, new cache arrays of the same form, new
  cache_index)."""
  if opts.is_causal is None:
    raise ValueError(
      "decode=True needs is_causal=True: step-by-step decoding with a KV cache "
      "reproduces causal self-attention only"
    )
  arrays = cache.arrays
  if cache.page_table is None and len(arrays) == 2:
    out, ck, cv, idx = attend_cached(opts, q, k, v, cache, masking, per_call)
    return out, (ck, cv), idx
  shapes = None
  if cache.page_table is None:
    # A contiguous quantised cache is read as pages of a pool: its rows, cut, without a copy.
    B, S_max = arrays[0].shape[:2]
    ps = _cache_pages(S_max)
    shapes = [x.shape for x in arrays]
    arrays = tuple(x.reshape((B * (S_max // ps), ps) + x.shape[2:]) for x in arrays)
    table = jnp.arange(B * (S_max // ps), dtype=jnp.int32).reshape(B, S_max // ps)
    cache = Cache(arrays, cache.index, table)
  out, arrays, idx = attend_paged(opts, q, k, v, cache, masking, per_call)
  if shapes is not None:
    arrays = tuple(x.reshape(shape) for x, shape in zip(arrays, shapes))
  return out, arrays, idx
