"""Mask objects, their block maps, score functions and sinks."""

import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from attention_cases import TILE_IMPLS

import jattn
from jattn import masks as M

B, N = 2, 3

# The chunked kernels in both schedules (the parallel one with 3 lanes per step).
IMPLS = {
  "dense": dict(implementation="dense"),
  "chunked": dict(implementation="chunked", schedule="serial"),
  "parallel": dict(implementation="chunked", schedule="parallel", step_width=3),
}


def _by_hand(kind, T, S):
  """The same masks built index by index from their definitions."""
  t = np.arange(T)[:, None]
  s = np.arange(S)[None, :]
  full = lambda x: np.broadcast_to(x, (B, N, T, S))
  return {
    "causal": full(s <= t),
    "causal bottom-right": full(s <= t + S - T),
    "causal negative offset": full(s <= t - 5),
    "window (3, 2)": full((s >= t - 3) & (s <= t + 2)),
    "window (7, 0) offset 4": full((s >= t + 4 - 7) & (s <= t + 4)),
    "chunked local 8": full(t // 8 == s // 8),
    "prefix-lm 10": full((s < 10) | (s <= t)),
    "lengths": np.stack(
      [
        full(np.ones((T, S), bool))[0] & (t < 9) & (s < 17),
        full(np.ones((T, S), bool))[1] & (t < T) & (s < 4),
      ]
    ),
    "segments": np.stack([full(_SEG_Q[b][:T, None] == _SEG_K[b][None, :S])[b] for b in range(B)]),
    "function": np.fromfunction(
      lambda b, h, i, j: (i + j + b + h) % 3 != 0, (B, N, T, S), dtype=int
    ),
    "causal & window": full((s <= t) & (s >= t - 6)),
    "causal | window": full((s <= t) | ((s >= t - 2) & (s <= t + 2))),
    "~causal": full(~(s <= t)),
    "dynamic causal": np.stack([full(s <= t + 3)[0], full(s <= t + 11)[1]]),
    "array": _ARR[:, :, :T, :S] & np.ones((B, N, T, S), bool),
  }[kind]


_rng = np.random.default_rng(0)
_SEG_Q = np.sort(_rng.integers(0, 4, (B, 64)), axis=1)
_SEG_K = np.sort(_rng.integers(0, 4, (B, 64)), axis=1)
_ARR = _rng.random((B, 1, 64, 64)) > 0.3


def _object(kind, T, S):
  return {
    "causal": M.causal(),
    "causal bottom-right": M.causal((T, S), alignment="bottom_right"),
    "causal negative offset": M.causal(offset=-5),
    "window (3, 2)": M.local_window(3, 2),
    "window (7, 0) offset 4": M.local_window(7, 0, offset=4),
    "chunked local 8": M.chunked_local(8),
    "prefix-lm 10": M.prefix_lm(10),
    "lengths": M.lengths(jnp.array([9, T]), jnp.array([17, 4])),
    "segments": M.segments(jnp.asarray(_SEG_Q[:, :T]), jnp.asarray(_SEG_K[:, :S])),
    "function": M.from_function(lambda b, h, i, j: (i + j + b + h) % 3 != 0),
    "causal & window": M.causal() & M.local_window(6, None),
    "causal | window": M.causal() | M.local_window(2, 2),
    "~causal": ~M.causal(),
    "dynamic causal": M.causal(offset=jnp.array([3, 11], jnp.int32)),
    "array": M.from_array(jnp.asarray(_ARR[:, :, :T, :S])),
  }[kind]


KINDS = [
  "causal",
  "causal bottom-right",
  "causal negative offset",
  "window (3, 2)",
  "window (7, 0) offset 4",
  "chunked local 8",
  "prefix-lm 10",
  "lengths",
  "segments",
  "function",
  "causal & window",
  "causal | window",
  "~causal",
  "dynamic causal",
  "array",
]
SHAPES = [("square", 40, 40), ("wide rectangle", 24, 61), ("tall rectangle", 61, 24)]


_BLOCKS = ((8, 8), (16, 5), (7, 13))


def _evaluations(mask, T, S):
  """The mask on the whole (T, S) grid, its block maps for each of `_BLOCKS`, and the mask
  evaluated on each block's positions alone (the positions run-time arguments): one compiled
  program (op-by-op dispatch, or a program per block shape, dominated the test's time)."""
  shape = (B, N, T, S)
  grids = [M.BlockGrid(T, S, bq, bk) for bq, bk in _BLOCKS]
  blocks = [
    [
      (
        np.arange(i * bq, min((i + 1) * bq, T), dtype=np.int32),
        np.arange(j * bk, min((j + 1) * bk, S), dtype=np.int32),
      )
      for i, j in itertools.product(range(g.num_q_blocks), range(g.num_kv_blocks))
    ]
    for g, (bq, bk) in zip(grids, _BLOCKS)
  ]

  def run(q_pos, kv_pos, blocks):
    return (
      mask.evaluate(q_pos, kv_pos, shape),
      [mask.block_states(g, shape) for g in grids],
      [[mask.evaluate(qb, kb, shape) for qb, kb in per_grid] for per_grid in blocks],
    )

  whole, states, per_block = jax.jit(run)(
    jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32), blocks
  )
  return np.broadcast_to(np.asarray(whole), shape), grids, states, per_block


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_mask_equals_dense_construction_and_block_map_is_exact(kind, shape):
  _, T, S = shape
  mask = _object(kind, T, S)
  want = _by_hand(kind, T, S)
  whole, grids, states, per_block = _evaluations(mask, T, S)
  np.testing.assert_array_equal(whole, want)
  for (bq, bk), grid, st, evaluated in zip(_BLOCKS, grids, states, per_block):
    st = np.broadcast_to(np.asarray(st), (B, N, grid.num_q_blocks, grid.num_kv_blocks))
    for (i, j), got in zip(
      itertools.product(range(grid.num_q_blocks), range(grid.num_kv_blocks)), evaluated
    ):
      blk = want[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
      # The mask evaluated on just this block equals the dense one there.
      np.testing.assert_array_equal(np.broadcast_to(np.asarray(got), blk.shape), blk)
      expect = np.where(
        ~blk.any(axis=(2, 3)), M.EMPTY, np.where(blk.all(axis=(2, 3)), M.FULL, M.PARTIAL)
      )
      if kind in ("causal | window", "~causal"):
        # OR of two partial blocks may be full: the summary is conservative (PARTIAL), never
        # wrong about emptiness.
        assert np.all((st[..., i, j] == expect) | (st[..., i, j] == M.PARTIAL)), (i, j)
        assert np.all((st[..., i, j] == M.EMPTY) == (expect == M.EMPTY))
      else:
        np.testing.assert_array_equal(st[..., i, j], expect, err_msg=f"block {(i, j)}")


def test_structural_block_maps_are_static():
  grid = M.BlockGrid(1000, 1000, 128, 128)
  for m in (
    M.causal(),
    M.local_window(64, 0),
    M.chunked_local(100),
    M.prefix_lm(300),
    M.causal() & M.local_window(64, 0),
  ):
    assert isinstance(m.block_states(grid, (1, 1, 1000, 1000)), np.ndarray)


def test_masks_are_hashable_and_band_intersection_is_a_band():
  assert hash(M.causal()) == hash(M.causal())
  assert M.causal() == M.causal(offset=0)
  both = M.causal() & M.local_window(5, 3)
  assert both == M.local_window(5, 0)


@pytest.mark.parametrize("impl", ["dense", "chunked", "parallel"])
def test_mask_objects_in_attention_match_reference(impl):
  T, S = 33, 50
  q = jax.random.normal(jax.random.key(0), (B, T, N, 8))
  k = jax.random.normal(jax.random.key(1), (B, S, N, 8))
  for kind in (
    "chunked local 8",
    "prefix-lm 10",
    "function",
    "causal | window",
    "~causal",
    "dynamic causal",
  ):
    mask = _object(kind, T, S)
    got = jattn.dot_product_attention(q, k, k, mask=mask, **IMPLS[impl], block_q=8, block_kv=16)
    want, _, _ = ref.attention(q, k, k, visible=_by_hand(kind, T, S))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=kind)


# --------------------------------------------------------------------------------------------
# Score functions.
# --------------------------------------------------------------------------------------------

T, S, H = 30, 41, 8


def _qkv():
  ks = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(ks[0], (B, T, N, H))
  k = jax.random.normal(ks[1], (B, S, N, H))
  v = jax.random.normal(ks[2], (B, S, N, H))
  do = jax.random.normal(ks[3], (B, T, N, H))
  return q, k, v, do


@pytest.mark.parametrize("impl", TILE_IMPLS)
def test_relative_position_table_gets_its_gradient(impl):
  q, k, v, do = _qkv()
  table = jax.random.normal(jax.random.key(9), (N, T + S)) * 0.5

  def f(q, k, v, table):
    def score_mod(s, b, h, qi, ki):
      return s + table[h, qi - ki + S]

    return jattn.dot_product_attention(
      q, k, v, score_mod=score_mod, is_causal=True, **IMPLS[impl], block_q=8, block_kv=16
    )

  out, pull = jax.vjp(f, q, k, v, table)
  dq, dk, dv, dtable = pull(do)
  # Reference: the same bias as an explicit array.
  idx = np.arange(T)[:, None] - np.arange(S)[None, :] + S
  bias = np.asarray(table)[:, idx][None]  # (1, N, T, S)
  vis = ref.visible_mask(B, N, T, S, causal="top_left")
  want, _, cache = ref.attention(q, k, v, visible=vis, bias=bias)
  r_dq, r_dk, r_dv, r_dbias, _ = ref.grads(cache, do, bias.shape)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  for got, w in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
    np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-4)
  r_dtable = np.zeros((N, T + S))
  np.add.at(r_dtable, (np.arange(N)[:, None, None], idx[None]), r_dbias[0])
  np.testing.assert_allclose(dtable, r_dtable, rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("impl", TILE_IMPLS)
def test_alibi_and_temperature(impl):
  q, k, v, _ = _qkv()
  slopes = jnp.asarray([0.5, 0.25, 0.125])
  temp = jnp.asarray([1.0, 2.0, 0.5])
  mod = lambda s, b, h, qi, ki: s / temp[h] - slopes[h] * jnp.abs(qi - ki).astype(s.dtype)
  got = jattn.dot_product_attention(q, k, v, score_mod=mod, **IMPLS[impl], block_q=8, block_kv=16)
  dist = np.abs(np.arange(T)[:, None] - np.arange(S)[None, :])
  want, _, _ = ref.attention(
    q,
    k,
    v,
    score_mod=lambda x: (
      x / np.asarray(temp)[None, :, None, None] - np.asarray(slopes)[None, :, None, None] * dist
    ),
  )
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", TILE_IMPLS)
def test_soft_cap_via_score_mod_against_reference(impl):
  # The option and the same function as a score_mod are one definition: both equal the float64
  # reference's soft cap, forward and gradients.
  q, k, v, do = _qkv()
  cap = 3.0
  vis = ref.visible_mask(B, N, T, S, causal="top_left")
  want, _, cache = ref.attention(q, k, v, visible=vis, soft_cap=cap)
  want_grads = ref.grads(cache, do)[:3]
  for kw in (dict(logits_soft_cap=cap), dict(score_mod=lambda s, *_: cap * jnp.tanh(s / cap))):
    f = lambda q, k, v: jattn.dot_product_attention(
      q, k, v, is_causal=True, **IMPLS[impl], block_q=8, block_kv=16, **kw
    )
    out, pull = jax.vjp(f, q, k, v)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5, err_msg=str(kw))
    for got, w in zip(pull(do), want_grads):
      np.testing.assert_allclose(got, w, rtol=2e-4, atol=1e-4, err_msg=str(kw))


def test_take_part_is_the_slice_of_the_whole_mask():
  """One device's examples and heads of a mask (the partitioned chunked kernels' cut) equal that
  slice of the whole mask, for every mask kind that holds arrays and their combinations."""
  Bw, Nw, T, S = 4, 6, 12, 10
  rng = np.random.default_rng(0)
  seg_q = np.sort(rng.integers(0, 3, (Bw, T)), axis=1)
  seg_kv = np.sort(rng.integers(0, 3, (Bw, S)), axis=1)
  arr = rng.random((Bw, Nw, T, S)) < 0.6
  masks = {
    "lengths": M.lengths(jnp.asarray([12, 5, 0, 9]), jnp.asarray([10, 2, 7, 0])),
    "segments": M.segments(seg_q, seg_kv),
    "causal offset per example": M.causal(offset=jnp.asarray([0, 3, -2, 5])),
    "array (B, N, T, S)": M.from_array(arr),
    "array (1, N, T, S)": M.from_array(arr[:1]),
    "static array": M.static_array(arr),
    "function": M.from_function(lambda b, h, i, j: (j <= i + b) | (h == 4)),
    "combined": ~M.lengths(None, jnp.asarray([10, 2, 7, 0]))
    | (M.causal() & M.from_array(arr[:, :1])),
  }
  q_pos, kv_pos = jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32)
  cuts = ((2, 2, 0, 6), (0, 4, 3, 3), (1, 1, 2, 2), (0, 4, 0, 6))

  def whole_and_parts(mask, starts):
    # The whole mask and its parts (the first example and head traced, as the kernels cut
    # them), in one compiled program.
    parts = [
      M.take_part(mask, b0, nb, h0, nh, (Bw, Nw, T, S)).evaluate(q_pos, kv_pos, (nb, nh, T, S))
      for (b0, h0), (_, nb, _, nh) in zip(starts, cuts)
    ]
    return mask.evaluate(q_pos, kv_pos, (Bw, Nw, T, S)), parts

  starts = [(jnp.int32(b0), jnp.int32(h0)) for b0, _, h0, _ in cuts]
  for name, mask in masks.items():
    assert M.can_take_part(mask), name
    whole, parts = jax.jit(whole_and_parts)(mask, starts)
    whole = np.broadcast_to(np.asarray(whole), (Bw, Nw, T, S))
    for (b0, nb, h0, nh), got in zip(cuts, parts):
      got = np.broadcast_to(np.asarray(got), (nb, nh, T, S))
      np.testing.assert_array_equal(got, whole[b0 : b0 + nb, h0 : h0 + nh], err_msg=name)


def test_a_mask_kind_defined_elsewhere_is_not_cut():
  """A Mask subclass jattn does not know may hold arrays of any layout: `can_take_part` says
  so, and the partitioned chunked kernels leave such calls to XLA's partitioner."""

  class Mine(M.Mask):
    def evaluate(self, q_pos, kv_pos, shape):
      return (kv_pos[None, :] <= q_pos[:, None])[None, None]

  assert not M.can_take_part(Mine())
  assert not M.can_take_part(M.causal() & Mine())
  assert M.can_take_part(M.causal() & M.local_window(3)) and M.can_take_part(None)


# jattn.masks's public names, as users and the rest of jattn call them (the masks layer's
# interface to the kernels included: EMPTY/PARTIAL/FULL, BlockGrid, from_arguments, remap, ...).
PUBLIC = {
  "BlockGrid",
  "CausalAlignment",
  "Cut",
  "EMPTY",
  "FULL",
  "Mask",
  "PARTIAL",
  "PrefixTree",
  "band",
  "can_take_part",
  "causal",
  "chunked_local",
  "combine",
  "from_arguments",
  "from_array",
  "from_function",
  "full",
  "hidden_rows",
  "is_position_based",
  "keyword_band",
  "lengths",
  "local_window",
  "positions",
  "prefix_lm",
  "prefix_tree",
  "reduce_states",
  "remap",
  "segments",
  "selected_blocks",
  "split_selection",
  "static_array",
  "take_part",
  "tree_mask",
  "visible_by_position",
}
# What the single-file module imported for itself and so showed in dir() besides its modules (jax,
# np, ...): annotation helpers, never API.
_ANNOTATION_IMPORTS = {"annotations", "Any", "ArrayLike", "Callable", "Sequence"}


def test_public_names_are_unchanged():
  names = {n for n in dir(M) if not n.startswith("_") and not inspect.ismodule(getattr(M, n))}
  assert names - _ANNOTATION_IMPORTS == PUBLIC
  assert M.__all__ == [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockGrid",
    "CausalAlignment",
    "Mask",
    "PrefixTree",
    "causal",
    "chunked_local",
    "from_array",
    "from_function",
    "full",
    "hidden_rows",
    "lengths",
    "local_window",
    "prefix_lm",
    "prefix_tree",
    "segments",
    "selected_blocks",
    "tree_mask",
  ]
