"""`jattn.paged_attention` with ``new_token_mask``: a tree of draft tokens verified in one call.

The definition the reference is written from: sequence b's n new tokens fill its cache slots
kv_lengths[b] - n .. kv_lengths[b] - 1 in row order; new token i, whose root-to-i path in the
tree is p_0, ..., p_d = i, gets exactly what decoding that path alone gives -- a contiguous
cache of the prefix's keys followed by the path's keys, attended causally (and within the
window, in positions) by the path's last token, at position prefix + d.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from paged_reference import check, normal, pool

import jattn
from jattn import _lowering, masks

# Trees of 8 draft tokens, parents before children (-1: the root, after the cached prefix).
TREES = (
  [-1, 0, 0, 1, 1, 2, 3, 5],  # branching at the root's child and below
  [-1, 0, 1, 0, 3, 0, 5, 6],  # three branches from the root
  [-1, 0, 1, 2, 3, 4, 5, 6],  # a chain: plain causal verification
)
N, K, H, PS = 4, 2, 16, 4  # GQA: two query heads per key/value head


def path(parents, i):
  """Token i's root-to-i path, root first."""
  out = [i]
  while parents[out[-1]] >= 0:
    out.append(parents[out[-1]])
  return out[::-1]


def path_reference(q, kp, vp, table, lens, trees, qs=None, *, window=None, sinks=None):
  """Float64 output, padded (B, T, N, H) or ragged (total, N, H): each new token attends to the
  prefix and its own path as a contiguous causal cache, as sequential decoding would."""
  q, kp, vp = (np.asarray(x, np.float64) for x in (q, kp, vp))
  table, G = np.asarray(table), N // K
  rows = np.arange(len(trees) + 1) * q.shape[1] if qs is None else np.asarray(qs)
  flat = q.reshape(-1, N, H)
  out = np.zeros_like(flat)
  for b, parents in enumerate(trees):
    L, n = int(lens[b]), len(parents)
    pages = range(-(-L // PS))
    keys = np.concatenate([kp[table[b, p]] for p in pages])[:L]
    vals = np.concatenate([vp[table[b, p]] for p in pages])[:L]
    prefix = L - n
    for i in range(n):
      slots = list(range(prefix)) + [prefix + a for a in path(parents, i)]
      pos = len(slots) - 1  # the path's last token: causal sees every slot listed
      vis = np.ones(len(slots), bool)
      if window is not None:
        vis &= np.arange(len(slots)) >= pos - window
      for h in range(N):
        s = keys[slots][vis, h // G] @ flat[rows[b] + i, h] / np.sqrt(H)
        logits = s if sinks is None else np.append(s, sinks[h])
        w = np.exp(logits - logits.max())
        out[rows[b] + i, h] = (w[: len(s)] / w.sum()) @ vals[slots][vis, h // G]
  return out.reshape(q.shape)


def padded_case(seed, prefixes, dtype=jnp.float32, P=64):
  """Three sequences with the trees above after ``prefixes`` cached tokens, pages shuffled."""
  T = len(TREES[0])
  lens = np.array(prefixes) + T
  kp, vp, table = pool(seed, P, PS, K, H, H, len(TREES), lens, dtype=dtype)
  q = normal(seed + 1, (len(TREES), T, N, H)).astype(dtype)
  return q, kp, vp, table, lens


def call(q, kp, vp, table, lens, mask, window=None, sinks=None, **kw):
  """paged_attention with a window of ``window`` positions back (None: none) and sinks."""
  return jattn.paged_attention(
    q,
    kp,
    vp,
    table,
    jnp.asarray(lens),
    new_token_mask=mask,
    local_window_size=None if window is None else (window, 0),
    sinks=sinks,
    **kw,
  )


SINKS = np.linspace(-1.0, 2.0, N)
OPTIONS = [(None, None), (3, None), (5, SINKS)]  # (window, sinks)


@pytest.mark.parametrize("window, sinks", OPTIONS, ids=["causal", "window3", "window5_sinks"])
def test_padded_tree_equals_decoding_each_path(window, sinks):
  q, kp, vp, table, lens = padded_case(0, [37, 5, 70])
  mask = masks.tree_mask(np.array(TREES))
  got = call(q, kp, vp, table, lens, mask, window, sinks)
  want = path_reference(q, kp, vp, table, lens, TREES, window=window, sinks=sinks)
  check(got, want)


# Ragged: trees of different sizes, one of 20 tokens (two interleaved branches, cut into two
# tiles of 16 rows), a single decode token and a sequence with no new tokens.
RAGGED = (
  TREES[0][:5],
  [-1, 0, 1, 1, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14, 17, 16],
  [-1],
  [],
  TREES[1],
)


def ragged_mask(trees, T_max):
  """(total, T_max): each sequence's tree_mask rows, columns padded to T_max."""
  rows = [
    np.pad(np.asarray(masks.tree_mask(np.array(t))), ((0, 0), (0, T_max - len(t))))
    for t in trees
    if t
  ]
  return np.concatenate(rows)


def ragged_case(seed, prefixes, trees=RAGGED, dtype=jnp.float32):
  counts = np.array([len(t) for t in trees])
  lens = np.array(prefixes) + counts
  qs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  kp, vp, table = pool(seed, 96, PS, K, H, H, len(trees), lens, dtype=dtype)
  q = normal(seed + 1, (int(qs[-1]), N, H)).astype(dtype)
  return q, kp, vp, table, lens, qs


@pytest.mark.parametrize(
  "window, sinks", [(None, None), (3, SINKS)], ids=["causal", "window3_sinks"]
)
def test_ragged_trees_equal_decoding_each_path(window, sinks):
  q, kp, vp, table, lens, qs = ragged_case(2, [11, 40, 9, 6, 64])
  mask = ragged_mask(RAGGED, 24)  # T_max above every sequence's count
  got = call(q, kp, vp, table, lens, mask, window, sinks, query_start=qs)
  want = path_reference(q, kp, vp, table, lens, RAGGED, qs, window=window, sinks=sinks)
  check(got, want)


def test_traced_mask_under_jit_and_head_major_pages():
  q, kp, vp, table, lens, qs = ragged_case(4, [11, 40, 9, 6, 64])
  mask = jnp.asarray(ragged_mask(RAGGED, 20))
  kh, vh = jnp.swapaxes(kp, 1, 2), jnp.swapaxes(vp, 1, 2)
  f = jax.jit(
    lambda q, m, qs: jattn.paged_attention(
      q,
      kh,
      vh,
      table,
      jnp.asarray(lens),
      query_start=qs,
      new_token_mask=m,
      local_window_size=(3, 0),
      kv_layout="HND",
    )
  )
  want = path_reference(q, kp, vp, table, lens, RAGGED, qs, window=3)
  check(f(q, mask, jnp.asarray(qs)), want)


def test_bf16_within_a_few_roundings():
  q, kp, vp, table, lens = padded_case(6, [37, 5, 70], jnp.bfloat16)
  mask = masks.tree_mask(np.array(TREES))
  got = call(q, kp, vp, table, lens, mask, 5, SINKS)
  assert got.dtype == jnp.bfloat16
  up = lambda x: x.astype(jnp.float32)
  want = path_reference(up(q), up(kp), up(vp), table, lens, TREES, window=5, sinks=SINKS)
  rounding = np.abs(np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64) - want).max()
  assert np.abs(np.asarray(got, np.float64) - want).max() <= 4 * rounding + 1e-6


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
def test_lower_triangular_mask_is_the_causal_call(ragged):
  # Every new row sees the earlier ones: positions are the slots, as without a mask. (The
  # masked calls have the shapes and options of the window-and-sinks tree tests above: the
  # programs they compiled.)
  if ragged:
    trees = [list(range(-1, n - 1)) for n in (5, 20, 1, 0, 8)]
    q, kp, vp, table, lens, qs = ragged_case(8, [11, 40, 9, 6, 64], trees)
    mask, kw, window = ragged_mask(trees, 24), dict(query_start=qs), 3
  else:
    q, kp, vp, table, lens = padded_case(8, [37, 5, 70])
    mask, kw, window = np.broadcast_to(np.tril(np.ones((8, 8), bool)), (3, 8, 8)), {}, 5
  got = call(q, kp, vp, table, lens, mask, window, SINKS, **kw)
  plain = call(q, kp, vp, table, lens, None, window, SINKS, **kw)
  np.testing.assert_allclose(np.asarray(got), np.asarray(plain), rtol=1e-6, atol=1e-6)


def test_tree_differs_from_the_plain_causal_call():
  # The test above would pass with the mask ignored; a branching tree must not.
  q, kp, vp, table, lens = padded_case(0, [37, 5, 70])
  got = call(q, kp, vp, table, lens, masks.tree_mask(np.array(TREES)))
  plain = call(q, kp, vp, table, lens, None)
  assert np.abs(np.asarray(got - plain))[:2].max() > 1e-2
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(plain[2]), rtol=1e-6, atol=1e-6)


def test_traced_fault_makes_only_its_sequence_nan():
  # A row that hides itself, known only at run time: its sequence's rows are NaN, the rest exact.
  q, kp, vp, table, lens = padded_case(0, [37, 5, 70])
  mask = np.array(masks.tree_mask(np.array(TREES)))
  mask[1, 4, 4] = False
  f = jax.jit(lambda m: call(q, kp, vp, table, lens, m, 3))
  got = np.asarray(f(jnp.asarray(mask)))
  assert np.isnan(got[1]).all()
  want = path_reference(q, kp, vp, table, lens, TREES, window=3)
  check(got[[0, 2]], want[[0, 2]])


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernels_refuse_the_mask_and_none_falls_to_the_walk(kernel):
  mode = {"tpu": pltpu.force_tpu_interpret_mode, "gpu": _lowering.gpu_interpret_mode}[kernel]
  q, kp, vp, table, lens = padded_case(0, [37, 5, 70])
  mask = masks.tree_mask(np.array(TREES))
  with mode():
    got = call(q, kp, vp, table, lens, mask, 3)
    with pytest.raises(NotImplementedError, match="cannot take new_token_mask"):
      call(q, kp, vp, table, lens, mask, 3, implementation="pallas")
  check(got, path_reference(q, kp, vp, table, lens, TREES, window=3))


def _bad_diagonal():
  m = np.array(masks.tree_mask(np.array(TREES)))
  m[2, 6, 6] = False
  return m


def _bad_ragged_diagonal():
  m = ragged_mask(RAGGED, 20)
  m[5 + 3, 3] = False  # sequence 1's row 3
  return m


@pytest.mark.parametrize(
  "ragged, mask, error, words",
  [
    (False, np.ones((3, 8, 8), np.int32), TypeError, "new_token_mask must be a boolean array"),
    (False, np.ones((3, 8, 7), bool), ValueError, "(B, T, T) = (3, 8, 8)"),
    (False, np.ones((8, 8), bool), ValueError, "got shape (8, 8)"),
    (True, np.ones((3, 8, 8), bool), ValueError, "(total, T_max) = (34, T_max)"),
    (False, _bad_diagonal(), ValueError, "new_token_mask[2, 6, 6] is False"),
    (True, _bad_ragged_diagonal(), ValueError, "new_token_mask[8, 3] is False"),
    (True, np.ones((34, 19), bool), ValueError, "sequence 1 has 20 new rows"),
  ],
)
def test_malformed_masks_name_the_argument(ragged, mask, error, words):
  if ragged:
    q, kp, vp, table, lens, qs = ragged_case(2, [11, 40, 9, 6, 64])
    kw = dict(query_start=qs)
  else:
    q, kp, vp, table, lens = padded_case(0, [37, 5, 70])
    kw = {}
  with pytest.raises(error, match=re.escape(words)):
    call(q, kp, vp, table, lens, mask, **kw)


def test_tree_mask():
  got = np.asarray(masks.tree_mask(np.array([[-1, 0, 0, 1], [-1, -1, 1, 2]])))
  want = np.array(
    [
      [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
      [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]],
    ],
    bool,
  )
  np.testing.assert_array_equal(got, want)
  for parents in ([-1, 1], [-1, 0, 3], [-2, 0]):
    with pytest.raises(ValueError, match="tree_mask: parents"):
      masks.tree_mask(np.array(parents))
  with pytest.raises(TypeError, match="tree_mask: parents"):
    masks.tree_mask(np.array([-1.0, 0.0]))


def test_without_causality_a_tree_mask_still_hides_other_branches():
  # Cached keys all precede the new rows and a tree row sees only its ancestors: the same.
  q, kp, vp, table, lens = padded_case(0, [37, 5, 70])
  got = call(q, kp, vp, table, lens, masks.tree_mask(np.array(TREES)), is_causal=False)
  check(got, path_reference(q, kp, vp, table, lens, TREES))


def test_checkify_names_the_sequence():
  from jax.experimental import checkify

  q, kp, vp, table, lens = padded_case(0, [37, 5, 70])
  mask = np.array(masks.tree_mask(np.array(TREES)))
  mask[1, 4, 4] = False
  f = checkify.checkify(jax.jit(lambda m: call(q, kp, vp, table, lens, m, on_invalid="checkify")))
  err, _ = f(jnp.asarray(mask))
  assert "sequence 1's new_token_mask" in str(err.get())


def test_split_kv_program_for_accelerators():
  # Exported for cuda (the kernel refuses the mask: the split-KV walk's lanes) and run here;
  # a cache of 600 keys spans three blocks of 256 (lanes), the window skips all but the last.
  q, kp, vp, table, lens = padded_case(0, [600, 5, 300], P=240)
  mask = masks.tree_mask(np.array(TREES))
  f = lambda q, m: call(q, kp, vp, table, lens, m, 3)
  exp = jax.export.export(
    jax.jit(f), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.platform()]
  )(q, mask)
  want = path_reference(q, kp, vp, table, lens, TREES, window=3)
  check(exp.call(q, mask), want)
  check(f(q, mask), want)  # the CPU's walk: blocks of 128 keys, one lane


def test_ancestors_in_another_key_block_than_the_rows_position():
  """A 122-token prefix: a new row at position prefix + depth sits in the first key block (of
  128) while its ancestors' slots (prefix + i, row order) run into the next one. The rows must
  read every slot of the tree, not the range their positions would give."""
  q, kp, vp, table, lens = padded_case(5, [122, 5, 124], P=80)
  mask = masks.tree_mask(np.array(TREES))
  for window in (None, 6):
    got = call(q, kp, vp, table, lens, mask, window)
    check(got, path_reference(q, kp, vp, table, lens, TREES, window=window))
