"""The program jattn gives an accelerator, run on this CPU: causal against unmasked time.

Exports `implementation="chunked"` for ``--platform`` (cuda: the parallel schedule's lanes),
compiles the exported program for this CPU with the platform check off, and times causal and
unmasked calls interleaved in one run (medians), beside the work each program does (matmul
FLOPs read from its compiled HLO, `jattn.bench.structure.matmul_flops`). Not an accelerator's
speed: the same program's work, executed where it can be.

  python benchmarks/exported_work.py --T 4096 --repeats 5 [--before 2c3c338]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jattn
from jattn.bench import interleaved, structure


def compiled(fn, args, platform):
  exp = jax.export.export(
    jax.jit(fn), platforms=[platform], disabled_checks=[jax.export.DisabledSafetyCheck.platform()]
  )(*args)
  return jax.jit(exp.call).lower(*args).compile()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--T", type=int, default=4096)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--platform", default="cuda", choices=("cuda", "tpu"))
  p.add_argument("--repeats", type=int, default=5)
  a = p.parse_args(argv)
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (1, a.T, a.heads, a.head_dim)
  q, k, v, do = (jax.random.normal(key, shape, jnp.float32) for key in keys)
  progs = {}
  for mask, kw in (("full", {}), ("causal", dict(is_causal=True))):
    f = lambda q, k, v, kw=kw: jattn.dot_product_attention(q, k, v, implementation="chunked", **kw)
    train = lambda q, k, v, do, f=f: jax.vjp(f, q, k, v)[1](do)
    for pass_, fn, args in (("forward", f, (q, k, v)), ("forward+backward", train, (q, k, v, do))):
      c = compiled(fn, args, a.platform)
      progs[mask, pass_] = (
        c,
        args,
        structure.matmul_flops(c.as_text()),
        structure.loop_structure(c.as_text()).steps,
      )
  ms = interleaved(
    {key: lambda c=c, args=args: c(*args) for key, (c, args, _, _) in progs.items()}, a.repeats
  )
  print(
    f"exported for {a.platform}, run on this CPU: B=1 N={a.heads} H={a.head_dim} "
    f"T=S={a.T} float32, medians of {a.repeats}"
  )
  print("pass              mask    steps  GFLOP   time_s  causal/full")
  for pass_ in ("forward", "forward+backward"):
    med = {m: ms[m, pass_] / 1e3 for m in ("full", "causal")}
    for m in ("full", "causal"):
      _, _, flops, steps = progs[m, pass_]
      ratio = f"{med['causal'] / med['full']:.2f}" if m == "causal" else ""
      print(f"{pass_:17} {m:7} {steps:5}  {flops / 1e9:6.1f}  {med[m]:7.3f}  {ratio}")


if __name__ == "__main__":
  main()
