"""Reading a compiled program's loop structure, and lowering for an accelerator from this CPU.

`jattn.bench.structure` counts sequential loop steps from the optimized HLO; these tests pin it
on programs whose counts are known by construction, then on jattn's chunked kernel lowered for
``cuda`` and ``tpu`` with jax.export (what an accelerator would run), and check that the exported
program, run here, computes what jattn computes.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from programs import equations

import jattn
from jattn.bench import structure

X = jax.ShapeDtypeStruct((8,), jnp.float32)


def _steps(fn, *args, platform=None):
  return structure.loop_structure(structure.lowered_for(fn, args, platform))


def test_counts_nested_sequential_and_run_time_loops():
  def nested(x):  # 3 outer steps, each running 5 inner steps: 15 steps of the inner body
    inner = lambda i, y: jnp.sin(y) * 1.01 + i
    return jax.lax.fori_loop(0, 3, lambda i, y: jax.lax.fori_loop(0, 5, inner, y) + 1.0, x)

  def sequential(x):  # 3 steps, then 4 more
    x = jax.lax.fori_loop(0, 3, lambda i, y: jnp.sin(y) + i, x)
    return jax.lax.fori_loop(0, 4, lambda i, y: jnp.cos(y) * i, x)

  def run_time(x, n):  # the trip count is only known when it runs
    return jax.lax.fori_loop(0, n, lambda i, y: jnp.sin(y), x)

  st = _steps(nested, X)
  assert (st.steps, st.loops) == (15, 2)
  assert st.ops_per_step >= 1
  st = _steps(sequential, X)
  assert (st.steps, st.loops) == (7, 2)
  st = _steps(run_time, X, jax.ShapeDtypeStruct((), jnp.int32))
  assert st.steps is None and st.loops == 1
  st = _steps(lambda x: jnp.sin(x) * 2, X)
  assert (st.steps, st.loops, st.ops_per_step) == (0, 0, 0) and st.ops >= 1


_EXPANDED_SCATTER = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %t = (s32[], f32[8]{0}) tuple(%p)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %i = s32[] constant(0)
  %t = (s32[], f32[8]{0}) tuple(%i, %x)
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, metadata={op_name="jit(f)/while/body/scatter-add" source_file="x.py"}, backend_config={"known_trip_count":{"n":"8"}}
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_a_scatter_that_xla_turned_into_a_loop_is_not_a_step():
  # XLA's CPU backend may expand a scatter (or gather, sort) into a while loop that an
  # accelerator's program does not have (jaxlib 0.10 without fusion emitters, as conftest runs
  # the suite, does so for every scatter): it is one op of the program, not 8 steps.
  st = structure.loop_structure(_EXPANDED_SCATTER)
  assert (st.steps, st.loops) == (0, 0)
  st = structure.loop_structure(_EXPANDED_SCATTER.replace("/scatter-add", "/while"))
  assert (st.steps, st.loops) == (8, 1)

  def scatter_in_loop(x):  # 3 steps, each with a scatter-add
    idx = jnp.array([0, 2, 2, 5])
    return jax.lax.fori_loop(0, 3, lambda i, y: y.at[idx].add(jnp.sin(y[:4])), x)

  st = _steps(scatter_in_loop, X)
  assert (st.steps, st.loops) == (3, 1)


def _largest_array(hlo):
  """Elements of the largest array any instruction of the program produces."""
  sizes = [
    int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    for dims in re.findall(r"(?:f32|bf16|f16|s32|pred|u32|s8)\[([\d,]*)\]", hlo)
  ]
  return max(sizes)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_chunked_lowered_for_an_accelerator(platform):
  # What a GPU or TPU gets from implementation="chunked" (schedule=None picks per platform where
  # the program is lowered): the parallel schedule. At T = S = 8192 with the default 512 x 256
  # blocks: forward one step per key block (<= S / 128), forward+backward two more passes
  # (<= 3 S / 128), causal about half of that, and no array of T x S elements anywhere.
  # The same programs' work against the mask's: _check_lanes_compute_the_work_the_mask_leaves.
  T, N, H = 8192, 4, 64
  args = (jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16),) * 3
  hlos = {}
  masks = {
    "full": {},
    "causal": dict(is_causal=True),
    "window": dict(is_causal=True, local_window_size=(1024, 0)),
  }
  for name, kw in masks.items():
    f = lambda q, k, v, kw=kw: jattn.dot_product_attention(q, k, v, implementation="chunked", **kw)
    g = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    for pass_, fn in (("fwd", f), ("fwd+bwd", g)):
      hlos[name, pass_] = structure.lowered_for(fn, args, platform)
  steps = {}
  for causal in (False, True):
    for name in ("fwd", "fwd+bwd"):
      hlo = hlos["causal" if causal else "full", name]
      steps[name, causal] = structure.loop_structure(hlo).steps
      assert _largest_array(hlo) < T * T, (name, causal)
  assert steps["fwd", False] == T // 256 <= T // 128
  assert steps["fwd+bwd", False] == T // 256 + T // 512 + T // 256 <= 3 * T // 128
  for name in ("fwd", "fwd+bwd"):
    assert 0.45 <= steps[name, True] / steps[name, False] <= 0.6, steps
  # The CPU keeps the serial schedule: (T / 512) x (S / 256) steps, one tile each.
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="chunked")
  assert _steps(f, *args).steps == (T // 512) * (T // 256)
  _check_lanes_compute_the_work_the_mask_leaves(hlos, T, N, H)


def test_exported_program_runs_here_and_equals_jattn():
  # The program exported for cuda, compiled for this CPU with the platform check off, gives
  # jattn's CPU result (the accelerator program is the one tested, not a look-alike).
  from jax import export

  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, 1024, 2, 32), jnp.float32) for key in keys)
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, implementation="chunked", is_causal=True, block_q=256, block_kv=128
  )
  exp = export.export(
    jax.jit(f), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.platform()]
  )(q, k, v)
  np.testing.assert_allclose(exp.call(q, k, v), f(q, k, v), rtol=1e-6, atol=1e-6)


def test_implementation_none_per_platform():
  # implementation=None is decided where the program is lowered: the CPU's rule (dense below
  # T x S = 2^20, chunked and serial above) and the accelerators' (their fused kernel first where
  # it takes the call, see test_implementations.py; then dense while the (B, N, T, S) float32
  # scores fit 256 MiB, chunked and parallel beyond).
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v)
  small = (jax.ShapeDtypeStruct((1, 4096, 4, 64), jnp.bfloat16),) * 3  # 256 MiB of scores
  big = (jax.ShapeDtypeStruct((8, 4096, 16, 64), jnp.bfloat16),) * 3  # 8 GiB of scores
  assert _steps(f, *small).steps == (4096 // 512) * (4096 // 256)  # CPU: chunked, serial
  # cuda: no GPU here to trace cuDNN with, so the rule's dense (no loop); a TPU program gets
  # splash (not compilable on this CPU, see test_implementations.py).
  assert _steps(f, *small, platform="cuda").loops == 0
  # GPU: chunked, parallel (a TPU program gets splash here: not compilable on this CPU). A step
  # holds 8 x 16 (B x N) tiles per lane; the 256 MiB step budget fits one lane, so the 8 rows of
  # blocks run one after another; step_width=8 runs them side by side.
  assert _steps(f, *big, platform="cuda").steps == 8 * (4096 // 256)
  wide = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, implementation="chunked", step_width=8
  )
  assert _steps(wide, *big, platform="cuda").steps == 4096 // 256


def _check_lanes_compute_the_work_the_mask_leaves(hlos, T, N, H):
  # The work the accelerator program does, read from it: every matmul's FLOPs times how often
  # it runs (loop trip counts), against the mask's non-empty tiles' matmuls. T = S = 8192,
  # default 512 x 256 blocks: the causal program does ~0.53x the unmasked one's work forward
  # and forward+backward (not the 0.8x of lanes padded to the depth), a causal window of 1024
  # within 1.15x of its non-empty tiles, at the depth of before (17 / 43 steps). (Read from
  # test_chunked_lowered_for_an_accelerator's programs: lowering them is that test's cost.)
  from jattn._chunked import plan as _plan

  got = {
    key: (structure.matmul_flops(hlo), structure.loop_structure(hlo).steps)
    for key, hlo in hlos.items()
  }
  for pass_ in ("fwd", "fwd+bwd"):
    assert got["causal", pass_][0] <= 0.6 * got["full", pass_][0], got
  assert (got["causal", "fwd"][1], got["causal", "fwd+bwd"][1]) == (17, 43), got
  assert (got["full", "fwd"][1], got["full", "fwd+bwd"][1]) == (32, 80), got
  # The window's non-empty tiles, from its block map; per tile the forward's 2 matmuls, the
  # backward's 7 (two passes, each recomputing P).
  mask = jattn.masks.from_arguments((1, N, T, T), causal="top_left", window=(1024, 0))
  grid = jattn.masks.BlockGrid(T, T, 512, 256)
  states, _ = _plan.block_map_and_kinds(mask, grid, (1, N, T, T))
  tiles = int((np.asarray(states) != jattn.masks.EMPTY).sum())
  tile = 2 * 2 * N * 512 * 256 * H  # 2 matmuls of 2 FLOPs per multiply-add
  assert got["window", "fwd"][0] <= 1.15 * tiles * tile, (got["window"], tiles)
  assert got["window", "fwd+bwd"][0] <= 1.15 * tiles * tile * 4.5, (got["window"], tiles)


def test_transient_memory_is_bounded_by_the_step_budget():
  # B=4 N=16 K=4 H=128 bf16, causal, exported for cuda and compiled here: the step's tiles
  # stay within jattn._chunked.plan.STEP_BYTES (lanes run group after group), so the temporaries are
  # the budget plus arrays of the size of the query in float32 (the output's accumulator, dQ's,
  # and XLA's CPU compile converting the 16-bit q, dO and O to float32), growing linearly in T.
  from jattn._chunked import plan as _plan

  B, N, K, H = 4, 16, 4, 128

  def temp(T):
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
    f = lambda q, k, v: jattn.dot_product_attention(
      q, k, v, is_causal=True, implementation="chunked"
    )

    def train(q, k, v, dout):
      return jax.vjp(f, q, k, v)[1](dout)

    exp = jax.export.export(
      jax.jit(train),
      platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.platform()],
    )(q, kv, kv, q)
    return jax.jit(exp.call).lower(q, kv, kv, q).compile().memory_analysis().temp_size_in_bytes

  sizes = {T: temp(T) for T in (4096, 8192)}
  query_f32 = B * 8192 * N * H * 4
  assert sizes[8192] <= _plan.STEP_BYTES + 6 * query_f32, sizes  # 1.5 GiB; it was 7.3
  assert sizes[8192] <= 2.1 * sizes[4096], sizes  # linear in T: nothing of T x S


def test_no_scatter_over_repeated_indices_in_programs_for_cuda():
  # On a GPU a floating-point scatter over repeated indices runs as atomics: its order, so its
  # rounding, changes from run to run. The parallel schedule merges a row's lane parts in rounds
  # of distinct rows and sums dBias where each block has one writer, so every scatter of the
  # programs lowered for cuda declares unique indices (forward and forward+backward; causal and
  # full; a bias of every broadcast shape with its gradient; a decoding step; the paged walk).
  T = 2048
  mods = []
  for causal in (False, True):
    for shape in ((1, 4, T, T), (1, 4, 1, T), (1, 4, T, 1), (1, 1, 1, 1)):
      args = (jax.ShapeDtypeStruct((1, T, 4, 64), jnp.bfloat16),) * 3 + (
        jax.ShapeDtypeStruct(shape, jnp.float32),
      )
      f = lambda q, k, v, b, causal=causal: jattn.dot_product_attention(
        q, k, v, b, implementation="chunked", is_causal=causal
      )
      g = jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
      # The forward's merges do not depend on the bias's shape (its gradient's sums do): the
      # forward alone once per mask, with a full bias.
      fns = (f, g) if shape == (1, 4, T, T) else (g,)
      mods += [
        jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module() for fn in fns
      ]
  dec = (jax.ShapeDtypeStruct((4, 1, 8, 64), jnp.bfloat16),) + (
    jax.ShapeDtypeStruct((4, 4096, 2, 64), jnp.bfloat16),
  ) * 2
  f = lambda q, k, v: jattn.dot_product_attention(
    q,
    k,
    v,
    is_causal="bottom_right",
    implementation="chunked",
    key_value_seq_lengths=jnp.array([5, 4096, 100, 3000]),
  )
  mods.append(jax.export.export(jax.jit(f), platforms=["cuda"])(*dec).mlir_module())
  pool = jax.ShapeDtypeStruct((64, 16, 2, 64), jnp.float32)
  paged_args = (
    jax.ShapeDtypeStruct((4, 3, 8, 64), jnp.float32),
    pool,
    pool,
    jax.ShapeDtypeStruct((4, 8), jnp.int32),
    jax.ShapeDtypeStruct((4,), jnp.int32),
  )
  for_cuda = lambda f, *more: jax.export.export(jax.jit(f), platforms=["cuda"])(
    *paged_args, *more
  ).mlir_module()
  mods.append(for_cuda(lambda *a: jattn.paged_attention(*a, implementation="chunked")))
  # A decoding step that reads only each row's chosen blocks (key_selection).
  selected = lambda *a: jattn.paged_attention(
    *a[:5], key_selection=jattn.masks.selected_blocks(a[5], 16)
  )
  mods.append(for_cuda(selected, jax.ShapeDtypeStruct((4, 3, 2, 4), jnp.int32)))
  scatters = [op for mod in mods for op in re.findall(r'"?stablehlo\.scatter"?.*', mod)]
  assert len(scatters) >= 20  # the merges are there, written as scatters
  repeated = [op for op in scatters if "unique_indices = true" not in op]
  assert not repeated, repeated[:3]


def test_vmapped_causal_gradients_keep_block_skipping():
  """Under jax.vmap the backward's block map must stay unmapped: a mapped map turns the tile
  switch (empty, partial, full) into selects that compute every branch of every block, and the
  gradient costs as much as an unmasked one (issue #52: 1.5-1.7x the batched call at T=4096,
  benchmarks/vmap_bench.py). The vmapped program keeps the batched one's switches."""
  B, T, N, H = 2, 256, 2, 16
  q, k, v = (jax.random.normal(jax.random.key(i), (B, T, N, H)) for i in range(3))
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, implementation="chunked", is_causal=True, block_q=64, block_kv=64, schedule="serial"
  )
  batched = jax.grad(lambda q, k, v: f(q, k, v).sum(), (0, 1, 2))
  one = lambda q, k, v: f(q[None], k[None], v[None])[0]
  vmapped = jax.grad(lambda q, k, v: jax.vmap(one)(q, k, v).sum(), (0, 1, 2))
  text = {name: jax.jit(g).lower(q, k, v).as_text() for name, g in (("b", batched), ("v", vmapped))}
  switches = {name: t.count("stablehlo.case") for name, t in text.items()}
  assert switches["b"] >= 2 and switches["v"] == switches["b"], switches
  np.testing.assert_allclose(
    jax.jit(vmapped)(q, k, v), jax.jit(batched)(q, k, v), rtol=2e-5, atol=2e-6
  )


def _tiles(f, *args):
  """The (rows, keys) of every logits tile (a dot_general ending in the key block) in ``f``'s
  program, sub-programs included."""
  return {
    tuple(e.outvars[0].aval.shape[-2:])
    for e, _ in equations(jax.make_jaxpr(f)(*args).jaxpr)
    if e.primitive.name == "dot_general"
  }


@pytest.mark.parametrize("w, blocks", [(511, (256, 256)), (1023, (256, 256)), (1024, (512, 256))])
def test_a_narrow_window_runs_on_square_blocks_by_default(w, blocks):
  # A window at most 1024 keys wide (left + right + 1) defaults to 256 x 256 blocks (a 512-row
  # block's band would span whole 256-key blocks mostly hidden); wider ones keep 512 x 256; the
  # caller's blocks stay the caller's.
  x = jax.ShapeDtypeStruct((1, 2048, 2, 32), jnp.float32)
  f = lambda q, k, v, **kw: jattn.dot_product_attention(
    q, k, v, local_window_size=(w, 0), implementation="chunked", **kw
  )
  assert blocks in _tiles(f, x, x, x)
  assert (128, 64) in _tiles(lambda *a: f(*a, block_q=128, block_kv=64), x, x, x)
