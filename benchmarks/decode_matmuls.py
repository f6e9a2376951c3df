"""The matmuls of one decoding step on this CPU, alone: the part of a paged step no layout saves.

One query token per head (T = 1), B = 4, N = 32, K = 8 (G = 4), H = 128, S = 16384, float32,
the cache head-major and contiguous, (B, K, S, H), walked in blocks of 128 keys as
`jattn.paged_attention` walks a pool on the CPU (no gather, no softmax):

- floor: reading K and V once (each summed in float32);
- logits: q . k for every block, keys as the matmul's rows ((bk, H) x (H, G));
- logits (queries as rows): the same product as (G, H) x (H, bk), XLA's other orientation;
- values: p v for every block, (G, bk) x (bk, H);
- both: logits and values, the matmul work of a whole step.

Medians of 9 interleaved rounds, `jattn.bench.runner.settle` between calls; ratios to the floor.
Run: python benchmarks/decode_matmuls.py [--block 128]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from jattn.bench import interleaved

B, S, K, G, H = 4, 16384, 8, 4, 128


def walk(product, shape, block):
  """A jitted loop over the blocks of a (B, K, S, H) cache, summing ``product(j, cache, x)``."""

  def run(cache, x):
    step = lambda j, acc: acc + product(j, cache, x)
    return jax.lax.fori_loop(0, S // block, step, jnp.zeros(shape, jnp.float32))

  return jax.jit(run)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--block", type=int, default=128)
  p.add_argument("--repeats", type=int, default=9)
  a = p.parse_args(argv)
  bk = a.block
  keys = jax.random.split(jax.random.key(0), 4)
  k = jax.random.normal(keys[0], (B, K, S, H), jnp.float32)
  v = jax.random.normal(keys[1], (B, K, S, H), jnp.float32)
  q = jax.random.normal(keys[2], (B, K, G, H), jnp.float32)
  p_ = jax.random.normal(keys[3], (B, K, G, bk), jnp.float32)
  blk = lambda c, j: jax.lax.dynamic_slice_in_dim(c, j * bk, bk, axis=2)
  logits = lambda j, c, x: jnp.einsum("bksh,bkgh->bkgs", blk(c, j), x)
  logits_t = lambda j, c, x: jnp.einsum("bkgh,bksh->bkgs", x, blk(c, j))
  values = lambda j, c, x: jnp.einsum("bkgs,bksh->bkgh", x, blk(c, j))
  floor = jax.jit(lambda k, v: (k.sum(), v.sum()))
  fns = {
    "floor (read K and V)": (floor, (k, v)),
    "logits": (walk(logits, (B, K, G, bk), bk), (k, q)),
    "logits (queries as rows)": (walk(logits_t, (B, K, G, bk), bk), (k, q)),
    "values": (walk(values, (B, K, G, H), bk), (v, p_)),
  }
  ms = interleaved(
    {name: lambda f=f, args=args: f(*args) for name, (f, args) in fns.items()},
    a.repeats,
    settle=True,
  )
  ms["both (logits + values)"] = ms["logits"] + ms["values"]
  floor_ms = ms["floor (read K and V)"]
  print(f"B={B} K={K} G={G} H={H} S={S} float32, blocks of {bk} keys, medians of {a.repeats}")
  for name, t in ms.items():
    print(f"  {name:28s} {t:7.1f} ms  {t / floor_ms:5.2f}x the floor")


if __name__ == "__main__":
  main()
