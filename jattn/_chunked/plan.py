"""The chunked kernels' plan: which blocks, which tile variants, which lanes.

Every chunked call -- `dot_product_attention`, `ring_attention` and `diagnostics.attention_stats`
-- has one `jattn.masks` object for everything that hides positions (`masks.from_arguments`) and
gets the same two things here for the kernels:

  * a `Plan` (static, hashable: part of the jit cache key): the call's `Config`, the block grid,
    the tile variants that can occur and, for a block map known at trace time, each row's and
    column's range of non-empty blocks, so loops run between constants;
  * `Operands` (the arrays the kernels read, one NamedTuple instead of ten positional
    arguments), whose ``states`` field is the (nq, nk) int8 block map: NumPy-derived constants
    for structural masks, computed at run time for data-dependent ones.

Also here: the block map and its ranges, the parallel schedule's lanes and their merge order,
the step width, decoding's split-KV and padding to whole blocks. Measured figures behind the
constants: docs/benchmarks.md ("Tuning constants").

Shapes: B batch, T query length, S key/value length, N query heads, K key/value heads,
H head dimension, G = N // K.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jattn import masks as _masks
from jattn._tile import Config
from jattn._validation import concrete
from jattn.masks import EMPTY, FULL, PARTIAL, BlockGrid

SCHEDULES = ("serial", "parallel")

# schedule=None: the chunked kernels' schedule per platform, picked where the program is lowered
# (jax.lax.platform_dependent), others get "parallel". CPU: "serial", measured faster here (see
# README); GPU and TPU: "parallel" -- reasoned (one step per key block instead of one per tile,
# each step as wide as the call), not yet measured on hardware.
SCHEDULE_DEFAULTS = {"cpu": "serial", "default": "parallel"}

# Decoding (a few new tokens against a long KV cache) gives the parallel schedule one row of
# blocks: one lane walking every key block in turn. Split-KV (FlashDecoding) instead spreads the
# row's key blocks over lanes side by side and merges their partial softmaxes by log-sum-exp.
# Reasoned, not measured (no accelerator here): a call is decoding-shaped (`decoding`) when its
# query rows (T x G per key/value head) fit one query block of at most DECODE_MAX_ROWS rows,
# and its row is dealt over up to SPLIT_KV_PARTS parts: with B x K (batch x key/value heads)
# tiles per lane that is enough side by side to fill a GPU's or TPU's cores at B x K >= 8, and
# the steps fall from S / block_kv to S / (block_kv x SPLIT_KV_PARTS) (4 at S = 16384 and
# 256-key blocks). DECODE_MIN_KEYS: below it the whole cache is a few blocks and dense's one
# pass is as good (on this CPU chunked already wins at S = 512 in float32; see
# `choose_implementation`).
DECODE_MAX_ROWS = 256
DECODE_MIN_KEYS = 512
SPLIT_KV_PARTS = 16


def decoding(T: int, S: int, G: int = 1) -> bool:
  """Whether a call is decoding-shaped: its T x G query rows per key/value head are at most
  DECODE_MAX_ROWS (so they fit one default query block), against at least DECODE_MIN_KEYS keys
  (a few new tokens against a KV cache). The chunked kernels then read the cache block by block
  where it lies; dense attention transposes the whole cache to head-major on every call."""
  return T * G <= DECODE_MAX_ROWS and S >= DECODE_MIN_KEYS


# --------------------------------------------------------------------------------------------
# The block map and its ranges.
# --------------------------------------------------------------------------------------------


def block_map_and_kinds(mask, grid, shape):
  """The (nq, nk) EMPTY/PARTIAL/FULL map the chunked kernels run on (a NumPy array when known at
  trace time, else a jax array), and the tuple of states that can occur in it.

  A static map tells exactly which states occur, so the kernels compile only those tile
  variants (an unmasked call compiles one, with no switch at all); a run-time map may hold any.
  """
  nq, nk = grid.num_q_blocks, grid.num_kv_blocks
  if mask is None:
    states = np.full((nq, nk), FULL, np.int8)
  else:
    states = _masks.reduce_states(mask.block_states(grid, shape), shape)
  xp = np if isinstance(states, np.ndarray) else jnp
  # Masks constant along an axis (a (B, N, 1, S) array, say) summarise it as one block.
  states = xp.broadcast_to(states, (nq, nk))
  if grid.S % grid.block_kv:
    # The last key block is padded: it always needs the (kv < S) mask.
    last = xp.minimum(states[:, -1:], PARTIAL).astype(xp.int8)
    states = xp.concatenate([states[:, :-1], last], axis=1)
  if xp is np:
    kinds = tuple(int(x) for x in np.unique(states))
  else:
    kinds = (EMPTY, PARTIAL, FULL)
  return states, kinds


def block_map(mask, grid, shape):
  """`block_map_and_kinds`' map as a jax int8 array."""
  return jnp.asarray(block_map_and_kinds(mask, grid, shape)[0], jnp.int8)


def nonempty_range(states):
  """Per row of a (R, C) state map: [first, last + 1) of its non-empty columns (0, 0 if none).

  NumPy in, NumPy out (a map known at trace time); jax in, jax out.
  """
  xp = np if isinstance(states, np.ndarray) else jnp
  ne = states != EMPTY
  has = ne.any(axis=1)
  C = states.shape[1]
  first = xp.argmax(ne, axis=1).astype(np.int32)
  last = (C - xp.argmax(ne[:, ::-1], axis=1)).astype(np.int32)
  zero = np.int32(0)
  return xp.where(has, first, zero), xp.where(has, last, zero)


def static_ranges(states: np.ndarray) -> tuple[tuple[int, int], ...]:
  """`nonempty_range` of a map known at trace time, as a hashable tuple of (first, last + 1)."""
  first, last = nonempty_range(states)
  return tuple(zip(first.tolist(), last.tolist()))


def block_lists(states):
  """Per row of an (R, C) block map, the compact list of its non-EMPTY columns, in order.

  Returns (columns, kinds, counts): (R, L) int32 column indices, (R, L) int8 states (PARTIAL or
  FULL; EMPTY marks padding) and (R,) int32 counts. Rows are padded to L entries with their
  last non-empty column (0 for an empty row) and state EMPTY, so a loop over L steps that
  gathers ``columns[:, step]`` for every row at once reads only blocks a row needs (padding
  re-reads one it has) and does no work where ``kinds`` is EMPTY -- skipping without a branch
  (the idea of splash attention's data_next / mask_next).

  A NumPy map (known at trace time) gives NumPy lists with L = the longest row (at least 1); a
  jax map gives jax lists with L = C, its counts telling how many steps a row really needs.
  """
  xp = np if isinstance(states, np.ndarray) else jnp
  _R, C = states.shape
  nonempty = states != EMPTY
  counts = nonempty.sum(axis=1).astype(np.int32)
  # A stable sort of "is empty" puts each row's non-empty columns first, in column order.
  order = xp.argsort(~nonempty, axis=1, stable=True).astype(np.int32)
  L = max(int(counts.max()), 1) if xp is np else C
  order = order[:, :L]
  step = xp.arange(L, dtype=np.int32)[None, :]
  valid = step < counts[:, None]
  last = xp.take_along_axis(order, xp.maximum(counts - 1, 0)[:, None], axis=1)
  columns = xp.where(valid, order, xp.where(counts[:, None] > 0, last, 0)).astype(np.int32)
  kinds = xp.where(valid, xp.take_along_axis(states, columns, axis=1), EMPTY).astype(np.int8)
  return columns, kinds, counts


class Lanes(NamedTuple):
  """A block map's work laid out for the parallel schedule: lanes computed side by side, each
  walking its own list of blocks, one block per step.

  A lane may run several short rows one after another, and a long row may be cut over several
  lanes: the pieces of a row seen by one lane are its *parts*. A part's running statistics start
  afresh at its first step and, after its last, are merged into its row's (split-KV style: the
  parts of a row saw disjoint keys), so nothing is kept per lane once a part is done.

  rows, columns, kinds (V, L): each step's row, block and state (EMPTY pads the last lane: a tile
  computed fully masked, no work that counts); starts (V, L): the step begins a new part (the
  lane's statistics restart); emit (V, L): the row whose part a step finishes, when that part is
  not the lane's last (R, one past the rows: none); final (V,): the row of each lane's last part
  (R: none).
  """

  rows: Any
  columns: Any
  kinds: Any
  starts: Any
  emit: Any
  final: Any

  @property
  def segmented(self) -> bool:
    """Whether some lane runs more than one part (static lanes only; run-time ones never do)."""
    return isinstance(self.starts, np.ndarray) and bool(self.starts.any())


def lanes(states: np.ndarray, min_lanes: int = 1) -> Lanes:
  """The non-empty blocks of a static map, row after row, cut into lanes of
  L = ceil(total / max(rows, min_lanes)) steps.

  The steps are today's depth (a causal map's rows hold 1 .. R blocks: L = ceil((R + 1) / 2),
  about half the unmasked call's) and every lane but the last is full, so the tiles computed are
  the non-empty ones plus less than one lane of padding, for any mask: causal in either
  alignment, windows, chunked-local, prefix-LM. (Splitting each row into its own lanes instead
  pads short rows to L: 1.5x the non-empty tiles for a causal map.) ``min_lanes`` above the
  number of rows (a decoding step: one row of blocks, see `split_kv_lanes`) cuts the rows
  further, into about that many lanes."""
  columns, kinds, counts = block_lists(np.asarray(states))
  R = states.shape[0]
  total = int(counts.sum())
  L = max(1, -(-total // max(R, int(min_lanes))))
  V = max(1, -(-total // L))
  live = np.arange(columns.shape[1])[None, :] < counts[:, None]
  rows = np.broadcast_to(np.arange(R, dtype=np.int32)[:, None], columns.shape)[live]
  cols, knds = columns[live], kinds[live]
  if total == 0:  # nothing to compute: one lane of one padding step, whose part is dropped
    rows, cols, knds = np.zeros(1, np.int32), np.zeros(1, np.int32), np.full(1, EMPTY, np.int8)
  pad = V * L - rows.size  # padding repeats the last entry (a block its row reads anyway)
  rows, cols = (np.concatenate([x, np.repeat(x[-1:], pad)]).reshape(V, L) for x in (rows, cols))
  knds = np.concatenate([knds, np.full(pad, EMPTY, np.int8)]).reshape(V, L)
  starts = np.zeros((V, L), bool)
  starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
  ends = np.zeros((V, L), bool)
  ends[:, :-1] = starts[:, 1:]
  emit = np.where(ends, rows, R).astype(np.int32)
  final = rows[:, -1].copy() if total else np.full(V, R, np.int32)
  return Lanes(
    rows.astype(np.int32),
    cols.astype(np.int32),
    knds.astype(np.int8),
    starts,
    emit,
    final.astype(np.int32),
  )


def run_time_lanes(states, per_row: int = 1):
  """`Lanes` of a run-time (jax) block map: ``per_row`` lanes per row over every column, one part
  each, and the number of steps that matter, as a jax scalar (the loop runs that many).

  Lane p of a row takes the row's non-empty blocks among columns p, p + per_row, ... in order.
  Which lane sees which keys thus depends only on the columns: a block that is non-empty for
  other sequences of the batch (the map is the batch's) only adds a tile whose rows of this
  sequence are masked -- an exact no-op -- and never moves this sequence's blocks to another
  lane (batch invariance). The steps are the most non-empty blocks of one lane: for a row's
  blocks in one run, ceil(count / per_row)."""
  R, C = states.shape
  P = max(1, min(int(per_row), C))
  L = -(-C // P)
  if P > 1:  # (R, C) -> (R * P, L): row r's lane p holds columns p, p + P, ...
    pad = L * P - C
    if pad:
      states = jnp.concatenate([states, jnp.full((R, pad), EMPTY, states.dtype)], axis=1)
    states = jnp.transpose(states.reshape(R, L, P), (0, 2, 1)).reshape(R * P, L)
  columns, kinds, counts = block_lists(states)
  if P > 1:  # a lane's list positions back to columns (its padding re-reads a column < C)
    columns = columns * P + (jnp.arange(R * P, dtype=jnp.int32) % P)[:, None]
  rows = jnp.repeat(jnp.arange(R, dtype=jnp.int32), P)
  V = R * P
  return Lanes(
    jnp.broadcast_to(rows[:, None], (V, L)),
    columns,
    kinds,
    np.zeros((V, L), bool),
    jnp.full((V, L), R, jnp.int32),
    rows,
  ), counts.max()


class MergeOrder(NamedTuple):
  """How the parallel schedule merges the parts of a row so that they always meet in lane order,
  however the lanes are grouped into steps (the group width follows the batch size): the same
  sums for a row whatever the batch holds besides it, and no scatter over repeated rows (atomics
  on a GPU).

  A part that is its row's only part is merged when it finishes. A row cut over lanes v .. v + k
  has its parts merged at the end of their lanes' groups, in lane order; the part that lane v + k
  finishes mid-lane (the start of its lane: ``hold`` (V, L), the step that finishes it) is held
  until then. rounds: the most parts of one row merged at once (see
  `jattn._softmax.distinct_rounds`)."""

  hold: Any
  rounds: int


def merge_order(ln: Lanes, per_row: int = 1) -> MergeOrder:
  """The `MergeOrder` of static lanes (NumPy tables), or of run-time ones (``per_row`` lanes per
  row, one part each, all finishing at the last step)."""
  if not isinstance(ln.final, np.ndarray):
    return MergeOrder(np.zeros(ln.rows.shape, bool), max(1, int(per_row)))
  V, L = ln.rows.shape
  R = int(ln.emit.max())  # emit's "none" is one past the rows
  hold = np.zeros((V, L), bool)
  for v in range(1, V):
    ends = np.nonzero(ln.emit[v] < R)[0]
    if ln.rows[v, 0] == ln.rows[v - 1, -1] and ends.size and ln.emit[v, ends[0]] == ln.rows[v, 0]:
      hold[v, ends[0]] = True
  lanes_per_row = np.bincount(
    np.unique(np.stack([ln.rows.ravel(), np.repeat(np.arange(V), L)]), axis=1)[0]
  )
  return MergeOrder(hold, max(1, int(np.max(lanes_per_row))))


def _loop_bounds(ranges, states):
  """Functions i -> first and i -> last + 1 non-empty block of row i of ``states``."""
  if ranges is None:
    lo, hi = nonempty_range(states)
    return (lambda i: lo[i]), (lambda i: hi[i])
  if len(set(ranges)) == 1:
    first, last = ranges[0]
    return (lambda i: first), (lambda i: last)
  lo, hi = (jnp.asarray(np.array(col, np.int32)) for col in zip(*ranges))
  return (lambda i: lo[i]), (lambda i: hi[i])


# --------------------------------------------------------------------------------------------
# The plan.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
  """The static description of one blocked computation (hashable: a custom VJP's nondiff
  argument and part of the jit cache key)."""

  cfg: Config
  grid: BlockGrid  # over the true (T, S)
  # The block states that can occur; only their tile variants are compiled.
  kinds: tuple[int, ...] = (EMPTY, PARTIAL, FULL)
  # For a block map known at trace time, `static_ranges` of it and of its transpose: the loops
  # then run between constants (Python ints when every row has the same range) instead of
  # bounds computed from the map at run time.
  q_ranges: tuple[tuple[int, int], ...] | None = None
  kv_ranges: tuple[tuple[int, int], ...] | None = None
  # "serial": one tile per loop step, query blocks one after another (the CPU schedule);
  # "parallel": every lane's next block in one step (`Lanes`; the accelerator schedule).
  schedule: str = "serial"
  # For a static map under the parallel schedule: its `Lanes` over rows (forward, dQ) and over
  # columns (dK, dV), as hashable tuples (see `lanes_of`).
  row_lanes: tuple | None = None
  column_lanes: tuple | None = None
  # Parallel schedule: lanes computed per step (None: all). A step holds one tile per lane, so
  # this bounds the schedule's memory; more lanes than this run group after group.
  width: int | None = None
  # Parallel schedule: the lanes each row of a run-time map is dealt over (see `split_kv_lanes`;
  # static maps have the split in `row_lanes`).
  row_split: int = 1
  # The forward's output dtype; None: the query's. A part that is merged with others through
  # their log-sum-exps (ring attention's shard pairs, split-KV's devices) keeps the statistics
  # dtype: rounded to a 16-bit input's dtype first, a row would be rounded once per part
  # (docs/prefix_trees.md: 1.59x the error of rounding the answer once, against 1.27x).
  out_dtype: Any = None

  @property
  def Tp(self) -> int:
    """T padded up to whole query blocks."""
    return self.grid.num_q_blocks * self.grid.block_q

  @property
  def Sp(self) -> int:
    """S padded up to whole key/value blocks."""
    return self.grid.num_kv_blocks * self.grid.block_kv

  @property
  def ragged_kv(self) -> bool:
    """Whether the last key block holds padding (keys past S, hidden in every tile)."""
    return self.cfg.S % self.grid.block_kv != 0

  def row_bounds(self, states):
    """i -> [first, last + 1) of query block i's non-empty key blocks."""
    return _loop_bounds(self.q_ranges, states)

  def column_bounds(self, states):
    """j -> [first, last + 1) of key block j's non-empty query blocks."""
    return _loop_bounds(self.kv_ranges, None if states is None else states.T)


# The parallel schedule's transient memory when the caller does not say (step_width=None): the
# lanes of a step are as many as fit this many bytes of score-sized tiles. A step holds, per lane,
# a (B, N, block_q, block_kv) tile of logits and a few more of its size (probabilities, and in
# the backward dP and dS: STEP_TILE_COPIES in all, in the statistics' dtype), so the step's
# memory is bounded by the budget and not by B x N x lanes; lanes that do not fit run group after
# group. Reasoned, not measured on an accelerator: 256 MiB is a few percent of an accelerator's
# memory, and a step as wide as it allows holds B x N x lanes tiles of 512 x 256 -- 64 of them
# at B x N x lanes = 64, already more than a GPU has streaming multiprocessors. It keeps the
# depth of a long causal call at B = 1, N = 4 (T = 8192: 17 steps forward, 43 forward+backward)
# and gives B = 4, N = 16 four lanes per step. The `step_width` keyword, or a tuning table's
# entry for the case, sets the width instead (measured wins over reasoned).
STEP_BYTES = 256 << 20
STEP_TILE_COPIES = 4


def default_step_width(cfg: Config, block_q: int, block_kv: int) -> int:
  """Lanes per step within STEP_BYTES (at least 1). A batch or head count that is symbolic
  (jax.export) counts as 1: the budget then holds per example or head."""
  B = cfg.B if concrete(cfg.B) else 1
  N = cfg.N if concrete(cfg.N) else 1
  per_lane = STEP_TILE_COPIES * 4 * B * N * block_q * block_kv  # float32 (float64: twice)
  return max(1, STEP_BYTES // per_lane)


def split_kv_lanes(cfg: Config, grid: BlockGrid, width: int) -> int:
  """The lanes the parallel schedule splits a call's single row of blocks over when its query
  rows fit one block of at most DECODE_MAX_ROWS (1: no split)."""
  if grid.num_q_blocks != 1 or cfg.T * cfg.G > DECODE_MAX_ROWS:
    return 1
  return max(1, min(SPLIT_KV_PARTS, width, grid.num_kv_blocks))


def make_plan(
  cfg: Config,
  mask,
  block_q: int,
  block_kv: int,
  schedule: str = "serial",
  width: int | None = None,
  out_dtype=None,
):
  """(Plan, states): the plan over (cfg.T, cfg.S) in blocks of (block_q, block_kv), and its block
  map as a jax int8 array. ``width``: the parallel schedule's lanes per step (default: as many
  as fit STEP_BYTES, see `default_step_width`); ``out_dtype``: see `Plan.out_dtype`."""
  grid = BlockGrid(cfg.T, cfg.S, block_q, block_kv)
  states, kinds = block_map_and_kinds(mask, grid, (cfg.B, cfg.N, cfg.T, cfg.S))
  parallel = schedule == "parallel"
  width = (width or default_step_width(cfg, block_q, block_kv)) if parallel else None
  split = split_kv_lanes(cfg, grid, width) if width is not None else 1
  out_dtype = None if out_dtype is None else jnp.dtype(out_dtype)
  plan = Plan(
    cfg, grid, kinds, schedule=schedule, width=width, row_split=split, out_dtype=out_dtype
  )
  if isinstance(states, np.ndarray):
    plan = dataclasses.replace(
      plan, q_ranges=static_ranges(states), kv_ranges=static_ranges(states.T)
    )
    if parallel:
      plan = dataclasses.replace(
        plan, row_lanes=_hashable(lanes(states, split)), column_lanes=_hashable(lanes(states.T))
      )
  return plan, jnp.asarray(states, jnp.int8)


def _hashable(ln: Lanes) -> tuple:
  return tuple((a.shape, tuple(np.asarray(a, np.int32).reshape(-1).tolist())) for a in ln)


def lanes_of(packed: tuple) -> Lanes:
  """The `Lanes` a plan stores as hashable tuples."""
  ln = Lanes(*(np.array(flat, np.int32).reshape(shape) for shape, flat in packed))
  return ln._replace(kinds=ln.kinds.astype(np.int8), starts=ln.starts.astype(bool))


class Positions(NamedTuple):
  """Where the kernel's rows sit in a larger problem (ring attention: one device's shards of a
  sequence, and possibly of the batch and heads). Masks, score_mod and the dropout hash see
  these global indices; slicing and padding use the local ones."""

  q: Any  # (Tp,) int32: global position of every (padded) local query row
  kv: Any  # (Sp,) int32: global position of every (padded) local key row
  batch0: Any  # int32 scalar: global index of local batch element 0
  head0: Any  # int32 scalar: global index of local query head 0


class Operands(NamedTuple):
  """The arrays a chunked kernel reads; one pytree, differentiated field by field.

  q (B, Tp, N, H), k and v (B, Sp, K, H): sequence-major as callers hold them, padded to whole
  blocks; bias (B|1, K|1, G|1, Tp|1, Sp|1) or None; mask a `jattn.masks` object or None; states
  the (nq, nk) int8 block map; seed (2,) uint32 dropout words; score_args the arrays a score_mod
  closes over (a tuple); sink (1, K, G, 1) or None; positions a `Positions` or None (local =
  global).
  """

  q: Any
  k: Any
  v: Any
  bias: Any = None
  mask: Any = None
  states: Any = None
  seed: Any = None
  score_args: tuple = ()
  sink: Any = None
  positions: Any = None


def pad_to_blocks(plan: Plan, q, k, v, bias):
  """q, k, v (and a bias that is not broadcast along T or S) padded with zeros to (Tp, Sp)."""
  pt, ps = plan.Tp - plan.cfg.T, plan.Sp - plan.cfg.S
  if pt:
    q = jnp.pad(q, ((0, 0), (0, pt), (0, 0), (0, 0)))
  if ps:
    k = jnp.pad(k, ((0, 0), (0, ps), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, ps), (0, 0), (0, 0)))
  if bias is not None and (pt or ps):
    bias = jnp.pad(
      bias,
      ((0, 0),) * 3 + ((0, pt if bias.shape[3] != 1 else 0), (0, ps if bias.shape[4] != 1 else 0)),
    )
  return q, k, v, bias
