"""Ring (context-parallel) attention: exact attention over a sequence sharded across devices.

Built on JAX's own SPMD machinery: `ring_attention` runs inside `jax.shard_map` with the query and
key/value sequences sharded along one mesh axis of P devices. Each device keeps its query shard.
For P steps it attends that shard to the key/value shard it currently holds, with the chunked
kernel (`jattn._chunked._forward`), while passing the key/value shard on to its ring neighbour with
`jax.lax.ppermute`; the P partial results are combined exactly through their log-sum-exps (the
rule of `merge_attention`).

The backward pass rings once more. The chunked backward recomputes probabilities as
exp(S - lse) from the *global* log-sum-exp of each row, so on one key/value shard
`jattn._chunked._backward` returns exactly that shard's share of dQ and the whole of its dK, dV.
The dK/dV accumulators travel around the ring with their shard and are back on its owner after P
steps; dQ stays put. Memory per device: its own shards, one key/value shard (plus, backward, its
dK/dV) in flight, and O(T / P) statistics -- independent of P.

Global positions. Causal, window and length masks are about positions in the whole sequence, but
the kernel sees local positions 0 .. T/P - 1. `_RingMask` maps them through tables of the global
position of every local row, computed from the device index and the layout:
  contiguous: device d holds positions [d * T/P, (d + 1) * T/P);
  zigzag:     the sequence is cut into 2P chunks; device d holds chunks d and 2P - 1 - d, so every
              device owns an equal share of the causal triangle (`zigzag_permute`).
Its block summary (EMPTY / PARTIAL / FULL per kernel block) comes from the min and max global
position of each block, so a key/value shard wholly in a query shard's future is an all-EMPTY block
map and costs no tile: the kernel skips it, while the ppermute still runs on every step (every
device takes part in every collective, whatever its share of the work).

Shapes: B batch, T / S global query / key length, N query heads, K key/value heads, G = N // K,
H head dim; Ts = T / P and Ss = S / P are one device's shards.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _chunked, _tile, _validation
from jattn import masks as _masks
from jattn._attention import DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q, block_map
from jattn._chunked import _varying
from jattn._tile import NEG, Config

LAYOUTS = ("contiguous", "zigzag")

# Dropout is not supported, so the kernels' dropout seed is a constant.
_NO_SEED = np.zeros((2,), np.uint32)


# --------------------------------------------------------------------------------------------
# Layouts.
# --------------------------------------------------------------------------------------------


def _check_num_devices(num_devices):
  if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)):
    raise TypeError(f"num_devices must be a positive int, got {type(num_devices).__name__} "
                    f"{num_devices!r}")
  if num_devices <= 0:
    raise ValueError(f"num_devices must be a positive int, got {num_devices}")
  return int(num_devices)


def zigzag_order(num_devices: int) -> np.ndarray:
  """The chunk order of the zigzag layout: [0, 2P-1, 1, 2P-2, ..., P-1, P].

  The sequence is cut into 2P equal chunks; device d holds chunks d and 2P-1-d, in that order.
  """
  P = _check_num_devices(num_devices)
  d = np.arange(P)
  return np.stack([d, 2 * P - 1 - d], axis=1).reshape(-1)


def _zigzag_take(x, num_devices, axis, inverse):
  P = _check_num_devices(num_devices)
  x = jnp.asarray(x)
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
    raise TypeError(f"axis must be an int, got {type(axis).__name__} {axis!r}")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis={axis} is out of range for an array of shape {x.shape}")
  axis = axis % x.ndim
  L = x.shape[axis]
  if L % (2 * P):
    raise ValueError(f"the zigzag layout cuts the sequence into 2 * num_devices = {2 * P} equal "
                     f"chunks, but x.shape[{axis}] = {L} (x.shape={x.shape}) is not a multiple "
                     f"of {2 * P}")
  index = np.arange(L).reshape(2 * P, L // (2 * P))[zigzag_order(P)].reshape(-1)
  if inverse:
    index = np.argsort(index)
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
    # Under an Explicit mesh the gather must be told its output sharding: keep the input's.
    return x.at[(slice(None),) * axis + (index,)].get(out_sharding=sharding)
  return jnp.take(x, index, axis=axis)


def zigzag_permute(x, num_devices: int, *, axis: int = 1):
  """Reorder a sequence into the zigzag (load-balanced causal) layout.

  Cuts axis ``axis`` (the sequence; 1 for (B, T, N, H) arrays and (B, T) segment ids) into
  2 * num_devices chunks and orders them [0, 2P-1, 1, 2P-2, ...], so that sharding the result
  evenly over P devices gives device d chunks d and 2P-1-d: under a causal mask every device then
  has the same amount of work. Use it on query, key, value and segment ids before
  ``ring_attention(..., layout="zigzag")``, and `zigzag_unpermute` on the output.
  ``query_seq_lengths`` and ``key_value_seq_lengths`` stay as they are: they are global positions.
  """
  return _zigzag_take(x, num_devices, axis, inverse=False)


def zigzag_unpermute(x, num_devices: int, *, axis: int = 1):
  """The inverse of `zigzag_permute`: back from the zigzag layout to sequence order."""
  return _zigzag_take(x, num_devices, axis, inverse=True)


def shard_positions(index, length: int, num_devices: int, layout: str):
  """(length,) int32 global sequence positions of the rows that device ``index`` holds.

  ``length`` is the shard length (T / P); ``index`` may be traced (`jax.lax.axis_index`).
  """
  p = jnp.arange(length, dtype=jnp.int32)
  index = jnp.asarray(index, jnp.int32)
  if layout == "contiguous":
    return index * length + p
  c = length // 2
  return jnp.where(p < c, index * c + p, (2 * num_devices - 1 - index) * c + (p - c))


# --------------------------------------------------------------------------------------------
# The mask of one (query shard, key/value shard) pair, in global positions.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _RingMask(_masks.Mask):
  """Band and length masks on global positions, evaluated at local positions.

  Visible iff ``lo <= kv_global - q_global <= hi`` (a ``None`` side is unbounded) and
  ``q_global < q_lengths[b]`` and ``kv_global < kv_lengths[b]``. ``q_pos`` / ``kv_pos`` are the
  global positions of the local rows, padded to whole kernel blocks by repeating the last one
  (padded query rows then behave as a copy of the last row; padded keys are hidden by the kernel).
  """

  q_pos: Any  # (Tp,) int32
  kv_pos: Any  # (Sp,) int32
  q_lengths: Any  # (B,) int32 or None
  kv_lengths: Any  # (B,) int32 or None
  lo: int | None
  hi: int | None

  def evaluate(self, q_pos, kv_pos, shape):
    qg = jnp.take(self.q_pos, q_pos, mode="clip")  # (tq,)
    kg = jnp.take(self.kv_pos, kv_pos, mode="clip")  # (tk,)
    ok = jnp.ones((1, qg.shape[0], kg.shape[0]), bool)
    d = kg[None, None, :] - qg[None, :, None]
    if self.lo is not None:
      ok = ok & (d >= self.lo)
    if self.hi is not None:
      ok = ok & (d <= self.hi)
    if self.q_lengths is not None:
      ok = ok & (qg[None, :, None] < self.q_lengths[:, None, None])
    if self.kv_lengths is not None:
      ok = ok & (kg[None, None, :] < self.kv_lengths[:, None, None])
    return ok[:, None]  # (B|1, 1, tq, tk)

  def block_states(self, grid, shape):
    nq, nk = grid.num_q_blocks, grid.num_kv_blocks
    assert self.q_pos.shape == (nq * grid.block_q,), (self.q_pos.shape, grid)
    assert self.kv_pos.shape == (nk * grid.block_kv,), (self.kv_pos.shape, grid)
    qb = self.q_pos.reshape(nq, grid.block_q)
    kb = self.kv_pos.reshape(nk, grid.block_kv)
    qmin, qmax = qb.min(axis=1)[None, :, None], qb.max(axis=1)[None, :, None]  # (1, nq, 1)
    kmin, kmax = kb.min(axis=1)[None, None, :], kb.max(axis=1)[None, None, :]  # (1, 1, nk)
    # Exact when a block holds consecutive positions; for a block straddling two zigzag chunks
    # the [min, max] hull is wider, which can only turn EMPTY or FULL into PARTIAL (still sound).
    full = jnp.ones((1, nq, nk), bool)
    empty = jnp.zeros((1, nq, nk), bool)
    if self.lo is not None:
      full = full & (kmin - qmax >= self.lo)
      empty = empty | (kmax - qmin < self.lo)
    if self.hi is not None:
      full = full & (kmax - qmin <= self.hi)
      empty = empty | (kmin - qmax > self.hi)
    if self.q_lengths is not None:
      n = self.q_lengths[:, None, None]
      full = full & (qmax < n)
      empty = empty | (qmin >= n)
    if self.kv_lengths is not None:
      n = self.kv_lengths[:, None, None]
      full = full & (kmax < n)
      empty = empty | (kmin >= n)
    states = jnp.where(empty, _masks.EMPTY, jnp.where(full, _masks.FULL, _masks.PARTIAL))
    return states.astype(jnp.int8)[:, None]  # (B|1, 1, nq, nk)


jax.tree_util.register_dataclass(_RingMask,
                                 data_fields=["q_pos", "kv_pos", "q_lengths", "kv_lengths"],
                                 meta_fields=["lo", "hi"])


@dataclasses.dataclass(frozen=True, slots=True)
class _RingConfig:
  """Static description of one ring call (hashable: the custom VJP's nondiff argument)."""

  cc: _chunked.ChunkedConfig  # over one device's shards (Ts, Ss)
  axis_name: Any
  num_devices: int
  layout: str
  lo: int | None  # the global diagonal band: lo <= kv - q <= hi
  hi: int | None


def _padded_positions(index, length, padded, rc: _RingConfig):
  pos = shard_positions(index, length, rc.num_devices, rc.layout)
  return jnp.pad(pos, (0, padded - length), mode="edge")


def _pair(rc: _RingConfig, q_pos, kv_index, lengths, segs):
  """The mask and block map for this device's queries against device ``kv_index``'s keys."""
  cc = rc.cc
  cfg = cc.cfg
  q_lengths, kv_lengths = lengths
  q_seg, kv_seg = segs
  parts = []
  if rc.lo is not None or rc.hi is not None or q_lengths is not None or kv_lengths is not None:
    kv_pos = _padded_positions(kv_index, cfg.S, cc.Sp, rc)
    parts.append(_RingMask(q_pos, kv_pos, q_lengths, kv_lengths, rc.lo, rc.hi))
  if q_seg is not None:
    # Segment ids are per token: the key shard's ids travelled with it, so they are local here.
    parts.append(_masks.segments(q_seg, kv_seg))
  mask = functools.reduce(lambda a, b: a & b, parts) if parts else None
  states = block_map(mask, cc.grid, (cfg.B, cfg.N, cfg.T, cfg.S))
  return mask, states


def tiles_per_device(num_devices: int, layout: str, Ts: int, Ss: int, block_q: int,
                     block_kv: int, lo: int | None = None, hi: int | None = None):
  """Kernel tiles each device computes over a whole ring pass, from the block maps it runs on.

  Returns two (P,) int arrays: the non-EMPTY tiles (the work) and, of those, the FULL ones (no
  mask arithmetic), for the band ``lo <= kv - q <= hi`` on global positions (``hi=0``: causal).
  Benchmarks and tests use it to show a layout's load balance.
  """
  cfg = Config(B=1, T=Ts, S=Ss, K=1, G=1, H=1, scale=1.0, logits_soft_cap=None, dropout_rate=0.0)
  cc = _chunked.ChunkedConfig(cfg, _masks.BlockGrid(Ts, Ss, block_q, block_kv))
  rc = _RingConfig(cc, None, num_devices, layout, lo, hi)
  work, full = np.zeros(num_devices, np.int64), np.zeros(num_devices, np.int64)
  for d in range(num_devices):
    q_pos = _padded_positions(d, Ts, cc.Tp, rc)
    for j in range(num_devices):
      states = np.asarray(_pair(rc, q_pos, j, (None, None), (None, None))[1])
      work[d] += int((states != _masks.EMPTY).sum())
      full[d] += int((states == _masks.FULL).sum())
  return work, full


def _send(rc: _RingConfig, tree):
  """Pass every array of ``tree`` to the next device on the ring (device d -> d + 1)."""
  P = rc.num_devices
  perm = [(d, (d + 1) % P) for d in range(P)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, rc.axis_name, perm), tree)


def _merge_pair(out_a, lse_a, out_b, lse_b):
  """Exact merge of two results over disjoint key sets, in the statistics dtype.

  The kernels mark a row with nothing to attend to by the finite lse NEG and output 0, so the
  weights stay finite: two NEG rows give weights (1, 1), out 0 and lse NEG + log 2 (= NEG in
  float32); a NEG row against a real one gets weight exp(NEG - lse) = 0.
  """
  m = jnp.maximum(lse_a, lse_b)
  wa = jnp.exp(lse_a - m)
  wb = jnp.exp(lse_b - m)
  tot = wa + wb  # >= 1
  out = (out_a * wa[..., None] + out_b * wb[..., None]) / tot[..., None]
  return out, m + jnp.log(tot)


# --------------------------------------------------------------------------------------------
# The ring: forward, backward, custom VJP.
# --------------------------------------------------------------------------------------------


def _ring_forward(rc: _RingConfig, q, k, v, lengths, segs):
  """q (B,Tp,N,H), k/v (B,Sp,K,H) local shards -> out (B,Tp,N,H), lse (B,Tp,N)."""
  cc = rc.cc
  B, Tp, N, _ = q.shape
  Hv = v.shape[-1]
  sd = _tile.stat_dtype(q.dtype)
  P = rc.num_devices
  index = jax.lax.axis_index(rc.axis_name)
  q_pos = _padded_positions(index, cc.cfg.T, cc.Tp, rc)
  q_seg, kv_seg = segs

  def attend(step, k, v, kv_seg):
    # After `step` sends, this device holds the shard of device index - step.
    mask, states = _pair(rc, q_pos, (index - step) % P, lengths, (q_seg, kv_seg))
    out, lse = _chunked._forward(cc, q, k, v, None, mask, states, _NO_SEED, (), None)
    return out.astype(sd), lse.astype(sd)

  def body(step, carry):
    k, v, kv_seg, out, lse = carry
    # The send does not depend on this step's compute, so the transfer can overlap it.
    k_next, v_next, seg_next = _send(rc, (k, v, kv_seg))
    o, l = attend(step, k, v, kv_seg)
    out, lse = _merge_pair(out, lse, o, l)
    return k_next, v_next, seg_next, out, lse

  out0 = _varying(jnp.zeros((B, Tp, N, Hv), sd), q, k, v)
  lse0 = _varying(jnp.full((B, Tp, N), NEG, sd), q, k, v)
  # The P-th send only returns the shards to their owners. Peeling the last step off the loop
  # would save it, but trace and compile the kernel twice; the send overlaps the last step's
  # compute anyway.
  _, _, _, out, lse = jax.lax.fori_loop(0, P, body, (k, v, kv_seg, out0, lse0))
  return out.astype(q.dtype), lse


def _ring_backward(rc: _RingConfig, q, k, v, lengths, segs, out, lse, dout):
  cc = rc.cc
  sd = _tile.stat_dtype(q.dtype)
  P = rc.num_devices
  index = jax.lax.axis_index(rc.axis_name)
  q_pos = _padded_positions(index, cc.cfg.T, cc.Tp, rc)
  q_seg, kv_seg = segs

  def grads(step, k, v, kv_seg):
    mask, states = _pair(rc, q_pos, (index - step) % P, lengths, (q_seg, kv_seg))
    dq, dk, dv, _, _, _ = _chunked._backward(cc, q, k, v, None, mask, states, _NO_SEED, (), None,
                                             out, lse, dout)
    return dq.astype(sd), dk.astype(sd), dv.astype(sd)

  def body(step, carry):
    k, v, kv_seg, dk, dv, dq = carry
    k_next, v_next, seg_next = _send(rc, (k, v, kv_seg))
    dq_s, dk_s, dv_s = grads(step, k, v, kv_seg)
    # dK, dV travel with their shard: after P sends they are back on its owner.
    dk, dv = _send(rc, (dk + dk_s, dv + dv_s))
    return k_next, v_next, seg_next, dk, dv, dq + dq_s

  dk0 = _varying(jnp.zeros(k.shape, sd), q, k, v, dout)
  dv0 = _varying(jnp.zeros(v.shape, sd), q, k, v, dout)
  dq0 = _varying(jnp.zeros(q.shape, sd), q, k, v, dout)
  _, _, _, dk, dv, dq = jax.lax.fori_loop(0, P, body, (k, v, kv_seg, dk0, dv0, dq0))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(rc, q, k, v, lengths, segs):
  return _ring_forward(rc, q, k, v, lengths, segs)


def _ring_fwd(rc, q, k, v, lengths, segs):
  out, lse = _ring_forward(rc, q, k, v, lengths, segs)
  return (out, lse), (q, k, v, lengths, segs, out, lse)


def _ring_bwd(rc, res, cts):
  q, k, v, lengths, segs, out, lse = res
  dout, _ = cts  # the log-sum-exp output carries no gradient (as in dot_product_attention)
  dq, dk, dv = _ring_backward(rc, q, k, v, lengths, segs, out, lse, dout)
  zero = lambda tree: jax.tree.map(_chunked._zero_cotangent, tree)
  return dq, dk, dv, zero(lengths), zero(segs)


_ring.defvjp(_ring_fwd, _ring_bwd)


# --------------------------------------------------------------------------------------------
# Public functions.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _RingOptions:
  """The static (hashable) options of one call."""

  axis_name: Any
  num_devices: int
  layout: str
  scale: float | None
  causal: str | None
  window: tuple[int, int] | None
  logits_soft_cap: float | None
  block_q: int | None
  block_kv: int | None
  return_residual: bool


def ring_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    axis_name,
    scale: float | None = None,
    is_causal: bool | str = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    layout: str = "contiguous",
    block_q: int | None = None,
    block_kv: int | None = None,
    return_residual: bool = False,
    score_mod=None,
    sinks=None,
):
  r"""Ring (context-parallel) attention; call it inside `jax.shard_map`.

  The query and key/value sequences are sharded along the mesh axis ``axis_name`` of P devices;
  each call sees one device's shards. The result equals
  ``jattn.dot_product_attention`` on the whole (unsharded) sequences, sharded the same way. Each
  device keeps its queries and passes key/value shards around the ring with `jax.lax.ppermute`
  (P steps, each one send of the shard; the backward pass also sends the key/value gradients).
  Memory per device does not grow with P.

  Args:
    query: this device's shard (B, Ts, N, H) (or (Ts, N, H)), Ts = T / P.
    key: (B, Ss, K, H), Ss = S / P; K must divide N (GQA / MQA).
    value: same shape as ``key``.
    bias, mask: not supported (NotImplementedError): an (T, S) array cannot be split into the
      ring's blocks without being all-gathered. Use the keyword masks below.
    axis_name: the `shard_map` mesh axis the sequence is sharded along.
    scale: logit scale; default ``1 / sqrt(H)``.
    is_causal: ``False``, ``True`` / ``"top_left"`` or ``"bottom_right"``, on *global* positions
      (bottom_right aligns the last query with the last key: offset S - T).
    query_seq_lengths, key_value_seq_lengths: int (B,) valid lengths in global positions (not
      sharded: the same on every device of the ring).
    local_window_size: ``w`` or ``(left, right)``, on global positions, as in
      ``dot_product_attention``.
    q_segment_ids: int (B, Ts), this device's shard of the (B, T) ids, in the same layout as the
      queries; kv_segment_ids: int (B, Ss) likewise (they travel with their key/value shard).
    logits_soft_cap: ``cap * tanh(logits / cap)``.
    dropout_rate, dropout_rng, score_mod, sinks: not supported (NotImplementedError).
    layout: ``"contiguous"`` (device d holds positions [d * Ts, (d + 1) * Ts)) or ``"zigzag"``
      (the sequence in 2P chunks, device d holding chunks d and 2P-1-d: balanced under a causal
      mask; permute with `zigzag_permute` first). Ts and Ss must be even for zigzag.
    block_q, block_kv: kernel block sizes within a shard (default 512 and 256, at most the shard, and for
      zigzag at most one chunk, so that no block straddles two chunks).
    return_residual: also return this device's log-sum-exp (B, Ts, N), without gradient.

  Returns:
    This device's output shard, shaped like ``query`` (and with
    ``return_residual``, (output, lse)).

  Call it inside ``jax.shard_map`` (``check_vma`` either way), or use `ring_attention_sharded`.
  """
  unsupported = [name for name, given in (
      ("bias", bias is not None), ("mask", mask is not None),
      ("dropout_rate", _validation.dropout(dropout_rate, dropout_rng) > 0),
      ("score_mod", score_mod is not None), ("sinks", sinks is not None)) if given]
  if unsupported:
    raise NotImplementedError(
        f"ring_attention does not support {', '.join(unsupported)}: a bias or mask array spans "
        "the whole (T, S) and would have to be all-gathered; dropout, score_mod and sinks would "
        "see shard-local positions or count once per shard. Supported: is_causal, "
        "local_window_size, query_seq_lengths, key_value_seq_lengths, q/kv_segment_ids, "
        "logits_soft_cap, scale.")
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  try:
    hash(axis_name)
  except TypeError:
    raise TypeError(f"axis_name must be a hashable mesh axis name, got {axis_name!r}") from None
  try:
    num_devices = jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"ring_attention: axis_name={axis_name!r} is not a bound mesh axis; call it inside "
        f"jax.shard_map over a mesh with that axis (or use ring_attention_sharded)") from e
  opts = _RingOptions(
      axis_name=axis_name,
      num_devices=int(num_devices),
      layout=layout,
      scale=_validation.scale(scale),
      causal=_validation.causal(is_causal),
      window=_validation.window(local_window_size),
      logits_soft_cap=_validation.soft_cap(logits_soft_cap),
      block_q=_validation.block("block_q", block_q),
      block_kv=_validation.block("block_kv", block_kv),
      return_residual=_validation.flag("return_residual", return_residual),
  )
  return _ring_attention(query, key, value, query_seq_lengths, key_value_seq_lengths,
                         q_segment_ids, kv_segment_ids, opts=opts)


@functools.partial(jax.jit, static_argnames=("opts",))
def _ring_attention(query, key, value, q_lengths, kv_lengths, q_seg, kv_seg, *,
                    opts: _RingOptions):
  args = _validation.arrays(query, key, value, None, None, q_lengths, kv_lengths, q_seg, kv_seg,
                            None)
  query, key, value = args.query, args.key, args.value
  B, Ts, N, H = query.shape
  _, Ss, K, Hv = value.shape
  G = N // K
  P = opts.num_devices
  zigzag = opts.layout == "zigzag"
  if zigzag and (Ts % 2 or Ss % 2):
    raise ValueError(
        f"layout='zigzag' holds two equal chunks per device, so the shard lengths must be even; "
        f"got query shard Ts={Ts} and key shard Ss={Ss} (query.shape={query.shape}, "
        f"key.shape={key.shape})")
  T, S = Ts * P, Ss * P
  scale = opts.scale if opts.scale is not None else 1.0 / float(np.sqrt(H))

  # The global band lo <= kv - q <= hi, built as `_attention.build_mask` builds it.
  offset = 0 if opts.causal in (None, "top_left") else S - T
  lo = hi = None
  if opts.causal is not None:
    hi = offset
  if opts.window is not None:
    left, right = opts.window
    lo = None if left is None else offset - left
    if right is not None:
      hi = offset + right if hi is None else min(hi, offset + right)

  cap_q, cap_kv = (Ts // 2, Ss // 2) if zigzag else (Ts, Ss)
  bq = min(opts.block_q or min(DEFAULT_BLOCK_Q, cap_q), Ts)
  bk = min(opts.block_kv or min(DEFAULT_BLOCK_KV, cap_kv), Ss)
  cfg = Config(B=B, T=Ts, S=Ss, K=K, G=G, H=H, scale=scale,
               logits_soft_cap=opts.logits_soft_cap, dropout_rate=0.0)
  cc = _chunked.ChunkedConfig(cfg, _masks.BlockGrid(Ts, Ss, bq, bk))
  rc = _RingConfig(cc, opts.axis_name, P, opts.layout, lo, hi)

  # Sequence-major as the chunked kernel takes them, padded to whole blocks: (B, Tp, N, H).
  q, k, v = query, key, value
  pt, ps = cc.Tp - Ts, cc.Sp - Ss
  if pt:
    q = jnp.pad(q, ((0, 0), (0, pt), (0, 0), (0, 0)))
  if ps:
    k = jnp.pad(k, ((0, 0), (0, ps), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, ps), (0, 0), (0, 0)))

  out, lse = _ring(rc, q, k, v, (args.q_lengths, args.kv_lengths), (args.q_seg, args.kv_seg))
  out = out[:, :Ts]
  if args.unbatched:
    out = out[0]
  if not opts.return_residual:
    return out
  lse = lse[:, :Ts]
  lse = jnp.maximum(lse, jnp.asarray(jnp.finfo(query.dtype).min, lse.dtype)).astype(query.dtype)
  if args.unbatched:
    lse = lse[0]
  return out, jax.lax.stop_gradient(lse)


def merge_attention(outs, lses):
  """Merge attention results over disjoint key sets into the result over their union.

  If ``out_i, lse_i`` is attention of the same queries over key set ``S_i`` (as returned by
  ``dot_product_attention(..., return_residual=True)``), the merged result is attention over the
  union of the ``S_i``: ``lse = log(sum_i exp(lse_i))`` and
  ``out = sum_i exp(lse_i - lse) * out_i``, computed with the max subtracted and in float32 (or
  wider). Split-KV decoding uses it to combine partial results over pieces of a KV cache.

  A row with nothing to attend to in one part (its lse very negative: -inf, or jattn's finite
  sentinel) gets weight 0 there; a row with nothing in any part returns out 0 and keeps its very
  negative lse, without NaN.

  Args:
    outs: a sequence of n arrays (B, T, N, H) -- or any (..., H) -- or one stacked (n, ..., H)
      array.
    lses: the matching log-sum-exps, a sequence of n arrays (B, T, N) or one (n, ...) array.

  Returns:
    (out, lse): out (B, T, N, H) in the dtype of ``outs``, lse (B, T, N) in the dtype of ``lses``.
  """
  outs = _stack("outs", outs)
  lses = _stack("lses", lses)
  for name, x in (("outs", outs), ("lses", lses)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
  if outs.ndim < 2 or lses.shape != outs.shape[:-1]:
    raise ValueError(f"lses must have the shape of outs without its last (H) axis: stacked "
                     f"outs.shape={outs.shape}, lses.shape={lses.shape}")
  if outs.shape[0] == 0:
    raise ValueError("merge_attention needs at least one partial result, got 0")
  return _merge(outs, lses)


@jax.jit
def _merge(outs, lses):
  sd = _tile.stat_dtype(jnp.promote_types(outs.dtype, lses.dtype))
  o = outs.astype(sd)
  l = lses.astype(sd)
  m = l.max(axis=0)
  # The shift only conditions the exponent (its gradient cancels); rows that are -inf
  # everywhere shift by 0 so that exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN.
  shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, jnp.zeros((), sd)))
  w = jnp.exp(l - shift[None])  # (n, ...)
  tot = w.sum(axis=0)
  ok = tot > 0
  safe_tot = jnp.where(ok, tot, jnp.ones((), sd))
  out = (w[..., None] * o).sum(axis=0) / safe_tot[..., None]
  lse = jnp.where(ok, shift + jnp.log(safe_tot), m)
  return out.astype(outs.dtype), lse.astype(lses.dtype)


def _stack(name, xs):
  if isinstance(xs, (list, tuple)):
    if not xs:
      raise ValueError(f"{name} must hold at least one partial result, got an empty sequence")
    xs = [jnp.asarray(x) for x in xs]
    shapes = {x.shape for x in xs}
    dtypes = {x.dtype for x in xs}
    if len(shapes) > 1 or len(dtypes) > 1:
      raise ValueError(f"all {name} must share one shape and dtype, got "
                       f"{[(x.shape, str(x.dtype)) for x in xs]}")
    return jnp.stack(xs)
  return jnp.asarray(xs)


def ring_attention_sharded(query, key, value, *, mesh, seq_axis, batch_axis=None,
                           head_axis=None, query_seq_lengths=None, key_value_seq_lengths=None,
                           q_segment_ids=None, kv_segment_ids=None, **kwargs):
  """`ring_attention` on global arrays: sets up the `jax.shard_map` over ``mesh``.

  Shards query, key and value (B, T, N, H) / (B, S, K, H) as ``P(batch_axis, seq_axis,
  head_axis, None)``: the sequence along ``seq_axis`` (the ring), optionally the batch along
  ``batch_axis`` (data parallel) and the heads along ``head_axis`` (tensor parallel: K must be a
  multiple of that axis's size, so each device keeps whole GQA groups). Mesh axes not named stay
  under the compiler's automatic sharding. Segment ids (B, T) / (B, S) are sharded like the
  sequence; lengths (B,) only along the batch.

  With ``layout="zigzag"`` the arrays (and segment ids) must already be in zigzag order
  (`zigzag_permute`); the output comes back in that order too (`zigzag_unpermute`).

  Args:
    query, key, value: global (B, T, N, H), (B, S, K, H), (B, S, K, H) arrays.
    mesh: a `jax.sharding.Mesh`.
    seq_axis: the mesh axis name of the ring.
    batch_axis, head_axis: optional mesh axis names for B and N/K.
    query_seq_lengths, key_value_seq_lengths, q_segment_ids, kv_segment_ids: as in
      `ring_attention`, global.
    **kwargs: the other keyword arguments of `ring_attention` (is_causal, layout, scale, ...).

  Returns:
    The global (B, T, N, H) output (and with ``return_residual``, the (B, T, N) lse), sharded
    like the query.
  """
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if "axis_name" in kwargs:
    raise TypeError("ring_attention_sharded takes seq_axis=, not axis_name=")
  axes = {"seq_axis": seq_axis, "batch_axis": batch_axis, "head_axis": head_axis}
  for name, ax in axes.items():
    if ax is not None and ax not in mesh.axis_names:
      raise ValueError(f"{name}={ax!r} is not an axis of the mesh {mesh.axis_names}")
  if seq_axis is None:
    raise ValueError("seq_axis must name a mesh axis, got None")
  used = [ax for ax in axes.values() if ax is not None]
  if len(set(used)) != len(used):
    raise ValueError(f"seq_axis, batch_axis and head_axis must be distinct mesh axes, got {axes}")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if jnp.ndim(x) != 4:
      raise ValueError(f"{name} must be a global (B, T|S, N|K, H) array, got shape "
                       f"{jnp.shape(x)}")
  B, T, N, _ = jnp.shape(query)
  _, S, K, _ = jnp.shape(key)
  size = lambda ax: 1 if ax is None else mesh.shape[ax]
  chunks = size(seq_axis) * (2 if kwargs.get("layout", "contiguous") == "zigzag" else 1)
  for what, n, d in (("T (query.shape[1])", T, chunks), ("S (key.shape[1])", S, chunks),
                     ("B (query.shape[0])", B, size(batch_axis)),
                     ("N (query.shape[2])", N, size(head_axis)),
                     ("K (key.shape[2])", K, size(head_axis))):
    if n % d:
      raise ValueError(f"{what} = {n} must be a multiple of {d} to shard over mesh {mesh.shape} "
                       f"(seq_axis={seq_axis!r}, batch_axis={batch_axis!r}, "
                       f"head_axis={head_axis!r}, layout={kwargs.get('layout', 'contiguous')!r})")

  PS = jax.sharding.PartitionSpec
  seq_spec = PS(batch_axis, seq_axis, head_axis, None)
  extras, extra_specs = {}, {}
  for name, x, spec in (("query_seq_lengths", query_seq_lengths, PS(batch_axis)),
                        ("key_value_seq_lengths", key_value_seq_lengths, PS(batch_axis)),
                        ("q_segment_ids", q_segment_ids, PS(batch_axis, seq_axis)),
                        ("kv_segment_ids", kv_segment_ids, PS(batch_axis, seq_axis))):
    if x is not None:
      extras[name], extra_specs[name] = x, spec
  out_spec = seq_spec
  if kwargs.get("return_residual", False):
    out_spec = (seq_spec, PS(batch_axis, seq_axis, head_axis))

  def body(q, k, v, extra):
    return ring_attention(q, k, v, axis_name=seq_axis, **extra, **kwargs)

  in_specs = (seq_spec, seq_spec, seq_spec, extra_specs)
  args = (query, key, value, extras)
  axis_types = dict(zip(mesh.axis_names, mesh.axis_types))
  if any(axis_types[ax] == jax.sharding.AxisType.Explicit for ax in used):
    # Explicit mesh axes make the sharding part of the array type: shard_map wants inputs
    # already laid out as in_specs say.
    put = lambda x, spec: jax.reshard(x, jax.sharding.NamedSharding(mesh, spec))
    args = (put(query, seq_spec), put(key, seq_spec), put(value, seq_spec),
            {name: put(x, extra_specs[name]) for name, x in extras.items()})
  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                     axis_names=frozenset(used), check_vma=False)
  return fn(*args)
