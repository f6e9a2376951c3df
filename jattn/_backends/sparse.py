"""``implementation="sparse"``: attention over each query's selected key blocks only
(`jattn.masks.selected_blocks`: NSA, MoBA, DSA), in work O(T x n x block) instead of O(T x S).

Everything runs key-major, through the inverse selection: the (token, slot) pairs of one example
and KV head are sorted by (block, token) -- a stable sort, so the order is fixed -- and each
block's run cut into chunks of that block (of 512 pairs while that many remain, then of 128,
the last part-filled), every chunk's indices computed before the loops (`_schedules`). A chunk
is a real matmul: its pairs' queries (P x G rows, gathered from token-major buffers: one
contiguous G x H read a pair) against its block's keys, read in place. The forward keeps each
token's running softmax statistics in a buffer and merges every chunk's pairs into their
tokens' rows; the backward, on keys-major tiles (dK and dV plain matmuls of them), adds each
chunk's dQ share into its tokens' rows and sums a block's dK and dV over its chunks of each
size in chunk order, adding each size's sum to the block once (a long loop computes two chunks
a step and merges them in that order, `_loops`). No two pairs of a chunk share a
row (a token chooses a block once), chunks run in their fixed order: every scatter declares
unique indices, nothing is added by atomics, and the results are bitwise reproducible.
Examples, and the KV heads of one, run one at a time (the program is the same whatever B is:
an example's result is the same bits alone and in a batch). The rest of the call's mask
(causal, a window, lengths, segments, any mask kind that cuts to one example and head group) is
evaluated at each pair's token and block.

Shapes: B batch, T queries, S keys, N query heads, K KV heads, G = N // K, H head size, n
slots per row, P pairs per chunk.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jattn import _call, _derivatives, _sharding, _softmax, _tile
from jattn import masks as _masks
from jattn._parallel import partition as _partition

# (token, slot) pairs per chunk, largest first: a block's run of pairs is cut into chunks of the
# first size while that many remain, the rest into chunks of the next (the last size takes what
# is left, its last chunk part-filled). G x 512 query rows a matmul where a block has many pairs
# (XLA's CPU matmuls run faster on taller tiles), little padding where it has few.
CHUNK_SIZES = (512, 128)

# Chunks a loop step takes (see `_loops`) where a schedule may run at least PAIRED_FROM chunks:
# two a step ran forward+backward in 0.94-0.96x the time of one (T = 8192, 4 and 16 heads, both
# jax lines; docs/benchmarks.md), but its program takes a third longer to compile and its last
# step may work a chunk for nothing, which short loops do not win back.
CHUNKS_A_STEP = 2
PAIRED_FROM = 32

# The largest packed (block, pair) sort key `_inverse_selection` forms; past it, a stable argsort.
PACKED_SORT_MAX = 2**31 - 1


def _split(mask):
  """((choices, block size), the AND of the mask's other conjuncts or None), or a reason."""
  if mask is None:
    return "no selection: implementation='sparse' needs a masks.selected_blocks mask"
  chosen, rest = _masks.split_selection(mask)
  if len(chosen) != 1:
    return (
      f"mask: implementation='sparse' needs exactly one masks.selected_blocks among the mask's "
      f"&-ed parts, got {len(chosen)}"
    )
  return chosen[0].selection(), rest


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
  ):
    if given:
      return f"{what}: not taken by implementation='sparse' yet (use 'chunked')"
  if any(x is not None for x in call.place):
    return "a device's part of a larger call (implementation='sparse' runs whole calls)"
  shards = _explicit_shards(call)
  if isinstance(shards, str):
    return (
      f"query, key and value under an Explicit mesh with {shards}: implementation='sparse' "
      f"splits only examples and heads there (a query's chosen blocks lie anywhere in the "
      f"sequence)"
    )
  return None


def _explicit_shards(call):
  """Under an Explicit mesh with query, key or value sharded (sharding in their types): the
  (batch, head) mesh axes they are split over (`_per_device` runs each device's part), or a
  phrase saying why they cannot be split so; else None."""
  arrays = (call.query, call.key, call.value)
  if not any(any(e is not None for e in (_sharding.spec_of(x) or ())) for x in arrays):
    return None
  return _sharding.examples_and_heads(*arrays)


def run(call):
  """The sparse backend on a bound call: (out (B, T, N, Hv), lse (B, T, N)), and each row's max
  logit over its visible keys (B, T, N) where the call asks for it (``return_max_logits``)."""
  reason = supports(call)
  if reason is not None:
    raise NotImplementedError(f"implementation='sparse' does not take this call: {reason}")
  s = call.static
  shards = _explicit_shards(call)
  if shards is not None:
    return _per_device(call, *shards)
  if _partition.applies(call.mask, ()):
    # Under plain jit on several devices XLA partitions the program after it is traced: left to
    # it, the loop over the examples needs every example on every device (the whole batch
    # computed on each, the output replicated). As one operation with a partitioning rule each
    # device runs its own examples and KV heads; rows and keys stay whole (a query's chosen
    # blocks lie anywhere in the sequence).
    problem = _partition.Problem(
      s.B, s.T, s.S, s.N, s.K, functools.partial(part, s), whole_sequences=True
    )
    operands = _partition.Operands(
      call.query, call.key, call.value, None, call.mask, None, call.sink
    )
    whole = lambda ops: part(s, ops, None)  # the same outputs unpartitioned, for forward mode
    return tuple(_partition.attention(problem, operands, whole))
  return _whole_forward(call)


def _per_device(call, batch, head):
  """Under an Explicit mesh with q, k and v sharded over the mesh axes ``batch`` (examples)
  and ``head`` (heads), sequences whole: each device's examples and heads as a whole call
  inside a `jax.shard_map` (its loop over the examples cannot run on sharded types), the mask
  and the sinks whole on every device and cut to its part. The outputs come back sharded as
  the query; nothing else moves."""
  s = call.static
  mesh = jax.sharding.get_abstract_mesh()
  Bl, Nl = s.B // _sharding.axes_size(mesh, batch), s.N // _sharding.axes_size(mesh, head)
  local = dataclasses.replace(s, B=Bl, N=Nl, K=Nl // s.G)
  P = jax.sharding.PartitionSpec
  rows = P(_sharding.spec_entry(batch), None, _sharding.spec_entry(head))

  def body(q, k, v, mask, sink):
    b0 = jax.lax.axis_index(batch) * Bl if batch else 0
    h0 = jax.lax.axis_index(head) * Nl if head else 0
    mask = mask.take_part(_masks.Cut(b0, Bl, h0, Nl, s.B, s.N))
    if sink is not None:
      sink = jax.lax.dynamic_slice_in_dim(sink, h0 // s.G, local.K, axis=1)
    return _whole_forward(_call.Call(q, k, v, None, mask, None, sink, None, local))

  fn = _sharding.per_device(
    body, (rows, rows, rows, P(), P()), (rows,) * (3 if s.opts.return_max_logits else 2)
  )
  qkv = (_sharding.reshard_to(x, rows) for x in (call.query, call.key, call.value))
  return fn(*qkv, *_sharding.replicated((call.mask, call.sink)))


def part(static, operands, place, saved=None):
  """One device's examples and heads (``operands``: its `_partition.Operands`, the mask cut to
  them; rows and keys whole), as the partitioning rule runs them: (out, lse) (and the max
  logits), or with ``saved`` = (out, lse, dout, dlse) the cotangents of q, k, v and the sinks."""
  del place  # no offsets: rows and keys are whole, the mask is the part's
  q, k, v, _, mask, _, sink = operands
  local = dataclasses.replace(static, B=q.shape[0], N=q.shape[2], K=k.shape[2])
  call = _call.Call(q, k, v, None, mask, None, sink, None, local)
  if saved is None:
    return _whole_forward(call)
  s = local
  out, lse, dout, dlse = saved
  stats = lambda x: jnp.transpose(x, (0, 2, 1)).reshape(s.B, s.K, s.G, s.T)
  per_example = (call.head_major(out, True), stats(lse), call.head_major(dout, True), stats(dlse))

  def example(geo, cfg, ops, sink, xs):
    outs, cts = (xs[0][None], xs[1][None]), (xs[2][None], xs[3][None])
    dq, dk, dv, dsink = _backward(geo, cfg, ops, sink, outs, cts)
    return dq[0], dk[0], dv[0], jnp.zeros((), lse.dtype) if dsink is None else dsink

  dq, dk, dv, dsink = _each_example(call, example, per_example)
  dq = jnp.transpose(dq.reshape(s.B, s.N, s.T, -1), (0, 2, 1, 3)).astype(q.dtype)
  dk, dv = (jnp.swapaxes(x, 1, 2).astype(y.dtype) for x, y in ((dk, k), (dv, v)))
  # The examples' shares of the sinks' gradient, added in one fixed order.
  dsink = None if sink is None else _softmax.ordered_sum(dsink, 0).astype(sink.dtype)
  return _partition.Operands(dq, dk, dv, None, None, None, dsink)


def _whole_forward(call):
  """(out (B, T, N, Hv), lse (B, T, N)[, max logits (B, T, N)]) of a whole call (`_attend` per
  example: differentiable in every mode)."""
  s = call.static
  example = lambda geo, cfg, ops, sink, _: tuple(x[0] for x in _attend(geo, cfg, ops, sink))
  out, *stats = _each_example(call, example, ())
  rows = lambda x: jnp.transpose(x.reshape(s.B, s.N, s.T), (0, 2, 1))
  out = jnp.transpose(out.reshape(s.B, s.N, s.T, s.Hv), (0, 2, 1, 3))
  return (out, *map(rows, stats))


def _each_example(call, fn, per_example):
  """``fn(geo, cfg, ops, sink, xs)`` for each example of ``call`` (``ops`` its `Ops`, ``xs``
  its slices of the arrays ``per_example``), stacked. One example at a time: the program is the
  same whatever B is, so an example's result is bitwise the same alone and in a batch."""
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
    b, (qb, kb, vb, bb, vab), xs = args
    part = None if rest is None else rest.take_part(_masks.Cut(b, 1, 0, s.N, s.B, s.N))
    ops = Ops(qb[None], kb[None], vb[None], bb[None], vab[None], part)
    return fn(geo, cfg, ops, sink, xs)

  return jax.lax.map(example, (jnp.arange(s.B), (q, k, v, blocks, valid), per_example))


class _Geometry(tuple):
  """The static sizes of a sparse call (a hashable tuple)."""

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
  of one KV head (`_heads`), q (T, G, H) (token-major), k, v (Sp, H) (padded to whole blocks),
  blocks and valid (T, n), and the mask cut to its query heads."""

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


def _heads(geo: _Geometry, ops: Ops) -> Ops:
  """`Ops` of one example as the K heads' `Ops` stacked on a leading axis: q token-major (K, T,
  G, H) (a pair's G query rows one contiguous read), k and v padded to whole blocks."""
  Sp = geo.num_blocks * geo.block
  pad = lambda x: jnp.pad(x[0], ((0, 0), (0, Sp - geo.S), (0, 0)))
  q = jnp.swapaxes(ops.q[0], 1, 2)
  return Ops(q, pad(ops.k), pad(ops.v), ops.blocks[0], ops.valid[0], ops.rest)


def _per_head(geo: _Geometry, fn, heads: Ops, *per_head):
  """``fn(head, *xs)`` for each KV head, one after the other (a loop per head, not one loop of
  stacked heads), the mask cut to that head's query heads."""
  N, rest = geo.K * geo.G, heads.rest

  def one(args):
    kh, head, xs = args
    if rest is not None:
      head = head._replace(rest=rest.take_part(_masks.Cut(0, 1, kh * geo.G, geo.G, 1, N)))
    return fn(head, *xs)

  return jax.lax.map(one, (jnp.arange(geo.K), heads._replace(rest=None), per_head))


class _Schedule(NamedTuple):
  """The inverse selection of one KV head as chunks of one size (`_schedules`): each chunk's key
  ``block`` (C,), its pairs' ``rows`` (C, P) in the token buffers (the pair's token, or spare
  row T + p for an unused pair, so that no two pairs of a chunk share a row), which pairs are in
  use (``ok`` (C, P)), whether it is its block's last chunk of this size (``last`` (C,)), and
  whether it is in use at all (``live`` (C,): the static count is a bound)."""

  block: Any
  rows: Any
  ok: Any
  last: Any
  live: Any


def _schedules(geo: _Geometry, blocks, valid) -> tuple[_Schedule, ...]:
  """One `_Schedule` per CHUNK_SIZES entry, every chunk's indices at once, before the loops (a
  loop step only reads its row of them)."""
  M, nb, T = geo.T * geo.n, geo.num_blocks, geo.T
  order, start, end = _inverse_selection(geo, blocks, valid)
  done, out = start, []  # each block's pairs handed to the larger sizes
  for i, P in enumerate(CHUNK_SIZES):
    left = end - done
    n = -(-left // P) if i == len(CHUNK_SIZES) - 1 else left // P
    last = jnp.cumsum(n)
    j = jnp.arange(_chunks(geo, i), dtype=jnp.int32)
    c = jnp.searchsorted(last, j, side="right").astype(jnp.int32)
    live = c < nb  # past the last chunk in use: padding
    c = jnp.minimum(c, nb - 1)
    spare = T + jnp.arange(P, dtype=jnp.int32)[None, :]
    p_idx = (done[c] + (j - (last[c] - n[c])) * P)[:, None] + spare - T
    ok = live[:, None] & (p_idx < end[c][:, None])
    token = order[jnp.minimum(p_idx, M - 1)] // geo.n
    out.append(_Schedule(c, jnp.where(ok, token, spare), ok, live & (j == last[c] - 1), live))
    done = done + n * P
  return tuple(out)


def _chunks(geo: _Geometry, i: int) -> int:
  """A static bound on the chunks of size CHUNK_SIZES[i]: whole chunks of every pair for the
  larger sizes; for the last, every pair in chunks of it, each block's last part-filled, and at
  most the chunks a run shorter than the size before makes in each block."""
  M, P = geo.T * geo.n, CHUNK_SIZES[i]
  if i < len(CHUNK_SIZES) - 1:
    return M // P
  every_pair = -(-M // P) + geo.num_blocks
  if i == 0:
    return every_pair
  return min(every_pair, -(-(CHUNK_SIZES[i - 1] - 1) // P) * geo.num_blocks)


def _loops(work, merge, schedules, carry):
  """``carry`` through every chunk of each schedule in turn: ``merge(sched, carry, j,
  work(sched, j))``, a chunk past the last in use skipped. ``work`` reads no carry: a long loop
  takes CHUNKS_A_STEP chunks a step, their work independent of each other (XLA's CPU runtime
  can run one's matmuls beside the other's), merged one after the other in chunk order (the
  same sums in the same order as one chunk a step)."""
  for sched in schedules:
    C = sched.live.shape[0]
    if not C:
      continue  # no chunk of this size can exist (fewer pairs than it)
    w = CHUNKS_A_STEP if C >= PAIRED_FROM else 1

    def one_step(carry, i, sched=sched, C=C, w=w):
      js = [jnp.minimum(i * w + d, C - 1) for d in range(w)]
      # Chunks in use are a prefix: the first of a step in use, it runs; each later one merges
      # only where it is itself in use (past C it would repeat the last chunk).
      in_use = [sched.live[j] & (i * w + d < C) for d, j in enumerate(js)]

      def run(carry):
        done = [work(sched, j) for j in js]
        carry = merge(sched, carry, js[0], done[0])
        for j, use, res in zip(js[1:], in_use[1:], done[1:]):
          later = lambda c, j=j, res=res: merge(sched, c, j, res)
          carry = jax.lax.cond(use, later, lambda c: c, carry)
        return carry

      return jax.lax.cond(in_use[0], run, lambda c: c, carry), None

    carry, _ = jax.lax.scan(one_step, carry, jnp.arange(-(-C // w), dtype=jnp.int32))
  return carry


class _Tile(NamedTuple):
  """One chunk's pairs against its block, the pairs' G query heads as rows p * G + g: the block
  ``c``, the pairs' ``rows`` (P,), the block's keys and values, the rows' queries (P * G, H), and
  the logits (P * G, block) (scale, soft cap; hidden: NEG) with their visibility and the soft
  cap's tanh."""

  c: Any
  rows: Any
  kc: Any
  vc: Any
  q: Any
  s: Any
  vis: Any
  tanh: Any


def _chunk_tile(geo, cfg, head: Ops, q, sched: _Schedule, j, keys_major=False) -> _Tile:
  """Chunk ``j``'s tile; ``q`` (T + P, G, H) the head's queries with P spare rows.
  ``keys_major``: the logits and visibility as (block, P * G) (the backward's layout)."""
  bk, G = geo.block, geo.G
  c, rows, ok = sched.block[j], sched.rows[j], sched.ok[j]
  P = rows.shape[0]
  kc = jax.lax.dynamic_slice_in_dim(head.k, c * bk, bk, 0)  # (block, H)
  vc = jax.lax.dynamic_slice_in_dim(head.v, c * bk, bk, 0)
  kpos = c * bk + jnp.arange(bk, dtype=jnp.int32)
  vis = (ok[:, None] & (kpos < geo.S)[None, :])[None]  # (1, P, block)
  if head.rest is not None:
    tokens = jnp.minimum(rows, geo.T - 1)
    vis = vis & head.rest.evaluate(tokens, kpos, (1, G, geo.T, geo.S))[0]  # (G|1, P, block)
  # Laid out as the logits are, straight from the mask (no transposed copy of it).
  order = (2, 1, 0) if keys_major else (1, 0, 2)
  vis = jnp.transpose(vis, order)
  vis = jnp.broadcast_to(vis, vis.shape[:-1] + (G,) if keys_major else (P, G, bk))
  vis = vis.reshape((bk, P * G) if keys_major else (P * G, bk))
  qt = q[rows].reshape(P * G, -1)
  sd = _tile.stat_dtype(qt.dtype)
  if keys_major:
    s = jnp.einsum("rh,ah->ra", kc, qt, preferred_element_type=sd)
  else:
    s = jnp.einsum("ah,rh->ar", qt, kc, preferred_element_type=sd)
  s, tanh = _tile.scale_cap_bias(cfg, s, None)
  s = jnp.where(vis, s, jnp.asarray(_softmax.NEG, s.dtype))
  return _Tile(c, rows, kc, vc, qt, s, vis, tanh)


def _spare_rows(x):
  """``x`` (T, ...) with max(CHUNK_SIZES) zero rows after it: what unused pairs read."""
  return jnp.pad(x, ((0, max(CHUNK_SIZES)),) + ((0, 0),) * (x.ndim - 1))


def _head_forward(geo, cfg, head: Ops, sink):
  """(out (G, T, Hv) in the query's dtype, lse (G, T), max logits (G, T)) of one KV head: each
  token's running softmax statistics in token-major buffers, each chunk merging its pairs into
  their tokens' rows (rows distinct within a chunk; chunks in their fixed order)."""
  scheds = _schedules(geo, head.blocks, head.valid)
  sd = _tile.stat_dtype(head.q.dtype)
  R, Hv = geo.T + max(CHUNK_SIZES), head.v.shape[-1]
  q = _spare_rows(head.q)

  def work(sched, j):
    t = _chunk_tile(geo, cfg, head, q, sched, j)
    P = t.rows.shape[0]
    mc = t.s.max(-1)
    p = jnp.where(t.vis, jnp.exp(t.s - mc[:, None]), jnp.zeros((), sd))
    pv = jnp.einsum("ar,rh->ah", p.astype(t.vc.dtype), t.vc, preferred_element_type=sd)
    return t.rows, mc.reshape(P, geo.G), p.sum(-1).reshape(P, geo.G), pv.reshape(P, geo.G, Hv)

  def merge(sched, carry, j, chunk):
    m, l, acc = carry  # (R, G), (R, G), (R, G, Hv)
    rows, mc, lc, pv = chunk
    m_o, l_o, acc_o = m[rows], l[rows], acc[rows]
    m_n = jnp.maximum(m_o, mc)
    a, b = jnp.exp(m_o - m_n), jnp.exp(mc - m_n)
    put = lambda buf, x: buf.at[rows].set(x, unique_indices=True)
    acc_n = acc_o * a[..., None] + pv * b[..., None]
    return put(m, m_n), put(l, l_o * a + lc * b), put(acc, acc_n)

  neg = jnp.asarray(_softmax.NEG, sd)
  init = (jnp.full((R, geo.G), neg), jnp.zeros((R, geo.G), sd), jnp.zeros((R, geo.G, Hv), sd))
  m, l, acc = _loops(work, merge, scheds, _sharding.varying_tree(init, head, sink))
  m, l = m[: geo.T].T, l[: geo.T].T
  acc = jnp.transpose(acc[: geo.T], (1, 0, 2))
  mx = _softmax.row_max(m, l)  # over the keys: before a sink joins
  if sink is not None:
    m, l, acc = _softmax.join_sink(m, l, acc, sink[:, None])
  out = _softmax.normalize(acc, l, m, 0.0).astype(head.q.dtype)
  return out, _softmax.lse(m, l), mx


def _head_backward(geo, cfg, head: Ops, dout, lse_r, delta):
  """dQ (G, T, H), dK, dV (S, H) of one KV head in one loop over the chunks of each size: dQ
  rows gain each chunk's share (rows distinct within a chunk), a block's dK and dV gain its
  chunks' sum of each size in chunk order, added after its last chunk of that size."""
  scheds = _schedules(geo, head.blocks, head.valid)
  sd = lse_r.dtype
  bk = geo.block
  # Token-major, spare rows past T (a chunk's unused pairs) reading zeros.
  q = _spare_rows(head.q)
  dout = _spare_rows(jnp.swapaxes(dout, 0, 1))
  lse_r, delta = _spare_rows(lse_r.T), _spare_rows(delta.T)

  def work(sched, j):
    t = _chunk_tile(geo, cfg, head, q, sched, j, keys_major=True)
    P = t.rows.shape[0]
    # Keys-major tiles (block, P * G): dK and dV are plain matmuls of them (a matmul reading a
    # tile transposed runs at a third of the speed on the CPU); dQ is the one transposed.
    dot = dout[t.rows].reshape(P * geo.G, -1)  # (P * G, Hv)
    dp = jnp.einsum("rh,ah->ra", t.vc, dot, preferred_element_type=sd)
    p = jnp.where(t.vis, jnp.exp(t.s - lse_r[t.rows].reshape(1, -1)), jnp.zeros((), sd))
    ds = p * (dp - delta[t.rows].reshape(1, -1))
    if t.tanh is not None:
      ds = ds * (1 - t.tanh * t.tanh)
    ds = ds * jnp.asarray(cfg.scale, ds.dtype)
    dq_c = jnp.einsum("ra,rh->ah", ds.astype(t.kc.dtype), t.kc, preferred_element_type=sd)
    mm = lambda a, b: jnp.einsum("ra,ah->rh", a.astype(b.dtype), b, preferred_element_type=sd)
    return t.c, t.rows, dq_c.reshape(P, geo.G, -1), mm(ds, t.q), mm(p, dot)

  def merge(sched, carry, j, chunk):
    acc_k, acc_v, dq, dk, dv = carry
    c, rows, dq_c, dk_c, dv_c = chunk
    dq = dq.at[rows].add(dq_c, unique_indices=True)
    acc_k, acc_v = acc_k + dk_c, acc_v + dv_c
    done = sched.last[j]
    at = c * bk
    old = lambda buf: jax.lax.dynamic_slice_in_dim(buf, at, bk, 0)
    put = lambda buf, acc: jax.lax.dynamic_update_slice_in_dim(
      buf, jnp.where(done, old(buf) + acc, old(buf)), at, 0
    )
    dk, dv = put(dk, acc_k), put(dv, acc_v)
    zero = jnp.zeros((), sd)
    return (jnp.where(done, zero, acc_k), jnp.where(done, zero, acc_v), dq, dk, dv)

  Sp, H, Hv = head.k.shape[0], head.k.shape[1], head.v.shape[1]
  zeros = lambda *shape: jnp.zeros(shape, sd)
  init = (zeros(bk, H), zeros(bk, Hv), zeros(q.shape[0], geo.G, H), zeros(Sp, H), zeros(Sp, Hv))
  _, _, dq, dk, dv = _loops(
    work, merge, scheds, _sharding.varying_tree(init, head, dout, lse_r, delta)
  )
  return jnp.swapaxes(dq[: geo.T], 0, 1), dk[: geo.S], dv[: geo.S]


def _attend(geo, cfg, ops: Ops, sink):
  """(out, lse) of one example (`_forward`), and its max logits with ``cfg.max_logits``,
  differentiable in q, k, v and the sinks in every mode: reverse mode by `_backward`
  (deterministic), forward mode by JAX's tangent of the same plain-JAX forward (its loops carry
  the tangents: O(T x n x block) too). The max logits are a statistic: no derivative."""
  diff, aux = (ops.q, ops.k, ops.v, sink), (ops.blocks, ops.valid, ops.rest)
  as_ops = lambda diff, aux: Ops(*diff[:3], *aux)
  n_outs = 3 if cfg.max_logits else 2
  forward = lambda diff, aux, saved=(): _forward(geo, cfg, as_ops(diff, aux), diff[3])[:n_outs]
  kernel = lambda diff, aux: (forward(diff, aux), ())

  def backward(diff, aux, outs, saved, cts):
    return _backward(geo, cfg, as_ops(diff, aux), diff[3], outs[:2], cts[:2])

  return _derivatives.with_derivatives(kernel, forward, backward, diff, aux)


def _forward(geo, cfg, ops: Ops, sink):
  """(out (1, K, G, T, Hv) in the query's dtype, lse (1, K, G, T), max logits (1, K, G, T)) of
  one example."""
  sinks = jnp.zeros((geo.K, geo.G)) if sink is None else sink.reshape(geo.K, geo.G)
  fn = lambda head, sk: _head_forward(geo, cfg, head, None if sink is None else sk)
  return tuple(x[None] for x in _per_head(geo, fn, _heads(geo, ops), sinks))


def _backward(geo, cfg, ops: Ops, sink, outs, cts):
  """(dq, dk, dv, dsink) of one example, from its (out, lse) and their cotangents (None: zero)."""
  out, lse = outs
  dout, dlse = (jnp.zeros_like(x) if c is None else c for c, x in zip(cts, outs))
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
  return dq[None], dk[None], dv[None], dsink


def _inverse_selection(geo, blocks, valid):
  """The (token, slot) pairs of one KV head sorted by (block, token), and where each block's
  run of them starts and ends in that order: (order (M,), start, end (each (num_blocks,)))."""
  M, nb = geo.T * geo.n, geo.num_blocks
  key = jnp.where(valid, blocks, nb).reshape(M)  # pairs in (token, slot) order; none: last
  pair = jnp.arange(M, dtype=jnp.int32)
  if (nb + 1) * M - 1 <= PACKED_SORT_MAX:
    # One int32 key a pair, (block, pair) packed, so distinct: a plain sort is the stable one,
    # and XLA's CPU sort of one operand runs ~4x faster than a stable sort of two (jax 0.10).
    packed = jnp.sort(key * M + pair)
    order, key = packed % M, packed // M
  else:
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # by block, then token
    key = key[order]
  ids = jnp.arange(nb, dtype=jnp.int32)
  start = jnp.searchsorted(key, ids, side="left").astype(jnp.int32)
  end = jnp.searchsorted(key, ids, side="right").astype(jnp.int32)
  return order, start, end
