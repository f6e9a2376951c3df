"""RL rollouts packed as a prefix tree against each rollout in a row of its own (issue #54.5).

A prompt of P tokens and R responses of L tokens, forward+backward through the chunked kernels:
packed, one row of P + R * L tokens under `jattn.masks.prefix_tree` (each response sees the
prompt and itself); unpacked, R rows of P + L tokens, causal (the prompt repeated R times), as
one call of R rows and row by row (R calls of one row: a tile then holds one example, as
packed). Beside the times (medians of interleaved calls): the work each does -- the tiles the
kernels compute (the non-empty blocks of the block map, times the examples a tile holds) and the
visible (query, key) pairs -- and the compiled program's temporary memory. Then the cost of the
tree's block summary (and of building the whole tree) at T = 32768, as the call computes it.

Run: python benchmarks/prefix_tree_bench.py [--prompt 2048] [--responses 8] [--length 512]
     [--heads 8] [--kv-heads 2] [--head-dim 64] [--repeats 5] [--summary-T 32768]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import _tile
from jattn import masks as M
from jattn.bench import interleaved
from jattn.bench.runner import compiled_memory


def _tiles(mask, B, N, T):
  """Tiles computed: non-empty blocks of the call's block map at the default block sizes, times
  the B examples each tile holds."""
  grid = M.BlockGrid(T, T, *_tile.block_sizes(T, T, None, None))
  states = np.asarray(M.reduce_states(mask.block_states(grid, (B, N, T, T)), (B, N, T, T)))
  return int((states != M.EMPTY).sum()) * B, grid


def _memory(fn, *args) -> int:
  return compiled_memory(jax.jit(fn).lower(*args).compile())["temp_bytes"]


def rl_shape(args):
  P, R, L = args.prompt, args.responses, args.length
  N, K, H = args.heads, args.kv_heads, args.head_dim
  T = P + R * L
  tree = M.prefix_tree(np.array([-1] + [0] * R), lengths=np.array([P] + [L] * R), size=T)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (
    jax.random.normal(kk, (1, T, n, H), jnp.float32) for kk, n in zip(keys, (N, K, K, N))
  )
  # Each response alone: the prompt's rows, then its own (the same values as packed).
  alone = lambda x: jnp.stack(
    [jnp.concatenate([x[0, :P], x[0, P + r * L : P + (r + 1) * L]]) for r in range(R)]
  )
  qa, ka, va, doa = (alone(x) for x in (q, k, v, do))

  def loss(mask, causal):
    f = lambda q, k, v, do: jnp.sum(
      jattn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="chunked")
      * do
    )
    return jax.grad(f, argnums=(0, 1, 2))

  packed = jax.jit(loss(tree.mask, False))
  unpacked = jax.jit(loss(None, True))
  # The R rows one call each: a tile then holds one example, as packed, where the batched
  # call's tiles hold all R (R times the tile's memory).
  rows = [tuple(x[r : r + 1] for x in (qa, ka, va, doa)) for r in range(R)]
  ms = interleaved(
    {
      "packed": lambda: packed(q, k, v, do),
      "unpacked": lambda: unpacked(qa, ka, va, doa),
      "row by row": lambda: [unpacked(*row) for row in rows],
    },
    args.repeats,
  )
  tiles_p, grid_p = _tiles(tree.mask, 1, N, T)
  tiles_u, _ = _tiles(M.causal(), R, N, P + L)
  pairs_p = P * (P + 1) // 2 + R * (P * L + L * (L + 1) // 2)
  pairs_u = R * (P + L) * (P + L + 1) // 2
  mem_p = _memory(loss(tree.mask, False), q, k, v, do)
  mem_u = _memory(loss(None, True), qa, ka, va, doa)
  print(
    f"prompt {P} + {R} responses of {L}, N={N} K={K} H={H} float32, chunked (CPU default "
    f"schedule), forward+backward, medians of {args.repeats}"
  )
  print(f"{'':10s} {'rows x T':>12s} {'ms':>9s} {'tiles':>7s} {'pairs':>12s} {'temp MiB':>9s}")
  mem_r = _memory(loss(None, True), *rows[0])
  for name, shape, t, ti, pa, me in (
    ("packed", f"1 x {T}", ms["packed"], tiles_p, pairs_p, mem_p),
    ("unpacked", f"{R} x {P + L}", ms["unpacked"], tiles_u, pairs_u, mem_u),
    ("row by row", f"{R} x 1 x {P + L}", ms["row by row"], tiles_u, pairs_u, mem_r),
  ):
    print(f"{name:10s} {shape:>12s} {t:9.1f} {ti:7d} {pa:12d} {me / 2**20:9.1f}")
  print(
    f"packed / unpacked: time {ms['packed'] / ms['unpacked']:.2f} (row by row: "
    f"{ms['packed'] / ms['row by row']:.2f}), tiles {tiles_p / tiles_u:.3f} ({grid_p.block_q} x "
    f"{grid_p.block_kv} blocks), pairs {pairs_p / pairs_u:.3f}, memory {mem_p / mem_u:.2f} "
    f"(row by row: the memory of one call)"
  )


def summary_cost(args):
  """The tree's block summary alone at T = S = summary_T: the prompt and as many responses of
  ``length`` as fit, under jit, medians of interleaved calls."""
  T, P, L = args.summary_T, args.prompt, args.length
  R = (T - P) // L
  N = args.heads
  parents = jnp.asarray(np.array([-1] + [0] * R), jnp.int32)
  lengths = jnp.asarray(np.array([P] + [L] * R), jnp.int32)
  grid = M.BlockGrid(T, T, *_tile.block_sizes(T, T, None, None))
  build = jax.jit(lambda p, n: M.prefix_tree(p, lengths=n, size=T))
  summary = jax.jit(
    lambda p, n: M.reduce_states(
      M.prefix_tree(p, lengths=n, size=T).mask.block_states(grid, (1, N, T, T)), (1, N, T, T)
    )
  )
  t0 = time.perf_counter()
  states = jax.block_until_ready(summary(parents, lengths))
  compile_s = time.perf_counter() - t0
  ms = interleaved(
    {"tree": lambda: build(parents, lengths), "tree + summary": lambda: summary(parents, lengths)},
    max(args.repeats, 5),
  )
  kept = int((np.asarray(states) != M.EMPTY).sum())
  print(
    f"T = {T} (prompt {P} + {R} x {L}): the whole tree (mask, positions, predecessors) "
    f"{ms['tree']:.2f} ms; the mask's {grid.num_q_blocks} x {grid.num_kv_blocks} block summary "
    f"from parents and lengths {ms['tree + summary']:.2f} ms (first call with compiling "
    f"{compile_s:.1f} s); {kept} of {grid.num_q_blocks * grid.num_kv_blocks} blocks kept"
  )


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--prompt", type=int, default=2048)
  p.add_argument("--responses", type=int, default=8)
  p.add_argument("--length", type=int, default=512)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--summary-T", type=int, default=32768)
  args = p.parse_args()
  rl_shape(args)
  summary_cost(args)


if __name__ == "__main__":
  main()
