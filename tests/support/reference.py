"""A float64 reference for attention, written plainly: the definition the tests pin down.

Shapes: q (B,T,N,H), k/v (B,S,K,H), visible (B,N,T,S) boolean (True = attend), bias broadcastable
to (B,N,T,S). Heads: query head n uses key/value head n // G (G = N // K), as jax.nn.

`attention` and `grads` are NumPy with the backward pass written out by hand. `attention_vjp` is
the same definition in float64 jax.numpy, differentiated by `jax.vjp`: it covers what a hand-written
backward cannot (an arbitrary score_mod and the arrays it closes over). None of this imports jattn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def visible_mask(
  B,
  N,
  T,
  S,
  *,
  mask=None,
  causal=None,
  window=None,
  q_lengths=None,
  kv_lengths=None,
  q_seg=None,
  kv_seg=None,
):
  """The dense (B, N, T, S) boolean mask, built index by index from the definitions."""
  t = np.arange(T)[:, None]
  s = np.arange(S)[None, :]
  vis = np.ones((B, N, T, S), bool)
  if mask is not None:
    vis &= np.broadcast_to(
      np.asarray(mask, bool).reshape((1,) * (4 - np.ndim(mask)) + np.shape(mask)), vis.shape
    )
  offset = 0 if causal in (None, "top_left") else S - T
  if causal is not None:
    vis &= (s <= t + offset)[None, None]
  if window is not None:
    left, right = window
    vis &= ((s >= t + offset - left) & (s <= t + offset + right))[None, None]
  for b in range(B):
    if q_lengths is not None:
      vis[b, :, q_lengths[b] :, :] = False
    if kv_lengths is not None:
      vis[b, :, :, kv_lengths[b] :] = False
    if q_seg is not None:
      vis[b] &= (np.asarray(q_seg)[b][:, None] == np.asarray(kv_seg)[b][None, :])[None]
  return vis


def attention(
  q,
  k,
  v,
  *,
  visible=None,
  bias=None,
  scale=None,
  soft_cap=None,
  keep=None,
  dropout_rate=0.0,
  sinks=None,
  score_mod=None,
):
  """Forward pass. Returns (out (B,T,N,H), lse (B,T,N), and the intermediates for `grads`)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  scale = 1.0 / np.sqrt(H) if scale is None else scale
  kr = np.repeat(k, G, axis=2)  # (B,S,N,H)
  vr = np.repeat(v, G, axis=2)
  raw = np.einsum("btnh,bsnh->bnts", q, kr) * scale
  tanh = None
  logits = raw
  if soft_cap is not None:
    tanh = np.tanh(raw / soft_cap)
    logits = soft_cap * tanh
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  if score_mod is not None:
    logits = score_mod(logits)  # a NumPy function of the (B,N,T,S) logits; no gradient (see grads)
  vis = np.ones((B, N, T, S), bool) if visible is None else visible
  masked = np.where(vis, logits, -np.inf)
  m = masked.max(axis=-1, keepdims=True)
  if sinks is not None:
    m = np.maximum(m, np.asarray(sinks, np.float64)[None, :, None, None])
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(vis, np.exp(masked - m), 0.0)
  denom = e.sum(-1, keepdims=True)
  if sinks is not None:
    denom = denom + np.exp(np.asarray(sinks, np.float64)[None, :, None, None] - m)
  p = np.where(denom > 0, e / np.where(denom > 0, denom, 1.0), 0.0)  # empty rows -> 0
  lse = np.where(
    denom[..., 0] > 0, np.log(np.where(denom[..., 0] > 0, denom[..., 0], 1.0)) + m[..., 0], -np.inf
  )
  pd = p
  if keep is not None and dropout_rate > 0:
    pd = np.where(keep, p, 0.0) / (1.0 - dropout_rate)
  out = np.einsum("bnts,bsnh->btnh", pd, vr)
  cache = dict(
    q=q,
    kr=kr,
    vr=vr,
    p=p,
    pd=pd,
    tanh=tanh,
    scale=scale,
    G=G,
    K=K,
    keep=keep,
    rate=dropout_rate,
    vis=vis,
    sinks=sinks,
    m=m,
    denom=denom,
    score_mod=score_mod,
  )
  return out, lse.transpose(0, 2, 1), cache


def grads(cache, dout, bias_shape=None):
  """Backward pass of `attention` for a cotangent dout (B,T,N,H): (dq, dk, dv, dbias, dsinks)."""
  if cache["score_mod"] is not None:
    raise NotImplementedError("grads has no score_mod derivative: use attention_vjp")
  dout = np.asarray(dout, np.float64)
  q, kr, vr, p, pd = cache["q"], cache["kr"], cache["vr"], cache["p"], cache["pd"]
  B, _T, _N, H = q.shape
  K, G = cache["K"], cache["G"]
  dvr = np.einsum("bnts,btnh->bsnh", pd, dout)
  dpd = np.einsum("btnh,bsnh->bnts", dout, vr)
  dp = dpd
  if cache["keep"] is not None and cache["rate"] > 0:
    dp = np.where(cache["keep"], dpd, 0.0) / (1.0 - cache["rate"])
  # Softmax Jacobian: dS = P * (dP - sum(P * dP)); the sink takes probability mass too but has
  # no value, so its own gradient is -p_sink * sum(P * dP).
  rowdot = (p * dp).sum(-1, keepdims=True)
  dlogits = p * (dp - rowdot)
  dsinks = None
  if cache["sinks"] is not None:
    p_sink = (
      np.exp(np.asarray(cache["sinks"], np.float64)[None, :, None, None] - cache["m"])
      / cache["denom"]
    )
    dsinks = -(p_sink * rowdot).sum(axis=(0, 2, 3))
  dbias = None
  if bias_shape is not None:
    shape4 = (1,) * (4 - len(bias_shape)) + tuple(bias_shape)
    axes = tuple(a for a in range(4) if shape4[a] == 1)
    dbias = dlogits.sum(axis=axes, keepdims=True).reshape(bias_shape)
  draw = dlogits if cache["tanh"] is None else dlogits * (1 - cache["tanh"] ** 2)
  draw = draw * cache["scale"]
  dq = np.einsum("bnts,bsnh->btnh", draw, kr)
  dkr = np.einsum("bnts,btnh->bsnh", draw, q)
  dk = dkr.reshape(B, -1, K, G, H).sum(3)
  dv = dvr.reshape(B, -1, K, G, dvr.shape[-1]).sum(3)
  return dq, dk, dv, dbias, dsinks


def attention_vjp(
  q,
  k,
  v,
  dout,
  *,
  visible=None,
  bias=None,
  scale=None,
  soft_cap=None,
  keep=None,
  dropout_rate=0.0,
  sinks=None,
  make_score_mod=None,
  score_args=(),
  dlse=None,
):
  """The definition in float64 jax.numpy, forward and reverse by autodiff.

  ``make_score_mod(args)`` returns ``f(score, b, h, q_index, kv_index)`` on the (B,N,T,S) logits
  (after soft cap and bias, before masking), with int32 index arrays (B,1,1,1), (1,N,1,1),
  (1,1,T,1), (1,1,1,S); ``score_args`` is the pytree of arrays it closes over (their gradients are
  returned). ``keep`` is the (B|1,N|1,T,S) dropout keep-mask. ``dlse`` (B,T,N): the lse's own
  cotangent (default zero); an empty row's lse (-inf) takes none.

  Returns (out (B,T,N,H), lse (B,T,N), grads) with grads a dict of dq, dk, dv, dbias, dsinks,
  dargs (None where the input is None), all NumPy float64.
  """
  with jax.enable_x64(True):
    f64 = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
    q, k, v, dout, bias, sinks = (f64(x) for x in (q, k, v, dout, bias, sinks))
    args = jax.tree.map(f64, score_args)
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    sc = 1.0 / np.sqrt(H) if scale is None else float(scale)
    vis = jnp.asarray(np.ones((B, N, T, S), bool) if visible is None else visible)

    def forward(q, k, v, bias, sinks, args):
      kr = jnp.repeat(k, G, axis=2)  # (B,S,N,H)
      vr = jnp.repeat(v, G, axis=2)
      s = jnp.einsum("btnh,bsnh->bnts", q, kr) * sc
      if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
      if bias is not None:
        s = s + bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
      if make_score_mod is not None:
        idx = (
          jnp.arange(B, dtype=jnp.int32).reshape(B, 1, 1, 1),
          jnp.arange(N, dtype=jnp.int32).reshape(1, N, 1, 1),
          jnp.arange(T, dtype=jnp.int32).reshape(1, 1, T, 1),
          jnp.arange(S, dtype=jnp.int32).reshape(1, 1, 1, S),
        )
        s = make_score_mod(args)(s, *idx)
      logits = jnp.where(vis, s, -jnp.inf)
      m = logits.max(axis=-1, keepdims=True)
      if sinks is not None:
        m = jnp.maximum(m, sinks[None, :, None, None])
      m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
      e = jnp.where(vis, jnp.exp(logits - m), 0.0)
      denom = e.sum(-1, keepdims=True)
      if sinks is not None:
        denom = denom + jnp.exp(sinks[None, :, None, None] - m)
      ok = denom > 0
      p = jnp.where(ok, e / jnp.where(ok, denom, 1.0), 0.0)  # empty rows -> 0
      lse = jnp.where(ok, jnp.log(jnp.where(ok, denom, 1.0)) + m, -jnp.inf)[..., 0]
      if keep is not None and dropout_rate > 0:
        p = jnp.where(jnp.asarray(keep), p, 0.0) / (1.0 - dropout_rate)
      out = jnp.einsum("bnts,bsnh->btnh", p, vr)
      return out, jnp.transpose(lse, (0, 2, 1))

    (out, lse), pull = jax.vjp(forward, q, k, v, bias, sinks, args)
    dlse = jnp.zeros_like(lse) if dlse is None else jnp.where(jnp.isfinite(lse), f64(dlse), 0.0)
    dq, dk, dv, dbias, dsinks, dargs = pull((dout, dlse))
    to_np = lambda x: None if x is None else np.asarray(x)
    grads = dict(
      dq=to_np(dq),
      dk=to_np(dk),
      dv=to_np(dv),
      dbias=to_np(dbias),
      dsinks=to_np(dsinks),
      dargs=jax.tree.map(to_np, dargs),
    )
    return np.asarray(out), np.asarray(lse), grads


# The 16-bit rule's two measures (tests/properties/test_precision16.py): the error against
# float64 stays within a small factor of the error of rounding the exact answer to the dtype.


def round_to_dtype(x, dtype):
  """``x`` rounded to ``dtype`` (through float32, as a kernel's output is), as float64."""
  return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


def rel_error(got, want):
  """||got - want|| / ||want|| (Frobenius), in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm((got - want).ravel()) / np.linalg.norm(want.ravel()))
