"""Selections written plainly for the tests of masks.selected_blocks and implementation="sparse":
random choices per row and their (B, N, T, S) boolean definition, built index by index, and
attention's definition in float64 jax.numpy for forward mode."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np


def indices(rng, Bi, T, K, n, S, block, unused=0.2):
  """Random (Bi, T, K, n) choices: distinct blocks per row, some slots -1."""
  blocks = -(-S // block)
  out = np.full((Bi, T, K, n), -1, np.int32)
  for b, t, k in itertools.product(range(Bi), range(T), range(K)):
    pick = rng.choice(blocks, size=min(n, blocks), replace=False)
    out[b, t, k, : len(pick)] = pick
  out[rng.random(out.shape) < unused] = -1
  return out


def by_hand(indices, block, N, T, S):
  """The (B, N, T, S) definition: query head h of example b at row t sees key s iff
  s // block is among indices[b, t, h // (N // K)]."""
  Bi, _, K, _ = indices.shape
  vis = np.zeros((Bi, N, T, S), bool)
  for b, h, t in itertools.product(range(Bi), range(N), range(T)):
    for c in indices[b, t, h // (N // K)]:
      if c >= 0:
        vis[b, h, t, c * block : (c + 1) * block] = True
  return vis


def f64_attention(q, k, v, bias, visible):
  """The definition in jax.numpy (float64 under jax.enable_x64), for jax.jvp: softmax over the
  visible keys of q.k / sqrt(H) + bias, GQA by repeating k and v; rows that see nothing: 0."""
  G = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(q.shape[-1]) + bias
  s = jnp.where(visible, s, -jnp.inf)
  any_ = visible.any(-1, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(any_, s.max(-1, keepdims=True), 0.0))
  e = jnp.where(visible, jnp.exp(s - m), 0.0)
  d = e.sum(-1, keepdims=True)
  return jnp.einsum("bnts,bsnh->btnh", e / jnp.where(d > 0, d, 1.0), vr)
