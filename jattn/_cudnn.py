"""jax.nn's cuDNN flash attention behind jattn's call, with jattn's semantics on top.

`jax.nn.dot_product_attention(implementation="cudnn")` runs NVIDIA's fused kernel for 16-bit
inputs. jattn hands it the calls it can express (a boolean or additive mask array, top-left
causal, a window, lengths, GQA) and restores what it leaves undefined: a row with nothing to
attend to returns 0 and gets zero gradients (`jattn._fused`). What it cannot express raises
NotImplementedError naming the argument, so a sequence of implementations falls through to the
next. Shape vocabulary: B T S N K H.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import _fused


def refuse(name: str, reason: str):
  raise NotImplementedError(f"implementation='cudnn' does not support {name}: {reason}")


def _check_gpu():
  try:
    jax.devices("cuda")
  except RuntimeError:
    raise NotImplementedError(
        "implementation='cudnn' needs an NVIDIA GPU with cuDNN (jax.nn checks the cuDNN "
        f"version when it traces the call); this process has none: {jax.devices()}") from None


def cudnn_attention(query, key, value, bias, mask, *, scale, causal, window, q_lengths,
                    kv_lengths):
  """(out (B, T, N, H), lse (B, T, N)) through jax.nn's cuDNN kernel. ``mask`` is a boolean
  array or None (mask objects and segment ids are refused by the caller)."""
  if query.dtype not in (jnp.bfloat16, jnp.float16):
    refuse(f"query dtype {query.dtype}", "cuDNN's flash attention takes float16 or bfloat16")
  if causal == "bottom_right":
    refuse("is_causal='bottom_right'", "jax.nn's causal mask is top-left")
  _check_gpu()
  kw = dict(scale=scale, is_causal=causal == "top_left", query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths, local_window_size=window, implementation="cudnn")

  def forward(q, k, v, b):
    return jax.nn.dot_product_attention(q, k, v, b, mask, return_residual=True, **kw)

  def plain(q, k, v, b):
    return jax.nn.dot_product_attention(q, k, v, b, mask, **kw)

  try:
    return _fused.zero_empty_rows(forward, plain, _empty_rows, (query, key, value, bias), ())
  except ValueError as e:  # jax.nn's own limits (head dim, layout, mask shape, ...)
    raise NotImplementedError(f"implementation='cudnn': {e}") from e


def _empty_rows(lse):
  # Anything but a finite log-sum-exp of real size: -inf, NaN or a masked-value sentinel.
  return ~(lse > -1e30)
