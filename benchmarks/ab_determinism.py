"""CPU A/B of the paths the deterministic merges touched: steady-state medians (ms) of jitted calls (docs/benchmarks.md, 2026-12-05)."""

import json

import jax
import jax.numpy as jnp

import jattn
from jattn.bench import interleaved

B, N, H = 1, 8, 64


def arr(T, seed):
  ks = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(k, (B, T, N, H)) for k in ks)


def fb(f):
  g = jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2))
  return jax.jit(g)


cases = {
  "dense T=1024 fwd": (
    jax.jit(lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="dense")),
    1024,
  ),
  "serial causal T=4096 fwd+bwd": (
    fb(
      lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="chunked", is_causal=True)
    ),
    4096,
  ),
  "serial lengths T=4096 fwd+bwd": (
    fb(
      lambda q, k, v: jattn.dot_product_attention(
        q, k, v, implementation="chunked", key_value_seq_lengths=jnp.array([3500]), is_causal=True
      )
    ),
    4096,
  ),
  "parallel causal T=2048 fwd+bwd": (
    fb(
      lambda q, k, v: jattn.dot_product_attention(
        q, k, v, implementation="chunked", schedule="parallel", is_causal=True
      )
    ),
    2048,
  ),
  "parallel lengths T=2048 fwd": (
    jax.jit(
      lambda q, k, v: jattn.dot_product_attention(
        q,
        k,
        v,
        implementation="chunked",
        schedule="parallel",
        key_value_seq_lengths=jnp.array([1500]),
      )
    ),
    2048,
  ),
}
out = {}
for name, (f, T) in cases.items():
  a = arr(T, 0)
  out[name] = interleaved({name: lambda f=f, a=a: f(*a)}, 5)[name]
print(json.dumps({"tree": jattn.__file__.split("/jattn/")[0], **out}))
