"""Blocks in and out of the chunked kernels: what every walk of the block map, serial or parallel,
does to reach one tile, and nothing of the tile's math (that is `jattn._tile`'s).

A tile (i, j) is query block i against key/value block j. This module cuts those blocks out of
the sequence-major operands and writes results back (`q_tile`, `kv_tile`, `put_q_tile`), gives
a tile its positions, visibility and bias (`TileView`, `tile_view`), runs a block by its state
in the block map (`dispatch` on EMPTY / PARTIAL / FULL) and reports every computed block to the
test hook (`_BLOCK_HOOK`).

Layout: the kernels take and return arrays sequence-major, as callers hold them -- q and out
(B, Tp, N, H), k/v (B, Sp, K, H), lse (B, Tp, N), with Tp, Sp padded up to whole blocks -- and
transpose one block at a time into the head-major tiles of `jattn._tile` ((B, K, G, bq, H) and
(B, K, bk, H)); the forward's tile math stacks the G query heads of a group as rows,
(B, K, G * bq, .), see `_rows`. Transposing whole arrays up front instead costs a full-size copy
of every input and output per call (at T = 4096, N = 8, H = 64: 34.5 MiB of XLA temporaries
against 10.5).
The backward keeps its score tiles key-major, (B, K, bk, G, bq): see `_key_major` and
`jattn._chunked.grads._rows_matmul`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _sharding, _tile
from jattn._chunked.plan import Operands, Plan

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
