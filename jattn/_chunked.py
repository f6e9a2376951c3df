"""Chunked attention: online softmax over key/value blocks, O(T + S) memory forward and backward.

The FlashAttention algorithm in pure JAX, so XLA compiles it for CPU, GPU and TPU.

Forward, for each query block: walk the key/value blocks that the mask does not hide, keeping a
running max m, running sum l and an fp32 accumulator acc. When a block raises the max from m to
m', the old sum and accumulator are rescaled by exp(m - m') -- the same max trick as the stable
softmax, applied incrementally. At the end out = acc / l and the log-sum-exp m + log(l) is saved.

Backward (a custom VJP, so nothing of size T x S is stored): for each key/value block, walk the
query blocks that can see it, recompute P = exp(S - lse) from the saved log-sum-exp, and
accumulate dV = P^T dO, dK = dS^T Q and dQ = dS K with dS = P * (dO V^T - rowsum(dO * O)).

Block skipping: a (num_q_blocks, num_kv_blocks) int8 map of EMPTY / PARTIAL / FULL (see
`jattn.masks`) drives both loops. Each loop only runs over the range of non-empty blocks, a switch
skips any EMPTY block inside that range, and FULL blocks take a branch without mask arithmetic.

Layout: the kernels take and return arrays sequence-major, as callers hold them -- q and out
(B, Tp, N, H), k/v (B, Sp, K, H), lse (B, Tp, N), with Tp, Sp padded up to whole blocks -- and
transpose one block at a time into the head-major tiles of `jattn._tile` ((B, K, G, bq, H) and
(B, K, bk, H)). Transposing whole arrays up front instead costs a full-size copy of every input
and output per call (at T = 4096, N = 8, H = 64: 34.5 MiB of XLA temporaries against 10.5).
The backward keeps its score tiles key-major, (B, K, bk, G, bq): see `_rows_matmul`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _sharding, _tile
from jattn._tile import Config
from jattn.masks import EMPTY, FULL, PARTIAL, BlockGrid

# A test hook: when set (at trace time) to a Python callable, every computed block calls it with
# (pass, q_block, kv_block, state) through `jax.debug.callback`. It lets tests check that EMPTY
# blocks are never computed, from the program actually run.
_BLOCK_HOOK = None


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkedConfig:
  cfg: Config
  grid: BlockGrid  # over the true (T, S)
  # The block states that can occur (static); only their tile variants are compiled.
  kinds: tuple[int, ...] = (EMPTY, PARTIAL, FULL)
  # For a block map known at trace time, `static_ranges` of it and of its transpose: the loops
  # then run between constants (Python ints when every row has the same range) instead of
  # bounds computed from the map at run time.
  q_ranges: tuple[tuple[int, int], ...] | None = None
  kv_ranges: tuple[tuple[int, int], ...] | None = None

  @property
  def Tp(self):
    return self.grid.num_q_blocks * self.grid.block_q

  @property
  def Sp(self):
    return self.grid.num_kv_blocks * self.grid.block_kv


def _nonempty_range(states):
  """Per row of a (R, C) state map: [first, last + 1) of its non-empty columns (0, 0 if none).

  NumPy in, NumPy out (a map known at trace time); jax in, jax out.
  """
  xp = np if isinstance(states, np.ndarray) else jnp
  ne = states != EMPTY
  has = ne.any(axis=1)
  C = states.shape[1]
  first = xp.argmax(ne, axis=1).astype(np.int32)
  last = (C - xp.argmax(ne[:, ::-1], axis=1)).astype(np.int32)
  zero = np.int32(0)
  return xp.where(has, first, zero), xp.where(has, last, zero)


def static_ranges(states: np.ndarray) -> tuple[tuple[int, int], ...]:
  """`_nonempty_range` of a map known at trace time, as a hashable tuple of (first, last + 1)."""
  first, last = _nonempty_range(states)
  return tuple(zip(first.tolist(), last.tolist()))


def _loop_bounds(ranges, states):
  """Functions i -> first and i -> last + 1 non-empty block of row i of ``states``."""
  if ranges is None:
    lo, hi = _nonempty_range(states)
    return (lambda i: lo[i]), (lambda i: hi[i])
  if len(set(ranges)) == 1:
    first, last = ranges[0]
    return (lambda i: first), (lambda i: last)
  lo, hi = (jnp.asarray(np.array(col, np.int32)) for col in zip(*ranges))
  return (lambda i: lo[i]), (lambda i: hi[i])


def _hook(pass_name, i, j, state):
  if _BLOCK_HOOK is not None:
    hook = _BLOCK_HOOK
    jax.debug.callback(lambda i, j, s: hook(pass_name, int(i), int(j), int(s)), i, j, state)


def _slice(x, start, size, axis):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _bias_block(bias, i, j, grid):
  """Slice a (B|1,K|1,G|1,Tp|1,Sp|1) bias for tile (i, j); broadcast dims stay size 1."""
  if bias is None:
    return None
  if bias.shape[3] != 1:
    bias = _slice(bias, i * grid.block_q, grid.block_q, 3)
  if bias.shape[4] != 1:
    bias = _slice(bias, j * grid.block_kv, grid.block_kv, 4)
  return bias


def _varying(x, *like):
  """Type a fresh loop carry as device-varying over the manual mesh axes of ``like``.

  Inside `jax.shard_map` with ``check_vma=True`` (ring attention), a carry that starts as a
  constant but becomes device-dependent in the loop body would change type; this declares it
  device-dependent from the start. Outside shard_map it returns ``x`` unchanged.
  """
  # Only the axes x does not vary over yet: a carry made from an input already varies.
  axes = set().union(*(_varying_axes(a) for a in like)) - _varying_axes(x)
  return jax.lax.pcast(x, tuple(sorted(axes, key=str)), to="varying") if axes else x


def _varying_axes(x) -> frozenset:
  """Manual mesh axes over which ``x`` varies (``typeof(x).mat.varying``; ``.vma`` before)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _kv_rows_matmul(x, rows, out_dtype):
  """(B,K,tk,H) x (B,K,t,H) -> (B,K,tk,t): key-major scores (rows of q or dO as columns)."""
  return jnp.einsum("bksh,bkth->bkst", x, rows, preferred_element_type=out_dtype)


def _rows_matmul(a, b, out_dtype):
  """(B,K,m,t) x (B,K,t,n) -> (B,K,m,n), a plain matmul per (batch, kv head).

  The backward keeps its (tk, tq) tiles key-major so that dV = P^T dO, dK = dS^T Q and
  dQ^T = K^T dS^T all have this standard form: XLA's CPU backend runs a matmul whose left
  operand is contracted over its rows (P^T dO from a query-major P) about 40% slower.
  """
  return jnp.einsum("bkmt,bktn->bkmn", a, b, preferred_element_type=out_dtype)


def _key_major(x):
  """A (B|1, K|1, G|1, tq|1, tk|1) tile quantity as (B|1, K|1, tk|1, G|1, tq|1)."""
  return jnp.transpose(x, (0, 1, 4, 2, 3))


def _query_major(x):
  """The inverse of `_key_major`."""
  return jnp.transpose(x, (0, 1, 3, 4, 2))


def _dispatch(kinds, state, branches, *args):
  """Run ``branches[state]`` ({EMPTY: f, PARTIAL: f, FULL: f}) for a traced block state,
  compiling only the states in ``kinds``: a direct call when there is one, else a switch."""
  if len(kinds) == 1:
    return branches[kinds[0]](*args)
  table = np.zeros(3, np.int32)
  for pos, kind in enumerate(kinds):
    table[kind] = pos
  index = jnp.asarray(table)[state.astype(jnp.int32)]
  fns = [branches[kind] for kind in kinds]
  if _sharding.explicit_mesh():
    # Branches that pass a carry through or return fresh zeros must return the sharding the
    # computing branch (the last: PARTIAL or FULL) gives its results.
    want = jax.eval_shape(fns[-1], *args)
    fns = [lambda *a, f=f: _sharding.reshard_like(f(*a), want) for f in fns]
  return jax.lax.switch(index, fns, *args)


def _varying_tree(tree, *like):
  return jax.tree.map(lambda x: _varying(x, *like), tree)


def _positions(i, block):
  return i * block + jnp.arange(block, dtype=jnp.int32)


def _q_tile(x, i, bq, K, G):
  """Query block i of a (B, Tp, N, X) array as a (B, K, G, bq, X) tile (head n = k * G + g)."""
  # Transposing the 4-D block and then splitting N keeps to standard layouts; transposing after
  # the split makes XLA's CPU backend copy the tile twice.
  b = jnp.transpose(_slice(x, i * bq, bq, 1), (0, 2, 1, 3))
  return b.reshape(b.shape[0], K, G, bq, b.shape[-1])


def _kv_tile(x, j, bk):
  """Key/value block j of a (B, Sp, K, X) array as a (B, K, bk, X) tile."""
  return jnp.transpose(_slice(x, j * bk, bk, 1), (0, 2, 1, 3))


def _row_tile(x, i, bq, K, G):
  """Block i of per-query statistics (B, Tp, N) as (B, K, G, bq)."""
  b = jnp.transpose(_slice(x, i * bq, bq, 1), (0, 2, 1))
  return b.reshape(b.shape[0], K, G, bq)


def _put_q_tile(x, tile, i, bq):
  """Write a (B, K, G, bq) or (B, K, G, bq, X) tile back as block i of (B, Tp, N[, X])."""
  B, K, G = tile.shape[:3]
  rows = tile.reshape((B, K * G) + tile.shape[3:])
  rows = jnp.transpose(rows, (0, 2, 1) + tuple(range(3, rows.ndim)))
  return jax.lax.dynamic_update_slice_in_dim(x, rows.astype(x.dtype), i * bq, axis=1)


def _put_kv_tile(x, tile, j, bk):
  """Write a (B, K, bk, X) tile back as block j of a (B, Sp, K, X) array."""
  return jax.lax.dynamic_update_slice_in_dim(x, jnp.transpose(tile, (0, 2, 1, 3)).astype(x.dtype),
                                             j * bk, axis=1)


# --------------------------------------------------------------------------------------------
# Forward.
# --------------------------------------------------------------------------------------------


def _forward(cc: ChunkedConfig, q, k, v, bias, mask, states, seed, score_args, sink):
  """q (B,Tp,N,H), k/v (B,Sp,K,H) -> out (B,Tp,N,Hv) in q's dtype, lse (B,Tp,N)."""
  cfg, grid = cc.cfg, cc.grid
  B, K, G = cfg.B, cfg.K, cfg.G
  bq, bk = grid.block_q, grid.block_kv
  sd = _tile.stat_dtype(q.dtype)
  ragged = cfg.S % bk != 0
  lo, hi = _loop_bounds(cc.q_ranges, states)
  Hv = v.shape[-1]

  def q_block(i, carry):
    out, lse = carry
    q_pos = _positions(i, bq)
    qb = _q_tile(q, i, bq, K, G)

    def tile(j, carry, masked: bool):
      m, l, acc = carry
      kv_pos = _positions(j, bk)
      kb, vb = _kv_tile(k, j, bk), _kv_tile(v, j, bk)
      qt = qb
      vis = None
      if masked:
        vis = _tile.visible(cfg, mask, q_pos, kv_pos, ragged_kv=ragged)
        if vis is not None:
          qt, kb, vb = _tile.sanitize(vis, qb, kb, vb)
      s, _ = _tile.logits(cfg, qt, kb, _bias_block(bias, i, j, grid), q_pos, kv_pos, score_args)
      if vis is not None:
        s = jnp.where(vis, s, jnp.asarray(_tile.NEG, sd))
      m_new = jnp.maximum(m, s.max(axis=-1))
      # Masked entries give exact zeros once the row has seen a visible key; before that
      # (m_new = NEG) they add junk that corr = exp(NEG - m) = 0 wipes when a visible key comes,
      # and safe_normalize discards if none ever does.
      p = jnp.exp(s - m_new[..., None])
      corr = jnp.exp(m - m_new)
      l = l * corr + p.sum(axis=-1)
      if cfg.dropout_rate > 0:
        p = jnp.where(_tile.keep(cfg, seed, q_pos, kv_pos), p, jnp.zeros((), sd))
      acc = acc * corr[..., None] + _tile.pv(p, vb)
      _hook("fwd", i, j, jnp.int8(PARTIAL if masked else FULL))
      return m_new, l, acc

    def body(j, carry):
      return _dispatch(cc.kinds, states[i, j],
                       {EMPTY: lambda j, c: c, PARTIAL: functools.partial(tile, masked=True),
                        FULL: functools.partial(tile, masked=False)}, j, carry)

    # Carries are made from the tiles they accumulate, so they share the inputs' sharding when
    # that is part of the type (an Explicit-axis mesh): a fresh jnp.zeros would be replicated.
    row0 = jnp.zeros_like(qb[..., 0], dtype=sd)  # (B, K, G, bq)
    m0 = row0 + jnp.asarray(_tile.NEG, sd)
    l0 = row0
    if sink is not None:
      # The sink is one more logit in every row, with no value: it starts the running max and
      # contributes exp(sink - m) to the sum.
      m0 = row0 + sink.astype(sd)  # (1, K, G, 1) -> (B, K, G, bq)
      l0 = row0 + jnp.ones((), sd)
    acc0 = jnp.zeros_like(qb, dtype=sd)  # (B, K, G, bq, Hv): Hv = H (value has key's shape)
    m0, l0, acc0 = (_varying(x, q, k, v, states) for x in (m0, l0, acc0))
    m, l, acc = jax.lax.fori_loop(lo(i), hi(i), body, (m0, l0, acc0))
    out = _put_q_tile(out, _tile.safe_normalize(acc, l, m, cfg.dropout_rate), i, bq)
    lse = _put_q_tile(lse, _tile.safe_lse(m, l), i, bq)
    return out, lse

  # Each query block writes its rows of the output in place: stacking per-block results (as
  # lax.map does) would need another full-size copy to put them back in sequence order.
  out0 = jnp.zeros_like(q)  # (B, Tp, N, Hv)
  lse0 = jnp.zeros_like(q[..., 0], dtype=sd)
  out0, lse0 = (_varying(x, q, k, v, states) for x in (out0, lse0))
  return jax.lax.fori_loop(0, grid.num_q_blocks, q_block, (out0, lse0))


# --------------------------------------------------------------------------------------------
# Backward.
# --------------------------------------------------------------------------------------------


def _backward(cc: ChunkedConfig, q, k, v, bias, mask, states, seed, score_args, sink, out, lse,
              dout):
  """Gradients for q, k, v (and bias, score_mod arrays, sinks), in the layout of `_forward`."""
  cfg, grid = cc.cfg, cc.grid
  B, K, G, H = cfg.B, cfg.K, cfg.G, q.shape[-1]
  bq, bk = grid.block_q, grid.block_kv
  sd = _tile.stat_dtype(q.dtype)
  ragged = cfg.S % bk != 0
  lo, hi = _loop_bounds(cc.kv_ranges, states.T)
  Hv = v.shape[-1]
  # rowsum(dO * O) = rowsum(P * dP): the softmax Jacobian's correction term, one per query.
  delta = jnp.einsum("btnh,btnh->btn", dout.astype(sd), out.astype(sd))
  keep_scale = 1.0 / (1.0 - cfg.dropout_rate) if cfg.dropout_rate > 0 else None
  lse_r = _tile.lse_for_recompute(lse)
  # The logit scale is applied to each finished dQ, dK block, not to every (tq, tk) tile.
  scale = jnp.asarray(cfg.scale, sd)

  def kv_block(j, carry):
    dq, dk, dv, dbias, dargs = carry
    kv_pos = _positions(j, bk)
    kb0, vb0 = _kv_tile(k, j, bk), _kv_tile(v, j, bk)

    # The (B, Tp, N, H) dQ and a full-size dBias stay outside the switch: a conditional that
    # threads a large array through its branches can copy it on every tile. The branches return
    # this tile's block contributions instead, added in place after the switch.
    dbias_block_shape = None if bias is None else _bias_contribution_shape(bias.shape, B, K, G,
                                                                           bq, bk)

    def tile(i, inner, masked: bool):
      dkb, dvb, dargs = inner
      q_pos = _positions(i, bq)
      qb, kb, vb = _q_tile(q, i, bq, K, G), kb0, vb0
      dob = _q_tile(dout, i, bq, K, G)
      # Per-query statistics broadcast along the key axis of the (B, K, bk, G, bq) tiles.
      lse_b = _row_tile(lse_r, i, bq, K, G)[:, :, None]
      delta_b = _row_tile(delta, i, bq, K, G)[:, :, None]
      vis = None
      if masked:
        vis = _tile.visible(cfg, mask, q_pos, kv_pos, ragged_kv=ragged)
        if vis is not None:
          qb, kb, vb = _tile.sanitize(vis, qb, kb, vb)
          vis = _key_major(vis)
      q2 = qb.reshape(B, K, G * bq, H)  # the G heads of a group stacked as rows
      do2 = dob.reshape(B, K, G * bq, Hv)
      bias_b = _bias_block(bias, i, j, grid)
      s = _kv_rows_matmul(kb, q2, sd).reshape(B, K, bk, G, bq)
      s, t = _tile.scale_cap_bias(cfg, s, None if bias_b is None else _key_major(bias_b))
      if cfg.score_mod is not None:
        # score_mod sees the tile in its documented (B, N, tq, tk) layout.
        s, mod_vjp = jax.vjp(
            lambda s_, a_: _key_major(_tile.apply_score_mod(cfg, _query_major(s_), q_pos, kv_pos,
                                                            a_)), s, score_args)
      if vis is not None:
        s = jnp.where(vis, s, jnp.asarray(_tile.NEG, sd))
      p = jnp.exp(s - lse_b)  # exact 0 where masked, and in empty rows (lse = inf)
      dp = _kv_rows_matmul(vb, do2, sd).reshape(B, K, bk, G, bq)
      if cfg.dropout_rate > 0:
        kept = _key_major(_tile.keep(cfg, seed, q_pos, kv_pos))
        pd = jnp.where(kept, p, jnp.zeros((), sd)) * jnp.asarray(keep_scale, sd)
        dp = jnp.where(kept, dp, jnp.zeros((), sd)) * jnp.asarray(keep_scale, sd)
      else:
        pd = p
      dvb = dvb + _rows_matmul(pd.astype(dob.dtype).reshape(B, K, bk, G * bq), do2, sd)
      # d loss / d (post-bias, post-score_mod) logits; 0 where p is (dp is finite: sanitized).
      ds = p * (dp - delta_b)
      if cfg.score_mod is not None:
        ds, dargs_b = mod_vjp(ds)
        dargs = jax.tree.map(jnp.add, dargs, dargs_b)
      dbias_b = (None if bias is None
                 else _bias_contribution(_query_major(ds), dbias_block_shape))
      if t is not None:
        ds = ds * (1.0 - t * t)
      dsc = ds.astype(q.dtype).reshape(B, K, bk, G * bq)
      dkb = dkb + _rows_matmul(dsc, q2, sd)
      # dQ^T = K^T dS^T: with K^T as the left operand both matmuls run in standard form.
      dq_t = _rows_matmul(jnp.swapaxes(kb, 2, 3), dsc, sd)  # (B, K, H, G * bq)
      _hook("bwd", i, j, jnp.int8(PARTIAL if masked else FULL))
      return (dkb, dvb, dargs), (dq_t, dbias_b)

    def skip(i, inner):
      zeros = (jnp.zeros((B, K, H, G * bq), sd),
               None if bias is None else jnp.zeros(dbias_block_shape, sd))
      return inner, _varying_tree(zeros, q, k, v, dout, states)

    def body(i, carry):
      dkb, dvb, dq, dbias, dargs = carry
      (dkb, dvb, dargs), (dq_t, dbias_b) = _dispatch(
          cc.kinds, states[i, j],
          {EMPTY: skip, PARTIAL: functools.partial(tile, masked=True),
           FULL: functools.partial(tile, masked=False)}, i, (dkb, dvb, dargs))
      # (B, K, H, G * bq) -> (B, bq, N, H), the rows of block i.
      rows = jnp.transpose(dq_t.reshape(B, K, H, G, bq), (0, 4, 1, 3, 2)).reshape(B, bq, K * G, H)
      dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, i * bq, bq, 1) + rows * scale,
                                               i * bq, axis=1)
      if dbias is not None:
        dbias = _accumulate_bias(dbias, dbias_b, i, j, grid)
      return dkb, dvb, dq, dbias, dargs

    dkb0 = jnp.zeros_like(kb0, dtype=sd)  # (B, K, bk, H), typed like the inputs (see _forward)
    dvb0 = jnp.zeros_like(vb0, dtype=sd)
    dkb0, dvb0 = (_varying(x, q, k, v, dout, states) for x in (dkb0, dvb0))
    dkb, dvb, dq, dbias, dargs = jax.lax.fori_loop(lo(j), hi(j), body,
                                                   (dkb0, dvb0, dq, dbias, dargs))
    # Every key block is finished here, so dK and dV are written once, in their own dtype.
    dk = _put_kv_tile(dk, dkb * scale, j, bk)
    dv = _put_kv_tile(dv, dvb, j, bk)
    return dq, dk, dv, dbias, dargs

  dq0 = jnp.zeros_like(q, dtype=sd)
  dk0 = jnp.zeros_like(k)
  dv0 = jnp.zeros_like(v)
  dbias0 = None if bias is None else jnp.zeros_like(bias, dtype=_tile.stat_dtype(bias.dtype))
  dargs0 = jax.tree.map(jnp.zeros_like, score_args)
  dq0, dk0, dv0, dbias0 = (None if x is None else _varying(x, q, k, v, dout, states)
                           for x in (dq0, dk0, dv0, dbias0))
  dq, dk, dv, dbias, dargs = jax.lax.fori_loop(0, grid.num_kv_blocks, kv_block,
                                               (dq0, dk0, dv0, dbias0, dargs0))
  dsink = None
  if sink is not None:
    # d out / d sink = -p_sink * out, so d loss / d sink = -sum_rows exp(sink - lse) * delta.
    # Padded query rows have delta = 0.
    p_sink = jnp.exp(sink.astype(sd).reshape(1, 1, K * G) - lse)
    dsink = -(p_sink * delta).sum(axis=(0, 1)).reshape(sink.shape)
    dsink = dsink.astype(sink.dtype)
  return (dq.astype(q.dtype), dk, dv, None if dbias is None else dbias.astype(bias.dtype), dargs,
          dsink)


def _bias_contribution_shape(bias_shape, B, K, G, bq, bk):
  """Shape of one tile's dBias block: the tile's (B, K, G, bq, bk), 1 where the bias broadcasts."""
  tile = (B, K, G, bq, bk)
  return tuple(1 if bias_shape[a] == 1 else tile[a] for a in range(5))


def _bias_contribution(ds, shape):
  """A tile's dS summed over the bias's broadcast dimensions."""
  axes = tuple(a for a in range(5) if shape[a] == 1 and ds.shape[a] != 1)
  return ds.sum(axis=axes, keepdims=True) if axes else ds


def _accumulate_bias(dbias, contrib, i, j, grid):
  """Add a tile's dBias block at its place in the (B|1,K|1,G|1,Tp|1,Sp|1) gradient."""
  start = (0, 0, 0, i * grid.block_q if dbias.shape[3] != 1 else 0,
           j * grid.block_kv if dbias.shape[4] != 1 else 0)
  cur = jax.lax.dynamic_slice(dbias, start, contrib.shape)
  return jax.lax.dynamic_update_slice(dbias, cur + contrib.astype(dbias.dtype), start)


# --------------------------------------------------------------------------------------------
# The custom VJP: inputs, output and log-sum-exp are the only residuals.
# --------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(cc, q, k, v, bias, mask, states, seed, score_args, sink):
  return _forward(cc, q, k, v, bias, mask, states, seed, score_args, sink)


def _chunked_fwd(cc, q, k, v, bias, mask, states, seed, score_args, sink):
  out, lse = _forward(cc, q, k, v, bias, mask, states, seed, score_args, sink)
  return (out, lse), (q, k, v, bias, mask, states, seed, score_args, sink, out, lse)


def _chunked_bwd(cc, res, cts):
  q, k, v, bias, mask, states, seed, score_args, sink, out, lse = res
  dout, _ = cts  # the log-sum-exp output carries no gradient (as in jax.nn)
  dq, dk, dv, dbias, dargs, dsink = _backward(cc, q, k, v, bias, mask, states, seed, score_args,
                                              sink, out, lse, dout)
  zero_mask = jax.tree.map(_zero_cotangent, mask)
  return (dq, dk, dv, dbias, zero_mask, _zero_cotangent(states), _zero_cotangent(seed), dargs,
          dsink)


def _zero_cotangent(x):
  if x is None:
    return None
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(cc: ChunkedConfig, q, k, v, bias, mask, states, seed, score_args=(),
                      sink=None):
  """q (B,T,N,H), k/v (B,S,K,H), bias (B|1,K|1,G|1,T|1,S|1), states (nq, nk) int8,
  sink (1,K,G,1).

  Pads T and S to whole blocks, runs the custom-VJP kernel, and slices the padding off.
  Returns out (B,T,N,H) and lse (B,T,N).
  """
  cfg = cc.cfg
  pt, ps = cc.Tp - cfg.T, cc.Sp - cfg.S
  if pt:
    q = jnp.pad(q, ((0, 0), (0, pt), (0, 0), (0, 0)))
  if ps:
    k = jnp.pad(k, ((0, 0), (0, ps), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, ps), (0, 0), (0, 0)))
  if bias is not None and (pt or ps):
    bias = jnp.pad(bias, ((0, 0),) * 3 + ((0, pt if bias.shape[3] != 1 else 0),
                                         (0, ps if bias.shape[4] != 1 else 0)))
  out, lse = _chunked(cc, q, k, v, bias, mask, states, seed, score_args, sink)
  if pt:
    out, lse = out[:, :cfg.T], lse[:, :cfg.T]
  return out, lse
