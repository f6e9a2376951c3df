"""Issue #30's and #41's mutations (realistic single bugs), put into the library one at a time: runs
the tests meant to catch each and reports which fail, then restores the file. Not collected by
pytest; run `python tests/_mutations.py [PYTHON] [INDEX...]` from a checkout."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = sys.argv[1] if len(sys.argv) > 1 else sys.executable
MUTATIONS = [
  (
    "accumulator in bf16 (_chunked)",
    "jattn/_chunked/kernel.py",
    "    acc = acc * corr[..., None] + _tile.pv(p, vb)\n    return m_new, l, acc",
    "    acc = (acc * corr[..., None] + _tile.pv(p, vb)).astype(q.dtype).astype(sd)\n    return m_new, l, acc",
    ["tests/test_precision16.py"],
  ),
  (
    "all tile math in bf16 (_softmax.stat_dtype)",
    "jattn/_softmax.py",
    "  return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)",
    "  return jnp.dtype(dtype)",
    ["tests/test_precision16.py"],
  ),
  (
    "user mask dropped while decoding (_mha)",
    "jattn/_mha.py",
    "  mask = _boolean_mask(mask)\n  if mask is not None:\n    m = m & ",
    "  mask = None\n  if mask is not None:\n    m = m & ",
    ["tests/test_flax_modules.py"],
  ),
  (
    "explicit positions offset twice while decoding (_mha)",
    "jattn/_mha.py",
    "  return jnp.broadcast_to(positions.astype(jnp.int32), (B, L))",
    "  positions = positions.astype(jnp.int32)\n  if offset is not None:\n    positions = offset.astype(jnp.int32)[:, None] + positions\n  return jnp.broadcast_to(positions, (B, L))",
    ["tests/test_flax_modules.py"],
  ),
  (
    "score_mod ignored by diagnostics",
    "jattn/diagnostics.py",
    "  cfg, score_args = s.config((B, N, bq, bk))",
    "  cfg, score_args = dataclasses.replace(\n      s, opts=dataclasses.replace(s.opts, score_mod=None)).config((B, N, bq, bk))",
    ["tests/test_diagnostics.py"],
  ),
  (
    "head index dropped from the dropout hash",
    "jattn/_dropout.py",
    "  x = _mix(x ^ u(h) + seed[1])",
    "  x = _mix(x ^ u(0 * h) + seed[1])",
    ["tests/test_attention.py", "tests/test_matrix.py", "tests/test_flax_modules.py"],
  ),
  # Issue #41: guarded by the tests named (node ids: only those run).
  (
    "paged/quantised cache: fill level clamped to capacity - 1 (_mha)",
    "jattn/_mha.py",
    "    jnp.minimum(index + T, capacity),",
    "    jnp.minimum(index + T, capacity - 1),",
    ["tests/test_flax_modules.py::test_cache_decoded_token_by_token_to_its_last_slot"],
  ),
  (
    "make_attention_fn: output shaped with the query's head size, not value's (_flax_fn)",
    "jattn/_flax_fn.py",
    "    return out.reshape(query.shape[:-1] + (value.shape[-1],))",
    "    return out.reshape(query.shape)",
    ["tests/test_flax_attention_fn.py::test_value_head_size_of_its_own_against_reference"],
  ),
  (
    "positions mask: a block's first position taken as its min (masks._Positions)",
    "jattn/masks/_per_example.py",
    "    kmin, kmax = _block_min_max(self.kv_positions.astype(jnp.int32), *grid.kv_blocks())\n",
    "    kmin, kmax = _block_min_max(self.kv_positions.astype(jnp.int32), *grid.kv_blocks())\n"
    "    # positions rise within a block: its first entry is its min\n"
    "    qmin = jnp.take(self.q_positions.astype(jnp.int32), jnp.asarray(grid.q_ranges()[0]),\n"
    "                    axis=1)\n"
    "    kmin = jnp.take(self.kv_positions.astype(jnp.int32), jnp.asarray(grid.kv_ranges()[0]),\n"
    "                    axis=1)\n",
    [
      "tests/test_positions.py::test_every_example_at_positions_of_its_own",
      "tests/test_positions.py::test_block_states_of_every_example_are_sound",
    ],
  ),
]
only = sys.argv[2:]
for i, (name, path, old, new, tests) in enumerate(MUTATIONS):
  if only and str(i) not in only:
    continue
  f = ROOT / path
  src = f.read_text()
  assert src.count(old) == 1, (name, src.count(old))
  f.write_text(src.replace(old, new))
  try:
    r = subprocess.run(
      [PY, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", *tests],
      cwd=ROOT,
      capture_output=True,
      text=True,
    )
    failed = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith("FAILED")]
    print(f"== {name}: {len(failed)} failed", flush=True)
    for l in failed[:12]:
      print("   ", l)
  finally:
    f.write_text(src)
