"""jax.nn's cuDNN flash attention behind jattn's call, with jattn's semantics on top.

`jax.nn.dot_product_attention(implementation="cudnn")` runs NVIDIA's fused kernel for 16-bit
inputs. jattn hands it the calls it can express (a boolean or additive mask array, top-left
causal, a window, lengths, GQA) and restores what it leaves undefined: a row with nothing to
attend to returns 0 and gets zero gradients (`jattn._backends.foreign`). What it cannot express
raises NotImplementedError naming the argument, so a sequence of implementations falls through to
the next. Shape vocabulary: B T S N K H.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jattn import _softmax
from jattn import masks as _masks
from jattn._backends import foreign
from jattn._tile import NEG


def _check_gpu():
  try:
    jax.devices("cuda")
  except RuntimeError:
    raise NotImplementedError(
      "implementation='cudnn' needs an NVIDIA GPU with cuDNN (jax.nn checks the cuDNN "
      f"version when it traces the call); this process has none: {jax.devices()}"
    ) from None


def supports(call) -> str | None:
  """None, or what of the bound call (`jattn._call.Call`) jax.nn's cuDNN call cannot take and
  why."""
  g, opts = call.given, call.opts
  missing = foreign.missing_input(
    "jax.nn's cuDNN call",
    (
      ("mask objects", isinstance(g.mask, _masks.Mask)),
      ("q_segment_ids", g.q_seg is not None),
      ("sinks", g.sinks is not None),
      ("score_mod", opts.score_mod is not None),
      ("dropout", opts.dropout_rate > 0),
      ("logits_soft_cap", opts.logits_soft_cap is not None),
    ),
  )
  if missing:
    return missing
  if call.static.Hv != call.static.H:
    return (
      f"a value head size Hv={call.static.Hv} other than the key's H={call.static.H}: "
      f"jax.nn's call takes value with key's shape"
    )
  if call.query.dtype not in (jnp.bfloat16, jnp.float16):
    return f"query dtype {call.query.dtype}: cuDNN's flash attention takes float16 or bfloat16"
  if opts.causal == "bottom_right":
    return "is_causal='bottom_right': jax.nn's causal mask is top-left"
  if opts.window is not None and None in opts.window:
    return f"local_window_size={opts.window}: jax.nn's cuDNN window needs both sides"
  return None


def first(call) -> bool:
  """implementation=None tries cuDNN first on a GPU for the 16-bit calls it takes (`supports`)
  where the program cannot be partitioned (jax.nn's cuDNN call refuses sequence-sharded inputs
  once the program is partitioned, after tracing). Where this process has no GPU with cuDNN (a
  program exported for cuda from a CPU) tracing it raises NotImplementedError and the call falls
  through to jattn's kernels."""
  return supports(call) is None and call.static.split.unpartitioned


class JaxNnOptions(NamedTuple):
  """The options of one call that jax.nn's cuDNN call takes besides its arrays: the logit
  ``scale``, ``causal`` ("top_left" or None: `supports` refuses "bottom_right") and ``window``
  ((left, right) or None)."""

  scale: float
  causal: str | None
  window: tuple[int, int] | None

  def keywords(self) -> dict:
    """jax.nn.dot_product_attention's keywords for these options, on cuDNN."""
    return dict(
      scale=self.scale,
      is_causal=self.causal == "top_left",
      local_window_size=self.window,
      implementation="cudnn",
    )


def run(call):
  """jax.nn's cuDNN kernel on a bound call: (out (B, T, N, H), lse (B, T, N) float32). It takes
  the arguments as given (jax.nn's layout), the query scaled if the scale is an array; the mask
  is a boolean array or None (`supports` has refused what jax.nn's call cannot express)."""
  _check_gpu()
  g, opts = call.given, call.opts
  nn = JaxNnOptions(call.static.scale, opts.causal, opts.window)
  kw = nn.keywords()
  T = call.query.shape[1]

  # The arrays jax.nn takes besides q, k, v, bias travel as operands (aux), not in closures: the
  # custom VJP runs these functions again when it is differentiated, after this trace.
  def forward(q, k, v, b, mask, q_len, kv_len):
    out, lse = jax.nn.dot_product_attention(
      q,
      k,
      v,
      b,
      mask,
      query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len,
      return_residual=True,
      **kw,
    )
    lse = lse.astype(jnp.float32)
    # Rows emptied by the lengths, besides those the log-sum-exp shows.
    hidden = jnp.zeros(lse.shape, bool)
    if q_len is not None:
      hidden = hidden | (jnp.arange(T)[None, :, None] >= q_len[:, None, None])
    if kv_len is not None:
      hidden = hidden | (kv_len[:, None, None] <= 0)
    return out, jnp.where(hidden, -jnp.inf, lse)

  def plain(q, k, v, b, mask, q_len, kv_len, implementation="cudnn"):
    return jax.nn.dot_product_attention(
      q,
      k,
      v,
      b,
      mask,
      query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len,
      **{**kw, "implementation": implementation},
    )

  # jax.nn's XLA computation of the same call: cuDNN's definition in plain JAX, for forward
  # mode and for a derivative of the backward, which the kernel has neither of.
  pure = functools.partial(plain, implementation="xla")

  def lse_of(q, k, v, b, mask, q_len, kv_len):
    del v
    return _lse(q, k, b, mask, q_len, kv_len, nn)

  try:
    return foreign.zero_empty_rows(
      forward,
      plain,
      pure,
      _empty_rows,
      lse_of,
      (call.query, call.key, call.value, g.bias),
      (g.mask, g.q_lengths, g.kv_lengths),
    )
  except ValueError as e:  # jax.nn's own limits (head dim, layout, mask shape, ...)
    raise NotImplementedError(f"implementation='cudnn': {e}") from e


def _empty_rows(lse):
  """jax.nn hides masked logits with a large finite negative (-2^41 for bfloat16, -2^15 for
  float16, jax.nn's own constants), so a row with nothing visible has a log-sum-exp about that
  low, or -inf; half of float16's constant separates them from real rows (a row whose every
  logit a bias pushes below -16384 counts as empty here). A NaN log-sum-exp is not empty: a NaN
  at a visible position propagates."""
  return lse < -(1 << 14)


def _lse(q, k, bias, mask, q_len, kv_len, nn: JaxNnOptions):
  """The (B, T, N) float32 log-sum-exp of the call in plain JAX (O(T x S)), for its gradient
  where the caller uses the lse: jax.nn's cuDNN call returns it without one."""
  scale, causal, window = nn
  B, T, N, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  s = (
    jnp.einsum(
      "btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, -1).astype(jnp.float32), k.astype(jnp.float32)
    ).reshape(B, N, T, S)
    * scale
  )
  if bias is not None:
    s = s + bias.astype(jnp.float32).reshape((1,) * (4 - bias.ndim) + bias.shape)
  t, j = jnp.arange(T).reshape(1, 1, T, 1), jnp.arange(S).reshape(1, 1, 1, S)
  vis = jnp.ones((1, 1, T, S), bool)
  if mask is not None:
    vis = vis & mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
  if causal is not None:
    vis = vis & (j <= t)
  if window is not None:
    vis = vis & (j >= t - window[0]) & (j <= t + window[1])
  if q_len is not None:
    vis = vis & (t < q_len[:, None, None, None])
  if kv_len is not None:
    vis = vis & (j < kv_len[:, None, None, None])
  _, l, m = _softmax.exp_rows(jnp.where(vis, s, NEG))
  return jnp.transpose(_softmax.lse(m, l), (0, 2, 1))
