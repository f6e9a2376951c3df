"""The chunked kernels: the forward and backward passes.

`forward` holds one tile's online-softmax step (a query block's start, each tile, its finish:
`_steps`) and hands it to the schedule's walk (`jattn._chunked.serial.walk_rows` or
`jattn._chunked.lanes._forward_parallel`); `forward_fixed` hands the same step to a walk of
fixed trip counts that JAX's reverse mode can differentiate. `backward` gathers what every
tile's gradient reads (`jattn._chunked.grads`) and runs the schedule's backward walk from the
`Residuals`: the operands, the output and its log-sum-exp. `jattn._chunked.derivatives` makes
them one differentiable function; ring attention calls `forward` and `backward` directly, once
per key/value shard.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import _derivatives, _sharding, _softmax, _tile
from jattn._chunked.blocks import TileView, _rows, _unrows, kv_tile, q_tile
from jattn._chunked.grads import _Backward, _bias_contribution_shape, _tile_grads
from jattn._chunked.lanes import _backward_parallel, _forward_parallel
from jattn._chunked.plan import Operands, Plan
from jattn._chunked.serial import _backward_serial, walk_rows, walk_rows_fixed


def forward(plan: Plan, ops: Operands):
  """q (B,Tp,N,H), k/v (B,Sp,K,H) -> out (B,Tp,N,Hv) in ``plan.out_dtype`` (default q's
  dtype), lse (B,Tp,N); with ``plan.cfg.max_logits`` also each row's max logit over its visible
  keys (B,Tp,N) (the running max of the same walk, before the sink joins; -inf for a row that
  sees nothing)."""
  start, tile, finish = _steps(plan, ops)
  out_dtype = _out_dtype(plan, ops)
  if plan.schedule == "parallel":
    return _forward_parallel(plan, ops, start, tile, out_dtype)
  # Each query block writes its rows of the output in place: stacking per-block results (as
  # lax.map does) would need another full-size copy to put them back in sequence order.
  outs = _outputs(plan, ops, out_dtype)
  return walk_rows(plan, ops, start=start, tile=tile, finish=finish, outs=outs, name="fwd")


def forward_fixed(plan: Plan, ops: Operands):
  """`forward` with loops of fixed trip count, each query block rematerialised: what JAX's own
  reverse mode can differentiate (a loop over a data-dependent range cannot be), at
  O(T + block_q * S) memory. The derivatives of the backward pass are taken through it."""
  # (out, lse) only: the max logits have no derivatives.
  cfg = dataclasses.replace(plan.cfg, max_logits=False)
  serial = dataclasses.replace(plan, schedule="serial", cfg=cfg)
  start, tile, finish = _steps(serial, ops)
  outs = _outputs(serial, ops, _out_dtype(plan, ops))
  return walk_rows_fixed(serial, ops, start=start, tile=tile, finish=finish, outs=outs)


def _out_dtype(plan: Plan, ops: Operands):
  return ops.q.dtype if plan.out_dtype is None else plan.out_dtype


def _outputs(plan: Plan, ops: Operands, out_dtype):
  """The forward's outputs before any block is written: out (B, Tp, N, Hv) in ``out_dtype``,
  lse (B, Tp, N) (and the max logits (B, Tp, N) with ``plan.cfg.max_logits``)."""
  q, v = ops.q, ops.v
  out0 = jnp.repeat(jnp.zeros_like(q[..., :1], dtype=out_dtype), v.shape[-1], axis=-1)
  lse0 = jnp.zeros_like(q[..., 0], dtype=_tile.stat_dtype(q.dtype))
  outs = (out0, lse0, lse0) if plan.cfg.max_logits else (out0, lse0)
  return _sharding.varying_tree(outs, q, v, ops.k, ops.states)


def _steps(plan: Plan, ops: Operands):
  """The forward's online-softmax step for one tile, as the (start, tile, finish) a walk runs:
  ``start(i)`` a query block's rows and carries, ``tile(rows, view, carry)`` one key block,
  ``finish(i, carry)`` the block's output and lse (and max logits, with ``cfg.max_logits``)."""
  cfg = plan.cfg
  K, G = cfg.K, cfg.G
  bq, bk = plan.grid.block_q, plan.grid.block_kv
  q, k, v = ops.q, ops.k, ops.v
  sd = _tile.stat_dtype(q.dtype)
  inputs = (q, k, v, ops.states)

  # The scale multiplies Q once, where that rounds no coarser than the logits do, instead of
  # every (bq, bk) tile of logits (the backward recomputes the logits the same way).
  q_scaled, scaled = _tile.prescaled_query(cfg, q)

  def start(i):
    qb = q_tile(q_scaled, i, bq, K, G)
    # Carries are made from the tiles they accumulate, so they share the inputs' sharding when
    # that is part of the type (an Explicit-axis mesh): a fresh jnp.zeros would be replicated.
    # The sink is one more logit in every row, with no value: it joins once per row after the
    # walk (`finish`; parallel: after the merge), so the running max is over keys alone.
    m0, l0 = _softmax.start(jnp.zeros_like(qb[..., 0], dtype=sd))  # (B, K, G, bq)
    # (B, K, G, bq, Hv): value's head size is its own.
    acc0 = jnp.repeat(jnp.zeros_like(qb[..., :1], dtype=sd), v.shape[-1], axis=-1)
    # The tile math and its carries are in rows layout, the G query heads of a group stacked as
    # rows: a separate (often size-1) G axis makes XLA's CPU backend copy every (bq, bk) tile of
    # logits to a new layout before its row max, and the carries on every step.
    carry0 = tuple(_rows(x) for x in (m0, l0, acc0))
    return _rows(qb), _sharding.varying_tree(carry0, *inputs)

  def tile(qb, view: TileView, carry):
    m, l, acc = carry
    kb, vb = kv_tile(k, view.j, bk), kv_tile(v, view.j, bk)
    vis = None if view.vis is None else _tile.as_rows(view.vis, G, bq)
    qt = qb
    if vis is not None:
      qt, kb, vb = _tile.sanitize(vis, qb, kb, vb)
    s, _ = _tile.logits(cfg, qt, kb, view.bias, view.idx, ops.score_args, scaled=scaled)
    if vis is not None:
      s = jnp.where(vis, s, jnp.asarray(_tile.NEG, sd))
    m_new, p, corr, l = _softmax.update(m, l, s)
    if cfg.dropout_rate > 0:
      keep = _tile.as_rows(_tile.keep(cfg, ops.seed, view.idx), G, bq)
      p = jnp.where(keep, p, jnp.zeros((), sd))
    acc = acc * corr[..., None] + _tile.pv(p, vb)
    return m_new, l, acc

  def finish(i, carry):
    m, l, acc = (_unrows(x, G) for x in carry)
    mx = _softmax.row_max(m, l) if cfg.max_logits else None
    if ops.sink is not None:
      m, l, acc = _softmax.join_sink(m, l, acc, ops.sink.astype(sd))
    done = (_softmax.normalize(acc, l, m, cfg.dropout_rate), _softmax.lse(m, l))
    return done if mx is None else (*done, mx)

  return start, tile, finish


class Residuals(NamedTuple):
  """What the backward pass keeps from the forward: the operands, the output and its lse."""

  ops: Operands
  out: Any  # (B, Tp, N, Hv)
  lse: Any  # (B, Tp, N)


def backward(plan: Plan, res: Residuals, dout, dlse=None) -> Operands:
  """Cotangents of every operand (an `Operands`: dq, dk, dv, dbias, the score_mod arrays' and the
  sinks' gradients; zeros for the integer and mask operands), in the layout of `forward`, from
  the output's cotangent ``dout`` and (optionally) the log-sum-exp's ``dlse`` (B, Tp, N)."""
  ops = res.ops
  cfg, grid = plan.cfg, plan.grid
  q, bias = ops.q, ops.bias
  sd = _tile.stat_dtype(q.dtype)
  # rowsum(dO * O) = rowsum(P * dP): the softmax Jacobian's correction term, one per query.
  delta = _softmax.output_delta(dout, res.out)
  if dlse is not None:
    # d lse / d s = P: a cotangent g of the lse adds g * P to dS = P * (dP - delta), the same
    # as lowering delta by g (and the sink's gradient follows from delta alike). Used where the
    # lse is merged with other parts (key/value shards on several devices).
    delta = delta - dlse.astype(delta.dtype)
  # The logit scale is applied to each finished dQ block, not to every (tq, tk) tile; as in the
  # forward (and with the same rounding) it multiplies Q where that rounds no coarser than the
  # logits, and then dK = dS^T (scale Q) carries it already; else each finished dK block too.
  scale = jnp.asarray(cfg.scale, sd)
  q_in, scaled = _tile.prescaled_query(cfg, q)
  dk_scale = jnp.ones((), sd) if scaled else scale
  # The (B, Tp, N, H) dQ and a full-size dBias stay outside the switch: a conditional that
  # threads a large array through its branches can copy it on every tile. The branches return
  # a tile's block contributions instead, added in place after the switch.
  bw = _Backward(
    q_in,
    scaled,
    dout,
    _softmax.lse_for_recompute(res.lse),
    delta,
    1.0 / (1.0 - cfg.dropout_rate) if cfg.dropout_rate > 0 else None,
    None
    if bias is None
    else _bias_contribution_shape(bias.shape, cfg.B, cfg.K, cfg.G, grid.block_q, grid.block_kv),
  )
  tile_grads = functools.partial(_tile_grads, plan, ops, bw)
  if plan.schedule == "parallel":
    dq, dk, dv, dbias, dargs = _backward_parallel(plan, ops, tile_grads, scale, dk_scale)
  else:
    dq, dk, dv, dbias, dargs = _backward_serial(plan, ops, bw, tile_grads, scale, dk_scale)
  dsink = None
  if ops.sink is not None:
    dsink = _softmax.sink_gradient(ops.sink, res.lse, delta)
  zeros = lambda tree: jax.tree.map(_derivatives.zero_cotangent, tree)
  return Operands(
    q=dq.astype(q.dtype),
    k=dk,
    v=dv,
    bias=None if dbias is None else dbias.astype(bias.dtype),
    mask=zeros(ops.mask),
    states=zeros(ops.states),
    seed=zeros(ops.seed),
    score_args=dargs,
    sink=dsink,
    positions=zeros(ops.positions),
  )
