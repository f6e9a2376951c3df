"""Selections written plainly for the tests of masks.selected_blocks and implementation="sparse":
random choices per row and their (B, N, T, S) boolean definition, built index by index, and the
16-bit rule's two measures."""

import itertools

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
