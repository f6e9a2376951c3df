"""Chunked attention: online softmax over key/value blocks, O(T + S) memory forward and backward.

The FlashAttention algorithm in pure JAX, so XLA compiles it for CPU, GPU and TPU.

Forward, for each query block: walk the key/value blocks that the mask does not hide, keeping a
running max m, running sum l and an fp32 accumulator acc. When a block raises the max from m to
m', the old sum and accumulator are rescaled by exp(m - m') -- the same max trick as the stable
softmax, applied incrementally. At the end out = acc / l and the log-sum-exp m + log(l) is saved.

Backward (a custom VJP, so nothing of size T x S is stored): for each key/value block, walk the
query blocks that can see it, recompute P = exp(S - lse) from the saved log-sum-exp, and
accumulate dV = P^T dO, dK = dS^T Q and dQ = dS K with dS = P * (dO V^T - rowsum(dO * O)).

Block skipping: a (num_q_blocks, num_kv_blocks) int8 map of EMPTY / PARTIAL / FULL (see
`jattn.masks`) drives both loops. Each loop only runs over the range of non-empty blocks, a switch
skips any EMPTY block inside that range, and FULL blocks take a branch without mask arithmetic.

Layout: the kernels take and return arrays sequence-major, as callers hold them -- q and out
(B, Tp, N, H), k/v (B, Sp, K, H), lse (B, Tp, N), with Tp, Sp padded up to whole blocks -- and
transpose one block at a time into the head-major tiles of `jattn._tile` ((B, K, G, bq, H) and
(B, K, bk, H)); the forward's tile math stacks the G query heads of a group as rows,
(B, K, G * bq, .), see `_rows`. Transposing whole arrays up front instead costs a full-size copy
of every input and output per call (at T = 4096, N = 8, H = 64: 34.5 MiB of XLA temporaries
against 10.5).
The backward keeps its score tiles key-major, (B, K, bk, G, bq): see `_rows_matmul`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _plan, _sharding, _softmax, _tile
from jattn import masks as _masks
from jattn._plan import Operands, Plan
from jattn.masks import EMPTY, FULL, PARTIAL

# A test hook: when set (at trace time) to a Python callable, every computed block calls it with
# (pass, q_block, kv_block, state) through `jax.debug.callback`. It lets tests check that EMPTY
# blocks are never computed, from the program actually run.
_BLOCK_HOOK = None


def _hook(pass_name, i, j, state):
  """Report tile (i, j) in ``state`` to the hook; i, j and state may also be (W,) vectors: the
  tiles the lanes of one parallel step compute (EMPTY: a padding step, computed fully masked)."""
  if _BLOCK_HOOK is not None:
    hook = _BLOCK_HOOK

    def report(i, j, s):
      for a, b, c in zip(*(np.atleast_1d(x).tolist() for x in (i, j, s))):
        hook(pass_name, a, b, c)

    jax.debug.callback(report, i, j, state)


def _slice(x, start, size, axis):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _positions(i, block):
  return i * block + jnp.arange(block, dtype=jnp.int32)


def _bias_block(bias, i, j, plan: Plan):
  """Slice a (B|1,K|1,G|1,Tp|1,Sp|1) bias for tile (i, j); broadcast dims stay size 1."""
  if bias is None:
    return None
  if bias.shape[3] != 1:
    bias = _slice(bias, i * plan.grid.block_q, plan.grid.block_q, 3)
  if bias.shape[4] != 1:
    bias = _slice(bias, j * plan.grid.block_kv, plan.grid.block_kv, 4)
  return bias


class TileView(NamedTuple):
  """What every tile function needs to know about tile (i, j) besides the data itself."""

  i: Any  # query block index
  j: Any  # key/value block index
  idx: _tile.Index  # the tile's positions (global ones in ring attention)
  vis: Any  # (B|1, K|1, G|1, tq, tk) bool visibility, or None: nothing hidden in this tile
  bias: Any  # the tile's (B|1, K|1, G|1, tq|1, tk|1) bias block, or None


def tile_view(plan: Plan, ops: Operands, i, j, masked: bool, live=None) -> TileView:
  """Positions, visibility and bias of tile (i, j); ``masked=False`` (a FULL block) skips the
  mask arithmetic. ``live`` (a traced bool, parallel schedule): False hides the whole tile (a
  lane's padding step)."""
  bq, bk = plan.grid.block_q, plan.grid.block_kv
  q_pos, kv_pos = _positions(i, bq), _positions(j, bk)
  if ops.positions is None:
    idx = _tile.Index(q_pos, kv_pos)
  else:
    pos = ops.positions
    idx = _tile.Index(
      _slice(pos.q, i * bq, bq, 0), _slice(pos.kv, j * bk, bk, 0), pos.batch0, pos.head0
    )
  vis = (
    _tile.visible(plan.cfg, ops.mask, q_pos, kv_pos, ragged_kv=plan.ragged_kv) if masked else None
  )
  if live is not None:
    live = jnp.reshape(live, (1, 1, 1, 1, 1))
    vis = live if vis is None else vis & live
  return TileView(i, j, idx, vis, _bias_block(ops.bias, i, j, plan))


def dispatch(kinds, state, branches, *args):
  """Run ``branches[state]`` ({EMPTY: f, PARTIAL: f, FULL: f}) for a traced block state,
  compiling only the states in ``kinds``: a direct call when there is one, else a switch."""
  if len(kinds) == 1:
    return branches[kinds[0]](*args)
  table = np.zeros(3, np.int32)
  for pos, kind in enumerate(kinds):
    table[kind] = pos
  index = jnp.asarray(table)[state.astype(jnp.int32)]
  fns = [branches[kind] for kind in kinds]
  if _sharding.explicit_mesh():
    # Branches that pass a carry through or return fresh zeros must return the sharding the
    # computing branch (the last: PARTIAL or FULL) gives its results.
    want = jax.eval_shape(fns[-1], *args)
    fns = [lambda *a, f=f: _sharding.reshard_like(f(*a), want) for f in fns]
  return jax.lax.switch(index, fns, *args)


def walk_rows(
  plan: Plan, ops: Operands, *, start: Callable, tile: Callable, finish: Callable, outs, name: str
):
  """The query-major walk over the block map, shared by the forward pass and the diagnostics.

  For each query block i: ``ctx, carry = start(i)``; for each non-EMPTY key block j of row i,
  ``carry = tile(ctx, view, carry)`` with the `TileView` of (i, j) (EMPTY blocks are skipped, FULL
  ones get no mask arithmetic); then ``outs = finish(i, carry, outs)``. Loops run over each row's
  range of non-empty blocks (constants when the block map is static).
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
    return finish(i, carry, outs)

  return jax.lax.fori_loop(0, plan.grid.num_q_blocks, q_block, outs)


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


def _key_major(x):
  """A (B|1, K|1, G|1, tq|1, tk|1) tile quantity as (B|1, K|1, tk|1, G|1, tq|1)."""
  return jnp.transpose(x, (0, 1, 4, 2, 3))


def _query_major(x):
  """The inverse of `_key_major`."""
  return jnp.transpose(x, (0, 1, 3, 4, 2))


def _rows(x):
  """(B, K, G, bq[, X]) -> (B, K, G * bq[, X]): the G query heads of a group stacked as rows
  (query head k * G + g's row t becomes row g * bq + t of kv head k)."""
  return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])


def _unrows(x, G, lead=0):
  """The inverse of `_rows`; ``lead`` leading axes (lanes) come first."""
  at = lead + 2
  return x.reshape(x.shape[:at] + (G, -1) + x.shape[at + 1 :])


def q_tile(x, i, bq, K, G):
  """Query block i of a (B, Tp, N, X) array as a (B, K, G, bq, X) tile (head n = k * G + g)."""
  # Transposing the 4-D block and then splitting N keeps to standard layouts; transposing after
  # the split makes XLA's CPU backend copy the tile twice.
  b = jnp.transpose(_slice(x, i * bq, bq, 1), (0, 2, 1, 3))
  return b.reshape(b.shape[0], K, G, bq, b.shape[-1])


def kv_tile(x, j, bk):
  """Key/value block j of a (B, Sp, K, X) array as a (B, K, bk, X) tile."""
  return jnp.transpose(_slice(x, j * bk, bk, 1), (0, 2, 1, 3))


def _row_tile(x, i, bq, K, G):
  """Block i of per-query statistics (B, Tp, N) as (B, K, G, bq)."""
  b = jnp.transpose(_slice(x, i * bq, bq, 1), (0, 2, 1))
  return b.reshape(b.shape[0], K, G, bq)


def put_q_tile(x, tile, i, bq):
  """Write a (B, K, G, bq) or (B, K, G, bq, X) tile back as block i of (B, Tp, N[, X])."""
  B, K, G = tile.shape[:3]
  rows = tile.reshape((B, K * G) + tile.shape[3:])
  rows = jnp.transpose(rows, (0, 2, 1) + tuple(range(3, rows.ndim)))
  return jax.lax.dynamic_update_slice_in_dim(x, rows.astype(x.dtype), i * bq, axis=1)


def _put_kv_tile(x, tile, j, bk):
  """Write a (B, K, bk, X) tile back as block j of a (B, Sp, K, X) array."""
  return jax.lax.dynamic_update_slice_in_dim(
    x, jnp.transpose(tile, (0, 2, 1, 3)).astype(x.dtype), j * bk, axis=1
  )


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------


def forward(plan: Plan, ops: Operands):
  """q (B,Tp,N,H), k/v (B,Sp,K,H) -> out (B,Tp,N,Hv) in q's dtype, lse (B,Tp,N)."""
  cfg = plan.cfg
  K, G = cfg.K, cfg.G
  bq, bk = plan.grid.block_q, plan.grid.block_kv
  q, k, v = ops.q, ops.k, ops.v
  sd = _tile.stat_dtype(q.dtype)
  inputs = (q, k, v, ops.states)

  parallel = plan.schedule == "parallel"
  # The scale multiplies Q once, where that rounds no coarser than the logits do, instead of
  # every (bq, bk) tile of logits (the backward recomputes the logits the same way).
  q_scaled, scaled = _tile.prescaled_query(cfg, q)

  def start(i):
    qb = q_tile(q_scaled, i, bq, K, G)
    # Carries are made from the tiles they accumulate, so they share the inputs' sharding when
    # that is part of the type (an Explicit-axis mesh): a fresh jnp.zeros would be replicated.
    # The sink is one more logit in every row, with no value: it starts the running max and
    # contributes exp(sink - m) to the sum (parallel: it joins once per row, in the merge).
    sink = ops.sink if not parallel else None
    m0, l0 = _softmax.start(jnp.zeros_like(qb[..., 0], dtype=sd), sink)  # (B, K, G, bq)
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

  def finish(i, carry, outs):
    m, l, acc = (_unrows(x, G) for x in carry)
    out, lse = outs
    out = put_q_tile(out, _softmax.normalize(acc, l, m, cfg.dropout_rate), i, bq)
    lse = put_q_tile(lse, _softmax.lse(m, l), i, bq)
    return out, lse

  if parallel:
    return _forward_parallel(plan, ops, start, tile)
  # Each query block writes its rows of the output in place: stacking per-block results (as
  # lax.map does) would need another full-size copy to put them back in sequence order.
  out0 = jnp.repeat(jnp.zeros_like(q[..., :1]), v.shape[-1], axis=-1)  # (B, Tp, N, Hv)
  lse0 = jnp.zeros_like(q[..., 0], dtype=sd)
  outs0 = _sharding.varying_tree((out0, lse0), *inputs)
  return walk_rows(plan, ops, start=start, tile=tile, finish=finish, outs=outs0, name="fwd")


# --------------------------------------------------------------------------------------------
# The parallel schedule: lanes side by side.
# --------------------------------------------------------------------------------------------


def _lanes(plan: Plan, packed, states, per_row: int = 1):
  """The lane tables (a `_LaneTables`), the number of steps, and whether any tile needs mask
  arithmetic: static lanes from the plan (``packed``), or run-time ones from the block map
  ``states`` (``per_row`` lanes per row)."""
  if packed is not None:
    ln = _plan.lanes_of(packed)
    masked = PARTIAL in plan.kinds or bool((ln.kinds == EMPTY).any())
    return _LaneTables(ln, ln.segmented, _plan.merge_order(ln)), ln.columns.shape[1], masked
  ln, steps = _plan.run_time_lanes(states, per_row)
  return _LaneTables(ln, False, _plan.merge_order(ln, per_row)), steps, True


class _LaneTables(NamedTuple):
  lanes: _plan.Lanes  # as jax arrays, or NumPy ones (static)
  segmented: bool  # some lane runs several parts: reset and write out its carry mid-loop
  order: _plan.MergeOrder  # which parts wait for their group's end, and the merges' rounds


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
  tables: _LaneTables,
  steps,
  masked,
  carry0,
  visit,
  const,
  rows0,
  fold,
  width=None,
  name=None,
  shared=None,
  gather=None,
  transposed=False,
):
  """Run ``steps`` steps; in each, every lane of a group (see `_in_groups`) visits its next
  block (vmapped over lanes): ``visit(i, j, live, masked, lane_const, lane_carry) -> (lane_carry,
  outs)``, i the step's row, j its block, ``const`` per-lane data that does not change (None
  when lanes are segmented: a lane's row changes between parts, so visit loads what it needs).

  A lane's carry restarts from its ``carry0`` where a part starts; finished parts are merged
  into their rows of the accumulator that starts as ``rows0`` by ``fold(rows, at, parts) ->
  rows``, ``at`` (W,) their rows without repeats (R or more: none), in the order of
  `jattn._plan.MergeOrder`: a row's parts in lane order. ``gather(shared, outs, rows_t,
  columns_t, kinds_t) -> shared`` folds each step's other results into ``shared``. Returns
  (rows, shared). ``transposed``: rows are key blocks (the dK/dV pass), for the block hook."""
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

  return _in_groups(tables, width, (const, carry0), (rows0, shared), run)


def _forward_parallel(plan: Plan, ops: Operands, start, tile):
  """Every lane's next key/value block in one step (see `jattn._plan.lanes`); the parts of a
  row are merged through their running max and sum, then the sink joins once."""
  cfg = plan.cfg
  sd = _tile.stat_dtype(ops.q.dtype)
  tables, steps, masked = _lanes(plan, plan.row_lanes, ops.states, plan.row_split)
  qbs, carry0 = jax.vmap(start)(jnp.asarray(tables.lanes.rows)[:, 0])

  def visit(i, j, live, masked, qb, carry):
    if qb is None:  # segmented lanes: the step's own row
      qb = start(i)[0]
    return tile(qb, tile_view(plan, ops, i, j, masked, live), carry), None

  # The rows' statistics, in rows layout (R, B, K, G * bq[, H]): a row's parts merged in lane
  # order once every lane has run.
  m0, l0, acc0 = carry0
  R = plan.grid.num_q_blocks
  rows0 = (_softmax.no_rows(m0, R, _tile.NEG), _softmax.no_rows(l0, R), _softmax.no_rows(acc0, R))
  rows, _ = _lane_steps(
    tables,
    steps,
    masked,
    carry0,
    visit,
    None if tables.segmented else qbs,
    rows0,
    _softmax.merge_into,
    plan.width,
    name="fwd",
  )
  # (R, B, K, G * bq[, H]) -> (R, B, K, G, bq[, H]).
  m_r, l_r, acc_r = (_unrows(x, cfg.G, lead=1) for x in rows)
  if ops.sink is not None:
    m_r, l_r, acc_r = _softmax.join_sink(m_r, l_r, acc_r, ops.sink.astype(sd)[None])
  out = _softmax.normalize(acc_r, l_r, m_r, cfg.dropout_rate).astype(ops.q.dtype)
  lse = _softmax.lse(m_r, l_r)
  # (nq, B, K, G, bq[, H]) -> (B, Tp, N[, H]): query block i holds rows i * bq ..
  R, B = out.shape[:2]
  out = _sharding.reshape(
    jnp.transpose(out, (1, 0, 4, 2, 3, 5)), (B, R * plan.grid.block_q, cfg.N, -1)
  )
  lse = _sharding.reshape(jnp.transpose(lse, (1, 0, 4, 2, 3)), (B, R * plan.grid.block_q, cfg.N))
  return out, lse


# --------------------------------------------------------------------------------------------
# Backward.
# --------------------------------------------------------------------------------------------


class Residuals(NamedTuple):
  """What the backward pass keeps from the forward: the operands, the output and its lse."""

  ops: Operands
  out: Any  # (B, Tp, N, Hv)
  lse: Any  # (B, Tp, N)


class _Backward(NamedTuple):
  """What every tile of the backward pass reads besides the operands."""

  q_in: Any  # the query, scaled where `_tile.prescaled_query` folds the logit scale into it
  scaled: bool
  dout: Any  # (B, Tp, N, Hv)
  lse_r: Any  # (B, Tp, N): the lse that P is recomputed with (+inf for empty rows)
  delta: Any  # (B, Tp, N): rowsum(dO * O), less the lse's cotangent
  keep_scale: float | None  # dropout's 1 / (1 - rate)
  dbias_block_shape: tuple | None  # one tile's dBias block (see `_bias_contribution_shape`)


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
  zeros = lambda tree: jax.tree.map(_plan.zero_cotangent, tree)
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


class _TileGrads(NamedTuple):
  dk: Any  # (B, K, bk, H)
  dv: Any  # (B, K, bk, Hv)
  dq_t: Any  # (B, K, H, G * bq): dQ^T of the tile's query block (unscaled)
  dbias: Any  # the tile's dBias block, or None
  dargs: Any  # score_mod arrays' gradient (a tuple)


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
  to_seq = lambda x: _sharding.reshape(
    jnp.transpose(x, (1, 0, 3, 2, 4)), (B, nk * bk, K, x.shape[-1])
  )
  dk = to_seq(dk_r * dk_scale).astype(k.dtype)
  dv = to_seq(dv_r).astype(v.dtype)
  dq, dbias_q = _backward_q_pass(plan, ops, tile_grads, sums)
  if dbias_q is not None:
    blocked = dbias_q
  dbias = None
  if blocked is not None:
    dbias = _sharding.reshape(jnp.transpose(blocked, (2, 3, 4, 0, 5, 1, 6)), bias.shape)
  # Cast before the transpose: the sequence-major copy is then in q's dtype, not float32.
  dq = (dq * scale).astype(q.dtype)
  dq = _sharding.reshape(dq, (nq, B, K, H, G, bq))  # (nq, B, K, H, G * bq) split
  dq = _sharding.reshape(jnp.transpose(dq, (1, 0, 5, 2, 4, 3)), (B, nq * bq, K * G, H))
  return dq, dk, dv, dbias, dargs


def _backward_kv_pass(plan: Plan, ops: Operands, tile_grads, sums):
  """dK, dV (nk, B, K, bk, H) in float32, with key blocks side by side as lanes (the transposed
  map), each walking its query blocks; also dBias in blocks where each (i, j) tile or each key
  block has one writer (see `_bias_sums`), and score_mod's arrays' gradients."""
  grid, k, v, bias = plan.grid, ops.k, ops.v, ops.bias
  bk, nq, nk = grid.block_kv, grid.num_q_blocks, grid.num_kv_blocks
  sd = _tile.stat_dtype(ops.q.dtype)
  per_key, _, block_spec, lane_zeros, blocked0 = sums
  tables, steps, masked = _lanes(plan, plan.column_lanes, ops.states.T)
  kv_rows = jnp.asarray(tables.lanes.rows)[:, 0]
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
    tables,
    steps,
    masked,
    carry0,
    kv_visit,
    None if tables.segmented else (kbs, vbs),
    tuple(_softmax.no_rows(x, nk) for x in carry0),
    _softmax.add_into,
    plan.width,
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
  tables, steps, masked = _lanes(plan, plan.row_lanes, ops.states, plan.row_split)
  q_rows = jnp.asarray(tables.lanes.rows)[:, 0]

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
  dq0 = _sharding.reshape(
    jnp.zeros_like(jnp.transpose(qbs, (0, 1, 2, 5, 3, 4)), dtype=sd), qbs.shape[:3] + (H, G * bq)
  )
  carry0 = (dq0, lane_zeros(dq0.shape[0])) if per_query else (dq0,)
  q_sums, _ = _lane_steps(
    tables,
    steps,
    masked,
    carry0,
    visit,
    None,
    tuple(_softmax.no_rows(x, nq) for x in carry0),
    _softmax.add_into,
    plan.width,
    name="bwd_dq",
  )
  # (nq, ...) -> (nq, 1, ...)
  return q_sums[0], (q_sums[1][:, None] if per_query else None)


def _bias_contribution_shape(bias_shape, B, K, G, bq, bk):
  """Shape of one tile's dBias block: the tile's (B, K, G, bq, bk), 1 where the bias broadcasts."""
  tile = (B, K, G, bq, bk)
  return tuple(1 if bias_shape[a] == 1 else tile[a] for a in range(5))


def _bias_contribution(ds, shape):
  """A tile's dS summed over the bias's broadcast dimensions."""
  axes = tuple(a for a in range(5) if shape[a] == 1 and ds.shape[a] != 1)
  return ds.sum(axis=axes, keepdims=True) if axes else ds


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


# --------------------------------------------------------------------------------------------
# The custom VJP: the operands, the output and its log-sum-exp are the only residuals.
# --------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel(plan: Plan, ops: Operands):
  return forward(plan, ops)


def _kernel_fwd(plan: Plan, ops: Operands):
  out, lse = forward(plan, ops)
  return (out, lse), Residuals(ops, out, lse)


def _kernel_bwd(plan: Plan, res: Residuals, cts):
  # The lse's cotangent: a merge of parts (merge_attention, key/value shards on several
  # devices) differentiates through it.
  dout, dlse = cts
  grads = backward(plan, res, dout, dlse)
  if _sharding.explicit_mesh():
    # A cotangent must have its operand's type, sharding included: the sinks' gradient, summed
    # from head-sharded statistics, comes out sharded like the heads even where the sinks are
    # replicated.
    ops, fields = res.ops, ("q", "k", "v", "bias", "sink", "score_args")
    want = [jax.tree.map(jax.typeof, getattr(ops, f)) for f in fields]
    got = _sharding.reshard_like([getattr(grads, f) for f in fields], want)
    grads = grads._replace(**dict(zip(fields, got)))
  return (grads,)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def chunked_attention(plan: Plan, ops: Operands):
  """Chunked attention of unpadded operands: q (B,T,N,H), k/v (B,S,K,H), bias
  (B|1,K|1,G|1,T|1,S|1). Pads T and S to whole blocks, runs the custom-VJP kernel, and slices
  the padding off. Returns out (B,T,N,H) and lse (B,T,N).
  """
  q, k, v, bias = _plan.pad_to_blocks(plan, ops.q, ops.k, ops.v, ops.bias)
  out, lse = _kernel(plan, ops._replace(q=q, k=k, v=v, bias=bias))
  T = plan.cfg.T
  if plan.Tp != T:
    out, lse = out[:, :T], lse[:, :T]
  return out, lse


def chunked_attention_grads(plan: Plan, ops: Operands, out, lse, dout, dlse) -> Operands:
  """The cotangents of `chunked_attention`'s operands from its saved output and log-sum-exp
  (out (B, T, N, H), lse (B, T, N)) and their cotangents: its backward pass, run by a caller
  that keeps the residuals itself (the partitioned operation of `jattn._parallel.partition`)."""
  padded, unpad = jax.vjp(
    lambda q, k, v, bias: _plan.pad_to_blocks(plan, q, k, v, bias), ops.q, ops.k, ops.v, ops.bias
  )
  pt = plan.Tp - plan.cfg.T

  def rows(x, fill=0):
    pads = ((0, 0), (0, pt)) + ((0, 0),) * (x.ndim - 2)
    return jnp.pad(x, pads, constant_values=fill) if pt else x

  # Padded query rows get a huge positive lse: their recomputed probabilities, and their share
  # of the sinks' gradient (exp(sink - lse), times a zero delta), are exact zeros. (The empty-
  # row value NEG would give the sinks exp(sink - NEG) = inf times 0.)
  res = Residuals(
    ops._replace(q=padded[0], k=padded[1], v=padded[2], bias=padded[3]),
    rows(out),
    rows(lse, -_tile.NEG),
  )
  (grads,) = _kernel_bwd(plan, res, (rows(dout), rows(dlse)))
  dq, dk, dv, dbias = unpad((grads.q, grads.k, grads.v, grads.bias))
  return grads._replace(q=dq, k=dk, v=dv, bias=dbias)


def attend(call, cfg, score_args, saved=None):
  """The chunked kernels on a bound call (`jattn._call.Call`), or on one device's part of one:
  queries (B, cfg.T, N, H), keys (B, cfg.S, K, H); ``cfg`` and ``score_args`` from its
  `Static.config`. Returns (out, lse).

  Where the call is a part (``call.place``): rows of a query shard, or keys of a key/value
  shard, see their global positions (the mask is remapped to them; score_mod and dropout see
  them too), and examples and heads their global indices (the mask is already cut to them).
  ``saved``: (out, lse, dout, dlse) of an earlier call on the same operands; the operands'
  cotangents (an `Operands`) are returned instead. The schedule is the call's, else the
  platform's default, chosen where the program is lowered."""
  tuned, place, mask = call.static.tuned, call.place, call.mask
  bq, bk = _plan.block_sizes(cfg.T, cfg.S, tuned.block_q, tuned.block_kv)
  positions = None
  if any(x is not None for x in place):
    q_table = _position_table(place.q_offset, cfg.T, bq)
    kv_table = _position_table(place.kv_offset, cfg.S, bk)
    if mask is not None and (place.q_offset is not None or place.kv_offset is not None):
      mask = _masks.remap(mask, q_table, kv_table)
    if cfg.score_mod is not None or cfg.dropout_rate > 0:
      positions = _plan.Positions(
        q_table,
        kv_table,
        0 if place.batch0 is None else place.batch0,
        0 if place.head0 is None else place.head0,
      )
  run = {}
  for schedule in (tuned.schedule,) if tuned.schedule else _plan.SCHEDULES:
    plan, states = _plan.make_plan(cfg, mask, bq, bk, schedule, tuned.step_width)
    ops = Operands(
      q=call.query,
      k=call.key,
      v=call.value,
      bias=call.bias,
      mask=mask,
      states=states,
      seed=call.seed,
      score_args=score_args,
      sink=call.sink,
      positions=positions,
    )
    run[schedule] = (
      functools.partial(chunked_attention, plan, ops)
      if saved is None
      else functools.partial(chunked_attention_grads, plan, ops, *saved)
    )
  if tuned.schedule:
    return run[tuned.schedule]()
  return _plan.by_platform({p: run[s] for p, s in _plan.SCHEDULE_DEFAULTS.items()})


def _position_table(offset, n: int, block: int):
  """The global positions of ``n`` rows padded to whole blocks, starting at ``offset``; padding
  rows repeat the last row's position (hidden, or sliced off)."""
  rows = jnp.minimum(jnp.arange(-(-n // block) * block, dtype=jnp.int32), n - 1)
  return rows if offset is None else offset + rows
