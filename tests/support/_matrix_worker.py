"""The feature matrix under meshes, on 4 host devices: run as a subprocess by
tests/parallel/test_matrix_sharded.py, one kind of mesh per process.

    python _matrix_worker.py MESH OUT.json
      MESH: auto | explicit

Runs the rows of `matrix.sharded_design` with that mesh: q, k, v and the output cotangent are
sharded over their batch, head or sequence dimension (B, N or K, T or S: the row's layout), and
so is every option array along the dimensions it has of that kind; each case (an
implementation x an option) is compiled, forward and VJP, and compared with the float64
reference. Writes {"LAYOUT IMPL OPTION": "ok" | "refused: ..." | "failed: ..."}.
"""

from __future__ import annotations

import functools
import json
import os
import sys

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import matrix
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# Which dimension letters each sharding splits (tests/support/matrix.py's letters).
SPLITS = {"batch": "B", "heads": "NK", "sequence": "TS"}


def spec(x, letters, layout):
  """Sharded along the first dimension of the layout's kind (a mesh axis shards one
  dimension of an array: a (B, N, T, S) bias is split along T, not also along S)."""
  entries = [None] * np.ndim(x)
  for i, (d, letter) in enumerate(zip(np.shape(x), letters)):
    if letter in SPLITS[layout] and d % 4 == 0:
      entries[i] = "x"
      break
  return P(*entries)


def main(mesh_kind, out_path):
  axis = AxisType.Explicit if mesh_kind == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((4,), ("x",), axis_types=(axis,))
  impls = matrix.implementations()
  results = {}
  q, k, v, do = matrix.inputs()
  for kind, layout, impl, option in matrix.sharded_design():
    if kind != mesh_kind:
      continue
    arrays = matrix.option_arrays(option)
    letters = {n: s[1] for n, s in matrix.OPTIONS[option].arrays.items()}
    name = f"{layout} {impl} {option}"
    try:
      with jax.set_mesh(mesh):
        put = lambda x, lt: jax.device_put(x, NamedSharding(mesh, spec(x, lt, layout)))
        args = [put(x, "BTKH" if i in (1, 2) else "BTNH") for i, x in enumerate((q, k, v, do))]
        args.append({n: put(x, letters[n]) for n, x in arrays.items()})
        out, grads = jax.jit(matrix.loss_and_grads(impls[impl], option))(*args)
      matrix.check(name, out, grads, _reference(option), 1e-4)
      results[name] = "ok"
    except NotImplementedError as e:
      results[name] = f"refused: {e}"
    except Exception as e:
      results[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1)


@functools.cache
def _reference(option):
  return matrix.reference(option)


if __name__ == "__main__":
  main(*sys.argv[1:3])
