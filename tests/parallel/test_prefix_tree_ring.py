"""Packed prefix trees through ring attention over 4 host devices (a subprocess), contiguous and
zigzag: the tree's mask remapped to every pair of shards, against the float64 answer of every
path alone (support/prefix_trees.py; the one-device runs: tests/attention/test_prefix_tree.py)."""

from __future__ import annotations

import pytest
from _subprocess import run_worker

RING_WORKER = """
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import json
import jax
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
import jax.numpy as jnp
import numpy as np
import jattn
import prefix_trees as t

pb, want = t.problem("float32", False)
mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("seq",))
errs = {}
for layout in ("contiguous", "zigzag"):
  perm = (lambda x: jattn.zigzag_permute(x, 4)) if layout == "zigzag" else (lambda x: x)
  unperm = (lambda x: jattn.zigzag_unpermute(x, 4)) if layout == "zigzag" else (lambda x: x)

  def f(q, k, v, sinks, perm=perm, unperm=unperm, layout=layout):
    o = jattn.ring_attention_sharded(
      perm(q), perm(k), perm(v), mask=pb.tree.mask, sinks=sinks, mesh=mesh, seq_axis="seq",
      layout=layout, block_q=4, block_kv=4,
    )
    return unperm(o)

  args = [jnp.asarray(x, jnp.float32) for x in (pb.q, pb.k, pb.v)] + [jnp.asarray(pb.sinks)]
  out, pull = jax.vjp(jax.jit(f), *args)
  got = dict(zip(("dq", "dk", "dv", "dsinks"), pull(jnp.asarray(pb.do, jnp.float32))), out=out)
  for name, g in got.items():
    errs[layout + "/" + name] = float(np.abs(np.asarray(g, np.float64) - want[name]).max())
print("RESULTS " + json.dumps(errs))
"""


@pytest.mark.slow
def test_ring_on_four_devices_equals_the_paths_alone():
  """Ring attention over 4 host devices, contiguous and zigzag: the tree's mask, built once on
  global positions, remapped to every pair of shards; outputs and gradients of q, k, v and sinks
  against the float64 answer of every path alone."""
  errs = run_worker(RING_WORKER)
  assert len(errs) == 10, errs
  bad = {k: e for k, e in errs.items() if not e < 3e-5}
  assert not bad, bad
