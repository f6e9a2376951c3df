"""Packed against alone in float32: which results of a prefix tree are the same bits as each
root-to-leaf path run alone (docs/prefix_trees.md). A prompt and 4 responses, GQA, forward and
gradients, on dense and chunked in both schedules; the nodes filling whole blocks (aligned) or
not. Each entry: "bitwise", else the largest difference relative to the largest value. The
prompt's dk and dv sum its 4 responses' contributions, packed in one loop, alone path by path.

Run: python benchmarks/prefix_tree_bits.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import masks as M

N, K, H = 4, 2, 16
BLOCKS = (16, 16)


def _kwargs(impl):
  if impl == "dense":
    return dict(implementation="dense")
  return dict(implementation="chunked", schedule=impl, block_q=BLOCKS[0], block_kv=BLOCKS[1])


def measure(P, resp, impl):
  R, T = len(resp), P + sum(resp)
  rng = np.random.default_rng(0)
  q, k, v, do = (
    jnp.asarray(rng.standard_normal((1, T) + s), jnp.float32)
    for s in ((N, H), (K, H), (K, H), (N, H))
  )
  tree = M.prefix_tree(np.array([-1] + [0] * R), lengths=np.array([P] + resp), size=T)
  kw = _kwargs(impl)
  f = jax.jit(lambda q, k, v: jattn.dot_product_attention(q, k, v, mask=tree.mask, **kw))
  out, pull = jax.vjp(f, q, k, v)
  packed = (out[0],) + tuple(g[0] for g in pull(do))
  # Alone: response r's path is the prompt, then its own tokens; the prompt's cotangent goes
  # to the first path only, so the paths' losses add up to the packed one.
  starts = np.concatenate([[P], P + np.cumsum(resp)])
  lens = np.array([P + r for r in resp], np.int32)
  idx = np.zeros((R, P + max(resp)), int)
  owner = np.zeros(idx.shape, bool)
  for r in range(R):
    idx[r, : lens[r]] = np.concatenate([np.arange(P), np.arange(starts[r], starts[r + 1])])
    owner[r, : lens[r]] = True
  owner[1:, :P] = False
  g = jax.jit(
    lambda q, k, v: jattn.dot_product_attention(
      q, k, v, is_causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens, **kw
    )
  )
  alone_out, pull = jax.vjp(g, *(x[0][idx] for x in (q, k, v)))
  alone = (alone_out,) + pull(do[0][idx] * owner[:, :, None, None])
  back = [np.zeros(x.shape, np.float32) for x in packed]
  for r in range(R):
    n = lens[r]
    back[0][idx[r, :n][owner[r, :n]]] = np.asarray(alone[0])[r, :n][owner[r, :n]]
    for i in (1, 2, 3):  # gradients: summed over the paths, in float32
      back[i][idx[r, :n]] += np.asarray(alone[i])[r, :n]
  res = {}
  for name, a, b in zip(("out", "dq", "dk", "dv"), packed, back):
    a = np.asarray(a)
    for part, sel in (("prompt", np.arange(T) < P), ("responses", np.arange(T) >= P)):
      same = np.array_equal(a[sel], b[sel])
      res[f"{name} {part}"] = (
        "bitwise" if same else f"{np.abs(a[sel] - b[sel]).max() / np.abs(b[sel]).max():.1e}"
      )
  return res


def main():
  print(f"float32, N={N} K={K} H={H}, chunked blocks {BLOCKS}")
  for label, P, resp in (("aligned", 64, [32, 32, 32, 32]), ("unaligned", 61, [29, 35, 17, 40])):
    for impl in ("dense", "serial", "parallel"):
      print(
        f"{label:9s} {impl:8s}", "  ".join(f"{k}: {v}" for k, v in measure(P, resp, impl).items())
      )


if __name__ == "__main__":
  main()
