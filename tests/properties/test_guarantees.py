"""Guarantees the README makes that the per-feature tests do not reach: the automatic choice at its
boundary with the default blocks, dtypes at the edges, lse without gradient, garbage hidden by
every kind of mask, and the 16-bit rule with every feature that changes the logits.

Every check is against the float64 reference of tests/support/reference.py (or jax.nn), never jattn
against itself.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from attention_cases import IMPLS, inputs
from dropout_reference import keep_mask

import jattn


def _vjp(f, primals, cotangent):
  """f's output at ``primals`` and its pullback of ``cotangent``: forward and backward in one
  compiled program (a program apart for each would compile longer)."""

  def both(primals, cotangent):
    out, pull = jax.vjp(f, *primals)
    return out, pull(cotangent)

  return jax.jit(both)(primals, cotangent)


def _uses_loop(f, *args) -> bool:
  """Whether the traced program has a while loop: the chunked kernels do, dense attention not."""
  return "while" in str(jax.make_jaxpr(f)(*args))


@pytest.mark.parametrize(
  "T,S,chosen", [(1024, 1024, "chunked"), (1023, 1025, "dense"), (1000, 1100, "chunked")]
)
def test_automatic_choice_at_its_boundary_with_default_blocks(T, S, chosen):
  # implementation=None switches to chunked at T*S >= 2^20 scores per head. These calls run the
  # default 512 x 256 blocks (ragged at 1000 x 1100) against the float64 reference.
  B, N, K, H = 1, 2, 1, 8
  q, k, v, do = inputs(B=B, T=T, S=S, N=N, K=K, H=H, seed=1)
  lens = jnp.asarray([S - 77], jnp.int32)
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, is_causal="bottom_right", key_value_seq_lengths=lens
  )
  assert _uses_loop(f, q, k, v) == (chosen == "chunked")
  out, grads = _vjp(f, (q, k, v), do)
  vis = ref.visible_mask(B, N, T, S, causal="bottom_right", kv_lengths=[S - 77])
  want, _, cache = ref.attention(q, k, v, visible=vis)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  for got, w in zip(grads, ref.grads(cache, do)[:3]):
    np.testing.assert_allclose(got, w, rtol=2e-4, atol=1e-4)


def test_xla_alias_is_dense():
  q, k, v, _ = inputs()
  a = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  b = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="dense")
  np.testing.assert_array_equal(a, b)
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_allclose(a, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_float64_inputs_stay_float64(impl):
  with jax.enable_x64(True):
    q, k, v, do = (jnp.asarray(np.asarray(x, np.float64)) for x in inputs())
    lens = jnp.asarray([30, 0], jnp.int32)
    f = lambda q, k, v: jattn.dot_product_attention(
      q, k, v, is_causal=True, key_value_seq_lengths=lens, return_residual=True, **IMPLS[impl]
    )
    (out, lse), grads = _vjp(f, (q, k, v), (do, jnp.zeros(do.shape[:-1], do.dtype)))
    assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
  vis = ref.visible_mask(2, 4, 37, 45, causal="top_left", kv_lengths=[30, 0])
  want, r_lse, cache = ref.attention(q, k, v, visible=vis)
  # Float64 statistics: agreement far beyond float32's precision.
  np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
  rows = np.isfinite(r_lse)
  np.testing.assert_allclose(np.asarray(lse)[rows], r_lse[rows], rtol=1e-12, atol=1e-12)
  for got, w in zip(grads, ref.grads(cache, do)[:3]):
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl", IMPLS)
def test_float16_lse_of_empty_rows_is_finite(impl):
  q, k, v, _ = inputs(dtype=jnp.float16)
  lens = jnp.asarray([0, 20], jnp.int32)
  out, lse = jattn.dot_product_attention(
    q, k, v, key_value_seq_lengths=lens, return_residual=True, **IMPLS[impl]
  )
  assert lse.dtype == jnp.float16
  lse = np.asarray(lse, np.float64)
  assert np.all(lse[0] == float(jnp.finfo(jnp.float16).min))  # batch 0 sees no key at all
  vis = ref.visible_mask(2, 4, 37, 45, kv_lengths=[0, 20])
  _want, r_lse, _ = ref.attention(*(np.asarray(x, np.float64) for x in (q, k, v)), visible=vis)
  np.testing.assert_allclose(lse[1], r_lse[1], rtol=2e-3, atol=2e-3)
  assert np.all(np.asarray(out)[0] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_lse_gradient_is_the_softmax(impl):
  """d lse / d logits = P: the gradient of sum(lse) w.r.t. q is scale * P K and w.r.t. v is 0
  (unlike jax.nn, whose residual lse carries none; tests/attention/test_merge.py checks the
  merge)."""
  q, k, v, _ = inputs()
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, return_residual=True, **IMPLS[impl])[
    1
  ].sum()
  dq, dk, dv = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
  # scale * P K is the attention output with K as the values.
  want = jattn.dot_product_attention(q, k, k, implementation="dense") / np.sqrt(q.shape[-1])
  np.testing.assert_allclose(dq, want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(dv) == 0) and np.abs(np.asarray(dk)).max() > 0


def _garbage(x, where):
  """Put NaN and +-inf at the True entries of ``where`` (broadcast along x's trailing axes)."""
  pattern = jnp.asarray([jnp.nan, jnp.inf, -jnp.inf], x.dtype)
  fill = jnp.resize(pattern, x.shape)
  return jnp.where(where, fill, x)


# Each case hides some query rows and key columns from everything, by a different mechanism.
def _segments():
  q_seg = np.zeros((2, 37), np.int32)
  q_seg[0, 30:] = 7  # no key has segment 7: these queries see nothing
  kv_seg = np.zeros((2, 45), np.int32)
  kv_seg[1, :9] = 9  # no query has segment 9: these keys are seen by no one
  kw = dict(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
  vis = ref.visible_mask(2, 4, 37, 45, q_seg=q_seg, kv_seg=kv_seg)
  return kw, vis


def _array():
  m = np.random.default_rng(9).random((2, 1, 37, 45)) > 0.3
  m[:, :, 5] = False
  m[0, :, :, 40:] = False
  m[1, :, :, :3] = False
  return dict(mask=jnp.asarray(m)), ref.visible_mask(2, 4, 37, 45, mask=m)


def _window():
  # Bottom-right causal band of width 6 with T < S: keys before S - T - 6 are outside every window.
  kw = dict(is_causal="bottom_right", local_window_size=(6, 0))
  return kw, ref.visible_mask(2, 4, 37, 45, causal="bottom_right", window=(6, 0))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [_segments, _array, _window])
def test_garbage_hidden_by_any_mask_never_leaks(impl, case):
  kw, vis = case()
  q, k, v, do = inputs()
  row_hidden = ~vis.any(axis=(1, 3))  # (B, T): hidden from every head
  col_hidden = ~vis.any(axis=(1, 2))  # (B, S)
  assert row_hidden.any() or col_hidden.any()
  qg = _garbage(q, row_hidden[:, :, None, None])
  kg = _garbage(k, col_hidden[:, :, None, None])
  vg = _garbage(v, col_hidden[:, :, None, None])
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw, **IMPLS[impl])
  out, grads = _vjp(f, (qg, kg, vg), do)
  want, _, cache = ref.attention(q, k, v, visible=vis)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  for got, w in zip(grads, ref.grads(cache, do)[:3]):
    np.testing.assert_allclose(got, w, rtol=2e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_masks_full_is_no_mask(impl):
  q, k, v, do = inputs()
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, mask=jattn.masks.full(), **IMPLS[impl])
  out, grads = _vjp(f, (q, k, v), do)
  want, _, cache = ref.attention(q, k, v)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  for got, w in zip(grads, ref.grads(cache, do)[:3]):
    np.testing.assert_allclose(got, w, rtol=2e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_broadcast_dropout_against_reference(impl):
  # flax's broadcast_dropout: one (T, S) keep-mask, that of batch 0 and head 0, for every head.
  B, T, S, N = 2, 37, 45, 4
  q, k, v, do = inputs()
  rate, rng = 0.3, jax.random.key(11)
  keep = keep_mask(rng, rate, B, N, T, S, broadcast=True)
  assert keep.shape == (1, 1, T, S)
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, dropout_rate=rate, dropout_rng=rng, dropout_broadcast=True, **IMPLS[impl]
  )
  out, grads = _vjp(f, (q, k, v), do)
  want, _, cache = ref.attention(q, k, v, keep=keep, dropout_rate=rate)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  for got, w in zip(grads, ref.grads(cache, do)[:3]):
    np.testing.assert_allclose(got, w, rtol=2e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# The FlashAttention rule for 16-bit inputs, with bias, boolean mask, sinks and soft cap.
# --------------------------------------------------------------------------------------------


def _plain_16bit(q, k, v, bias, sinks, vis, cap):
  """Everything in the input dtype (logits, soft cap, softmax): the baseline a kernel must beat."""
  dt = q.dtype
  G = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, kr) * jnp.asarray(1 / np.sqrt(q.shape[-1]), dt)
  s = jnp.asarray(cap, dt) * jnp.tanh(s / jnp.asarray(cap, dt))
  s = jnp.where(vis, s + bias.astype(dt), jnp.asarray(-1e4, dt))
  B, N, T, _ = s.shape
  sink_col = jnp.broadcast_to(sinks.astype(dt)[None, :, None, None], (B, N, T, 1))
  p = jax.nn.softmax(jnp.concatenate([s, sink_col], axis=-1), axis=-1)[..., :-1]
  return jnp.einsum("bnts,bsnh->btnh", p, vr)


_16BIT = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


@functools.cache
def _16bit_case(dtype):
  """The inputs in ``dtype``, the 16-bit baseline's output and gradients, and the float64
  reference's on the same rounded inputs: one per dtype, shared by the implementations."""
  dtype = _16BIT[dtype]
  B, T, S, N, K, H = 2, 48, 80, 4, 2, 32
  q, k, v, do = (x.astype(dtype) for x in inputs(B=B, T=T, S=S, N=N, K=K, H=H, seed=3))
  rng = np.random.default_rng(12)
  bias = jnp.asarray(rng.normal(size=(1, N, T, S)), dtype)
  sinks = jnp.asarray(rng.normal(size=(N,)), dtype)
  mask = rng.random((B, 1, T, S)) > 0.25
  vis = ref.visible_mask(B, N, T, S, mask=mask, causal="top_left")
  g = lambda q, k, v, bias, sinks: _plain_16bit(q, k, v, bias, sinks, jnp.asarray(vis), _CAP)
  # Op by op, as written: each operation rounds its result to the dtype (one compiled program
  # could keep intermediates in float32).
  base, pull_base = jax.vjp(g, q, k, v, bias, sinks)
  base = (base, pull_base(do))
  f64 = lambda x: np.asarray(x, np.float64)
  want, _, cache = ref.attention(
    f64(q), f64(k), f64(v), visible=vis, bias=f64(bias), soft_cap=_CAP, sinks=f64(sinks)
  )
  want_grads = ref.grads(cache, f64(do), bias.shape)
  return (q, k, v, bias, sinks, do), mask, base, (want, want_grads)


_CAP = 4.0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", list(_16BIT))
def test_low_precision_rule_with_bias_mask_sinks_soft_cap(impl, dtype):
  (q, k, v, bias, sinks, do), mask, (base, base_grads), (want, want_grads) = _16bit_case(dtype)
  f = lambda q, k, v, bias, sinks: jattn.dot_product_attention(
    q,
    k,
    v,
    bias,
    jnp.asarray(mask),
    is_causal=True,
    sinks=sinks,
    logits_soft_cap=_CAP,
    **IMPLS[impl],
  )
  # Forward and backward as programs apart (16-bit residuals between them, as stored).
  out, pull = jax.vjp(f, q, k, v, bias, sinks)
  grads = pull(do)
  assert out.dtype == _16BIT[dtype]
  f64 = lambda x: np.asarray(x, np.float64)
  err = lambda a, b: float(np.max(np.abs(f64(a) - b)))
  assert err(out, want) <= 2 * err(base, want) + 1e-3
  names = ("dq", "dk", "dv", "dbias", "dsinks")
  for name, got, plain, w in zip(names, grads, base_grads, want_grads):
    assert err(got, w) <= 2 * err(plain, w) + 1e-3, name


@pytest.mark.parametrize("impl", IMPLS)
def test_debug_nans_and_infs_stay_quiet(impl):
  # Forward and backward with every masking feature at once and rows that see nothing (a zero
  # length) give no NaN or inf: jax.debug_nans / debug_infs check the compiled call's results
  # (and would re-run it op by op to name the primitive).
  B, T, S = 2, 40, 24
  q, k, v, do = inputs(B=B, T=T, S=S)
  ids = jnp.asarray(np.repeat([[0, 1]], 20, axis=1).reshape(1, 40).repeat(B, 0), jnp.int32)
  kw = dict(
    is_causal="bottom_right",
    local_window_size=(30, 2),
    logits_soft_cap=4.0,
    key_value_seq_lengths=jnp.asarray([S, 0], jnp.int32),
    q_segment_ids=ids,
    kv_segment_ids=ids[:, :S],
    sinks=jnp.linspace(-1.0, 1.0, 4),
    dropout_rate=0.2,
    dropout_rng=jax.random.key(3),
    **IMPLS[impl],
  )
  loss = lambda q, k, v: (jattn.dot_product_attention(q, k, v, **kw) * do).sum()
  with jax.debug_nans(True), jax.debug_infs(True):
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    jax.block_until_ready(grads)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)
