"""Ring attention on several host CPU devices, checked against the float64 reference.

Run by tests/test_ring.py in a subprocess, because the number of host devices is fixed when JAX
starts (``--xla_force_host_platform_device_count``) and the rest of the suite runs on one:

  python tests/_ring_worker.py --devices 8 [case ...]

For every case it runs ring attention forward and backward (value_and_grad of sum(out * dout)
w.r.t. the global query, key and value, so zigzag permutations are inside the differentiated
function) and prints one JSON line {case: {"out": err, "lse": err, "dq": err, ...}} with
scale-relative max errors against tests/reference.py (float64 NumPy) and, for cases marked
``single``, against single-device jattn.dot_product_attention. A case that raises reports
{"error": traceback}.

``--distributed PROCESS_ID PORT`` instead runs one process of a 2-process jax.distributed job on
127.0.0.1 (2 local devices each, gloo CPU collectives) and reports the errors of its own shards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def _setup(devices):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={devices}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, os.path.dirname(HERE))
  sys.path.insert(0, HERE)


# Each case: mesh shape and axis names, the wrapper's axes, problem shape and keyword options.
# "direct" calls ring_attention inside a hand-written jax.shard_map instead of the wrapper;
# "explicit" builds the mesh with Explicit axis types (jax.make_mesh's default).
CASES = {
    # ---- 8 devices ----
    "p8_contiguous_full_gqa_lengths_softcap": dict(
        devices=8, mesh=(8,), names=("seq",), seq="seq", T=64, S=64, N=4, K=2,
        layout="contiguous", block_q=4, block_kv=4,
        kw=dict(logits_soft_cap=3.0, scale=0.7), q_lengths=(60, 21), kv_lengths=(64, 35)),
    "p8_zigzag_causal_gqa_segments": dict(
        devices=8, mesh=(8,), names=("seq",), seq="seq", T=64, S=64, N=4, K=2,
        layout="zigzag", block_q=4, block_kv=4, kw=dict(is_causal=True),
        segments=((0, 13, 30, 47), (0, 5, 50, 61))),
    # A ring of 4 inside a (data, seq) mesh; T != S, MQA, blocks that do not divide the shards.
    "p8_data2_seq4_bottom_right_mqa_ragged_lengths": dict(
        devices=8, mesh=(2, 4), names=("data", "seq"), seq="seq", batch="data", T=32, S=48,
        N=4, K=1, layout="contiguous", block_q=3, block_kv=5,
        kw=dict(is_causal="bottom_right"), q_lengths=(32, 19), kv_lengths=(41, 48)),
    "p8_seq4_heads2_zigzag_causal_segments": dict(
        devices=8, mesh=(4, 2), names=("seq", "heads"), seq="seq", head="heads", T=32, S=32,
        N=4, K=2, layout="zigzag", kw=dict(is_causal=True), segments=((0, 9, 20), (0, 16))),
    # ---- 4 devices ----
    "p4_direct_contiguous_causal_residual": dict(
        devices=4, mesh=(4,), names=("seq",), seq="seq", T=32, S=32, N=4, K=2,
        layout="contiguous", block_q=4, block_kv=4, kw=dict(is_causal=True), direct=True,
        single=True),
    "p4_explicit_zigzag_causal_lengths": dict(
        devices=4, mesh=(4,), names=("seq",), seq="seq", T=32, S=32, N=4, K=2,
        layout="zigzag", kw=dict(is_causal=True), q_lengths=(32, 11), explicit=True,
        single=True),
    "p4_contiguous_full_segments": dict(
        devices=4, mesh=(4,), names=("seq",), seq="seq", T=32, S=32, N=4, K=2,
        layout="contiguous", kw=dict(), segments=((0, 3, 17), (0, 30))),
    "p4_zigzag_full_gqa_window_lengths": dict(
        devices=4, mesh=(4,), names=("seq",), seq="seq", T=32, S=32, N=4, K=2,
        layout="zigzag", block_q=2, block_kv=4, kw=dict(local_window_size=(9, 4)),
        kv_lengths=(32, 27)),
}


def _segment_ids(starts_per_batch, L):
  import numpy as np
  ids = np.zeros((len(starts_per_batch), L), np.int32)
  for b, starts in enumerate(starts_per_batch):
    for i, s in enumerate(starts):
      ids[b, s:] = i
  return ids


def _inputs(c, seed=0):
  import numpy as np
  rng = np.random.default_rng(seed)
  B, H = 2, 8
  q = rng.standard_normal((B, c["T"], c["N"], H)).astype(np.float32)
  k = rng.standard_normal((B, c["S"], c["K"], H)).astype(np.float32)
  v = rng.standard_normal((B, c["S"], c["K"], H)).astype(np.float32)
  do = rng.standard_normal((B, c["T"], c["N"], H)).astype(np.float32)
  extra = {}
  if "q_lengths" in c:
    extra["query_seq_lengths"] = np.asarray(c["q_lengths"], np.int32)
  if "kv_lengths" in c:
    extra["key_value_seq_lengths"] = np.asarray(c["kv_lengths"], np.int32)
  if "segments" in c:
    extra["q_segment_ids"] = _segment_ids(c["segments"], c["T"])
    extra["kv_segment_ids"] = _segment_ids(c["segments"], c["S"])
  return q, k, v, do, extra


def _reference(c, q, k, v, do, extra):
  import numpy as np
  import reference as ref
  B, T, N, _ = q.shape
  S = k.shape[1]
  kw = c["kw"]
  causal = kw.get("is_causal", False)
  causal = None if causal is False else ("top_left" if causal is True else causal)
  window = kw.get("local_window_size")
  vis = ref.visible_mask(B, N, T, S, causal=causal, window=window,
                         q_lengths=extra.get("query_seq_lengths"),
                         kv_lengths=extra.get("key_value_seq_lengths"),
                         q_seg=extra.get("q_segment_ids"), kv_seg=extra.get("kv_segment_ids"))
  out, lse, cache = ref.attention(q, k, v, visible=vis, scale=kw.get("scale"),
                                  soft_cap=kw.get("logits_soft_cap"))
  dq, dk, dv, _, _ = ref.grads(cache, do)
  return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def _err(got, want):
  import numpy as np
  got = np.asarray(got, np.float64)
  return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


def _lse_err(got, want):
  """Error on rows that attend to something; rows that attend to nothing must be very negative."""
  import numpy as np
  got = np.asarray(got, np.float64)
  live = np.isfinite(want)
  err = float(np.max(np.abs(got[live] - want[live])) / max(1.0, np.max(np.abs(want[live]))))
  if (~live).any() and not np.all(got[~live] < -1e30):
    err = float("inf")
  return err


def _mesh(c):
  import jax
  import numpy as np
  devices = np.asarray(jax.devices()[:int(np.prod(c["mesh"]))]).reshape(c["mesh"])
  if c.get("explicit"):
    return jax.make_mesh(c["mesh"], c["names"], devices=devices.reshape(-1))
  return jax.sharding.Mesh(devices, c["names"])


def _ring_fn(c, mesh, extra):
  """f(q, k, v) -> (out, lse) on global arrays in sequence order."""
  import jax
  import jattn
  P = mesh.shape[c["seq"]]
  zig = c["layout"] == "zigzag"
  blocks = {n: c[n] for n in ("block_q", "block_kv") if n in c}
  perm = (lambda x: jattn.zigzag_permute(x, P)) if zig else (lambda x: x)
  unperm = (lambda x: jattn.zigzag_unpermute(x, P)) if zig else (lambda x: x)
  seq_extra = {n: (perm(x) if "segment" in n else x) for n, x in extra.items()}

  if c.get("direct"):
    PS = jax.sharding.PartitionSpec
    spec = PS(None, c["seq"])

    def body(q, k, v, ex):
      return jattn.ring_attention(q, k, v, axis_name=c["seq"], layout=c["layout"],
                                  return_residual=True, **blocks, **ex, **c["kw"])

    ex_specs = {n: (spec if "segment" in n else PS()) for n in seq_extra}
    sm = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, ex_specs),
                       out_specs=(spec, spec))
    run = lambda q, k, v: sm(q, k, v, seq_extra)
  else:
    run = lambda q, k, v: jattn.ring_attention_sharded(
        q, k, v, mesh=mesh, seq_axis=c["seq"], batch_axis=c.get("batch"),
        head_axis=c.get("head"), layout=c["layout"], return_residual=True, **blocks,
        **seq_extra, **c["kw"])

  def f(q, k, v):
    out, lse = run(perm(q), perm(k), perm(v))
    return unperm(out), unperm(lse)

  return f


def _value_and_grads(f, q, k, v, do):
  import jax
  import jax.numpy as jnp

  def loss(q, k, v):
    out, lse = f(q, k, v)
    return jnp.sum(out * do), (out, lse)

  (_, (out, lse)), (dq, dk, dv) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2),
                                                             has_aux=True))(q, k, v)
  return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def run_case(name):
  import jax
  import jattn
  c = CASES[name]
  q, k, v, do, extra = _inputs(c)
  want = _reference(c, q, k, v, do, extra)
  got = _value_and_grads(_ring_fn(c, _mesh(c), extra), q, k, v, do)
  res = {key: (_lse_err if key == "lse" else _err)(got[key], want[key]) for key in want}
  if c.get("single"):
    blocks = {n: c[n] for n in ("block_q", "block_kv") if n in c}
    single = lambda q, k, v: jattn.dot_product_attention(
        q, k, v, implementation="chunked", return_residual=True, **blocks, **extra, **c["kw"])
    one = _value_and_grads(single, q, k, v, do)
    for key in ("out", "dq", "dk", "dv"):
      res["single_" + key] = _err(got[key], one[key])
  return res


def memory_by_ring_size(Ts=16, sizes=(4, 8)):
  """Compiled per-device temporary memory of ring forward+backward with the same shard length
  Ts on rings of different sizes (the global sequence grows with P)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import jattn
  res = {}
  for P in sizes:
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:P]), ("seq",))
    T = Ts * P
    q = jax.ShapeDtypeStruct((1, T, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, 2, 8), jnp.float32)

    def loss(q, k, v):
      out = jattn.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="seq", is_causal=True,
                                         layout="zigzag", block_q=4, block_kv=4)
      return out.sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    res[f"temp_bytes_p{P}"] = int(compiled.memory_analysis().temp_size_in_bytes)
  return res


def main_cases(devices, names):
  _setup(devices)
  import jax
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  assert jax.device_count() == devices, jax.devices()
  results = {}
  for name in names or [n for n, c in CASES.items() if c["devices"] == devices]:
    start = time.perf_counter()
    try:
      results[name] = run_case(name)
      results[name]["seconds"] = time.perf_counter() - start
    except Exception:  # reported per case, so one failure does not hide the others
      results[name] = {"error": traceback.format_exc()}
  if devices == 8 and not names:
    try:
      results["memory"] = memory_by_ring_size()
    except Exception:
      results["memory"] = {"error": traceback.format_exc()}
  print("RESULTS " + json.dumps(results), flush=True)


def main_distributed(process_id, port):
  """One of two processes, 2 CPU devices each: ring over the 4 devices of both."""
  _setup(2)
  import jax
  import numpy as np
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, initialization_timeout=60)
  try:
    import jattn
    c = dict(T=32, S=32, N=4, K=2, kw=dict(is_causal=True), segments=((0, 7, 20), (0, 25)))
    q, k, v, do, extra = _inputs(c)
    want = _reference(c, q, k, v, do, extra)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("seq",))
    PS = jax.sharding.PartitionSpec
    glob = lambda x, spec: jax.make_array_from_callback(
        x.shape, jax.sharding.NamedSharding(mesh, spec), lambda idx: x[idx])
    seq = PS(None, "seq")
    P = 4
    perm = lambda x: np.asarray(jattn.zigzag_permute(x, P))
    gq, gk, gv, gdo = (glob(perm(x), seq) for x in (q, k, v, do))
    gseg = glob(perm(extra["q_segment_ids"]), seq)

    # Arrays spanning both processes must be arguments, not closed-over constants.
    def loss(q, k, v, seg, do):
      out = jattn.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="seq", layout="zigzag",
                                         q_segment_ids=seg, kv_segment_ids=seg, **c["kw"])
      return (out * do).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        gq, gk, gv, gseg, gdo)
    res = {}
    for key, arr in zip(("out", "dq", "dk", "dv"), (out,) + tuple(grads)):
      full = perm(want[key])  # the global arrays are in zigzag order
      res[key] = max(_err(np.asarray(s.data), full[s.index]) for s in arr.addressable_shards)
    res["process_count"] = jax.process_count()
    res["devices"] = jax.device_count()
    print("RESULTS " + json.dumps(res), flush=True)
  finally:
    jax.distributed.shutdown()


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--distributed", nargs=2, type=int, metavar=("PROCESS_ID", "PORT"))
  parser.add_argument("cases", nargs="*")
  a = parser.parse_args()
  if a.distributed:
    main_distributed(*a.distributed)
  else:
    main_cases(a.devices, a.cases)
