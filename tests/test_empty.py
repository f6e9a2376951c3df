"""Empty problems (issue #42): no examples (B = 0) or no heads (N = K = 0) give empty results on
every implementation, forward and gradients, as jax.nn's dense path does; empty sequences
(T = 0 or S = 0) keep their clear error. An empty array's whole content is its shape and dtype,
so those are what these tests compare (against jax.nn where it answers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

IMPLS = ["dense", "chunked", None]
OPTIONS = {
  "plain": {},
  "causal": dict(is_causal=True),
  "window": dict(local_window_size=(4, 0), logits_soft_cap=20.0),
  "lengths": "lengths",
  "segments": "segments",
  "bias": "bias",
}


def _kwargs(name, B, T, S, N):
  kw = OPTIONS[name]
  if kw == "lengths":
    return dict(
      query_seq_lengths=jnp.zeros((B,), jnp.int32), key_value_seq_lengths=jnp.zeros((B,), jnp.int32)
    )
  if kw == "segments":
    return dict(
      q_segment_ids=jnp.zeros((B, T), jnp.int32), kv_segment_ids=jnp.zeros((B, S), jnp.int32)
    )
  if kw == "bias":
    return dict(bias=jnp.zeros((B, N, T, S), jnp.float32))
  return kw


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_no_examples_give_an_empty_result_and_empty_gradients(impl, option, dtype):
  B, T, S, N, K, H, Hv = 0, 16, 24, 4, 2, 8, 6
  q = jnp.ones((B, T, N, H), dtype)
  k = jnp.ones((B, S, K, H), dtype)
  v = jnp.ones((B, S, K, Hv), dtype)
  kw = _kwargs(option, B, T, S, N)
  f = jax.jit(lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation=impl, **kw))
  out = f(q, k, v)
  assert (out.shape, out.dtype) == ((B, T, N, Hv), jnp.dtype(dtype))
  if Hv == H:  # jax.nn takes value's head size only equal to key's
    want = jax.nn.dot_product_attention(q, k, v)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  loss = lambda q, k, v: f(q, k, v).astype(jnp.float32).sum()
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for g, x in zip(grads, (q, k, v)):
    assert (g.shape, g.dtype) == (x.shape, x.dtype)
  out, lse = jattn.dot_product_attention(q, k, v, implementation=impl, return_residual=True, **kw)
  assert lse.shape == (B, T, N) and out.shape == (B, T, N, Hv)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_examples_matches_jax_nn_at_equal_head_sizes(impl):
  q = jax.random.normal(jax.random.key(0), (0, 8, 4, 16))
  k = jax.random.normal(jax.random.key(1), (0, 12, 2, 16))
  got = jattn.dot_product_attention(q, k, k, implementation=impl, is_causal=True)
  want = jax.nn.dot_product_attention(q, k, k, is_causal=True)
  assert (got.shape, got.dtype) == (want.shape, want.dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("batched", [True, False])
def test_no_heads_give_an_empty_result_and_empty_gradients(impl, batched):
  # jax.nn raises ZeroDivisionError here (N % K with K = 0); an empty answer is the useful one.
  lead = (2,) if batched else ()
  q, k = jnp.ones(lead + (16, 0, 8)), jnp.ones(lead + (24, 0, 8))
  out = jattn.dot_product_attention(q, k, k, implementation=impl, is_causal=True)
  assert out.shape == q.shape
  grads = jax.grad(
    lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation=impl).sum(), argnums=(0, 1)
  )(q, k, k)
  assert grads[0].shape == q.shape and grads[1].shape == k.shape


def test_query_heads_without_key_heads_are_still_an_error():
  with pytest.raises(ValueError, match="key/value heads K=0"):
    jattn.dot_product_attention(
      jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 0, 8)), jnp.ones((1, 4, 0, 8))
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T, S", [(0, 8), (8, 0)])
def test_empty_sequences_keep_their_clear_error(impl, T, S):
  q, k = jnp.ones((1, T, 2, 8)), jnp.ones((1, S, 2, 8))
  with pytest.raises(ValueError, match="empty attention"):
    jattn.dot_product_attention(q, k, k, implementation=impl)
