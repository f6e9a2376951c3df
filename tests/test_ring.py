"""Ring attention, its layouts and merge_attention.

Multi-device checks run tests/_ring_worker.py in subprocesses with 8 and 4 host CPU devices (the
device count is fixed when JAX starts; this process keeps its one device), and once as two
processes joined by jax.distributed on 127.0.0.1. Everything else runs here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import _ring
from jattn import masks as jmasks
from jattn._tile import NEG

import _ring_worker
import reference as ref

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-5  # float32 against float64, errors relative to max(1, max |reference|)


# --------------------------------------------------------------------------------------------
# Multi-device: subprocesses.
# --------------------------------------------------------------------------------------------


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the worker sets its own device count
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _results(stdout: str):
  for line in stdout.splitlines():
    if line.startswith("RESULTS "):
      return json.loads(line[len("RESULTS "):])
  return None


def _run_worker(devices):
  proc = subprocess.run([sys.executable, os.path.join(HERE, "_ring_worker.py"), "--devices",
                         str(devices)], capture_output=True, text=True, env=_env(), timeout=600)
  res = _results(proc.stdout)
  assert proc.returncode == 0 and res is not None, (
      f"worker with {devices} devices failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
  return res


@pytest.fixture(scope="module")
def ring8():
  return _run_worker(8)


@pytest.fixture(scope="module")
def ring4():
  return _run_worker(4)


def _check_case(results, name):
  res = results[name]
  assert "error" not in res, res.get("error")
  errs = {k: v for k, v in res.items() if k != "seconds"}
  c = _ring_worker.CASES[name]
  expected = {"out", "lse", "dq", "dk", "dv"}
  if c.get("single"):
    expected |= {"single_out", "single_dq", "single_dk", "single_dv"}
  assert set(errs) == expected
  bad = {k: v for k, v in errs.items() if not v < TOL}
  assert not bad, f"{name}: errors above {TOL}: {bad}"


@pytest.mark.parametrize("name", [n for n, c in _ring_worker.CASES.items() if c["devices"] == 8])
def test_ring_8_devices(ring8, name):
  """Forward, lse and dq/dk/dv equal the float64 reference on 8 host devices."""
  _check_case(ring8, name)


@pytest.mark.parametrize("name", [n for n, c in _ring_worker.CASES.items() if c["devices"] == 4])
def test_ring_4_devices(ring4, name):
  """Same on 4 devices; the ``single`` cases also match single-device dot_product_attention."""
  _check_case(ring4, name)


def test_ring_memory_does_not_grow_with_devices(ring8):
  """Compiled per-device temporaries of forward+backward, same shard length, P = 4 and 8."""
  mem = ring8["memory"]
  assert "error" not in mem, mem.get("error")
  assert 0 < mem["temp_bytes_p8"] <= mem["temp_bytes_p4"], mem


def _free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_ring_two_processes_distributed():
  """Two processes x 2 CPU devices, jax.distributed on 127.0.0.1, gloo collectives."""
  if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
    pytest.skip("this jax has no CPU cross-process collectives option")
  port = _free_port()
  cmd = lambda i: [sys.executable, os.path.join(HERE, "_ring_worker.py"), "--distributed",
                   str(i), str(port)]
  procs = [subprocess.Popen(cmd(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env()) for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=300))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for (stdout, stderr), p in zip(outs, procs):
    if "gloo" in stderr.lower() and ("not" in stderr.lower() and "support" in stderr.lower()):
      pytest.skip(f"CPU collectives across processes unavailable: {stderr[-500:]}")
    res = _results(stdout)
    assert p.returncode == 0 and res is not None, f"rc={p.returncode}\n{stderr[-4000:]}"
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
  np.testing.assert_array_equal(_ring.zigzag_order(3), [0, 5, 1, 4, 2, 3])


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
    got = _ring.shard_positions(jnp.int32(d), T // P, P, layout)
    np.testing.assert_array_equal(got, seq[d * (T // P):(d + 1) * (T // P)])


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
  contiguous, _ = _ring.tiles_per_device(P, "contiguous", Ts, Ts, block, block, hi=0)
  zigzag, zig_full = _ring.tiles_per_device(P, "zigzag", Ts, Ts, block, block, hi=0)
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
  out = jax.jit(lambda q, k, v: jattn.ring_attention_sharded(
      q, k, v, mesh=_mesh1(), seq_axis="seq", is_causal=True, layout="zigzag",
      block_q=2, block_kv=2))(q, k, v)
  want, _, _ = ref.attention(q, k, v, visible=ref.visible_mask(1, 2, 8, 8, causal="top_left"))
  np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("kw,name", [
    (dict(bias=jnp.zeros((8, 8))), "bias"),
    (dict(mask=jmasks.causal()), "mask"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout_rate"),
    (dict(score_mod=lambda s, b, h, q, k: s), "score_mod"),
    (dict(sinks=jnp.zeros((2,))), "sinks"),
])
def test_unsupported_arguments(kw, name):
  q, k, v = _qkv()
  with pytest.raises(NotImplementedError, match=f"does not support {name}"):
    jattn.ring_attention(q, k, v, axis_name="seq", **kw)


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
    jattn.ring_attention_sharded(q[:, :7], k[:, :7], v[:, :7], mesh=mesh, seq_axis="seq",
                                 layout="zigzag")
  with pytest.raises(ValueError, match=r"global \(B, T\|S, N\|K, H\)"):
    jattn.ring_attention_sharded(q[0], k[0], v[0], mesh=mesh, seq_axis="seq")
  with pytest.raises(TypeError, match="seq_axis=, not axis_name="):
    jattn.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="seq", axis_name="seq")
  # Shard-level checks run inside the shard_map.
  with pytest.raises(ValueError, match="number of query heads"):
    jattn.ring_attention_sharded(q, k[:, :, [0, 0, 0]], v[:, :, [0, 0, 0]], mesh=mesh,
                                 seq_axis="seq")


def test_ring_attention_in_a_checked_shard_map():
  # The default check_vma=True types device-varying values; the kernels' loop carries follow it.
  q, k, v = _qkv()
  spec = jax.sharding.PartitionSpec(None, "seq")
  f = jax.shard_map(lambda q, k, v: jattn.ring_attention(q, k, v, axis_name="seq",
                                                         is_causal=True),
                    mesh=_mesh1(), in_specs=(spec,) * 3, out_specs=spec)
  want = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="chunked")
  np.testing.assert_allclose(f(q, k, v), want, rtol=1e-5, atol=1e-5)
  g = jax.grad(lambda q: f(q, k, v).sum())(q)
  g_want = jax.grad(lambda q: jattn.dot_product_attention(q, k, v, is_causal=True).sum())(q)
  np.testing.assert_allclose(g, g_want, rtol=1e-4, atol=1e-5)


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
  parts = [jattn.dot_product_attention(q, k[:, a:b], v[:, a:b], mask=mask[..., a:b],
                                       return_residual=True) for a, b in bounds]
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
  full, full_lse = jattn.dot_product_attention(q, k, v, mask=mask, return_residual=True)
  np.testing.assert_allclose(out, full, atol=2e-6, rtol=2e-6)
  out2, lse2 = jattn.merge_attention(jnp.stack([p[0] for p in parts]),
                                     jnp.stack([p[1] for p in parts]))
  np.testing.assert_array_equal(out2, out)
  np.testing.assert_array_equal(lse2, lse)


def test_merge_closed_form():
  # lse 0 and log 3: weights 1/4 and 3/4, merged lse log 4.
  o1 = jnp.full((1, 1, 1, 2), 4.0)
  o2 = jnp.full((1, 1, 1, 2), 8.0)
  out, lse = jattn.merge_attention([o1, o2], [jnp.zeros((1, 1, 1)),
                                              jnp.full((1, 1, 1), np.log(3.0), jnp.float32)])
  np.testing.assert_allclose(out, np.full((1, 1, 1, 2), 7.0), rtol=1e-6)
  np.testing.assert_allclose(lse, np.full((1, 1, 1), np.log(4.0)), rtol=1e-6)


def test_merge_large_lse_is_stable():
  # exp(1000) overflows float32: only the max-subtracted form survives.
  o = jnp.stack([jnp.ones((3, 2)), 3 * jnp.ones((3, 2))])
  l = jnp.asarray([[1000.0, 1000.0, -1000.0], [1000.0, 999.0, -1000.0]], jnp.float32)
  out, lse = jattn.merge_attention(o, l)
  w = 1 / (1 + np.exp(-1.0))
  np.testing.assert_allclose(out[:, 0], [2.0, 1 * w + 3 * (1 - w), 2.0], rtol=1e-6)
  np.testing.assert_allclose(lse, [1000 + np.log(2.0), 1000 + np.log1p(np.exp(-1.0)),
                                   -1000 + np.log(2.0)], rtol=1e-6)


def test_merge_empty_rows_without_nan():
  o = jnp.stack([jnp.zeros((4, 3)), jnp.full((4, 3), 2.0)])
  ninf = -np.inf
  l = jnp.asarray([[ninf, ninf, NEG, 0.5], [ninf, 1.0, NEG, ninf]], jnp.float32)
  out, lse = jattn.merge_attention(o, l)
  # Row 0: -inf everywhere; row 1: one live part; row 2: the finite sentinel everywhere.
  np.testing.assert_array_equal(out[:, 0], [0.0, 2.0, 1.0, 0.0])
  assert lse[0] == ninf and float(lse[1]) == pytest.approx(1.0) and float(lse[2]) < -1e30
  assert float(lse[3]) == pytest.approx(0.5)
  grads = jax.grad(lambda o, l: jattn.merge_attention(o, l)[0].sum() +
                   jnp.where(jnp.isfinite(jattn.merge_attention(o, l)[1]),
                             jattn.merge_attention(o, l)[1], 0.0).sum(), argnums=(0, 1))(o, l)
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
