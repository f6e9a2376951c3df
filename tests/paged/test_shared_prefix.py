"""examples/shared_prefix.py: a shared-prefix cascade over a paged pool.

The prefix attended once per group (the group's query rows stacked as one sequence's, not
causal) and each request's own pages (causal), merged by log-sum-exp, equal the plain paged call
over each request's whole page table, and both equal a float64 NumPy reference of causal
attention over each request's tokens; the example itself runs and reports both times.
"""

import _examples
import numpy as np
import pytest


def _example():
  return _examples.load("shared_prefix")


def _reference(query, keys, values):
  """(B, T, N, H) float64: request b's T queries, bottom-right causal over its own tokens
  keys[b], values[b] (S_b, K, H), the G = N // K query heads of a key head sharing it."""
  B, T, N, H = query.shape
  out = np.zeros((B, T, N, H))
  for b in range(B):
    k, v = (np.repeat(x.astype(np.float64), N // x.shape[1], axis=1) for x in (keys[b], values[b]))
    S = k.shape[0]
    s = np.einsum("tnh,snh->nts", query[b].astype(np.float64), k) / np.sqrt(H)
    pos = S - T + np.arange(T)
    s = np.where(np.arange(S)[None, None, :] <= pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    out[b] = np.einsum("nts,snh->tnh", p / p.sum(-1, keepdims=True), v)
  return out


@pytest.mark.parametrize(
  "sizes",
  [
    # Decoding; the prefix ends inside a page (its last tokens are each request's own).
    dict(groups=2, requests=3, prefix=37, own=20, T=1, page_size=8, heads=4, kv_heads=2),
    # A prefill chunk of own tokens, causal among themselves; MHA; whole-page prefix.
    dict(groups=1, requests=4, prefix=32, own=12, T=5, page_size=4, heads=2, kv_heads=2),
    # A prefix shorter than a page: nothing shared, the prefix call sees no keys.
    dict(groups=2, requests=2, prefix=3, own=6, T=2, page_size=8, heads=4, kv_heads=1),
  ],
)
def test_cascade_equals_plain_and_float64(sizes):
  ex = _example()
  pb = ex.make_problem(1, head_dim=8, **sizes)
  plain = np.asarray(
    ex.plain_attention(pb.query, pb.key_pages, pb.value_pages, pb.table, pb.lengths)
  )
  cascade = np.asarray(
    ex.cascade_attention(
      pb.query,
      pb.key_pages,
      pb.value_pages,
      pb.shared_table,
      pb.shared_lengths,
      pb.own_table,
      pb.own_lengths,
    )
  )
  want = _reference(np.asarray(pb.query), pb.keys, pb.values)
  np.testing.assert_allclose(plain, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cascade, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cascade, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", ["1", "3"])
def test_the_example_runs_and_reports_both_times(T, capsys):
  argv = ["--groups", "2", "--requests", "4", "--prefix", "64", "--own", "16", "--T", T]
  assert _example().main(argv + ["--page-size", "8", "--head-dim", "16", "--repeats", "2"]) == 0
  out = capsys.readouterr().out
  assert "plain:" in out and "cascade:" in out and "the cascade equals the plain call" in out
