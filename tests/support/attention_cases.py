"""What the attention tests share: the implementations every semantic check runs on, and the
inputs and 16-bit baseline of tests/attention/test_attention.py that other files reuse."""

import jax
import jax.numpy as jnp
import numpy as np

# Chunked runs with small, non-dividing blocks so ragged edges and many blocks are exercised.
# The chunked kernels in both schedules: "chunked" is the serial walk (CPU's default), "parallel"
# computes every lane's next block per step (GPU's and TPU's default); one semantics. The
# parallel schedule runs its lanes two per step here (step_width=2): groups, and a last group
# filled with padding lanes whenever the lanes are odd; test_chunked and the property test
# cover the other widths (1, 3, all).
IMPLS = {
  "dense": dict(implementation="dense"),
  "chunked": dict(implementation="chunked", block_q=16, block_kv=24, schedule="serial"),
  "parallel": dict(
    implementation="chunked", block_q=16, block_kv=24, schedule="parallel", step_width=2
  ),
}
# For a check of what a tile computes (a feature's mask, score function, scale): dense and the
# serial chunked kernels. The parallel schedule runs the same tile code and differs in how tiles
# are laid out and merged; it takes every feature in tests/properties/test_matrix.py (each option
# on chunked-parallel) and all of them composed in test_attention's TestAgainstReference, and
# its programs take about twice as long to compile as the serial ones'.
TILE_IMPLS = ("dense", "chunked")


def inputs(B=2, T=37, S=45, N=4, K=2, H=16, dtype=jnp.float32, seed=0):
  kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, H), jnp.float32).astype(dtype)
  do = jax.random.normal(kd, (B, T, N, H), jnp.float32).astype(dtype)
  return q, k, v, do


def plain_low_precision(q, k, v, causal):
  """Everything in the input dtype: logits, softmax and all (the baseline a bf16 kernel beats)."""
  H = q.shape[-1]
  G = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, kr) * jnp.asarray(1 / np.sqrt(H), q.dtype)
  if causal:
    T, S = s.shape[-2:]
    s = jnp.where(jnp.tril(jnp.ones((T, S), bool))[None, None], s, jnp.asarray(-1e4, q.dtype))
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", p, vr)
