"""`return_max_logits`: each row's max logit over the keys it sees, from the attention pass itself.

Against a float64 NumPy reference (tests/support/max_logits_reference.py: scale * q.k, then the soft
cap, then the bias; the max over visible keys; -inf for a row that sees none; a sink is not a key),
on dense and chunked (both schedules), with masks, GQA, soft cap, bias, sinks, empty rows and
bfloat16 inputs; under jit and grad (the output's gradient unchanged, none through the max); the
return order with ``return_residual``; the fused kernels refusing it; the Flax modules' sowing.
Under Explicit and Auto meshes and through ring attention (4 host devices, in a subprocess):
tests/parallel/test_max_logits_sharded.py.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from max_logits_reference import (
  KV_LEN,
  KV_SEG,
  Q_LEN,
  Q_SEG,
  SINKS,
  B,
  H,
  N,
  S,
  T,
  inputs,
  reference_max,
  visibility,
)

import jattn

IMPLS = [("dense", None), ("chunked", "serial"), ("chunked", "parallel")]

CASES = {
  # causal (bottom rows of example 1 empty through q lengths), GQA, soft cap, bias, sinks
  "causal_cap_bias_sinks_lengths": (
    dict(is_causal=True, logits_soft_cap=5.0, query_seq_lengths=Q_LEN, sinks=SINKS, bias=True),
    dict(causal=True, q_len=Q_LEN),
  ),
  # a window with segment ids and key lengths: some rows see nothing
  "window_segments_kv_lengths": (
    dict(
      local_window_size=(3, 0),
      q_segment_ids=Q_SEG,
      kv_segment_ids=KV_SEG,
      key_value_seq_lengths=KV_LEN,
    ),
    dict(window=(3, 0), q_seg=Q_SEG, kv_seg=KV_SEG, kv_len=KV_LEN),
  ),
  # a boolean mask array with whole rows off, and an array scale (an operand)
  "mask_array_sinks": (
    dict(mask=True, sinks=SINKS, scale=0.3),
    dict(),
  ),
}


def _mask_array():
  m = np.random.default_rng(1).random((B, N, T, S)) < 0.3
  m[:, :, 5] = False  # row 5 sees nothing
  return m


def _call(case, impl, schedule, dtype=jnp.float32, **extra):
  kw, vis_kw = CASES[case]
  (q, k, v), rounded, bias = inputs(dtype)
  kw = dict(kw)
  vis = visibility(**vis_kw)
  if kw.pop("bias", False):
    kw["bias"] = bias
  if kw.pop("mask", False):
    kw["mask"] = _mask_array()
    vis = vis & kw["mask"]
  scale = kw.get("scale", 1 / np.sqrt(H))
  want = reference_max(
    *rounded[:2], scale=scale, cap=kw.get("logits_soft_cap"), bias=kw.get("bias"), visible=vis
  )
  got = jattn.dot_product_attention(
    q, k, v, implementation=impl, schedule=schedule, block_q=16, block_kv=16, **kw, **extra
  )
  return got, want, (q, k, v), kw


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl,schedule", IMPLS)
def test_against_reference(case, impl, schedule):
  (out, mx), want, (q, k, v), kw = _call(case, impl, schedule, return_max_logits=True)
  assert mx.shape == (B, T, N) and mx.dtype == jnp.float32
  assert np.isneginf(want).any() and np.isfinite(want).any()  # empty rows and seen ones
  np.testing.assert_array_equal(np.isneginf(mx), np.isneginf(want))
  np.testing.assert_allclose(np.asarray(mx), want, rtol=2e-6, atol=2e-6)
  # The output is the one the call gives without the max logits.
  alone = jattn.dot_product_attention(
    q, k, v, implementation=impl, schedule=schedule, block_q=16, block_kv=16, **kw
  )
  np.testing.assert_array_equal(np.asarray(out), np.asarray(alone))


@pytest.mark.parametrize("impl,schedule", IMPLS)
def test_bfloat16_inputs(impl, schedule):
  (out, mx), want, _, _ = _call(
    "causal_cap_bias_sinks_lengths", impl, schedule, jnp.bfloat16, return_max_logits=True
  )
  assert out.dtype == jnp.bfloat16 and mx.dtype == jnp.float32
  np.testing.assert_array_equal(np.isneginf(mx), np.isneginf(want))
  # The logits are float32 products of the bfloat16 inputs (the prescaled query rounds once).
  np.testing.assert_allclose(np.asarray(mx), want, rtol=2e-2, atol=2e-2)


def test_sink_is_not_a_key():
  """Head 1's sink (30) exceeds every logit: the max logits are the keys' all the same."""
  (_, mx), want, _, _ = _call(
    "causal_cap_bias_sinks_lengths", "chunked", "serial", return_max_logits=True
  )
  seen = np.isfinite(want[:, :, 1])
  assert (want[:, :, 1][seen] < 29).all()
  np.testing.assert_allclose(np.asarray(mx)[:, :, 1][seen], want[:, :, 1][seen], rtol=2e-6)


@pytest.mark.parametrize("impl,schedule", IMPLS)
def test_order_unbatched_jit_and_grad(impl, schedule):
  (q, k, v), rounded, _ = inputs()
  kw = dict(is_causal=True, sinks=SINKS, implementation=impl, schedule=schedule)
  kw.update(block_q=16, block_kv=16)
  out, lse, mx = jattn.dot_product_attention(
    q[0], k[0], v[0], return_residual=True, return_max_logits=True, **kw
  )
  assert out.shape == (T, N, H) and lse.shape == mx.shape == (T, N)
  want = reference_max(
    *(x[:1] for x in rounded[:2]), scale=1 / np.sqrt(H), visible=visibility(causal=True)[:1]
  )
  np.testing.assert_allclose(np.asarray(mx), want[0], rtol=2e-6, atol=2e-6)

  w = jnp.asarray(np.random.default_rng(2).normal(size=out.shape), out.dtype)

  def loss(with_max, q, k, v):
    if not with_max:
      return (jattn.dot_product_attention(q, k, v, **kw) * w).sum()
    o, m = jattn.dot_product_attention(q, k, v, return_max_logits=True, **kw)
    return (o * w).sum() + 0.0 * m.sum()

  args = (q[0], k[0], v[0])
  g_plain = jax.jit(jax.grad(lambda *a: loss(False, *a), argnums=(0, 1, 2)))(*args)
  g_max = jax.jit(jax.grad(lambda *a: loss(True, *a), argnums=(0, 1, 2)))(*args)
  for a, b in zip(g_plain, g_max):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)

  # The max logits are a statistic: no gradient flows through them.
  def max_only(q):
    _, m = jattn.dot_product_attention(q, k[0], v[0], return_max_logits=True, **kw)
    return jnp.where(jnp.isfinite(m), m, 0.0).sum()

  assert not np.asarray(jax.grad(max_only)(q[0])).any()
  # Forward mode through chunked: its tangent is zero.
  _, t = jax.jvp(
    lambda q: jattn.dot_product_attention(q, k[0], v[0], return_max_logits=True, **kw)[1],
    (q[0],),
    (q[0],),
  )
  assert not np.asarray(t).any()


def test_empty_batch():
  z = jnp.zeros((0, 8, 2, 4))
  out, mx = jattn.dot_product_attention(z, z, z, return_max_logits=True, implementation="chunked")
  assert out.shape == (0, 8, 2, 4) and mx.shape == (0, 8, 2)


def test_fused_kernels_refuse_and_bad_input():
  (q, k, v), _, _ = inputs()
  for name in ("splash", "cudnn", "pallas_gpu"):
    with pytest.raises(NotImplementedError, match="return_max_logits"):
      jattn.dot_product_attention(q, k, v, implementation=name, return_max_logits=True)
  # A sequence falls through to the kernels that return them, saying why.
  with pytest.warns(UserWarning, match="return_max_logits"):
    _, mx = jattn.dot_product_attention(
      q, k, v, implementation=("splash", "chunked"), return_max_logits=True
    )
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _, mx_none = jattn.dot_product_attention(q, k, v, return_max_logits=True)
  np.testing.assert_allclose(np.asarray(mx), np.asarray(mx_none), rtol=1e-6)
  with pytest.raises(TypeError, match="return_max_logits must be a bool"):
    jattn.dot_product_attention(q, k, v, return_max_logits=1)


def test_flax_modules_sow_max_logits():
  from flax import nnx

  from jattn import linen as jlinen
  from jattn import nnx as jnnx

  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 24, 32)), jnp.float32)
  m = jlinen.MultiHeadAttention(
    num_heads=4, num_kv_heads=2, is_causal=True, implementation="chunked"
  )
  params = m.init(jax.random.PRNGKey(0), x)
  y, state = m.apply(params, x, sow_max_logits=True, mutable=["intermediates"])
  (mx,) = state["intermediates"]["max_logits"]
  assert mx.shape == (2, 24, 4) and mx.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), np.asarray(m.apply(params, x)))
  p = params["params"]
  q = jnp.einsum("btd,dnh->btnh", x, p["query"]["kernel"]) + p["query"]["bias"][None, None]
  kk = jnp.einsum("btd,dnh->btnh", x, p["key"]["kernel"]) + p["key"]["bias"][None, None]
  want = reference_max(q, kk, scale=1 / np.sqrt(8), visible=np.tril(np.ones((24, 24), bool)))
  np.testing.assert_allclose(np.asarray(mx), want, rtol=1e-5, atol=1e-5)

  n = jnnx.MultiHeadAttention(
    num_heads=4, in_features=32, num_kv_heads=2, is_causal=True, rngs=nnx.Rngs(0)
  )
  forward = nnx.capture(nnx.Intermediate)(lambda m, x: m(x, sow_max_logits=True))
  _, inter = forward(n, x)
  (mx_n,) = inter["max_logits"]
  q, kk = n.query(x), n.key(x)
  want = reference_max(q, kk, scale=1 / np.sqrt(8), visible=np.tril(np.ones((24, 24), bool)))
  np.testing.assert_allclose(np.asarray(mx_n), want, rtol=1e-5, atol=1e-5)
  with pytest.raises(TypeError, match="sow_max_logits"):
    m.apply(params, x, sow_max_logits="yes")
