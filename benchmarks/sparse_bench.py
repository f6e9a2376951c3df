"""Trainable sparse attention (issue #55.6): NSA's selected branch plus its sliding window against
causal attention over every key, forward+backward.

NSA's query sees, per KV head, n chosen blocks of `block` keys (causal within them) and, in a
separate branch, a window of the last `window` keys; the two branches are gated and summed. Here:
the selected branch through ``implementation="sparse"`` (masks.selected_blocks & causal) plus the
window branch (chunked, local_window_size), against one causal chunked call over all T keys.
Beside the medians of interleaved calls: the compiled programs' temporary memory, the keys each
query reads (the work), and the n at which the causal call would read as many keys as the
selection (the work's crossover; time's crossover follows from the measured ratio).

``--work``: no run; each program exported for cuda (`jax.export`, from this machine) and its
matmul work read from the optimized program (`jattn.bench.structure.matmul_flops`: every loop
step and conditional branch counted as run, so an upper bound where steps are skipped at run
time), beside the work of the steps the selection actually runs (its chunks, counted from the
indices as `_schedules` cuts them) -- for T = 65536, too long to time here.

``--decode``: serving, a paged decoding step (B=4, N=32, K=8, H=128, 16384 cached tokens a
sequence in pages of 16, float32) reading every cached key against one reading a selection of
2048 (`paged_attention(key_selection=...)`: tokens, then whole pages).

``--sweep 16,32,64``: for each n, the selection through "sparse" against the same call (the
selection as a mask, causal) through "chunked", interleaved: the n from which chunked is faster,
the measured crossover behind implementation=None's rule (`jattn._dispatch.SPARSE_MAX_KEYS`).

Run: python benchmarks/sparse_bench.py [--T 16384] [--n 16] [--block 64] [--window 512]
     [--heads 16] [--kv-heads 1] [--head-dim 64] [--repeats 3] [--sweep 16,32,64] [--work]
     [--decode]
The defaults are NSA's: blocks of 64, 16 of them, a 512 window, and its GQA group (64 query
heads over 4 KV heads: 16 query heads share a KV head and its selection). The ratio to causal
depends on the group: the selected branch's matmuls are G x 512 rows against one block, so a
smaller group (``--heads 4``) runs them at a lower rate (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import masks as M
from jattn.bench import alternating, interleaved, structure
from jattn.bench.runner import compiled_memory


def _selection(T, K, n, block, seed=0):
  """(1, T, K, n) causal choices: each query's own block and n - 1 distinct earlier ones (fewer
  where fewer exist: -1), as NSA's top-n over its compressed scores yields."""
  rng = np.random.default_rng(seed)
  own = np.arange(T) // block
  out = np.full((1, T, K, n), -1, np.int32)
  for t in range(T):
    earlier = own[t]
    for kh in range(K):
      pick = rng.permutation(earlier)[: n - 1] if earlier else np.zeros(0, np.int64)
      out[0, t, kh, : 1 + len(pick)] = np.concatenate([[own[t]], pick])
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--T", type=int, default=16384)
  p.add_argument("--n", type=int, default=16)
  p.add_argument("--block", type=int, default=64)
  p.add_argument("--window", type=int, default=512)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=1)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--sweep", type=str, default=None)
  p.add_argument("--work", action="store_true")
  p.add_argument("--decode", action="store_true")
  a = p.parse_args(argv)
  if a.decode:
    return _decode(a.repeats)
  T, N, K, H = a.T, a.heads, a.kv_heads, a.head_dim
  if a.work:
    return _work(a)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (
    jax.random.normal(kk, (1, T, h, H), jnp.float32) for kk, h in zip(keys, (N, K, K, N))
  )
  if a.sweep:
    return _sweep(a, (q, k, v, do), [int(n) for n in a.sweep.split(",")])
  idx = jnp.asarray(_selection(T, K, a.n, a.block))

  programs = _programs(a)
  calls = {name: (lambda f=f: f(q, k, v, do, idx)) for name, f in programs.items()}
  times = interleaved(calls, a.repeats, order=alternating(list(calls)), raw=True)
  ms = {name: float(np.median(t)) for name, t in times.items()}
  mem = {
    name: compiled_memory(f.lower(q, k, v, do, idx).compile())["temp_bytes"]
    for name, f in programs.items()
  }
  reads = {
    "selected (sparse)": a.n * a.block,
    "window (chunked)": a.window,
    "causal (chunked)": (T + 1) / 2,
  }
  print(f"T={T} N={N} K={K} H={H} n={a.n} block={a.block} window={a.window}, fwd+bwd, CPU")
  print(f"{'call':20s} {'median ms':>10s} {'temp MiB':>9s} {'keys/query':>11s}")
  for name in calls:
    print(f"{name:20s} {ms[name]:10.1f} {mem[name] / 2**20:9.1f} {reads[name]:11.0f}")
  # The ratio per round (the three calls run back to back), then its median and range: the
  # machine's drift moves the causal call's seconds as much as the branches' (a ratio of
  # medians taken over different rounds mixes them).
  rounds = [
    (s + w) / c
    for s, w, c in zip(
      *(times[n] for n in ("selected (sparse)", "window (chunked)", "causal (chunked)"))
    )
  ]
  print(
    f"NSA's two branches / causal: {np.median(rounds):.3f}x the time "
    f"(median of {len(rounds)} rounds, {min(rounds):.3f}-{max(rounds):.3f})"
  )
  print(f"work crossover: n = {(T + 1) / 2 / a.block:.0f} blocks read as many keys as causal")


def loss(block=None, **kw):
  """The jitted gradient in q, k and v of sum(attention * do); with ``block``, the selection's
  indices are an argument (traced, as a model's are: not constants the compiler folds)."""

  def f(q, k, v, do, idx=None):
    sel = {} if block is None else {"mask": M.selected_blocks(idx, block)}
    return jnp.sum(jattn.dot_product_attention(q, k, v, **kw, **sel) * do)

  return jax.jit(jax.grad(f, argnums=(0, 1, 2)))


def _programs(a):
  """The three branches' jitted gradients: NSA's selected and window branches, causal."""
  return {
    "selected (sparse)": loss(block=a.block, is_causal=True, implementation="sparse"),
    "window (chunked)": loss(local_window_size=(a.window - 1, 0), implementation="chunked"),
    "causal (chunked)": loss(is_causal=True, implementation="chunked"),
  }


def _chunks_run(idx, block, S, sizes=(512, 128)):
  """Pairs' worth of chunk rows the sparse path runs for ``idx`` (1, T, K, n): per KV head and
  key block, whole chunks of the first size, the rest in chunks of the second (as
  `jattn._backends.sparse` cuts them)."""
  rows = 0
  for kh in range(idx.shape[2]):
    chosen = idx[0, :, kh].ravel()
    count = np.bincount(chosen[chosen >= 0], minlength=-(-S // block))
    big = count // sizes[0]
    rows += int(
      (big * sizes[0]).sum() + (-(-(count - big * sizes[0]) // sizes[1]) * sizes[1]).sum()
    )
  return rows


def _work(a):
  """Matmul work of each branch at T, exported for cuda (no run)."""
  T, N, K, H = a.T, a.heads, a.kv_heads, a.head_dim
  spec = lambda h, dtype=jnp.float32: jax.ShapeDtypeStruct((1, T, h, H), dtype)
  args = (spec(N), spec(K), spec(K), spec(N), jax.ShapeDtypeStruct((1, T, K, a.n), jnp.int32))
  print(f"T={T} N={N} K={K} H={H} n={a.n} block={a.block} window={a.window}, fwd+bwd, for cuda")
  print(f"{'call':20s} {'program GFLOP':>14s}")
  work = {}
  for name, f in _programs(a).items():
    work[name] = structure.matmul_flops(structure.lowered_for(f, args, "cuda"))
    shown = "unknown" if work[name] is None else f"{work[name] / 1e9:.1f}"
    print(f"{name:20s} {shown:>14s}")
  # The steps the selection runs: 7 matmuls (forward QK, PV; backward QK, dP, dQ, dK, dV) of
  # G query rows per pair against one block.
  idx = _selection(T, K, a.n, a.block)
  ran = 7 * 2 * _chunks_run(idx, a.block, T) * (N // K) * a.block * H
  print(f"{'selected, chunks run':20s} {ran / 1e9:14.1f}")
  causal = work["causal (chunked)"]
  if causal:
    print(
      f"selected's chunks run + window / causal: {(ran + work['window (chunked)']) / causal:.3f}x"
    )


def _decode(repeats, B=4, N=32, K=8, H=128, page=16, L=16384, chosen=2048):
  """A paged decoding step over all L cached keys against one over ``chosen`` selected keys."""
  P = B * L // page
  rng = np.random.default_rng(0)
  kp, vp = (jnp.asarray(rng.standard_normal((P, page, K, H)), jnp.float32) for _ in "kv")
  table = jnp.asarray(rng.permutation(P).reshape(B, L // page).astype(np.int32))
  lens = jnp.full((B,), L, jnp.int32)
  q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32)

  def picks(size):  # (B, 1, K, chosen / size) distinct blocks of ``size`` tokens
    n, blocks = chosen // size, L // size
    return jnp.asarray(
      np.stack([rng.permutation(blocks)[:n] for _ in range(B * K)]).reshape(B, 1, K, n),
      jnp.int32,
    )

  def step(size):
    f = lambda q, i: jattn.paged_attention(
      q, kp, vp, table, lens, key_selection=None if i is None else M.selected_blocks(i, size)
    )
    return jax.jit(f)

  progs = {
    f"all {L} keys": (step(1), None),
    f"{chosen} tokens (block 1)": (step(1), picks(1)),
    f"{chosen // page} pages of {page}": (step(page), picks(page)),
  }
  calls = {name: (lambda f=f, i=i: f(q, i)) for name, (f, i) in progs.items()}
  ms = interleaved(calls, repeats, order=alternating(list(calls)))
  print(f"paged decoding step: B={B} N={N} K={K} H={H}, {L} cached tokens, float32, CPU")
  for name in calls:
    print(f"{name:28s} {ms[name]:8.2f} ms")


def _sweep(a, args, ns):
  """For each n: the selection's forward+backward through "sparse" and through "chunked"."""
  T, K = a.T, a.kv_heads
  print(f"T={T} N={a.heads} K={K} H={a.head_dim} block={a.block}, causal, fwd+bwd, CPU")
  print(f"{'n':>5s} {'keys/query':>11s} {'sparse ms':>10s} {'chunked ms':>11s} {'ratio':>6s}")
  crossover = None
  for n in ns:
    idx = jnp.asarray(_selection(T, K, n, a.block))
    progs = {
      impl: loss(block=a.block, is_causal=True, implementation=impl)
      for impl in ("sparse", "chunked")
    }
    calls = {name: (lambda f=f: f(*args, idx)) for name, f in progs.items()}
    ms = interleaved(calls, a.repeats, order=alternating(list(calls)))
    ratio = ms["sparse"] / ms["chunked"]
    print(f"{n:5d} {n * a.block:11d} {ms['sparse']:10.1f} {ms['chunked']:11.1f} {ratio:6.2f}")
    if ratio >= 1 and crossover is None:
      crossover = n
  where = "beyond the sweep" if crossover is None else f"at n = {crossover} or below"
  print(f"chunked is as fast as sparse {where} ({T} keys, causal: {(T + 1) // 2} a query)")


if __name__ == "__main__":
  main()
