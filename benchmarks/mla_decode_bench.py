"""One absorbed-MLA decoding step against the floor of reading its latent pool once, beside
the same model's non-absorbed step against its per-head K/V pools (on this machine, CPU).

The model is DeepSeek-V2-Lite's attention (N = 16 heads, latent Hc = 512 + rotary Hr = 64,
non-rotary query/key Hn = 128, values Hv = 128). Absorbed, a token's cache is one latent of
Hc + Hr features, shared by the heads: ``paged_attention(q (B, 1, N, Hc + Hr), latent
(P, page_size, 1, Hc + Hr), None, ..., value_head_dim=Hc)``. Non-absorbed, it is N keys of
Hn + Hr and N values of Hv: ``paged_attention(q (B, 1, N, Hn + Hr), keys (P, page_size, N,
Hn + Hr), values (P, page_size, N, Hv), ...)``, 2 * 16 * 160 / 576 = 8.9x the bytes. Each row:
the step's median (and best) milliseconds, its pool's floor (as `jattn.bench.decode_bench`
measures it: the faster of summing the pool in float32 and a max over its bits, i.e. bytes /
this machine's read bandwidth; here each read's best run) and the median's ratio to it; and
the step's arithmetic floor, its FLOPs over this machine's float32 matmul peak (absorbed MLA
does N heads' work per latent read: on a CPU it is bound by arithmetic, not by the read). Pages shuffled, every sequence S tokens.

  python benchmarks/mla_decode_bench.py [--S 4096] [--batch 4] [--page-size 16]
                                        [--dtypes float32 bfloat16] [--repeats 5]

Shapes: B sequences, S cached tokens, N heads, P pages.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn.bench import interleaved
from jattn.bench.decode_bench import _floor_max, _floor_sum
from jattn.bench.runner import measure_matmul_peak

N, HC, HR, HN, HV = 16, 512, 64, 128, 128


def pools(B, S, ps, dtype, seed=0):
  """{name: (query, key pool, value pool or None, value_head_dim)} and the shared page table:
  the absorbed latent pool and the non-absorbed per-head K/V pools of the same B x S tokens."""
  P = B * -(-S // ps)
  rng = np.random.default_rng(seed)
  table = jnp.asarray(rng.permutation(P).reshape(B, -1), jnp.int32)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  return {
    "absorbed (latent pool)": (normal(B, 1, N, HC + HR), normal(P, ps, 1, HC + HR), None, HC),
    "non-absorbed (K/V pools)": (
      normal(B, 1, N, HN + HR),
      normal(P, ps, N, HN + HR),
      normal(P, ps, N, HV),
      None,
    ),
  }, table


@functools.partial(jax.jit, static_argnames="value_head_dim")
def step(q, kp, vp, table, lens, value_head_dim):
  return jattn.paged_attention(q, kp, vp, table, lens, value_head_dim=value_head_dim)


def timed(f, repeats):
  """(median, min) milliseconds of f() after a warm-up, each run started on an idle process."""
  times = interleaved({"f": f}, repeats, settle=True, raw=True)["f"]
  return statistics.median(times), min(times)


def floor_ms(kp, vp, repeats):
  """The fastest read of the pools (each run's best: on a shared machine the median of a
  few-millisecond read is mostly other processes' noise)."""
  pages = (kp,) if vp is None else (kp, vp)
  ms = [
    sum(timed(lambda x=x, f=f: jax.jit(f)(x), repeats)[1] for x in pages)
    for f in (_floor_sum, _floor_max)
  ]
  return min(ms)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--S", type=int, default=4096, help="cached tokens per sequence")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  p.add_argument("--repeats", type=int, default=5)
  a = p.parse_args(argv)
  peak = measure_matmul_peak("float32", 1024)["flops_per_s"]
  print(
    f"{jax.devices()[0].device_kind}, B={a.batch} S={a.S} N={N} page_size={a.page_size}, "
    f"float32 matmul peak {peak / 1e9:.0f} GFLOP/s"
  )
  print(
    "| pool | dtype | pool MiB | step ms (median) | step ms (best) | floor ms | "
    "step / floor | GB/s at the floor | FLOP floor ms |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for dtype in a.dtypes:
    cases, table = pools(a.batch, a.S, a.page_size, jnp.dtype(dtype))
    lens = jnp.full((a.batch,), a.S, jnp.int32)
    for name, (q, kp, vp, hv) in cases.items():
      nbytes = kp.nbytes + (0 if vp is None else vp.nbytes)
      # Scores and the weighted sum: 2 FLOPs per multiply-add, per head, key and feature.
      flops = 2 * a.batch * a.S * N * (kp.shape[-1] + (hv or vp.shape[-1]))
      ms, best = timed(lambda: step(q, kp, vp, table, lens, hv), a.repeats)
      fl = floor_ms(kp, vp, a.repeats)
      print(
        f"| {name} | {dtype} | {nbytes / 2**20:.0f} | {ms:.1f} | {best:.1f} | {fl:.2f} | "
        f"{ms / fl:.1f}x | "
        f"{nbytes / fl / 1e6:.1f} | {flops / peak * 1e3:.1f} |"
      )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
