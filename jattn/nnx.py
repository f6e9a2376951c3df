"""jattn attention as a ``flax.nnx`` module.

Shapes: B batch, T query length, S key length, S_max cache length, N query heads, K key/value
heads, H head dim, D features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jattn import _validation
from jattn import masks as _masks
from jattn._flax import modules as _mha
from jattn._types import ArrayLike, Implementation, IsCausal, LocalWindowSize

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nnx.Module):
  """Multi-head attention (MHA, GQA, MQA) over :func:`jattn.dot_product_attention`.

  Parameters as in ``flax.nnx.MultiHeadAttention``: ``query``, ``key``, ``value``
  (LinearGeneral kernels (D, N|K, H)) and ``out`` (kernel (N, H, out_features)); they copy
  one to one to and from :class:`jattn.linen.MultiHeadAttention`.

  Args:
    num_heads: N query heads.
    in_features: D, features of the query input.
    qkv_features: N * H (default D).
    out_features: output features (default D).
    num_kv_heads: K key/value heads (default N); K < N is GQA, K = 1 MQA.
    in_kv_features: features of the key/value inputs (default D).
    value_head_dim: Hv, the value heads' size (default H = qkv_features // num_heads); the
      ``value`` kernel is then (D, K, Hv) and ``out``'s (N, Hv, out_features) (MLA-style).
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: parameter dtype.
    dropout_rate: attention-weight dropout rate.
    broadcast_dropout: one (T, S) dropout mask for all batch elements and heads (flax's
      default is True; here False: independent masks).
    deterministic: default for the call's ``deterministic`` (``model.eval()`` / ``.train()``
      set it).
    use_bias, kernel_init, bias_init: for the four projections, as in flax.
    is_causal, local_window_size, logits_soft_cap, scale, implementation, block_q, block_kv:
      passed to :func:`jattn.dot_product_attention`.
    rope: apply rotary position embeddings (rotate-half convention) to q and k.
    rope_base: RoPE base (theta).
    decode: default for the call's ``decode``: append to the KV cache made by
      :meth:`init_cache` and attend over it.
    collect_stats: store the softmax statistics of every call (`jattn.diagnostics.AttentionStats`)
      as an ``nnx.Intermediate`` named ``attention_stats``; read them with
      ``nnx.capture(nnx.Intermediate)``. Off by default, and then nothing is computed.
    rngs: parameter initialisation, and the dropout stream (kept when dropout_rate > 0).
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    in_kv_features: int | None = None,
    *,
    value_head_dim: int | None = None,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    dropout_rate: float = 0.0,
    broadcast_dropout: bool = False,
    deterministic: bool | None = None,
    use_bias: bool = True,
    kernel_init: Callable = nnx.initializers.lecun_normal(),  # noqa: B008 -- flax's own default
    bias_init: Callable = nnx.initializers.zeros_init(),  # noqa: B008
    is_causal: IsCausal = False,
    local_window_size: LocalWindowSize | None = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    implementation: Implementation | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    rope: bool = False,
    rope_base: float = 10000.0,
    decode: bool = False,
    collect_stats: bool = False,
    rngs: nnx.Rngs,
  ):
    in_features = _validation.positive_int("in_features", in_features)
    out_features = _validation.positive_int("out_features", out_features, optional=True)
    in_kv_features = _validation.positive_int("in_kv_features", in_kv_features, optional=True)
    self.opts = _mha.options(
      _mha.Arguments(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        qkv_features=in_features if qkv_features is None else qkv_features,
        is_causal=is_causal,
        local_window_size=local_window_size,
        logits_soft_cap=logits_soft_cap,
        scale=scale,
        implementation=implementation,
        block_q=block_q,
        block_kv=block_kv,
        rope=rope,
        rope_base=rope_base,
        dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout,
        value_head_dim=value_head_dim,
      )
    )
    o = self.opts
    self.in_features = in_features
    self.out_features = in_features if out_features is None else out_features
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.deterministic = _validation.flag("deterministic", deterministic, optional=True)
    self.decode = _validation.flag("decode", decode)
    self.collect_stats = _validation.flag("collect_stats", collect_stats)
    use_bias = _validation.flag("use_bias", use_bias)
    _validation.function("kernel_init", kernel_init)
    _validation.function("bias_init", bias_init)
    _validation.instance("rngs", rngs, nnx.Rngs, "an nnx.Rngs")
    in_kv = in_features if in_kv_features is None else in_kv_features
    linear = lambda fin, heads, size: nnx.LinearGeneral(
      fin,
      (heads, size),
      dtype=dtype,
      param_dtype=param_dtype,
      use_bias=use_bias,
      kernel_init=kernel_init,
      bias_init=bias_init,
      rngs=rngs,
    )
    self.query = linear(in_features, o.num_heads, o.head_dim)
    self.key = linear(in_kv, o.num_kv_heads, o.head_dim)
    self.value = linear(in_kv, o.num_kv_heads, o.value_head_dim)
    self.out = nnx.LinearGeneral(
      (o.num_heads, o.value_head_dim),
      self.out_features,
      axis=(-2, -1),
      dtype=dtype,
      param_dtype=param_dtype,
      use_bias=use_bias,
      kernel_init=kernel_init,
      bias_init=bias_init,
      rngs=rngs,
    )
    self.rngs = rngs.dropout.fork() if o.dropout_rate > 0 else nnx.data(None)
    # The cache, once `init_cache` makes it.
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.cache_index: nnx.Cache | None = nnx.data(None)
    self.cached_key_scale: nnx.Cache | None = nnx.data(None)
    self.cached_value_scale: nnx.Cache | None = nnx.data(None)
    self.page_table: nnx.Cache | None = nnx.data(None)

  def init_cache(
    self, batch_size: int, max_length: int, dtype: Any = None, *, page_size: int | None = None
  ):
    """Create a zero KV cache: ``cached_key``, ``cached_value`` (B, S_max, K, H|Hv) and
    ``cache_index`` int32 (B,), as ``nnx.Cache`` variables. ``dtype`` defaults to the
    computation dtype (``dtype``, else ``param_dtype``); it must be the dtype keys come in, or
    int8 / float8_e4m3fn / float8_e5m2 for a quantised cache: keys and values are then stored
    in that dtype with a float32 scale per token and head (``cached_key_scale``,
    ``cached_value_scale`` (B, S_max, K)).

    ``page_size``: keep the cache in pages instead -- pools ``cached_key`` (P, page_size, K, H),
    ``cached_value`` (P, page_size, K, Hv) (scales (P, page_size, K)) and ``page_table``
    (B, ceil(S_max / page_size)) int32, example b's positions i * page_size .. in page
    page_table[b, i]. It starts as example b owning pages b * n .. b * n + n - 1; set
    ``page_table[...]`` (and size the pool) to share one pool as a serving loop does.

    Quantised and paged caches are read through `jattn.paged_attention` (causality, windows,
    soft caps; no masks, dropout or statistics)."""
    batch_size = _validation.positive_int("batch_size", batch_size)
    max_length = _validation.positive_int("max_length", max_length)
    page_size = _validation.positive_int("page_size", page_size, optional=True)
    if dtype is None:
      dtype = self.dtype if self.dtype is not None else self.param_dtype
    pools, table = _mha.new_cache(self.opts, batch_size, max_length, dtype, page_size)
    self.cache_index = nnx.Cache(jnp.zeros((batch_size,), jnp.int32))
    self.page_table = nnx.data(None) if table is None else nnx.Cache(table)
    self.cached_key, self.cached_value = nnx.Cache(pools[0]), nnx.Cache(pools[1])
    if len(pools) == 4:
      self.cached_key_scale, self.cached_value_scale = nnx.Cache(pools[2]), nnx.Cache(pools[3])
    else:
      self.cached_key_scale = nnx.data(None)
      self.cached_value_scale = nnx.data(None)

  def _decode_cache(self):
    """(the cache's variables, the cache as `_mha.layer_attention` takes it)."""
    if self.cached_key is None:
      raise ValueError(
        "decode=True but the KV cache is not initialized: call "
        "init_cache(batch_size, max_length) first"
      )
    # Key and value, and their scales where the cache is quantised.
    variables = [
      var
      for var in (
        self.cached_key,
        self.cached_value,
        self.cached_key_scale,
        self.cached_value_scale,
      )
      if var is not None
    ]
    page_table = None if self.page_table is None else self.page_table[...]
    assert self.cache_index is not None  # made with the cached keys
    return variables, _mha.Cache(
      tuple(var[...] for var in variables), self.cache_index[...], page_table
    )

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
    decode: bool | None = None,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
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
      decode: append to the cache and attend over it (overrides the attribute).
      rngs: dropout randomness (overrides the stream kept at construction).
      sow_weights: as flax's: store the (B, N, T, S) softmax weights (before dropout; 0 on rows
        with nothing to attend to) as an ``nnx.Intermediate`` named ``attention_weights``. They
        cost O(T x S) memory by nature.
      sow_max_logits: sow each row's max logit over the keys it sees, (B, T, N) float32 (see
        ``return_max_logits`` of :func:`jattn.dot_product_attention`: -inf for a row that sees
        nothing, no gradient), as an ``nnx.Intermediate``
        named ``max_logits``, from the attention
        pass itself (QK-Clip / MuonClip: ``max_logits.max(axis=(0, 1))`` per head). Dense and
        chunked only (not a fused kernel named alone, nor a paged or quantised cache).

    Returns:
      (B, T, out_features).
    """
    o = self.opts
    deterministic = _validation.flag("deterministic", deterministic, optional=True)
    decode = _validation.flag("decode", decode, optional=True)
    sow_weights = _validation.flag("sow_weights", sow_weights)
    sow_max_logits = _validation.flag("sow_max_logits", sow_max_logits)
    if rngs is not None:
      _validation.instance(
        "rngs", rngs, (nnx.Rngs, nnx.RngStream), "an nnx.Rngs or nnx.RngStream (or None)"
      )
    inputs_q = jnp.asarray(inputs_q)
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(
        f"inputs_q has {inputs_q.shape[-1]} features, the module expects "
        f"in_features={self.in_features}"
      )
    keys_in, values_in, self_attention = _mha.kv_inputs(inputs_q, inputs_k, inputs_v)
    q = self.query(inputs_q)  # (B, T, N, H)
    k = self.key(keys_in)  # (B, S, K, H)
    v = self.value(values_in)

    det = True
    if o.dropout_rate > 0:
      det = deterministic if deterministic is not None else self.deterministic
      if det is None:
        raise ValueError(
          "dropout_rate > 0 needs deterministic=True/False, at the call or in the "
          "constructor (or model.train() / model.eval())"
        )
    dropout_rng = None
    if not det:
      stream = rngs if rngs is not None else self.rngs
      if isinstance(stream, nnx.Rngs):
        stream = stream.dropout
      if stream is None:
        raise ValueError("dropout needs rngs: pass rngs= at the call")
      dropout_rng = stream()

    # Softmax statistics as an nnx.Intermediate (jattn.diagnostics); nothing traced when off.
    collect = None
    if self.collect_stats:
      from jattn import diagnostics

      collect = lambda stats: diagnostics.sow_nnx(self, stats)
    sow = (lambda w: self.sow(nnx.Intermediate, "attention_weights", w)) if sow_weights else None
    sow_max = (lambda x: self.sow(nnx.Intermediate, "max_logits", x)) if sow_max_logits else None

    decode = self.decode if decode is None else decode
    variables, cache = self._decode_cache() if decode else (None, None)
    x, arrays, index = _mha.layer_attention(
      o,
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
      per_call=_mha.PerCall(det, dropout_rng, collect, sow, sow_max),
    )
    if variables is not None:
      assert self.cache_index is not None
      self.cache_index[...] = index
      for var, value in zip(variables, arrays):
        var[...] = value
    return self.out(x)
