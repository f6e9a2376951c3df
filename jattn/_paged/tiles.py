"""Query rows cut into tiles of one sequence each, and the way back: at most ``tq`` rows of a
sequence per tile (a decoding step: one tile per sequence), the keys each tile needs, and where
each tile row's results land among the query's rows. The tiles are cut at run time (the offsets
are data) from the sequences' runs of rows that `jattn._paged.metadata.owners` gives; the XLA
walk and the Pallas kernels take the same tiles.

A tree of new tokens (``new_token_mask``) places each new row at prefix + depth, not at its slot:
a tile then carries which of its sequence's new rows each tile row sees and their positions.

Shapes: B sequences, M tiles (``PagedPlan.max_tiles``) of tq rows, K key/value heads, G query
heads per key/value head, H head size, C a tree mask's columns.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from jattn._paged.metadata import Owners
from jattn._paged.plan import PagedPlan


class Tiles(NamedTuple):
  seq: Any  # (M,) the tile's sequence (clipped into range; see ``rows``)
  rows: Any  # (M, tq) the flat query row of each tile row, or -1 (none)
  pos: Any  # (M, tq) the position of each tile row (meaningless where rows is -1)
  lo: Any  # (M,) the first key position the tile needs
  hi: Any  # (M,) one past the last
  # With a new_token_mask (a tree; None without), C = its columns:
  sees: Any = None  # (M, tq, C) which new rows of its sequence each tile row sees
  new_pos: Any = None  # (M, C) the positions of its sequence's new keys (prefix + depth)
  first_new: Any = None  # (M,) the slot of its sequence's first new key (the prefix)


def cut(st: PagedPlan, at: Owners, kv_lengths, new_token_mask=None) -> Tiles:
  """Cut each sequence's query rows (``at``: their runs, a faulty sequence's empty) into tiles
  of at most tq rows. A padded query has one tile per sequence. ``kv_lengths`` (B,) as the walk
  reads them (a faulty sequence's 0)."""
  kv_lengths = kv_lengths.astype(jnp.int32)
  counts = at.count  # (B,) queries per sequence
  per_seq = (counts + st.tq - 1) // st.tq
  # Tiles of sequences 0 .. b, a running sum written as a triangular one: jaxlib 0.12's CPU
  # compiler aborts on the cumsum lowered for cuda (the accelerators' program run here).
  b = jnp.arange(st.B, dtype=jnp.int32)
  ends = jnp.where(b[:, None] >= b[None, :], per_seq[None, :], 0).sum(axis=1, dtype=jnp.int32)
  m = jnp.arange(st.max_tiles, dtype=jnp.int32)
  # The tile's sequence: how many sequences' tiles end at or before it (a count, not a
  # searchsorted, so that B may be a symbolic dimension of an exported program).
  seq = jnp.minimum((ends[None, :] <= m[:, None]).sum(axis=1, dtype=jnp.int32), st.B - 1)
  within = m - (ends[seq] - per_seq[seq])  # the tile's index within its sequence
  offset = within[:, None] * st.tq + jnp.arange(st.tq, dtype=jnp.int32)[None, :]
  valid = (m < ends[-1])[:, None] & (offset < counts[seq][:, None])
  rows = jnp.where(valid, at.start[seq][:, None] + offset, -1)
  # Bottom-right: the sequence's last query sits at its last cached position.
  pos = kv_lengths[seq][:, None] - counts[seq][:, None] + offset
  first_new = kv_lengths[seq] - counts[seq]
  tree = {}
  if st.tree:  # a tree's rows sit at prefix + depth, not at their slots
    sees, new_pos = _tree_rows(st, new_token_mask, at.start[seq], counts[seq], first_new)
    at_row = jnp.clip(offset, 0, st.tree - 1)  # (M, tq): the tile rows among the sequence's
    pos = jnp.take_along_axis(new_pos, at_row, axis=1)
    tree = dict(sees=jnp.take_along_axis(sees, at_row[..., None], 1), new_pos=new_pos)
  lo, hi = _key_range(
    st, jnp.where(valid, pos, jnp.int32(2**30)), jnp.where(valid, pos, -1), kv_lengths[seq]
  )
  if st.tree:
    # A tree's new keys lie at slots past their positions (prefix + i, not prefix + depth): a
    # tile with rows reads every one of them; the cached blocks are still cut by the window.
    some = valid.any(axis=1)
    lo = jnp.where(some, jnp.minimum(lo, first_new), lo)
    hi = jnp.where(some, kv_lengths[seq], hi)
    tree["first_new"] = first_new
  return Tiles(seq, rows, pos, lo, hi, **tree)


def _tree_rows(st: PagedPlan, new_token_mask, start, count, first_new):
  """A tree's rows per tile, of the tile's sequence (``start`` its first row, ``count`` its new
  rows and ``first_new`` its prefix, each (M,)): (sees (M, C, C), which of the sequence's new
  rows each sees, columns past its count cleared; new_pos (M, C), each new row's position,
  prefix + the rows it sees - 1)."""
  C = st.tree
  flat = new_token_mask.reshape(-1, C)  # (B * T | total, C)
  a = jnp.arange(C, dtype=jnp.int32)
  ok = a[None, :] < count[:, None]  # (M, C)
  sees = jnp.take(flat, jnp.clip(start[:, None] + a[None, :], 0, flat.shape[0] - 1), axis=0)
  sees = sees & ok[:, :, None] & ok[:, None, :]
  return sees, first_new[:, None] + sees.sum(axis=-1, dtype=jnp.int32) - 1


def _key_range(st: PagedPlan, pos_min, pos_max, kv_len):
  """[lo, hi) key positions a tile needs: keys below its sequence's length, and within its
  rows' causal and window reach."""
  lo_key = jnp.zeros_like(kv_len)
  hi_key = kv_len
  if st.window is not None and st.window[0] is not None:
    lo_key = jnp.maximum(lo_key, pos_min.min(axis=1) - st.window[0])
  reach = None
  if st.causal:
    reach = 0
  if st.window is not None and st.window[1] is not None:
    reach = st.window[1] if reach is None else min(reach, st.window[1])
  if reach is not None:
    hi_key = jnp.minimum(hi_key, pos_max.max(axis=1) + reach + 1)
  return lo_key, jnp.maximum(hi_key, lo_key)


def gather(st: PagedPlan, query, tiles: Tiles):
  """(M, K, G * tq, H): each tile's query rows (zeros for rows it does not have), the G heads of
  a group stacked as rows (row g * tq + t is query head k * G + g of tile row t)."""
  flat = query.reshape((-1,) + query.shape[-2:])  # (B * T | total, N, H)
  q = jnp.take(flat, jnp.maximum(tiles.rows, 0), axis=0)  # (M, tq, N, H)
  q = jnp.where((tiles.rows >= 0)[..., None, None], q, jnp.zeros((), q.dtype))
  M = q.shape[0]
  q = jnp.transpose(q.reshape(M, st.tq, st.K, st.G, st.H), (0, 2, 3, 1, 4))
  return q.reshape(M, st.K, st.G * st.tq, st.H)


def landing(st: PagedPlan, tiles: Tiles):
  """(M * tq,): the query row (of B * T padded, ``total`` ragged) each tile row's results go
  back to. Each row sits in one tile; tile rows holding none land past the end, each at its own
  place: indices without repeats, a scatter without atomics on a GPU."""
  n = st.B * st.rows if not st.ragged else st.rows
  rows = tiles.rows.reshape(-1)
  return jnp.where(rows >= 0, rows, n + jnp.arange(rows.shape[0], dtype=rows.dtype))
