"""One tile's gradients: the backward's math, the same whichever schedule walks the tiles.

`_tile_grads` recomputes P = exp(S - lse) from the saved log-sum-exp and returns the tile's
contributions to dK, dV, dQ^T, dBias and score_mod's arrays' gradient (a `_TileGrads`);
`_Backward` is what every tile reads besides the operands. The tile's scores are key-major,
(B, K, bk, G, bq), so that every matmul of the backward has the standard form (`_rows_matmul`);
a dBias block is dS summed over the bias's broadcast dimensions (`_bias_contribution`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import _softmax, _tile
from jattn._chunked.blocks import TileView, _key_major, _query_major, _row_tile, q_tile
from jattn._chunked.plan import Operands, Plan


class _Backward(NamedTuple):
  """What every tile of the backward pass reads besides the operands."""

  q_in: Any  # the query, scaled where `_tile.prescaled_query` folds the logit scale into it
  scaled: bool
  dout: Any  # (B, Tp, N, Hv)
  lse_r: Any  # (B, Tp, N): the lse that P is recomputed with (+inf for empty rows)
  delta: Any  # (B, Tp, N): rowsum(dO * O), less the lse's cotangent
  keep_scale: float | None  # dropout's 1 / (1 - rate)
  dbias_block_shape: tuple | None  # one tile's dBias block (see `_bias_contribution_shape`)


def _tile_grads(plan: Plan, ops: Operands, bw: _Backward, view: TileView, kb, vb):
  """One tile's contributions to dK, dV (B, K, bk, H), dQ^T (B, K, H, G * bq), dBias and the
  score_mod arrays' gradient (a `_TileGrads`), from P recomputed with the saved log-sum-exp."""
  cfg = plan.cfg
  B, K, G, H = cfg.B, cfg.K, cfg.G, ops.q.shape[-1]
  Hv = ops.v.shape[-1]
  bq, bk = plan.grid.block_q, plan.grid.block_kv
  sd = _tile.stat_dtype(ops.q.dtype)
  i = view.i
  qb = q_tile(bw.q_in, i, bq, K, G)
  dob = q_tile(bw.dout, i, bq, K, G)
  # Per-query statistics broadcast along the key axis of the (B, K, bk, G, bq) tiles.
  lse_b = _row_tile(bw.lse_r, i, bq, K, G)[:, :, None]
  delta_b = _row_tile(bw.delta, i, bq, K, G)[:, :, None]
  vis = view.vis
  if vis is not None:
    qb, kb, vb = _tile.sanitize(vis, qb, kb, vb)
    vis = _key_major(vis)
  q2 = qb.reshape(B, K, G * bq, H)  # the G heads of a group stacked as rows
  do2 = dob.reshape(B, K, G * bq, Hv)
  s = _kv_rows_matmul(kb, q2, sd).reshape(B, K, bk, G, bq)
  s, t = _tile.scale_cap_bias(
    cfg, s, None if view.bias is None else _key_major(view.bias), bw.scaled
  )
  if cfg.score_mod is not None:
    # score_mod sees the tile in its documented (B, N, tq, tk) layout.
    s, mod_vjp = jax.vjp(
      lambda s_, a_: _key_major(_tile.apply_score_mod(cfg, _query_major(s_), view.idx, a_)),
      s,
      ops.score_args,
    )
  if vis is not None:
    s = jnp.where(vis, s, jnp.asarray(_tile.NEG, sd))
  p = _softmax.probabilities(s, lse_b)
  dp = _kv_rows_matmul(vb, do2, sd).reshape(B, K, bk, G, bq)
  pd = p
  if cfg.dropout_rate > 0:
    kept = _key_major(_tile.keep(cfg, ops.seed, view.idx))
    pd = jnp.where(kept, p, jnp.zeros((), sd)) * jnp.asarray(bw.keep_scale, sd)
    dp = jnp.where(kept, dp, jnp.zeros((), sd)) * jnp.asarray(bw.keep_scale, sd)
  dvb = _rows_matmul(pd.astype(dob.dtype).reshape(B, K, bk, G * bq), do2, sd)
  # d loss / d (post-bias, post-score_mod) logits; 0 where p is (dp is finite: sanitized).
  ds = p * (dp - delta_b)
  dargs_b = jax.tree.map(jnp.zeros_like, ops.score_args)
  if cfg.score_mod is not None:
    ds, dargs_b = mod_vjp(ds)
  dbias_b = None if ops.bias is None else _bias_contribution(_query_major(ds), bw.dbias_block_shape)
  if t is not None:
    ds = ds * (1.0 - t * t)
  dsc = ds.astype(ops.q.dtype).reshape(B, K, bk, G * bq)
  dkb = _rows_matmul(dsc, q2, sd)
  # dQ^T = K^T dS^T: with K^T as the left operand both matmuls run in standard form.
  dq_t = _rows_matmul(jnp.swapaxes(kb, 2, 3), dsc, sd)  # (B, K, H, G * bq)
  return _TileGrads(dkb, dvb, dq_t, dbias_b, dargs_b)


class _TileGrads(NamedTuple):
  dk: Any  # (B, K, bk, H)
  dv: Any  # (B, K, bk, Hv)
  dq_t: Any  # (B, K, H, G * bq): dQ^T of the tile's query block (unscaled)
  dbias: Any  # the tile's dBias block, or None
  dargs: Any  # score_mod arrays' gradient (a tuple)


def _kv_rows_matmul(x, rows, out_dtype):
  """(B,K,tk,H) x (B,K,t,H) -> (B,K,tk,t): key-major scores (rows of q or dO as columns)."""
  return jnp.einsum("bksh,bkth->bkst", x, rows, preferred_element_type=out_dtype)


def _rows_matmul(a, b, out_dtype):
  """(B,K,m,t) x (B,K,t,n) -> (B,K,m,n), a plain matmul per (batch, kv head).

  The backward keeps its (tk, tq) tiles key-major so that dV = P^T dO, dK = dS^T Q and
  dQ^T = K^T dS^T all have this standard form: XLA's CPU backend runs a matmul whose left
  operand is contracted over its rows (P^T dO from a query-major P) about 40% slower.
  """
  return jnp.einsum("bkmt,bktn->bkmn", a, b, preferred_element_type=out_dtype)


def _bias_contribution_shape(bias_shape, B, K, G, bq, bk):
  """Shape of one tile's dBias block: the tile's (B, K, G, bq, bk), 1 where the bias broadcasts."""
  tile = (B, K, G, bq, bk)
  return tuple(1 if bias_shape[a] == 1 else tile[a] for a in range(5))


def _bias_contribution(ds, shape):
  """A tile's dS summed over the bias's broadcast dimensions."""
  axes = tuple(a for a in range(5) if shape[a] == 1 and ds.shape[a] != 1)
  return ds.sum(axis=axes, keepdims=True) if axes else ds
