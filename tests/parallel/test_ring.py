"""Ring attention, its layouts and merge_attention.

Multi-device checks run tests/support/_ring_worker.py in subprocesses with 8 and 4 host CPU devices
(the device count is fixed when JAX starts; this process keeps its one device), and once as two
processes joined by jax.distributed on this host. Everything else runs here; merge_attention's
gradients against the reference are in tests/attention/test_merge.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import _ring_runs
import _ring_worker
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jattn
from jattn import masks as jmasks
from jattn._parallel import ring_loop
from jattn._parallel import zigzag as _zigzag
from jattn._tile import NEG

WORKER = os.path.abspath(_ring_worker.__file__)  # in tests/support/
TOL = 1e-5  # float32 against float64, errors relative to max(1, max |reference|)


# --------------------------------------------------------------------------------------------
# Multi-device: subprocesses.
# --------------------------------------------------------------------------------------------


def _results(stdout: str):
  for line in stdout.splitlines():
    if line.startswith("RESULTS "):
      return json.loads(line[len("RESULTS ") :])
  return None


# The 4- and 8-device runs start with the session (tests/conftest.py), so they
# compile beside the other tests; these fixtures wait for their results.
@pytest.fixture(scope="module")
def ring8(tmp_path_factory):
  return _ring_runs.results(8, _ring_runs.session_dir(tmp_path_factory))


@pytest.fixture(scope="module")
def ring4(tmp_path_factory):
  return _ring_runs.results(4, _ring_runs.session_dir(tmp_path_factory))


QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def _check_case(results, name):
  res = results[name]
  assert "error" not in res, res.get("error")
  errs = {k: v for k, v in res.items() if k != "seconds"}
  c = _ring_worker.CASES[name]
  expected = set(QUANTITIES)
  if c.get("single"):
    expected |= {"single_out", "single_dq", "single_dk", "single_dv"}
  if c.get("dtype", "float32") == "float32":
    assert set(errs) == expected
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, f"{name}: errors above {TOL}: {bad}"
    return
  # 16-bit inputs (the FlashAttention rule): against the float64 reference on the same rounded
  # inputs, the ring's error is at most twice that of a plain dense computation in the input
  # dtype (_ring_worker._plain_fn), plus 1e-3 -- for the output, the lse and every gradient. The
  # plain errors must be those of a sane bfloat16 computation, so that the bound is not vacuous.
  assert set(errs) == expected | {"plain_" + k for k in QUANTITIES} | {"rounded_out"}
  # And the output against the error of rounding the exact answer to the input dtype once (the
  # rule of tests/properties/test_precision16.py, here in the max norm): the shard pairs'
  # outputs merge in float32 and round once, so the largest error is the rounding's (measured
  # 1.00x in both cases); merged from parts each rounded to bfloat16 first it was 1.16x and 1.29x.
  assert errs["out"] <= 1.1 * errs["rounded_out"], (
    f"{name}: output error {errs['out']:.3e} is {errs['out'] / errs['rounded_out']:.2f}x the "
    f"{c['dtype']} rounding of the exact answer ({errs['rounded_out']:.3e}); the bound is 1.1x"
  )
  bad = {
    k: (errs[k], errs["plain_" + k])
    for k in QUANTITIES
    if not errs[k] <= 2 * errs["plain_" + k] + 1e-3
  }
  assert not bad, f"{name}: ring error > 2 x plain {c['dtype']} error + 1e-3: {bad}"
  insane = {k: errs["plain_" + k] for k in QUANTITIES if not 0 < errs["plain_" + k] < 0.05}
  assert not insane, f"{name}: plain {c['dtype']} baseline errors out of range: {insane}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, c in _ring_worker.CASES.items() if c["devices"] == 8])
def test_ring_8_devices(ring8, name):
  """Forward, lse and dq/dk/dv equal the float64 reference on 8 host devices."""
  _check_case(ring8, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, c in _ring_worker.CASES.items() if c["devices"] == 4])
def test_ring_4_devices(ring4, name):
  """Same on 4 devices; the ``single`` cases also match single-device dot_product_attention."""
  _check_case(ring4, name)


@pytest.mark.slow
def test_split_kv_decoding_recipe_from_the_docs(ring4):
  """docs/ring.md's split-KV decoding code block, run as written on 4 devices (a cache sharded
  over them, per-device lengths, all_gather, merge_attention): equal to the float64 reference
  over the whole cache, with NaN/inf garbage past each length and a length-0 row returning 0."""
  res = ring4["split_kv_recipe"]
  assert "error" not in res, res.get("error")
  assert res["finite"] and res["empty_row_zero"], res
  assert res["out"] < TOL and res["lse"] < TOL, res


@pytest.mark.slow
def test_ring_memory_does_not_grow_with_devices(ring8):
  """Compiled per-device temporaries of forward+backward, same shard length, P = 4 and 8."""
  mem = ring8["memory"]
  assert "error" not in mem, mem.get("error")
  assert 0 < mem["temp_bytes_p8"] <= mem["temp_bytes_p4"], mem


# The exact error of a CPU client without cross-process collectives (XLA's PjRt CPU client,
# jaxlib's libjax_common.so): the one reason to skip rather than fail.
NO_CPU_COLLECTIVES = "Multiprocess computations aren't implemented on the CPU backend"


@pytest.mark.slow
def test_ring_two_processes_distributed():
  """Two processes x 2 CPU devices, jax.distributed, gloo collectives over TCP on this host.

  The coordinator listens on a Unix-domain socket in a fresh temporary directory rather than on
  a TCP port. A port found free and then closed (``bind(("127.0.0.1", 0))``) can be taken by
  anyone before the coordinator binds it -- another test's process under ``pytest -n 2``, or a
  concurrent run of this same test, whose gRPC server binds with SO_REUSEPORT and would then
  silently share the port, so clients register with the wrong coordinator and time out. A path
  in a directory that ``mkdtemp`` just created cannot be in use, so there is nothing to race or
  retry. (Gloo's own TCP listeners bind port 0 and publish the port through the coordinator,
  which is atomic.)
  """
  if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
    pytest.skip("this jax has no CPU cross-process collectives option")
  with tempfile.TemporaryDirectory(
    prefix="jattn-", dir="/tmp" if os.path.isdir("/tmp") else None
  ) as tmp:
    address = "unix:" + os.path.join(tmp, "coordinator")
    assert len(address) < 100, address  # sockaddr_un.sun_path holds 108 bytes
    cmd = lambda i: [
      sys.executable,
      WORKER,
      "--distributed",
      str(i),
      address,
    ]
    procs = [
      subprocess.Popen(
        cmd(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_ring_runs.env()
      )
      for i in range(2)
    ]
    outs = []
    try:
      for p in procs:
        outs.append(p.communicate(timeout=300))
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.communicate()
  for (_, stderr), p in zip(outs, procs):
    if p.returncode != 0 and NO_CPU_COLLECTIVES in stderr:
      pytest.skip(f"CPU collectives across processes unavailable: {stderr[-500:]}")
  for i, ((stdout, stderr), p) in enumerate(zip(outs, procs)):
    res = _results(stdout)
    assert p.returncode == 0 and res is not None, (
      f"process {i}: rc={p.returncode}\n{stderr[-4000:]}"
    )
    assert res["process_count"] == 2 and res["devices"] == 4, res
    bad = {k: res[k] for k in ("out", "dq", "dk", "dv") if not res[k] < TOL}
    assert not bad, bad


# --------------------------------------------------------------------------------------------
# Layouts.
# --------------------------------------------------------------------------------------------


def test_zigzag_permute_small_example():
  # T = 8 on P = 2 devices: chunks of 2, device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
  x = jnp.arange(8, dtype=jnp.int32)[None]
  np.testing.assert_array_equal(jattn.zigzag_permute(x, 2), [[0, 1, 6, 7, 2, 3, 4, 5]])
  np.testing.assert_array_equal(_zigzag.zigzag_order(3), [0, 5, 1, 4, 2, 3])


@pytest.mark.parametrize("P,axis", [(1, 1), (3, 1), (2, 0), (4, -3)])
def test_zigzag_roundtrip(P, axis):
  x = np.random.default_rng(0).standard_normal((8, 24, 3, 2)).astype(np.float32)
  y = jattn.zigzag_permute(x, P, axis=axis)
  np.testing.assert_array_equal(jattn.zigzag_unpermute(y, P, axis=axis), x)
  if P > 1:
    assert not np.array_equal(y, x)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_positions_match_the_layout(layout):
  """The global positions the kernel uses are where the permuted sequence puts each token."""
  P, T = 4, 24
  seq = np.arange(T)
  if layout == "zigzag":
    seq = np.asarray(jattn.zigzag_permute(seq[None], P))[0]
  for d in range(P):
    got = _zigzag.shard_positions(jnp.int32(d), T // P, P, layout)
    np.testing.assert_array_equal(got, seq[d * (T // P) : (d + 1) * (T // P)])


def test_zigzag_errors():
  with pytest.raises(ValueError, match="multiple of 8"):
    jattn.zigzag_permute(jnp.zeros((1, 12)), 4)
  with pytest.raises(ValueError, match="num_devices"):
    jattn.zigzag_permute(jnp.zeros((1, 12)), 0)
  with pytest.raises(ValueError, match="out of range"):
    jattn.zigzag_unpermute(jnp.zeros((1, 12)), 2, axis=2)


def test_zigzag_balances_causal_work():
  P, Ts, block = 8, 16, 4
  nb = P * Ts // block  # global blocks per side
  contiguous, _ = ring_loop.tiles_per_device(P, "contiguous", Ts, Ts, block, block, hi=0)
  zigzag, zig_full = ring_loop.tiles_per_device(P, "zigzag", Ts, Ts, block, block, hi=0)
  contiguous, zigzag = contiguous.tolist(), zigzag.tolist()
  # Both compute exactly the lower triangle of the global block grid, diagonal included...
  assert sum(contiguous) == sum(zigzag) == nb * (nb + 1) // 2
  # ...but contiguous gives the last device 2P - 1 times the first's work, zigzag spreads it.
  assert contiguous == sorted(contiguous) and contiguous[-1] > 10 * contiguous[0]
  assert len(set(zigzag)) == 1, zigzag
  # Only diagonal blocks need mask arithmetic.
  assert sum(zigzag) - sum(zig_full) == nb


# --------------------------------------------------------------------------------------------
# ring_attention: in-process checks (one device).
# --------------------------------------------------------------------------------------------


def _normal(seed, *shape):
  # NumPy inputs: jax.random would compile a sampler per shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _qkv(B=1, T=8, N=2, K=1, H=4):
  return _normal(0, B, T, N, H), _normal(1, B, T, K, H), _normal(2, B, T, K, H)


def _mesh1(name="seq"):
  return jax.sharding.Mesh(np.asarray(jax.devices()[:1]), (name,))


def test_ring_on_one_device_equals_attention():
  q, k, v = _qkv()
  out = jax.jit(
    lambda q, k, v: jattn.ring_attention_sharded(
      q, k, v, mesh=_mesh1(), seq_axis="seq", is_causal=True, layout="zigzag", block_q=2, block_kv=2
    )
  )(q, k, v)
  want, _, _ = ref.attention(q, k, v, visible=ref.visible_mask(1, 2, 8, 8, causal="top_left"))
  np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-6)


def test_ring_nan_at_visible_positions_propagates_hidden_never_leaks():
  # As dot_product_attention: a NaN key seen by some rows makes exactly those rows NaN (as in
  # jax.nn); NaN/inf past the key length (hidden from everyone) never reach the output.
  q, k, v = _qkv()
  ring = jax.jit(
    lambda q, k, v, lens: jattn.ring_attention_sharded(
      q,
      k,
      v,
      mesh=_mesh1(),
      seq_axis="seq",
      is_causal=True,
      key_value_seq_lengths=lens,
      block_q=2,
      block_kv=2,
    )
  )
  full = jnp.asarray([8], jnp.int32)
  kn = k.at[0, 3, 0, 1].set(jnp.nan)
  out = ring(q, kn, v, full)
  want = jax.nn.dot_product_attention(q, kn, v, is_causal=True)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
  assert np.isnan(out).any()
  garbage_k = k.at[0, 6:].set(jnp.nan)
  garbage_v = v.at[0, 6:].set(jnp.inf)
  out = ring(q, garbage_k, garbage_v, jnp.asarray([6], jnp.int32))
  want, _, _ = ref.attention(
    q, k, v, visible=ref.visible_mask(1, 2, 8, 8, causal="top_left", kv_lengths=[6])
  )
  np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(
  "kw,words",
  [
    (dict(bias=jnp.zeros((8, 8))), "does not support bias"),
    (dict(mask=jnp.ones((8, 8), bool)), "boolean mask array"),
    (dict(mask=jmasks.causal() & jmasks.from_array(jnp.ones((8, 8), bool))), "boolean mask array"),
  ],
)
def test_unsupported_arguments(kw, words):
  # Arrays laid out over the whole (T, S) are refused with the reason; every position-based
  # mask object, score_mod, sinks and dropout are supported (test_ring_equals_single_device).
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match=words):
    jattn.ring_attention(q, k, v, axis_name="seq", **kw)


@pytest.mark.parametrize("impl", ["splash", "cudnn", "pallas_gpu", ("cudnn", "splash")])
def test_fused_kernels_cannot_serve_a_ring(impl):
  # Named alone (or only fused names in a sequence) they are refused with the reason; in a
  # sequence with jattn's kernels they are skipped (the p4_dense_* case of _ring_worker).
  q, k, v = _qkv()
  with pytest.raises(
    NotImplementedError, match="cannot run '(splash|cudnn|pallas_gpu)' per shard pair"
  ):
    jattn.ring_attention_sharded(q, k, v, mesh=_mesh1(), seq_axis="seq", implementation=impl)
  with pytest.raises(ValueError, match="implementation must be"):
    jattn.ring_attention_sharded(q, k, v, mesh=_mesh1(), seq_axis="seq", implementation="flash")


SINGLE_CASES = [
  f"{f}/{layout}" for f in _ring_worker.SINGLE_FEATURES for layout in ("contiguous", "zigzag")
]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 8])
@pytest.mark.parametrize("case", SINGLE_CASES)
def test_ring_equals_single_device(ring4, ring8, devices, case):
  """Mask objects (chunked_local & causal, prefix_lm, a from_function of batch and head),
  score_mod with an array it closes over, sinks and dropout, all with a value head size of its
  own (Hv = 12, H = 8): ring attention's output and the
  gradients of q, k, v, the sinks and score_mod's table equal the single-device call on the
  same global inputs (dropout drops the same entries), in both layouts; on 8 devices the batch
  is sharded too (batch indices are global)."""
  res = (ring4 if devices == 4 else ring8)["vs_single"]
  assert "error" not in res, res.get("error")
  errs = res[case]
  feature = case.split("/")[0]
  assert errs.pop("used_sinks") == ("sinks" in feature)
  assert errs.pop("used_table") == ("score_mod" in feature)
  assert set(errs) == {"out", "dq", "dk", "dv", "dsinks", "dtable"}
  bad = {k: v for k, v in errs.items() if not v < TOL}
  assert not bad, f"{case} on {devices} devices: ring vs single-device errors above {TOL}: {bad}"


@pytest.mark.slow
def test_ring_in_checked_shard_map_sums_invariant_gradients_once(ring4):
  """ring_attention in a hand-written shard_map(check_vma=True): the sinks and score_mod's
  table are the same on every device, and their gradients are the single-device ones."""
  res = ring4["vs_single"]
  assert "error" not in res, res.get("error")
  errs = res["typed_shard_map_score_mod_sinks"]
  assert set(errs) == {"out", "dq", "dk", "dv", "dsinks", "dtable"}
  assert all(v < TOL for v in errs.values()), errs


def test_argument_errors():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="not a bound mesh axis"):
    jattn.ring_attention(q, k, v, axis_name="seq")
  with pytest.raises(ValueError, match="layout"):
    jattn.ring_attention(q, k, v, axis_name="seq", layout="striped")
  mesh = _mesh1()
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    jattn.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="sp")
  with pytest.raises(ValueError, match=r"must be a multiple of 2"):
    jattn.ring_attention_sharded(
      q[:, :7], k[:, :7], v[:, :7], mesh=mesh, seq_axis="seq", layout="zigzag"
    )
  with pytest.raises(ValueError, match=r"global \(B, T\|S, N\|K, H\)"):
    jattn.ring_attention_sharded(q[0], k[0], v[0], mesh=mesh, seq_axis="seq")
  with pytest.raises(TypeError, match="seq_axis=, not axis_name="):
    jattn.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="seq", axis_name="seq")
  # Shard-level checks run inside the shard_map.
  with pytest.raises(ValueError, match="number of query heads"):
    jattn.ring_attention_sharded(
      q, k[:, :, [0, 0, 0]], v[:, :, [0, 0, 0]], mesh=mesh, seq_axis="seq"
    )


def test_ring_attention_in_a_checked_shard_map():
  """Under the default check_vma=True (the kernels' loop carries are typed device-varying):
  forward, lse and dq/dk/dv equal the float64 reference (MQA, T != S, bottom-right causal,
  lengths)."""
  B, T, S, N, K, H = 2, 6, 10, 2, 1, 4
  q, k, v, do = (
    _normal(20 + i, *shape)
    for i, shape in enumerate([(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)])
  )
  lengths = jnp.asarray([10, 7], jnp.int32)
  spec = jax.sharding.PartitionSpec(None, "seq")
  f = jax.shard_map(
    lambda q, k, v, n: jattn.ring_attention(
      q,
      k,
      v,
      axis_name="seq",
      is_causal="bottom_right",
      key_value_seq_lengths=n,
      block_q=4,
      block_kv=4,
      return_residual=True,
    ),
    mesh=_mesh1(),
    in_specs=(spec, spec, spec, jax.sharding.PartitionSpec()),
    out_specs=(spec, spec),
  )
  (out, lse), pull = jax.vjp(lambda q, k, v: f(q, k, v, lengths), q, k, v)
  dq, dk, dv = pull((do, jnp.zeros_like(lse)))
  vis = ref.visible_mask(B, N, T, S, causal="bottom_right", kv_lengths=np.asarray(lengths))
  want, want_lse, cache = ref.attention(q, k, v, visible=vis)
  for name, got, exp in zip(
    ("out", "lse", "dq", "dk", "dv"),
    (out, lse, dq, dk, dv),
    (want, want_lse) + ref.grads(cache, do)[:3],
  ):
    np.testing.assert_allclose(
      np.asarray(got, np.float64),
      exp,
      rtol=0,
      atol=TOL * max(1.0, float(np.abs(exp).max())),
      err_msg=name,
    )


def test_ring_lse_carries_its_gradient_on_a_one_device_mesh():
  """ring_attention's residual lse carries its gradient (d lse / d logits = P), with sinks: the
  gradient of sum(out * do) + sum(lse * w) equals the float64 reference's."""
  B, T, S, N, K, H = 2, 6, 6, 2, 1, 4
  q, k, v, do = (
    _normal(40 + i, *shape)
    for i, shape in enumerate([(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)])
  )
  w = _normal(50, B, T, N)
  sinks = jnp.asarray([0.3, -0.5], jnp.float32)
  spec = jax.sharding.PartitionSpec(None, "seq")
  f = jax.shard_map(
    lambda q, k, v, s: jattn.ring_attention(
      q, k, v, axis_name="seq", is_causal=True, sinks=s, block_q=4, block_kv=4, return_residual=True
    ),
    mesh=_mesh1(),
    in_specs=(spec, spec, spec, jax.sharding.PartitionSpec()),
    out_specs=(spec, spec),
  )
  (_out, _lse), pull = jax.vjp(lambda q, k, v, s: f(q, k, v, s), q, k, v, sinks)
  got = pull((do, w))
  vis = ref.visible_mask(B, N, T, S, causal="top_left")
  _, _, g = ref.attention_vjp(q, k, v, do, visible=vis, sinks=sinks, dlse=w)
  want = (g["dq"], g["dk"], g["dv"], g["dsinks"])
  for name, g, wg in zip(("dq", "dk", "dv", "dsinks"), got, want):
    wg = np.asarray(wg)
    np.testing.assert_allclose(
      np.asarray(g, np.float64),
      wg,
      rtol=0,
      atol=TOL * max(1.0, float(np.abs(wg).max())),
      err_msg=name,
    )


# --------------------------------------------------------------------------------------------
# merge_attention.
# --------------------------------------------------------------------------------------------


def test_merge_equals_full_attention_over_key_ranges():
  """Attention split over two key ranges, merged, equals attention over all keys -- including
  rows that see nothing in some range and a row that sees nothing at all."""
  B, T, S, N, K, H = 2, 6, 13, 4, 2, 8
  q, k, v = _normal(3, B, T, N, H), _normal(4, B, S, K, H), _normal(5, B, S, K, H)
  vis = np.asarray(ref.visible_mask(B, N, T, S, causal="bottom_right"))
  vis[1, :, 2, :] = False  # one row with nothing to attend to
  mask = jnp.asarray(vis)
  bounds = [(0, 8), (8, 13)]
  parts = [
    jattn.dot_product_attention(q, k[:, a:b], v[:, a:b], mask=mask[..., a:b], return_residual=True)
    for a, b in bounds
  ]
  # Row 0 sees keys 0..7 only: nothing in the second range.
  assert float(parts[1][1][0, 0, 0]) < -1e30
  out, lse = jattn.merge_attention([p[0] for p in parts], [p[1] for p in parts])
  want, want_lse, _ = ref.attention(q, k, v, visible=vis)
  np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-6)
  live = np.isfinite(want_lse)
  np.testing.assert_allclose(np.asarray(lse)[live], want_lse[live], atol=2e-6, rtol=2e-6)
  assert np.all(np.asarray(lse)[~live] < -1e30) and (~live).any()
  np.testing.assert_array_equal(np.asarray(out)[1, 2], 0.0)
  # The same through single-device attention, and with the parts stacked.
  full, _full_lse = jattn.dot_product_attention(q, k, v, mask=mask, return_residual=True)
  np.testing.assert_allclose(out, full, atol=2e-6, rtol=2e-6)
  out2, lse2 = jattn.merge_attention(
    jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts])
  )
  np.testing.assert_array_equal(out2, out)
  np.testing.assert_array_equal(lse2, lse)


def test_merge_closed_form():
  # lse 0 and log 3: weights 1/4 and 3/4, merged lse log 4.
  o1 = jnp.full((1, 1, 1, 2), 4.0)
  o2 = jnp.full((1, 1, 1, 2), 8.0)
  out, lse = jattn.merge_attention(
    [o1, o2], [jnp.zeros((1, 1, 1)), jnp.full((1, 1, 1), np.log(3.0), jnp.float32)]
  )
  np.testing.assert_allclose(out, np.full((1, 1, 1, 2), 7.0), rtol=1e-6)
  np.testing.assert_allclose(lse, np.full((1, 1, 1), np.log(4.0)), rtol=1e-6)


def test_merge_large_lse_is_stable():
  # exp(1000) overflows float32: only the max-subtracted form survives.
  o = jnp.stack([jnp.ones((3, 2)), 3 * jnp.ones((3, 2))])
  l = jnp.asarray([[1000.0, 1000.0, -1000.0], [1000.0, 999.0, -1000.0]], jnp.float32)
  out, lse = jattn.merge_attention(o, l)
  w = 1 / (1 + np.exp(-1.0))
  np.testing.assert_allclose(out[:, 0], [2.0, 1 * w + 3 * (1 - w), 2.0], rtol=1e-6)
  np.testing.assert_allclose(
    lse, [1000 + np.log(2.0), 1000 + np.log1p(np.exp(-1.0)), -1000 + np.log(2.0)], rtol=1e-6
  )


def test_merge_empty_rows_without_nan():
  o = jnp.stack([jnp.zeros((4, 3)), jnp.full((4, 3), 2.0)])
  ninf = -np.inf
  l = jnp.asarray([[ninf, ninf, NEG, 0.5], [ninf, 1.0, NEG, ninf]], jnp.float32)
  out, lse = jattn.merge_attention(o, l)
  # Row 0: -inf everywhere; row 1: one live part; row 2: the finite sentinel everywhere.
  np.testing.assert_array_equal(out[:, 0], [0.0, 2.0, 1.0, 0.0])
  assert lse[0] == ninf and float(lse[1]) == pytest.approx(1.0) and float(lse[2]) < -1e30
  assert float(lse[3]) == pytest.approx(0.5)
  grads = jax.grad(
    lambda o, l: (
      jattn.merge_attention(o, l)[0].sum()
      + jnp.where(
        jnp.isfinite(jattn.merge_attention(o, l)[1]), jattn.merge_attention(o, l)[1], 0.0
      ).sum()
    ),
    argnums=(0, 1),
  )(o, l)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_merge_errors():
  with pytest.raises(ValueError, match="at least one"):
    jattn.merge_attention([], [])
  with pytest.raises(ValueError, match="without its last"):
    jattn.merge_attention(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="share one shape"):
    jattn.merge_attention([jnp.zeros((3, 4)), jnp.zeros((2, 4))], [jnp.zeros(3), jnp.zeros(2)])
  with pytest.raises(TypeError, match="floating"):
    jattn.merge_attention(jnp.zeros((2, 3, 4), jnp.int32), jnp.zeros((2, 3)))
