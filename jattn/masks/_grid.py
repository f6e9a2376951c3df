"""The block grid and block states: the (block_q, block_kv) tiling of a (T, S) score matrix that
mask summaries are computed on (`BlockGrid`; `_TableGrid`, the same grid at the run-time
positions of a remapped mask), the per-block states EMPTY / PARTIAL / FULL, and their reduction
over batch and heads into the one block map a kernel walks (`reduce_states`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

# Block states. The numeric order matters: AND of two states is their minimum, OR their maximum,
# NOT is 2 - state (see `_protocol._combine`).
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True)
class BlockGrid:
  """A (block_q, block_kv) tiling of a (T, S) score matrix; the last blocks may be ragged."""

  T: int
  S: int
  block_q: int
  block_kv: int

  @property
  def num_q_blocks(self) -> int:
    return -(-self.T // self.block_q)

  @property
  def num_kv_blocks(self) -> int:
    return -(-self.S // self.block_kv)

  def q_ranges(self) -> tuple[np.ndarray, np.ndarray]:
    """First and one-past-last query position of every query block, shape (nq,)."""
    start = np.arange(self.num_q_blocks, dtype=np.int64) * self.block_q
    return start, np.minimum(start + self.block_q, self.T)

  def kv_ranges(self) -> tuple[np.ndarray, np.ndarray]:
    start = np.arange(self.num_kv_blocks, dtype=np.int64) * self.block_kv
    return start, np.minimum(start + self.block_kv, self.S)

  def q_blocks(self) -> tuple[np.ndarray, np.ndarray]:
    """(nq, block_q) query position of every row of every block, and whether it is < T (the
    last block's rows past T are padding)."""
    pos = np.arange(self.num_q_blocks * self.block_q, dtype=np.int32)
    return pos.reshape(self.num_q_blocks, self.block_q), (pos < self.T).reshape(
      self.num_q_blocks, self.block_q
    )

  def kv_blocks(self) -> tuple[np.ndarray, np.ndarray]:
    pos = np.arange(self.num_kv_blocks * self.block_kv, dtype=np.int32)
    return pos.reshape(self.num_kv_blocks, self.block_kv), (pos < self.S).reshape(
      self.num_kv_blocks, self.block_kv
    )


def _xp(*arrays):
  """NumPy when every array is (a summary known at trace time), else jax.numpy."""
  return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


def _summary(xp, empty, full):
  """int8 EMPTY / PARTIAL / FULL from two boolean arrays (empty wins)."""
  return xp.where(empty, EMPTY, xp.where(full, FULL, PARTIAL)).astype(xp.int8)


class _TableGrid:
  """A `BlockGrid` whose rows sit at the positions of two tables (the grid masks see in
  `_Remapped.block_states`): ranges and block tables are jax arrays."""

  def __init__(self, grid: BlockGrid, q_table, kv_table):
    self.grid, self.q_table, self.kv_table = grid, q_table, kv_table
    self.num_q_blocks, self.num_kv_blocks = grid.num_q_blocks, grid.num_kv_blocks
    self.block_q, self.block_kv = grid.block_q, grid.block_kv

  def q_blocks(self):
    return self.q_table.reshape(self.num_q_blocks, self.block_q), self.grid.q_blocks()[1]

  def kv_blocks(self):
    return self.kv_table.reshape(self.num_kv_blocks, self.block_kv), self.grid.kv_blocks()[1]

  def q_ranges(self):
    return self._hull(*self.q_blocks())

  def kv_ranges(self):
    return self._hull(*self.kv_blocks())

  @staticmethod
  def _hull(pos, valid):
    """[min, max + 1) of each block's valid positions."""
    big = jnp.iinfo(jnp.int32)
    return (
      jnp.where(valid, pos, big.max).min(axis=1),
      jnp.where(valid, pos, big.min).max(axis=1) + 1,
    )


def reduce_states(states, shape) -> Any:
  """Summarise (B|1, N|1, nq, nk) states over batch and heads into one (nq, nk) map.

  The kernels process all batch elements and heads of a block together, so a block is skipped
  only if it is EMPTY for every (b, n), and is mask-free only if it is FULL for every (b, n).
  """
  xp = np if isinstance(states, np.ndarray) else jnp
  lo = states.min(axis=(0, 1))
  hi = states.max(axis=(0, 1))
  return xp.where(hi == EMPTY, EMPTY, xp.where(lo == FULL, FULL, PARTIAL)).astype(xp.int8)
