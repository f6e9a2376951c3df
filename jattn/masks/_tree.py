"""`tree_mask`: the boolean mask of a tree of draft tokens (speculative decoding), from each
token's parent, in the form `jattn.paged_attention`'s ``new_token_mask`` takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _validation


def tree_mask(parents):
  """(..., T, T) bool: token i sees token j iff j is i or one of its ancestors.

  ``parents``: int (..., T), token i's parent among the T tokens, or -1 for a root (a token
  whose parent is the cached prefix). Parents come before their children (parents[i] < i, the
  order in which trees of draft tokens are written and verified); known values are checked
  (ValueError), traced ones are taken as given. The result is ``paged_attention``'s padded
  ``new_token_mask`` for parents (B, T); the ragged form stacks each sequence's rows."""
  parents = _validation.int_array("tree_mask: parents", parents)
  if parents.ndim < 1:
    raise ValueError(f"tree_mask: parents must be (..., T), got shape {parents.shape}")
  T = parents.shape[-1]
  if not isinstance(parents, jax.core.Tracer):
    p = np.asarray(parents)
    bad = np.argwhere((p < -1) | (p >= np.arange(T)))
    if bad.size:
      i = tuple(int(x) for x in bad[0])
      raise ValueError(
        f"tree_mask: parents[{', '.join(map(str, i))}]={int(p[i])} must be -1 (a root) or an "
        f"earlier token's index in [0, {i[-1]}) (parents before children)"
      )
  # Ancestors by doubling: ``reach`` holds the ancestors within 2^s steps, and squaring it as a
  # boolean matrix product doubles that; log2(T) products reach the root of any path.
  lead = (1,) * (parents.ndim - 1)
  tokens = jnp.arange(T)
  itself = (tokens[:, None] == tokens[None, :]).reshape(lead + (T, T))
  reach = (parents[..., :, None] == tokens.reshape(lead + (1, T))) | itself  # (..., T, T)
  for _ in range(max(T - 1, 0).bit_length()):
    r = reach.astype(jnp.int32)
    reach = reach | (jnp.matmul(r, r) > 0)
  return reach
