"""jattn.attention_received (issue #42): the sum over queries of each key's softmax weight, per
query head, against the float64 definition; O(T + S) memory on chunked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from _subprocess import run_worker

import jattn

B, T, S, N, K, H = 2, 40, 56, 4, 2, 16
IMPLS = {
  "dense": dict(implementation="dense"),
  "chunked": dict(implementation="chunked", block_q=16, block_kv=8),
  "None": {},
}


def _inputs(dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(3), 2)
  q = 2.0 * jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32)
  return q.astype(dtype), k.astype(dtype)


def _want(q, k, visible, **kw):
  """received[b, s, n] = sum_t P[b, n, t, s] from the float64 weights."""
  v = np.zeros(k.shape[:-1] + (1,))
  _, _, cache = ref.attention(
    np.asarray(q, np.float64), np.asarray(k, np.float64), v, visible=visible, **kw
  )
  return cache["p"].sum(axis=2).transpose(0, 2, 1)  # (B, S, N)


CASES = {
  "plain": (dict(), dict()),
  "causal, window": (
    dict(is_causal="bottom_right", local_window_size=(12, 0)),
    dict(causal="bottom_right", window=(12, 0)),
  ),
  "lengths": (
    dict(query_seq_lengths=np.array([40, 9]), key_value_seq_lengths=np.array([56, 0])),
    dict(q_lengths=[40, 9], kv_lengths=[56, 0]),
  ),
  "segments": ("segments", None),
  "bias, soft cap, sinks": ("bias", None),
}


def _case(name):
  kw, vis_kw = CASES[name]
  ref_kw = {}
  if kw == "segments":
    qs = np.repeat([[0, 1], [0, 2]], [20, 20], axis=1).astype(np.int32)
    ks = np.repeat([[0, 1], [2, 0]], [30, 26], axis=1).astype(np.int32)
    kw, vis_kw = dict(q_segment_ids=qs, kv_segment_ids=ks), dict(q_seg=qs, kv_seg=ks)
  elif kw == "bias":
    bias = np.asarray(jax.random.normal(jax.random.key(5), (1, N, T, S)), np.float32)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    kw = dict(bias=bias, logits_soft_cap=5.0, sinks=sinks, is_causal=True)
    vis_kw = dict(causal="top_left")
    ref_kw = dict(bias=bias, soft_cap=5.0, sinks=sinks)
  return kw, ref.visible_mask(B, N, T, S, **vis_kw), ref_kw


# implementation=None is tried once: at this size it is dense on this CPU (and so the same
# program as "dense" for every case).
@pytest.mark.parametrize(
  "case,impl",
  [
    (case, impl)
    for case in sorted(CASES)
    for impl in sorted(IMPLS)
    if impl != "None" or case == "bias, soft cap, sinks"
  ],
)
def test_received_equals_the_float64_definition(impl, case):
  q, k = _inputs()
  kw, vis, ref_kw = _case(case)
  got = jax.jit(lambda q, k: jattn.attention_received(q, k, **kw, **IMPLS[impl]))(q, k)
  want = _want(q, k, vis, **ref_kw)
  assert got.shape == (B, S, N) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_16_bit_inputs_give_float32_sums_of_their_exact_weights(impl):
  # The sums are float32 of the bf16 inputs' exact weights: a bfloat16 result (rounded to 8
  # bits) would miss by about 1e-2 of a sum of several.
  q, k = _inputs(jnp.bfloat16)
  got = jattn.attention_received(q, k, is_causal=True, **IMPLS[impl])
  want = _want(q, k, ref.visible_mask(B, N, T, S, causal="top_left"))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_unbatched_and_each_rows_weights_sum_to_one():
  q, k = _inputs()
  got = jattn.attention_received(q[0], k[0], is_causal=True, implementation="chunked")
  assert got.shape == (S, N)
  # Every query sees a key here (causal, T <= S): the weights of T rows add up to T per head.
  np.testing.assert_allclose(np.asarray(got).sum(axis=0), np.full(N, T), rtol=1e-5)


def test_chunked_memory_grows_linearly():
  # Compiled temporaries at T = S = 4096 and 8192: O(T + S), nothing of T x S (which would be
  # 4 x 8192^2 x 4 bytes = 1 GiB at 8192 for one example and head).
  def temp(T):
    q = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.float32)
    f = lambda q, k: jattn.attention_received(q, k, is_causal=True, implementation="chunked")
    return jax.jit(f).lower(q, k).compile().memory_analysis().temp_size_in_bytes

  small, large = temp(4096), temp(8192)
  assert large <= 2.2 * small, (small, large)
  assert large < 4 * 8192 * 8192, large


def test_errors_name_the_argument():
  q, k = _inputs()
  with pytest.raises(ValueError, match="multiple of the key/value heads"):
    jattn.attention_received(q, k[:, :, :1].repeat(3, axis=2))
  with pytest.raises(TypeError, match="query"):
    jattn.attention_received("q", k)


MESH_WORKER = """
import json, os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np, jattn
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import test_received as t

q, k = t._inputs()
kw, visible, ref_kw = t._case("causal, window")
want = t._want(q, k, visible, **ref_kw)
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
