"""A float64 NumPy multi-head attention layer driven by the parameters of jattn's Flax modules.

Written plainly from the documented definitions (docs/flax.md), independent of jattn's code:
projections, rotary positions, grouped key/value heads, masks and the softmax (through the
float64 `reference.attention` / `reference.visible_mask`), dropout given an explicit keep mask,
the output projection, and KV-cache decoding as a loop over steps.

Parameters, as both modules lay them out (`params_from_linen` / `params_from_nnx` read them):
``query`` kernel (D, N, H), ``key`` and ``value`` kernels (D_kv, K, H), biases (N|K, H), ``out``
kernel (N, H, D_out) with bias (D_out,). N and K are read from the kernels; query head n uses
key/value head n // (N // K).

Shapes: B batch, T query length, S key length, N query heads, K key/value heads, H head dim,
D features.
"""

from __future__ import annotations

import numpy as np
import reference

NAMES = ("query", "key", "value", "out")


def params_from_linen(params) -> dict:
  """{name: {"kernel", "bias"}} in float64 from a jattn.linen params tree (``["params"]``)."""
  return {
    n: {w: np.asarray(params[n][w], np.float64) for w in ("kernel", "bias") if w in params[n]}
    for n in NAMES
  }


def params_from_nnx(module) -> dict:
  """The same dict read from a jattn.nnx.MultiHeadAttention's parameter variables."""
  out = {}
  for n in NAMES:
    layer = getattr(module, n)
    d = {"kernel": np.asarray(layer.kernel[...], np.float64)}
    if getattr(layer, "bias", None) is not None:
      d["bias"] = np.asarray(layer.bias[...], np.float64)
    out[n] = d
  return out


def _dense(x, p, spec):
  y = np.einsum(spec, np.asarray(x, np.float64), p["kernel"])
  return y + p["bias"] if "bias" in p else y


def project_qkv(params, x_q, x_kv):
  """q (B, T, N, H), k and v (B, S, K, H) in float64."""
  q = _dense(x_q, params["query"], "btd,dnh->btnh")
  k = _dense(x_kv, params["key"], "bsd,dkh->bskh")
  v = _dense(x_kv, params["value"], "bsd,dkh->bskh")
  return q, k, v


def project_out(params, o):
  """(B, T, N, H) attention output -> (B, T, D_out)."""
  return _dense(o, params["out"], "btnh,nho->bto")


def rope(x, positions, base=10000.0):
  """Rotate-half RoPE as a complex rotation: feature i < H/2 and feature i + H/2 are the real and
  imaginary parts of z_i, turned by exp(1j * position * base ** (-2 i / H)).

  x (B, L, heads, H); positions int (B, L).
  """
  x = np.asarray(x, np.float64)
  H = x.shape[-1]
  half = H // 2
  freq = np.array([base ** (-2.0 * i / H) for i in range(half)])
  angle = np.asarray(positions, np.float64)[:, :, None, None] * freq  # (B, L, 1, H/2)
  z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * angle)
  return np.concatenate([z.real, z.imag], axis=-1)


def _positions(p, B, L):
  if p is None:
    p = np.arange(L)
  p = np.asarray(p)
  return np.broadcast_to(p if p.ndim == 2 else p[None], (B, L))


def mha(
  params,
  x_q,
  x_kv=None,
  *,
  causal=None,
  window=None,
  mask=None,
  scale=None,
  soft_cap=None,
  rope_base=None,
  positions=None,
  kv_positions=None,
  q_lengths=None,
  kv_lengths=None,
  q_seg=None,
  kv_seg=None,
  keep=None,
  dropout_rate=0.0,
):
  """The layer's forward pass without a cache. Returns (B, T, D_out) float64.

  x_q (B, T, D); x_kv (B, S, D_kv) for cross-attention (None: self-attention on x_q).
  causal: None, "top_left" (the modules' ``is_causal=True``) or "bottom_right"; window
  (left, right); mask: boolean broadcastable to (B, N, T, S); rope_base: None for no RoPE, else
  the base. RoPE positions: ``positions`` (T,) or (B, T) for the queries (default arange(T)),
  ``kv_positions`` for the keys (default: the query positions in self-attention, arange(S)
  otherwise). keep: boolean (B, N, T, S) dropout keep mask (the kept weights are scaled by
  1 / (1 - dropout_rate)).
  """
  self_attention = x_kv is None
  x_kv = x_q if self_attention else x_kv
  q, k, v = project_qkv(params, x_q, x_kv)
  B, T, N, _ = q.shape
  S = k.shape[1]
  if rope_base is not None:
    qp = _positions(positions, B, T)
    if kv_positions is None and self_attention:
      kp = qp
    else:
      kp = _positions(kv_positions, B, S)
    q, k = rope(q, qp, rope_base), rope(k, kp, rope_base)
  vis = reference.visible_mask(
    B,
    N,
    T,
    S,
    mask=mask,
    causal=causal,
    window=window,
    q_lengths=q_lengths,
    kv_lengths=kv_lengths,
    q_seg=q_seg,
    kv_seg=kv_seg,
  )
  o, _, _ = reference.attention(
    q, k, v, visible=vis, scale=scale, soft_cap=soft_cap, keep=keep, dropout_rate=dropout_rate
  )
  return project_out(params, o)


def decode(params, steps, *, window=None, scale=None, soft_cap=None, rope_base=None):
  """Cached causal decoding, one step after another, as a NumPy loop.

  ``steps``: a list of (x (B, T_i, D), n_new) pairs; n_new None (all T_i tokens are real) or an
  int (B,) count of real tokens (the rest right-padding). Each example keeps its own cache of
  rotated keys and values; a step appends its real tokens at positions fill[b] ..
  fill[b] + n_new[b] - 1 (their RoPE positions too) and computes its real queries from the whole
  filled prefix: query t sees keys j <= fill[b] + t (and j >= fill[b] + t - left with a window
  (left, right)). Padded queries attend to nothing (output = the out projection's bias).

  Returns the list of per-step outputs (B, T_i, D_out) in float64.
  """
  B = steps[0][0].shape[0]
  cache_k = [None] * B  # (fill, K, H) per example
  cache_v = [None] * B
  outs = []
  for x, n_new in steps:
    q, k, v = project_qkv(params, x, x)
    Ti, N, H = q.shape[1:]
    n_new = np.full((B,), Ti) if n_new is None else np.asarray(n_new)
    o = np.zeros((B, Ti, N, H))
    for b in range(B):
      fill = 0 if cache_k[b] is None else cache_k[b].shape[0]
      n = int(n_new[b])
      pos = fill + np.arange(n)[None]
      qb, kb, vb = q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n]
      if rope_base is not None:
        qb, kb = rope(qb, pos, rope_base), rope(kb, pos, rope_base)
      cache_k[b] = kb[0] if cache_k[b] is None else np.concatenate([cache_k[b], kb[0]])
      cache_v[b] = vb[0] if cache_v[b] is None else np.concatenate([cache_v[b], vb[0]])
      S = cache_k[b].shape[0]
      t = fill + np.arange(n)[:, None]  # absolute query positions
      j = np.arange(S)[None, :]
      vis = j <= t
      if window is not None:
        vis &= j >= t - window[0]
      ob, _, _ = reference.attention(
        qb,
        cache_k[b][None],
        cache_v[b][None],
        visible=np.broadcast_to(vis, (1, N, n, S)),
        scale=scale,
        soft_cap=soft_cap,
      )
      o[b, :n] = ob[0]
    outs.append(project_out(params, o))
  return outs
