"""Causality and windows measured in positions (`q_positions`, `kv_positions`,
`jattn.masks.positions`): a cache with padding inside, packed sequences whose positions restart.

Checked against a float64 reference that builds the visibility from the positions, index by
index, for every jattn kernel (dense, chunked in both schedules), with gradients; and block
skipping from per-block position ranges: no block the positions hide is computed. A batch in
which every example has positions of its own (restarting inside a block, offset with a gap,
repeated), and each example's block summary checked pair by pair before the batch reduces it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from attention_cases import IMPLS

import jattn
from jattn._attention import attention_weights
from jattn._chunked import blocks as chunked_blocks

B, T, S, N, K, H = 2, 24, 40, 4, 2, 8


def _padded_cache():
  """Example 0: 10 pad slots, then 30 tokens (positions 0..29); example 1: 40 tokens. The last
  T of each are the queries. Returns (q_pos (B, T), kv_pos (B, S), kv_valid (B, S))."""
  kv_pos = np.stack([np.concatenate([np.zeros(10), np.arange(30)]), np.arange(40)]).astype(np.int32)
  valid = np.stack([np.arange(S) >= 10, np.ones(S, bool)])
  return kv_pos[:, -T:], kv_pos, valid


def _packed():
  """Two packed documents per example whose positions restart: (q_pos, kv_pos, segments)."""
  pos = np.stack(
    [np.concatenate([np.arange(15), np.arange(25)]), np.concatenate([np.arange(33), np.arange(7)])]
  ).astype(np.int32)
  seg = np.stack([np.repeat([0, 1], [15, 25]), np.repeat([0, 1], [33, 7])]).astype(np.int32)
  return pos, seg


def _visible(q_pos, kv_pos, causal, window, kv_valid=None, q_seg=None, kv_seg=None):
  vis = np.zeros((q_pos.shape[0], N, q_pos.shape[1], kv_pos.shape[1]), bool)
  for b in range(q_pos.shape[0]):
    for t in range(q_pos.shape[1]):
      for s in range(kv_pos.shape[1]):
        q, k = q_pos[b, t], kv_pos[b, s]
        ok = not causal or k <= q
        if window is not None:
          ok = ok and q - window[0] <= k <= q + window[1]
        if kv_valid is not None:
          ok = ok and kv_valid[b, s]
        if q_seg is not None:
          ok = ok and q_seg[b, t] == kv_seg[b, s]
        vis[b, :, t, s] = ok
  return vis


def _run(impl, q, k, v, do, **kw):
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, **IMPLS[impl], **kw)
  return _out_and_grads(f, q, k, v, do)


def _out_and_grads(f, q, k, v, do):
  """(out, dq, dk, dv) of f for the cotangent ``do``: forward and backward in one program."""

  def run(q, k, v, do):
    out, pull = jax.vjp(f, q, k, v)
    return (out,) + pull(do)

  return jax.jit(run)(q, k, v, do)


def _compare(got, q, k, v, do, vis):
  want_out, _, cache = ref.attention(q, k, v, visible=vis)
  want = (want_out,) + tuple(ref.grads(cache, do))[:3]
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(
      np.asarray(a) / scale, np.asarray(b) / scale, atol=2e-5, err_msg=name
    )


def _inputs(T_):
  ks = jax.random.split(jax.random.key(0), 4)
  return (
    jax.random.normal(ks[0], (B, T_, N, H)),
    jax.random.normal(ks[1], (B, S, K, H)),
    jax.random.normal(ks[2], (B, S, K, H)),
    jax.random.normal(ks[3], (B, T_, N, H)),
  )


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("window", [None, (6, 0)])
def test_padded_cache_window_counts_positions(impl, window):
  q_pos, kv_pos, valid = _padded_cache()
  q, k, v, do = _inputs(T)
  # The padding sits at the start of example 0's cache: a segment id marks it.
  seg_q, seg_kv = np.ones((B, T), np.int32), valid.astype(np.int32)
  got = _run(
    impl,
    q,
    k,
    v,
    do,
    is_causal=True,
    local_window_size=window,
    q_positions=jnp.asarray(q_pos),
    kv_positions=jnp.asarray(kv_pos),
    q_segment_ids=jnp.asarray(seg_q),
    kv_segment_ids=jnp.asarray(seg_kv),
  )
  _compare(got, q, k, v, do, _visible(q_pos, kv_pos, True, window, kv_valid=valid))


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_packed_sequences_whose_positions_restart(impl):
  pos, seg = _packed()
  q, k, v, do = _inputs(S)
  mask = jattn.masks.positions(pos, pos, window=(5, 0)) & jattn.masks.segments(seg, seg)
  got = _run(impl, q, k, v, do, mask=mask)
  _compare(got, q, k, v, do, _visible(pos, pos, True, (5, 0), q_seg=seg, kv_seg=seg))


def test_blocks_hidden_by_positions_are_never_computed():
  # Two documents of 40 tokens packed in 80, positions restarting, a window of 8: the blocks
  # between a query block and keys more than 8 positions back are skipped (the hook counts).
  pos = np.tile(np.arange(40), 2)[None].astype(np.int32)
  q = jax.random.normal(jax.random.key(1), (1, 80, 2, 8))
  seen = []
  chunked_blocks._BLOCK_HOOK = lambda name, i, j, state: seen.append((i, j, state))
  try:
    jax.block_until_ready(
      jattn.dot_product_attention(
        q,
        q,
        q,
        implementation="chunked",
        block_q=8,
        block_kv=8,
        is_causal=True,
        local_window_size=(8, 0),
        q_positions=jnp.asarray(pos),
        kv_positions=jnp.asarray(pos),
      )
    )
  finally:
    chunked_blocks._BLOCK_HOOK = None
  computed = {(i, j) for i, j, state in seen if state}
  # Exactly the blocks holding a visible pair (positions rise within each block, so a block's
  # position range decides): own document's diagonal blocks, and -- positions alone do not know
  # documents -- the other document's blocks at the same positions.
  p = pos[0]
  vis = (p[None, :] <= p[:, None]) & (p[None, :] >= p[:, None] - 8)
  want = {
    (i, j) for i in range(10) for j in range(10) if vis[8 * i : 8 * i + 8, 8 * j : 8 * j + 8].any()
  }
  assert computed == want, sorted(computed ^ want)
  assert len(want) < 100 // 2


# ---- every example at positions of its own ---------------------------------------------------
# The chunked kernels skip a block only if every example's summary calls it EMPTY, and drop its
# mask only if every one calls it FULL (the map is reduced over the batch): a wrong summary of
# one example is hidden wherever another's is right -- an example whose positions are its
# indices runs every block below the diagonal for all -- and a segment mask ANDed in hides
# more. Here no example's positions are its indices, each differs, positions fall back inside
# a block with no segments to cover it, and each example's own summary is checked as well.

S3 = 40


def _shifted():
  """(3, S3) positions: a packed pair of sequences restarting inside a block (index 20); an
  offset with a gap (9.., jumping by 7 at index 22); two drafts at the same positions after a
  prefix (28.. twice, the second from index 34)."""
  i = np.arange(S3)
  return np.stack(
    [np.where(i < 20, i, i - 20), 9 + i + 6 * (i >= 22), np.where(i < 34, i, i - 6)]
  ).astype(np.int32)


SCHEDULES = {
  s: dict(implementation="chunked", block_q=8, block_kv=8, schedule=s)
  for s in ("serial", "parallel")
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("window", [None, (5, 0)])
def test_every_example_at_positions_of_its_own(schedule, window):
  # Self-attention over the positions of `_shifted` in blocks of 8, causal and a causal window:
  # output and gradients equal the float64 reference's.
  pos = _shifted()
  assert not (pos == np.arange(S3)).all(axis=1).any()
  ks = jax.random.split(jax.random.key(2), 4)
  q, do = (jax.random.normal(kk, (3, S3, N, H)) for kk in ks[:2])
  k, v = (jax.random.normal(kk, (3, S3, K, H)) for kk in ks[2:])
  f = lambda q, k, v: jattn.dot_product_attention(
    q,
    k,
    v,
    is_causal=True,
    local_window_size=window,
    q_positions=jnp.asarray(pos),
    kv_positions=jnp.asarray(pos),
    **SCHEDULES[schedule],
  )
  _compare(_out_and_grads(f, q, k, v, do), q, k, v, do, _visible(pos, pos, True, window))


@pytest.mark.parametrize("positions", ["shifted", "sorted-repeats"])
@pytest.mark.parametrize("window", [None, (5, 0), (3, 2)])
def test_block_states_of_every_example_are_sound(window, positions):
  # Each example's own summary, before any reduction over the batch: a block called EMPTY holds
  # no visible pair, one called FULL no hidden one (from the positions, pair by pair), in grids
  # of 8 x 8 and 6 x 8 (ragged). Positions: `_shifted`'s, and rising ones that repeat (a
  # position shared across a block edge: the edge cases of every inequality).
  pos = (
    _shifted()
    if positions == "shifted"
    else np.sort(np.random.default_rng(1).integers(0, 25, (3, S3)), axis=1).astype(np.int32)
  )
  vis = _visible(pos, pos, True, window)[:, 0]
  m = jattn.masks.positions(jnp.asarray(pos), jnp.asarray(pos), window=window)
  for bq, bk in ((8, 8), (6, 8)):
    grid = jattn.masks.BlockGrid(S3, S3, bq, bk)
    states = np.asarray(m.block_states(grid, (3, N, S3, S3)))[:, 0]
    for b, i, j in np.ndindex(states.shape):
      block = vis[b, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
      where = f"example {b} block ({i}, {j}) of {bq} x {bk}"
      assert states[b, i, j] != jattn.masks.EMPTY or not block.any(), where
      assert states[b, i, j] != jattn.masks.FULL or block.all(), where


def test_positions_errors_name_the_argument():
  q, k, v, _ = _inputs(T)
  with pytest.raises(ValueError, match="q_positions and kv_positions must be given together"):
    jattn.dot_product_attention(q, k, v, q_positions=jnp.zeros((B, T), jnp.int32))
  with pytest.raises(ValueError, match=r"masks.positions: kv_positions must have shape \(B, S\)"):
    jattn.dot_product_attention(
      q,
      k,
      v,
      q_positions=jnp.zeros((B, T), jnp.int32),
      kv_positions=jnp.zeros((B, S + 1), jnp.int32),
    )
  with pytest.raises(TypeError, match="q_positions"):
    jattn.dot_product_attention(
      q, k, v, q_positions=jnp.zeros((B, T)), kv_positions=jnp.zeros((B, S), jnp.int32)
    )


# ---- every public function that takes masks takes positions ----------------------------------


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_attention_stats_with_positions_equal_the_same_mask_given_explicitly(impl):
  # The keywords are the mask masks.positions builds from them (causality and the window moved
  # into it), so the statistics are the same, field by field.
  from jattn import diagnostics

  q_pos, kv_pos, valid = _padded_cache()
  q, k, _, _ = _inputs(T)
  seg_q, seg_kv = jnp.ones((B, T), jnp.int32), jnp.asarray(valid, jnp.int32)
  kw = dict(implementation=impl, block_q=8, block_kv=8, q_segment_ids=seg_q, kv_segment_ids=seg_kv)
  got = diagnostics.attention_stats(
    q,
    k,
    is_causal=True,
    local_window_size=(6, 0),
    q_positions=jnp.asarray(q_pos),
    kv_positions=jnp.asarray(kv_pos),
    **kw,
  )
  mask = jattn.masks.positions(jnp.asarray(q_pos), jnp.asarray(kv_pos), window=(6, 0))
  want = diagnostics.attention_stats(q, k, mask=mask, **kw)
  for name, a, b in zip(got._fields, got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_attention_weights_with_positions_against_the_float64_reference():
  # Packed documents whose positions restart, causal with a window, in positions: the weights
  # are the plain softmax over the keys the positions let each query see.
  pos, seg = _packed()
  q, k, v, _ = _inputs(S)
  # The weights flax's sow_weights records (not a public function; the modules call it).
  got = attention_weights(
    q,
    k,
    v,
    is_causal=True,
    local_window_size=(5, 0),
    q_segment_ids=jnp.asarray(seg),
    kv_segment_ids=jnp.asarray(seg),
    q_positions=jnp.asarray(pos),
    kv_positions=jnp.asarray(pos),
  )
  vis = _visible(pos, pos, True, (5, 0), q_seg=seg, kv_seg=seg)
  qd, kd = (np.asarray(x, np.float64) for x in (q, k))
  kd = np.repeat(kd, N // K, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", qd, kd) / np.sqrt(H)
  logits = np.where(vis, logits, -np.inf)
  w = np.exp(logits - logits.max(axis=-1, keepdims=True))
  want = w / w.sum(axis=-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


def _ring_one_device(q, k, v, **kw):
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("seq",))
  return jattn.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="seq", **kw)


PUBLIC = {
  "dot_product_attention": lambda q, k, v, **kw: jattn.dot_product_attention(q, k, v, **kw),
  "attention_stats": lambda q, k, v, **kw: jattn.diagnostics.attention_stats(q, k, **kw),
  "attention_weights (sow)": lambda q, k, v, **kw: attention_weights(q, k, v, **kw),
  "ring_attention": _ring_one_device,
  "masks.positions": lambda q, k, v, **kw: jattn.masks.positions(
    kw.get("q_positions"), kw.get("kv_positions")
  ),
}


@pytest.mark.parametrize("fn", sorted(PUBLIC))
@pytest.mark.parametrize("given", ["q_positions", "kv_positions"])
def test_a_missing_half_is_one_error_from_every_public_function(fn, given):
  q, k, v, _ = _inputs(T)
  missing = "kv_positions" if given == "q_positions" else "q_positions"
  half = {given: jnp.zeros((B, T if given == "q_positions" else S), jnp.int32)}
  with pytest.raises(
    ValueError,
    match=f"q_positions and kv_positions must be given together, got {given} without {missing}",
  ):
    PUBLIC[fn](q, k, v, is_causal=True, **half)
