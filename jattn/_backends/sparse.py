"""``implementation="sparse"``: attention over each query's selected key blocks only
(`jattn.masks.selected_blocks`: NSA, MoBA, DSA), in work O(T x n x block) instead of O(T x S).

Forward and the dQ pass go token-major: each query token gathers the n blocks its KV head chose
(L = n x block keys) and runs the dense softmax over them, a chunk of tokens at a time. The rest
of the call's mask (causal, a window, lengths, segments, any mask kind that cuts to one example
and head group) is evaluated at the gathered positions, token by token.

dK and dV go key-major, through the inverse selection: the (token, slot) pairs of one example
and KV head are sorted by (block, token) -- a stable sort, so the order is fixed -- and cut into
chunks of one block each (each block's run padded to whole chunks). A loop over the chunks sums
each chunk's contribution (one matmul over its pairs) into its block's running total, in chunk
order, and writes the block once, when its last chunk is done. No scatter adds over repeated
indices anywhere: the gradients are bitwise reproducible and do not depend on the batch.

Shapes: B batch, T queries, S keys, N query heads, K KV heads, G = N // K, H head size, n
slots per row, L = n x block gathered keys per token.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _softmax, _tile
from jattn import masks as _masks
from jattn.masks._selection import _Selected

# Tokens per step of the token-major passes, (token, slot) pairs per chunk of the key-major one.
TOKENS_PER_STEP = 64
PAIRS_PER_CHUNK = 64


def _split(mask):
  """(the one selection, the AND of the other conjuncts or None), or a reason string."""
  if mask is None:
    return "no selection: implementation='sparse' needs a masks.selected_blocks mask"
  parts = mask.conjuncts()
  chosen = [m for m in parts if isinstance(m, _Selected)]
  if len(chosen) != 1:
    return (
      f"mask: implementation='sparse' needs exactly one masks.selected_blocks among the mask's "
      f"&-ed parts, got {len(chosen)}"
    )
  rest = [m for m in parts if m is not chosen[0]]
  return chosen[0], functools.reduce(lambda a, b: a & b, rest) if rest else None


def supports(call) -> str | None:
  """None, or why the sparse path cannot take this call."""
  split = _split(call.mask)
  if isinstance(split, str):
    return split
  sel, rest = split
  s = call.static
  Ks = sel.chosen.shape[2]
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
  sel, rest = _split(call.mask)
  s = call.static
  cfg, _ = s.config((s.B, s.N, 1, 1))
  geo = _Geometry(1, s.T, s.S, s.K, s.G, sel.block_size, sel.chosen.shape[3])
  blocks, valid = _choices(sel.chosen, geo._replace_batch(s.B))
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
  L = property(lambda self: self[5] * self[6])

  def _replace_batch(self, B):
    return _Geometry(B, *self[1:])

  num_blocks = property(lambda self: -(-self[2] // self[5]))


class Ops(NamedTuple):
  """One example's operands: q (1, K, G, T, H), k, v (1, K, S, H), the choices ``blocks`` and
  ``valid`` (1, K, T, n) (see `_choices`), and the rest of the mask (cut to the example)."""

  q: Any
  k: Any
  v: Any
  blocks: Any
  valid: Any
  rest: Any


class Cotangents(NamedTuple):
  """What the backward passes read besides `Ops`: dout (1, K, G, T, Hv), lse_r (1, K, G, T)
  (+inf for empty rows, see `_softmax.lse_for_recompute`), delta (1, K, G, T) (rowsum(dO * O)
  less the lse's own cotangent)."""

  dout: Any
  lse_r: Any
  delta: Any


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


def _positions(blocks, valid, geo: _Geometry):
  """(key positions (..., L), visible by the selection (..., L)) of gathered rows."""
  r = jnp.arange(geo.block, dtype=jnp.int32).reshape((1,) * blocks.ndim + (geo.block,))
  pos = (blocks[..., None] * geo.block + r).reshape(blocks.shape[:-1] + (geo.L,))
  ok = jnp.repeat(valid, geo.block, axis=-1) & (pos < geo.S)
  return jnp.minimum(pos, geo.S - 1), ok


def _rest_visible(rest, geo: _Geometry, t, pos):
  """The rest of the mask at the gathered positions: (B, K, G|1, tq, L) bool, or None.
  ``t`` (tq,) query positions, ``pos`` (B, K, tq, L) key positions."""
  if rest is None:
    return None
  N = geo.K * geo.G

  def one(b, kh, ti, p):  # one example, one KV head's query heads, one token
    part = rest.take_part(_masks.Cut(b, 1, kh * geo.G, geo.G, geo.B, N))
    vis = part.evaluate(ti[None], p, (1, geo.G, geo.T, geo.S))  # (1|1, G|1, 1, L)
    return vis.reshape(vis.shape[1], geo.L)

  per_token = jax.vmap(one, in_axes=(None, None, 0, 0))
  per_head = jax.vmap(per_token, in_axes=(None, 0, None, 0))
  per_example = jax.vmap(per_head, in_axes=(0, None, None, 0))
  vis = per_example(jnp.arange(geo.B), jnp.arange(geo.K), t, pos)  # (B, K, tq, G|1, L)
  return jnp.transpose(vis, (0, 1, 3, 2, 4))


def _gather(x, pos):
  """Rows ``pos`` (B, K, tq, L) of x (B, K, S, H): (B, K, tq, L, H)."""
  B, K, tq, L = pos.shape
  flat = jnp.take_along_axis(x, pos.reshape(B, K, tq * L, 1), axis=2)
  return flat.reshape(B, K, tq, L, x.shape[-1])


def _token_tiles(geo: _Geometry, cfg, ops: Ops, t0):
  """One step of the token-major passes, tokens t0 .. t0 + tq (``ops``' q, blocks and valid
  hold those tokens; k and v every key): the gathered keys and values, the logits
  (B, K, G, tq, L) in the statistics dtype (scale, soft cap; hidden entries NEG), the
  visibility and the soft cap's tanh."""
  q, k, v, blocks, valid, rest = ops
  tq = q.shape[3]
  t = t0 + jnp.arange(tq, dtype=jnp.int32)
  pos, ok = _positions(blocks, valid, geo)  # (B, K, tq, L)
  ok = ok & (t < geo.T)[None, None, :, None]
  kg, vg = _gather(k, pos), _gather(v, pos)
  s = jnp.einsum("bkgth,bktlh->bkgtl", q, kg, preferred_element_type=_tile.stat_dtype(q.dtype))
  s, tanh = _tile.scale_cap_bias(cfg, s, None)
  vis = ok[:, :, None]
  extra = _rest_visible(rest, geo, jnp.minimum(t, geo.T - 1), pos)
  if extra is not None:
    vis = vis & extra
  s = jnp.where(vis, s, jnp.asarray(_softmax.NEG, s.dtype))
  return kg, vg, s, vis, tanh


def _steps(geo: _Geometry, *arrays):
  """The token-major arrays cut into steps of TOKENS_PER_STEP tokens (the T axis padded):
  (steps, ...) each, T being axis 3 of (B, K, G, T, X) arrays and axis 2 of (B, K, T, n)."""
  tq = min(TOKENS_PER_STEP, geo.T)
  nsteps = -(-geo.T // tq)
  out = []
  for x in arrays:
    axis = 3 if x.ndim == 5 else 2
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, nsteps * tq - geo.T)
    x = jnp.pad(x, pad)
    x = x.reshape(x.shape[:axis] + (nsteps, tq) + x.shape[axis + 1 :])
    out.append(jnp.moveaxis(x, axis, 0))
  return tq, out


def _unsteps(x, geo: _Geometry, axis: int):
  """Inverse of `_steps` for one output: (steps, ..., tq at ``axis``, ...) -> T at ``axis``."""
  x = jnp.moveaxis(x, 0, axis)
  x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])
  return jax.lax.slice_in_dim(x, 0, geo.T, axis=axis)


def _forward(geo, cfg, ops: Ops, sink):
  """(out (B, K, G, T, Hv) in the query dtype, lse (B, K, G, T) stat dtype, no gradients)."""
  q, v = ops.q, ops.v
  tq, (qs, bs, vs) = _steps(geo, ops.q, ops.blocks, ops.valid)

  def step(args):
    i, qi, bi, vi = args
    tile = ops._replace(q=qi, blocks=bi, valid=vi)
    _, vg, s, _, _ = _token_tiles(geo, cfg, tile, i * tq)
    p, l, m = _softmax.exp_rows(s, sink)
    acc = jnp.einsum("bkgtl,bktlh->bkgth", p.astype(v.dtype), vg, preferred_element_type=l.dtype)
    return _softmax.normalize(acc, l, m, 0.0).astype(q.dtype), _softmax.lse(m, l)

  out, lse = jax.lax.map(step, (jnp.arange(qs.shape[0]), qs, bs, vs))
  return _unsteps(out, geo, 3), _unsteps(lse, geo, 3)


def _zero_cotangent(x):
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(geo, cfg, ops: Ops, sink):
  return _forward(geo, cfg, ops, sink)


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
  cot = Cotangents(dout, _softmax.lse_for_recompute(lse), delta)
  dq = _dq(geo, cfg, ops, cot)
  dk, dv = _dkv(geo, cfg, ops, cot)
  dsink = None
  if sink is not None:
    # d lse / d sink = p_sink and d out / d sink = -p_sink out: -p_sink (dO.O - dlse).
    p_sink = jnp.exp(sink.astype(sd) - cot.lse_r)
    dsink = (-(p_sink * delta).sum(axis=(0, 3), keepdims=True)).astype(sink.dtype)
  zeros = jax.tree.map(_zero_cotangent, (ops.blocks, ops.valid, ops.rest))
  return Ops(dq, dk, dv, *zeros), dsink


_attend.defvjp(_attend_fwd, _attend_bwd)


def _ds(cfg, s, tanh, vis, lse_r, delta, dp):
  """(P, d loss / d raw q.k) of a tile: P = exp(s - lse), dS = P (dP - delta), then back
  through the soft cap and the scale."""
  p = jnp.where(vis, jnp.exp(s - lse_r[..., None]), jnp.zeros((), s.dtype))
  ds = p * (dp - delta[..., None])
  if tanh is not None:
    ds = ds * (1 - tanh * tanh)
  return p, ds * jnp.asarray(cfg.scale, ds.dtype)


def _dq(geo, cfg, ops: Ops, cot: Cotangents):
  """dQ token-major: each token's own gathered keys (no sharing between tokens)."""
  q = ops.q
  tq, steps = _steps(
    geo, q, ops.blocks, ops.valid, cot.dout, cot.lse_r[..., None], cot.delta[..., None]
  )

  def step(args):
    i, qi, bi, vi, doi, li, di = args
    kg, vg, s, vis, tanh = _token_tiles(geo, cfg, ops._replace(q=qi, blocks=bi, valid=vi), i * tq)
    dp = jnp.einsum("bkgth,bktlh->bkgtl", doi, vg, preferred_element_type=s.dtype)
    _, ds = _ds(cfg, s, tanh, vis, li[..., 0], di[..., 0], dp)
    dq = jnp.einsum("bkgtl,bktlh->bkgth", ds.astype(q.dtype), kg, preferred_element_type=s.dtype)
    return dq.astype(q.dtype)

  dq = jax.lax.map(step, (jnp.arange(steps[0].shape[0]), *steps))
  return _unsteps(dq, geo, 3)


class _Head(NamedTuple):
  """One KV head's share of the backward's operands: q (G, T, H), k, v (Sp, H) (padded to whole
  blocks), blocks and valid (T, n), dout (G, T, Hv), lse_r and delta (G, T)."""

  q: Any
  k: Any
  v: Any
  blocks: Any
  valid: Any
  dout: Any
  lse_r: Any
  delta: Any


def _dkv(geo, cfg, ops: Ops, cot: Cotangents):
  """dK, dV (1, K, S, H) key-major through the inverse selection (see the module docstring)."""
  Sp = geo.num_blocks * geo.block
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, Sp - geo.S), (0, 0)))
  heads = _Head(
    ops.q[0], pad(ops.k)[0], pad(ops.v)[0], ops.blocks[0], ops.valid[0], *(x[0] for x in cot)
  )
  N = geo.K * geo.G

  def one(kh, head):
    rest = (
      None if ops.rest is None else ops.rest.take_part(_masks.Cut(0, 1, kh * geo.G, geo.G, 1, N))
    )
    return _key_major(geo, cfg, head, rest)

  dk, dv = jax.vmap(one)(jnp.arange(geo.K), heads)
  return dk[None].astype(ops.k.dtype), dv[None].astype(ops.v.dtype)


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


def _key_major(geo, cfg, head: _Head, rest):
  """dK, dV (S, H) of one KV head: a loop over chunks of pairs, each chunk one block's; a
  block's total is written once, after its last chunk."""
  P, M, nb, bk = PAIRS_PER_CHUNK, geo.T * geo.n, geo.num_blocks, geo.block
  order, start, end, first, last = _inverse_selection(geo, head.blocks, head.valid)

  def chunk(carry, j):
    acc_k, acc_v, dk, dv = carry
    c = jnp.searchsorted(last, j, side="right").astype(jnp.int32)
    live = c < nb  # past the last chunk in use: padding
    c = jnp.minimum(c, nb - 1)
    p_idx = start[c] + (j - first[c]) * P + jnp.arange(P, dtype=jnp.int32)
    p_ok = live & (p_idx < end[c])
    t = order[jnp.minimum(p_idx, M - 1)] // geo.n  # each pair's token
    kc = jax.lax.dynamic_slice_in_dim(head.k, c * bk, bk, 0)  # (block, H)
    vc = jax.lax.dynamic_slice_in_dim(head.v, c * bk, bk, 0)
    qt, dot = head.q[:, t], head.dout[:, t]  # (G, P, H)
    kpos = c * bk + jnp.arange(bk, dtype=jnp.int32)
    vis = jnp.broadcast_to((p_ok[:, None] & (kpos < geo.S)[None, :])[None], (geo.G, P, bk))
    if rest is not None:
      ev = jax.vmap(lambda ti: rest.evaluate(ti[None], kpos, (1, geo.G, geo.T, geo.S)))(t)
      vis = vis & jnp.transpose(ev.reshape(P, -1, bk), (1, 0, 2))
    s = jnp.einsum("gph,rh->gpr", qt, kc, preferred_element_type=head.lse_r.dtype)
    s, tanh = _tile.scale_cap_bias(cfg, s, None)
    s = jnp.where(vis, s, jnp.asarray(_softmax.NEG, s.dtype))
    dp = jnp.einsum("gph,rh->gpr", dot, vc, preferred_element_type=s.dtype)
    p, ds = _ds(cfg, s, tanh, vis, head.lse_r[:, t], head.delta[:, t], dp)
    mm = lambda a, b: jnp.einsum(
      "gpr,gph->rh", a.astype(b.dtype), b, preferred_element_type=s.dtype
    )
    acc_k, acc_v = acc_k + mm(ds, qt), acc_v + mm(p, dot)
    done = live & (j == last[c] - 1)
    put = lambda buf, acc: jax.lax.dynamic_update_slice_in_dim(
      buf, jnp.where(done, acc, jax.lax.dynamic_slice_in_dim(buf, c * bk, bk, 0)), c * bk, 0
    )
    dk, dv = put(dk, acc_k), put(dv, acc_v)
    zero = jnp.zeros((), s.dtype)
    return (jnp.where(done, zero, acc_k), jnp.where(done, zero, acc_v), dk, dv), None

  sd = head.lse_r.dtype
  Sp, H, Hv = head.k.shape[0], head.k.shape[1], head.v.shape[1]
  init = (
    jnp.zeros((bk, H), sd),
    jnp.zeros((bk, Hv), sd),
    jnp.zeros((Sp, H), sd),
    jnp.zeros((Sp, Hv), sd),
  )
  steps = jnp.arange(-(-M // P) + nb, dtype=jnp.int32)
  (_, _, dk, dv), _ = jax.lax.scan(chunk, init, steps)
  return dk[: geo.S], dv[: geo.S]
