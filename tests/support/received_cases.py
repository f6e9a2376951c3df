"""jattn.attention_received's test problem (tests/attention/test_received.py, and its mesh runs
in tests/parallel/test_received_sharded.py): the shapes, the implementations, the inputs, the
cases' keywords and visibility, and the float64 definition of the sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import reference as ref

B, T, S, N, K, H = 2, 40, 56, 4, 2, 16
IMPLS = {
  "dense": dict(implementation="dense"),
  "chunked": dict(implementation="chunked", block_q=16, block_kv=8),
  "None": {},
}


def inputs(dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(3), 2)
  q = 2.0 * jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32)
  return q.astype(dtype), k.astype(dtype)


def want(q, k, visible, **kw):
  """received[b, s, n] = sum_t P[b, n, t, s] from the float64 weights."""
  v = np.zeros(k.shape[:-1] + (1,))
  _, _, cache = ref.attention(
    np.asarray(q, np.float64), np.asarray(k, np.float64), v, visible=visible, **kw
  )
  return cache["p"].sum(axis=2).transpose(0, 2, 1)  # (B, S, N)


CASES = {
  "plain": (dict(), dict()),
  "causal, window": (
    dict(is_causal="bottom_right", local_window_size=(12, 0)),
    dict(causal="bottom_right", window=(12, 0)),
  ),
  "lengths": (
    dict(query_seq_lengths=np.array([40, 9]), key_value_seq_lengths=np.array([56, 0])),
    dict(q_lengths=[40, 9], kv_lengths=[56, 0]),
  ),
  "segments": ("segments", None),
  "bias, soft cap, sinks": ("bias", None),
}


def case(name):
  kw, vis_kw = CASES[name]
  ref_kw = {}
  if kw == "segments":
    qs = np.repeat([[0, 1], [0, 2]], [20, 20], axis=1).astype(np.int32)
    ks = np.repeat([[0, 1], [2, 0]], [30, 26], axis=1).astype(np.int32)
    kw, vis_kw = dict(q_segment_ids=qs, kv_segment_ids=ks), dict(q_seg=qs, kv_seg=ks)
  elif kw == "bias":
    bias = np.asarray(jax.random.normal(jax.random.key(5), (1, N, T, S)), np.float32)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    kw = dict(bias=bias, logits_soft_cap=5.0, sinks=sinks, is_causal=True)
    vis_kw = dict(causal="top_left")
    ref_kw = dict(bias=bias, soft_cap=5.0, sinks=sinks)
  return kw, ref.visible_mask(B, N, T, S, **vis_kw), ref_kw
