"""jattn's Pallas TPU kernel for paged attention: the pool read where it lies, page by page.

Why jattn's own kernel and not jax's: `jax.experimental.pallas.ops.tpu.ragged_paged_attention`
reads only the combined pool, takes no sinks, no per-head or per-token scales, no value head
size of its own, returns no log-sum-exp, and cannot run in Pallas's TPU interpret mode (jax
0.10 and 0.12 fail in its strided key/value loads), so nothing of it could be tested here;
`...tpu.paged_attention` wants pools laid out (K, P, page_size, H), which jattn's layouts would
have to be copied into on every call. This kernel walks jattn's own tiles (`jattn._paged.tiles.Tiles`:
query rows of one sequence) over their pages, in every layout jattn takes, and returns the
running softmax (m, l, acc) that the XLA walk returns, so the epilogue (sinks, normalisation,
log-sum-exp, rows back in place) is one for both.

The grid is (tiles, steps). A step reads ``ppb`` pages of the tile's sequence: the page ids
come from the page table through scalar prefetch, so each page is DMA'd from the pool by its
BlockSpec's index map, double-buffered by Pallas's pipeline. Steps a tile does not need map to
the block it already holds (no new copy) and skip their arithmetic. All K heads of a page are
read in one block, whose last two dimensions are whole ((K, H) token-major, (page_size, H)
head-major), as the TPU's tiling asks.

Reasoned, not measured: no TPU was available. The kernel is tested in interpret mode against
the float64 reference and lowered for TPU (Pallas to Mosaic) from this CPU; Mosaic's own
compiler only runs on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jattn import _softmax
from jattn._paged import fold

# Pages per grid step: about this many keys (whole pages; a longer page is a step of its own).
STEP_KEYS = 256


def pages_per_step(page_size: int, max_pages: int) -> int:
  return max(1, min(max_pages, STEP_KEYS // page_size))


def walk(st, q, tiles, pool):
  """(m, l, acc) of (M, K, R[, Hv]) float32, R = G * tq: every tile's running softmax over
  the keys of its range [tiles.lo, tiles.hi), as the XLA walk returns it."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  key_pages, value_pages, page_table, kv_lengths, k_scale, v_scale = pool  # (a `Pool`)
  kv_len = kv_lengths[tiles.seq]  # (M,) each tile's sequence's cached tokens
  # The pool's own pages (the XLA walk may cut long pages into pieces: not needed here).
  st = st._replace(
    page_size=st.page_size * st.sub, max_pages=st.max_pages // st.sub, sub=1, pages_per_block=1
  )
  M, K, R, H = q.shape
  ppb = pages_per_step(st.page_size, st.max_pages)
  steps = -(-st.max_pages // ppb)
  # First and last needed page of each tile, from its key range [lo, hi).
  lo_page = jnp.clip(tiles.lo // st.page_size, 0, st.max_pages).astype(jnp.int32)
  hi_page = jnp.clip(-(-tiles.hi // st.page_size), 0, st.max_pages).astype(jnp.int32)
  hi_page = jnp.maximum(hi_page, lo_page)
  base = tiles.pos[:, 0].astype(jnp.int32)  # position of each tile's row 0
  count = (tiles.rows >= 0).sum(axis=1).astype(jnp.int32)
  P = key_pages.shape[0]
  scalars = [
    page_table.astype(jnp.int32),
    tiles.seq.astype(jnp.int32),
    lo_page,
    hi_page,
    kv_len.astype(jnp.int32),
    base,
    count,
  ]
  # Scales per tensor or per head are scalars of the step (SMEM); per token, blocks of pages.
  for kind, scale in ((st.k_scale_kind, k_scale), (st.v_scale_kind, v_scale)):
    if kind in ("tensor", "head"):
      scalars.append(jnp.broadcast_to(scale.astype(jnp.float32), (K,)))

  def page_of(m, j, i, table, seq, lo, hi, *_):
    """The pool page that step j's i-th page of tile m reads: its sequence's page, clamped to
    the pages the tile needs (an unneeded step re-maps the block it holds: no copy)."""
    col = jnp.clip(j * ppb + i, lo[m], jnp.maximum(hi[m] - 1, lo[m]))
    col = jnp.minimum(col, st.max_pages - 1)
    return jnp.clip(table[seq[m], col], 0, P - 1)

  def pool_spec(x, i):
    shape = (None,) + x.shape[1:]
    return pl.BlockSpec(shape, lambda m, j, *s: (page_of(m, j, i, *s), 0, 0, 0))

  def scale_spec(x, i):
    return pl.BlockSpec((None,) + x.shape[1:], lambda m, j, *s: (page_of(m, j, i, *s), 0, 0))

  operands, specs = [q], [pl.BlockSpec((None, K, R, H), lambda m, j, *s: (m, 0, 0, 0))]
  pools = (key_pages,) if st.kv_layout == "combined" else (key_pages, value_pages)
  for pool in pools:
    operands += [pool] * ppb
    specs += [pool_spec(pool, i) for i in range(ppb)]
  for kind, scale in ((st.k_scale_kind, k_scale), (st.v_scale_kind, v_scale)):
    if kind == "token":
      operands += [scale.astype(jnp.float32)] * ppb
      specs += [scale_spec(scale, i) for i in range(ppb)]
  out_specs = [
    pl.BlockSpec((None, K, R), lambda m, j, *s: (m, 0, 0)),
    pl.BlockSpec((None, K, R), lambda m, j, *s: (m, 0, 0)),
    pl.BlockSpec((None, K, R, st.Hv), lambda m, j, *s: (m, 0, 0, 0)),
  ]
  out_shape = [jax.ShapeDtypeStruct((M, K, R), jnp.float32)] * 2 + [
    jax.ShapeDtypeStruct((M, K, R, st.Hv), jnp.float32)
  ]
  kernel = functools.partial(_kernel, st, ppb, len(pools))
  # Mosaic takes no 64-bit types: the kernel is traced with x64 off, whatever the caller has
  # (its operands are int32 and float32 already).
  with jax.enable_x64(False):
    return tuple(
      pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(scalars), grid=(M, steps), in_specs=specs, out_specs=out_specs
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name="jattn_paged_attention",
      )(*scalars, *operands)
    )


def _kernel(st, ppb, npools, _table, _seq, lo, hi, kv_len, base, count, *refs):
  """One step of one tile: fold its ``ppb`` pages into the running (m, l, acc) kept in the
  output blocks (resident across the steps of a tile)."""
  from jax.experimental import pallas as pl

  refs_ = list(refs)
  scales = []  # per key and value: (kind, ref): SMEM (K,) per head, or ppb page blocks
  for kind in (st.k_scale_kind, st.v_scale_kind):
    scales.append(("head", refs_.pop(0)) if kind in ("tensor", "head") else (kind, None))
  q_ref = refs_.pop(0)
  m_ref, l_ref, acc_ref = refs_[-3:]
  pages = [refs_[i * ppb : (i + 1) * ppb] for i in range(npools)]
  key_refs, value_refs = pages[0], pages[-1]
  rest = refs_[npools * ppb : -3]
  for n, (kind, _) in enumerate(scales):
    if kind == "token":
      scales[n], rest = (kind, rest[:ppb]), rest[ppb:]
  t, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j == 0)
  def _start():
    m_ref[...] = jnp.full(m_ref.shape, _softmax.NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  K, R = m_ref.shape
  tq = R // st.G
  row = jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0) % tq  # row g * tq + r is tile row r
  pos = base[t] + row
  real = row < count[t]
  for i in range(ppb):
    page = j * ppb + i

    @pl.when((page >= lo[t]) & (page < hi[t]))
    def _fold(i=i, page=page):
      key = page * st.page_size + jax.lax.broadcasted_iota(jnp.int32, (1, st.page_size), 1)
      vis = fold.visible(st, key, pos, real, kv_len[t])
      for k in range(K):
        ks, vs = _scale(st, scales, 0, k, i), _scale(st, scales, 1, k, i)
        carry = (m_ref[k], l_ref[k], acc_ref[k])
        m, l, acc = fold.fold_page(
          st,
          carry,
          q_ref[k],
          _head(st, key_refs[i], k, 0),
          _head(st, value_refs[i], k, 1),
          ks,
          vs,
          vis,
        )
        m_ref[k], l_ref[k], acc_ref[k] = m, l, acc


def _head(st, ref, k, half):
  """Head k's (page_size, X) slice of a page block, as the layout holds it."""
  if st.kv_layout == "HND":
    return ref[k]
  if st.kv_layout == "combined":
    return ref[:, 2 * k + half, :]
  return ref[:, k, :]


def _scale(st, scales, which, k, i):
  """Head k's scale for page i of the step: None, a scalar, or (1, page_size) per token."""
  kind, ref = scales[which]
  if kind is None:
    return None
  if kind == "head":
    return ref[k]
  page = ref[i]
  return (page[k] if st.kv_layout == "HND" else page[:, k])[None, :]
