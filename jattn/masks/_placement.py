"""A mask placed on a device's part of the call: `take_part` (one device's examples and heads,
the chunked kernels partitioned under an Auto mesh) and `remap` (the mask at other positions: one
shard of a sequence in ring attention, through tables of the global position of every local
row)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jattn.masks._grid import _TableGrid
from jattn.masks._protocol import Cut, Mask, _register

# --------------------------------------------------------------------------------------------
# A mask for one device's examples and heads (the chunked kernels partitioned under an Auto mesh).
# --------------------------------------------------------------------------------------------


def can_take_part(mask: Mask | None) -> bool:
  """Whether `take_part` knows where every array of ``mask`` keeps its batch and head axes."""
  return mask is None or mask.can_take_part()


def take_part(mask: Mask | None, batch0, nb: int, head0, nh: int, shape) -> Mask | None:
  """``mask`` of the (B, N, T, S) problem ``shape`` restricted to batch elements
  batch0 .. batch0 + nb - 1 and query heads head0 .. head0 + nh - 1 (``batch0`` and ``head0``
  may be traced). Positions along T and S are unchanged (see `remap` for those)."""
  return None if mask is None else mask.take_part(Cut(batch0, nb, head0, nh, shape[0], shape[1]))


# --------------------------------------------------------------------------------------------
# A mask at other positions: one shard of a sequence (ring attention).
# --------------------------------------------------------------------------------------------


def is_position_based(mask: Mask) -> bool:
  """See `Mask.is_position_based`."""
  return mask.is_position_based()


def remap(mask: Mask, q_table, kv_table, batch0=0, head0=0) -> Mask:
  """``mask`` evaluated where a kernel's rows sit in the problem it was built for.

  Local query row r (key row c) of the kernel is position ``q_table[r]`` (``kv_table[c]``) of
  that problem, and local batch element / query head 0 is ``batch0`` / ``head0``. Ring attention
  builds the mask once on global positions and remaps it for every pair of shards. Block
  summaries come from each block's [min, max] of global positions: exact for blocks of
  consecutive positions, and sound (only more PARTIAL) for a block that straddles a jump.
  """
  return _Remapped(
    mask.shift_indices(batch0, head0),
    jnp.asarray(q_table, jnp.int32),
    jnp.asarray(kv_table, jnp.int32),
  )


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Remapped(Mask):
  mask: Mask
  q_table: Any  # (Tp,) int32
  kv_table: Any  # (Sp,) int32

  def evaluate(self, q_pos, kv_pos, shape):
    return self.mask.evaluate(
      jnp.take(self.q_table, q_pos, mode="clip"),
      jnp.take(self.kv_table, kv_pos, mode="clip"),
      shape,
    )

  def block_states(self, grid, shape):
    return self.mask.block_states(_TableGrid(grid, self.q_table, self.kv_table), shape)


_register(_Remapped, data_fields=("mask", "q_table", "kv_table"))
