"""jattn's Pallas GPU (Triton) kernel for paged attention, split-KV, merged in a fixed order.

Why jattn's own kernel and not jax's: `jax.experimental.pallas.ops.gpu.paged_attention` wants
pools laid out (K, P, page_size, H) (jattn's layouts would be copied on every call), decodes one
query per sequence only, takes no window, sinks or value head size of its own and returns no
log-sum-exp; `...gpu.decode_attention` reads contiguous keys. This kernel walks jattn's own tiles
(`jattn._paged.tiles.Tiles`) over their pages in every layout jattn takes, folding pages with the same
arithmetic as the XLA walk and the TPU kernel (`jattn._paged.fold`).

The grid is (tiles, K heads, lanes). A program reads, for its tile and key/value head, the whole
pool of that head as a strided reference (no copy) and gathers ``ppb`` pages a step by their ids
from the page table. A tile's pages are cut into ``lanes`` contiguous runs (split-KV: a decoding
step of few sequences still fills the GPU); each lane returns its running (m, l, acc) and the
lanes are merged by log-sum-exp in XLA, in a fixed order: no atomics, so the result does not vary
from run to run, and a sequence's split never depends on the other sequences of the batch.

Reasoned, not measured: no GPU was available. The kernel is tested in Pallas's interpret mode on
the CPU (`jattn._lowering.gpu_interpret_mode`) and lowered for CUDA (Pallas to Triton) from the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jattn import _softmax
from jattn._chunked.plan import SPLIT_KV_PARTS
from jattn._paged import fold

# Keys per step: Triton's matmul tiles want 16 or more rows and powers of two; 64 keys keep a
# step's keys and values of head size 128 within a streaming multiprocessor's shared memory.
STEP_KEYS = 64
# Split-KV lanes: as many as the XLA walk's and the chunked kernels' (with B x K programs per
# lane, 16 lanes fill an H100/H200's 132 SMs at B x K >= 8; reasoned).
SPLIT_PARTS = SPLIT_KV_PARTS


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def supports(st) -> str | None:
  """None, or why Triton cannot take a planned call's sizes (a `PagedPlan`; a symbolic B is
  refused for both kernels by `jattn._paged.plan.why_no_kernel`)."""
  ps = st.page_size * st.sub
  for name, size in (("page_size", ps), ("H", st.H), ("Hv", st.Hv)):
    if not _pow2(size) or (name != "page_size" and size < 16):
      return (
        f"{name}={size}: Triton's loads and matmuls take powers of two (head sizes of 16 or more)"
      )
  return None


def walk(st, q, tiles, pool, *, interpret: bool = False):
  """(m, l, acc) of (M, K, R[, Hv]) float32, R = G * tq: as the XLA walk returns them."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  key_pages, value_pages, page_table, kv_lengths, k_scale, v_scale = pool  # (a `Pool`)
  kv_len = kv_lengths.astype(jnp.int32)[tiles.seq]  # (M,) each tile's sequence's keys
  st = st._replace(
    page_size=st.page_size * st.sub, max_pages=st.max_pages // st.sub, sub=1, pages_per_block=1
  )
  M, K, R, H = q.shape
  ps = st.page_size
  ppb = max(1, STEP_KEYS // ps)
  steps = -(-st.max_pages // ppb)
  lanes = max(1, min(SPLIT_PARTS, steps))
  Rp = max(16, 1 << (R - 1).bit_length())  # Triton's matmul rows: a power of two, 16 or more
  q = jnp.pad(q, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
  table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, steps * ppb - st.max_pages)))
  lo = jnp.clip(tiles.lo // ps, 0, st.max_pages)
  hi = jnp.maximum(jnp.clip(-(-tiles.hi // ps), 0, st.max_pages), lo)
  info = jnp.stack(
    [tiles.seq, lo, hi, kv_len, tiles.pos[:, 0], (tiles.rows >= 0).sum(axis=1, dtype=jnp.int32)]
    + [jnp.zeros_like(lo)] * 2,
    axis=1,
  ).astype(jnp.int32)  # (M, 8)

  P = key_pages.shape[0]
  operands = [info, table, q]
  specs = [
    pl.BlockSpec((None, 8), lambda m, k, p: (m, 0)),
    pl.BlockSpec(table.shape, lambda m, k, p: (0, 0)),
    pl.BlockSpec((None, None, Rp, H), lambda m, k, p: (m, k, 0, 0)),
  ]
  for half, pool in ((0, key_pages), (1, key_pages if st.kv_layout == "combined" else value_pages)):
    operands.append(pool)
    specs.append(_head_spec(st, pool.shape, half))
  for kind, scale in ((st.k_scale_kind, k_scale), (st.v_scale_kind, v_scale)):
    if kind == "token":
      operands.append(scale.astype(jnp.float32))
      specs.append(_head_spec(st, scale.shape, 0))
    elif kind is not None:
      operands.append(jnp.broadcast_to(scale.astype(jnp.float32), (K,)))
      specs.append(pl.BlockSpec((K,), lambda m, k, p: (0,)))
  lane_spec = lambda *rest: pl.BlockSpec(
    (None, None, None, Rp) + rest, lambda m, k, p: (p, m, k, 0) + (0,) * len(rest)
  )
  out_shape = [jax.ShapeDtypeStruct((lanes, M, K, Rp), jnp.float32)] * 2 + [
    jax.ShapeDtypeStruct((lanes, M, K, Rp, st.Hv), jnp.float32)
  ]
  m, l, acc = pl.pallas_call(
    functools.partial(_kernel, st, ppb, lanes, R, P),
    grid=(M, K, lanes),
    in_specs=specs,
    out_specs=[lane_spec(), lane_spec(), lane_spec(st.Hv)],
    out_shape=out_shape,
    interpret=interpret,
    name="jattn_paged_attention",
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
  )(*operands)
  # Lanes merged in a fixed order (no scatter, no atomics): the same bits every run.
  m, l, acc = _softmax.merge_lanes(m, l, acc)
  return m[..., :R], l[..., :R], acc[..., :R, :]


def _head_spec(st, shape, half):
  """A pool (or its per-token scales) as head k's strided reference, (P, page_size[, X])."""
  from jax.experimental import pallas as pl

  if st.kv_layout == "HND":
    block = (shape[0], None) + shape[2:]
    return pl.BlockSpec(block, lambda m, k, p: (0, k) + (0,) * (len(shape) - 2))
  if st.kv_layout != "combined" or len(shape) == 3:  # a combined pool's scales are (P, ps, K)
    half, heads = 0, 1
  else:  # key head k at 2k, its values at 2k + 1
    heads = 2
  block = shape[:2] + (None,) + shape[3:]
  return pl.BlockSpec(block, lambda m, k, p: (0, 0, heads * k + half) + (0,) * (len(shape) - 3))


def _kernel(st, ppb, lanes, R, P, info_ref, table_ref, q_ref, k_ref, v_ref, *refs):
  """One (tile, head, lane) program: fold the lane's run of the tile's pages."""
  from jax.experimental import pallas as pl

  *scale_refs, m_ref, l_ref, acc_ref = refs
  scales = []
  for kind in (st.k_scale_kind, st.v_scale_kind):
    scales.append((kind, scale_refs.pop(0)) if kind is not None else (None, None))
  k, lane = pl.program_id(1), pl.program_id(2)
  seq, lo, hi, kv_len, base, count = (info_ref[i] for i in range(6))
  bk = ppb * st.page_size
  first, last = lo // ppb, (hi + ppb - 1) // ppb
  run = (last - first + lanes - 1) // lanes
  start = first + lane * run
  stop = jnp.minimum(last, start + run)
  Rp = q_ref.shape[0]
  row = jax.lax.broadcasted_iota(jnp.int32, (Rp, 1), 0)
  pos = base + row % (R // st.G)
  real = (row < R) & (row % (R // st.G) < count)
  q = q_ref[...]

  def step(j, carry):
    pages = jnp.clip(table_ref[seq, pl.ds(j * ppb, ppb)], 0, P - 1)
    keys = k_ref[pages].reshape(bk, -1)
    values = v_ref[pages].reshape(bk, -1)
    key = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    vis = fold.visible(st, key, pos, real, kv_len)
    ks, vs = (_scale(kind, ref, pages, k, bk) for kind, ref in scales)
    return fold.fold_page(st, carry, q, keys, values, ks, vs, vis)

  carry = (
    jnp.full((Rp,), _softmax.NEG, jnp.float32),
    jnp.zeros((Rp,), jnp.float32),
    jnp.zeros((Rp, acc_ref.shape[-1]), jnp.float32),
  )
  m, l, acc = jax.lax.fori_loop(start, jnp.maximum(stop, start), step, carry)
  m_ref[...] = m
  l_ref[...] = l
  acc_ref[...] = acc


def _scale(kind, ref, pages, k, bk):
  """This head's key or value scale for a step's pages: None, a scalar, or (1, bk)."""
  if kind is None:
    return None
  if kind == "token":
    return ref[pages].reshape(1, bk)
  return ref[k]
