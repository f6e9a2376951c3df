"""The feature matrix under meshes (tests/support/matrix.py, run by tests/support/_matrix_worker.py
on 4 host devices): every option under an Auto and an Explicit mesh with batch-, head- and
sequence-sharded inputs (and option arrays), and every implementation with every option, forward and
gradients equal to the float64 reference; a NotImplementedError naming the implementation only from
a platform-bound kernel (cuDNN here); jattn's own implementations and None take every case.

A covering design (`matrix.sharded_design`), not the product: each (mesh, layout, option) once,
taken by one of jattn's implementations (or None), which are turned so that each meets every
option and every mesh and layout; one process per kind of mesh, each compiling only its own
rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import matrix
import pytest

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support")


def test_the_design_holds_every_pair():
  rows = matrix.sharded_design()
  impls = matrix.implementations()
  own = {i for i in impls if matrix.platform_of(i) is None}
  ran = [r for r in rows if r[2] in own]
  placements = {(m, lay) for m in matrix.MESHES for lay in matrix.LAYOUTS}
  assert len(set(rows)) == len(rows)
  assert {(i, o) for *_, i, o in rows} == {
    (i, o) for i in impls if i != "splash" for o in matrix.OPTIONS
  }
  assert {(m, lay, o) for m, lay, _, o in ran} == {
    (*p, o) for p in placements for o in matrix.OPTIONS
  }
  assert {(m, lay, i) for m, lay, i, _ in ran} == {(*p, i) for p in placements for i in own}


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("mesh", matrix.MESHES)
def test_matrix_under_a_mesh(mesh, tmp_path):
  out = tmp_path / "results.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run(
    [sys.executable, os.path.join(SUPPORT, "_matrix_worker.py"), mesh, str(out)],
    env=env,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  results = json.loads(out.read_text())
  expected = {f"{lay} {i} {o}" for m, lay, i, o in matrix.sharded_design() if m == mesh}
  assert set(results) == expected
  bad = []
  for case, result in results.items():
    impl = case.split()[1]
    if result == "ok":
      continue
    if result.startswith("refused: ") and matrix.platform_of(impl) is not None and impl in result:
      continue
    bad.append(f"{case}: {result}")
  assert not bad, f"{mesh} mesh:\n" + "\n".join(bad)
