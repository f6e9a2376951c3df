"""Attention dropout as a pure function of (rng, batch, head, query index, key index).

A counter-based hash instead of `jax.random.bernoulli` over the (B, N, T, S) probabilities: any
block of the keep-mask can be generated on its own, so dense and chunked drop exactly the same
entries whatever the block sizes, and the backward pass regenerates the mask rather than storing
an O(T x S) array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_GOLDEN = 0x9E3779B9


def _mix(x):
  """A 32-bit finaliser (lowbias32): full avalanche, cheap elementwise uint32 arithmetic."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def seed_words(dropout_rng) -> jax.Array:
  """Two uint32 words from a PRNG key (typed or raw), the only randomness dropout consumes."""
  return jax.random.bits(dropout_rng, (2,), jnp.uint32)


def keep_mask(seed, rate: float, b, h, q, k) -> jax.Array:
  """True where the attention weight is kept.

  seed: (2,) uint32 from `seed_words`. b, h, q, k: int32 index arrays that broadcast against each
  other (e.g. (B,1,1,1), (1,N,1,1), (1,1,tq,1), (1,1,1,tk)). Returns their broadcast shape.
  """
  u = lambda x: jnp.asarray(x).astype(jnp.uint32)
  x = _mix(seed[0] ^ u(b) * jnp.uint32(_GOLDEN))
  x = _mix(x ^ u(h) + seed[1])
  x = _mix(x ^ u(q) * jnp.uint32(0x85EBCA6B))
  x = _mix(x ^ u(k) * jnp.uint32(0xC2B2AE35))
  # Compare in 32-bit integers: P(keep) = 1 - rate to within 2**-32.
  threshold = jnp.uint32(min(int(round(rate * 2.0**32)), 2**32 - 1))  # noqa: RUF046 -- rate may be a NumPy float
  return x >= threshold
