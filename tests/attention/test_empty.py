"""Empty problems (issue #42): no examples (B = 0), no heads (N = K = 0), no queries (T = 0) or
no keys (S = 0) give jax.nn's results on every implementation, forward and gradients. An empty
array's whole content is its shape and dtype, so those are what these tests compare (against
jax.nn where it answers); with no keys every row sees nothing, so its output is 0 (jattn's empty
row, and jax.nn's answer) and its log-sum-exp that of the sink alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn._attention import attention_weights  # what make_attention_fn's sow_weights calls

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
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("T, S", [(0, 8), (8, 0), (0, 0)])
def test_empty_sequences_give_jax_nns_answer(impl, option, T, S):
  B, N, K, H = 2, 4, 2, 8
  rng = np.random.default_rng(0)  # NumPy: jax.random would compile a program per shape
  q, k, v = (
    jnp.asarray(rng.standard_normal(shape), jnp.float32)
    for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H))
  )
  kw = _kwargs(option, B, T, S, N)
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation=impl, **kw)
  out = f(q, k, v)
  jattn_only = ("local_window_size", "logits_soft_cap", "q_segment_ids", "kv_segment_ids")
  nn_kw = {x: y for x, y in kw.items() if x not in jattn_only}
  want = jax.nn.dot_product_attention(q, k, v, **nn_kw)
  assert (out.shape, out.dtype) == (want.shape, want.dtype) == ((B, T, N, H), jnp.float32)
  np.testing.assert_array_equal(out, want)  # zeros where S = 0
  grads = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(q, k, v)
  for g, x in zip(grads, (q, k, v)):
    assert (g.shape, g.dtype) == (x.shape, x.dtype)
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_keys_leave_each_row_its_sink(impl):
  """With sinks and S = 0 a row's softmax holds the sink alone: output 0, log-sum-exp the sink
  (as for a row whose keys are all masked), and the sinks' gradient through that lse."""
  B, T, N, K, H = 2, 3, 4, 2, 8
  q = jnp.ones((B, T, N, H))
  sinks = jnp.array([0.5, -1.0, 2.0, 0.0])

  def lse(sinks, S=0):
    kv = jnp.ones((B, S, K, H))
    mask = jnp.zeros((B, N, T, S), bool)
    out, lse = jattn.dot_product_attention(
      q, kv, kv, mask=mask, sinks=sinks, implementation=impl, return_residual=True
    )
    return lse, out

  (got, out), (masked, _) = lse(sinks), lse(sinks, S=5)
  np.testing.assert_array_equal(out, 0.0)
  np.testing.assert_array_equal(got, np.broadcast_to(sinks, (B, T, N)))
  np.testing.assert_array_equal(got, masked)
  cotangent = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, N)), jnp.float32)
  grad = lambda S: jax.grad(lambda s: (lse(s, S)[0] * cotangent).sum())(sinks)
  np.testing.assert_allclose(grad(0), cotangent.sum((0, 1)), rtol=1e-6)
  np.testing.assert_allclose(grad(0), grad(5), rtol=1e-6)


@pytest.mark.parametrize("T, S", [(0, 8), (8, 0)])
def test_empty_sequences_through_weights_and_received(T, S):
  q, k = jnp.ones((1, T, 4, 8)), jnp.ones((1, S, 2, 8))
  weights = attention_weights(q, k, k, is_causal=True)
  assert (weights.shape, weights.dtype) == ((1, 4, T, S), jnp.float32)
  received = jattn.attention_received(q, k, is_causal=True)
  assert received.shape == (1, S, 4)
  np.testing.assert_array_equal(received, 0.0)


@pytest.mark.parametrize("T, S", [(0, 8), (8, 0)])
def test_the_other_entry_points_keep_the_empty_sequence_error(T, S):
  q, k = jnp.ones((1, T, 2, 8)), jnp.ones((1, S, 2, 8))
  with pytest.raises(ValueError, match="empty attention"):
    jattn.diagnostics.attention_stats(q, k, k)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
  "form,rows",
  [("padded", None), ("ragged", 0), ("ragged", 2)],
  ids=["padded", "ragged0", "ragged2"],
)
def test_paged_calls_without_sequences(form, rows, jit):
  """paged_attention and write_pages with B = 0 (an engine step with no running request): empty
  outputs; ragged rows past query_start[0] = 0 belong to no sequence (output 0, lse NEG) and
  write nothing."""
  P, PS, K, H, N = 4, 4, 2, 8, 4
  pool = jnp.arange(P * PS * K * H, dtype=jnp.float32).reshape(P, PS, K, H)
  table, lens = np.zeros((0, 2), np.int32), np.zeros((0,), np.int32)
  kw = {} if form == "padded" else dict(query_start=np.array([0]))
  q = jnp.ones((0, 3, N, H) if form == "padded" else (rows, N, H))
  new = jnp.ones(q.shape[:-2] + (K, H))
  attend = jax.jit(jattn.paged_attention, static_argnames="return_residual") if jit else None
  attend = attend or jattn.paged_attention
  out, lse = attend(q, pool, pool + 1, table, lens, return_residual=True, **kw)
  assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
  np.testing.assert_array_equal(out, 0.0)
  assert (np.asarray(lse) < -1e30).all()
  write = jax.jit(jattn.write_pages) if jit else jattn.write_pages
  written = write(pool, pool + 1, table, lens, new, new, **kw)
  np.testing.assert_array_equal(written.key_pages, pool)
  np.testing.assert_array_equal(written.value_pages, pool + 1)
