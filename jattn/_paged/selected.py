"""paged_attention over each new token's selected keys (``key_selection``: a
`jattn.masks.selected_blocks`, DSA's top-k tokens at block size 1, NSA's key blocks): each row
reads only the keys it chose, through the page table, wherever they lie in the pool -- work and
reads O(rows x n x block), whatever the cached length.

A row is one query token of one sequence; per KV head its chosen blocks' positions go through
the page table to (page, slot) pairs, the keys and values there are gathered (dequantised with
their scales) and folded into the row's softmax by the arithmetic every paged walk shares
(`jattn._paged.fold`). A selected key is seen iff it is cached and causality and the window
allow it at the row's position, as without a selection; an entry that is -1, past the table's
reach, or a repeat (the entries are sorted: the second of two equal ones) selects nothing.

Shapes: R query rows (B * T padded, ``total`` ragged), N query heads, K KV heads, G = N // K,
H head size, Hv value head size, n slots per row, J = n * block keys a row reads per KV head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import _softmax
from jattn._paged import fold
from jattn._paged.metadata import Owners
from jattn._paged.plan import PagedPlan, Queries
from jattn._paged.pool import Pool
from jattn._validation import concrete

# Rows gathered and folded at once: their keys, ROWS_PER_STEP x K x J x H numbers, are the
# program's largest buffer (a prefill of many rows runs in steps of this many).
ROWS_PER_STEP = 16


def attend(st: PagedPlan, queries: Queries, pool: Pool, at: Owners):
  """(out (R, N, Hv) in the query's dtype, lse (R, N)) of every query row; ``pool``'s lengths
  are 0 for a faulty sequence (its rows see nothing) and ``at`` the rows' owners."""
  R = st.rows if st.ragged else st.B * st.rows
  chosen, block = queries.selection.chosen, queries.selection.block_size
  chosen = jnp.broadcast_to(chosen, (1 if st.ragged else st.B,) + chosen.shape[1:])
  chosen = jnp.broadcast_to(chosen.reshape((R,) + chosen.shape[2:]), (R, st.K, chosen.shape[-1]))
  lens = pool.kv_lengths.astype(jnp.int32)
  pos = lens[at.seq] - at.count[at.seq] + at.within  # bottom-right: the last row at lens - 1
  q = queries.query.reshape(R, st.K, st.G, st.H)

  def one_row(args):
    q_r, chosen_r, seq, pos_r, live = args
    keys, key_pos = _positions(st, chosen_r, block)  # (K, J) each
    table = pool.page_table[seq]
    pages = pool.key_pages.shape[0]
    page = jnp.clip(jnp.take(table, key_pos // st.page_size, mode="clip"), 0, pages - 1)
    slot = key_pos % st.page_size
    vis = fold.visible(st, key_pos[:, None, :], pos_r, live, lens[seq]) & keys[:, None, :]
    vis = jnp.broadcast_to(vis, (st.K, st.G, vis.shape[-1]))
    return _fold_row(st, pool, q_r, page.astype(jnp.int32), slot, vis)

  rows = (q, chosen, at.seq, pos, at.live)
  m, l, acc = jax.lax.map(one_row, rows, batch_size=ROWS_PER_STEP if concrete(R) else None)
  if queries.sinks is not None:
    sink = queries.sinks.astype(jnp.float32).reshape(1, st.K, st.G)
    m, l, acc = _softmax.join_sink(m, l, acc, sink)
  out = _softmax.normalize(acc, l, m, 0.0).astype(st.dtype)
  return out.reshape(R, st.N, st.Hv), _softmax.lse(m, l).reshape(R, st.N)


def _positions(st: PagedPlan, chosen, block: int):
  """(selected (K, J) bool, positions (K, J) int32) of a row's sorted choices (K, n): each
  slot's ``block`` positions, selected where the slot names a block within the page table's
  reach for the first time."""
  reach = st.max_pages * st.page_size
  blocks = -(-reach // block)
  first = jnp.concatenate(
    [jnp.ones(chosen.shape[:-1] + (1,), bool), chosen[..., 1:] != chosen[..., :-1]], -1
  )
  ok = (chosen >= 0) & (chosen < blocks) & first
  key_pos = (
    jnp.where(ok, chosen, 0)[..., None] * block + jnp.arange(block, dtype=jnp.int32)[None, None]
  )
  ok = jnp.broadcast_to(ok[..., None], key_pos.shape) & (key_pos < reach)
  K = chosen.shape[0]
  return ok.reshape(K, -1), key_pos.reshape(K, -1)


def _fold_row(st: PagedPlan, pool: Pool, q, page, slot, vis):
  """One row's (m (K, G), l (K, G), acc (K, G, Hv)): per KV head, its selected keys (page,
  slot) (K, J) gathered and folded (`fold.fold_page`) for the G query heads q (K, G, H) with
  visibility ``vis`` (K, G, J)."""
  seen = vis.any(axis=1)  # (K, J): some head of the group sees the key
  keys = _gather(st, pool.key_pages, page, slot, 0)
  if st.latent:
    values = keys[..., : st.Hv]
  else:
    values = pool.key_pages if pool.value_pages is None else pool.value_pages
    values = _gather(st, values, page, slot, 1)
  ks = _scale(st, pool.k_scale, st.k_scale_kind, page, slot, seen)
  vs = ks if st.latent else _scale(st, pool.v_scale, st.v_scale_kind, page, slot, seen)

  def head(q_k, k_k, v_k, ks_k, vs_k, vis_k):
    G = q_k.shape[0]
    m = jnp.full((G,), _softmax.NEG, jnp.float32)
    init = (m, jnp.zeros((G,), jnp.float32), jnp.zeros((G, st.Hv), jnp.float32))
    return fold.fold_page(st, init, q_k, k_k, v_k, ks_k, vs_k, vis_k)

  return jax.vmap(head)(q, keys, values, ks, vs, vis)


def _gather(st: PagedPlan, pages, page, slot, half: int):
  """The pool's entries at (page, slot) (K, J) for each KV head: (K, J, X); ``half`` picks a
  combined pool's key (0) or value (1) heads. Quantised pages (another dtype than the query's)
  become float32."""
  kh = jnp.arange(st.K, dtype=jnp.int32)[:, None]
  x = _take(st, pages, page, slot, 2 * kh + half if st.kv_layout == "combined" else kh)
  return x if x.dtype == st.dtype else x.astype(jnp.float32)


def _scale(st: PagedPlan, scale, kind, page, slot, seen):
  """A quantised pool's scales as `fold.fold_page` takes them per KV head: None, (K,) scalars
  or (K, 1, J); a hidden key's per-token scale zeroed (it may be garbage: 0 * NaN is NaN)."""
  if kind is None:
    return None
  if kind in ("tensor", "head"):
    return jnp.broadcast_to(scale.astype(jnp.float32), (st.K,))
  x = _take(st, scale, page, slot, jnp.arange(st.K, dtype=jnp.int32)[:, None])
  return jnp.where(seen, x.astype(jnp.float32), 0.0)[:, None, :]


def _take(st: PagedPlan, pool, page, slot, head):
  """``pool``'s entries (pages, or per-token scales) at (page, slot, head), laid out as
  ``st.kv_layout`` says: token-major (P, page_size, heads, ...) or head-major (P, heads,
  page_size, ...)."""
  return pool[page, head, slot] if st.kv_layout == "HND" else pool[page, slot, head]
