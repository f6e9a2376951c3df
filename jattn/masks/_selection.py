"""`selected_blocks`: learned sparse attention's selection (NSA's top-n key blocks, MoBA's gated
blocks, DSA's top-k tokens at block size 1) as a mask: each query token, per KV head, sees the
key blocks it chose and nothing else.

The selection is (B, T, K, n) int block indices, -1 for an unused slot; query head h reads the
selection of KV head h // (N // K), as NSA shares one choice across the query heads of a GQA
group. It combines with every other mask by ``&`` (a query sees a key iff it is selected and
the rest allow it). Evaluated per tile by a binary search in each row's sorted choices (memory
O(tq x tk), no (T, S) array); summarised per block of the grid by sorting each query block's
choices, so the chunked engine skips the key blocks no query of a block chose. Neither step
scatters.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _sharding, _validation
from jattn._types import ArrayLike
from jattn.masks._grid import EMPTY, PARTIAL
from jattn.masks._protocol import Mask, _register

_NAME = "masks.selected_blocks"


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Selected(Mask):
  """Query t of example b, head h sees key s iff s // block_size is among
  ``chosen[b, t, h // (N // K)]``. ``chosen`` is the indices sorted along their last axis (the
  search below needs them sorted; which slot held a block does not matter)."""

  chosen: Any  # (B|1, T, K, n) int32, sorted along n
  block_size: int

  def validate(self, shape):
    B, N, T, _ = shape
    b, t, k, _ = self.chosen.shape
    if b not in (1, B) or t != T:
      raise ValueError(
        f"{_NAME}: indices must be (B, T, K, n) with B={B} (or 1) and T={T}, got shape "
        f"{self.chosen.shape}"
      )
    if k == 0 or N % k:
      raise ValueError(
        f"{_NAME}: indices' K={k} (axis 2) must divide the query heads N={N} (each query head "
        f"reads its group's selection)"
      )

  def check_known(self, shape):
    self.validate(shape)
    S = shape[3]
    blocks = -(-S // self.block_size)
    if isinstance(self.chosen, jax.core.Tracer):
      return  # traced: entries outside [0, blocks) select nothing, a repeat counts once
    known = np.asarray(self.chosen)
    bad = np.argwhere((known < -1) | (known >= blocks))
    if bad.size:
      i = tuple(int(a) for a in bad[0])
      raise ValueError(
        f"{_NAME}: indices must each be -1 (no block) or a key block in [0, {blocks}) "
        f"(S={S}, block_size={self.block_size}), got a row of indices[{i[0]}, {i[1]}, {i[2]}] "
        f"holding {int(known[i])}"
      )
    repeat = np.argwhere((known[..., 1:] == known[..., :-1]) & (known[..., 1:] >= 0))
    if repeat.size:
      i = tuple(int(a) for a in repeat[0])
      raise ValueError(
        f"{_NAME}: indices must not repeat a block within a row, got indices[{i[0]}, {i[1]}, "
        f"{i[2]}] holding block {int(known[i])} twice"
      )

  def selection(self):
    return self.chosen, self.block_size

  def can_take_part(self):
    return True

  def take_part(self, cut):
    chosen = cut.examples(self.chosen)
    K = self.chosen.shape[2]
    if K == 1 or cut.nh == cut.N:
      return _Selected(chosen, self.block_size)
    G = cut.N // K
    if cut.nh % G:
      raise NotImplementedError(
        f"{_NAME}: a part of {cut.nh} query heads splits a group of G={G} heads that share one "
        f"selection"
      )
    start = jnp.asarray(cut.head0) // G
    part = jax.lax.dynamic_slice_in_dim(chosen, start, cut.nh // G, axis=2)
    return _Selected(part, self.block_size)

  def evaluate(self, q_pos, kv_pos, shape):
    N = shape[1]
    K = self.chosen.shape[2]
    # Rows past T (a ragged last block) choose nothing.
    rows = jnp.take(self.chosen, q_pos, axis=1, mode="fill", fill_value=-1)  # (B, tq, K, n)
    rows = jnp.transpose(rows, (0, 2, 1, 3))  # (B, K, tq, n)
    block = (kv_pos // self.block_size).astype(rows.dtype)
    want = jnp.broadcast_to(block[None, None, None, :], rows.shape[:3] + block.shape)
    hit = _member(rows, want)  # (B, K, tq, tk)
    return jnp.repeat(hit, N // K, axis=1) if K != N else hit

  def block_states(self, grid, shape):
    _, N, _, _ = shape
    B, _, K, n = self.chosen.shape
    q_pos, q_valid = grid.q_blocks()  # (nq, bq)
    nq, bq = q_pos.shape
    rows = jnp.take(self.chosen, jnp.asarray(q_pos).reshape(-1), axis=1, mode="fill", fill_value=-1)
    rows = jnp.where(jnp.asarray(q_valid).reshape(1, -1, 1, 1), rows, -1)
    # Every choice of a query block, sorted: (B, K, nq, bq * n).
    per_block = jnp.sort(
      jnp.transpose(rows.reshape(B, nq, bq, K, n), (0, 3, 1, 2, 4)).reshape(B, K, nq, bq * n),
      axis=-1,
    )
    # The selection blocks each key block's valid positions span (a superset where a block's
    # positions are not contiguous: still sound, it only turns EMPTY into PARTIAL).
    kv_pos, kv_valid = grid.kv_blocks()
    kv_pos, kv_valid = jnp.asarray(kv_pos), jnp.asarray(kv_valid)
    big = jnp.iinfo(jnp.int32).max
    lo = jnp.where(kv_valid, kv_pos, big).min(-1) // self.block_size  # (nk,)
    hi = jnp.where(kv_valid, kv_pos, -1).max(-1) // self.block_size
    nk = lo.shape[0]
    lo_at = jnp.broadcast_to(lo.astype(per_block.dtype), (B, K, nq, nk))
    hi_at = jnp.broadcast_to((hi + 1).astype(per_block.dtype), (B, K, nq, nk))
    # A key block is chosen by someone in the query block iff a choice lies in [lo, hi].
    hit = _lower_bound(per_block, hi_at) > _lower_bound(per_block, lo_at)
    states = jnp.where(hit, PARTIAL, EMPTY).astype(jnp.int8)
    return jnp.repeat(states, N // K, axis=1) if K != N else states


_register(_Selected, data_fields=("chosen",))


def _lower_bound(sorted_rows, values):
  """For each entry of ``values`` (..., m), the number of entries of its row of
  ``sorted_rows`` (..., L) (sorted ascending) below it: a binary search of log2(L) gathers,
  O(m log L) work and O(m) memory."""
  L = sorted_rows.shape[-1]
  values = _sharding.reshard_to(values, _sharding.spec_of(sorted_rows))  # Explicit: as the rows
  pos = jnp.zeros_like(values, dtype=jnp.int32)  # sharded as the values
  for bit in reversed(range(max(L, 1).bit_length())):
    step = pos + (1 << bit)
    probe = jnp.take_along_axis(sorted_rows, jnp.minimum(step, L) - 1, axis=-1)
    pos = jnp.where((step <= L) & (probe < values), step, pos)
  return pos


def _member(sorted_rows, values):
  """Whether each entry of ``values`` (..., m) is in its row of ``sorted_rows`` (..., L)."""
  L = sorted_rows.shape[-1]
  values = _sharding.reshard_to(values, _sharding.spec_of(sorted_rows))  # Explicit: as the rows
  pos = _lower_bound(sorted_rows, values)
  found = jnp.take_along_axis(sorted_rows, jnp.minimum(pos, L - 1), axis=-1)
  return (pos < L) & (found == values)


def split_selection(mask: Mask | None) -> tuple[tuple[Mask, ...], Mask | None]:
  """(the `selected_blocks` among ``mask``'s &-ed parts, the AND of the other parts or None):
  what a path that gathers the selection's blocks takes apart (none of either for None)."""
  if mask is None:
    return (), None
  parts = mask.conjuncts()
  chosen = tuple(m for m in parts if m.selection() is not None)
  rest = [m for m in parts if m.selection() is None]
  return chosen, functools.reduce(lambda a, b: a & b, rest) if rest else None


def selected_blocks(indices: ArrayLike, block_size: int = 1) -> Mask:
  """Learned sparse attention's selection as a mask: each query token sees, per KV head, the
  key blocks it chose.

  Args:
    indices: int (B, T, K, n) (B may be 1: one selection for the batch): for query token t of
      example b and KV head k, the n key blocks it attends to, block c being keys
      [c * block_size, (c + 1) * block_size); -1 marks an unused slot. Query head h reads
      ``indices[:, :, h // (N // K)]`` (K = 1: one selection for every head, as DSA's indexer in
      MQA form; K = the call's KV heads: NSA's per-group selection).
    block_size: keys per block (NSA 64; 1 selects tokens, as DSA).

  Combine with ``&`` (or pass as ``mask=`` beside ``is_causal``, lengths, segments, a window):
  a query sees a key iff it is selected and the rest allow it; a row that selects nothing
  visible outputs 0. Known indices are checked when the call is traced (ValueError naming the
  first bad row): each -1 or a block in [0, ceil(S / block_size)), no block twice in a row.
  Traced indices are not checked: an entry outside that range selects nothing and a repeat
  counts once -- never another row's or example's keys.

  The work of `jattn.dot_product_attention` with this mask is that of the other masks (the
  chunked engine skips the key blocks no query of a block chose, which at long T is few).
  """
  idx: Any = _validation.int_array(f"{_NAME}: indices", indices)
  if idx.ndim != 4:
    raise ValueError(f"{_NAME}: indices must be (B, T, K, n), got shape {idx.shape}")
  if idx.shape[3] == 0:
    raise ValueError(
      f"{_NAME}: indices must hold at least one slot (n >= 1), got shape {idx.shape}"
    )
  size = _validation.positive_int(f"{_NAME}: block_size", block_size)
  return _Selected(jnp.sort(idx.astype(jnp.int32), axis=-1), size)
