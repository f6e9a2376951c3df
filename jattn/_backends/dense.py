"""Dense attention: materialise the (B, N, T, S) scores; plain autodiff gives the gradients.

Fastest for short sequences, where the score matrix fits in cache. The stable softmax is written
out rather than calling `jax.nn.softmax` so that masked entries are exact zeros, a row with
nothing to attend to yields 0 instead of the mean of V, and no masked position can put inf or NaN
into the forward or backward pass.
"""

from __future__ import annotations

import jax.numpy as jnp

from jattn import _softmax, _tile
from jattn._tile import Config


def run(call):
  """The dense backend on a bound call (`jattn._call.Call`): (out (B, T, N, Hv), lse (B, T, N))."""
  s = call.static
  cfg, score_args = s.config((s.B, s.N, s.T, s.S))
  out, lse, mx = dense_attention(call, cfg, score_args)
  rows = lambda x: jnp.transpose(x.reshape(s.B, s.N, s.T), (0, 2, 1))
  out = jnp.transpose(out.reshape(s.B, s.N, s.T, s.Hv), (0, 2, 1, 3))
  if mx is None:
    return out, rows(lse)
  return out, rows(lse), rows(mx)


def weights(call):
  """The bound call's (B, N, T, S) softmax weights (see `attention_weights`)."""
  s = call.static
  if s.T * s.S == 0:  # no queries or no keys: no weight (a max over no keys has no identity)
    return jnp.zeros((s.B, s.N, s.T, s.S), s.stat_dtype)
  cfg, score_args = s.config((s.B, s.N, s.T, s.S))
  return attention_weights(call, cfg, score_args).reshape(s.B, s.N, s.T, s.S)


def dense_attention(call, cfg: Config, score_args=()):
  """The dense kernel on a bound call (`jattn._call.Call`), head-major and GQA-grouped: one
  (T, S) matmul per head. ``cfg`` and ``score_args`` from its `Static.config`; the call's bias is
  (B|1,K|1,G|1,T|1,S|1) or None, its mask a jattn Mask or None.

  Returns out (B,K,G,T,Hv) in the query's dtype, lse (B,K,G,T) in the statistics dtype, and
  with ``cfg.max_logits`` each row's max logit over its visible keys (B,K,G,T) (`row_max`: the
  max the softmax subtracts, before the sink joins), else None.
  """
  # The tile's math first (logits, visibility, dropout's keep-mask), then the softmax: each
  # layer is entered once, in that order.
  q, v, s, at = _masked_logits(call, cfg, score_args)
  keep = _tile.keep(cfg, call.seed, at) if cfg.dropout_rate > 0 else None
  p, l, m, m_keys = _softmax.exp_rows(s, call.sink, keys_max=True)
  if keep is not None:
    p = jnp.where(keep, p, jnp.zeros((), p.dtype))
  # P V with G and T separate dimensions (see `_tile.matmul`'s fold=False); fp32 accumulate.
  pv = jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), v, preferred_element_type=l.dtype)
  out = _softmax.normalize(pv, l, m, cfg.dropout_rate)
  # Differentiable: d lse / d s = P (m is a constant for autodiff, as in `_softmax.exp_rows`).
  lse = _softmax.lse(m, l)
  mx = _softmax.row_max(m_keys, l) if cfg.max_logits else None
  return out.astype(q.dtype), lse, mx


def attention_weights(call, cfg: Config, score_args=()):
  """The softmax weights (B,K,G,T,S) of a bound call in the statistics dtype, before dropout;
  rows with nothing to attend to are 0. O(T x S) by nature: for looking at the weights, not for
  computing with."""
  _, _, s, _ = _masked_logits(call, cfg, score_args)
  p, l, m, _ = _softmax.exp_rows(s, call.sink, keys_max=True)
  return _softmax.normalize(p, l, m, 0.0)


def _masked_logits(call, cfg: Config, score_args):
  """(q (B,K,G,T,H), v (B,K,S,Hv), the (B|1,K,G,T,S) logits with hidden entries at NEG, the
  whole problem's `_tile.Index`). Rows and keys the mask hides entirely are zeroed in q, k and v
  first (`_tile.sanitize`)."""
  q = call.head_major(call.query, True)
  k = call.head_major(call.key, False)
  v = call.head_major(call.value, False)
  at = _tile.Index(jnp.arange(cfg.T, dtype=jnp.int32), jnp.arange(cfg.S, dtype=jnp.int32))
  vis = _tile.visible(cfg, call.mask, at.q, at.kv, ragged_kv=False)
  if vis is not None:
    q, k, v = _tile.sanitize(vis, q, k, v)
  # G and T stay separate dimensions (fold=False): a sequence-sharded query then stays sharded
  # and only K and V are gathered (see _tile.matmul).
  s, _ = _tile.logits(cfg, q, k, call.bias, at, score_args, fold=False)
  if vis is not None:
    s = jnp.where(vis, s, jnp.asarray(_softmax.NEG, s.dtype))
  return q, v, s, at
