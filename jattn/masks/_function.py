"""The mask kind of a user predicate, `from_function`: ``fn(batch, head, q_index, kv_index)``
written with jnp ops, summarised block by block at run time, with the shift of its example and
head indices that a device's part carries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jattn import _validation
from jattn.masks._grid import EMPTY, FULL, PARTIAL
from jattn.masks._protocol import Mask, _register


@dataclasses.dataclass(frozen=True, slots=True)
class _FnMask(Mask):
  """A user predicate ``fn(batch, head, q_index, kv_index) -> bool`` written with jnp ops.

  The four index arguments are int32 arrays broadcastable against each other, of shapes
  (B,1,1,1), (1,N,1,1), (1,1,tq,1), (1,1,1,tk). Its block summary is evaluated block by block at
  run time (one (B, N, block_q, block_kv) window at a time, never a (T, S) array).
  """

  fn: Callable
  # Global index of local batch element 0 and query head 0 (one shard of a ring call).
  batch0: Any = 0
  head0: Any = 0

  def can_take_part(self):
    return True

  def take_part(self, cut):
    return self.shift_indices(cut.batch0, cut.head0)

  def shift_indices(self, batch0, head0):
    # Added to the mask's own shift (one already cut to a device's examples and heads).
    return _FnMask(self.fn, self.batch0 + batch0, self.head0 + head0)

  def unshifted(self):
    return dataclasses.replace(self, batch0=0, head0=0)

  def evaluate(self, q_pos, kv_pos, shape):
    B, N = shape[0], shape[1]
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None, None] + self.batch0
    h = jnp.arange(N, dtype=jnp.int32)[None, :, None, None] + self.head0
    out = self.fn(b, h, q_pos[None, None, :, None], kv_pos[None, None, None, :])
    out = jnp.asarray(out)
    if out.dtype != jnp.bool_:
      raise TypeError(f"mask_fn must return booleans, got dtype {out.dtype}")
    return jnp.broadcast_to(out, (B, N, q_pos.shape[0], kv_pos.shape[0]))

  def block_states(self, grid, shape):
    nq, nk = grid.num_q_blocks, grid.num_kv_blocks
    q_pos, q_ok = (jnp.asarray(a) for a in grid.q_blocks())
    kv_pos, kv_ok = (jnp.asarray(a) for a in grid.kv_blocks())

    def one(ij):
      i, j = ij // nk, ij % nk
      q, k = q_pos[i], kv_pos[j]
      inside = (q_ok[i][:, None] & kv_ok[j][None, :])[None, None]
      m = self.evaluate(q, k, shape)
      anyv = (m & inside).any(axis=(2, 3))
      allv = (m | ~inside).all(axis=(2, 3))
      return jnp.where(anyv, jnp.where(allv, FULL, PARTIAL), EMPTY).astype(jnp.int8)

    st = jax.lax.map(one, jnp.arange(nq * nk, dtype=jnp.int32))  # (nq*nk, B, N)
    return jnp.moveaxis(st.reshape(nq, nk, *st.shape[1:]), (0, 1), (2, 3))


_register(_FnMask, data_fields=("batch0", "head0"))


def from_function(mask_fn: Callable) -> Mask:
  """Mask from ``mask_fn(batch, head, q_index, kv_index) -> bool`` (jnp ops, broadcasting)."""
  return _FnMask(_validation.function("masks.from_function: mask_fn", mask_fn))
