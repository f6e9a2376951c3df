"""The Pallas GPU (Triton) kernels of implementation="pallas_gpu" (`jattn._backends.pallas_gpu`
holds the call: what it takes, block sizes, padding, the custom VJP): the forward, grid (query
blocks, B, N), walking each row block's key blocks with the online softmax; the backward's dK/dV
kernel, grid (key blocks, B, K), looping over a group's G query heads and their query blocks so
that no two programs write the same rows; its dQ kernel, grid (query blocks, B, N). The walks
visit only the blocks that meet the band ``q + lo <= k <= q + hi`` and mask by position only the
blocks its edges cross (`_walk`). None of them has a derivative of its own beyond the gradient
(`without_derivative`). Shape vocabulary: B T S N K H, Hv the value head size, G = N // K.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import _softmax
from jattn._softmax import NEG

# Default block sizes (reasoned): 64 x 64 tiles keep a block of keys and values of head size 128
# in 16-bit (16 KiB each) within a streaming multiprocessor's shared memory with two pipeline
# stages, and a 64-row query block in registers.
DEFAULT_BLOCK = 64
MIN_BLOCK = 16  # Triton's matmul tiles: powers of two, 16 or more


class Padded(NamedTuple):
  """The arrays every kernel reads, on the problem padded to whole blocks (one pytree: the custom
  VJP's operand and residual): q (B, Tp, N, H), k (B, Sp, K, H), v (B, Sp, K, Hv), sinks (N,)
  float32 or None, q_ids (B, Tp) and kv_ids (B, Sp) int32 (query t sees key s iff their ids are
  equal), info (B, 8) int32 (column 0: the example's key length)."""

  q: Any
  k: Any
  v: Any
  sinks: Any
  q_ids: Any
  kv_ids: Any
  info: Any


def _refuse_derivative(plan, primals, tangents):
  del plan, primals, tangents
  raise NotImplementedError(
    "higher-order AD (a derivative of the gradient) of implementation='pallas_gpu': its "
    "kernels have no derivative of their own beyond the gradient; use "
    "implementation='chunked' or 'dense'"
  )


def without_derivative(fn):
  """``fn(plan, *arrays)`` whose derivative raises NotImplementedError: the kernels' own
  (pallas_call's) would fail with an unhelpful message in a gradient of the gradient."""
  fn = jax.custom_jvp(fn, nondiff_argnums=(0,))
  fn.defjvp(_refuse_derivative)
  return fn


# --------------------------------------------------------------------------------------------
# The kernels.
# --------------------------------------------------------------------------------------------


def _dot(a, b, contract):
  """a @ b in float32 with a's axis contract[0] against b's contract[1] (2-D operands)."""
  return jax.lax.dot_general(
    a, b, ((contract[:1], contract[1:]), ((), ())), preferred_element_type=jnp.float32
  )


def _logits(plan, q, k):
  """(s, t): the (rows, keys) float32 logits scaled and soft-capped, and tanh(s / cap) (None
  without a cap) for the backward's derivative cap * tanh' = 1 - t^2."""
  s = _dot(q, k, (1, 1)) * plan.scale
  if plan.cap is None:
    return s, None
  t = jnp.tanh(s / plan.cap)
  return plan.cap * t, t


def _masked(plan, s, rows, cols, q_id, kv_id, band: bool):
  """The (rows, keys) logits ``s`` with NEG where the ids differ (if the plan compares ids) or,
  for a tile the band crosses (``band``), where the band hides the key; rows, cols: positions.
  A tile inside the band with nothing to compare is returned as it is."""
  vis = None
  if plan.ids:
    vis = q_id[:, None] == kv_id[None, :]
  for edge, inside in (
    (plan.lo, lambda e: cols[None, :] >= rows[:, None] + e),
    (plan.hi, lambda e: cols[None, :] <= rows[:, None] + e),
  ):
    if band and edge is not None:
      vis = inside(edge) if vis is None else vis & inside(edge)
  return s if vis is None else jnp.where(vis, s, NEG)


def _walk(plan, blocks, step, carry):
  """fori_loop of ``step(j, carry, band)`` over the blocks [lo, hi), ``band`` False on the blocks
  [inside_lo, inside_hi) that lie inside the band (clipped to [lo, hi)), ``blocks`` = (lo, hi,
  inside_lo, inside_hi): only the blocks the band's edges cross pay for its mask."""
  lo, hi, inside_lo, inside_hi = blocks
  if plan.lo is None and plan.hi is None:
    return jax.lax.fori_loop(lo, hi, functools.partial(step, band=False), carry)
  a = jnp.clip(inside_lo, lo, hi)
  b = jnp.clip(inside_hi, a, hi)
  carry = jax.lax.fori_loop(lo, a, functools.partial(step, band=True), carry)
  carry = jax.lax.fori_loop(a, b, functools.partial(step, band=False), carry)
  return jax.lax.fori_loop(b, hi, functools.partial(step, band=True), carry)


def _key_blocks(plan, first_row, last_row, kv_len):
  """(j0, j1, ja, jb): the key blocks [j0, j1) rows first_row..last_row may see (band and key
  length), and [ja, jb) those whose every key every row's band holds."""
  bk = plan.bk
  start = 0 if plan.lo is None else jnp.maximum(first_row + plan.lo, 0)
  stop = kv_len if plan.hi is None else jnp.minimum(kv_len, last_row + plan.hi + 1)
  j0 = start // bk
  j1 = jnp.maximum((stop + bk - 1) // bk, j0)
  # Inside: the block's first key at or after the last row's left edge, its last key at or
  # before the first row's right edge (clipped at 0 first: the divisions round down).
  ja = j0 if plan.lo is None else (jnp.maximum(last_row + plan.lo, 0) + bk - 1) // bk
  jb = j1 if plan.hi is None else jnp.maximum(first_row + plan.hi + 1, 0) // bk
  return j0, j1, ja, jb


def _query_blocks(plan, first_col, last_col):
  """(i0, i1, ia, ib): the query blocks [i0, i1) whose rows may see keys first_col..last_col
  (the band), and [ia, ib) those whose every row's band holds every one of these keys."""
  bq = plan.bq
  start = 0 if plan.hi is None else jnp.maximum(first_col - plan.hi, 0)
  stop = plan.Tp if plan.lo is None else jnp.clip(last_col - plan.lo + 1, 0, plan.Tp)
  i0 = start // bq
  i1 = jnp.maximum((stop + bq - 1) // bq, i0)
  # Inside: the block's first row at or after last_col - hi, its last row at or before
  # first_col - lo.
  ia = i0 if plan.hi is None else (jnp.maximum(last_col - plan.hi, 0) + bq - 1) // bq
  ib = i1 if plan.lo is None else jnp.maximum(first_col - plan.lo + 1, 0) // bq
  return i0, i1, ia, ib


def _pallas_call(plan, kernel, *, grid, in_specs, out_specs, out_shape, name, operands):
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    interpret=plan.interpret,
    name=name,
    compiler_params=plgpu.CompilerParams(num_warps=plan.warps(), num_stages=2),
  )(*operands)


@without_derivative
def forward(plan, ops: Padded):
  from jax.experimental import pallas as pl

  q, k, v, sinks, q_ids, kv_ids, info = ops
  B, Tp, N, H = q.shape
  Sp, Hv = k.shape[1], v.shape[3]
  bq, G = plan.bq, plan.G
  rows = lambda i, b, n: (b, i)
  specs = [
    pl.BlockSpec((None, 8), lambda i, b, n: (b, 0)),
    pl.BlockSpec((None, bq, None, H), lambda i, b, n: (b, i, n, 0)),
    pl.BlockSpec((None, Sp, None, H), lambda i, b, n: (b, 0, n // G, 0)),
    pl.BlockSpec((None, Sp, None, Hv), lambda i, b, n: (b, 0, n // G, 0)),
    pl.BlockSpec((None, bq), rows),
    pl.BlockSpec((None, Sp), lambda i, b, n: (b, 0)),
  ]
  operands = [info, q, k, v, q_ids, kv_ids]
  if sinks is not None:
    # One row of bq copies per head: the kernel starts its running max from a vector.
    operands.append(jnp.broadcast_to(sinks.astype(jnp.float32)[:, None], (N, bq)))
    specs.append(pl.BlockSpec((None, bq), lambda i, b, n: (n, 0)))
  return _pallas_call(
    plan,
    functools.partial(_forward_kernel, plan),
    grid=(Tp // bq, B, N),
    in_specs=specs,
    out_specs=[
      pl.BlockSpec((None, bq, None, Hv), lambda i, b, n: (b, i, n, 0)),
      pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((B, Tp, N, Hv), q.dtype),
      jax.ShapeDtypeStruct((B, N, Tp), jnp.float32),
    ],
    name="jattn_flash_forward",
    operands=operands,
  )


def _forward_kernel(plan, info_ref, q_ref, k_ref, v_ref, qid_ref, kvid_ref, *refs):
  """One (query block, example, head) program: the online softmax over its key blocks."""
  from jax.experimental import pallas as pl

  *sink_ref, o_ref, lse_ref = refs
  bq, bk = plan.bq, plan.bk
  i = pl.program_id(0)
  rows = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)
  q, q_id = q_ref[...], qid_ref[...]

  def step(j, carry, band):
    m, l, acc = carry
    keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
    v = v_ref[keys, :]
    s, _ = _logits(plan, q, k_ref[keys, :])
    cols = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
    s = _masked(plan, s, rows, cols, q_id, kvid_ref[keys], band)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_new[:, None])
    corr = jnp.exp(m - m_new)
    return (
      m_new,
      l * corr + p.sum(axis=1),
      acc * corr[:, None] + _dot(p.astype(v.dtype), v, (1, 0)),
    )

  # A sink starts each row as its first logit (m = sink, l = 1); else nothing seen (m = NEG).
  if sink_ref:
    m0, l0 = sink_ref[0][...], jnp.ones((bq,), jnp.float32)
  else:
    m0, l0 = jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32)
  m, l, acc = _walk(
    plan,
    _key_blocks(plan, i * bq, i * bq + bq - 1, info_ref[0]),
    step,
    (m0, l0, jnp.zeros((bq, o_ref.shape[-1]), jnp.float32)),
  )
  # A row that saw no key keeps m = NEG (with a sink m >= sink, and its masked entries added
  # exact zeros): output 0, lse NEG. Its l counted junk exp(NEG - NEG) = 1s, discarded here.
  ok = ~_softmax.empty_rows(m, l)
  denom = jnp.where(ok, l, 1.0)
  o_ref[...] = jnp.where(ok[:, None], acc / denom[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(ok, m + jnp.log(denom), NEG)


def backward_kv(plan, ops: Padded, d_out, lse, delta):
  """(dK (B, Sp, K, H), dV (B, Sp, K, Hv)) in k's and v's dtypes: one program per key block of
  each key/value head, looping over the G query heads of its group. ``d_out`` (B, Tp, N, Hv) in
  q's dtype; ``lse`` (for recomputing) and ``delta`` (B, N, Tp) float32."""
  from jax.experimental import pallas as pl

  q, k, v, q_ids, kv_ids = ops.q, ops.k, ops.v, ops.q_ids, ops.kv_ids
  B, Tp, _N, H = q.shape
  Sp, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  bk, G = plan.bk, plan.G
  group = lambda *rest: pl.BlockSpec((None, Tp, G) + rest, lambda j, b, h: (b, 0, h, 0))
  stat = pl.BlockSpec((None, G, Tp), lambda j, b, h: (b, h, 0))
  block = lambda X: pl.BlockSpec((None, bk, None, X), lambda j, b, h: (b, j, h, 0))
  return _pallas_call(
    plan,
    functools.partial(_backward_kv_kernel, plan),
    grid=(Sp // bk, B, K),
    in_specs=[
      group(H),
      block(H),
      block(Hv),
      group(Hv),
      stat,
      stat,
      pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),
      pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
    ],
    out_specs=[block(H), block(Hv)],
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    name="jattn_flash_backward_kv",
    operands=[q, k, v, d_out, lse, delta, q_ids, kv_ids],
  )


def _backward_kv_kernel(
  plan, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qid_ref, kvid_ref, dk_ref, dv_ref
):
  """One (key block, example, key/value head) program: dK and dV summed over the G query
  heads of the group and the query blocks that see the keys."""
  from jax.experimental import pallas as pl

  bq, bk = plan.bq, plan.bk
  j = pl.program_id(0)
  cols = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
  k, v, kv_id = k_ref[...], v_ref[...], kvid_ref[...]
  blocks = _query_blocks(plan, j * bk, j * bk + bk - 1)

  def step(i, carry, g, band):
    dk, dv = carry
    at = pl.ds(pl.multiple_of(i * bq, bq), bq)
    q, do = q_ref[at, g, :], do_ref[at, g, :]
    rows = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)
    s, t = _logits(plan, q, k)
    s = _masked(plan, s, rows, cols, qid_ref[at], kv_id, band)
    p = jnp.exp(s - lse_ref[g, at][:, None])
    dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
    ds = p * (_dot(do, v, (1, 1)) - delta_ref[g, at][:, None])
    if t is not None:
      ds = ds * (1.0 - t * t)
    return dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv

  def head(g, carry):
    return _walk(plan, blocks, functools.partial(step, g=g), carry)

  dk, dv = jax.lax.fori_loop(
    0,
    plan.G,
    head,
    (jnp.zeros((bk, k.shape[-1]), jnp.float32), jnp.zeros((bk, v.shape[-1]), jnp.float32)),
  )
  dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward_q(plan, ops: Padded, d_out, lse, delta):
  """dQ (B, Tp, N, H) in q's dtype: one program per query block of each head (``d_out``,
  ``lse``, ``delta`` as for `backward_kv`)."""
  from jax.experimental import pallas as pl

  q, k, v, _, q_ids, kv_ids, info = ops
  B, Tp, N, H = q.shape
  Sp, Hv = k.shape[1], v.shape[3]
  bq, G = plan.bq, plan.G
  rows = lambda X: pl.BlockSpec((None, bq, None, X), lambda i, b, n: (b, i, n, 0))
  whole = lambda X: pl.BlockSpec((None, Sp, None, X), lambda i, b, n: (b, 0, n // G, 0))
  stat = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
  return _pallas_call(
    plan,
    functools.partial(_backward_q_kernel, plan),
    grid=(Tp // bq, B, N),
    in_specs=[
      pl.BlockSpec((None, 8), lambda i, b, n: (b, 0)),
      rows(H),
      whole(H),
      whole(Hv),
      rows(Hv),
      stat,
      stat,
      pl.BlockSpec((None, bq), lambda i, b, n: (b, i)),
      pl.BlockSpec((None, Sp), lambda i, b, n: (b, 0)),
    ],
    out_specs=rows(H),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    name="jattn_flash_backward_q",
    operands=[info, q, k, v, d_out, lse, delta, q_ids, kv_ids],
  )


def _backward_q_kernel(
  plan, info_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qid_ref, kvid_ref, dq_ref
):
  """One (query block, example, head) program: dQ over the key blocks its rows see."""
  from jax.experimental import pallas as pl

  bq, bk = plan.bq, plan.bk
  i = pl.program_id(0)
  rows = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)
  q, do, q_id = q_ref[...], do_ref[...], qid_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]

  def step(j, dq, band):
    keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
    k = k_ref[keys, :]
    s, t = _logits(plan, q, k)
    cols = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
    s = _masked(plan, s, rows, cols, q_id, kvid_ref[keys], band)
    p = jnp.exp(s - lse[:, None])
    ds = p * (_dot(do, v_ref[keys, :], (1, 1)) - delta[:, None])
    if t is not None:
      ds = ds * (1.0 - t * t)
    return dq + _dot(ds.astype(k.dtype), k, (1, 0))

  dq = _walk(
    plan,
    _key_blocks(plan, i * bq, i * bq + bq - 1, info_ref[0]),
    step,
    jnp.zeros((bq, q_ref.shape[-1]), jnp.float32),
  )
  dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)
