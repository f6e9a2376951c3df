"""PyTorch's ``scaled_dot_product_attention`` as an optional peer, timed in its own process.

Importing torch into the JAX process slows JAX by 10-40% on a small CPU (torch's idle OpenMP
threads), so torch never enters the benchmark's process: this file runs as a worker
(``python torch_peer.py``) that the benchmark drives over JSON lines on stdin/stdout, one timed
call per request, so torch's calls interleave with JAX's (A B A B ...) like any other row. The
worker gets ``OMP_WAIT_POLICY=PASSIVE`` (its threads sleep while JAX runs) and as many threads as
the JAX process may use. torch is never a dependency: without it the peer is dropped with a note.

The worker file imports nothing from the jattn.bench package, so it runs wherever torch does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import IO, Any


def available() -> bool:
  """Whether torch could be imported (checked without importing it here)."""
  return importlib.util.find_spec("torch") is not None


class PeerError(RuntimeError):
  def __init__(self, message, oom=False):
    super().__init__(message)
    self.oom = oom


class TorchPeer:
  """The parent's handle on one worker process, started lazily and kept for the whole sweep."""

  def __init__(self, threads: int):
    self.threads = threads
    self.info: dict[str, Any] | None = None
    self.broken: str | None = None  # why the worker could not start; not retried for every case
    self._proc: subprocess.Popen[str] | None = None
    self._stderr: IO[str] | None = None

  def _start(self):
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["JATTN_BENCH_TORCH_THREADS"] = str(self.threads)
    self._stderr = tempfile.TemporaryFile(mode="w+")
    self._proc = subprocess.Popen(
      [sys.executable, os.path.abspath(__file__)],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self._stderr,
      text=True,
      env=env,
    )
    self.info = self._receive()

  def _receive(self) -> dict[str, Any]:
    # Only called while the worker runs: _start sets _proc (with PIPE stdout) and _stderr first.
    assert self._proc is not None and self._proc.stdout is not None and self._stderr is not None
    line = self._proc.stdout.readline()
    if not line:
      self._stderr.seek(0)
      tail = self._stderr.read()[-2000:]
      code = self._proc.wait()
      self._proc = None
      raise PeerError(f"torch worker exited (code {code}): {tail.strip()}")
    msg = json.loads(line)
    if not msg.get("ok"):
      raise PeerError(msg.get("error", "torch worker failed"), oom=bool(msg.get("oom")))
    return msg

  def request(self, **msg) -> dict:
    if self.broken:
      raise PeerError(self.broken)
    if self._proc is None:
      try:
        self._start()
      except PeerError as e:
        self.broken = f"torch worker could not start: {e}"
        raise PeerError(self.broken) from None
    assert self._proc is not None and self._proc.stdin is not None  # _start set it, with PIPE stdin
    try:
      self._proc.stdin.write(json.dumps(msg) + "\n")
      self._proc.stdin.flush()
    except OSError:
      pass  # the worker died: _receive reads EOF and reports its stderr
    return self._receive()

  def setup(self, case_fields: dict, seed: int, device: str) -> dict:
    """Make the case's tensors in the worker; returns {"note": ...}."""
    return self.request(op="setup", case=case_fields, seed=seed, device=device)

  def run(self) -> float:
    """One timed call of the case set up last; seconds, measured inside the worker."""
    return float(self.request(op="run")["time_s"])

  def close(self):
    if self._proc is not None:
      assert self._proc.stdin is not None  # started with stdin=PIPE
      try:
        self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self._proc.stdin.close()
        self._proc.wait(timeout=30)
      except (OSError, subprocess.TimeoutExpired):
        self._proc.kill()
        self._proc.wait()
      self._proc = None
    if self._stderr is not None:
      self._stderr.close()
      self._stderr = None


# ---------------------------------------------------------------- the worker (torch imported here)


def _send(msg):
  sys.stdout.write(json.dumps(msg) + "\n")
  sys.stdout.flush()


class _Case:
  """Tensors and call of one case, in torch's (B, N, T, H) layout."""

  def __init__(self, torch, F, msg):
    c = msg["case"]
    self.torch, self.F = torch, F
    self.device = "cuda" if msg["device"] == "gpu" and torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, c["dtype"])
    B, N, K, H, T, S = (c[x] for x in ("B", "N", "K", "H", "T", "S"))
    gen = torch.Generator().manual_seed(int(msg["seed"]))

    def normal(*shape):
      return torch.randn(*shape, generator=gen, dtype=torch.float32).to(self.device, dtype)

    self.q, self.k, self.v = normal(B, N, T, H), normal(B, K, S, H), normal(B, K, S, H)
    self.dout = normal(B, N, T, H)
    self.backward = c["pass"] == "forward+backward"
    notes = []
    self.kwargs = {}
    if K != N:
      if _version(torch.__version__) >= (2, 5):
        self.kwargs["enable_gqa"] = True
      else:
        self.k = self.k.repeat_interleave(N // K, dim=1)
        self.v = self.v.repeat_interleave(N // K, dim=1)
        notes.append(f"torch < 2.5 has no enable_gqa: k/v heads repeated {N // K}x")
    causal, window, segments = c["causal"], c["window"], c["segments"]
    if causal == "top_left" and window is None and segments is None:
      self.kwargs["is_causal"] = True  # torch's is_causal is top-left aligned, like jax.nn's
    elif causal is not None or window is not None or segments is not None:
      self.kwargs["attn_mask"] = self._mask(B, T, S, causal, window, segments)
      notes.append("mask passed as a boolean array")
    self.note = "; ".join(notes)

  def _mask(self, B, T, S, causal, window, segments):
    torch = self.torch
    q = torch.arange(T, device=self.device)[:, None]
    k = torch.arange(S, device=self.device)[None, :]
    d = S - T if causal == "bottom_right" else 0
    ok = torch.ones(T, S, dtype=torch.bool, device=self.device)
    if causal is not None:
      ok &= k <= q + d
    if window is not None:
      ok &= (k >= q + d - window[0]) & (k <= q + d + window[1])
    ok = ok[None, None]
    if segments is not None:
      # Equal packed documents, as jattn.bench.masks.segment_ids: position i is in i*M // length.
      qs = torch.arange(T, device=self.device) * segments // T
      ks = torch.arange(S, device=self.device) * segments // S
      ok = ok & (qs[:, None] == ks[None, :])[None, None]
    return ok.expand(B, 1, T, S)

  def run(self) -> float:
    torch, F = self.torch, self.F
    sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    if self.backward:
      q, k, v = (x.detach().requires_grad_(True) for x in (self.q, self.k, self.v))
      out = F.scaled_dot_product_attention(q, k, v, **self.kwargs)
      torch.autograd.grad(out, (q, k, v), self.dout)
    else:
      with torch.no_grad():
        F.scaled_dot_product_attention(self.q, self.k, self.v, **self.kwargs)
    sync()
    return time.perf_counter() - start


def _version(text):
  parts = []
  for p in text.split("+")[0].split(".")[:2]:
    digits = "".join(ch for ch in p if ch.isdigit())
    parts.append(int(digits or 0))
  return tuple(parts)


def _serve():
  try:
    import torch
    import torch.nn.functional as F
  except Exception as e:
    _send({"ok": False, "error": f"import torch failed: {type(e).__name__}: {e}"})
    return
  torch.set_num_threads(int(os.environ.get("JATTN_BENCH_TORCH_THREADS", os.cpu_count() or 1)))
  _send(
    {
      "ok": True,
      "torch": torch.__version__,
      "threads": torch.get_num_threads(),
      "cuda": torch.cuda.is_available(),
    }
  )
  case = None
  for line in sys.stdin:
    msg = json.loads(line)
    try:
      if msg["op"] == "quit":
        break
      if msg["op"] == "setup":
        case = None  # free the previous case's tensors first
        case = _Case(torch, F, msg)
        _send({"ok": True, "note": case.note})
      elif msg["op"] == "run":
        if case is None:
          raise RuntimeError("run before setup")
        _send({"ok": True, "time_s": case.run()})
      else:
        raise ValueError(f"unknown op {msg['op']!r}")
    except Exception as e:
      text = f"{type(e).__name__}: {e}"
      _send(
        {
          "ok": False,
          "error": text[:1000],
          "oom": isinstance(e, MemoryError) or "out of memory" in text.lower(),
        }
      )


if __name__ == "__main__":
  _serve()
