"""``implementation="sparse"``: attention over each query's selected key blocks only
(`jattn.masks.selected_blocks`: NSA, MoBA, DSA), in work O(T x n x block) instead of O(T x S).

Everything runs key-major, through the inverse selection: the (token, slot) pairs of one example
and KV head are sorted by (block, token) -- a stable sort, so the order is fixed -- and cut into
chunks of one block each (each block's run padded to whole chunks). A chunk is a real matmul:
its pairs' queries (G x P rows, gathered: G x H numbers a pair) against its block's keys, read
in place. The forward keeps each token's running softmax statistics in a buffer and merges every
chunk's pairs into their tokens' rows; the backward adds each chunk's dQ share into its tokens'
rows and sums a block's dK and dV over its chunks in chunk order, writing the block once. No
two pairs of a chunk share a row (a token chooses a block once), chunks run in their fixed
order: every scatter declares unique indices, nothing is added by atomics, and the results are
bitwise reproducible. Examples run one at a time (the program is the same whatever B is: an
example's result is the same bits alone and in a batch). The rest of the call's mask (causal,
a window, lengths, segments, any mask kind that cuts to one example and head group) is
evaluated at each pair's token and block.

Shapes: B batch, T queries, S keys, N query heads, K KV heads, G = N // K, H head size, n
slots per row, P pairs per chunk.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _softmax, _tile
from jattn import masks as _masks

# (token, slot) pairs per chunk: G x 128 query rows a matmul against one block.
PAIRS_PER_CHUNK = 128


def _split(mask):
  """((choices, block size), the AND of the mask's other conjuncts or None), or a reason."""
  if mask is None:
    return "no selection: implementation='sparse' needs a masks.selected_blocks mask"
  parts = mask.conjuncts()
  chosen = [m for m in parts if m.selection() is not None]
  if len(chosen) != 1:
    return (
      f"mask: implementation='sparse' needs exactly one masks.selected_blocks among the mask's "
      f"&-ed parts, got {len(chosen)}"
    )
  rest = [m for m in parts if m is not chosen[0]]
  return chosen[0].selection(), functools.reduce(lambda a, b: a & b, rest) if rest else None


def supports(call) -> str | None:
  """None, or why the sparse path cannot take this call."""
  split = _split(call.mask)
  if isinstance(split, str):
    return split
  (chosen, _), rest = split
  s = call.static
  Ks = chosen.shape[2]
  if Ks not in (1, s.K):
    return (
      f"mask: a selection per {Ks} heads (implementation='sparse' takes one per KV head, "
      f"K={s.K}, or one for all heads)"
    )
  if rest is not None and not _masks.can_take_part(rest):
    return "mask: a part of the mask that does not cut to one example and head group"
  for what, given in (
    ("bias", call.bias is not None),
    ("dropout_rate", s.opts.dropout_rate > 0),
    ("score_mod", s.opts.score_mod is not None),
    ("return_max_logits", s.opts.return_max_logits),
  ):
    if given:
      return f"{what}: not taken by implementation='sparse' yet (use 'chunked')"
  if any(x is not None for x in call.place):
    return "a device's part of a larger call (implementation='sparse' runs whole calls)"
  return None


def run(call):
  """The sparse backend on a bound call: (out (B, T, N, Hv), lse (B, T, N))."""
  reason = supports(call)
  if reason is not None:
    raise NotImplementedError(f"implementation='sparse' does not take this call: {reason}")
  (chosen, block), rest = _split(call.mask)
  s = call.static
  cfg, _ = s.config((s.B, s.N, 1, 1))
  geo = _Geometry(1, s.T, s.S, s.K, s.G, block, chosen.shape[3])
  blocks, valid = _choices(chosen, geo._replace_batch(s.B))
  q = call.head_major(call.query, True)  # (B, K, G, T, H)
  k = call.head_major(call.key, False)  # (B, K, S, H)
  v = call.head_major(call.value, False)
  sink = None if call.sink is None else call.sink.reshape(1, s.K, s.G, 1)

  def example(args):
    # One example at a time: the program is the same whatever B is, so an example's result is
    # bitwise the same alone and in a batch.
    b, (qb, kb, vb, bb, vab) = args
    part = None if rest is None else rest.take_part(_masks.Cut(b, 1, 0, s.N, s.B, s.N))
    ops = Ops(qb[None], kb[None], vb[None], bb[None], vab[None], part)
    out, lse = _attend(geo, cfg, ops, sink)
    return out[0], lse[0]

  out, lse = jax.lax.map(example, (jnp.arange(s.B), (q, k, v, blocks, valid)))
  rows = lambda x: jnp.transpose(x.reshape(s.B, s.N, s.T), (0, 2, 1))
  out = jnp.transpose(out.reshape(s.B, s.N, s.T, s.Hv), (0, 2, 1, 3))
  return out, rows(lse)


class _Geometry(tuple):
  """The static sizes of a sparse call (hashable: a custom_vjp's static argument)."""

  def __new__(cls, B, T, S, K, G, block, n):
    return super().__new__(cls, (B, T, S, K, G, block, n))

  B = property(lambda self: self[0])
  T = property(lambda self: self[1])
  S = property(lambda self: self[2])
  K = property(lambda self: self[3])
  G = property(lambda self: self[4])
  block = property(lambda self: self[5])
  n = property(lambda self: self[6])

  def _replace_batch(self, B):
    return _Geometry(B, *self[1:])

  num_blocks = property(lambda self: -(-self[2] // self[5]))


class Ops(NamedTuple):
  """The operands: of one example, q (1, K, G, T, H), k, v (1, K, S, H), the choices ``blocks``
  and ``valid`` (1, K, T, n) (see `_choices`), and the rest of the mask (cut to the example);
  of one KV head (`_heads`), q (G, T, H), k, v (Sp, H) (padded to whole blocks), blocks and
  valid (T, n), and the mask cut to its query heads."""

  q: Any
  k: Any
  v: Any
  blocks: Any
  valid: Any
  rest: Any


def _choices(chosen, geo: _Geometry):
  """(blocks (B, K, T, n) int32, valid (B, K, T, n)): each row's chosen blocks per KV head, a
  slot valid where it names a block of the keys and differs from the slot before it (the
  choices are sorted: a traced repeat counts once; -1 and out-of-range entries select
  nothing)."""
  c = jnp.broadcast_to(chosen, (geo.B, geo.T, chosen.shape[2], geo.n))
  c = jnp.broadcast_to(c, (geo.B, geo.T, geo.K, geo.n)) if c.shape[2] == 1 else c
  c = jnp.transpose(c, (0, 2, 1, 3)).astype(jnp.int32)
  first = jnp.concatenate([jnp.ones(c.shape[:-1] + (1,), bool), c[..., 1:] != c[..., :-1]], -1)
  valid = (c >= 0) & (c < geo.num_blocks) & first
  return jnp.where(valid, c, 0), valid


def _zero_cotangent(x):
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def _ds(cfg, s, tanh, vis, lse_r, delta, dp):
  """(P, d loss / d raw q.k) of a tile: P = exp(s - lse), dS = P (dP - delta), then back
  through the soft cap and the scale."""
  p = jnp.where(vis, jnp.exp(s - lse_r[..., None]), jnp.zeros((), s.dtype))
  ds = p * (dp - delta[..., None])
  if tanh is not None:
    ds = ds * (1 - tanh * tanh)
  return p, ds * jnp.asarray(cfg.scale, ds.dtype)


def _heads(geo: _Geometry, ops: Ops) -> Ops:
  """`Ops` of one example as the K heads' `Ops` stacked on a leading axis (the mask cut per head
  by `_per_head`)."""
  Sp = geo.num_blocks * geo.block
  pad = lambda x: jnp.pad(x[0], ((0, 0), (0, Sp - geo.S), (0, 0)))
  return Ops(ops.q[0], pad(ops.k), pad(ops.v), ops.blocks[0], ops.valid[0], ops.rest)


def _per_head(geo: _Geometry, fn, heads: Ops, *per_head):
  """``fn(head, *xs)`` for each KV head (vmapped), the mask cut to that head's query heads."""
  N = geo.K * geo.G

  def one(kh, head, *xs):
    if head.rest is not None:
      head = head._replace(rest=head.rest.take_part(_masks.Cut(0, 1, kh * geo.G, geo.G, 1, N)))
    return fn(head, *xs)

  axes = (0, Ops(0, 0, 0, 0, 0, None)) + (0,) * len(per_head)
  return jax.vmap(one, in_axes=axes)(jnp.arange(geo.K), heads, *per_head)


class _Chunk(NamedTuple):
  """One chunk of the inverse selection: its block ``c``, whether it is in use (``live``), its
  pairs' tokens ``t`` (P,) and where they land in a token buffer (``row``: the token, or one of
  P spare rows past T for unused pairs, so that no two pairs of a chunk share a row), the
  block's keys and values, and the logits (G, P, block) (scale, soft cap; hidden: NEG) with
  their visibility and the soft cap's tanh."""

  c: Any
  live: Any
  row: Any
  kc: Any
  vc: Any
  s: Any
  vis: Any
  tanh: Any


def _chunk(geo, cfg, head: Ops, inv, j) -> _Chunk:
  """Chunk ``j`` of the inverse selection ``inv`` (see `_inverse_selection`)."""
  P, M, nb, bk = PAIRS_PER_CHUNK, geo.T * geo.n, geo.num_blocks, geo.block
  order, start, end, first, last = inv
  c = jnp.searchsorted(last, j, side="right").astype(jnp.int32)
  live = c < nb  # past the last chunk in use: padding
  c = jnp.minimum(c, nb - 1)
  p_idx = start[c] + (j - first[c]) * P + jnp.arange(P, dtype=jnp.int32)
  p_ok = live & (p_idx < end[c])
  t = order[jnp.minimum(p_idx, M - 1)] // geo.n  # each pair's token
  row = jnp.where(p_ok, t, geo.T + jnp.arange(P, dtype=jnp.int32))
  kc = jax.lax.dynamic_slice_in_dim(head.k, c * bk, bk, 0)  # (block, H)
  vc = jax.lax.dynamic_slice_in_dim(head.v, c * bk, bk, 0)
  kpos = c * bk + jnp.arange(bk, dtype=jnp.int32)
  vis = jnp.broadcast_to((p_ok[:, None] & (kpos < geo.S)[None, :])[None], (geo.G, P, bk))
  if head.rest is not None:
    at = lambda ti: head.rest.evaluate(ti[None], kpos, (1, geo.G, geo.T, geo.S))
    vis = vis & jnp.transpose(jax.vmap(at)(t).reshape(P, -1, bk), (1, 0, 2))
  qt = head.q[:, t]  # (G, P, H)
  s = jnp.einsum("gph,rh->gpr", qt, kc, preferred_element_type=_tile.stat_dtype(qt.dtype))
  s, tanh = _tile.scale_cap_bias(cfg, s, None)
  s = jnp.where(vis, s, jnp.asarray(_softmax.NEG, s.dtype))
  return _Chunk(c, live, row, kc, vc, s, vis, tanh)


def _chunks(geo: _Geometry):
  """The static number of chunks: every pair in chunks of one block each, each block's last
  chunk possibly part-filled."""
  return -(-(geo.T * geo.n) // PAIRS_PER_CHUNK) + geo.num_blocks


def _head_forward(geo, cfg, head: Ops, sink):
  """(out (G, T, Hv) in the query's dtype, lse (G, T)) of one KV head: each token's running
  softmax statistics in a buffer, each chunk merging its pairs into their tokens' rows (rows
  distinct within a chunk; chunks in their fixed order)."""
  inv = _inverse_selection(geo, head.blocks, head.valid)
  sd = _tile.stat_dtype(head.q.dtype)
  R, Hv = geo.T + PAIRS_PER_CHUNK, head.v.shape[-1]

  def step(carry, j):
    m, l, acc = carry
    ch = _chunk(geo, cfg, head, inv, j)
    mc = ch.s.max(-1)
    p = jnp.where(ch.vis, jnp.exp(ch.s - mc[..., None]), jnp.zeros((), sd))
    pv = jnp.einsum("gpr,rh->gph", p.astype(ch.vc.dtype), ch.vc, preferred_element_type=sd)
    m_o, l_o, acc_o = m[:, ch.row], l[:, ch.row], acc[:, ch.row]
    m_n = jnp.maximum(m_o, mc)
    a, b = jnp.exp(m_o - m_n), jnp.exp(mc - m_n)
    put = lambda buf, x: buf.at[:, ch.row].set(x, unique_indices=True)
    l_n = l_o * a + p.sum(-1) * b
    acc_n = acc_o * a[..., None] + pv * b[..., None]
    return (put(m, m_n), put(l, l_n), put(acc, acc_n)), None

  neg = jnp.asarray(_softmax.NEG, sd)
  init = (jnp.full((geo.G, R), neg), jnp.zeros((geo.G, R), sd), jnp.zeros((geo.G, R, Hv), sd))
  (m, l, acc), _ = jax.lax.scan(step, init, jnp.arange(_chunks(geo), dtype=jnp.int32))
  m, l, acc = m[:, : geo.T], l[:, : geo.T], acc[:, : geo.T]
  if sink is not None:
    m, l, acc = _softmax.join_sink(m, l, acc, sink[:, None])
  out = _softmax.normalize(acc, l, m, 0.0).astype(head.q.dtype)
  return out, _softmax.lse(m, l)


def _head_backward(geo, cfg, head: Ops, dout, lse_r, delta):
  """dQ (G, T, H), dK, dV (S, H) of one KV head in one loop over the chunks: dQ rows gain each
  chunk's share (rows distinct within a chunk), a block's dK and dV are its chunks' sums in
  chunk order, written once after its last chunk."""
  inv = _inverse_selection(geo, head.blocks, head.valid)
  sd = lse_r.dtype
  P, bk = PAIRS_PER_CHUNK, geo.block
  pad = lambda x: jnp.pad(x, ((0, 0), (0, P)) + ((0, 0),) * (x.ndim - 2))
  # Spare rows past T (a chunk's unused pairs) read zeros.
  q, dout, lse_r, delta = pad(head.q), pad(dout), pad(lse_r), pad(delta)

  def step(carry, j):
    acc_k, acc_v, dq, dk, dv = carry
    ch = _chunk(geo, cfg, head, inv, j)
    qt, dot = q[:, ch.row], dout[:, ch.row]  # (G, P, H)
    dp = jnp.einsum("gph,rh->gpr", dot, ch.vc, preferred_element_type=sd)
    p, ds = _ds(cfg, ch.s, ch.tanh, ch.vis, lse_r[:, ch.row], delta[:, ch.row], dp)
    dq_c = jnp.einsum("gpr,rh->gph", ds.astype(ch.kc.dtype), ch.kc, preferred_element_type=sd)
    dq = dq.at[:, ch.row].add(dq_c, unique_indices=True)
    mm = lambda a, b: jnp.einsum("gpr,gph->rh", a.astype(b.dtype), b, preferred_element_type=sd)
    acc_k, acc_v = acc_k + mm(ds, qt), acc_v + mm(p, dot)
    done = ch.live & (j == inv[4][ch.c] - 1)
    at = ch.c * bk
    put = lambda buf, acc: jax.lax.dynamic_update_slice_in_dim(
      buf, jnp.where(done, acc, jax.lax.dynamic_slice_in_dim(buf, at, bk, 0)), at, 0
    )
    dk, dv = put(dk, acc_k), put(dv, acc_v)
    zero = jnp.zeros((), sd)
    return (jnp.where(done, zero, acc_k), jnp.where(done, zero, acc_v), dq, dk, dv), None

  Sp, H, Hv = head.k.shape[0], head.k.shape[1], head.v.shape[1]
  zeros = lambda *shape: jnp.zeros(shape, sd)
  init = (zeros(bk, H), zeros(bk, Hv), zeros(geo.G, geo.T + P, H), zeros(Sp, H), zeros(Sp, Hv))
  (_, _, dq, dk, dv), _ = jax.lax.scan(step, init, jnp.arange(_chunks(geo), dtype=jnp.int32))
  return dq[:, : geo.T], dk[: geo.S], dv[: geo.S]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(geo, cfg, ops: Ops, sink):
  return _forward(geo, cfg, ops, sink)


def _forward(geo, cfg, ops: Ops, sink):
  """(out (1, K, G, T, Hv) in the query's dtype, lse (1, K, G, T)) of one example."""
  sinks = jnp.zeros((geo.K, geo.G)) if sink is None else sink.reshape(geo.K, geo.G)
  fn = lambda head, sk: _head_forward(geo, cfg, head, None if sink is None else sk)
  out, lse = _per_head(geo, fn, _heads(geo, ops), sinks)
  return out[None], lse[None]


def _attend_fwd(geo, cfg, ops: Ops, sink):
  out, lse = _forward(geo, cfg, ops, sink)
  return (out, lse), (ops, sink, out, lse)


def _attend_bwd(geo, cfg, res, cts):
  ops, sink, out, lse = res
  dout, dlse = cts
  sd = lse.dtype
  # d loss / d s = P * (dP - delta + dlse): the lse's own cotangent joins delta. A sum in a fixed
  # order (not the compiler's): an example's gradient is the same bits alone and in a batch.
  delta = _softmax.ordered_sum(dout.astype(sd) * out.astype(sd)) - dlse.astype(sd)
  lse_r = _softmax.lse_for_recompute(lse)
  fn = lambda head, do, lr, d: _head_backward(geo, cfg, head, do, lr, d)
  dq, dk, dv = _per_head(geo, fn, _heads(geo, ops), dout[0], lse_r[0], delta[0])
  dsink = None
  if sink is not None:
    # d lse / d sink = p_sink and d out / d sink = -p_sink out: -p_sink (dO.O - dlse).
    p_sink = jnp.exp(sink.astype(sd) - lse_r)
    dsink = (-(p_sink * delta).sum(axis=(0, 3), keepdims=True)).astype(sink.dtype)
  zeros = jax.tree.map(_zero_cotangent, (ops.blocks, ops.valid, ops.rest))
  grads = (dq[None].astype(ops.q.dtype), dk[None].astype(ops.k.dtype), dv[None].astype(ops.v.dtype))
  return Ops(*grads, *zeros), dsink


_attend.defvjp(_attend_fwd, _attend_bwd)


def _inverse_selection(geo, blocks, valid):
  """The (token, slot) pairs of one KV head sorted by (block, token), and where each block's
  run of them starts and ends in that order and in chunks of PAIRS_PER_CHUNK: (order (M,),
  start, end, first chunk, one past the last chunk (each (num_blocks,)))."""
  M, nb, P = geo.T * geo.n, geo.num_blocks, PAIRS_PER_CHUNK
  key = jnp.where(valid, blocks, nb).reshape(M)  # pairs in (token, slot) order; none: last
  order = jnp.argsort(key, stable=True).astype(jnp.int32)  # by block, then token
  ids = jnp.arange(nb, dtype=jnp.int32)
  start = jnp.searchsorted(key[order], ids, side="left").astype(jnp.int32)
  end = jnp.searchsorted(key[order], ids, side="right").astype(jnp.int32)
  nchunks = -(-(end - start) // P)
  last = jnp.cumsum(nchunks)
  return order, start, end, last - nchunks, last
