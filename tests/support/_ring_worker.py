"""Ring attention on several host CPU devices, checked against the float64 reference.

Run by tests/parallel/test_ring.py in a subprocess, because the number of host devices is fixed when
JAX starts (``--xla_force_host_platform_device_count``) and the rest of the suite runs on one:

  python tests/support/_ring_worker.py --devices 8 [case ...]

(``--out FILE`` runs the same in a child process and writes its results to FILE: how
tests/support/_ring_runs.py starts it in the background.)

For every case it runs ring attention forward and backward (value_and_grad of sum(out * dout)
w.r.t. the global query, key and value, so zigzag permutations are inside the differentiated
function) and prints one JSON line {case: {"out": err, "lse": err, "dq": err, ...}} with
scale-relative max errors against tests/support/reference.py (float64 NumPy) and, for cases marked
``single``, against single-device jattn.dot_product_attention. Cases with ``dtype="bfloat16"``
run on bfloat16 inputs and also report ``plain_*``: the errors of a plain bfloat16 dense
computation (`_plain_fn`: every op's result rounded to bfloat16) against the same reference, for
the FlashAttention rule "ring error <= 2 x plain bfloat16 error + 1e-3". A case that raises
reports {"error": traceback}. With 4 devices (and no case names) it also runs the split-KV
decoding recipe of docs/ring.md, executed from the page's own code block, and reports its errors
as "split_kv_recipe".

``--distributed PROCESS_ID ADDRESS`` instead runs one process of a 2-process jax.distributed job (2
local devices each, gloo CPU collectives over TCP on this host), the coordinator at ADDRESS
(tests/parallel/test_ring.py passes ``unix:<fresh temporary directory>/coordinator``), and reports
the errors of its own shards.
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
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
  )
  os.environ["JAX_PLATFORMS"] = "cpu"
  # jattn: the one the suite imports (tests/conftest.py passes it on through PYTHONPATH).
  sys.path.insert(0, HERE)


# Each case: mesh shape and axis names, the wrapper's axes, problem shape and keyword options.
# "direct" calls ring_attention inside a hand-written jax.shard_map instead of the wrapper;
# "explicit" builds the mesh with Explicit axis types (jax.make_mesh's default).
CASES = {
  # ---- 8 devices ----
  "p8_contiguous_full_gqa_lengths_softcap": dict(
    devices=8,
    mesh=(8,),
    names=("seq",),
    seq="seq",
    T=64,
    S=64,
    N=4,
    K=2,
    layout="contiguous",
    block_q=4,
    block_kv=4,
    kw=dict(logits_soft_cap=3.0, scale=0.7),
    q_lengths=(60, 21),
    kv_lengths=(64, 35),
  ),
  "p8_zigzag_causal_gqa_segments": dict(
    devices=8,
    mesh=(8,),
    names=("seq",),
    seq="seq",
    T=64,
    S=64,
    N=4,
    K=2,
    layout="zigzag",
    block_q=4,
    block_kv=4,
    kw=dict(is_causal=True),
    segments=((0, 13, 30, 47), (0, 5, 50, 61)),
  ),
  # A ring of 4 inside a (data, seq) mesh; T != S, MQA, blocks that do not divide the shards.
  "p8_data2_seq4_bottom_right_mqa_ragged_lengths": dict(
    devices=8,
    mesh=(2, 4),
    names=("data", "seq"),
    seq="seq",
    batch="data",
    T=32,
    S=48,
    N=4,
    K=1,
    layout="contiguous",
    block_q=3,
    block_kv=5,
    kw=dict(is_causal="bottom_right"),
    q_lengths=(32, 19),
    kv_lengths=(41, 48),
  ),
  # Bottom-right causal in the zigzag layout, T < S (offset S - T = 32 in global positions;
  # the chunk lengths of queries (2) and keys (4) differ).
  "p8_zigzag_bottom_right_T_lt_S_gqa": dict(
    devices=8,
    mesh=(8,),
    names=("seq",),
    seq="seq",
    T=32,
    S=64,
    N=4,
    K=2,
    layout="zigzag",
    block_q=2,
    block_kv=3,
    kw=dict(is_causal="bottom_right"),
  ),
  # A window in the contiguous layout, measured from the bottom-right diagonal, T < S, with
  # blocks that do not divide the shards.
  "p8_contiguous_bottom_right_window_lengths": dict(
    devices=8,
    mesh=(8,),
    names=("seq",),
    seq="seq",
    T=32,
    S=64,
    N=4,
    K=2,
    layout="contiguous",
    block_q=3,
    block_kv=5,
    kw=dict(is_causal="bottom_right", local_window_size=(13, 2)),
    kv_lengths=(64, 45),
  ),
  # bfloat16 over 8 ring steps that all compute (no causal mask): the running output and lse
  # of the merge must stay float32.
  "p8_contiguous_full_gqa_bf16": dict(
    devices=8,
    mesh=(8,),
    names=("seq",),
    seq="seq",
    T=64,
    S=64,
    N=4,
    K=2,
    layout="contiguous",
    block_q=4,
    block_kv=4,
    kw=dict(),
    dtype="bfloat16",
  ),
  "p8_seq4_heads2_zigzag_causal_segments": dict(
    devices=8,
    mesh=(4, 2),
    names=("seq", "heads"),
    seq="seq",
    head="heads",
    T=32,
    S=32,
    N=4,
    K=2,
    layout="zigzag",
    kw=dict(is_causal=True),
    segments=((0, 9, 20), (0, 16)),
  ),
  # Causality and a window measured in positions (q_positions, kv_positions: each device's
  # slices, permuted like the segment ids): two packed documents per example whose positions
  # restart inside a shard, no segment ids (a query also sees the other document's keys at
  # positions in its window), in the zigzag layout, against single-device attention too.
  "p8_zigzag_positions_restart_causal_window": dict(
    devices=8,
    mesh=(8,),
    names=("seq",),
    seq="seq",
    T=64,
    S=64,
    N=4,
    K=2,
    layout="zigzag",
    block_q=3,
    block_kv=2,
    kw=dict(is_causal=True, local_window_size=(9, 0)),
    restarts=((0, 21), (0, 45)),
    positions="packed",
    single=True,
  ),
  # A cache left-padded by each example's own amount (positions 0 under the padding, hidden by
  # segment ids), the queries its last T tokens: a ring of 4 in a (data, seq) mesh, T < S.
  "p8_data2_seq4_contiguous_positions_padded_cache": dict(
    devices=8,
    mesh=(2, 4),
    names=("data", "seq"),
    seq="seq",
    batch="data",
    T=32,
    S=48,
    N=4,
    K=2,
    layout="contiguous",
    block_q=4,
    block_kv=5,
    kw=dict(is_causal=True),
    positions="padded",
    single=True,
  ),
  # ---- 4 devices ----
  "p4_direct_contiguous_causal_residual": dict(
    devices=4,
    mesh=(4,),
    names=("seq",),
    seq="seq",
    T=32,
    S=32,
    N=4,
    K=2,
    layout="contiguous",
    block_q=4,
    block_kv=4,
    kw=dict(is_causal=True),
    direct=True,
    single=True,
  ),
  "p4_explicit_zigzag_causal_lengths": dict(
    devices=4,
    mesh=(4,),
    names=("seq",),
    seq="seq",
    T=32,
    S=32,
    N=4,
    K=2,
    layout="zigzag",
    kw=dict(is_causal=True),
    q_lengths=(32, 11),
    explicit=True,
    single=True,
  ),
  "p4_contiguous_full_segments": dict(
    devices=4,
    mesh=(4,),
    names=("seq",),
    seq="seq",
    T=32,
    S=32,
    N=4,
    K=2,
    layout="contiguous",
    kw=dict(),
    segments=((0, 3, 17), (0, 30)),
  ),
  "p4_zigzag_full_gqa_window_lengths": dict(
    devices=4,
    mesh=(4,),
    names=("seq",),
    seq="seq",
    T=32,
    S=32,
    N=4,
    K=2,
    layout="zigzag",
    block_q=2,
    block_kv=4,
    kw=dict(local_window_size=(9, 4)),
    kv_lengths=(32, 27),
  ),
  # The same window, contiguous layout (window edges cross shard boundaries).
  "p4_contiguous_full_gqa_window_lengths": dict(
    devices=4,
    mesh=(4,),
    names=("seq",),
    seq="seq",
    T=32,
    S=32,
    N=4,
    K=2,
    layout="contiguous",
    block_q=2,
    block_kv=4,
    kw=dict(local_window_size=(9, 4)),
    q_lengths=(29, 32),
    kv_lengths=(32, 27),
  ),
  # Bottom-right causal, zigzag, T > S: the first T - S = 32 queries see no key at all.
  "p4_zigzag_bottom_right_T_gt_S_lengths": dict(
    devices=4,
    mesh=(4,),
    names=("seq",),
    seq="seq",
    T=64,
    S=32,
    N=4,
    K=2,
    layout="zigzag",
    block_q=4,
    block_kv=2,
    kw=dict(is_causal="bottom_right"),
    q_lengths=(64, 50),
    kv_lengths=(32, 21),
  ),
  # implementation="dense" per shard pair (one tile per pair of zigzag chunks), reached
  # through a sequence whose first name (splash) cannot serve a ring.
  "p4_dense_zigzag_causal_segments_lengths": dict(
    devices=4,
    mesh=(4,),
    names=("seq",),
    seq="seq",
    T=32,
    S=32,
    N=4,
    K=2,
    layout="zigzag",
    kw=dict(is_causal=True, implementation=("splash", "dense")),
    segments=((0, 7, 19), (0, 25)),
    kv_lengths=(32, 29),
  ),
  "p4_zigzag_bottom_right_window_softcap_bf16": dict(
    devices=4,
    mesh=(4,),
    names=("seq",),
    seq="seq",
    T=32,
    S=48,
    N=4,
    K=1,
    layout="zigzag",
    block_q=2,
    block_kv=3,
    kw=dict(is_causal="bottom_right", local_window_size=(20, 0), logits_soft_cap=5.0),
    dtype="bfloat16",
  ),
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
  if c.get("dtype", "float32") != "float32":
    import jax.numpy as jnp

    # The reference sees the same rounded values, upcast.
    q, k, v, do = (x.astype(jnp.dtype(c["dtype"])) for x in (q, k, v, do))
  extra = {}
  if "q_lengths" in c:
    extra["query_seq_lengths"] = np.asarray(c["q_lengths"], np.int32)
  if "kv_lengths" in c:
    extra["key_value_seq_lengths"] = np.asarray(c["kv_lengths"], np.int32)
  if "segments" in c:
    extra["q_segment_ids"] = _segment_ids(c["segments"], c["T"])
    extra["kv_segment_ids"] = _segment_ids(c["segments"], c["S"])
  if "positions" in c:
    extra.update(_positions(c))
  return q, k, v, do, extra


def _positions(c):
  """The case's q_positions (B, T) and kv_positions (B, S) in sequence order: "packed", two
  documents per example whose positions restart (at the case's ``restarts``); "padded", a
  cache left-padded by 10 and 0 slots (padding at position 0, hidden by segment ids), the queries
  its last T tokens."""
  import numpy as np

  T, S = c["T"], c["S"]
  if c["positions"] == "packed":
    ids = _segment_ids(c["restarts"], S)
    starts = [np.searchsorted(ids[b], ids[b]) for b in range(len(ids))]
    pos = (np.arange(S)[None] - np.stack(starts)).astype(np.int32)
    return dict(q_positions=pos, kv_positions=pos)
  pad = np.asarray([10, 0])[:, None]
  kv = np.maximum(np.arange(S)[None] - pad, 0).astype(np.int32)
  return dict(
    q_positions=kv[:, S - T :],
    kv_positions=kv,
    q_segment_ids=np.ones((2, T), np.int32),
    kv_segment_ids=(np.arange(S)[None] >= pad).astype(np.int32),
  )


def _by_position(q_pos, kv_pos, causal, window):
  """(B, 1, T, S): key s visible to query t by their positions (float64 reference's rule)."""
  import numpy as np

  qp, kp = np.asarray(q_pos)[:, None, :, None], np.asarray(kv_pos)[:, None, None, :]
  ok = np.ones(np.broadcast_shapes(qp.shape, kp.shape), bool)
  if causal is not None:
    ok &= kp <= qp
  if window is not None:
    ok &= (kp >= qp - window[0]) & (kp <= qp + window[1])
  return ok


def _reference(c, q, k, v, do, extra):
  import reference as ref

  B, T, N, _ = q.shape
  S = k.shape[1]
  kw = c["kw"]
  causal = kw.get("is_causal", False)
  causal = None if causal is False else ("top_left" if causal is True else causal)
  window = kw.get("local_window_size")
  positions = "q_positions" in extra
  vis = ref.visible_mask(
    B,
    N,
    T,
    S,
    causal=None if positions else causal,
    window=None if positions else window,
    q_lengths=extra.get("query_seq_lengths"),
    kv_lengths=extra.get("key_value_seq_lengths"),
    q_seg=extra.get("q_segment_ids"),
    kv_seg=extra.get("kv_segment_ids"),
  )
  if positions:
    vis = vis & _by_position(extra["q_positions"], extra["kv_positions"], causal, window)
  out, lse, cache = ref.attention(
    q, k, v, visible=vis, scale=kw.get("scale"), soft_cap=kw.get("logits_soft_cap")
  )
  dq, dk, dv, _, _ = ref.grads(cache, do)
  return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), vis


def _plain_fn(c, vis):
  """Plain dense attention in the input dtype, the baseline of the 16-bit error rule, as
  FlashAttention's reference without upcasting (PyTorch ops on bfloat16 tensors): every op's
  result is rounded to the input dtype -- the scores, the soft cap, the probabilities, the lse, the
  output -- while each op computes internally in float32 (matmuls accumulate in float32; the
  softmax is one op, like torch.softmax, and so is its backward). Empty rows: out 0, lse -inf."""
  import jax
  import jax.numpy as jnp

  kw = c["kw"]
  G = c["N"] // c["K"]
  cap = kw.get("logits_soft_cap")
  vis = jnp.asarray(vis)

  def softmax_and_lse(s):  # (B, N, T, S) scores in float32
    s = jnp.where(vis, s, -jnp.inf)
    m = jax.lax.stop_gradient(s.max(axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    den = e.sum(axis=-1, keepdims=True)
    ok = den > 0
    p = jnp.where(ok, e / jnp.where(ok, den, 1.0), 0.0)
    return p, jnp.where(ok, jnp.log(jnp.where(ok, den, 1.0)) + m, -jnp.inf)[..., 0]

  def f(q, k, v):
    dt = q.dtype
    scale = kw.get("scale", 1.0 / float(q.shape[-1]) ** 0.5)
    kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, kr) * scale
    if cap is not None:
      s = cap * jnp.tanh(s / cap)
    p, lse = softmax_and_lse(s.astype(jnp.float32))
    p, lse = p.astype(dt), lse.astype(dt)
    return jnp.einsum("bnts,bsnh->btnh", p, vr), jnp.transpose(lse, (0, 2, 1))

  return f


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

  devices = np.asarray(jax.devices()[: int(np.prod(c["mesh"]))]).reshape(c["mesh"])
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
  per_token = lambda n: "segment" in n or "positions" in n
  seq_extra = {n: (perm(x) if per_token(n) else x) for n, x in extra.items()}

  if c.get("direct"):
    PS = jax.sharding.PartitionSpec
    spec = PS(None, c["seq"])

    def body(q, k, v, ex):
      return jattn.ring_attention(
        q,
        k,
        v,
        axis_name=c["seq"],
        layout=c["layout"],
        return_residual=True,
        **blocks,
        **ex,
        **c["kw"],
      )

    ex_specs = {n: (spec if per_token(n) else PS()) for n in seq_extra}
    sm = jax.shard_map(
      body, mesh=mesh, in_specs=(spec, spec, spec, ex_specs), out_specs=(spec, spec)
    )
    run = lambda q, k, v: sm(q, k, v, seq_extra)
  else:
    run = lambda q, k, v: jattn.ring_attention_sharded(
      q,
      k,
      v,
      mesh=mesh,
      seq_axis=c["seq"],
      batch_axis=c.get("batch"),
      head_axis=c.get("head"),
      layout=c["layout"],
      return_residual=True,
      **blocks,
      **seq_extra,
      **c["kw"],
    )

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

  (_, (out, lse)), (dq, dk, dv) = jax.jit(
    jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  )(q, k, v)
  return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def run_case(name):
  import reference as ref

  import jattn

  c = CASES[name]
  q, k, v, do, extra = _inputs(c)
  want, vis = _reference(c, q, k, v, do, extra)
  got = _value_and_grads(_ring_fn(c, _mesh(c), extra), q, k, v, do)
  res = {key: (_lse_err if key == "lse" else _err)(got[key], want[key]) for key in want}
  if c.get("dtype", "float32") != "float32":
    assert all(got[key].dtype == q.dtype for key in want), {k: got[k].dtype for k in want}
    plain = _value_and_grads(_plain_fn(c, vis), q, k, v, do)
    for key in want:
      res["plain_" + key] = (_lse_err if key == "lse" else _err)(plain[key], want[key])
    # The error of rounding the exact output to the input dtype: the project's 16-bit rule.
    res["rounded_out"] = _err(ref.round_to_dtype(want["out"], q.dtype), want["out"])
  if c.get("single"):
    blocks = {n: c[n] for n in ("block_q", "block_kv") if n in c}
    single = lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation="chunked", return_residual=True, **blocks, **extra, **c["kw"]
    )
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
      out = jattn.ring_attention_sharded(
        q, k, v, mesh=mesh, seq_axis="seq", is_causal=True, layout="zigzag", block_q=4, block_kv=4
      )
      return out.sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    res[f"temp_bytes_p{P}"] = int(compiled.memory_analysis().temp_size_in_bytes)
  return res


def _doc_code_block(path, marker):
  """The ```python block of a Markdown page that contains ``marker``."""
  import re

  with open(path) as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
  found = [b for b in blocks if marker in b]
  assert len(found) == 1, f"{path}: expected one python block with {marker!r}, found {len(found)}"
  return found[0]


def split_kv_recipe(P=4):
  """Split-KV decoding exactly as docs/ring.md writes it (its code block, executed), against the
  float64 reference: one query per sequence, a GQA cache of S = 32 sharded over P devices, and
  cache lengths that end inside a shard, on a shard boundary, fill the cache, hold a single
  position, or are 0 (nothing to attend to anywhere)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import reference as ref

  import jattn

  B, S, N, K, H = 5, 32, 4, 2, 8
  L = S // P
  rng = np.random.default_rng(1)
  q = rng.standard_normal((B, 1, N, H)).astype(np.float32)
  k = rng.standard_normal((B, S, K, H)).astype(np.float32)
  v = rng.standard_normal((B, S, K, H)).astype(np.float32)
  lengths = np.asarray([13, S, 2 * L, 0, 1], np.int32)
  # Garbage past each length (an uninitialised cache): the recipe must never look there.
  k_cache, v_cache = k.copy(), v.copy()
  for b, n in enumerate(lengths):
    k_cache[b, n:] = np.nan
    v_cache[b, n:] = np.inf
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:P]), ("kv",))
  code = _doc_code_block(os.path.join(HERE, "..", "..", "docs", "ring.md"), "def decode(")
  namespace = dict(jax=jax, jnp=jnp, jattn=jattn, mesh=mesh, L=L)
  exec(compile(code, "docs/ring.md (split-KV block)", "exec"), namespace)
  out, lse = namespace["decode"](q, k_cache, v_cache, lengths)
  vis = ref.visible_mask(B, N, 1, S, kv_lengths=lengths)
  want, want_lse, _ = ref.attention(q, k, v, visible=vis)
  return dict(
    out=_err(out, want),
    lse=_lse_err(lse, want_lse),
    empty_row_zero=bool(np.all(np.asarray(out)[3] == 0.0)),
    finite=bool(np.isfinite(np.asarray(out)).all()),
  )


# Ring attention against the single-device call on the same global inputs, for what ring
# attention evaluates on global indices: mask objects, score_mod (with an array it closes over,
# whose gradient is compared too), sinks and dropout (the same dropped entries, or the outputs
# would differ). Each feature set runs in both layouts; on 8 devices the batch is sharded too,
# so batch indices must be global for the mask function, score_mod and the dropout hash.
SINGLE_FEATURES = {
  "chunked_local_causal_sinks_dropout": lambda M, T, tbl: dict(
    mask=M.chunked_local(12) & M.causal(), sinks=True, dropout_rate=0.25
  ),
  # prefix_lm or a function of batch and head, a window, dropout and a score_mod with a table.
  "prefix_lm_from_function_window_dropout_score_mod_table": lambda M, T, tbl: dict(
    mask=M.prefix_lm(11)
    | M.from_function(lambda b, h, q, k: ((k <= q) & ((q - k) % 5 != 2)) | ((b == 1) & (h == 3))),
    local_window_size=(20, 20),
    dropout_rate=0.2,
    score_mod=lambda s, b, h, q, k: (
      s
      + tbl[k - q + T] * (h + 1).astype(s.dtype)
      - 0.1 * ((b + 1) * jnp_abs(q - k)).astype(s.dtype) * tbl[h]
    ),
  ),
}


def jnp_abs(x):
  import jax.numpy as jnp

  return jnp.abs(x)


def vs_single(devices):
  """{case: max errors of ring vs single-device (out, dq, dk, dv, dsinks, dtable)}."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jattn
  from jattn import masks as M

  # A value head size of its own (Hv != H, as MLA's) rides along with every feature.
  B, T, N, K, H, Hv = 2, 32, 4, 2, 8, 12
  keys = jax.random.split(jax.random.key(3), 6)
  q = jax.random.normal(keys[0], (B, T, N, H), jnp.float32)
  k = jax.random.normal(keys[1], (B, T, K, H), jnp.float32)
  v = jax.random.normal(keys[2], (B, T, K, Hv), jnp.float32)
  do = jax.random.normal(keys[3], (B, T, N, Hv), jnp.float32)
  table = jax.random.normal(keys[4], (2 * T,), jnp.float32)
  sinks = jnp.linspace(-0.5, 1.0, N, dtype=jnp.float32)
  rng = jax.random.key(11)
  shape, names, batch = (
    ((2, 4), ("data", "seq"), "data") if devices == 8 else ((4,), ("seq",), None)
  )
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]).reshape(shape), names)
  P = mesh.shape["seq"]
  out = {}
  for feature, make in SINGLE_FEATURES.items():

    def kwargs(snk, tbl, make=make):
      kw = make(M, T, tbl)
      if kw.pop("sinks", False):
        kw["sinks"] = snk
      if kw.get("dropout_rate"):
        kw["dropout_rng"] = rng
      return kw

    def single(q, k, v, snk, tbl):
      return jattn.dot_product_attention(
        q, k, v, implementation="chunked", block_q=8, block_kv=8, **kwargs(snk, tbl)
      )

    # One single-device answer per feature serves both layouts.
    want = _out_and_grads(single, do, q, k, v, sinks, table)
    # Sanity: the feature must matter (a sink or table gradient of zero would compare equal).
    used = {key: bool(np.abs(np.asarray(want[key])).max() > 0) for key in ("dsinks", "dtable")}
    for layout in ("contiguous", "zigzag"):
      perm = (lambda x: jattn.zigzag_permute(x, P)) if layout == "zigzag" else (lambda x: x)
      unperm = (lambda x: jattn.zigzag_unpermute(x, P)) if layout == "zigzag" else (lambda x: x)

      def ring(q, k, v, snk, tbl, perm=perm, unperm=unperm, layout=layout):
        o = jattn.ring_attention_sharded(
          perm(q),
          perm(k),
          perm(v),
          mesh=mesh,
          seq_axis="seq",
          batch_axis=batch,
          layout=layout,
          block_q=4,
          block_kv=4,
          **kwargs(snk, tbl),
        )
        return unperm(o)

      got = _out_and_grads(ring, do, q, k, v, sinks, table)
      out[f"{feature}/{layout}"] = dict(
        {key: _err(got[key], want[key]) for key in got},
        used_sinks=used["dsinks"],
        used_table=used["dtable"],
      )
  if devices == 4:
    out["typed_shard_map_score_mod_sinks"] = _typed_vs_single(mesh, q, k, v, do, sinks, table)
  return out


def _out_and_grads(f, do, *args):
  """f's output and the gradients of sum(f * do) for every argument, in one compiled call."""
  import jax
  import jax.numpy as jnp

  def loss(*a):
    o = f(*a)
    return jnp.sum(o * do), o

  (_, val), grads = jax.jit(
    jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)
  )(*args)
  return dict(zip(("out", "dq", "dk", "dv", "dsinks", "dtable"), (val,) + tuple(grads)))


def _typed_vs_single(mesh, q, k, v, do, sinks, table):
  """ring_attention called in a hand-written shard_map with check_vma=True: the gradients of
  the sinks and of score_mod's table (arrays that are the same on every device) are summed over
  the ring, once."""
  import jax

  import jattn

  PS = jax.sharding.PartitionSpec
  T = q.shape[1]
  mod = lambda tbl: lambda s, b, h, qi, ki: s + tbl[ki - qi + T]

  def ring(q, k, v, snk, tbl):
    body = lambda q, k, v, snk, tbl: jattn.ring_attention(
      q, k, v, axis_name="seq", is_causal=True, sinks=snk, score_mod=mod(tbl), block_q=4, block_kv=4
    )
    sp = PS(None, "seq")
    return jax.shard_map(
      body, mesh=mesh, in_specs=(sp, sp, sp, PS(), PS()), out_specs=sp, check_vma=True
    )(q, k, v, snk, tbl)

  single = lambda q, k, v, snk, tbl: jattn.dot_product_attention(
    q, k, v, is_causal=True, sinks=snk, score_mod=mod(tbl)
  )
  got = {}
  for name, f in (("ring", ring), ("single", single)):
    got[name] = _out_and_grads(f, do, q, k, v, sinks, table)
  return {key: _err(got["ring"][key], got["single"][key]) for key in got["ring"]}


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
  if devices == 4 and not names:
    try:
      results["split_kv_recipe"] = split_kv_recipe()
    except Exception:
      results["split_kv_recipe"] = {"error": traceback.format_exc()}
  if not names:
    try:
      results["vs_single"] = vs_single(devices)
    except Exception:
      results["vs_single"] = {"error": traceback.format_exc()}
  print("RESULTS " + json.dumps(results), flush=True)


def write_run(devices, names, out):
  """Run the cases in a child process and write {"rc", "results", "stderr"} to ``out``, whole
  (written beside it, then renamed): tests/support/_ring_runs.py's workers poll for the file."""
  import subprocess

  proc = subprocess.run(
    [sys.executable, os.path.abspath(__file__), "--devices", str(devices), *names],
    capture_output=True,
    text=True,
    timeout=900,
  )
  results = None
  for line in proc.stdout.splitlines():
    if line.startswith("RESULTS "):
      results = json.loads(line[len("RESULTS ") :])
  with open(out + ".part", "w") as f:
    json.dump({"rc": proc.returncode, "results": results, "stderr": proc.stderr[-8000:]}, f)
  os.replace(out + ".part", out)


def main_distributed(process_id, address):
  """One of two processes, 2 CPU devices each: ring over the 4 devices of both."""
  _setup(2)
  import jax
  import numpy as np

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  # The coordinator (process 0) listens on ADDRESS itself, not on jax's default "[::]:port".
  jax.distributed.initialize(
    coordinator_address=address,
    coordinator_bind_address=address,
    num_processes=2,
    process_id=process_id,
    initialization_timeout=60,
  )
  try:
    import jattn

    c = dict(T=32, S=32, N=4, K=2, kw=dict(is_causal=True), segments=((0, 7, 20), (0, 25)))
    q, k, v, do, extra = _inputs(c)
    want, _ = _reference(c, q, k, v, do, extra)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("seq",))
    PS = jax.sharding.PartitionSpec
    glob = lambda x, spec: jax.make_array_from_callback(
      x.shape, jax.sharding.NamedSharding(mesh, spec), lambda idx: x[idx]
    )
    seq = PS(None, "seq")
    P = 4
    perm = lambda x: np.asarray(jattn.zigzag_permute(x, P))
    gq, gk, gv, gdo = (glob(perm(x), seq) for x in (q, k, v, do))
    gseg = glob(perm(extra["q_segment_ids"]), seq)

    # Arrays spanning both processes must be arguments, not closed-over constants.
    def loss(q, k, v, seg, do):
      out = jattn.ring_attention_sharded(
        q,
        k,
        v,
        mesh=mesh,
        seq_axis="seq",
        layout="zigzag",
        q_segment_ids=seg,
        kv_segment_ids=seg,
        **c["kw"],
      )
      return (out * do).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
      gq, gk, gv, gseg, gdo
    )
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
  parser.add_argument("--distributed", nargs=2, metavar=("PROCESS_ID", "ADDRESS"))
  parser.add_argument("--out", help="run in a child process; write its results to this file")
  parser.add_argument("cases", nargs="*")
  a = parser.parse_args()
  if a.out:
    write_run(a.devices, a.cases, a.out)
  elif a.distributed:
    main_distributed(int(a.distributed[0]), a.distributed[1])
  else:
    main_cases(a.devices, a.cases)
