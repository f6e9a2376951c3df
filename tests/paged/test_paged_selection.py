"""`jattn.paged_attention` with a key selection (`key_selection=masks.selected_blocks(...)`): a
DSA/NSA decoding step reads only its chosen keys from the paged cache.

Held to the float64 reference (the keys a row sees without a selection, and of those only the
blocks it chose) and to the contiguous call it stands for (`dot_product_attention` with the same
selection as a mask, causal bottom-right, on the sequence's keys laid side by side).
"""

from __future__ import annotations

import covering
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from covering import pairwise
from paged_reference import check, combined, head_major, normal, pool, reference
from programs import equations

import jattn
from jattn import masks

B, N, H, HV, P = 3, 4, 16, 8, 48
LENS = np.array([37, 5, 22])


def choose(seed, rows_shape, K, n, block, lens, at_row):
  """Indices rows_shape + (K, n): for each row, n distinct blocks of its sequence's cached
  tokens (``at_row`` maps a row to its sequence), -1 where it has fewer; unsorted."""
  rng = np.random.default_rng(seed)
  idx = np.full(rows_shape + (K, n), -1, np.int32)
  for r in np.ndindex(*rows_shape):
    blocks = -(-int(lens[at_row(r)]) // block)
    for k in range(K):
      c = rng.permutation(blocks)[:n]
      idx[r + (k,)][: len(c)] = c
  return idx


def call(layout, q, kp, vp, table, lens, **kw):
  if layout == "HND":
    kp, vp, _, _ = head_major(kp, vp)
    kw["kv_layout"] = "HND"
  elif layout == "combined":
    kp, vp = combined(kp, vp), None
    kw["kv_layout"] = "combined"
  return jattn.paged_attention(q, kp, vp, table, jnp.asarray(lens), return_residual=True, **kw)


# Every pair of layout, page size, block size (tokens, half a page, a page, two pages), new rows
# (1: decoding; 3: a prefill chunk), selection heads (one for all, one per KV head) and KV heads.
ROWS = pairwise(
  {
    "layout": ["NHD", "HND", "combined"],
    "ps": [4, 8],
    "block": [1, "half", "page", "two pages"],
    "T": [1, 3],
    "shared": [True, False],
    "K": [1, 2],
  }
)


@pytest.mark.parametrize("row", ROWS, ids=covering.ids(ROWS))
def test_selection_against_reference(row):
  ps, K, T = row["ps"], row["K"], row["T"]
  block = {1: 1, "half": ps // 2, "page": ps, "two pages": 2 * ps}[row["block"]]
  Hv = H if row["layout"] == "combined" else HV  # a combined pool's values are key-sized
  kp, vp, table = pool(0, P, ps, K, H, Hv, B, LENS)
  q = normal(1, (B, T, N, H))
  idx = choose(2, (B, T), 1 if row["shared"] else K, 3, block, LENS, lambda r: r[0])
  sel = masks.selected_blocks(idx, block)
  out, lse = call(row["layout"], q, kp, vp, table, LENS, key_selection=sel)
  want, want_lse = reference(q, kp, vp, table, LENS, selection=(idx, block))
  check(out, want)
  check(lse, want_lse)


@pytest.mark.parametrize(
  "kw",
  [dict(local_window_size=(5, 0)), dict(logits_soft_cap=2.0, sinks=True), dict(is_causal=False)],
  ids=["window", "cap+sinks", "not causal"],
)
def test_selection_equals_the_contiguous_call(kw):
  # Each sequence's step as dot_product_attention over its keys side by side, the same
  # selection as a mask, causality bottom-right (the last new row at the last key).
  kw, K, T, ps, block = dict(kw), 2, 3, 4, 4
  kp, vp, table = pool(3, P, ps, K, H, HV, B, LENS)
  q = normal(4, (B, T, N, H))
  idx = choose(5, (B, T), K, 4, block, LENS, lambda r: r[0])
  if "sinks" in kw:
    kw = dict(kw, sinks=jnp.linspace(-1.0, 1.0, N))
  out = jattn.paged_attention(
    q, kp, vp, table, jnp.asarray(LENS), key_selection=masks.selected_blocks(idx, block), **kw
  )
  causal = kw.pop("is_causal", True)
  for b, L in enumerate(LENS):
    pages = np.asarray(table)[b, : -(-L // ps)]
    k, v = (x[pages].reshape(-1, K, x.shape[-1])[None, :L] for x in (kp, vp))
    want = jattn.dot_product_attention(
      q[b : b + 1],
      k,
      v,
      mask=masks.selected_blocks(idx[b : b + 1], block),
      is_causal="bottom_right" if causal else False,
      implementation="dense",
      **kw,
    )
    check(out[b : b + 1], np.asarray(want, np.float64), atol=1e-5)


def test_ragged_rows_quantized_pages_and_absorbed_mla():
  # A ragged batch (a prefill chunk, an empty sequence, a decode step) on a latent int8 pool
  # with per-token scales: values are the keys' first HV features, read with them.
  ps, block, K = 4, 1, 1
  lens = np.array([9, 0, 30])
  qs = np.array([0, 4, 4, 5])
  latent, _, table = pool(6, P, ps, K, H, HV, B, lens, garbage=False)
  scale = np.abs(np.asarray(latent)).max(axis=-1) / 127.0  # (P, ps, K)
  quant = jnp.asarray(np.round(np.asarray(latent) / scale[..., None]), jnp.int8)
  seq_of_row = [0, 0, 0, 0, 2, 2]  # row 5 is past query_start[B]: no sequence
  q = normal(7, (6, N, H))
  idx = choose(8, (1, 6), 1, 5, block, lens, lambda r: seq_of_row[r[1]])
  out, lse = jattn.paged_attention(
    q,
    quant,
    None,
    table,
    jnp.asarray(lens),
    query_start=jnp.asarray(qs),
    value_head_dim=HV,
    k_scale=jnp.asarray(scale, jnp.float32),
    key_selection=masks.selected_blocks(idx, block),
    return_residual=True,
  )
  deq = np.asarray(quant, np.float64)
  want, want_lse = reference(
    q, deq, deq[..., :HV], table, lens, qs, ks=scale, vs=scale, selection=(idx, block)
  )
  check(out, want)
  np.testing.assert_allclose(np.asarray(lse)[:5], want_lse[:5], atol=1e-5)
  assert (np.asarray(out)[5] == 0).all()


def test_only_the_selected_pages_are_read():
  # Every key and value a row did not choose is NaN, and the program gathers no more keys
  # from the pool than the rows chose (rows x K x n x block x H per step), whatever the length.
  ps, block, K, T, n = 4, 4, 2, 1, 2
  lens = np.array([200, 120, 160])
  kp, vp, table = pool(9, 128, ps, K, H, HV, B, lens, garbage=False)
  q = normal(10, (B, T, N, H))
  idx = choose(11, (B, T), K, n, block, lens, lambda r: r[0])
  keep = np.zeros(kp.shape[:3], bool)
  for b in range(B):
    for k in range(K):
      for c in idx[b, 0, k]:
        for pos in range(c * block, (c + 1) * block):
          keep[np.asarray(table)[b, pos // ps], pos % ps, k] = True
  poisoned = [jnp.where(jnp.asarray(keep)[..., None], x, jnp.nan) for x in (kp, vp)]
  sel = masks.selected_blocks(idx, block)
  out = jattn.paged_attention(q, *poisoned, table, jnp.asarray(lens), key_selection=sel)
  want, _ = reference(q, kp, vp, table, lens, selection=(idx, block))
  check(out, want)

  f = lambda kp: jattn.paged_attention(q, kp, vp, table, jnp.asarray(lens), key_selection=sel)
  gathered = [
    np.prod(e.outvars[0].aval.shape)
    for e, _ in equations(jax.make_jaxpr(f)(kp).jaxpr)
    if e.primitive.name == "gather" and e.invars[0].aval.shape == kp.shape
  ]
  assert gathered and max(gathered) <= B * T * K * n * block * H


def test_traced_indices_select_nothing_out_of_range_and_count_a_repeat_once():
  ps, block, K, T = 4, 4, 1, 1
  kp, vp, table = pool(12, P, ps, K, H, HV, B, LENS, garbage=False)
  q = normal(13, (B, T, N, H))
  reach = -(-np.asarray(table).shape[1] * ps // block)
  idx = np.array([[[[0, 0, 1]]], [[[-1, 0, reach]]], [[[1, 1000, 2]]]], np.int32)
  clean = np.array([[[[0, 1, -1]]], [[[0, -1, -1]]], [[[1, 2, -1]]]], np.int32)
  f = jax.jit(
    lambda i: jattn.paged_attention(
      q,
      kp,
      vp,
      table,
      jnp.asarray(LENS),
      key_selection=masks.selected_blocks(i, block),
      return_residual=True,
    )
  )
  out, lse = f(idx)
  want, want_lse = reference(q, kp, vp, table, LENS, selection=(clean, block))
  check(out, want)
  check(lse, want_lse)


@pytest.mark.parametrize(
  "change, error, words",
  [
    (dict(key_selection=masks.causal()), TypeError, "key_selection must be one"),
    (dict(indices=[[[[0, 0]]]] * 3), ValueError, "must not repeat"),
    (dict(indices=[[[[99]]]] * 3), ValueError, "indices must each be -1"),
    (dict(indices=np.zeros((3, 2, 1, 1), np.int32)), ValueError, "T=1"),
    (dict(indices=np.zeros((3, 1, 3, 1), np.int32)), ValueError, "K'=3"),
    (dict(implementation="pallas"), NotImplementedError, "key_selection"),
    (dict(new_token_mask=np.ones((3, 1, 1), bool)), NotImplementedError, "new_token_mask"),
  ],
  ids=["not a selection", "repeat", "out of range", "rows", "heads", "pallas", "tree"],
)
def test_malformed_selections_name_the_argument(change, error, words):
  kp, vp, table = pool(14, P, 4, 2, H, HV, B, LENS, garbage=False)
  q = normal(15, (B, 1, N, H))
  change = dict(change)
  idx = np.asarray(change.pop("indices", np.zeros((3, 1, 1, 1), np.int32)), np.int32)
  kw = dict(key_selection=masks.selected_blocks(idx, 4)) | change
  with pytest.raises(error, match=words):
    jattn.paged_attention(q, kp, vp, table, jnp.asarray(LENS), **kw)
