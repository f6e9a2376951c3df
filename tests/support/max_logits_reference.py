"""`return_max_logits`'s float64 NumPy reference and test problem (tests/attention/
test_max_logits.py, and its mesh and ring runs in tests/parallel/test_max_logits_sharded.py):
scale * q.k, then the soft cap, then the bias; the max over visible keys; -inf for a row that
sees none; a sink is not a key."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

B, T, S, N, K, H = 2, 40, 56, 4, 2, 16


def reference_max(q, k, *, scale, cap=None, bias=None, visible=None):
  """(B, T, N) float64: max over visible keys of cap(scale * q.k) + bias; -inf where none."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  G = q.shape[2] // k.shape[2]
  s = scale * np.einsum("btnh,bsnh->bnts", q, np.repeat(k, G, axis=2))
  if cap is not None:
    s = cap * np.tanh(s / cap)
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  if visible is not None:
    s = np.where(np.broadcast_to(visible, s.shape), s, -np.inf)
  return np.transpose(s.max(axis=-1), (0, 2, 1))


def visibility(*, causal=False, window=None, q_len=None, kv_len=None, q_seg=None, kv_seg=None):
  """(B, 1, T, S) boolean: which keys each query sees (top-left causal, (left, right) window)."""
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  vis = np.ones((B, 1, T, S), bool)
  if causal:
    vis &= j <= i
  if window is not None:
    vis &= (j >= i - window[0]) & (j <= i + window[1])
  if q_len is not None:
    vis &= (np.arange(T)[None, :, None] < np.asarray(q_len)[:, None, None])[:, None]
  if kv_len is not None:
    vis &= (np.arange(S)[None, None, :] < np.asarray(kv_len)[:, None, None])[:, None]
  if q_seg is not None:
    vis &= (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])[:, None]
  return vis


def inputs(dtype=jnp.float32):
  r = np.random.default_rng(0)
  q = r.normal(size=(B, T, N, H)) * 2.0
  k = r.normal(size=(B, S, K, H))
  v = r.normal(size=(B, S, K, H))
  bias = r.normal(size=(B, N, T, S))
  # Rounded to the input dtype first: the reference sees what the kernels see.
  rounded = [np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v)]
  return [jnp.asarray(x, dtype) for x in (q, k, v)], rounded, bias.astype(np.float32)


Q_LEN, KV_LEN = np.array([40, 27]), np.array([56, 33])
Q_SEG = np.repeat(np.array([[0, 1, 2, 3], [0, 0, 1, 1]]), 10, axis=1)
KV_SEG = np.repeat(np.array([[0, 1, 2, 3], [0, 0, 1, 1]]), 14, axis=1)
SINKS = np.array([0.5, 30.0, -1.0, 2.0], np.float32)  # head 1's sink exceeds every logit
