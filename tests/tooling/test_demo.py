"""The claims the demo prints hold on its own data; the CLI runs end to end and writes figures.

Settings are small; the CLI test reuses the experiment settings of the claim tests so that jattn's
compiled programs are shared.
"""

import itertools
import math

import jax
import numpy as np
import pytest

from jattn.bench import demo


@pytest.fixture(scope="module")
def sharpness_rows():
  return demo.sharpness(dims=(32, 128, 512), num_keys=8, seeds=64, seed=0)


def test_unscaled_softmax_sharpens_with_d_and_scaled_does_not(sharpness_rows):
  un = {r.d: r for r in sharpness_rows if not r.scaled}
  sc = {r.d: r for r in sharpness_rows if r.scaled}
  dims = sorted(un)
  # Var(q.k) = d for unit-variance entries: the logit std is sqrt(d), and 1 after scaling.
  for d in dims:
    assert abs(un[d].logit_std / math.sqrt(d) - 1) < 0.2, (d, un[d].logit_std)
    assert abs(sc[d].logit_std - 1) < 0.2, (d, sc[d].logit_std)
  # Unscaled: the max probability grows with d, entropy and the softmax Jacobian shrink.
  assert all(un[a].max_prob < un[b].max_prob for a, b in itertools.pairwise(dims))
  assert all(un[a].entropy > un[b].entropy for a, b in itertools.pairwise(dims))
  assert all(un[a].jacobian_norm > un[b].jacobian_norm for a, b in itertools.pairwise(dims))
  assert un[512].saturated_fraction > 0.5 and un[512].jacobian_norm < 0.1
  for d in dims:
    assert un[d].max_prob > sc[d].max_prob and un[d].min_prob < sc[d].min_prob
    assert un[d].jacobian_norm < sc[d].jacobian_norm
  # Scaled: the same distribution whatever d (within sampling noise), never saturated.
  maxes = [sc[d].max_prob for d in dims]
  assert max(maxes) - min(maxes) < 0.05 and all(sc[d].saturated_fraction < 0.05 for d in dims)
  # The diagnostics' entropy fraction agrees with the float64 entropy / log S.
  for r in sharpness_rows:
    assert abs(r.entropy_fraction - r.entropy / math.log(8)) < 1e-4


def test_softmax_jacobian_norm_closed_form():
  p = np.array([[0.7, 0.2, 0.1], [1.0, 0.0, 0.0]])
  jacobian = jax.jit(jax.jacobian(jax.nn.softmax))
  for row in p:
    jac = np.asarray(jacobian(np.log(np.maximum(row, 1e-30)).astype(np.float32)), np.float64)
    np.testing.assert_allclose(demo.softmax_jacobian_norm(row), np.linalg.norm(jac), atol=1e-6)
  assert demo.softmax_jacobian_norm(p)[1] == 0.0  # one-hot: no gradient at all


@pytest.fixture(scope="module")
def overflow_rows():
  return demo.overflow(magnitudes=(10, 100, 1e5), num_keys=8)


def _row(rows, dtype, pattern, M, method):
  (r,) = [
    r for r in rows if (r.dtype, r.pattern, r.magnitude, r.method) == (dtype, pattern, M, method)
  ]
  return r


def test_naive_softmax_overflows_where_stable_and_jattn_do_not(overflow_rows):
  for dtype in ("float16", "bfloat16", "float32"):
    for pattern in ("spread", "shifted"):
      # Small logits: every method is right.
      for method in ("naive", "stable", "jattn"):
        r = _row(overflow_rows, dtype, pattern, 10, method)
        assert r.status == "ok" and r.max_error < 1e-2, r
      # Logits of 100: exp overflows (spread) or underflows to 0/0 (shifted) in every dtype.
      assert _row(overflow_rows, dtype, pattern, 100, "naive").status == "NaN"
      assert _row(overflow_rows, dtype, pattern, 100, "stable").status == "ok"
      r = _row(overflow_rows, dtype, pattern, 100, "jattn")
      assert r.status == "ok" and r.max_error < 1e-2, r
      # jattn stays finite even at 1e5, where a float16 logit is itself inf.
      assert _row(overflow_rows, dtype, pattern, 1e5, "jattn").status == "ok"
  assert _row(overflow_rows, "float16", "spread", 1e5, "stable").status == "NaN"


@pytest.fixture(scope="module")
def masked_results():
  return {r.method: r for r in demo.masked_row()}


def test_fully_masked_row(masked_results):
  naive, jnn, ours = (masked_results[m] for m in ("naive -inf", "jax.nn", "jattn"))
  assert naive.output_nan and naive.grad_nan and np.isnan(naive.masked_row).all()
  assert not jnn.output_nan and jnn.mean_of_v_error < 1e-5  # silently the mean of V
  assert not ours.output_nan and not ours.grad_nan
  assert np.all(ours.masked_row == 0.0) and ours.mean_of_v_error > 0.1
  # Where rows do see keys, all three agree with the float64 reference.
  for r in (naive, jnn, ours):
    assert r.other_rows_error < 1e-5, r


PRECISION = dict(lengths=(256,), heads=1, head_dim=32, block=32)


@pytest.fixture(scope="module")
def precision_rows():
  return demo.precision(**PRECISION)


def test_precision_claims(precision_rows):
  by = {(r.T, r.method): r for r in precision_rows}
  for T in PRECISION["lengths"]:
    floor = by[T, "bf16 rounding of ref"].rel_error
    assert 5e-4 < floor < 5e-3  # bfloat16 has an 8-bit mantissa: ~2^-9 relative rounding
    for impl in ("dense", "chunked"):
      assert by[T, f"jattn {impl} fp32"].rel_error < 2e-6
      # float32 statistics: jattn in bfloat16 is within 2x of rounding the exact answer.
      assert by[T, f"jattn {impl} bf16"].rel_error < 2 * floor
      assert by[T, "plain bf16"].rel_error > by[T, f"jattn {impl} bf16"].rel_error
    assert (
      abs(by[T, "jattn dense bf16"].rel_error - by[T, "jattn chunked bf16"].rel_error) < 0.5 * floor
    )


def test_cli_end_to_end_with_plots(tmp_path, capsys):
  args = [
    "--seeds",
    "64",
    "--dims",
    "32,128,512",
    "--magnitudes",
    "10,100,1e5",
    "--lengths",
    "256",
    "--heads",
    "1",
    "--head-dim",
    "32",
    "--block",
    "32",
    "--plot",
    str(tmp_path),
  ]
  assert demo.main(args) == 0
  out = capsys.readouterr().out
  for title in ("1. Softmax sharpness", "2. Naive", "3. A query row", "4. Relative error"):
    assert title in out
  assert "NaN" in out and "jattn chunked bf16" in out
  pngs = sorted(p.name for p in tmp_path.iterdir())
  assert pngs == ["1_sharpness.png", "2_overflow.png", "3_masked.png", "4_precision.png"]
  for name in pngs:
    data = (tmp_path / name).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_cli_experiment_selection_and_errors(capsys):
  assert demo.main(["-e", "3"]) == 0
  out = capsys.readouterr().out
  assert "3. A query row" in out and "1. Softmax" not in out
  with pytest.raises(SystemExit):
    demo.main(["-e", "nonsense"])
  assert "unknown experiment" in capsys.readouterr().err
