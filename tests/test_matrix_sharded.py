"""The feature matrix under meshes (tests/matrix.py, run by tests/_matrix_worker.py on 4 host
devices): every implementation x every option, under an Auto and an Explicit mesh, with
batch-, head- and sequence-sharded inputs (and option arrays), forward and gradients equal to
the float64 reference; a NotImplementedError naming the implementation only from a
platform-bound kernel (cuDNN here); jattn's own implementations and None take every case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import matrix
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("layout", ["batch", "heads", "sequence"])
@pytest.mark.parametrize("mesh", ["auto", "explicit"])
def test_matrix_under_a_mesh(mesh, layout, tmp_path):
  out = tmp_path / "results.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run(
    [sys.executable, os.path.join(HERE, "_matrix_worker.py"), mesh, layout, str(out)],
    env=env,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  results = json.loads(out.read_text())
  expected = {
    f"{impl} {option}"
    for impl in matrix.implementations()
    if impl != "splash"
    for option in matrix.OPTIONS
  }
  assert set(results) == expected
  bad = []
  for case, result in results.items():
    impl = case.split()[0]
    if result == "ok":
      continue
    if result.startswith("refused: ") and matrix.platform_of(impl) is not None and impl in result:
      continue
    bad.append(f"{case}: {result}")
  assert not bad, f"{mesh} mesh, {layout}-sharded:\n" + "\n".join(bad)
