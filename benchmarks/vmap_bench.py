"""Under jax.vmap over a batch, a causal call against the same batch passed as B, both schedules,
forward and gradient (issues #13 and #52: <= 1.15x; an unmasked call's time beside it shows
whether blocks are skipped). Medians of interleaved calls.

Run: python benchmarks/vmap_bench.py [--T 4096] [--repeats 5] [--forward-only]
"""

import argparse

import jax

import jattn
from jattn.bench import interleaved

p = argparse.ArgumentParser()
p.add_argument("--B", type=int, default=2)
p.add_argument("--T", type=int, default=4096)
p.add_argument("--N", type=int, default=8)
p.add_argument("--H", type=int, default=64)
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--forward-only", action="store_true")
args = p.parse_args()

ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, (args.B, args.T, args.N, args.H)) for kk in ks)
fns = {}
for sched in ("serial", "parallel"):
  for causal in (True, False):
    f = lambda q, k, v, s=sched, c=causal: jattn.dot_product_attention(
      q, k, v, implementation="chunked", is_causal=c, schedule=s
    )
    one = lambda q, k, v, f=f: f(q[None], k[None], v[None])[0]
    vm = lambda q, k, v, one=one: jax.vmap(one)(q, k, v)
    for mode in ("forward",) if args.forward_only else ("forward", "grad"):
      for way, g in (("batched", f), ("vmap", vm)):
        if mode == "grad":
          g = jax.grad(lambda q, k, v, g=g: g(q, k, v).sum(), (0, 1, 2))
        fns[(sched, mode, causal, way)] = jax.jit(g)
ms = interleaved({key: (lambda fn=fn: fn(q, k, v)) for key, fn in fns.items()}, args.repeats)
print(f"B={args.B} T={args.T} N={args.N} H={args.H} float32, medians of {args.repeats}")
for sched in ("serial", "parallel"):
  for mode in ("forward",) if args.forward_only else ("forward", "grad"):
    b, vmapped = ms[(sched, mode, True, "batched")], ms[(sched, mode, True, "vmap")]
    full = ms[(sched, mode, False, "batched")]
    print(
      f"{sched:8s} {mode:7s} causal: batched {b:8.1f} ms, vmap {vmapped:8.1f} ms, "
      f"vmap / batched = {vmapped / b:.2f}; unmasked batched {full:8.1f} ms"
    )
