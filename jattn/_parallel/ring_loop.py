"""The ring's loop, one device's view (inside `jax.shard_map`): the operands of one (query shard,
key/value shard) pair on global positions, the P steps forward (each shard pair's chunked
forward, merged by log-sum-exp while K and V pass to the ring neighbour) and backward (dK and dV
travelling with their shard), their custom VJP (`ring`), and `tiles_per_device`, the work each
device's block maps give it. `jattn._parallel.ring` holds the public functions and why the ring
works (its docstring).

Shapes: B batch, T / S global query / key length, N query heads, K key/value heads, G = N // K,
H head dim; Ts = T / P and Ss = S / P are one device's shards.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _chunked, _derivatives, _sharding, _softmax, _tile
from jattn import masks as _masks
from jattn._chunked import plan as _plan
from jattn._parallel.zigzag import shard_positions
from jattn._tile import NEG, Config

# --------------------------------------------------------------------------------------------
# The operands of one (query shard, key/value shard) pair, in global positions.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class RingConfig:
  """Static description of one ring call (hashable: the custom VJP's nondiff argument)."""

  plan: _plan.Plan  # over one device's shards (Ts, Ss)
  axis_name: Any
  num_devices: int
  layout: str
  # (causal, window) measured in the positions of `Tokens.pos`, when the call gives them.
  by_position: tuple | None = None


class Tokens(NamedTuple):
  """The per-token arrays of one side of a shard pair, (B, Ts) for the queries or (B, Ss) for the
  keys, each None when not given: segment ids and positions. They are this device's slices (in
  the layout of the sequence), so a key shard's travel round the ring with it."""

  seg: Any = None
  pos: Any = None


class RingOperands(NamedTuple):
  """Everything a ring call reads besides q, k and v.

  mask: the call's position-based mask on global positions (built once; remapped per pair);
  q_tokens, kv_tokens: this device's (B, Ts) and the travelling (B, Ss) per-token arrays;
  seed: (2,) uint32 dropout words; score_args: the arrays a score_mod closes over; sink:
  (1, K, G, 1) or None; batch0, head0: int32 global index of this device's first batch element
  and query head (nonzero when the batch or heads are sharded too).
  """

  mask: Any
  q_tokens: Tokens
  kv_tokens: Tokens
  seed: Any
  score_args: tuple
  sink: Any
  batch0: Any
  head0: Any


def _padded_positions(index, length, padded, rc: RingConfig):
  pos = shard_positions(index, length, rc.num_devices, rc.layout)
  return jnp.pad(pos, (0, padded - length), mode="edge")


def _pair(rc: RingConfig, ro: RingOperands, q, k, v, q_index, kv_index, kv_tokens: Tokens):
  """Kernel operands for this device's queries against device ``kv_index``'s keys (whose
  per-token arrays, ``kv_tokens``, travelled with them)."""
  plan = rc.plan
  cfg = plan.cfg
  q_table = _padded_positions(q_index, cfg.T, plan.Tp, rc)
  kv_table = _padded_positions(kv_index, cfg.S, plan.Sp, rc)
  parts = [
    None if ro.mask is None else _masks.remap(ro.mask, q_table, kv_table, ro.batch0, ro.head0)
  ]
  # Segment ids and positions are per token: the key shard's travelled with it, so they are
  # local here (masks on local rows, not remapped).
  if ro.q_tokens.seg is not None:
    parts.append(_masks.segments(ro.q_tokens.seg, kv_tokens.seg))
  if rc.by_position is not None:
    causal, window = rc.by_position
    parts.append(_masks.positions(ro.q_tokens.pos, kv_tokens.pos, causal=causal, window=window))
  mask = _masks.combine(parts)
  states = _plan.block_map(mask, plan.grid, (cfg.B, cfg.N, cfg.T, cfg.S))
  positions = None
  if cfg.score_mod is not None or cfg.dropout_rate > 0:
    positions = _plan.Positions(q_table, kv_table, ro.batch0, ro.head0)
  score_args = ro.score_args
  if cfg.score_mod is not None:
    # score_mod was traced on arguments varying like q and k (see closure_convert_score_mod):
    # its indices and arrays are typed so here too (its arrays' gradient is summed over the
    # devices once, after the loops, in _ring_backward).
    positions = _sharding.varying_tree(positions, q, k)
    score_args = _sharding.varying_tree(score_args, q, k)
  return _plan.Operands(
    q=q,
    k=k,
    v=v,
    mask=mask,
    states=states,
    seed=ro.seed,
    score_args=score_args,
    positions=positions,
  )


def tiles_per_device(
  num_devices: int,
  layout: str,
  Ts: int,
  Ss: int,
  block_q: int,
  block_kv: int,
  lo: int | None = None,
  hi: int | None = None,
):
  """Kernel tiles each device computes over a whole ring pass, from the block maps it runs on.

  Returns two (P,) int arrays: the non-EMPTY tiles (the work) and, of those, the FULL ones (no
  mask arithmetic), for the band ``lo <= kv - q <= hi`` on global positions (``hi=0``: causal).
  Benchmarks and tests use it to show a layout's load balance.
  """
  cfg = Config(B=1, T=Ts, S=Ss, K=1, G=1, H=1, scale=1.0, logits_soft_cap=None, dropout_rate=0.0)
  plan, _ = _plan.make_plan(cfg, None, block_q, block_kv)
  rc = RingConfig(plan, None, num_devices, layout)
  mask = None if lo is None and hi is None else _masks.band(lo, hi)
  ro = RingOperands(mask, Tokens(), Tokens(), None, (), None, 0, 0)
  work, full = np.zeros(num_devices, np.int64), np.zeros(num_devices, np.int64)
  for d in range(num_devices):
    for j in range(num_devices):
      states = np.asarray(_pair(rc, ro, None, None, None, d, j, Tokens()).states)
      work[d] += int((states != _masks.EMPTY).sum())
      full[d] += int((states == _masks.FULL).sum())
  return work, full


def _send(rc: RingConfig, tree):
  """Pass every array of ``tree`` to the next device on the ring (device d -> d + 1)."""
  P = rc.num_devices
  perm = [(d, (d + 1) % P) for d in range(P)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, rc.axis_name, perm), tree)


# --------------------------------------------------------------------------------------------
# The ring: forward, backward, custom VJP.
# --------------------------------------------------------------------------------------------


def _ring_forward(rc: RingConfig, q, k, v, ro: RingOperands):
  """q (B,Tp,N,H), k/v (B,Sp,K,H) local shards -> out (B,Tp,N,H), lse (B,Tp,N), and with
  ``rc.plan.cfg.max_logits`` the rows' max logits (B,Tp,N): the max over every pair's."""
  B, Tp, N, _ = q.shape
  Hv = v.shape[-1]
  sd = _tile.stat_dtype(q.dtype)
  P = rc.num_devices
  index = jax.lax.axis_index(rc.axis_name)

  def body(step, carry):
    k, v, kv_tokens, out, lse, *mx = carry
    # The send does not depend on this step's compute, so the transfer can overlap it.
    k_next, v_next, tokens_next = _send(rc, (k, v, kv_tokens))
    # After `step` sends, this device holds the shard of device index - step.
    ops = _pair(rc, ro, q, k, v, index, (index - step) % P, kv_tokens)
    o, l, *m = _chunked.forward(rc.plan, ops)  # o in the statistics dtype (`_ring_config`)
    out, lse = _softmax.merge_pair(out, lse, o, l.astype(sd))
    mx = [jnp.maximum(a, b.astype(sd)) for a, b in zip(mx, m)]  # exact: a max of maxes
    return k_next, v_next, tokens_next, out, lse, *mx

  out0 = _sharding.varying(jnp.zeros((B, Tp, N, Hv), sd), q, k, v)
  lse0 = _sharding.varying(jnp.full((B, Tp, N), NEG, sd), q, k, v)
  mx0 = [lse0 + jnp.asarray(-jnp.inf, sd)] if rc.plan.cfg.max_logits else []  # typed as lse0
  # The P-th send only returns the shards to their owners. Peeling the last step off the loop
  # would save it, but trace and compile the kernel twice; the send overlaps the last step's
  # compute anyway.
  _, _, _, out, lse, *mx = jax.lax.fori_loop(0, P, body, (k, v, ro.kv_tokens, out0, lse0, *mx0))
  if ro.sink is not None:
    # The sink is one term of the whole row's softmax: added once, after every shard's part
    # (not a key: the max logits leave it out).
    out, lse = _softmax.add_sink(out, lse, ro.sink)
  return (out.astype(q.dtype), lse, *mx)


class _Residuals(NamedTuple):
  """What the ring's backward reads of its forward: this device's padded shards q (B, Tp, N, H),
  k and v (B, Sp, K, H), the operands, and the merged out (B, Tp, N, Hv) and lse (B, Tp, N)."""

  q: Any
  k: Any
  v: Any
  ro: RingOperands
  out: Any
  lse: Any


def _ring_backward(rc: RingConfig, res: _Residuals, dout, dlse):
  """(dq, dk, dv, the operands' cotangents) from the forward's residuals and the cotangents of
  out (B, Tp, N, Hv) and lse (B, Tp, N)."""
  q, k, v, ro, out, lse = res
  sd = _tile.stat_dtype(q.dtype)
  P = rc.num_devices
  index = jax.lax.axis_index(rc.axis_name)
  # Under shard_map(check_vma=True) values are typed device-varying or invariant, and the
  # gradient of an invariant input (the sinks, score_mod's arrays) must be invariant: the sum of
  # every device's share, a psum here. Without the typing (check_vma=False), shard_map sums the
  # per-device shares itself when it transposes.
  typed = rc.axis_name in _sharding.varying_axes(q)
  total = (lambda g: jax.lax.psum(g, rc.axis_name)) if typed else (lambda g: g)

  def body(step, carry):
    k, v, kv_tokens, dk, dv, dq, dargs = carry
    k_next, v_next, tokens_next = _send(rc, (k, v, kv_tokens))
    ops = _pair(rc, ro, q, k, v, index, (index - step) % P, kv_tokens)
    # The backward recomputes P = exp(S - lse) from the *global* lse (the sink included), so on
    # one key/value shard it gives that shard's share of dQ and the whole of its dK, dV.
    g = _chunked.backward(rc.plan, _chunked.Residuals(ops, out, lse), dout, dlse)
    # dK, dV travel with their shard: after P sends they are back on its owner.
    dk, dv = _send(rc, (dk + g.k.astype(sd), dv + g.v.astype(sd)))
    dargs = jax.tree.map(jnp.add, dargs, g.score_args)
    return k_next, v_next, tokens_next, dk, dv, dq + g.q.astype(sd), dargs

  dk0, dv0, dq0 = _sharding.varying_tree(
    (jnp.zeros(k.shape, sd), jnp.zeros(v.shape, sd), jnp.zeros(q.shape, sd)), q, k, v, dout
  )
  dargs0 = _sharding.varying_tree(jax.tree.map(jnp.zeros_like, ro.score_args), q, k, v, dout)
  if rc.plan.cfg.score_mod is None:
    dargs0 = ()
  _, _, _, dk, dv, dq, dargs = jax.lax.fori_loop(
    0, P, body, (k, v, ro.kv_tokens, dk0, dv0, dq0, dargs0)
  )
  dargs = jax.tree.map(total, dargs)
  dsink = None
  if ro.sink is not None:
    # The lse's cotangent lowers delta, as in _chunked.backward.
    delta = _softmax.output_delta(dout, out) - dlse.astype(sd)
    dsink = total(_softmax.sink_gradient(ro.sink, lse, delta))
  zeros = lambda tree: jax.tree.map(_derivatives.zero_cotangent, tree)
  dro = RingOperands(
    mask=zeros(ro.mask),
    q_tokens=zeros(ro.q_tokens),
    kv_tokens=zeros(ro.kv_tokens),
    seed=zeros(ro.seed),
    score_args=dargs,
    sink=dsink,
    batch0=zeros(ro.batch0),
    head0=zeros(ro.head0),
  )
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dro


# Traced when the call is staged and again by `_ring_fwd`: the second trace from the first's.
_ring_forward_once = _derivatives.traced_once(_ring_forward, static_argnums=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring(rc, q, k, v, ro):
  return _ring_forward_once(rc, q, k, v, ro)


def _ring_fwd(rc, q, k, v, ro):
  res = _ring_forward_once(rc, q, k, v, ro)
  return res, _Residuals(q, k, v, ro, res[0], res[1])


def _ring_bwd(rc, res, cts):
  dout, dlse = cts[:2]  # the max logits' cotangent, if any, is dropped: they are a statistic
  return _ring_backward(rc, res, dout, dlse)


ring.defvjp(_ring_fwd, _ring_bwd)
