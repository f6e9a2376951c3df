"""masks.prefix_tree: packed token trees (RL rollouts) and each root-to-leaf path run alone.

The builder's mask is the tree's definition (a token sees itself, earlier tokens of its node and
its ancestors' tokens), its positions are each token's position in its path alone, for node ids
and lengths alike, traced or not, with forests, nested trees and padding. The point of it:
attention over a packed row equals every root-to-leaf path run alone as one causal sequence --
each packed token's output, and the gradients of q, k, v, bias and sinks (a shared node's summed
over the paths through it) -- against float64, within the project's 16-bit bounds
(tests/properties/test_precision16.py), on dense, chunked in both schedules and ring attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from prefix_trees import (
  DTYPES,
  SIZES,
  B,
  N,
  Problem,
  positions_by_hand,
  previous_by_hand,
  problem,
  random_rows,
  visible_by_hand,
)

import jattn
from jattn import masks as M

# The 16-bit rule of tests/properties/test_precision16.py, ring attention under it too (its shard
# pairs' outputs merge unrounded: 1.26x packed, 1.27x alone here; rounded to the input dtype
# before the merge, as they were until 2026-12-06, 1.58x and 1.59x).
FORWARD, GRADIENTS = 1.5, 1.75


# Trees written plainly, the packed-against-alone problem and its float64 answer:
# tests/support/prefix_trees.py.


# --------------------------------------------------------------------------------------------
# The builder.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth, branches", [(1, 8), (2, 4), (3, 3)])
def test_mask_and_positions_are_the_trees(depth, branches):
  B, T = 3, 90
  parents, lengths = random_rows(depth, B, T, depth, branches, 9)
  tree = M.prefix_tree(parents, lengths=lengths, size=T)
  vis = np.asarray(
    tree.mask.evaluate(jnp.arange(T, dtype=jnp.int32), jnp.arange(T, dtype=jnp.int32), (B, 1, T, T))
  )
  for b in range(B):
    np.testing.assert_array_equal(vis[b, 0], visible_by_hand(parents[b], lengths[b], T))
    np.testing.assert_array_equal(tree.positions[b], positions_by_hand(parents[b], lengths[b], T))
    np.testing.assert_array_equal(tree.previous[b], previous_by_hand(parents[b], lengths[b], T))
  # The same from node ids, and traced under jit.
  again = M.prefix_tree(parents, tree.node_ids)
  traced = jax.jit(lambda p, n: M.prefix_tree(p, lengths=n, size=T))(parents, lengths)
  for other in (again, traced):
    np.testing.assert_array_equal(other.positions, tree.positions)
    np.testing.assert_array_equal(other.previous, tree.previous)
    np.testing.assert_array_equal(other.node_ids, tree.node_ids)
    np.testing.assert_array_equal(
      other.mask.evaluate(jnp.arange(T), jnp.arange(T), (B, 1, T, T)), vis
    )


def test_padding_between_trees_and_one_tree_for_the_batch():
  # node ids with padding between two trees and after them; parents (M,) shared by the batch.
  parents = np.array([-1, 0, 0, -1, 3])
  ids = np.array([[0, 0, 1, 2, 2, -1, -1, 3, 4, 4, -1], [0, 1, 1, 1, 2, -1, 3, 3, 4, -1, -1]])
  T = ids.shape[1]
  tree = M.prefix_tree(parents, ids)
  vis = np.asarray(tree.mask.evaluate(jnp.arange(T), jnp.arange(T), (2, 1, T, T)))[:, 0]
  for b in range(2):
    tok = ids[b]
    want = np.zeros((T, T), bool)
    for i in range(T):
      for j in range(i + 1):
        if tok[i] >= 0 and tok[j] >= 0 and (tok[j] == tok[i] or tok[j] == parents[tok[i]]):
          want[i, j] = True
    np.testing.assert_array_equal(vis[b], want)
  np.testing.assert_array_equal(tree.positions[0], [0, 1, 2, 2, 3, 0, 0, 0, 1, 2, 0])
  np.testing.assert_array_equal(tree.previous[0], [-1, 0, 1, 1, 3, -1, -1, -1, 7, 8, -1])
  np.testing.assert_array_equal(tree.previous[1], [-1, 0, 1, 2, 0, -1, -1, 6, 7, -1, -1])
  # A node with no tokens (a turn left empty) between a node and its grandchild.
  tree = M.prefix_tree(np.array([-1, 0, 1, 1]), lengths=np.array([2, 0, 3, 1]), size=7)
  np.testing.assert_array_equal(tree.previous[0], [-1, 0, 1, 2, 3, 1, -1])
  np.testing.assert_array_equal(tree.positions[0], [0, 1, 2, 3, 4, 2, 0])


@pytest.mark.parametrize(
  "args, words",
  [
    (
      dict(parents=[-1, 0, 2], lengths=[1, 1, 1], size=4),
      "must each be -1 (a root) or an earlier node (parents before children), got parents[0, 2]=2",
    ),
    (dict(parents=[-1, 0, 0, 1], lengths=[1, 1, 1, 1], size=4), "node 3 comes after node 1's"),
    (dict(parents=[-1, 0], node_ids=[0, 1, 0]), "node_ids[0, 2]=0 after a later node's token"),
    (dict(parents=[-1, 0], node_ids=[0, -1, 0, 1]), "node_ids[0, 2]=0 after padding inside"),
    (
      dict(parents=[-1, 0], node_ids=[0, 2]),
      "node_ids must each be -1 (padding) or in [0, 2), got node_ids[0, 1]=2",
    ),
    (
      dict(parents=[-1, 0], lengths=[3, 2], size=4),
      "lengths must sum to at most size=4, got sum(lengths[0])=5",
    ),
    (dict(parents=[-1, 0], lengths=[3, -1], size=4), "lengths must be >= 0, got lengths[0, 1]=-1"),
    (dict(parents=[-1, 0]), "give node_ids or lengths (with size), got neither"),
    (dict(parents=[-1, 0], node_ids=[0, 1], lengths=[1, 1], size=2), "got both"),
    (dict(parents=[-1, 0], node_ids=[0, 1], size=2), "size goes with lengths"),
    (dict(parents=[-1, 0], lengths=[1, 1, 1], size=4), "lengths must be (B, M) or (M,) with M=2"),
  ],
)
def test_bad_trees_are_value_errors_naming_the_argument(args, words):
  args = {k: np.asarray(v) if isinstance(v, list) else v for k, v in args.items()}
  with pytest.raises(ValueError) as e:
    M.prefix_tree(**args)
  assert words in str(e.value) and "masks.prefix_tree" in str(e.value), str(e.value)


def test_float_parents_are_type_errors():
  with pytest.raises(TypeError, match="masks.prefix_tree: parents must be an integer array"):
    M.prefix_tree(np.array([-1.0, 0.0]), lengths=np.array([1, 1]), size=2)


def test_block_map_of_a_shared_prompt_skips_the_siblings():
  # The RL shape, small: a 64-token prompt and 8 responses of 16 in blocks of 16 x 8. Every
  # block the summary keeps holds a visible pair, and the count is the tokens' own.
  P, R, L = 64, 8, 16
  T = P + R * L
  tree = M.prefix_tree(np.array([-1] + [0] * R), lengths=np.array([P] + [L] * R), size=T)
  grid = M.BlockGrid(T, T, 16, 8)
  st = np.asarray(M.reduce_states(tree.mask.block_states(grid, (1, 1, T, T)), (1, 1, T, T)))
  vis = visible_by_hand([-1] + [0] * R, [P] + [L] * R, T)
  any_visible = vis.reshape(T // 16, 16, T // 8, 8).any(axis=(1, 3))
  np.testing.assert_array_equal(st != M.EMPTY, any_visible)
  assert int((st != M.EMPTY).sum()) == 4 * 5 * 2 // 2 + R * (P // 8 + 2)


# --------------------------------------------------------------------------------------------
# Packed equals alone.
# --------------------------------------------------------------------------------------------

IMPLS = ["dense", "chunked", "parallel", "ring"]


def _kwargs(impl, blocks):
  bq, bk = blocks
  return {
    "dense": dict(implementation="dense"),
    "chunked": dict(implementation="chunked", schedule="serial", block_q=bq, block_kv=bk),
    "parallel": dict(
      implementation="chunked", schedule="parallel", step_width=4, block_q=bq, block_kv=bk
    ),
    # ring_attention_sharded on a one-device mesh in the zigzag layout: the mask remapped to
    # the permuted rows (its bias: not supported by ring attention).
    "ring": dict(block_q=bq, block_kv=bk),
  }[impl]


def _ring(blocks, **kw):
  """ring_attention_sharded on a one-device mesh, zigzag layout, as f(q, k, v, bias, sinks)."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("seq",))

  def f(q, k, v, bias, sinks):
    perm = lambda x: jattn.zigzag_permute(x, 1)
    o = jattn.ring_attention_sharded(
      perm(q), perm(k), perm(v), sinks=sinks, mesh=mesh, seq_axis="seq", layout="zigzag",
      block_q=blocks[0], block_kv=blocks[1], **kw,
    )  # fmt: skip
    return jattn.zigzag_unpermute(o, 1)

  return f


def run_packed(pb: Problem, impl, dtype, blocks):
  """The packed rows' output and gradients (dq, dk, dv, dbias, dsinks) for cotangent pb.do."""
  args = [jnp.asarray(x, dtype) for x in (pb.q, pb.k, pb.v)]
  bias = None if pb.bias is None else jnp.asarray(pb.bias, dtype)
  if impl == "ring":
    f = _ring(blocks, mask=pb.tree.mask)
  else:
    kw = _kwargs(impl, blocks)
    f = lambda q, k, v, bias, sinks: jattn.dot_product_attention(
      q, k, v, bias, mask=pb.tree.mask, sinks=sinks, **kw
    )
  out, pull = jax.vjp(jax.jit(f), *args, bias, jnp.asarray(pb.sinks))
  g = pull(jnp.asarray(pb.do, dtype))
  return out, dict(zip(("dq", "dk", "dv", "dbias", "dsinks"), g))


def run_alone(pb: Problem, impl, dtype, blocks):
  """Every path alone as one causal sequence (a batch padded to the longest), its results put
  back in the packed rows (`Problem.packed`)."""
  # The zigzag layout holds two equal chunks: an even length (the padding is hidden).
  L = pb.L + pb.L % 2 if impl == "ring" else pb.L
  pad = lambda x: np.pad(x, [(0, 0), (0, L - pb.L)] + [(0, 0)] * (x.ndim - 2))
  args = [jnp.asarray(pad(pb.alone(x)), dtype) for x in (pb.q, pb.k, pb.v)]
  bias = None if pb.bias is None else jnp.asarray(pb.alone_bias(), dtype)
  lens = jnp.asarray(pb.len)
  keywords = dict(is_causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens)
  if impl == "ring":
    f = _ring(blocks, **keywords)
  else:
    kw = _kwargs(impl, blocks)
    f = lambda q, k, v, bias, sinks: jattn.dot_product_attention(
      q, k, v, bias, sinks=sinks, **keywords, **kw
    )
  out, pull = jax.vjp(jax.jit(f), *args, bias, jnp.asarray(pb.sinks))
  g = pull(jnp.asarray(pad(pb.alone_do()), dtype))
  cut = lambda x: None if x is None else np.asarray(jnp.asarray(x, jnp.float32))[:, : pb.L]
  grads = dict(zip(("dq", "dk", "dv"), map(cut, g[:3])), dbias=g[3], dsinks=g[4])
  return pb.packed(cut(out), grads)


def test_float64_tree_attention_is_the_paths_alone():
  # The definition checked against itself: packed float64 attention under the tree's visibility
  # equals every path alone, so "against float64" below means "as if each path ran alone".
  pb = Problem(0, jnp.float32, **SIZES["float32"])
  vis = np.stack([visible_by_hand(pb.parents[b], pb.lengths[b], pb.T) for b in range(B)])
  out, _, grads = ref.attention_vjp(
    pb.q, pb.k, pb.v, pb.do, visible=np.broadcast_to(vis[:, None], (B, N, pb.T, pb.T)),
    bias=pb.bias, sinks=pb.sinks,
  )  # fmt: skip
  want = pb.float64()
  for name, got in dict(grads, out=out).items():
    if name in want:
      np.testing.assert_allclose(got, want[name], atol=1e-12, err_msg=name)


# Every implementation in float32; in bfloat16 (paths of hundreds of tokens, the costliest cases
# here) the chunked kernels once (serial), not again in the parallel schedule: its 16-bit
# arithmetic is tests/properties/test_precision16.py's, its tree mask the float32 case's. The
# bias (B, N, T, T) is in the float32 cases only: its packed gradient is the tree's bookkeeping,
# checked there; a 16-bit bias gradient is tests/properties/test_guarantees.py's, and at T = 1536
# the bias made these cases 4x dearer (~25 s of the suite).
PACKED_CASES = [(impl, "float32") for impl in IMPLS] + [
  (impl, "bfloat16") for impl in IMPLS if impl != "parallel"
]


@pytest.mark.parametrize("impl, dtype", PACKED_CASES)
def test_packed_equals_alone_against_float64(impl, dtype):
  """Each packed token's output and the gradients of q, k, v, bias (float32, not ring) and sinks
  against the float64 answer (every path alone), for the packed rows and for the same paths run
  alone by jattn: float32 within 3e-5, bfloat16 within the 16-bit rule (both)."""
  dt, size = DTYPES[dtype], SIZES[dtype]
  pb, want = problem(dtype, dtype == "float32" and impl != "ring")
  out, grads = run_packed(pb, impl, dt, size["blocks"])
  got = dict(grads, out=out)
  alone = run_alone(pb, impl, dt, size["blocks"])
  names = ["out", "dq", "dk", "dv"] + (["dbias"] if pb.bias is not None else [])
  for name in names:
    g = np.asarray(jnp.asarray(got[name], jnp.float32), np.float64)
    if dtype == "float32":
      np.testing.assert_allclose(g, want[name], atol=3e-5, rtol=3e-5, err_msg=name)
      np.testing.assert_allclose(g, alone[name], atol=3e-5, rtol=3e-5, err_msg=name)
      continue
    rounding = ref.rel_error(ref.round_to_dtype(want[name], dt), want[name])
    factor = FORWARD if name == "out" else GRADIENTS
    for what, x in (("packed", g), ("alone", alone[name])):
      err = ref.rel_error(x, want[name])
      assert err <= factor * rounding, (
        f"{what} {name}: error {err:.3e} is {err / rounding:.2f}x the {dtype} rounding of the "
        f"exact answer ({rounding:.3e}); the rule is {factor}x"
      )
  # Sinks are float32 parameters: their gradient sums every row's, to its inputs' accuracy.
  tol = 3e-5 if dtype == "float32" else 2e-2
  np.testing.assert_allclose(got["dsinks"], want["dsinks"], rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_windows_in_alone_positions(impl):
  # A sliding window measured in the positions each token has alone (q_positions/kv_positions):
  # packed, every path's window is the one it has alone.
  size = SIZES["float32"]
  pb = Problem(2, jnp.float32, bias=False, **size)
  w = (5, 0)
  pos = pb.tree.positions
  kw = _kwargs(impl, size["blocks"])
  packed = jattn.dot_product_attention(
    *(jnp.asarray(x, jnp.float32) for x in (pb.q, pb.k, pb.v)),
    mask=pb.tree.mask, q_positions=pos, kv_positions=pos, is_causal=True, local_window_size=w,
    **kw,
  )  # fmt: skip
  lens = jnp.asarray(pb.len)
  alone = jattn.dot_product_attention(
    *(jnp.asarray(pb.alone(x), jnp.float32) for x in (pb.q, pb.k, pb.v)),
    is_causal=True, local_window_size=w, query_seq_lengths=lens, key_value_seq_lengths=lens, **kw,
  )  # fmt: skip
  np.testing.assert_allclose(packed, pb.packed_out(np.asarray(alone)), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("schedule", ["serial", "parallel"])
def test_chunked_packed_is_alone_bit_for_bit_where_nodes_fill_whole_blocks(schedule):
  """float32, every node a multiple of both block sizes: each path's keys fall in the same blocks
  packed and alone, so the outputs, dq, and dk and dv of tokens on one path add the same terms in
  the same order (a shared node's dk and dv are summed over its leaves in another order: ~1e-7).
  The outputs are the same bits; the gradients too on jax >= 0.11. On jax 0.10 XLA's CPU
  runtime can round a tile's matmul differently in two programs of the same tiles (jax 0.10.2
  on an AMD EPYC: dq's head dims 6 and 7 of 8 on 2.5% of its entries, 6e-8 apart; bitwise on an
  Intel Xeon), so there the gradients are held to a few float32 roundings of their scale; the
  order of the terms is jattn's code, the same on both jax lines, and CI runs both. Elsewhere
  packed differs from alone by rounding: docs/prefix_trees.md."""
  parents = np.array([[-1, 0, 1, 1, 0], [-1, 0, 0, 0, -1]])
  lengths = np.array([[32, 16, 16, 32, 16], [16, 32, 16, 16, 0]])
  pb = Problem(0, jnp.float32, T=112, bias=False, tree=(parents, lengths))
  out, grads = run_packed(
    pb, schedule if schedule == "parallel" else "chunked", jnp.float32, (16, 8)
  )
  alone = run_alone(pb, "parallel" if schedule == "parallel" else "chunked", jnp.float32, (16, 8))
  shared = np.zeros((B, pb.T), bool)  # tokens on more than one path
  for b in range(B):
    for m in range(parents.shape[1]):
      if (parents[b] == m).sum() > 1:
        start = lengths[b, :m].sum()
        shared[b, start : start + lengths[b, m]] = True
  np.testing.assert_array_equal(np.asarray(out), alone["out"].astype(np.float32))

  def same(got, want, name):
    if jax.__version_info__ >= (0, 11):
      np.testing.assert_array_equal(got, want, err_msg=name)
    else:
      scale = float(np.abs(want).max())
      np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * scale, err_msg=name)

  same(np.asarray(grads["dq"]), alone["dq"].astype(np.float32), "dq")
  for name in ("dk", "dv"):
    got, want = np.asarray(grads[name]), alone[name].astype(np.float32)
    same(got[~shared], want[~shared], name)
    np.testing.assert_allclose(got[shared], want[shared], rtol=1e-6, atol=1e-6, err_msg=name)
