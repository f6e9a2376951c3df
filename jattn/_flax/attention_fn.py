"""A drop-in ``attention_fn`` for flax's attention layers, computed by jattn.

``flax.linen.MultiHeadDotProductAttention`` and ``flax.nnx.MultiHeadAttention`` take an
``attention_fn`` with the signature of ``flax.{linen,nnx}.dot_product_attention``. The function
made here accepts every keyword either layer passes (linen filters them by the function's
signature, so the names must be spelled out) and forwards them to
:func:`jattn.dot_product_attention`.

Shapes: query [batch..., T, N, H], key and value [batch..., S, K, H] (K divides N: GQA),
mask and bias broadcastable to [batch..., N, T, S], as flax documents them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jattn import _validation
from jattn import masks as _masks
from jattn._attention import attention_weights, dot_product_attention
from jattn._types import ArrayLike, Implementation, IsCausal, LocalWindowSize

_PRECISION_NAMES = {
  jax.lax.Precision.DEFAULT: "default",
  jax.lax.Precision.HIGH: "high",
  jax.lax.Precision.HIGHEST: "highest",
}


def _refuse_custom_einsums(**einsums):
  for name, v in einsums.items():
    if v is not None:
      raise NotImplementedError(
        f"jattn.make_attention_fn: {name} (a custom einsum, e.g. quantized) is not "
        f"supported; jattn computes q.k and p.v with its own float32-accumulating einsums"
      )


def make_attention_fn(
  *,
  implementation: Implementation | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
  is_causal: IsCausal = False,
  local_window_size: LocalWindowSize | None = None,
  logits_soft_cap: float | None = None,
  scale: float | None = None,
  score_mod: Callable | None = None,
) -> Callable:
  """An ``attention_fn`` for flax's attention layers, computed by
  :func:`jattn.dot_product_attention`.

  Usage::

    layer = flax.linen.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=jattn.make_attention_fn(implementation="chunked"))
    layer = flax.nnx.MultiHeadAttention(
        num_heads=8, in_features=64, rngs=rngs,
        attention_fn=jattn.make_attention_fn(block_q=256, block_kv=256))

  The options are fixed for every call of the returned function and mean what they mean in
  :func:`jattn.dot_product_attention`. ``is_causal`` here adds a causal mask on top of the mask
  flax passes (flax's own call-time ``is_causal`` is honoured too, top-left aligned as in flax).
  For a layer that also decodes (flax's ``decode=True`` calls it with one query against the
  cache's S slots) pass ``is_causal="bottom_right"``: it equals top-left when T == S and is the
  right mask when T < S. ``is_causal=True`` (top-left) with T < S raises a ValueError saying so.

  What the returned function does with flax's arguments:
    * ``mask``: flax's boolean or 0/1 float mask, broadcastable to [batch..., N, T, S]
      (``make_causal_mask``, ``make_attention_mask``, ``combine_masks``, the decode cache mask);
      nonzero = attend, as ``jnp.where(mask, ...)`` reads it in flax. A :mod:`jattn.masks`
      object is passed through as is (when calling the function directly).
    * ``bias``: added to the scaled logits, as in flax.
    * ``dropout_rate``, ``dropout_rng``, ``deterministic``: dropout only when
      ``not deterministic and dropout_rate > 0``; the kept weights are scaled by 1 / (1 - rate),
      as in flax. Which weights drop is jattn's pure function of (rng, b, n, t, s), not flax's
      ``jax.random.bernoulli`` draw: same distribution, different samples.
    * ``broadcast_dropout=True`` (flax's default): one (T, S) dropout mask for every batch
      element and head, as flax; ``False``: independent masks.
    * ``dtype``: the computation dtype; q, k and v are cast to it (``promote_dtype``, default
      flax's), the output has it. jattn's softmax statistics are float32 regardless, so
      ``force_fp32_for_softmax`` is always satisfied.
    * ``precision``: applied as ``jax.default_matmul_precision`` around the call.
    * ``module`` (``sow_weights=True``): the (batch..., N, T, S) softmax weights, before
      dropout, are formed (O(T x S) memory, by nature) and sown where flax sows them
      (linen: ``'intermediates'``, nnx: ``nnx.Intermediate``, name ``'attention_weights'``),
      in the computation dtype; rows with nothing to attend to are 0. The output is still
      jattn's own computation.
    * The einsum overrides raise NotImplementedError.

  Differences from flax: a query row with nothing to attend to (fully masked) gives 0, where
  flax's softmax over all-equal masked logits gives the mean of V.
  """
  opts = dict(
    implementation=_validation.implementation(implementation),
    block_q=_validation.block("block_q", block_q),
    block_kv=_validation.block("block_kv", block_kv),
    local_window_size=_validation.window(local_window_size),
    logits_soft_cap=_validation.soft_cap(logits_soft_cap),
    scale=_validation.scale(scale),
    score_mod=_validation.score_function("score_mod", score_mod),
  )
  causal_option = _validation.causal(is_causal)

  def attention_fn(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: _masks.Mask | ArrayLike | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: ArrayLike | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=None,
    is_causal: bool = False,
    *,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general=None,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
  ):
    """flax's ``dot_product_attention`` signature (linen's and nnx's keywords), run by jattn.

    Returns [batch..., T, N, H] in the computation dtype.
    """
    _refuse_custom_einsums(
      einsum_dot_general=einsum_dot_general,
      qk_attn_weights_einsum=qk_attn_weights_einsum,
      attn_weights_value_einsum=attn_weights_value_einsum,
    )
    dropout_rate = _validation.real("dropout_rate", dropout_rate, at_least=0, below=1)
    is_causal = _validation.flag("is_causal", is_causal)
    # jattn's softmax statistics are always float32 or wider; the flag only decides, as in
    # flax, that sown weights stay float32 for a 16-bit computation dtype.
    force_fp32_for_softmax = _validation.flag("force_fp32_for_softmax", force_fp32_for_softmax)
    query, key, value = _promoted(promote_dtype, (query, key, value), dtype)
    batch = query.shape[:-3]
    nb = math.prod(batch)
    q4, k4, v4 = (x.reshape((nb,) + x.shape[-3:]) for x in (query, key, value))
    mask, bias = _flat_mask_and_bias(mask, bias, batch)
    _refuse_top_left_decoding(causal_option, query.shape[-3], key.shape[-3])
    causal = _call_causal(causal_option, is_causal)

    drop = (not deterministic) and dropout_rate > 0.0
    with _precision_context(precision):
      if module is not None:
        # The layer asked for its weights (sow_weights=True): form them (O(T x S), by nature),
        # and sow them where flax's own dot_product_attention does, under its name.
        w = attention_weights(q4, k4, v4, bias, mask, is_causal=causal or False, **opts)
        w_dtype = jnp.float32 if force_fp32_for_softmax else query.dtype
        _sow_weights(module, w.astype(w_dtype).reshape(batch + w.shape[1:]))
      out = dot_product_attention(
        q4,
        k4,
        v4,
        bias,
        mask,
        is_causal=causal or False,
        dropout_rate=dropout_rate if drop else 0.0,
        dropout_rng=dropout_rng if drop else None,
        dropout_broadcast=bool(broadcast_dropout) if drop else False,
        **opts,
      )
    return out.reshape(query.shape[:-1] + (value.shape[-1],))

  return attention_fn


def _promoted(promote_dtype, qkv, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
  """flax's ``promote_dtype`` (its own by default) applied to q, k, v, which must then be
  [batch..., length, heads, head_dim] of equal rank and equal batch dims."""
  if promote_dtype is None:
    from flax.nnx.nn import dtypes as _flax_dtypes  # flax's own callers have it imported

    promote_dtype = _flax_dtypes.promote_dtype
  promote = _validation.function("promote_dtype", promote_dtype)
  query, key, value = promote(qkv, dtype=dtype)
  shapes = f"query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}"
  if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
    raise ValueError(
      "query, key and value must be [batch..., length, heads, head_dim] of equal rank, got "
      + shapes
    )
  batch = query.shape[:-3]
  if key.shape[:-3] != batch or value.shape[:-3] != batch:
    raise ValueError(f"query, key and value batch dims must match, got {shapes}")
  return query, key, value


def _flat_mask_and_bias(mask, bias, batch):
  """flax's mask and bias with the batch dims flattened into one (a jattn.masks object
  passes through)."""
  if mask is not None and not isinstance(mask, _masks.Mask):
    mask = jnp.asarray(mask)
    # flax reads its masks as jnp.where(mask, ...): any nonzero entry attends.
    mask = _flatten_batch("mask", mask if mask.dtype == jnp.bool_ else mask != 0, batch)
  if bias is not None:
    bias = _flatten_batch("bias", jnp.asarray(bias), batch)
  return mask, bias


def _refuse_top_left_decoding(causal_option, T: int, S: int) -> None:
  """make_attention_fn(is_causal=True) with fewer queries than keys: refused.

  flax's layers call the function with T < S in one case, decoding (``decode=True``: one query
  against the S slots of the cache, the cache index in flax's mask). Top-left causality there lets
  query 0 see key 0 only, whatever the step: a silently wrong layer. Bottom-right causality is
  the same mask when T == S (training) and the right one when T < S, so it is what to ask for."""
  if causal_option == "top_left" and T < S:
    raise ValueError(
      f"make_attention_fn(is_causal=True) is top-left causal: query t sees keys 0..t. Called "
      f"with T={T} queries against S={S} keys (as flax's decode cache does, one query against "
      f"its S slots), every query would see the first keys only. Pass "
      f'make_attention_fn(is_causal="bottom_right") (the same mask when T == S, and the right '
      f"one against a cache), or leave causality to flax's own mask (nn.make_causal_mask)"
    )


def _call_causal(causal_option, is_causal):
  """make_attention_fn's causal option with flax's call-time (top-left) ``is_causal``."""
  if not is_causal:
    return causal_option
  if causal_option not in (None, "top_left"):
    raise ValueError(
      f"is_causal=True at call time (flax's top-left causal mask) conflicts with "
      f"make_attention_fn(is_causal={causal_option!r})"
    )
  return "top_left"


def _sow_weights(module, weights):
  """Sow as flax's linen and nnx ``dot_product_attention`` do for their ``module`` argument."""
  from flax import (
    linen,
    nnx,  # flax is imported by this module already; nnx only when sowing
  )

  if isinstance(module, nnx.Module):
    module.sow(nnx.Intermediate, "attention_weights", weights)
  elif isinstance(module, linen.Module):
    module.sow("intermediates", "attention_weights", weights)
  else:
    raise TypeError(
      f"module (flax's sow_weights=True) must be the flax linen or nnx Module that "
      f"sows the attention weights, got {type(module).__name__}"
    )


def _flatten_batch(name, x, batch):
  """[batch..., N|1, T|1, S|1] (or fewer leading dims) -> (prod(batch) | 1, N|1, T|1, S|1)."""
  nb = len(batch)
  if x.ndim > nb + 3:
    raise ValueError(
      f"{name} of shape {x.shape} has rank {x.ndim}, more than the "
      f"[batch..., heads, q_length, kv_length] rank {nb + 3} of this call"
    )
  x = x.reshape((1,) * (nb + 3 - x.ndim) + tuple(x.shape))
  lead = x.shape[:nb]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + x.shape[nb:])
  for got, want in zip(lead, batch):
    if got not in (1, want):
      raise ValueError(f"{name} of shape {x.shape} does not broadcast to the batch dims {batch}")
  x = jnp.broadcast_to(x, tuple(batch) + x.shape[nb:])
  return x.reshape((math.prod(batch),) + x.shape[nb:])


def _precision_context(precision):
  """flax's ``precision`` as a matmul-precision context for jattn's einsums."""
  if precision is None:
    return contextlib.nullcontext()
  if isinstance(precision, (tuple, list)):
    if len(precision) != 2 or precision[0] != precision[1]:
      raise NotImplementedError(
        f"precision={precision!r}: jattn applies one matmul precision to all its einsums; "
        f"pass a single jax.lax.Precision or a pair of equal ones"
      )
    precision = precision[0]
  if isinstance(precision, jax.lax.Precision):
    name = _PRECISION_NAMES[precision]
  elif isinstance(precision, str):
    name = precision
  else:
    raise TypeError(
      f"precision must be None, a jax.lax.Precision or a string, got "
      f"{type(precision).__name__} {precision!r}"
    )
  return jax.default_matmul_precision(name)
