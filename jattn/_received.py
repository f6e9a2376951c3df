"""The attention each key receives: per query head, the sum over queries of the key's softmax
weight, for KV-cache eviction (H2O, SnapKV, TOVA) and token pruning.

    received[b, s, n] = sum_t P[b, n, t, s],   P = softmax(scale * q.k + bias, masked)

Why it is a gradient: with values of one feature, all ones, the output is out = P @ 1, and the
derivative of sum(out) with respect to that value is P^T @ 1, the column sums. The backward of
`jattn.dot_product_attention` computes it: dense from its (T, S) matrix; chunked key block by key
block from the forward's log-sum-exp, never holding the (T, S) matrix (O(T + S) memory). The keys
are repeated per query head first, so that a grouped head's column sums are not added together
over its group.

Cost: one forward and one backward (the queries' and keys' gradients are computed too and
discarded), in float32 whatever the inputs' dtype, so that the sums come out in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jattn import _attention, _sharding, _validation
from jattn import masks as _masks
from jattn._types import ArrayLike, Implementation, IsCausal, LocalWindowSize


def attention_received(
  query: ArrayLike,
  key: ArrayLike,
  bias: ArrayLike | None = None,
  mask: ArrayLike | _masks.Mask | None = None,
  *,
  scale: float | None = None,
  is_causal: IsCausal = False,
  query_seq_lengths: ArrayLike | None = None,
  key_value_seq_lengths: ArrayLike | None = None,
  local_window_size: LocalWindowSize | None = None,
  q_segment_ids: ArrayLike | None = None,
  kv_segment_ids: ArrayLike | None = None,
  logits_soft_cap: float | None = None,
  score_mod: Callable | None = None,
  sinks: ArrayLike | None = None,
  q_positions: ArrayLike | None = None,
  kv_positions: ArrayLike | None = None,
  implementation: Implementation | None = None,
  block_q: int | None = None,
  block_kv: int | None = None,
) -> jax.Array:
  """(B, S, N) float32: for each key and query head, the sum over the queries of the key's
  softmax weight in the attention `jattn.dot_product_attention` computes with these arguments
  (no dropout). Unbatched (T, N, H) / (S, K, H) inputs give (S, N).

  Args:
    query: (B, T, N, H) or unbatched (T, N, H).
    key: (B, S, K, H) or (S, K, H), N a multiple of K (GQA: each query head's own sums).
    bias, mask, and the keywords: as in `jattn.dot_product_attention`. A query that sees no
      key adds nothing; with ``sinks`` the sink's share is no key's.
    implementation: None, "dense" (the (T, S) weights) or "chunked" (O(T + S) memory), or any
      name of dot_product_attention with a backward.

  Each query row's weights sum to 1 (less the sink's share), so the result summed over keys is
  the number of queries that see a key.
  """
  qa = _validation.float_array("query", query)
  ka = _validation.float_array("key", key)
  if ka.ndim != qa.ndim or qa.ndim not in (3, 4):
    raise ValueError(
      f"query and key must be (B, T, N, H) and (B, S, K, H) (or both unbatched), got "
      f"query.shape={qa.shape}, key.shape={ka.shape}"
    )
  N, K = qa.shape[-2], ka.shape[-2]
  if K == 0 or N % K:
    raise ValueError(f"the query heads N={N} must be a multiple of the key/value heads K={K}")
  # Float32 throughout: the sums are returned in float32, and dot_product_attention returns its
  # value gradient in the value's dtype.
  q = qa.astype(jnp.float32)
  k = ka.astype(jnp.float32)
  if N != K:
    # (B, S, N, H): head n sees n // G. Head-sharded keys stay sharded on the head axis (an
    # Explicit mesh makes the sharding part of the type, and repeat must be told).
    spec = _sharding.spec_of(k) if _sharding.explicit_mesh() else None
    k = jnp.repeat(k, N // K, axis=-2, out_sharding=spec)
  # Typed like the keys: under an Explicit mesh the values' sharding is the kernels' carry's.
  ones = jnp.ones_like(k[..., :1])

  def total(v):
    out = _attention.dot_product_attention(
      q,
      k,
      v,
      None if bias is None else _validation.float_array("bias", bias).astype(jnp.float32),
      mask,
      scale=scale,
      is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size,
      q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids,
      logits_soft_cap=logits_soft_cap,
      score_mod=score_mod,
      sinks=sinks,
      q_positions=q_positions,
      kv_positions=kv_positions,
      implementation=implementation,
      block_q=block_q,
      block_kv=block_kv,
    )
    return out.sum()

  return jax.grad(total)(ones)[..., 0]
