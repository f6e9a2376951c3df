"""`jattn.paged_attention`'s metadata rules: no sequence ever reads another's pages.

Each fault is tried twice: with concrete metadata (an eager call) it is a ValueError naming the
argument, the sequence and the bad value; with traced metadata (under ``jit``) the faulty
sequence's rows are NaN, output and log-sum-exp, and every other row equals the clean call's.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from paged_reference import check, normal, pool, reference

import jattn

N, K, H, PS, P = 4, 2, 8, 8, 24


def _padded():
  lens = np.array([30, 6, 19])
  kp, vp, table = pool(20, P, PS, K, H, H, 3, lens)
  q = normal(21, (3, 2, N, H))
  return q, kp, vp, np.asarray(table), lens


def _ragged():
  # Three sequences of 3, 1 and 2 new rows, and one trailing row that belongs to none.
  lens = np.array([30, 6, 19])
  qs = np.array([0, 3, 4, 6])
  kp, vp, table = pool(22, P, PS, K, H, H, 3, lens)
  q = normal(23, (7, N, H))
  return q, kp, vp, np.asarray(table), lens, qs


@jax.jit
def _jitted(q, kp, vp, t, l, s):
  return jattn.paged_attention(q, kp, vp, t, l, query_start=s, return_residual=True)


def _traced(q, kp, vp, table, lens, qs=None):
  # One jitted function for every call: the clean and faulty metadata of every test (the same
  # shapes) run one compiled program, padded or ragged.
  out, lse = _jitted(
    q, kp, vp, jnp.asarray(table), jnp.asarray(lens), None if qs is None else jnp.asarray(qs)
  )
  return np.asarray(out), np.asarray(lse)


def _bad_page(table, value):
  table = table.copy()
  table[1, 0] = value  # sequence 1's first page, which its 6 tokens cover
  return table


PADDED_FAULTS = {
  "page id past the pool": (lambda t, l: (_bad_page(t, P), l), r"page_table\[1, 0\]=24"),
  "negative page id": (lambda t, l: (_bad_page(t, -1), l), r"page_table\[1, 0\]=-1"),
  "kv_lengths past the table": (
    lambda t, l: (t, np.array([30, 6, t.shape[1] * PS + 1])),
    r"kv_lengths\[2\]=41 is outside \[0, 40\]",
  ),
  "negative kv_lengths": (
    lambda t, l: (t, np.array([30, -3, 19])),
    r"kv_lengths\[1\]=-3 is outside",
  ),
}


@pytest.mark.parametrize("fault", PADDED_FAULTS)
def test_padded_faults(fault):
  q, kp, vp, table, lens = _padded()
  make, words = PADDED_FAULTS[fault]
  bad_table, bad_lens = make(table, lens)
  with pytest.raises(ValueError, match=words):
    jattn.paged_attention(q, kp, vp, jnp.asarray(bad_table), jnp.asarray(bad_lens))
  # NumPy metadata is concrete under jit too.
  with pytest.raises(ValueError, match=words):
    jax.jit(lambda q: jattn.paged_attention(q, kp, vp, bad_table, bad_lens))(q)
  clean, clean_lse = _traced(q, kp, vp, table, lens)
  want, _ = reference(q, kp, vp, table, lens)
  check(clean, want)
  out, lse = _traced(q, kp, vp, bad_table, bad_lens)
  faulty = int(re.search(r"\[(\d)", words).group(1))
  others = [b for b in range(3) if b != faulty]
  assert np.isnan(out[faulty]).all() and np.isnan(lse[faulty]).all()
  np.testing.assert_array_equal(out[others], clean[others])
  np.testing.assert_array_equal(lse[others], clean_lse[others])


RAGGED_FAULTS = {
  # query_start, kv_lengths, the rows that must be NaN, the error's words
  "starts at 1": ([1, 3, 4, 6], None, [1, 2], r"start at 0.*sequence 0 .*query_start\[0\]=1"),
  "starts at -1": ([-1, 3, 4, 6], None, [0, 1, 2], r"sequence 0 .*query_start\[0\]=-1"),
  # Sequence 1 ends before it starts; sequence 2 starts inside sequence 0's rows, which stay
  # sequence 0's.
  "decreasing": ([0, 3, 2, 6], None, [3, 4, 5], r"sequence 1 .*query_start\[2\]=2"),
  "ends past the rows": ([0, 3, 4, 9], None, [4, 5, 6], r"sequence 2 .*query_start\[3\]=9"),
  # Also FlashAttention's cache_seqlens (the cache before the new tokens) passed as
  # kv_lengths for a first prefill chunk; elsewhere that mix-up is a valid call of other
  # positions (docs/serving.md says so).
  "more rows than cached tokens": (
    None,
    [0, 6, 19],
    [0, 1, 2],
    r"sequence 0 has 3 query rows but kv_lengths\[0\]=0",
  ),
}


@pytest.mark.parametrize("fault", RAGGED_FAULTS)
def test_ragged_faults(fault):
  q, kp, vp, table, lens, qs = _ragged()
  bad_qs, bad_lens, nan_rows, words = RAGGED_FAULTS[fault]
  bad_qs = qs if bad_qs is None else np.array(bad_qs)
  bad_lens = lens if bad_lens is None else np.array(bad_lens)
  with pytest.raises(ValueError, match=words):
    jattn.paged_attention(
      q, kp, vp, jnp.asarray(table), jnp.asarray(bad_lens), query_start=jnp.asarray(bad_qs)
    )
  clean, clean_lse = _traced(q, kp, vp, table, lens, qs)
  want, _ = reference(q, kp, vp, table, lens, qs)
  check(clean[:6], want[:6])
  # The trailing row belongs to no sequence: output 0, log-sum-exp that of an empty row.
  assert (clean[6] == 0).all() and (clean_lse[6] < -1e30).all()
  out, lse = _traced(q, kp, vp, table, bad_lens, bad_qs)
  nan = np.zeros(7, bool)
  nan[nan_rows] = True
  assert np.isnan(out[nan]).all() and np.isnan(lse[nan]).all()
  assert not np.isnan(out[~nan]).any()
  # Rows of sound sequences are the clean call's; rows no sequence owns now are 0.
  owned = np.array([any(bad_qs[b] <= r < bad_qs[b + 1] for b in range(3)) for r in range(7)])
  sound = owned & ~nan
  np.testing.assert_array_equal(out[sound], clean[sound])
  np.testing.assert_array_equal(lse[sound], clean_lse[sound])
  assert (out[~owned] == 0).all()


def test_padded_form_keeps_leading_rows_that_see_nothing():
  # Padded queries: T rows per sequence even when fewer tokens are cached; the leading rows sit
  # before position 0 and see nothing. Not a fault.
  q, kp, vp, table, _ = _padded()
  lens = np.array([30, 1, 19])
  out = jattn.paged_attention(q, kp, vp, jnp.asarray(table), jnp.asarray(lens))
  want, _ = reference(q, kp, vp, table, lens)
  check(out, want)
  assert (np.asarray(out)[1, 0] == 0).all()


def test_checkify_names_the_faulty_sequence():
  q, kp, vp, table, lens = _padded()
  f = checkify.checkify(
    jax.jit(lambda t, l: jattn.paged_attention(q, kp, vp, t, l, on_invalid="checkify"))
  )
  err, out = f(jnp.asarray(_bad_page(table, 99)), jnp.asarray(lens))
  assert "sequence 1 breaks metadata rule 2" in str(err.get())
  assert np.isnan(np.asarray(out)[1]).all()
  err, out = f(jnp.asarray(table), jnp.asarray(lens))
  assert err.get() is None
  check(out, reference(q, kp, vp, table, lens)[0])


def test_layout_mixups_caught_where_they_can_be():
  q, kp, vp, table, lens = _padded()
  # A token-major pool (P, 8, 2, 8) declared head-major fits every shape check when N is a
  # multiple of 8 -- the page size says otherwise.
  q8 = jnp.ones((3, 1, 8, 8))
  with pytest.raises(ValueError, match=r"page_size=8 .* has 2 .*other layout"):
    jattn.paged_attention(q8, kp, vp, table, lens, kv_layout="HND", page_size=PS)
  with pytest.raises(ValueError, match=r"num_kv_heads=2 .* has 8"):
    jattn.paged_attention(q8, kp, vp, table, lens, kv_layout="HND", num_kv_heads=K)
  jattn.paged_attention(q, kp, vp, table, lens, page_size=PS, num_kv_heads=K)
  with pytest.raises(ValueError, match="same array"):
    jattn.paged_attention(q, kp, kp, table, lens)
  with pytest.raises(ValueError, match="on_invalid must be"):
    jattn.paged_attention(q, kp, vp, table, lens, on_invalid="raise")
