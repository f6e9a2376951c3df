"""Mask kinds that are boolean arrays broadcastable to (B, N, T, S): `from_array` (a traced array,
as jax.nn's ``mask``) and `static_array` (a NumPy array known at trace time, part of the compiled
program), with the per-block summary of an array and its part for one device."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _sharding, _validation
from jattn._types import ArrayLike
from jattn.masks._grid import _summary, _TableGrid
from jattn.masks._protocol import Cut, Mask, _register


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _ArrayMask(Mask):
  """A boolean array broadcastable to (B, N, T, S), as jax.nn's ``mask`` argument."""

  array: Any

  def validate(self, shape):

    _validation.broadcastable("masks.from_array: mask", self.array, shape, "(B, N, T, S)")

  def is_position_based(self):
    return False

  def can_take_part(self):
    return True

  def take_part(self, cut):
    return _array_part(self, cut)

  def evaluate(self, q_pos, kv_pos, shape):
    a = self.array
    if a.shape[2] != 1:
      a = jnp.take(a, q_pos, axis=2, mode="fill", fill_value=False)
    if a.shape[3] != 1:
      a = jnp.take(a, kv_pos, axis=3, mode="fill", fill_value=False)
    return a

  def block_states(self, grid, shape):
    return _array_block_states(jnp, self.array, grid)


def _array_block_states(xp, a, grid):
  """EMPTY/PARTIAL/FULL per block of a (b, n, t, s) boolean array (t, s: 1 or the full length),
  in NumPy for an array known at trace time, else in jax. On a `_TableGrid` (a `remap`ped mask)
  the array's rows and columns are first taken where the kernel's rows sit."""
  if isinstance(grid, _TableGrid):
    a, grid, xp = _table_rows(a, grid), grid.grid, jnp
  b, n, t, s = a.shape
  nq = grid.num_q_blocks if t != 1 else 1
  nk = grid.num_kv_blocks if s != 1 else 1
  bq = grid.block_q if t != 1 else 1
  bk = grid.block_kv if s != 1 else 1
  # Padding positions count as "visible" for FULL and "hidden" for EMPTY: they are neither.
  pad = ((0, 0), (0, 0), (0, nq * bq - t), (0, nk * bk - s))
  # Under an Explicit mesh a traced mask sharded along B or N keeps that sharding (_sharding's
  # reshape spells it out: jnp's cannot infer it for a split of T and S).
  blocks = (
    (lambda x: x.reshape(b, n, nq, bq, nk, bk))
    if xp is np
    else (lambda x: _sharding.sharded_reshape(x, (b, n, nq, bq, nk, bk)))
  )
  anyv = blocks(xp.pad(a, pad, constant_values=False)).any(axis=(3, 5))
  allv = blocks(xp.pad(a, pad, constant_values=True)).all(axis=(3, 5))
  return _summary(xp, ~anyv, allv)


def _array_part(mask, cut: Cut) -> Mask:
  """An array mask's examples and heads of ``cut`` (the mask itself where it has none to cut)."""
  a = mask.array
  if (cut.nb == cut.B or a.shape[0] != cut.B) and (cut.nh == cut.N or a.shape[1] != cut.N):
    return mask
  return _ArrayMask(cut.heads(cut.examples(a)))


def _table_rows(a, grid):
  """The rows (axis 2) and columns (axis 3) of a (b, n, t, s) array at a `_TableGrid`'s
  positions (of its T and S valid rows; axes of length 1 stay)."""
  a = jnp.asarray(a)
  if a.shape[2] != 1:
    a = jnp.take(a, grid.q_table[: grid.grid.T], axis=2, mode="clip")
  if a.shape[3] != 1:
    a = jnp.take(a, grid.kv_table[: grid.grid.S], axis=3, mode="clip")
  return a


_register(_ArrayMask, data_fields=("array",))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _StaticArrayMask(Mask):
  """A boolean NumPy array known when the call is traced, kept out of the traced arguments:
  part of the compiled program (a new array compiles anew), so its block map is static. What
  a kernel that needs the mask when it is built takes (splash attention)."""

  array: np.ndarray
  digest: str

  def validate(self, shape):

    _validation.broadcastable("mask", self.array, shape, "(B, N, T, S)")

  def take_part(self, cut):
    return _array_part(self, cut)

  def evaluate(self, q_pos, kv_pos, shape):
    return _ArrayMask(jnp.asarray(self.array)).evaluate(q_pos, kv_pos, shape)

  def block_states(self, grid, shape):
    return _array_block_states(np, self.array, grid)

  def __eq__(self, other):
    return isinstance(other, _StaticArrayMask) and self.digest == other.digest

  def __hash__(self):
    return hash(("static array", self.digest))


# No array leaves: the whole mask is static structure, compared and hashed by its digest.
jax.tree_util.register_pytree_node(_StaticArrayMask, lambda m: ((), m), lambda m, _: m)


def static_array(mask: np.ndarray) -> Mask:
  """``mask`` (a boolean NumPy array of rank <= 4 broadcastable to (B, N, T, S)) as a mask
  known at trace time (see `_StaticArrayMask`)."""
  import hashlib

  m = np.asarray(mask)
  m = m.reshape((1,) * (4 - m.ndim) + m.shape)
  digest = hashlib.sha1(repr(m.shape).encode() + np.packbits(m).tobytes()).hexdigest()
  return _StaticArrayMask(m, digest)


def from_array(mask: ArrayLike) -> Mask:
  """Wrap a boolean array broadcastable to (B, N, T, S) (True = attend)."""
  m = _validation.bool_array("masks.from_array: mask", mask, "a boolean array (True = attend)")
  if m.ndim > 4:
    raise ValueError(
      f"masks.from_array: mask must have rank <= 4, broadcastable to "
      f"(B, N, T, S), got shape {m.shape}"
    )
  return _ArrayMask(m.reshape((1,) * (4 - m.ndim) + m.shape))
