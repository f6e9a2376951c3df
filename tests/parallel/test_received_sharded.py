"""jattn.attention_received under meshes (4 host devices, in a subprocess): batch-, head- and
key-sharded operands under an Explicit and an Auto mesh, every implementation of
tests/attention/test_received.py, against the same float64 definition
(support/received_cases.py)."""

from __future__ import annotations

import pytest
from _subprocess import run_worker

MESH_WORKER = """
import json, os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np, jattn
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import received_cases as t

q, k = t.inputs()
kw, visible, ref_kw = t.case("causal, window")
want = t.want(q, k, visible, **ref_kw)
errs = {}
# Batch-, head- and key-sharded operands, under an Explicit mesh and an Auto one.
for axes in ("explicit", "auto"):
  typ = AxisType.Explicit if axes == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(typ, typ))
  for where, qs, ks in (
    ("batch", P("a"), P("a")),
    ("heads", P(None, None, "b"), P(None, None, "b")),
    ("batch+heads", P("a", None, "b"), P("a", None, "b")),
    ("keys", P(), P(None, ("a", "b"))),
  ):
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in ((q, qs), (k, ks))]
    for impl, extra in t.IMPLS.items():
      f = jax.jit(lambda q, k: jattn.attention_received(q, k, **kw, **extra))
      name = f"{axes}/{where}/{impl}"
      try:
        if axes == "explicit":
          with jax.set_mesh(mesh):
            got = f(*args)
        else:
          got = f(*args)
        errs[name] = float(np.abs(np.asarray(got, np.float64) - want).max())
      except Exception as e:
        errs[name] = f"{type(e).__name__}: {e}"[:400]
print("RESULTS " + json.dumps(errs))
"""


@pytest.mark.slow
def test_under_meshes():
  errs = run_worker(MESH_WORKER)
  assert len(errs) == 24, errs
  bad = {k: e for k, e in errs.items() if not (isinstance(e, float) and e < 1e-5)}
  assert not bad, bad
