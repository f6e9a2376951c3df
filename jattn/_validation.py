"""Argument checks. Every malformed call fails here, at trace time, naming the argument.

ValueError for bad shapes and values, TypeError for bad dtypes and types, NotImplementedError for
valid requests jattn does not support. Nothing here runs inside the custom-VJP kernels.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jattn import masks as _masks

IMPLEMENTATIONS = ("dense", "chunked")


# ---- static options ------------------------------------------------------------------------


def scale(value):
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"scale must be a real number or None, got {type(value).__name__} {value!r}")
  value = float(value)
  if not np.isfinite(value):
    raise ValueError(f"scale must be finite, got {value}")
  return value


def scale_operand(value):
  """``scale`` of the public function: (static float or None, jax scalar operand or None).

  Python and NumPy numbers are static (part of the jit cache key, applied to the float32
  logits); a jax array, concrete or traced, is an operand (jax.nn accepts both).
  """
  if isinstance(value, jax.Array):  # tracers are jax.Arrays too
    if value.shape != ():
      raise ValueError(f"scale must be a scalar, got an array of shape {value.shape}")
    if not (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
      raise TypeError(f"scale must be a real number, got dtype {value.dtype}")
    return 1.0, value
  if isinstance(value, np.ndarray) and value.shape == ():
    value = value[()]
  return scale(value), None


def causal(value):
  if isinstance(value, np.bool_):
    value = bool(value)
  if value is False or value is None:
    return None
  if value is True:
    return "top_left"
  if isinstance(value, str) and value in ("top_left", "bottom_right"):
    return value
  raise ValueError(
      f"is_causal must be a bool, 'top_left' or 'bottom_right', got {value!r}")


def window(value):
  """``local_window_size``: ``w`` means ``(w, w)`` as in jax.nn; ``None`` on a side: unbounded."""
  if value is None:
    return None
  is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
  if is_int(value):
    value = (int(value), int(value))
  if (not isinstance(value, (tuple, list)) or len(value) != 2
      or not all(v is None or is_int(v) for v in value)):
    raise ValueError(f"local_window_size must be an int or a (left, right) pair of ints or "
                     f"None, got {value!r}")
  if any(v is not None and v < 0 for v in value):
    raise ValueError(f"local_window_size must be non-negative, got {value!r}")
  left, right = (None if v is None else int(v) for v in value)
  return None if (left, right) == (None, None) else (left, right)


def soft_cap(value):
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"logits_soft_cap must be a float or None, got {type(value).__name__}")
  if not (float(value) > 0 and np.isfinite(float(value))):
    raise ValueError(f"logits_soft_cap must be a positive finite number, got {value!r}")
  return float(value)


def dropout(rate, rng):
  if isinstance(rate, (bool, np.bool_)) or not isinstance(rate, numbers.Real):
    raise TypeError(f"dropout_rate must be a float in [0, 1), got {type(rate).__name__}")
  rate = float(rate)
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
  if rate > 0 and rng is None:
    raise ValueError(f"dropout_rate={rate} needs dropout_rng (a PRNG key), got None")
  if rate > 0:
    _prng_key("dropout_rng", rng)
  return rate


def _prng_key(name, key):
  """One PRNG key: a typed key of shape (), or a raw uint32 key (jax.random.PRNGKey) of rank 1."""
  shape, dtype = getattr(key, "shape", None), getattr(key, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if shape != ():
      raise ValueError(f"{name} must be a single PRNG key, got a key array of shape {shape} "
                       f"(split keys are for several calls)")
    return
  if dtype != jnp.uint32 or shape is None or len(shape) != 1:
    raise TypeError(f"{name} must be a PRNG key (jax.random.key(...), or a raw uint32 "
                    f"jax.random.PRNGKey(...)), got "
                    f"{type(key).__name__ if dtype is None else f'{dtype}{tuple(shape)}'}")


def implementation(value):
  if value is None:
    return None
  if value == "xla":
    return "dense"
  if value == "cudnn":
    raise NotImplementedError(
        "implementation='cudnn' is jax.nn's cuDNN kernel; jattn is pure JAX/XLA. Use "
        "jax.nn.dot_product_attention(implementation='cudnn') for it.")
  if value not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be None, 'dense' (or 'xla') or 'chunked', got {value!r}")
  return value


def block(name, value):
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a positive int or None, got {type(value).__name__} {value!r}")
  if value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value}")
  return int(value)


def flag(name, value):
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
  return bool(value)


def callable_or_none(name, value):
  if value is not None and not callable(value):
    raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
  return value


# ---- arrays --------------------------------------------------------------------------------


@dataclasses.dataclass
class Arrays:
  """The array arguments, made rank-4 ((B, T, N, H) etc.), checked against each other."""

  query: Any
  key: Any
  value: Any
  bias: Any
  mask: Any
  q_lengths: Any
  kv_lengths: Any
  q_seg: Any
  kv_seg: Any
  sinks: Any
  unbatched: bool


def _float_array(name, x):
  if not hasattr(x, "dtype") or not hasattr(x, "shape"):
    x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {name}.dtype={x.dtype}")
  return x


def broadcastable(name, x, shape, letters):
  """Rank <= 4, each dim either 1 or the full size (no silent broadcasting of other sizes)."""
  chex.assert_rank(x, {0, 1, 2, 3, 4}, exception_type=ValueError,
                   custom_message=f"{name} must have rank <= 4, broadcastable to {letters}={shape}")
  x4 = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
  for got, want in zip(x4.shape, shape):
    if got not in (1, want):
      raise ValueError(
          f"{name} of shape {tuple(x.shape)} is not broadcastable to {letters}={shape}: each "
          f"dimension must be 1 or the full size")
  return x4


def int_vector(name, x, B, *, checked=False):
  """An int (B,) array as int32. ``checked``: only check (mask objects keep their own arrays);
  None passes."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array of shape (B,)=({B},), got dtype {x.dtype}")
  chex.assert_shape(x, (B,), exception_type=ValueError,
                    custom_message=f"{name} must have shape (B,)=({B},), got {x.shape}")
  return x if checked else x.astype(jnp.int32)


def segment_ids(name, x, B, L, letter, *, checked=False):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array of shape (B, {letter})=({B}, {L}), "
                    f"got dtype {x.dtype}")
  if x.ndim == 1 and B == 1 and not checked:
    x = x[None]
  chex.assert_shape(x, (B, L), exception_type=ValueError,
                    custom_message=f"{name} must have shape (B, {letter})=({B}, {L}), "
                    f"got {x.shape}")
  return x if checked else x.astype(jnp.int32)


def arrays(query, key, value, bias, mask, q_lengths, kv_lengths, q_seg, kv_seg, sinks) -> Arrays:
  query = _float_array("query", query)
  key = _float_array("key", key)
  value = _float_array("value", value)
  chex.assert_rank(query, {3, 4}, exception_type=ValueError,
                   custom_message=f"query must be (B, T, N, H) or (T, N, H), got {query.shape}")
  chex.assert_rank(key, query.ndim, exception_type=ValueError,
                   custom_message=f"key must have the rank of query ({query.ndim}): "
                   f"query.shape={query.shape}, key.shape={key.shape}")
  if key.dtype != query.dtype or value.dtype != query.dtype:
    raise TypeError(f"query, key and value must share a dtype, got query.dtype={query.dtype}, "
                    f"key.dtype={key.dtype}, value.dtype={value.dtype}")
  if value.shape != key.shape:
    raise ValueError(f"value must have the shape of key (B, S, K, H): key.shape={key.shape}, "
                     f"value.shape={value.shape}")
  unbatched = query.ndim == 3
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  B, T, N, H = query.shape
  Bk, S, K, Hk = key.shape
  if Bk != B:
    raise ValueError(f"query and key must have the same batch size B: query.shape={query.shape}, "
                     f"key.shape={key.shape}")
  if Hk != H:
    raise ValueError(f"query and key must have the same head dim H: query.shape={query.shape}, "
                     f"key.shape={key.shape}")
  if K == 0 or N % K:
    raise ValueError(f"the number of query heads N={N} must be a multiple of the number of "
                     f"key/value heads K={K} (query.shape={query.shape}, key.shape={key.shape})")
  if min(T, S, H) == 0:
    raise ValueError(f"empty attention: T={T}, S={S}, H={H} must all be positive")
  full = (B, N, T, S)

  if bias is not None:
    bias = _float_array("bias", bias)
    bias = broadcastable("bias", bias, full, "(B, N, T, S)")
  if isinstance(mask, _masks.Mask):
    mask.validate(full)
  elif mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
      raise TypeError(f"mask must be a boolean array (True = attend) or a jattn.masks object, "
                      f"got dtype {mask.dtype}; pass additive masks as bias")
    mask = broadcastable("mask", mask, full, "(B, N, T, S)")
  if q_lengths is not None:
    q_lengths = int_vector("query_seq_lengths", q_lengths, B)
  if kv_lengths is not None:
    kv_lengths = int_vector("key_value_seq_lengths", kv_lengths, B)
  if (q_seg is None) != (kv_seg is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together, got only "
                     + ("q_segment_ids" if kv_seg is None else "kv_segment_ids"))
  if q_seg is not None:
    q_seg = segment_ids("q_segment_ids", q_seg, B, T, "T")
    kv_seg = segment_ids("kv_segment_ids", kv_seg, B, S, "S")
  if sinks is not None:
    sinks = _float_array("sinks", sinks)
    chex.assert_shape(sinks, (N,), exception_type=ValueError,
                      custom_message=f"sinks must have shape (N,)=({N},), got {sinks.shape}")
  return Arrays(query, key, value, bias, mask, q_lengths, kv_lengths, q_seg, kv_seg, sinks,
                unbatched)
