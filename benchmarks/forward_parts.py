"""Where the chunked forward's time goes on this CPU: the same loop structure as jattn's serial
schedule (query blocks of 512, key blocks of 256), written plainly, with more of the online
softmax each time. B = 1, T = S = 4096, N = 8, H = 64, float32; medians of 9 interleaved rounds,
with `jattn.bench.runner.settle` between calls. Run: python benchmarks/forward_parts.py

- matmuls: per tile S = Q K^T and acc += S V, nothing else (no softmax: a cost floor);
- + exp: the running max and exp(S - max), no rescaling of the carries;
- online softmax: the whole of it (running max, rescaled sum and accumulator, a final divide);
- jattn: `jattn.dot_product_attention(implementation="chunked", schedule="serial")`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import jattn
from jattn.bench import alternating, interleaved

B, T, N, H = 1, 4096, 8, 64
BQ, BK = 512, 256


def plain_loops(q, k, v, mode):
  qh = jnp.transpose(q, (0, 2, 1, 3)) * H**-0.5
  kh, vh = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))

  def row(i, out):
    qb = jax.lax.dynamic_slice_in_dim(qh, i * BQ, BQ, 2)

    def col(j, carry):
      m, l, acc = carry
      kb = jax.lax.dynamic_slice_in_dim(kh, j * BK, BK, 2)
      vb = jax.lax.dynamic_slice_in_dim(vh, j * BK, BK, 2)
      s = jnp.einsum("bnqh,bnsh->bnqs", qb, kb)
      if mode == "matmuls":
        return m, l, acc + jnp.einsum("bnqs,bnsh->bnqh", s, vb)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      if mode == "+ exp":
        return m_new, l, acc + jnp.einsum("bnqs,bnsh->bnqh", p, vb)
      corr = jnp.exp(m - m_new)
      return (
        m_new,
        l * corr + p.sum(-1),
        acc * corr[..., None] + jnp.einsum("bnqs,bnsh->bnqh", p, vb),
      )

    zeros = jnp.zeros((B, N, BQ))
    _m, l, acc = jax.lax.fori_loop(0, T // BK, col, (zeros - 1e30, zeros, jnp.zeros((B, N, BQ, H))))
    result = acc / l[..., None] if mode == "online softmax" else acc
    return jax.lax.dynamic_update_slice_in_dim(out, result, i * BQ, 2)

  return jax.lax.fori_loop(0, T // BQ, row, jnp.zeros_like(qh))


def main():
  q, k, v = (jax.random.normal(key, (B, T, N, H)) for key in jax.random.split(jax.random.key(0), 3))
  fns = {
    mode: jax.jit(lambda q, k, v, mode=mode: plain_loops(q, k, v, mode))
    for mode in ("matmuls", "+ exp", "online softmax")
  }
  fns["jattn"] = jax.jit(
    lambda q, k, v: jattn.dot_product_attention(
      q, k, v, implementation="chunked", schedule="serial", block_q=BQ, block_kv=BK
    )
  )
  ms = interleaved(
    {name: lambda f=f: f(q, k, v) for name, f in fns.items()},
    9,
    settle=True,
    order=alternating(fns),
  )
  flops = 4 * B * N * T * T * H
  for name, t in ms.items():
    med = t / 1e3
    print(f"{name:15s} {med:.3f} s  {flops / med / 1e9:6.1f} GFLOP/s (of the two matmuls)")


if __name__ == "__main__":
  main()
