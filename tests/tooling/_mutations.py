"""Realistic single bugs (issues #30, #41, #51, #52), put into the library one at a time: runs the
tests meant to catch each and reports which fail, then restores the file; a mutation no test
catches is reported as SURVIVED and the run exits 1. Not collected by pytest; run
`python tests/tooling/_mutations.py [PYTHON] [INDEX...]` from a checkout (PYTHON: the
interpreter whose jattn is this checkout's, e.g. an editable install or PYTHONPATH=.)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.argv[1] if len(sys.argv) > 1 else sys.executable
MUTATIONS = [
  (
    "accumulator in bf16 (_chunked)",
    "jattn/_chunked/kernel.py",
    "    acc = acc * corr[..., None] + _tile.pv(p, vb)\n    return m_new, l, acc",
    "    acc = (acc * corr[..., None] + _tile.pv(p, vb)).astype(q.dtype).astype(sd)\n    return m_new, l, acc",
    ["tests/properties/test_precision16.py"],
  ),
  (
    "all tile math in bf16 (_softmax.stat_dtype)",
    "jattn/_softmax.py",
    "  return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)",
    "  return jnp.dtype(dtype)",
    ["tests/properties/test_precision16.py"],
  ),
  (
    "user mask dropped while decoding (_flax/modules)",
    "jattn/_flax/modules.py",
    "  mask = _boolean_mask(mask)\n  if mask is not None:\n    m = m & ",
    "  mask = None\n  if mask is not None:\n    m = m & ",
    ["tests/flax/test_flax_modules.py"],
  ),
  (
    "explicit positions offset twice while decoding (_flax/modules)",
    "jattn/_flax/modules.py",
    "  return jnp.broadcast_to(positions.astype(jnp.int32), (B, L))",
    "  positions = positions.astype(jnp.int32)\n  if offset is not None:\n    positions = offset.astype(jnp.int32)[:, None] + positions\n  return jnp.broadcast_to(positions, (B, L))",
    ["tests/flax/test_flax_modules.py"],
  ),
  (
    "score_mod ignored by diagnostics",
    "jattn/diagnostics.py",
    "  cfg, score_args = s.config((B, N, bq, bk))",
    "  cfg, score_args = dataclasses.replace(\n      s, opts=dataclasses.replace(s.opts, score_mod=None)).config((B, N, bq, bk))",
    ["tests/attention/test_diagnostics.py"],
  ),
  (
    "head index dropped from the dropout hash",
    "jattn/_dropout.py",
    "  x = _mix(x ^ u(h) + seed[1])",
    "  x = _mix(x ^ u(0 * h) + seed[1])",
    [
      "tests/attention/test_attention.py",
      "tests/properties/test_matrix.py",
      "tests/flax/test_flax_modules.py",
    ],
  ),
  # Issue #41: guarded by the tests named (node ids: only those run).
  (
    "paged/quantised cache: fill level clamped to capacity - 1 (_flax/modules)",
    "jattn/_flax/modules.py",
    "    jnp.minimum(index + T, capacity),",
    "    jnp.minimum(index + T, capacity - 1),",
    ["tests/flax/test_flax_modules.py::test_cache_decoded_token_by_token_to_its_last_slot"],
  ),
  (
    "make_attention_fn: output shaped with the query's head size, not value's (_flax/attention_fn)",
    "jattn/_flax/attention_fn.py",
    "    return out.reshape(query.shape[:-1] + (value.shape[-1],))",
    "    return out.reshape(query.shape)",
    ["tests/flax/test_flax_attention_fn.py::test_value_head_size_of_its_own_against_reference"],
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
      "tests/attention/test_positions.py::test_every_example_at_positions_of_its_own",
      "tests/attention/test_positions.py::test_block_states_of_every_example_are_sound",
    ],
  ),
  # Issue #52: the three regressions and the seven bugs the last suite let through.
  (
    "vmap: the block map broadcast with the batch in the tangent primitive (_derivatives)",
    "jattn/_derivatives.py",
    "  mapped = tuple(d is not None for d in dims[:n])",
    "  primal = [jnp.broadcast_to(x, (size, *x.shape)) if d is None else x"
    " for x, d in zip(primal, dims[:n])]\n  mapped = (True,) * n",
    ["tests/attention/test_structure.py::test_vmapped_causal_gradients_keep_block_skipping"],
  ),
  (
    "write_pages: NumPy pools kept as NumPy arrays (_paged/write)",
    "jattn/_paged/write.py",
    '  pages = jnp.asarray(_validation.as_array("key_pages", pool.key_pages, "an array of pages"))',
    '  pages = _validation.as_array("key_pages", pool.key_pages, "an array of pages")',
    ["tests/paged/test_write_pages.py", "tests/properties/test_x64.py"],
  ),
  (
    "x64: the paged tiles' sums and loop bounds left as computed (int64 meets int32) (_paged)",
    "jattn/_paged/walk.py",
    (
      (
        "    lo, hi = first.min().astype(jnp.int32), last.max().astype(jnp.int32)",
        "    lo, hi = first.min(), last.max()",
      ),
      (
        "jattn/_paged/tiles.py",
        "per_seq[None, :], 0).sum(axis=1, dtype=jnp.int32)",
        "per_seq[None, :], 0).sum(axis=1)",
      ),
    ),
    None,
    ["tests/properties/test_x64.py"],
  ),
  (
    "x64: splash's kernels traced with x64 on (_backends/splash)",
    "jattn/_backends/splash.py",
    "    int32=True,  # Mosaic: no int64 in the kernels' index arithmetic under jax_enable_x64",
    "    int32=False,",
    ["tests/properties/test_x64.py"],
  ),
  (
    "per-token scales: tokens divided by the scale before it is rounded to its dtype (_paged/write)",
    "jattn/_paged/write.py",
    "    scale = jnp.where(amax > 0, amax / top, jnp.ones((), jnp.float32)).astype(scale_dtype)\n"
    "  y = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)[..., None]",
    "    exact = jnp.where(amax > 0, amax / top, jnp.ones((), jnp.float32))\n"
    "    scale = exact.astype(scale_dtype)\n"
    "    y = x.astype(jnp.float32) / exact[..., None]\n"
    "  else:\n"
    "    y = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)[..., None]",
    ["tests/paged/test_write_pages.py", "tests/flax/test_flax_modules.py"],
  ),
  (
    "write_pages: a traced faulty sequence's tokens still written (_paged/metadata.owners)",
    "jattn/_paged/metadata.py",
    (
      ("  own = mine & ~faulty[None, :]", "  own = mine"),
      ("    live = ~faulty[seq] & (within >= 0)", "    live = within >= 0"),
    ),
    None,
    ["tests/paged/test_write_pages.py"],
  ),
  (
    "write_pages: ragged padding rows written as sequence 0's tokens (_paged/metadata.owners)",
    "jattn/_paged/metadata.py",
    "  live = own.any(axis=1)",
    "  live = xp.ones(own.shape[:1], bool)",
    ["tests/paged/test_write_pages.py"],
  ),
  (
    "parallel schedule: the merge order never holds a part (_chunked/plan.merge_order)",
    "jattn/_chunked/plan.py",
    "      hold[v, ends[0]] = True",
    "      pass",
    ["tests/properties/test_batch_invariance.py"],
  ),
  (
    "tree mask: the key range cut at the rows' depth positions, not their slots (_paged/tiles)",
    "jattn/_paged/tiles.py",
    "    lo = jnp.where(some, jnp.minimum(lo, first_new), lo)\n"
    "    hi = jnp.where(some, kv_lengths[seq], hi)\n",
    "",
    ["tests/paged/test_paged_tree.py"],
  ),
  (
    "forward mode: the sinks' tangent dropped (_chunked/tangent)",
    "jattn/_chunked/tangent.py",
    "      dlse0 = jnp.exp(sink - lse_b) * dot.sink.astype(sd)",
    "      dlse0 = jnp.exp(sink - lse_b) * jnp.zeros_like(dot.sink).astype(sd)",
    ["tests/attention/test_transforms.py"],
  ),
  (
    "forward mode: dropout's 1 / (1 - rate) dropped (_chunked/tangent)",
    "jattn/_chunked/tangent.py",
    "      acc = acc * jnp.asarray(1.0 / (1.0 - cfg.dropout_rate), sd)",
    "      acc = acc * jnp.asarray(1.0, sd)",
    ["tests/attention/test_transforms.py"],
  ),
  # Issue #51: the traps a new user hit.
  (
    "make_attention_fn: top-left causality against flax's decode cache not refused (_flax/attention_fn)",
    "jattn/_flax/attention_fn.py",
    "    _refuse_top_left_decoding(causal_option, query.shape[-3], key.shape[-3])\n",
    "",
    ["tests/flax/test_flax_attention_fn.py"],
  ),
  (
    "write_pages: new_lengths ignored, left padding written over the cache (_paged/metadata.owners)",
    "jattn/_paged/metadata.py",
    "      within, count = within - first[seq], new_lengths.astype(i32)\n",
    "",
    ["tests/paged/test_write_pages.py"],
  ),
  (
    "fused kernels: forward mode's tangent dropped (_derivatives)",
    "jattn/_derivatives.py",
    "    _, d_outs = jax.jvp(f, (leaves,), (list(dots),))",
    "    _, d_outs = jax.jvp(f, (leaves,), ([d * 0 for d in dots],))",
    ["tests/attention/test_transforms.py"],
  ),
  (
    "paged_attention: B = 0 runs the planned walk (_paged/run)",
    "jattn/_paged/run.py",
    "  if concrete(st.B) and st.B * st.rows == 0:",
    "  if False:",
    ["tests/attention/test_empty.py"],
  ),
  (
    "sparse: a traced repeated block counted twice (_backends/sparse)",
    "jattn/_backends/sparse.py",
    "  valid = (c >= 0) & (c < geo.num_blocks) & first",
    "  valid = (c >= 0) & (c < geo.num_blocks)",
    ["tests/attention/test_sparse.py"],
  ),
  (
    "sparse: a block's dK/dV total carried into the next block (_backends/sparse)",
    "jattn/_backends/sparse.py",
    "    return (jnp.where(done, zero, acc_k), jnp.where(done, zero, acc_v), dq, dk, dv)",
    "    return (acc_k, acc_v, dq, dk, dv)",
    ["tests/attention/test_sparse.py"],
  ),
  (
    "sparse: a block's dK/dV from its chunks of 128 overwrite those of 512 (_backends/sparse)",
    "jattn/_backends/sparse.py",
    "      buf, jnp.where(done, old(buf) + acc, old(buf)), at, 0",
    "      buf, jnp.where(done, acc, old(buf)), at, 0",
    ["tests/attention/test_sparse.py"],
  ),
  (
    "paged key_selection: a traced repeated block read twice (_paged/selected)",
    "jattn/_paged/selected.py",
    "  ok = (chosen >= 0) & (chosen < blocks) & first",
    "  ok = (chosen >= 0) & (chosen < blocks)",
    ["tests/paged/test_paged_selection.py"],
  ),
  (
    "sparse: the forward's accumulator not rescaled when a chunk raises a row's max "
    "(_backends/sparse)",
    "jattn/_backends/sparse.py",
    "    acc_n = acc_o * a[..., None] + pv * b[..., None]",
    "    acc_n = acc_o + pv * b[..., None]",
    ["tests/attention/test_sparse.py"],
  ),
  (
    "sparse: two chunks a step, the second merged though past the loop's end (_backends/sparse)",
    "jattn/_backends/sparse.py",
    "          carry = jax.lax.cond(use, later, lambda c: c, carry)",
    "          carry = later(carry)",
    ["tests/attention/test_sparse.py"],
  ),
  (
    "no keys (S = 0): a sink's row given the empty row's lse, not the sink's (_dispatch)",
    "jattn/_dispatch.py",
    "    if call.sink is None:",
    "    if True:",
    ["tests/attention/test_empty.py"],
  ),
]


def edits(path, old, new):
  """A mutation's replacements as (file, old, new): one, or several (``old`` a tuple of (old, new)
  pairs in ``path``, or of (file, old, new) where one bug spans files). The runner below and
  tests/tooling/test_code_shape.py both read them so."""
  pairs = old if isinstance(old, tuple) else ((old, new),)
  return [(e[0] if len(e) == 3 else path, *e[-2:]) for e in pairs]


only = sys.argv[2:]
survivors: list[str] = []
for i, (name, path, old, new, tests) in enumerate(MUTATIONS):
  if only and str(i) not in only:
    continue
  sources: dict[pathlib.Path, str] = {}  # each file as it was, restored whatever happens
  try:
    for file, a, b in edits(path, old, new):
      f = ROOT / file
      sources.setdefault(f, f.read_text())
      mutated = f.read_text()  # with this mutation's earlier edits in it
      assert mutated.count(a) == 1, (name, a, mutated.count(a))
      f.write_text(mutated.replace(a, b))
    r = subprocess.run(
      [PY, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", *tests],
      cwd=ROOT,
      capture_output=True,
      text=True,
    )
    failed = [l.split(" ")[1] for l in r.stdout.splitlines() if l.startswith(("FAILED", "ERROR"))]
    verdict = "caught" if r.returncode != 0 else "SURVIVED"
    if r.returncode == 0:
      survivors.append(name)
    print(f"== [{i}] {name}: {verdict}, {len(failed)} failed", flush=True)
    for l in failed[:12]:
      print("   ", l)
  finally:
    for f, src in sources.items():
      f.write_text(src)
print(f"{len(survivors)} survived" + (": " + "; ".join(survivors) if survivors else ""))
sys.exit(1 if survivors else 0)
