"""Decoding's logits on this CPU, four ways: why the cache's (B, S, K, H) layout costs time here.

One query token per head (T = 1), B = 4, N = 32, K = 8 (G = 4), H = 128, S = 16384, the
logits only (the P V product is the same question in reverse). Medians of 7 interleaved rounds,
with `jattn.bench.runner.settle` between calls. Run: python benchmarks/decode_layouts.py

- stream: reading the cache once (K converted to float32 and summed), the memory floor;
- einsum: the batched matmul on the cache as stored, (B, S, K, H) x (B, K, G, H): XLA's CPU
  backend moves the key/value head to a leading batch axis first, a relayout of the whole cache;
- head-major: the same on a cache already stored as (B, K, S, H) (a different cache layout);
- block-diagonal: one plain matmul of the cache as (B, S, K * H) against the query laid out as a
  (K * H, K * G) block-diagonal matrix, zero outside each head's block: K times the arithmetic,
  no relayout.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from jattn.bench import alternating, interleaved

B, S, K, G, H = 4, 16384, 8, 4, 128


def block_diagonal(q, k):
  eye = jnp.eye(K, dtype=q.dtype)
  # (B, K, K', G, H), nonzero where k == k'; rows (k, h), columns (k', g).
  qbd = jnp.transpose(q[:, :, None] * eye[None, :, :, None, None], (0, 1, 4, 2, 3))
  s = jnp.einsum(
    "bsc,bcd->bsd",
    k.reshape(B, S, K * H),
    qbd.reshape(B, K * H, K * G),
    preferred_element_type=jnp.float32,
  )
  return s.reshape(B, S, K, G)


def main():
  for dtype in (jnp.float32, jnp.bfloat16):
    k = jax.random.normal(jax.random.key(0), (B, S, K, H)).astype(dtype)
    q = jax.random.normal(jax.random.key(1), (B, K, G, H)).astype(dtype)
    k_head_major = jnp.transpose(k, (0, 2, 1, 3))
    fns = {
      "stream": (jax.jit(lambda k: k.astype(jnp.float32).sum()), (k,)),
      "einsum": (
        jax.jit(
          lambda q, k: jnp.einsum("bskh,bkgh->bskg", k, q, preferred_element_type=jnp.float32)
        ),
        (q, k),
      ),
      "head-major": (
        jax.jit(
          lambda q, k: jnp.einsum("bksh,bkgh->bksg", k, q, preferred_element_type=jnp.float32)
        ),
        (q, k_head_major),
      ),
      "block-diagonal": (jax.jit(block_diagonal), (q, k)),
    }
    want = np.asarray(fns["einsum"][0](q, k))
    np.testing.assert_allclose(
      np.asarray(fns["block-diagonal"][0](q, k)), want, rtol=1e-4, atol=1e-3
    )
    ms = interleaved(
      {name: lambda f=f, args=args: f(*args) for name, (f, args) in fns.items()},
      7,
      settle=True,
      order=alternating(fns),
    )
    row = ", ".join(f"{name} {t:.1f} ms" for name, t in ms.items())
    print(f"{jnp.dtype(dtype).name}: {row}")


if __name__ == "__main__":
  main()
