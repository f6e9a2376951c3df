"""One command for a lent accelerator: correctness, determinism and speed of every backend.

    PYTHONPATH=. python benchmarks/device_check.py --out device_check  # on a GPU or TPU
    python benchmarks/device_check.py --smoke --out /tmp/dc            # any machine, seconds

Sections, each a list of rows in ``<out>.json`` and a markdown table in ``<out>.md``:

- ``correctness``: every implementation that runs on this device (dense, chunked, None, and the
  platform's fused ones: cudnn / splash; paged: the XLA walk and the Pallas kernel), forward and
  gradients, against a float64 NumPy reference on the host (small shapes); error relative to
  the reference's largest magnitude, and to the error of rounding the reference to the dtype.
- ``determinism``: each call run twice: whether the bits are equal (forward and gradients).
- ``batch_invariance``: each implementation's output and log-sum-exp for a sequence alone and in
  a batch of four of other lengths (prefill and decode rows): whether the bits are equal.
- ``speed``: forward+backward of full, causal, window, segments, soft cap and sinks at
  T = 1k .. 16k, bfloat16, against `jax.nn.dot_product_attention` (xla and cudnn): medians of
  interleaved runs, TFLOP/s of the useful work (causal: half) and % of the device's peak.
- ``decode``: one paged decoding step (B = 8, N = 32, K = 8, H = 128, 8k..32k cached tokens,
  bfloat16 pages of 16): bytes of the pool read per second, % of the memory bandwidth.

``--smoke`` runs every section on tiny shapes with one repeat, each correctness case on one
implementation in turn and two speed cases (the suite runs it on the CPU so the script cannot
rot); its figures mean nothing. A section that fails records its error and the
script goes on: a lent device's minutes are not spent twice. Budget: about 5 minutes on one
H100/H200 (reasoned from the shapes; not yet run on one).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn.bench import interleaved

# Dense bfloat16 matmul peak and memory bandwidth per device kind (vendors' figures).
PEAKS = {
  "H200": (989e12, 4.8e12),
  "H100": (989e12, 3.35e12),
  "A100": (312e12, 2.0e12),
  "TPU v5 lite": (197e12, 0.82e12),
  "TPU v5": (459e12, 2.77e12),
  "TPU v4": (275e12, 1.2e12),
  "TPU v6 lite": (918e12, 1.64e12),
}

SPEED_CASES = {
  "full": {},
  "causal": dict(is_causal=True),
  "window": dict(local_window_size=(1024, 0)),
  "segments": dict(segments=4),
  "soft cap": dict(logits_soft_cap=30.0),
  "sinks": dict(sinks=True, is_causal=True),
}


def peaks():
  kind = jax.devices()[0].device_kind
  for name, figures in PEAKS.items():
    if name in kind:
      return kind, figures
  return kind, (None, None)


def implementations():
  """The implementations to check here: the XLA ones and this platform's fused kernels."""
  backend = jax.default_backend()
  fused = {"gpu": ["cudnn", "pallas_gpu"], "tpu": ["splash"]}.get(backend, [])
  return ["dense", "chunked", None] + fused


# --------------------------------------------------------------------------------------------
# The float64 reference.
# --------------------------------------------------------------------------------------------


def reference(q, k, v, *, is_causal=False, window=None, cap=None, sinks=None, seg=None):
  """float64 (B, T, N, H) attention, bottom-right causal, a (left, right) window."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  k = np.repeat(k, N // K, axis=2)
  v = np.repeat(v, N // K, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(H)
  if cap is not None:
    s = cap * np.tanh(s / cap)
  t = np.arange(T)[:, None] + S - T
  j = np.arange(S)[None, :]
  vis = np.ones((T, S), bool)
  if is_causal:
    vis &= j <= t
  if window is not None:
    vis &= (j >= t - window[0]) & (j <= t + window[1])
  vis = np.broadcast_to(vis, (B, 1, T, S))
  if seg is not None:
    vis = vis & (seg[:, None, :, None] == seg[:, None, None, :])
  s = np.where(vis, s, -np.inf)
  m = s.max(-1, keepdims=True)
  if sinks is not None:
    m = np.maximum(m, np.asarray(sinks, np.float64)[None, :, None, None])
  m = np.where(np.isfinite(m), m, 0)
  p = np.exp(s - m)
  denom = p.sum(-1, keepdims=True)
  if sinks is not None:
    denom = denom + np.exp(np.asarray(sinks, np.float64)[None, :, None, None] - m)
  out = np.einsum("bnts,bsnh->btnh", p / np.where(denom > 0, denom, 1), v)
  return out


def reference_f32(q, k, v, *, is_causal=False, window=None, cap=None, sinks=None, seg=None):
  """The same attention in float32 jax.numpy at full matmul precision, for gradients on the
  device (written out, sharing nothing with jattn)."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
  hi = jax.lax.Precision.HIGHEST
  s = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) / math.sqrt(H)
  if cap is not None:
    s = cap * jnp.tanh(s / cap)
  t = jnp.arange(T)[:, None] + S - T
  j = jnp.arange(S)[None, :]
  vis = jnp.ones((T, S), bool)
  if is_causal:
    vis &= j <= t
  if window is not None:
    vis &= (j >= t - window[0]) & (j <= t + window[1])
  vis = jnp.broadcast_to(vis, (B, 1, T, S))
  if seg is not None:
    vis = vis & (seg[:, None, :, None] == seg[:, None, None, :])
  s = jnp.where(vis, s, -1e30)
  if sinks is not None:
    snk = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[None, :, None, None], (B, N, T, 1))
    p = jax.nn.softmax(jnp.concatenate([s, snk], -1), axis=-1)[..., :-1]
  else:
    p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", p, v, precision=hi)


def _case_kwargs(case, T, N, key):
  kw = {k: v for k, v in case.items() if k not in ("segments", "sinks")}
  ref = dict(
    is_causal=bool(case.get("is_causal")),
    window=case.get("local_window_size"),
    cap=case.get("logits_soft_cap"),
  )
  if case.get("segments"):
    seg = np.repeat(np.arange(case["segments"]), -(-T // case["segments"]))[:T]
    seg = np.broadcast_to(seg, (1, T)).astype(np.int32)
    kw.update(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg))
    ref["seg"] = seg
  if case.get("sinks"):
    sinks = jax.random.normal(key, (N,), jnp.float32)
    kw["sinks"] = sinks
    ref["sinks"] = np.asarray(sinks)
  if kw.get("is_causal"):
    kw["is_causal"] = "bottom_right"
  return kw, ref


# --------------------------------------------------------------------------------------------
# Sections.
# --------------------------------------------------------------------------------------------


def _out_and_grads(f, ct, q, k, v):
  """f(q, k, v) and its pullback of ``ct`` (float32, taken in the output's dtype: the gradients
  of sum(f.astype(float32) * ct) in q, k, v)."""
  out, pull = jax.vjp(f, q, k, v)
  return out, pull(ct.astype(out.dtype))


def correctness(smoke: bool):
  """Forward and gradients of every implementation against float64, and run-twice bits."""
  rows, bits = [], []
  B, T, N, K, H = (1, 64, 4, 2, 32) if smoke else (2, 512, 8, 2, 64)
  keys = jax.random.split(jax.random.key(0), 5)
  for dtype in (jnp.float32, jnp.bfloat16):
    q, k, v = (
      jax.random.normal(kk, (B, T, n, H), jnp.float32).astype(dtype)
      for kk, n in zip(keys[:3], (N, K, K))
    )
    ct = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
    impls = implementations()
    for n, (name, case) in enumerate(SPEED_CASES.items()):
      if smoke and n % 2 != (dtype == jnp.bfloat16):  # smoke: each case in one dtype
        continue
      kw, ref_kw = _case_kwargs(case, T, N, keys[4])
      want = reference(q, k, v, **ref_kw)
      want_g = jax.jit(
        jax.grad(lambda q, k, v: (reference_f32(q, k, v, **ref_kw) * ct).sum(), argnums=(0, 1, 2))
      )(*(x.astype(jnp.float32) for x in (q, k, v)))
      # smoke: each case on one implementation, rotated (each implementation in both dtypes).
      for impl in [impls[n % len(impls)]] if smoke else impls:
        row = dict(dtype=jnp.dtype(dtype).name, case=name, implementation=str(impl))
        try:
          # The output and its gradients in one program (one compile, as a training step).
          g = jax.jit(
            lambda q, k, v, impl=impl, kw=kw: _out_and_grads(
              lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation=impl, **kw),
              ct,
              q,
              k,
              v,
            )
          )
          raw, grads = g(q, k, v)
          out = np.asarray(raw, np.float64)
          scale = max(np.abs(want).max(), 1e-30)
          rounding = np.abs(np.asarray(jnp.asarray(want, dtype), np.float64) - want).max()
          row.update(
            status="ok",
            err=float(np.abs(out - want).max() / scale),
            err_over_rounding=float(np.abs(out - want).max() / max(rounding, 1e-30)),
          )
          row["grad_err"] = float(
            max(
              np.abs(np.asarray(a, np.float32) - np.asarray(b)).max()
              / max(np.abs(np.asarray(b)).max(), 1e-30)
              for a, b in zip(grads, want_g)
            )
          )
          bitwise = lambda a, b: bool(
            np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
          )
          raw2, grads2 = g(q, k, v)
          same = bitwise(raw, raw2)
          same_g = all(bitwise(a, b) for a, b in zip(grads, grads2))
          bits.append(dict(row, forward_bitwise=same, grads_bitwise=same_g))
        except Exception as e:
          row.update(status=type(e).__name__, error=str(e).splitlines()[0][:200])
        rows.append(row)
  return rows, bits


def batch_invariance(smoke: bool):
  """Each implementation's output and log-sum-exp for a sequence alone and in a batch of four with
  other lengths (bottom-right causal, bfloat16): whether the bits are equal. jattn's own paths are
  batch-invariant by construction on the CPU (tests/properties/test_batch_invariance.py); on a
  device this shows whether XLA's matmuls and the fused kernels keep it."""
  rows = []
  B, T, S, N, K, H = (4, 8, 64, 4, 2, 32) if smoke else (4, 256, 4096, 8, 2, 128)
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, v = (
    jax.random.normal(kk, (B, t, n, H), jnp.bfloat16)
    for kk, t, n in zip(keys, (T, S, S), (N, K, K))
  )
  lengths = jnp.asarray([S // 3, S, 5 * S // 8, 7], jnp.int32)
  for rows_q, name in ((T, "prefill"), (1, "decode")):
    for impl in implementations():
      row = dict(case=name, implementation=str(impl))
      try:
        f = jax.jit(
          lambda q, k, v, n, impl=impl: jattn.dot_product_attention(
            q,
            k,
            v,
            implementation=impl,
            is_causal="bottom_right",
            key_value_seq_lengths=n,
            return_residual=True,
          )
        )
        batched = f(q[:, :rows_q], k, v, lengths)
        same = True
        for b in range(B):
          alone = f(q[b : b + 1, :rows_q], k[b : b + 1], v[b : b + 1], lengths[b : b + 1])
          same &= all(
            np.array_equal(np.asarray(x[b : b + 1]).view(np.uint8), np.asarray(y).view(np.uint8))
            for x, y in zip(batched, alone)
          )
        row.update(status="ok", batch_invariant=bool(same))
      except Exception as e:
        row.update(status=type(e).__name__, error=str(e).splitlines()[0][:200])
      rows.append(row)
  return rows


def speed(smoke: bool):
  """Forward+backward TFLOP/s against jax.nn (xla, cudnn) per case and length."""
  _, (peak, _) = peaks()
  Ts = [128] if smoke else [1024, 2048, 4096, 8192, 16384]
  B, N, K, H = (1, 4, 4, 32) if smoke else (1, 16, 16, 128)
  repeats = 1 if smoke else 5
  rows = []
  for T in Ts:
    keys = jax.random.split(jax.random.key(T), 4)
    q, k, v = (
      jax.random.normal(kk, (B, T, n, H), jnp.bfloat16) for kk, n in zip(keys[:3], (N, K, K))
    )
    # smoke: one case jax.nn has and one it lacks (the script's two kinds of row).
    cases = {n: SPEED_CASES[n] for n in ("causal", "segments")} if smoke else SPEED_CASES
    for name, case in cases.items():
      kw, _ = _case_kwargs(case, T, N, keys[3])
      loss = lambda f: jax.jit(
        jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
      )
      fns = {"jattn": loss(lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw))}
      nn_kw = {key: val for key, val in kw.items() if key in ("is_causal", "local_window_size")}
      if nn_kw.get("is_causal"):
        nn_kw["is_causal"] = True
      if set(kw) <= {"is_causal", "local_window_size"}:  # jax.nn has the case
        for impl in ["xla", "cudnn"] if jax.default_backend() == "gpu" else ["xla"]:
          fns[f"jax.nn {impl}"] = loss(
            lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
              q, k, v, implementation=impl, **nn_kw
            )
          )
      # Useful work: 4 matmuls forward+backward x 2 ... (fwd 2, bwd 5 matmul-sized products).
      frac = 0.5 if kw.get("is_causal") else 1.0
      if "local_window_size" in kw:
        frac = min(1.0, (kw["local_window_size"][0] + 1) / T)
      flops = 7 * 2 * B * N * T * T * H * frac
      for impl, f in fns.items():
        row = dict(case=name, T=T, implementation=impl)
        try:
          ms = interleaved({impl: lambda f=f: f(q, k, v)}, repeats)[impl]
          row.update(status="ok", ms=ms, tflops=flops / ms / 1e9)
          if peak:
            row["pct_peak"] = 100 * flops / (ms / 1e3) / peak
        except Exception as e:
          row.update(status=type(e).__name__, error=str(e).splitlines()[0][:200])
        rows.append(row)
  return rows


def decode(smoke: bool):
  """One paged decoding step: the pool's bytes per second, % of the memory bandwidth."""
  _, (_, bandwidth) = peaks()
  B, N, K, H, ps = (2, 4, 2, 16, 16) if smoke else (8, 32, 8, 128, 16)
  rows = []
  for S in [256] if smoke else [8192, 32768]:
    P = B * S // ps
    keys = jax.random.split(jax.random.key(S), 3)
    kp = jax.random.normal(keys[0], (P, ps, K, H), jnp.bfloat16)
    vp = jax.random.normal(keys[1], (P, ps, K, H), jnp.bfloat16)
    table = jax.random.permutation(keys[2], P).reshape(B, S // ps).astype(jnp.int32)
    q = jnp.ones((B, 1, N, H), jnp.bfloat16)
    lens = jnp.full((B,), S, jnp.int32)
    outs = {}
    for impl in ("chunked", None):
      f = jax.jit(
        lambda q, kp, vp, t, n, impl=impl: jattn.paged_attention(
          q, kp, vp, t, n, implementation=impl
        )
      )
      row = dict(S=S, B=B, implementation=str(impl))
      try:
        ms = interleaved({"f": lambda f=f: f(q, kp, vp, table, lens)}, 1 if smoke else 20)["f"]
        outs[impl] = np.asarray(f(q, kp, vp, table, lens), np.float32)
        read = 2 * kp.size * kp.dtype.itemsize
        row.update(status="ok", ms=ms, gb_per_s=read / ms / 1e6)
        if bandwidth:
          row["pct_bandwidth"] = 100 * read / (ms / 1e3) / bandwidth
        twice = np.asarray(f(q, kp, vp, table, lens), np.float32)
        row["bitwise_rerun"] = bool(np.array_equal(twice, outs[impl]))
      except Exception as e:
        row.update(status=type(e).__name__, error=str(e).splitlines()[0][:200])
      rows.append(row)
    if len(outs) == 2:
      rows[-1]["max_abs_diff_vs_chunked"] = float(np.abs(outs[None] - outs["chunked"]).max())
  return rows


# --------------------------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
  lines = [
    f"# device check: {report['device']} ({report['backend']}), jax {report['jax']}",
    f"{report['started']}, {report['seconds']:.0f} s",
    "",
  ]
  for section, rows in report["sections"].items():
    lines.append(f"## {section}")
    if isinstance(rows, dict):  # a section that failed as a whole
      lines += [f"failed: {rows['error']}", ""]
      continue
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|---" * len(cols) + "|")
    for r in rows:
      cell = lambda x: f"{x:.3g}" if isinstance(x, float) else str(x)
      lines.append("| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |")
    lines.append("")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat (any device)")
  parser.add_argument("--out", default="device_check", help="writes OUT.json and OUT.md")
  parser.add_argument(
    "--sections", nargs="*", default=["correctness", "batch_invariance", "speed", "decode"]
  )
  a = parser.parse_args(argv)
  start = time.time()
  report = dict(
    device=peaks()[0],
    backend=jax.default_backend(),
    jax=jax.__version__,
    started=time.strftime("%Y-%m-%d %H:%M:%S"),
    sections={},
  )
  for section in a.sections:
    try:
      if section == "correctness":
        rows, bits = correctness(a.smoke)
        report["sections"]["correctness"] = rows
        report["sections"]["determinism"] = bits
      else:
        report["sections"][section] = {
          "batch_invariance": batch_invariance,
          "speed": speed,
          "decode": decode,
        }[section](a.smoke)
    except Exception as e:
      report["sections"][section] = {
        "error": f"{type(e).__name__}: {e}",
        "traceback": traceback.format_exc(),
      }
    print(f"{section}: done at {time.time() - start:.0f} s", file=sys.stderr)
  report["seconds"] = time.time() - start
  with open(a.out + ".json", "w") as f:
    json.dump(report, f, indent=1)
  with open(a.out + ".md", "w") as f:
    f.write(markdown(report))
  print(markdown(report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
