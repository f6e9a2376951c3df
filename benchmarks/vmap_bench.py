"""Under jax.vmap over a batch, a causal call against the same batch passed as B, both schedules
(issue #13: <= 1.15x). Medians of 5 interleaved calls. Run: python benchmarks/vmap_bench.py"""

import statistics
import time

import jax

import jattn

B, T, N, H = 4, 2048, 8, 64
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, (B, T, N, H)) for kk in ks)
res = {}
fns = {}
for sched in ("serial", "parallel"):
  f = lambda q, k, v, s=sched: jattn.dot_product_attention(
    q, k, v, implementation="chunked", is_causal=True, schedule=s
  )
  fns[(sched, "batched")] = jax.jit(f)
  fns[(sched, "vmap")] = jax.jit(jax.vmap(lambda q, k, v, f=f: f(q[None], k[None], v[None])[0]))
for fn in fns.values():
  jax.block_until_ready(fn(q, k, v))
times = {key: [] for key in fns}
for _ in range(5):
  for key, fn in fns.items():
    t = time.perf_counter()
    jax.block_until_ready(fn(q, k, v))
    times[key].append(time.perf_counter() - t)
for sched in ("serial", "parallel"):
  b = statistics.median(times[(sched, "batched")])
  vm = statistics.median(times[(sched, "vmap")])
  print(f"{sched}: batched {b:.3f} s, vmap {vm:.3f} s, vmap / batched = {vm / b:.2f}")
