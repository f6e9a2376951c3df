"""Forward mode of the chunked kernels: the tangents of the output and of its log-sum-exp in one
walk over the blocks, O(T + S) memory, from the forward's saved output and log-sum-exp.

With a row's final log-sum-exp the probabilities are exact, P = exp(s - lse) (the backward's
recompute), so the tangent needs no running max. For row i, with s' the tangent of a logit
(through scale, soft cap, bias and score_mod: `jax.jvp` of the tile's own logits) and D the
dropout keep mask over 1 - rate:

  lse'_i = sum_j P_ij s'_ij  (+ P_sink sink': the sink is one more logit, with no value)
  out'_i = sum_j P_ij D_ij (s'_ij v_j + v'_j) - lse'_i out_i

since dP_ij = P_ij (s'_ij - lse'_i). Each tile adds its share to two row sums; like the
forward, a walk over the non-empty blocks only (`jattn._chunked.serial.walk_rows`), whatever
the schedule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _sharding, _softmax, _tile
from jattn._chunked.blocks import (
  TileView,
  _bias_block,
  _row_tile,
  _rows,
  _unrows,
  kv_tile,
  q_tile,
)
from jattn._chunked.plan import Operands, Plan
from jattn._chunked.serial import walk_rows, walk_rows_fixed


def tangent(plan: Plan, ops: Operands, out, lse, dot: Operands, fixed: bool = False):
  """(out', lse'): the tangents of `jattn._chunked.kernel.forward`'s (out, lse) at ``ops`` in
  the direction ``dot`` (tangents of q, k, v, bias, sink and score_args; the other fields are
  ignored). out (B, Tp, N, Hv), lse (B, Tp, N) as the forward returned them. ``fixed``: walk
  with fixed trip counts (`walk_rows_fixed`), so that JAX's reverse mode can differentiate it."""
  cfg = plan.cfg
  K, G = cfg.K, cfg.G
  bq, bk = plan.grid.block_q, plan.grid.block_kv
  q, k, v = ops.q, ops.k, ops.v
  sd = _tile.stat_dtype(q.dtype)
  (q_in, dq_in), scaled = _scaled_query(cfg, q, dot.q)
  lse_r = _softmax.lse_for_recompute(lse)
  inputs = (q, k, v, ops.states)

  def start(i):
    lse_b = _row_tile(lse_r, i, bq, K, G)  # (B, K, G, bq)
    dlse0 = jnp.zeros_like(lse_b)
    if ops.sink is not None:
      sink = ops.sink.astype(sd)  # (1, K, G, 1)
      dlse0 = jnp.exp(sink - lse_b) * dot.sink.astype(sd)
    acc0 = jnp.repeat(jnp.zeros_like(lse_b[..., None]), v.shape[-1], axis=-1)
    ctx = tuple(_rows(q_tile(x, i, bq, K, G)) for x in (q_in, dq_in)) + (_rows(lse_b),)
    return ctx, _sharding.varying_tree((_rows(dlse0), _rows(acc0)), *inputs)

  def tile(ctx, view: TileView, carry):
    qb, dqb, lse_b = ctx
    dlse, acc = carry
    vis = None if view.vis is None else _tile.as_rows(view.vis, G, bq)

    def scores(qb, kb, vb, bias, args):
      if vis is not None:
        qb, kb, vb = _tile.sanitize(vis, qb, kb, vb)
      s, _ = _tile.logits(cfg, qb, kb, bias, view.idx, args, scaled=scaled)
      if vis is not None:
        s = jnp.where(vis, s, jnp.asarray(_tile.NEG, sd))
      return s, vb

    tiles = lambda x: (kv_tile(x[0], view.j, bk), kv_tile(x[1], view.j, bk))
    dbias = _bias_block(dot.bias, view.i, view.j, plan)
    (s, vb), (ds, dvb) = jax.jvp(
      scores,
      (qb, *tiles((k, v)), view.bias, ops.score_args),
      (dqb, *tiles((dot.k, dot.v)), dbias, _tangents_of(ops.score_args, dot.score_args)),
    )
    p = _softmax.probabilities(s, lse_b[..., None])
    dlse = dlse + (p * ds).sum(axis=-1)
    if cfg.dropout_rate > 0:
      keep = _tile.as_rows(_tile.keep(cfg, ops.seed, view.idx), G, bq)
      p = jnp.where(keep, p, jnp.zeros((), sd))
    acc = acc + _tile.pv(p * ds, vb) + _tile.pv(p, dvb)
    return dlse, acc

  def finish(i, carry):
    dlse, acc = (_unrows(x, G) for x in carry)
    if cfg.dropout_rate > 0:
      acc = acc * jnp.asarray(1.0 / (1.0 - cfg.dropout_rate), sd)
    ob = q_tile(out, i, bq, K, G).astype(sd)
    return acc - dlse[..., None] * ob, dlse

  outs0 = _sharding.varying_tree((jnp.zeros_like(out), jnp.zeros_like(lse)), *inputs)
  if fixed:
    return walk_rows_fixed(plan, ops, start=start, tile=tile, finish=finish, outs=outs0)
  return walk_rows(plan, ops, start=start, tile=tile, finish=finish, outs=outs0, name="jvp")


def _scaled_query(cfg: _tile.Config, q, dq):
  """((q_in, dq_in), scaled): the query as the forward's tiles take it and its tangent."""
  scaled = _tile.query_takes_scale(cfg, q.dtype)
  if not scaled:
    return (q, dq), False
  scale = jnp.asarray(cfg.scale, q.dtype)
  return (q * scale, dq.astype(q.dtype) * scale), True


def _tangents_of(args, dargs):
  """score_mod's arrays' tangents, float0 for integer arrays (what jax.jvp takes)."""
  return jax.tree.map(
    lambda a, d: (
      d if jnp.issubdtype(a.dtype, jnp.inexact) else np.zeros(a.shape, jax.dtypes.float0)
    ),
    args,
    dargs,
  )
