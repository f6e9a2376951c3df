"""The serial schedule: one tile after another, each loop over a row's (or a column's) range of
non-empty blocks, EMPTY blocks inside the range skipped by a switch. The platform default on CPU
(`jattn._chunked.plan.SCHEDULE_DEFAULTS`).

`walk_rows` is the forward's query-major walk, which `jattn.diagnostics` also runs with a tile
function of its own; `_backward_serial` walks key block after key block, each over the query
blocks that see it: dK and dV are finished per key block, dQ and dBias accumulate in place
(`_accumulate_bias`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jattn import _sharding, _tile
from jattn._chunked.blocks import (
  _hook,
  _put_kv_tile,
  _slice,
  dispatch,
  kv_tile,
  put_q_tile,
  tile_view,
)
from jattn._chunked.grads import _Backward
from jattn._chunked.plan import Operands, Plan
from jattn.masks import EMPTY, FULL, PARTIAL


def walk_rows(
  plan: Plan, ops: Operands, *, start: Callable, tile: Callable, finish: Callable, outs, name: str
):
  """The query-major walk over the block map, shared by the forward pass and the diagnostics.

  For each query block i: ``ctx, carry = start(i)``; for each non-EMPTY key block j of row i,
  ``carry = tile(ctx, view, carry)`` with the `TileView` of (i, j) (EMPTY blocks are skipped, FULL
  ones get no mask arithmetic); then ``finish(i, carry)`` gives the block's results, (B, K, G,
  bq[, X]) tiles in the structure of ``outs`` ((B, Tp, N[, X]) arrays), written there in place.
  Loops run over each row's range of non-empty blocks (constants when the block map is static).
  """
  lo, hi = plan.row_bounds(ops.states)

  def q_block(i, outs):
    ctx, carry0 = start(i)

    def visit(j, carry, masked: bool):
      carry = tile(ctx, tile_view(plan, ops, i, j, masked), carry)
      _hook(name, i, j, jnp.int8(PARTIAL if masked else FULL))
      return carry

    def body(j, carry):
      return dispatch(
        plan.kinds,
        ops.states[i, j],
        {
          EMPTY: lambda j, c: c,
          PARTIAL: functools.partial(visit, masked=True),
          FULL: functools.partial(visit, masked=False),
        },
        j,
        carry,
      )

    carry = jax.lax.fori_loop(lo(i), hi(i), body, carry0)
    bq = plan.grid.block_q
    return jax.tree.map(lambda o, t: put_q_tile(o, t, i, bq), outs, finish(i, carry))

  return jax.lax.fori_loop(0, plan.grid.num_q_blocks, q_block, outs)


def walk_rows_fixed(
  plan: Plan, ops: Operands, *, start: Callable, tile: Callable, finish: Callable, outs
):
  """`walk_rows` with loops of fixed trip count, which JAX's reverse mode differentiates: every
  query block takes as many steps as the longest row's range (steps past its own range and
  EMPTY blocks are skipped by the switch), and is rematerialised (`jax.checkpoint`), so the
  reverse pass keeps only the blocks' outputs, and one block's tiles at a time.

  ``outs`` is the whole output (as for `walk_rows`); the blocks' results are stacked and put in
  sequence order."""
  lo, hi = plan.row_bounds(ops.states)
  nq, nk = plan.grid.num_q_blocks, plan.grid.num_kv_blocks
  steps = nk if plan.q_ranges is None else max(1, max(b - a for a, b in plan.q_ranges))
  kinds = tuple(sorted({*plan.kinds, EMPTY}))
  bq = plan.grid.block_q
  outs_block = jax.tree.map(lambda x: _slice(x, 0, bq, 1), outs)

  @jax.checkpoint
  def q_block(i):
    ctx, carry0 = start(i)

    def visit(j, carry, masked: bool):
      return tile(ctx, tile_view(plan, ops, i, j, masked), carry)

    def body(step, carry):
      at = lo(i) + step
      j = jnp.minimum(at, nk - 1)
      state = jnp.where(at < hi(i), ops.states[i, j], jnp.int8(EMPTY))
      branches = {
        EMPTY: lambda j, c: c,
        PARTIAL: functools.partial(visit, masked=True),
        FULL: functools.partial(visit, masked=False),
      }
      return dispatch(kinds, state, branches, j, carry)

    tiles = finish(i, jax.lax.fori_loop(0, steps, body, carry0))
    return jax.tree.map(lambda o, t: put_q_tile(o, t, 0, bq), outs_block, tiles)

  blocks = jax.lax.map(q_block, jnp.arange(nq, dtype=jnp.int32))
  # (nq, B, bq, ...) -> (B, nq * bq, ...): block i holds rows i * bq ..
  return jax.tree.map(
    lambda b: jnp.moveaxis(b, 0, 1).reshape((b.shape[1], nq * bq) + b.shape[3:]), blocks
  )


def _backward_serial(plan: Plan, ops: Operands, bw: _Backward, tile_grads, scale, dk_scale):
  """The serial schedule's backward: key block after key block, each walking the query blocks
  that see it (loop ranges from the plan); dK and dV are finished per key block, dQ and dBias
  accumulate in place. Returns (dq, dk, dv, dbias, dargs)."""
  cfg, grid = plan.cfg, plan.grid
  q, k, v, bias = ops.q, ops.k, ops.v, ops.bias
  B, K, G, H = cfg.B, cfg.K, cfg.G, q.shape[-1]
  bq, bk = grid.block_q, grid.block_kv
  sd = _tile.stat_dtype(q.dtype)
  lo, hi = plan.column_bounds(ops.states)
  inputs = (q, k, v, bw.dout, ops.states)

  def kv_block(j, carry):
    dq, dk, dv, dbias, dargs = carry
    kb0, vb0 = kv_tile(k, j, bk), kv_tile(v, j, bk)

    def tile(i, inner, masked: bool):
      dkb, dvb, dargs = inner
      c = tile_grads(tile_view(plan, ops, i, j, masked), kb0, vb0)
      _hook("bwd", i, j, jnp.int8(PARTIAL if masked else FULL))
      return ((dkb + c.dk, dvb + c.dv, jax.tree.map(jnp.add, dargs, c.dargs)), (c.dq_t, c.dbias))

    def skip(i, inner):
      zeros = (
        jnp.zeros((B, K, H, G * bq), sd),
        None if bias is None else jnp.zeros(bw.dbias_block_shape, sd),
      )
      return inner, _sharding.varying_tree(zeros, *inputs)

    def body(i, carry):
      dkb, dvb, dq, dbias, dargs = carry
      (dkb, dvb, dargs), (dq_t, dbias_b) = dispatch(
        plan.kinds,
        ops.states[i, j],
        {
          EMPTY: skip,
          PARTIAL: functools.partial(tile, masked=True),
          FULL: functools.partial(tile, masked=False),
        },
        i,
        (dkb, dvb, dargs),
      )
      # (B, K, H, G * bq) -> (B, bq, N, H), the rows of block i.
      rows = jnp.transpose(dq_t.reshape(B, K, H, G, bq), (0, 4, 1, 3, 2)).reshape(B, bq, K * G, H)
      dq = jax.lax.dynamic_update_slice_in_dim(
        dq, _slice(dq, i * bq, bq, 1) + rows * scale, i * bq, axis=1
      )
      if dbias is not None:
        dbias = _accumulate_bias(dbias, dbias_b, i, j, plan)
      return dkb, dvb, dq, dbias, dargs

    dkb0 = jnp.zeros_like(kb0, dtype=sd)  # (B, K, bk, H), typed like the inputs (see forward)
    dvb0 = jnp.zeros_like(vb0, dtype=sd)
    dkb0, dvb0 = _sharding.varying_tree((dkb0, dvb0), *inputs)
    dkb, dvb, dq, dbias, dargs = jax.lax.fori_loop(
      lo(j), hi(j), body, (dkb0, dvb0, dq, dbias, dargs)
    )
    # Every key block is finished here, so dK and dV are written once, in their own dtype.
    dk = _put_kv_tile(dk, dkb * dk_scale, j, bk)
    dv = _put_kv_tile(dv, dvb, j, bk)
    return dq, dk, dv, dbias, dargs

  dq0 = jnp.zeros_like(q, dtype=sd)
  dk0 = jnp.zeros_like(k)
  dv0 = jnp.zeros_like(v)
  dbias0 = None if bias is None else jnp.zeros_like(bias, dtype=_tile.stat_dtype(bias.dtype))
  dargs0 = jax.tree.map(jnp.zeros_like, ops.score_args)
  dq0, dk0, dv0, dbias0 = _sharding.varying_tree((dq0, dk0, dv0, dbias0), *inputs)
  return jax.lax.fori_loop(0, grid.num_kv_blocks, kv_block, (dq0, dk0, dv0, dbias0, dargs0))


def _accumulate_bias(dbias, contrib, i, j, plan: Plan):
  """Add a tile's dBias block at its place in the (B|1,K|1,G|1,Tp|1,Sp|1) gradient."""
  start = (
    0,
    0,
    0,
    i * plan.grid.block_q if dbias.shape[3] != 1 else 0,
    j * plan.grid.block_kv if dbias.shape[4] != 1 else 0,
  )
  # Integer starts of one type (x64 makes Python ints int64 next to the int32 loop indices).
  starts = tuple(jnp.asarray(x, jnp.int32) for x in start)
  cur = jax.lax.dynamic_slice(dbias, starts, contrib.shape)
  # Under an Explicit mesh the tile's contribution is sharded like the query (batch, heads),
  # where a broadcast or replicated bias's gradient is not: give it dBias's sharding.
  contrib = _sharding.reshard_to(contrib.astype(dbias.dtype), _sharding.spec_of(dbias))
  return jax.lax.dynamic_update_slice(dbias, cur + contrib, starts)
