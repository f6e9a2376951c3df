"""The XLA walk: every tile's running softmax over the key blocks of its sequence, each block
read from the pool where it lies (`jattn._paged.read`) and folded with the arithmetic the Pallas
kernels share (`jattn._paged.fold`). On the CPU one lane walks the blocks from the first any tile
needs to the last; on GPU and TPU the blocks are dealt over lanes side by side and merged by
log-sum-exp (split-KV). A tree's new keys are seen as its mask says (`_tree_keys`).

Shapes: M tiles of tq rows, K key/value heads, G query heads per key/value head (R = G * tq
rows of a tile and head), H and Hv head sizes, bk keys per block in c pieces.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jattn import _softmax
from jattn._paged import fold, read
from jattn._paged.plan import PagedPlan
from jattn._paged.pool import Pool
from jattn._paged.tiles import Tiles


def walk(st: PagedPlan, lanes: int, q, tiles: Tiles, pool: Pool):
  """Every tile's running softmax over its key blocks: (m, l, acc) of (M, K, G * tq[, Hv]).

  ``lanes`` lanes side by side, lane p taking blocks p, p + lanes, ... of every tile; one lane
  walks from the first block any tile needs to the last (bounds known at run time), several
  walk ceil(blocks / lanes) steps each (a static count) and are merged by log-sum-exp."""
  M = q.shape[0]
  like = jnp.zeros((M, st.K, st.G * st.tq), jnp.float32)
  m0, l0 = _softmax.start(like)
  acc0 = jnp.zeros((M, st.K, st.G * st.tq, st.Hv), jnp.float32)
  kv_len = pool.kv_lengths.astype(jnp.int32)[tiles.seq]
  first, last = _block_range(st, tiles)
  step = functools.partial(_block, st, q, tiles, (first, last), kv_len, pool)
  if lanes == 1:
    # int32 both (under jax_enable_x64 the range's arithmetic may come out int64).
    lo, hi = first.min().astype(jnp.int32), last.max().astype(jnp.int32)
    return jax.lax.fori_loop(lo, jnp.maximum(hi, lo), step, (m0, l0, acc0))
  steps = -(-st.blocks // lanes)

  def lane(p):
    body = lambda t, carry: step(t * lanes + p, carry)
    return jax.lax.fori_loop(0, steps, body, (m0, l0, acc0))

  m, l, acc = jax.vmap(lane)(jnp.arange(lanes, dtype=jnp.int32))
  return _softmax.merge_lanes(m, l, acc)


def _block_range(st: PagedPlan, tiles: Tiles):
  """[first, last) key blocks each tile needs."""
  first = jnp.clip(tiles.lo // st.block, 0, st.blocks)
  last = jnp.clip((tiles.hi + st.block - 1) // st.block, 0, st.blocks)
  return first, jnp.maximum(last, first)


def _block(st: PagedPlan, q, tiles: Tiles, needed, kv_len, pool: Pool, j, carry):
  """Fold key block j of every tile's sequence into the tiles' running (m, l, acc).

  The block reaches the matmuls as (M, c, K, bk / c, X): c pieces of keys per head, batched
  with the tile and the head, so that no head-major pool is relaid out. Quantised pages are
  only converted; their scales (one per key and head, or coarser) multiply the scores and the
  probabilities, which is the same sum: q . (k * s) = s * (q . k)."""
  m, l, acc = carry
  ids = read.page_ids(st, pool.page_table, tiles.seq, j, pool.key_pages.shape[0])
  k, ks = read.read(st, pool.key_pages, ids, pool.k_scale, st.k_scale_kind, q.dtype, heads=0)
  vis = _visible(st, tiles, kv_len, j)  # (M, 1, G * tq, bk)
  live = (j >= needed[0]) & (j < needed[1])
  vis = vis & live[:, None, None, None]
  # Hidden keys' values are zeroed: a masked weight is an exact 0, but 0 * NaN is NaN (a page
  # of garbage, past a sequence's last token, must not leak).
  M, c = q.shape[0], st.pieces
  keep = vis.any(axis=(1, 2)).reshape(M, c, 1, st.block // c, 1)
  if st.latent:
    v, vs = read.latent_values(st, k, ks, keep)
  else:
    kind = st.v_scale_kind
    v, vs = read.read(st, pool.value_pages, ids, pool.v_scale, kind, q.dtype, keep, heads=1)
  qp = jnp.broadcast_to(q[:, None].astype(k.dtype), (M, c) + q.shape[1:])
  s = jnp.einsum("mckxh,mckrh->mckrx", k, qp, preferred_element_type=jnp.float32)
  # (M, c, K, R, bk / c): the softmax runs on the pieces as they come
  s = fold.scores(st, s, ks, _pieces(st, vis))
  m_new, p, corr, l = _softmax.update(m, l, s, key_axes=(1, 4))
  if vs is not None:
    p = p * vs
  # Piece by piece, then summed: one contraction over (c, x) would relay V out per head.
  pv = jnp.einsum("mckrx,mckxh->mckrh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  pv = _softmax.ordered_sum(pv, 1)
  return m_new, l, acc * corr[..., None] + pv


def _pieces(st: PagedPlan, x):
  """(M, K', R, bk) -> (M, c, K', R, bk / c): a block's keys as its pieces."""
  c = st.pieces
  x = x.reshape(x.shape[:3] + (c, st.block // c))
  return jnp.moveaxis(x, 3, 1)


def _visible(st: PagedPlan, tiles: Tiles, kv_len, j):
  """(M, 1, G * tq, bk) bool: which keys of block j each tile row sees, in positions."""
  slot = j * st.block + jnp.arange(st.block, dtype=jnp.int32)  # (bk,)
  key, real = slot[None, None, :], (tiles.rows >= 0)[:, :, None]
  if st.tree:
    key, real = _tree_keys(st, tiles, slot, real)
  vis = fold.visible(
    st, key, tiles.pos[:, :, None], real, kv_len[:, None, None], slot=slot[None, None, :]
  )  # (M, tq, bk)
  M = vis.shape[0]
  vis = jnp.broadcast_to(vis[:, None], (M, st.G, st.tq, st.block))
  return vis.reshape(M, 1, st.G * st.tq, st.block)


def _tree_keys(st: PagedPlan, tiles: Tiles, slot, real):
  """A tree's keys at cache slots ``slot`` (bk,): (their positions (M, 1, bk) -- a cached key's
  is its slot, a new key's its row's depth position -- and ``real`` (M, tq, 1) narrowed to the
  keys each tile row sees by the mask, (M, tq, bk); cached keys pass it)."""
  c = slot[None, :] - tiles.first_new[:, None]  # (M, bk): the new row each slot holds
  new = c >= 0
  at = jnp.clip(c, 0, st.tree - 1)
  key = jnp.where(new, jnp.take_along_axis(tiles.new_pos, at, axis=1), slot[None, :])
  M = at.shape[0]
  at = jnp.broadcast_to(at[:, None, :], (M, st.tq, st.block))
  seen = jnp.take_along_axis(tiles.sees, at, axis=2) | ~new[:, None, :]
  return key[:, None, :], real & seen
