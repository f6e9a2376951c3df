"""Structure of the chunked implementation: O(T) memory, hidden blocks really skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jattn
from jattn import masks as M
from jattn._chunked import blocks as chunked_blocks
from jattn._chunked import plan as _plan


def _compiled_temp_bytes(fn, *args):
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def _shapes(T, N=2, H=16):
  return (jax.ShapeDtypeStruct((1, T, N, H), jnp.float32),) * 3


@pytest.mark.parametrize("backward", [False, True])
def test_memory_grows_linearly(backward):
  def make(impl):
    def f(q, k, v):
      return jattn.dot_product_attention(q, k, v, implementation=impl, block_q=128, block_kv=128)

    if backward:
      return lambda q, k, v: jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
    return f

  # From T = 2048: below it XLA's buffer reuse shifts the constant and hides the slope.
  temps = {
    impl: [_compiled_temp_bytes(make(impl), *_shapes(T)) for T in (2048, 4096, 8192)]
    for impl in ("chunked", "dense")
  }
  ch, de = temps["chunked"], temps["dense"]
  # Doubling T doubles chunked memory (plus a constant), and quadruples dense's.
  assert ch[2] - ch[1] <= 2.2 * (ch[1] - ch[0]) + 4096, ch
  assert ch[2] <= 2.3 * ch[1], ch
  assert de[2] >= 3.5 * de[1], de
  # At T = 8192 (N=2, H=16) chunked needs a small multiple of one (B, T, N, H) input.
  one_input = 8192 * 2 * 16 * 4
  assert ch[2] <= 12 * one_input, (ch[2], one_input)
  assert ch[2] * 10 < de[2]


class _Recorder:
  """{pass: {(i, j): state}} of the tiles computed, EMPTY ones (the parallel schedule's padding
  steps, fully masked) left out; ``repeats`` lists any tile computed twice in one pass."""

  def __init__(self):
    self.blocks = {"fwd": {}, "bwd": {}, "bwd_dq": {}}
    self.repeats = []

  def __call__(self, pass_name, i, j, state):
    if state == M.EMPTY:
      return
    if (i, j) in self.blocks[pass_name]:
      self.repeats.append((pass_name, i, j))
    self.blocks[pass_name][(i, j)] = state


def _run_recorded(T, S, bq, bk, **kwargs):
  jax.clear_caches()  # the hook is read at trace time
  kwargs.setdefault("schedule", "serial")
  rec = _Recorder()
  chunked_blocks._BLOCK_HOOK = rec
  try:
    # Only the blocks are looked at: any values (NumPy's: no program compiled for them after the
    # caches are cleared).
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, T, 2, 8), np.float32)
    k = rng.standard_normal((2, S, 2, 8), np.float32)
    f = lambda q, k: jattn.dot_product_attention(
      q, k, k, implementation="chunked", block_q=bq, block_kv=bk, **kwargs
    ).sum()
    # Forward and backward traced once each, compiled as one program.
    jax.block_until_ready(jax.jit(jax.grad(f, argnums=(0, 1)))(q, k))
    jax.effects_barrier()
  finally:
    chunked_blocks._BLOCK_HOOK = None
    jax.clear_caches()
  assert not rec.repeats, rec.repeats
  return rec.blocks


def _expected_blocks(vis, bq, bk):
  """From the dense (B, N, T, S) mask: {(i, j): state} for every non-empty block."""
  T, S = vis.shape[-2:]
  out = {}
  for i in range(-(-T // bq)):
    for j in range(-(-S // bk)):
      blk = vis[..., i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
      if blk.any():
        ragged = (j + 1) * bk > S
        out[(i, j)] = M.FULL if blk.all() and not ragged else M.PARTIAL
  return out


def _dense_vis(T, S, **kwargs):
  import reference as ref

  return ref.visible_mask(2, 2, T, S, **kwargs)


@pytest.mark.parametrize(
  "T,S,bq,bk,schedule",
  [
    (64, 64, 16, 16, "serial"),
    (50, 70, 16, 8, "serial"),
    (70, 50, 8, 16, "serial"),
    (64, 64, 16, 16, "parallel"),
    (70, 50, 8, 16, "parallel"),
  ],
)
def test_causal_blocks_skipped_exactly(T, S, bq, bk, schedule):
  # Every pass computes each non-empty block once and no other block (the parallel schedule's
  # padding steps are fully masked EMPTY tiles, not counted). The state is the branch the serial
  # walk takes; for the parallel schedule, the state its block list holds (it masks every tile
  # of a call that has a PARTIAL block or padding lanes). The parallel backward is two passes
  # (dK/dV by key blocks, dQ by query blocks), each over the whole map; its lanes run 3 per step
  # here (groups, padding lanes).
  blocks = _run_recorded(
    T,
    S,
    bq,
    bk,
    is_causal=True,
    schedule=schedule,
    step_width=3 if schedule == "parallel" else None,
  )
  want = _expected_blocks(_dense_vis(T, S, causal="top_left"), bq, bk)
  assert blocks["fwd"] == want
  assert blocks["bwd"] == want
  assert blocks["bwd_dq"] == (want if schedule == "parallel" else {})


def test_diagnostics_walk_the_kernels_blocks():
  # diagnostics' chunked pass runs on the forward kernel's own block walk: the same blocks are
  # computed (none the mask hides), with the same FULL / PARTIAL variants.
  jax.clear_caches()
  rec = _Recorder()
  rec.blocks["stats"] = {}
  chunked_blocks._BLOCK_HOOK = rec
  try:
    q = jax.random.normal(jax.random.key(0), (2, 50, 2, 8))
    k = jax.random.normal(jax.random.key(1), (2, 70, 2, 8))
    st = jattn.diagnostics.attention_stats(
      q,
      k,
      is_causal="bottom_right",
      local_window_size=(30, 0),
      implementation="chunked",
      block_q=16,
      block_kv=8,
    )
    jax.block_until_ready(st)
    jax.effects_barrier()
  finally:
    chunked_blocks._BLOCK_HOOK = None
    jax.clear_caches()
  want = _expected_blocks(_dense_vis(50, 70, causal="bottom_right", window=(30, 0)), 16, 8)
  assert rec.blocks["stats"] == want
  assert rec.blocks["fwd"] == {} and rec.blocks["bwd"] == {}


def test_window_blocks_skipped_exactly():
  blocks = _run_recorded(128, 128, 16, 16, is_causal=True, local_window_size=(20, 0))
  want = _expected_blocks(_dense_vis(128, 128, causal="top_left", window=(20, 0)), 16, 16)
  assert blocks["fwd"] == want and blocks["bwd"] == want
  # Work proportional to T x window: 8 rows of at most 3 blocks.
  assert len(want) <= 8 * 3


def test_lengths_blocks_skipped():
  lens = np.array([20, 33])
  blocks = _run_recorded(48, 64, 16, 16, key_value_seq_lengths=jnp.asarray(lens, jnp.int32))
  want = _expected_blocks(_dense_vis(48, 64, kv_lengths=lens), 16, 16)
  assert blocks["fwd"] == want and blocks["bwd"] == want
  assert all(j <= 2 for (_, j) in blocks["fwd"])


def test_packed_segments_blocks_skipped():
  q_seg = np.repeat(np.arange(4), 16)[None].repeat(2, 0)  # four 16-token documents
  blocks = _run_recorded(
    64,
    64,
    16,
    16,
    q_segment_ids=jnp.asarray(q_seg, jnp.int32),
    kv_segment_ids=jnp.asarray(q_seg, jnp.int32),
  )
  assert blocks["fwd"] == {(i, i): M.FULL for i in range(4)}
  assert blocks["bwd"] == blocks["fwd"]


def _ranges_by_hand(states):
  """[first, last + 1) of each row's non-EMPTY columns, (0, 0) for an all-EMPTY row."""
  out = []
  for row in states:
    cols = [j for j, x in enumerate(row) if x != M.EMPTY]
    out.append((cols[0], cols[-1] + 1) if cols else (0, 0))
  return tuple(out)


def test_loop_bounds_static_and_run_time_equal_a_hand_count():
  # A block map known at trace time gives the loops constant bounds; a run-time map computes
  # them in the program. Both must be each row's first and last non-empty block, empty rows
  # (and a map with no non-empty block at all) included.
  rng = np.random.default_rng(0)
  maps = [
    rng.choice([M.EMPTY, M.PARTIAL, M.FULL], size=(5, 7), p=[0.6, 0.2, 0.2]) for _ in range(20)
  ]
  maps += [np.full((3, 4), M.EMPTY), np.full((1, 1), M.FULL), np.eye(4) * M.FULL]
  nonempty_range = jax.jit(_plan.nonempty_range)  # a program per shape, not per operation
  for states in maps:
    states = np.asarray(states, np.int8)
    want = _ranges_by_hand(states)
    assert _plan.static_ranges(states) == want
    lo, hi = nonempty_range(jnp.asarray(states))
    assert tuple(zip(np.asarray(lo).tolist(), np.asarray(hi).tolist())) == want


def test_block_lists_static_and_run_time_equal_a_hand_count():
  # Each row's non-empty blocks in order, padded with its last one (state EMPTY): static maps
  # give NumPy lists as long as the longest row, run-time maps jax lists of the full width.
  rng = np.random.default_rng(1)
  maps = [
    rng.choice([M.EMPTY, M.PARTIAL, M.FULL], size=(5, 7), p=[0.5, 0.25, 0.25]) for _ in range(20)
  ]
  maps += [np.full((3, 4), M.EMPTY), np.full((1, 1), M.FULL), np.tril(np.full((4, 4), M.FULL))]
  run_time = jax.jit(_plan.block_lists)  # a program per shape, not per operation
  for states in maps:
    states = np.asarray(states, np.int8)
    rows = [[j for j, x in enumerate(row) if x != M.EMPTY] for row in states]
    for xp_states in (states, jnp.asarray(states)):
      lists = _plan.block_lists if isinstance(xp_states, np.ndarray) else run_time
      columns, kinds, counts = (np.asarray(a) for a in lists(xp_states))
      static = isinstance(xp_states, np.ndarray)
      L = max(max(len(r) for r in rows), 1) if static else states.shape[1]
      assert columns.shape == kinds.shape == (states.shape[0], L)
      assert counts.tolist() == [len(r) for r in rows]
      for i, r in enumerate(rows):
        pad = r[-1] if r else 0
        assert columns[i].tolist() == r + [pad] * (L - len(r))
        assert kinds[i].tolist() == [int(states[i, j]) for j in r] + [M.EMPTY] * (L - len(r))


def test_unsorted_segments_against_reference_and_blocks():
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 3, (2, 40))
  q = jax.random.normal(jax.random.key(0), (2, 40, 2, 8))
  kw = dict(q_segment_ids=jnp.asarray(ids, jnp.int32), kv_segment_ids=jnp.asarray(ids, jnp.int32))
  got = jattn.dot_product_attention(q, q, q, implementation="chunked", block_q=8, block_kv=8, **kw)
  want, _, _ = ref.attention(q, q, q, visible=ref.visible_mask(2, 2, 40, 40, q_seg=ids, kv_seg=ids))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Unsorted ids make every block PARTIAL (never FULL, never skipped): no block is run as FULL.
  blocks = _run_recorded(40, 40, 8, 8, **kw)
  assert blocks["fwd"] == _expected_blocks(_dense_vis(40, 40, q_seg=ids, kv_seg=ids), 8, 8)


def test_cost_analysis_has_no_dense_score_matrix():
  # XLA's cost analysis of the chunked forward counts FLOPs of one tile per loop body: far below
  # the dense count. It would be equal if the kernel formed the (T, S) scores.
  T = 2048
  dense = jax.jit(lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="dense"))
  chunk = jax.jit(
    lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation="chunked", block_q=256, block_kv=256
    )
  )
  args = _shapes(T)
  fd = dense.lower(*args).compile().cost_analysis()["flops"]
  fc = chunk.lower(*args).compile().cost_analysis()["flops"]
  assert fc < fd / 8


def test_memory_at_16k_is_a_few_inputs_and_a_tenth_of_dense():
  # The figure: T = S = 16384, B=1, N=8, H=64, float32, forward+backward, default blocks.
  # Compiling is enough: XLA's memory analysis reads the buffer assignment, nothing is allocated.
  T = 16384
  args = (jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32),) * 3

  def fwd_bwd(impl):
    f = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation=impl)
    return jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))

  chunked = _compiled_temp_bytes(fwd_bwd("chunked"), *args)
  dense = _compiled_temp_bytes(fwd_bwd("dense"), *args)
  one_input = T * 8 * 64 * 4
  assert chunked < 8 * one_input, chunked / one_input
  assert chunked < dense / 10, (chunked, dense)


@pytest.mark.parametrize(
  "width,causal,lengths",
  [
    (1, False, True),
    (2, True, True),
    (3, False, True),
    (None, True, True),
    (1, True, False),
    (3, True, False),
    (None, True, False),
  ],
)
def test_parallel_schedule_step_widths_against_reference(width, causal, lengths):
  # The parallel schedule with 1, 2, 3 or all lanes per step (7 query blocks, 9 key blocks:
  # groups that do not divide the lanes leave padding lanes) equals the float64 reference:
  # output and the gradients of q, k, v, a full bias and the sinks, with lengths (a run-time map,
  # one part per lane) or without (a static map: lanes that run several rows' parts one after
  # another, and rows cut over lanes), a window, soft cap and dropout.
  from dropout_reference import keep_mask

  B, T, S, N, K, H = 2, 50, 70, 4, 2, 8
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (B, T, N, H))
  k = jax.random.normal(keys[1], (B, S, K, H))
  v = jax.random.normal(keys[2], (B, S, K, H))
  do = jax.random.normal(keys[3], (B, T, N, H))
  bias = jax.random.normal(keys[4], (B, N, T, S))
  sinks = jnp.linspace(-1.0, 1.0, N)
  rng, rate = jax.random.key(9), 0.2
  lens = np.array([S, 33])
  kw = dict(logits_soft_cap=5.0, dropout_rate=rate, dropout_rng=rng)
  vis_kw = {}
  if lengths:
    kw.update(key_value_seq_lengths=jnp.asarray(lens, jnp.int32))
    vis_kw.update(kv_lengths=lens)
  if causal:
    kw.update(is_causal="bottom_right", local_window_size=(25, 0))
    vis_kw.update(causal="bottom_right", window=(25, 0))

  def f(q, k, v, bias, sinks):
    return jattn.dot_product_attention(
      q,
      k,
      v,
      bias,
      implementation="chunked",
      schedule="parallel",
      step_width=width,
      block_q=8,
      block_kv=8,
      sinks=sinks,
      **kw,
    )

  # Forward and backward in one compiled program.
  got = jax.jit(lambda *a: (lambda out, pull: (out,) + pull(do))(*jax.vjp(f, *a)))(
    q, k, v, bias, sinks
  )
  want_out, _, cache = ref.attention(
    q,
    k,
    v,
    visible=ref.visible_mask(B, N, T, S, **vis_kw),
    bias=bias,
    soft_cap=5.0,
    sinks=sinks,
    keep=keep_mask(rng, rate, B, N, T, S),
    dropout_rate=rate,
  )
  want = (want_out,) + tuple(ref.grads(cache, do, bias_shape=bias.shape))
  for name, a, b in zip(("out", "dq", "dk", "dv", "dbias", "dsinks"), got, want):
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(
      np.asarray(a) / scale,
      np.asarray(b) / scale,
      atol=2e-5,
      err_msg=f"{name} width={width} causal={causal} {lengths=}",
    )


@pytest.mark.parametrize(
  "name",
  [
    "causal",
    "bottom_right",
    "window",
    "chunked_local",
    "prefix_lm",
    "random",
    "empty_rows",
    "nothing",
  ],
)
@pytest.mark.parametrize("min_lanes", [1, 4])
def test_lanes_cover_every_nonempty_block_once_at_the_depth(name, min_lanes):
  # The parallel schedule's lanes (`_plan.lanes`) over a static block map: every non-empty
  # block exactly once, in its row's order within a lane; padding only in the last lane
  # (tiles <= non-empty + L - 1); L = ceil(non-empty / max(rows, min_lanes)); a lane's parts
  # restart where its row changes and each part is merged into its row once (emit / final).
  R, C = 12, 20
  r, c = np.arange(R)[:, None], np.arange(C)[None, :]
  rng = np.random.default_rng(0)
  vis = {
    "causal": c <= 2 * r + 1,
    "bottom_right": c <= 2 * r + 8,
    "window": (c <= 2 * r + 1) & (c >= 2 * r - 4),
    "chunked_local": (c // 5) == (r // 3),
    "prefix_lm": (c <= 2 * r + 1) | (c < 6),
    "random": rng.random((R, C)) < 0.3,
    "empty_rows": (r % 3 == 0) & (c < 7),
    "nothing": np.zeros((R, C), bool),
  }[name]
  states = np.where(vis, M.FULL, M.EMPTY).astype(np.int8)
  ln = _plan.lanes(states, min_lanes)
  total = int(vis.sum())
  V, L = ln.columns.shape
  assert L == max(1, -(-total // max(R, min_lanes)))
  live = ln.kinds != M.EMPTY
  assert live.sum() == total and V * L <= total + L - 1 + (total == 0)
  assert not (~live[:-1]).any()  # every lane but the last is full
  got = sorted(zip(ln.rows[live].tolist(), ln.columns[live].tolist()))
  assert got == sorted(zip(*np.nonzero(vis)))
  # Parts: a row's blocks within a lane are one run in column order; the step before a start
  # (and the lane's end) merges the part into its row.
  ends = np.zeros((V, L), bool)
  ends[:, :-1] = ln.starts[:, 1:]
  assert (
    ln.starts == np.concatenate([np.zeros((V, 1), bool), ln.rows[:, 1:] != ln.rows[:, :-1]], axis=1)
  ).all()
  np.testing.assert_array_equal(ln.emit, np.where(ends, ln.rows, R))
  np.testing.assert_array_equal(ln.final, ln.rows[:, -1] if total else np.full(V, R))
  for v in range(V):
    for row in set(ln.rows[v][live[v]].tolist()):
      cols = ln.columns[v][live[v] & (ln.rows[v] == row)]
      assert (np.diff(cols) > 0).all()


def test_parallel_causal_at_a_size_that_crashed_jaxlib_0_10():
  # Merging a causal call's split lanes through a gather segfaulted jaxlib 0.10's CPU runtime at
  # B >= 2, N = 8 (the merge is a scatter-add now); the result must equal the serial schedule.
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (4, 1024, 8, 64)) for key in keys)
  run = lambda s: jattn.dot_product_attention(
    q, k, v, implementation="chunked", is_causal=True, schedule=s
  )
  np.testing.assert_allclose(run("parallel"), run("serial"), rtol=2e-5, atol=2e-5)
