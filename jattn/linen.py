"""jattn attention as a ``flax.linen`` module.

Shapes: B batch, T query length, S key length, S_max cache length, N query heads, K key/value
heads, H head dim, D features.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import linen as nn

from jattn import _paged, _validation
from jattn import masks as _masks
from jattn._flax import modules as _mha
from jattn._types import ArrayLike, Implementation, IsCausal, LocalWindowSize

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
  """Multi-head attention (MHA, GQA, MQA) over :func:`jattn.dot_product_attention`.

  Parameters as in ``flax.linen.MultiHeadDotProductAttention`` (``query``, ``key``, ``value``
  DenseGeneral kernels (D, N|K, H), ``out`` kernel (N, H, out_features)), so weights copy
  between the two, and between this module and :class:`jattn.nnx.MultiHeadAttention`.

  Attributes:
    num_heads: N query heads.
    qkv_features: N * H (default: the input features D).
    out_features: output features (default: D).
    num_kv_heads: K key/value heads (default N); K < N is GQA, K = 1 MQA.
    value_head_dim: Hv, the value heads' size (default H = qkv_features // num_heads); the
      ``value`` kernel is then (D, K, Hv) and ``out``'s (N, Hv, out_features) (MLA-style).
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: parameter dtype.
    dropout_rate: attention-weight dropout rate.
    broadcast_dropout: one (T, S) dropout mask for all batch elements and heads (flax's
      default is True; here False: independent masks).
    deterministic: default for the call's ``deterministic`` (no dropout when True).
    use_bias, kernel_init, bias_init: for the four projections, as in flax.
    is_causal, local_window_size, logits_soft_cap, scale, implementation, block_q, block_kv:
      passed to :func:`jattn.dot_product_attention`.
    rope: apply rotary position embeddings (rotate-half convention) to q and k.
    rope_base: RoPE base (theta).
    decode: autoregressive decoding with a KV cache in the ``'cache'`` collection. As in flax,
      ``init`` with decode=True on an input of shape (B, S_max, D) creates a zero cache of
      S_max positions (``cached_key``, ``cached_value`` (B, S_max, K, H) and ``cache_index``
      (B,)); then each ``apply(..., mutable=['cache'])`` on (B, T, D) appends T tokens (a
      prompt prefill, or one or a few generated tokens) and attends causally over the filled
      cache. Needs ``is_causal``.
    cache_dtype: the cache's dtype (default: the keys'). int8, float8_e4m3fn or float8_e5m2
      keep a quantised cache: values in that dtype with a float32 scale per token and head
      (``cached_key_scale``, ``cached_value_scale`` (B, S_max, K)); decoding steps then read it
      through `jattn.paged_attention` (causality, windows, soft caps; no masks, dropout or
      statistics).
    cache_page_size: keep the cache in pages: pools ``cached_key`` (P, page_size, K, H),
      ``cached_value`` (P, page_size, K, Hv) (scales (P, page_size, K)) and ``page_table``
      (B, ceil(S_max / page_size)) int32 in the ``'cache'`` collection, example b's positions
      i * page_size .. in page page_table[b, i] (at first, example b owns pages b * n ..
      b * n + n - 1; replace the table to share one pool). Read through `jattn.paged_attention`
      as a quantised cache is.
    collect_stats: sow the softmax statistics of every call (`jattn.diagnostics.AttentionStats`)
      into ``'intermediates'`` under ``attention_stats`` when that collection is mutable
      (``apply(..., mutable=['intermediates'])``). Off by default, and then nothing is computed.
  """

  num_heads: int
  qkv_features: int | None = None
  out_features: int | None = None
  num_kv_heads: int | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  dropout_rate: float = 0.0
  broadcast_dropout: bool = False
  deterministic: bool | None = None
  use_bias: bool = True
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros_init()
  is_causal: IsCausal = False
  local_window_size: LocalWindowSize | None = None
  logits_soft_cap: float | None = None
  scale: float | None = None
  implementation: Implementation | None = None
  block_q: int | None = None
  block_kv: int | None = None
  rope: bool = False
  rope_base: float = 10000.0
  decode: bool = False
  collect_stats: bool = False
  cache_dtype: Any = None
  cache_page_size: int | None = None
  value_head_dim: int | None = None

  def _cache(self, opts, k):
    """The 'cache' variables: ([key, value(, key scale, value scale)], page table or None,
    cache index). As in flax, the first (init) call sizes the cache from its input, (B, S_max,
    ...)."""
    dtype = k.dtype if self.cache_dtype is None else self.cache_dtype
    page_size = _validation.positive_int("cache_page_size", self.cache_page_size, optional=True)
    # Made once, when init creates the first variable, whichever variables it then creates.
    B, S_max = k.shape[:2]
    new = functools.cache(lambda: _mha.new_cache(opts, B, S_max, dtype, page_size))
    names = ("cached_key", "cached_value", "cached_key_scale", "cached_value_scale")
    variables = [
      self.variable("cache", name, lambda i=i: new()[0][i])
      for i, name in enumerate(names[: 4 if _paged.is_quantized(dtype) else 2])
    ]
    page_table = (
      None if page_size is None else self.variable("cache", "page_table", lambda: new()[1])
    )
    index = self.variable("cache", "cache_index", jnp.zeros, k.shape[:1], jnp.int32)
    return variables, page_table, index

  def _checked_options(self, D):
    """(_mha.Options, out_features, decode, collect_stats, use_bias), every attribute checked
    (errors name it); D: the queries' input features."""
    opts = _mha.options(
      _mha.Arguments(
        num_heads=self.num_heads,
        num_kv_heads=self.num_kv_heads,
        qkv_features=D if self.qkv_features is None else self.qkv_features,
        is_causal=self.is_causal,
        local_window_size=self.local_window_size,
        logits_soft_cap=self.logits_soft_cap,
        scale=self.scale,
        implementation=self.implementation,
        block_q=self.block_q,
        block_kv=self.block_kv,
        rope=self.rope,
        rope_base=self.rope_base,
        dropout_rate=self.dropout_rate,
        broadcast_dropout=self.broadcast_dropout,
        value_head_dim=self.value_head_dim,
      )
    )
    out_features = _validation.positive_int("out_features", self.out_features, optional=True)
    decode = _validation.flag("decode", self.decode)
    collect_stats = _validation.flag("collect_stats", self.collect_stats)
    use_bias = _validation.flag("use_bias", self.use_bias)
    _validation.flag("deterministic", self.deterministic, optional=True)
    _validation.function("kernel_init", self.kernel_init)
    _validation.function("bias_init", self.bias_init)
    return opts, out_features, decode, collect_stats, use_bias

  @nn.compact
  def __call__(
    self,
    inputs_q: ArrayLike,
    inputs_k: ArrayLike | None = None,
    inputs_v: ArrayLike | None = None,
    *,
    mask: _masks.Mask | ArrayLike | None = None,
    positions: ArrayLike | None = None,
    kv_positions: ArrayLike | None = None,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    q_segment_ids: ArrayLike | None = None,
    kv_segment_ids: ArrayLike | None = None,
    deterministic: bool | None = None,
    dropout_rng: ArrayLike | None = None,
    sow_weights: bool = False,
    sow_max_logits: bool = False,
  ):
    """inputs_q (B, T, D); inputs_k, inputs_v (B, S, D_kv) (default: self-attention).

    Args:
      mask: a :mod:`jattn.masks` object, or an array broadcastable to (B, N, T, S): boolean, or
        0/1 numbers as flax's `make_attention_mask` / `make_causal_mask` build them (nonzero
        attends, as in flax).
      positions: int (T,) or (B, T) RoPE positions of the queries (default arange(T), or the
        cache positions when decoding); kv_positions: the same for keys (cross-attention).
      query_seq_lengths, key_value_seq_lengths: int (B,) valid lengths (padding). When
        decoding, ``query_seq_lengths`` is the number of real tokens among the T new ones.
      q_segment_ids, kv_segment_ids: int (B, T), (B, S) packed-document ids.
      deterministic: no dropout (overrides the attribute).
      dropout_rng: PRNG key for dropout (default: ``self.make_rng('dropout')``).
      sow_weights: as flax's: sow the (B, N, T, S) softmax weights (before dropout; 0 on rows
        with nothing to attend to) into ``'intermediates'`` under ``attention_weights``. They
        cost O(T x S) memory by nature.
      sow_max_logits: sow each row's max logit over the keys it sees, (B, T, N) float32 (see
        ``return_max_logits`` of :func:`jattn.dot_product_attention`: -inf for a row that sees
        nothing, no gradient), into ``'intermediates'`` under ``max_logits``, from the attention
        pass itself (QK-Clip / MuonClip: ``max_logits.max(axis=(0, 1))`` per head). Dense and
        chunked only (not a fused kernel named alone, nor a paged or quantised cache).

    Returns:
      (B, T, out_features).
    """
    inputs_q = jnp.asarray(inputs_q)
    D = inputs_q.shape[-1]
    opts, out_features, decode, collect_stats, use_bias = self._checked_options(D)
    deterministic = _validation.flag("deterministic", deterministic, optional=True)
    sow_weights = _validation.flag("sow_weights", sow_weights)
    sow_max_logits = _validation.flag("sow_max_logits", sow_max_logits)
    inputs_k, inputs_v, self_attention = _mha.kv_inputs(inputs_q, inputs_k, inputs_v)

    dense = lambda heads, size, name: nn.DenseGeneral(
      features=(heads, size),
      axis=-1,
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=self.kernel_init,
      bias_init=self.bias_init,
      use_bias=use_bias,
      name=name,
    )
    q = dense(opts.num_heads, opts.head_dim, "query")(inputs_q)  # (B, T, N, H)
    k = dense(opts.num_kv_heads, opts.head_dim, "key")(inputs_k)  # (B, S, K, H)
    v = dense(opts.num_kv_heads, opts.value_head_dim, "value")(inputs_v)  # (B, S, K, Hv)

    m_deterministic = (
      nn.merge_param("deterministic", self.deterministic, deterministic)
      if (opts.dropout_rate > 0)
      else True
    )
    if not m_deterministic and dropout_rng is None:
      dropout_rng = self.make_rng("dropout")

    # Softmax statistics into 'intermediates' (jattn.diagnostics); nothing is traced when off.
    collect = None
    if collect_stats:
      from jattn import diagnostics

      collect = lambda stats: diagnostics.sow_linen(self, stats)
    sow = (lambda w: self.sow("intermediates", "attention_weights", w)) if sow_weights else None
    sow_max = (lambda x: self.sow("intermediates", "max_logits", x)) if sow_max_logits else None

    decoding = decode and self.has_variable("cache", "cached_key")
    cache = None
    if decode:
      variables, page_table, cache_index = self._cache(opts, k)
    if decoding:
      page_table = None if page_table is None else page_table.value
      cache = _mha.Cache(tuple(var.value for var in variables), cache_index.value, page_table)
    x, arrays, index = _mha.layer_attention(
      opts,
      q,
      k,
      v,
      cache,
      self_attention=self_attention,
      masking=_mha.Masking(
        mask=mask,
        positions=positions,
        kv_positions=kv_positions,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
      ),
      per_call=_mha.PerCall(m_deterministic, dropout_rng, collect, sow, sow_max),
    )
    if decoding:
      cache_index.value = index
      for var, value in zip(variables, arrays):
        var.value = value

    return nn.DenseGeneral(
      features=D if out_features is None else out_features,
      axis=(-2, -1),
      dtype=self.dtype,
      param_dtype=self.param_dtype,
      kernel_init=self.kernel_init,
      bias_init=self.bias_init,
      use_bias=use_bias,
      name="out",
    )(x)
