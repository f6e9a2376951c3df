"""examples/speculative.py: speculative decoding with a tree of draft tokens over a paged cache.

Each step writes the tree's keys and values in row order, verifies every row in one
``paged_attention(..., new_token_mask=tree_mask(parents))`` call, accepts a root-to-node path
and moves its tokens to consecutive slots with ``write_pages(..., new_lengths=...)``. The
accepted rows' outputs must equal decoding the same tokens one at a time (float32, and a float64
NumPy forward of the whole sequence), and the moved cache the one filled token by token; without
the move the next step reads rejected rows and the check fails.
"""

import _examples
import numpy as np
import pytest


@pytest.fixture(scope="module")
def ex():
  return _examples.load("speculative")


@pytest.fixture(scope="module")
def model(ex):
  rng = np.random.default_rng(0)
  return ex.init(rng), [rng.integers(0, ex.V, n) for n in (5, 9)]


def _rope(x, pos):
  """float64 NumPy rotary embedding of x (S, N, H) at positions pos (S,)."""
  half = x.shape[-1] // 2
  ang = pos[:, None, None] * 10000.0 ** (-np.arange(half) / half)[None, None, :]
  a, b = x[..., :half], x[..., half:]
  return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], -1)


def _uncached_outputs(ex, w, tokens):
  """(S, N, H) float64: every token's causal attention output over the whole sequence, no cache,
  token s at position s."""
  w = {name: np.asarray(x, np.float64) for name, x in w.items()}
  pos = np.arange(len(tokens), dtype=np.float64)
  x = w["embed"][np.asarray(tokens)]
  q = _rope(np.einsum("sd,dnh->snh", x, w["wq"]), pos)
  k = np.repeat(_rope(np.einsum("sd,dkh->skh", x, w["wk"]), pos), ex.N // ex.K, axis=1)
  v = np.repeat(np.einsum("sd,dkh->skh", x, w["wv"]), ex.N // ex.K, axis=1)
  s = np.einsum("qnh,knh->nqk", q, k) / np.sqrt(ex.H)
  s = np.where(np.tril(np.ones((len(tokens),) * 2, bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("nqk,knh->qnh", p / p.sum(-1, keepdims=True), v)


def test_tree_steps_equal_step_by_step_decoding(ex, model):
  w, prompts = model
  r = ex.run(w, prompts, steps=4, page_size=4)
  # The run exercises what the example is about: sequences accepting different counts in one
  # step, and a path whose rows are not consecutive (its tokens had to move).
  assert any(len(set(a)) > 1 for a in r["accepted"])
  assert any(p != list(range(len(p))) for step in r["paths"] for p in step)
  assert r["out_diff"] < 2e-6
  assert r["cache_diff"] < 1e-6
  for b, prompt in enumerate(prompts):
    want = _uncached_outputs(ex, w, r["tokens"][b])[len(prompt) :]
    np.testing.assert_allclose(np.stack(r["outs"][b]), want, rtol=1e-5, atol=1e-5)


def test_without_the_move_the_next_step_reads_rejected_rows(ex, model):
  w, prompts = model
  r = ex.run(w, prompts, steps=4, page_size=4, moved=False)
  assert r["out_diff"] > 1e-3 and r["cache_diff"] > 1e-3


def test_the_example_runs(ex, capsys):
  assert ex.main(["--steps", "3", "--page-size", "8"]) == 0
  assert "the tree steps equal step-by-step decoding" in capsys.readouterr().out
