"""The parallel schedule: lanes of blocks side by side, each step computing every lane's next
tile at once (vmapped over lanes). The platform default off CPU (`jattn._chunked.plan.SCHEDULE_DEFAULTS`).

`jattn._chunked.plan` cuts the block map's non-empty blocks into lanes (static ones from the plan, or
run-time ones from a traced block map: `_lanes`, `_LaneTables`). Here they run ``plan.width`` at
a time (`_in_groups`, `_lane_steps`), and the parts a lane leaves are merged into their rows in
lane order (`jattn._chunked.plan.MergeOrder`), so results do not depend on the grouping.
The forward (`_forward_parallel`) runs query blocks' parts side by side and merges them through
their running max and sum; the backward (`_backward_parallel`) runs two passes that each
recompute P: dK and dV with key blocks as lanes (`_backward_kv_pass`), dQ with query blocks as
lanes (`_backward_q_pass`), dBias summed where each block has one writer (`_bias_sums`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import _sharding, _softmax, _tile
from jattn._chunked import plan as _plan
from jattn._chunked.blocks import _hook, _unrows, kv_tile, q_tile, tile_view
from jattn._chunked.grads import _bias_contribution_shape
from jattn._chunked.plan import Operands, Plan
from jattn.masks import EMPTY, PARTIAL


def _lanes(plan: Plan, packed, states, per_row: int = 1) -> _Schedule:
  """The `_Schedule` of one pass: static lanes from the plan (``packed``), or run-time ones from
  the block map ``states`` (``per_row`` lanes per row), run ``plan.width`` at a time."""
  if packed is not None:
    ln = _plan.lanes_of(packed)
    masked = PARTIAL in plan.kinds or bool((ln.kinds == EMPTY).any())
    tables = _LaneTables(ln, ln.segmented, _plan.merge_order(ln))
    return _Schedule(tables, ln.columns.shape[1], masked, plan.width)
  ln, steps = _plan.run_time_lanes(states, per_row)
  return _Schedule(_LaneTables(ln, False, _plan.merge_order(ln, per_row)), steps, True, plan.width)


class _LaneTables(NamedTuple):
  lanes: _plan.Lanes  # as jax arrays, or NumPy ones (static)
  segmented: bool  # some lane runs several parts: reset and write out its carry mid-loop
  order: _plan.MergeOrder  # which parts wait for their group's end, and the merges' rounds


class _Schedule(NamedTuple):
  """One pass's lanes and how they run: a pass makes it once (`_lanes`) and hands it whole to
  `_lane_steps`."""

  tables: _LaneTables
  steps: Any  # steps every lane takes: an int for static lanes, traced for run-time ones
  masked: bool  # some tile needs mask arithmetic
  width: int | None  # lanes run at a time (`_in_groups`); None: all at once


class _Lane(NamedTuple):
  """What each of V lanes does at every step (see `_lane_steps`): ``visit(i, j, live, masked,
  const, carry) -> (carry, outs)`` on its next block, its carry's start ``carry0`` and its
  ``const`` data that does not change: pytrees of (V, ...) arrays, a row per lane (``const``
  None when the lanes are segmented)."""

  visit: Callable
  carry0: Any
  const: Any


def _in_groups(tables: _LaneTables, width, per_lane, shared, run):
  """Run the lanes ``width`` at a time (all at once when width is None or >= their number).

  ``per_lane`` is a pytree of (V, ...) arrays (constants, initial carries); ``run(group_tables,
  group_per_lane, shared) -> shared`` runs one group with its (W, L) step tables (rows,
  columns, kinds, starts, emit, hold) and (W,) final rows; everything a group leaves (its parts
  merged into their rows, sums) is in ``shared``, so nothing grows with the number of lanes.
  Lanes added to fill the last group repeat the last lane with every step EMPTY and merge no
  part. Callers mask every step when `_pads` says padding lanes exist."""
  ln = tables.lanes
  step_tables = [
    jnp.asarray(x)
    for x in (ln.rows, ln.columns, ln.kinds, ln.starts, ln.emit, tables.order.hold, ln.final)
  ]
  V = step_tables[0].shape[0]
  W = V if width is None else max(1, min(int(width), V))
  groups = -(-V // W)
  pad = groups * W - V
  if pad:
    none = jnp.iinfo(jnp.int32).max  # a row past every accumulator: dropped
    fills = (None, None, EMPTY, None, none, False, none)  # None: repeat the last lane's entry
    grow = lambda x, fill=None: jnp.concatenate(
      [
        x,
        jnp.repeat(x[-1:], pad, axis=0)
        if fill is None
        else jnp.full((pad,) + x.shape[1:], fill, x.dtype),
      ]
    )
    step_tables = [grow(x, f) for x, f in zip(step_tables, fills)]
    per_lane = jax.tree.map(grow, per_lane)
  if groups == 1:
    return run(step_tables, per_lane, shared)

  def group(g, shared):
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, g * W, W, axis=0)
    return run([take(x) for x in step_tables], jax.tree.map(take, per_lane), shared)

  return jax.lax.fori_loop(0, groups, group, shared)


def _pads(n_lanes: int, width) -> bool:
  """Whether `_in_groups` adds padding lanes (the last group of ``width`` is not full)."""
  return width is not None and int(width) < n_lanes and n_lanes % int(width) != 0


def _lane_steps(
  schedule: _Schedule,
  lane: _Lane,
  rows0,
  fold,
  name=None,
  shared=None,
  gather=None,
  transposed=False,
):
  """Run the schedule's steps; in each, every lane of a group (see `_in_groups`) visits its next
  block (vmapped over lanes): ``lane.visit(i, j, live, masked, lane_const, lane_carry) ->
  (lane_carry, outs)``, i the step's row, j its block, ``lane.const`` per-lane data that does not
  change (None when lanes are segmented: a lane's row changes between parts, so visit loads what
  it needs).

  A lane's carry restarts from its ``lane.carry0`` where a part starts; finished parts are merged
  into their rows of the accumulator that starts as ``rows0`` by ``fold(rows, at, parts) ->
  rows``, ``at`` (W,) their rows without repeats (R or more: none), in the order of
  `jattn._chunked.plan.MergeOrder`: a row's parts in lane order. ``gather(shared, outs, rows_t,
  columns_t, kinds_t) -> shared`` folds each step's other results into ``shared``. Returns
  (rows, shared). ``transposed``: rows are key blocks (the dK/dV pass), for the block hook."""
  tables, steps, masked, width = schedule
  visit = lane.visit
  ln, segmented, order = tables
  masked = masked or _pads(ln.rows.shape[0], width)
  R = jax.tree.leaves(rows0)[0].shape[0]

  def merge(acc, at, parts, rounds):
    for distinct in _softmax.distinct_rounds(at, R, rounds):
      acc = fold(acc, distinct, parts)
    return acc

  def run(step_tables, per_lane, state):
    rows, columns, kinds, starts, emit, hold, final = step_tables
    const_g, init_g = per_lane
    W = rows.shape[0]

    def step(t, c):
      carry, acc, held, shared = c
      at = lambda x: jnp.take(x, t, axis=1)
      rows_t, columns_t, kinds_t = at(rows), at(columns), at(kinds)
      if segmented:
        restart = at(starts)
        carry = jax.tree.map(
          lambda x, x0: jnp.where(restart.reshape((-1,) + (1,) * (x.ndim - 1)), x0, x),
          carry,
          init_g,
        )
      live = kinds_t != EMPTY
      fn = lambda i, j, lv, k, c: visit(i, j, lv if masked else None, masked, k, c)
      if transposed:
        _hook(name, columns_t, rows_t, kinds_t)
      else:
        _hook(name, rows_t, columns_t, kinds_t)
      carry, outs = jax.vmap(fn)(rows_t, columns_t, live, const_g, carry)
      if gather is not None:
        shared = gather(shared, outs, rows_t, columns_t, kinds_t)
      if segmented:  # a row's only part goes in now; a continued row's waits (see MergeOrder)
        emit_t, hold_t = at(emit), at(hold)
        acc = merge(acc, jnp.where(hold_t, R, emit_t), carry, 1)
        held_rows, held_parts = held
        held = (
          jnp.where(hold_t, emit_t, held_rows),
          jax.tree.map(
            lambda x, p: jnp.where(hold_t.reshape((W,) + (1,) * (x.ndim - 1)), x, p),
            carry,
            held_parts,
          ),
        )
      return carry, acc, held, shared

    acc, shared = state
    # Only segmented lanes hold parts: elsewhere nothing rides along the loop.
    held0 = (jnp.full((W,), R, jnp.int32), init_g) if segmented else None
    carry, acc, held, shared = jax.lax.fori_loop(0, steps, step, (init_g, acc, held0, shared))
    if not segmented:
      return merge(acc, final, carry, order.rounds), shared
    held_rows, held_parts = held
    # Each lane's held part, then its last part: lane order, interleaved.
    at = jnp.stack([held_rows, final.astype(jnp.int32)], axis=1).reshape(2 * W)
    parts = jax.tree.map(
      lambda h, c: jnp.stack([h, c], axis=1).reshape((2 * W,) + c.shape[1:]), held_parts, carry
    )
    return merge(acc, at, parts, order.rounds), shared

  return _in_groups(tables, width, (lane.const, lane.carry0), (rows0, shared), run)


def _forward_parallel(plan: Plan, ops: Operands, start, tile, out_dtype):
  """Every lane's next key/value block in one step (see `jattn._chunked.plan.lanes`); the parts of a
  row are merged through their running max and sum, then the sink joins once. Returns (out
  in ``out_dtype``, lse), and the rows' max logits (their max before the sink joins) with
  ``cfg.max_logits``."""
  cfg = plan.cfg
  sd = _tile.stat_dtype(ops.q.dtype)
  schedule = _lanes(plan, plan.row_lanes, ops.states, plan.row_split)
  qbs, carry0 = jax.vmap(start)(jnp.asarray(schedule.tables.lanes.rows)[:, 0])

  def visit(i, j, live, masked, qb, carry):
    if qb is None:  # segmented lanes: the step's own row
      qb = start(i)[0]
    return tile(qb, tile_view(plan, ops, i, j, masked, live), carry), None

  # The rows' statistics, in rows layout (R, B, K, G * bq[, H]): a row's parts merged in lane
  # order once every lane has run.
  m0, l0, acc0 = carry0
  R = plan.grid.num_q_blocks
  rows0 = (_softmax.no_rows(m0, R, _tile.NEG), _softmax.no_rows(l0, R), _softmax.no_rows(acc0, R))
  lane = _Lane(visit, carry0, None if schedule.tables.segmented else qbs)
  rows, _ = _lane_steps(schedule, lane, rows0, _softmax.merge_into, name="fwd")
  # (R, B, K, G * bq[, H]) -> (R, B, K, G, bq[, H]).
  m_r, l_r, acc_r = (_unrows(x, cfg.G, lead=1) for x in rows)
  mx = _softmax.row_max(m_r, l_r) if cfg.max_logits else None
  if ops.sink is not None:
    m_r, l_r, acc_r = _softmax.join_sink(m_r, l_r, acc_r, ops.sink.astype(sd)[None])
  out = _softmax.normalize(acc_r, l_r, m_r, cfg.dropout_rate).astype(out_dtype)
  lse = _softmax.lse(m_r, l_r)
  # (nq, B, K, G, bq[, H]) -> (B, Tp, N[, H]): query block i holds rows i * bq ..
  R, B = out.shape[:2]
  out = _sharding.sharded_reshape(
    jnp.transpose(out, (1, 0, 4, 2, 3, 5)), (B, R * plan.grid.block_q, cfg.N, -1)
  )
  rows_of = lambda x: _sharding.sharded_reshape(
    jnp.transpose(x, (1, 0, 4, 2, 3)), (B, R * plan.grid.block_q, cfg.N)
  )
  return (out, rows_of(lse)) if mx is None else (out, rows_of(lse), rows_of(mx))


def _bias_sums(plan: Plan, bias, sd):
  """Where the parallel backward sums dBias, in blocks (nq|1, nk|1, B|1, K|1, G|1, bq|1, bk|1),
  so that each block has one writer per step: a bias with both sequence axes is scattered tile by
  tile (the live lanes of a step hold distinct tiles); one broadcast along the queries sums like
  dK, per key block, in the dK/dV lanes' carry; one broadcast along the keys like dQ, per query
  block (a scatter would repeat indices: atomics on a GPU). Returns (per_key, per_query, the
  block's sharding, zeros for V lanes' sums, the scattered blocks' zeros or None)."""
  if bias is None:
    return False, False, None, None, None
  cfg, grid = plan.cfg, plan.grid
  tq, tk = bias.shape[3] != 1, bias.shape[4] != 1
  # Under an Explicit mesh: sharded as the bias is along (B, K, G); each step's lane blocks,
  # computed sharded like the query, are given that sharding before they are added.
  bias_bkg = (tuple(_sharding.spec_of(bias) or ()) + (None,) * 3)[:3]
  block_spec = jax.sharding.PartitionSpec(*bias_bkg, None, None)
  lane_spec = jax.sharding.PartitionSpec(None, *block_spec)
  block = _bias_contribution_shape(bias.shape, cfg.B, cfg.K, cfg.G, grid.block_q, grid.block_kv)
  lane_zeros = lambda V: _sharding.reshard_to(jnp.zeros((V,) + block, sd), lane_spec)
  blocked0 = None
  if tq and tk:
    blocked0 = _sharding.reshard_to(
      jnp.zeros((grid.num_q_blocks, grid.num_kv_blocks) + block, sd),
      jax.sharding.PartitionSpec(None, *lane_spec),
    )
  return not tq, tq and not tk, block_spec, lane_zeros, blocked0


def _backward_parallel(plan: Plan, ops: Operands, tile_grads, scale, dk_scale):
  """The parallel schedule's backward in two passes that each recompute P (as FlashAttention-2
  and Pallas TPU flash attention do): dK, dV (and dBias, score_mod's arrays) with key blocks side
  by side, each walking its query blocks; dQ with query blocks side by side, each walking its
  key blocks. Lanes of one block are summed at the end."""
  cfg, grid = plan.cfg, plan.grid
  q, k, v, bias = ops.q, ops.k, ops.v, ops.bias
  B, K, G, H = cfg.B, cfg.K, cfg.G, q.shape[-1]
  bq, bk = grid.block_q, grid.block_kv
  nq, nk = grid.num_q_blocks, grid.num_kv_blocks
  sums = _bias_sums(plan, bias, _tile.stat_dtype(q.dtype))
  dk_r, dv_r, blocked, dargs = _backward_kv_pass(plan, ops, tile_grads, sums)
  # (nk, B, K, bk, H) -> (B, Sp, K, H)
  to_seq = lambda x: _sharding.sharded_reshape(
    jnp.transpose(x, (1, 0, 3, 2, 4)), (B, nk * bk, K, x.shape[-1])
  )
  dk = to_seq(dk_r * dk_scale).astype(k.dtype)
  dv = to_seq(dv_r).astype(v.dtype)
  dq, dbias_q = _backward_q_pass(plan, ops, tile_grads, sums)
  if dbias_q is not None:
    blocked = dbias_q
  dbias = None
  if blocked is not None:
    dbias = _sharding.sharded_reshape(jnp.transpose(blocked, (2, 3, 4, 0, 5, 1, 6)), bias.shape)
  # Cast before the transpose: the sequence-major copy is then in q's dtype, not float32.
  dq = (dq * scale).astype(q.dtype)
  dq = _sharding.sharded_reshape(dq, (nq, B, K, H, G, bq))  # (nq, B, K, H, G * bq) split
  dq = _sharding.sharded_reshape(jnp.transpose(dq, (1, 0, 5, 2, 4, 3)), (B, nq * bq, K * G, H))
  return dq, dk, dv, dbias, dargs


def _backward_kv_pass(plan: Plan, ops: Operands, tile_grads, sums):
  """dK, dV (nk, B, K, bk, H) in float32, with key blocks side by side as lanes (the transposed
  map), each walking its query blocks; also dBias in blocks where each (i, j) tile or each key
  block has one writer (see `_bias_sums`), and score_mod's arrays' gradients."""
  grid, k, v, bias = plan.grid, ops.k, ops.v, ops.bias
  bk, nq, nk = grid.block_kv, grid.num_q_blocks, grid.num_kv_blocks
  sd = _tile.stat_dtype(ops.q.dtype)
  per_key, _, block_spec, lane_zeros, blocked0 = sums
  schedule = _lanes(plan, plan.column_lanes, ops.states.T)
  kv_rows = jnp.asarray(schedule.tables.lanes.rows)[:, 0]
  kbs = jax.vmap(lambda j: kv_tile(k, j, bk))(kv_rows)
  vbs = jax.vmap(lambda j: kv_tile(v, j, bk))(kv_rows)
  tk = bias is not None and bias.shape[4] != 1

  def kv_visit(j, i, live, masked, kvb, carry):
    kb, vb = (kv_tile(k, j, bk), kv_tile(v, j, bk)) if kvb is None else kvb
    c = tile_grads(tile_view(plan, ops, i, j, masked, live), kb, vb)
    sums: tuple[jax.Array, ...] = (carry[0] + c.dk, carry[1] + c.dv)
    if per_key:
      sums += (carry[2] + _sharding.reshard_to(c.dbias.astype(sd), block_spec),)
    return sums, (c.dbias, c.dargs)

  def gather(shared, outs, j_vec, i_vec, kinds):
    blocked, dargs = shared
    dbias_c, dargs_c = outs
    if blocked is not None:
      # Steps that compute nothing (padding) write past the blocks, each at its own place.
      lane = jnp.arange(i_vec.shape[0], dtype=jnp.int32)
      i_vec = jnp.where(kinds != EMPTY, i_vec, nq + lane)
      dbias_c = _sharding.reshard_to(
        dbias_c.astype(sd), jax.sharding.PartitionSpec(None, *block_spec)
      )
      blocked = blocked.at[i_vec, j_vec].add(dbias_c, mode="drop", unique_indices=True)
    return blocked, jax.tree.map(lambda a, b: a + b.sum(axis=0), dargs, dargs_c)

  carry0: tuple[jax.Array, ...] = (jnp.zeros_like(kbs, dtype=sd), jnp.zeros_like(vbs, dtype=sd))
  if per_key:
    carry0 += (lane_zeros(kbs.shape[0]),)
  kv_sums, (blocked, dargs) = _lane_steps(
    schedule,
    _Lane(kv_visit, carry0, None if schedule.tables.segmented else (kbs, vbs)),
    tuple(_softmax.no_rows(x, nk) for x in carry0),
    _softmax.add_into,
    name="bwd",
    shared=(blocked0, jax.tree.map(jnp.zeros_like, ops.score_args)),
    gather=gather,
    transposed=True,
  )
  if per_key:  # (nk, ...) -> (1, nk|1, ...)
    blocked = (kv_sums[2] if tk else kv_sums[2].sum(axis=0, keepdims=True))[None]
  return kv_sums[0], kv_sums[1], blocked, dargs


def _backward_q_pass(plan: Plan, ops: Operands, tile_grads, sums):
  """dQ (nq, B, K, H, G * bq) in float32 with query blocks side by side as lanes, as in the
  forward pass; and dBias in blocks (nq, 1, ...) when the bias is broadcast over keys (one
  writer per query block), else None."""
  cfg, grid, q, k, v = plan.cfg, plan.grid, ops.q, ops.k, ops.v
  K, G, H = cfg.K, cfg.G, q.shape[-1]
  bq, bk, nq = grid.block_q, grid.block_kv, grid.num_q_blocks
  sd = _tile.stat_dtype(q.dtype)
  _, per_query, block_spec, lane_zeros, _ = sums
  schedule = _lanes(plan, plan.row_lanes, ops.states, plan.row_split)
  q_rows = jnp.asarray(schedule.tables.lanes.rows)[:, 0]

  def visit(i, j, live, masked, const, carry):
    c = tile_grads(tile_view(plan, ops, i, j, masked, live), kv_tile(k, j, bk), kv_tile(v, j, bk))
    if per_query:
      return (
        carry[0] + c.dq_t,
        carry[1] + _sharding.reshard_to(c.dbias.astype(sd), block_spec),
      ), None
    return (carry[0] + c.dq_t,), None

  # (V, B, K, H, G * bq) zeros typed like the query tiles they sum (see forward).
  qbs = jax.vmap(lambda i: q_tile(q, i, bq, K, G))(q_rows)  # (V, B, K, G, bq, H)
  dq0 = _sharding.sharded_reshape(
    jnp.zeros_like(jnp.transpose(qbs, (0, 1, 2, 5, 3, 4)), dtype=sd), qbs.shape[:3] + (H, G * bq)
  )
  carry0 = (dq0, lane_zeros(dq0.shape[0])) if per_query else (dq0,)
  q_sums, _ = _lane_steps(
    schedule,
    _Lane(visit, carry0, None),
    tuple(_softmax.no_rows(x, nq) for x in carry0),
    _softmax.add_into,
    name="bwd_dq",
  )
  # (nq, ...) -> (nq, 1, ...)
  return q_sums[0], (q_sums[1][:, None] if per_query else None)
