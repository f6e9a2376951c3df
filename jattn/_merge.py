"""`merge_attention`: attention over disjoint key sets merged into attention over their union.

Each part is combined through its log-sum-exp (`jattn._softmax.merge_stacked`), exactly and with
gradients: split-KV decoding over pieces of a KV cache, cascades (a shared prefix attended once,
each suffix on its own), or any other partition of the keys. Public as ``jattn.merge_attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import _softmax, _tile, _validation


def merge_attention(outs, lses):
  """Merge attention results over disjoint key sets into the result over their union.

  If ``out_i, lse_i`` is attention of the same queries over key set ``S_i`` (as returned by
  ``dot_product_attention(..., return_residual=True)``), the merged result is attention over the
  union of the ``S_i``: ``lse = log(sum_i exp(lse_i))`` and
  ``out = sum_i exp(lse_i - lse) * out_i``, computed with the max subtracted and in float32 (or
  wider). Split-KV decoding uses it to combine partial results over pieces of a KV cache.

  A row with nothing to attend to in one part (its lse very negative: -inf, or jattn's finite
  sentinel) gets weight 0 there; a row with nothing in any part returns out 0 and keeps its very
  negative lse, without NaN.

  Gradients: the log-sum-exp that ``dot_product_attention(..., return_residual=True)`` and
  `ring_attention` return carries its gradient, so a merge of such parts differentiates exactly
  (dQ, dK and dV of one call over the union of the keys).

  Args:
    outs: a sequence of n arrays (B, T, N, H) -- or any (..., H) -- or one stacked (n, ..., H)
      array.
    lses: the matching log-sum-exps, a sequence of n arrays (B, T, N) or one (n, ...) array.

  Returns:
    (out, lse): out (B, T, N, H) in the dtype of ``outs``, lse (B, T, N) in the dtype of ``lses``.
  """
  outs = _stack("outs", outs)
  lses = _stack("lses", lses)
  for name, x in (("outs", outs), ("lses", lses)):
    _validation.float_array(name, x)
  if outs.ndim < 2 or lses.shape != outs.shape[:-1]:
    raise ValueError(
      f"lses must have the shape of outs without its last (H) axis: stacked "
      f"outs.shape={outs.shape}, lses.shape={lses.shape}"
    )
  if outs.shape[0] == 0:
    raise ValueError("merge_attention needs at least one partial result, got 0")
  return _merge(outs, lses)


@jax.jit
def _merge(outs, lses):
  sd = _tile.stat_dtype(jnp.promote_types(outs.dtype, lses.dtype))
  out, lse = _softmax.merge_stacked(outs, lses, sd)
  return out.astype(outs.dtype), lse.astype(lses.dtype)


def _stack(name, xs):
  if isinstance(xs, (list, tuple)):
    if not xs:
      raise ValueError(f"{name} must hold at least one partial result, got an empty sequence")
    xs = [jnp.asarray(x) for x in xs]
    if len({x.dtype for x in xs}) > 1:
      raise TypeError(f"all {name} must share one dtype, got {[str(x.dtype) for x in xs]}")
    if len({x.shape for x in xs}) > 1:
      raise ValueError(f"all {name} must share one shape, got {[x.shape for x in xs]}")
    return jnp.stack(xs)
  return jnp.asarray(xs)
