"""jattn.make_attention_fn inside flax's own attention layers, against flax's default attention;
called directly with a value head size of its own, against the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from flax import linen as nn
from flax import nnx

import jattn

B, T, D, N = 2, 6, 16, 4
IMPLS = [
  dict(implementation="dense"),
  dict(implementation="chunked", block_q=4, block_kv=4),
]  # ragged blocks: T = 6
IMPL_IDS = ["dense", "chunked"]
# Example 0 has two padding tokens at the end, example 1 none.
VALID = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)


def _normal(seed, *shapes):
  """Standard normal float32 arrays of ``shapes``, drawn by NumPy (jax.random would compile a
  program for every shape)."""
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes]


def _inputs(seed=0):
  return _normal(seed, (B, T, D))[0]


def _flax_masks():
  causal = nn.make_causal_mask(VALID)
  padding = nn.make_attention_mask(VALID, VALID)
  return {
    "none": None,
    "causal": causal,
    "padding": padding,
    "combined": nn.combine_masks(causal, padding),
    "bool_causal": nn.make_causal_mask(VALID, dtype=jnp.bool_),
  }


def _check_rows(ref, got, mask_name, atol=2e-6):
  """Equal where flax's answer is defined; 0 (jattn) where a query row sees nothing."""
  ref, got = np.asarray(ref), np.asarray(got)
  if mask_name in ("padding", "combined"):
    # Padded queries of example 0 (positions 4, 5) have nothing to attend to.
    np.testing.assert_allclose(got[0, :4], ref[0, :4], atol=atol, rtol=0)
    np.testing.assert_allclose(got[1], ref[1], atol=atol, rtol=0)
    return got[0, 4:], ref[0, 4:]
  np.testing.assert_allclose(got, ref, atol=atol, rtol=0)
  return None


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_linen_layer_matches_flax(impl):
  x = _inputs()
  ref = nn.MultiHeadDotProductAttention(num_heads=N)
  mine = nn.MultiHeadDotProductAttention(num_heads=N, attention_fn=jattn.make_attention_fn(**impl))
  params = ref.init(jax.random.key(1), x)
  for name, mask in _flax_masks().items():
    empty = _check_rows(ref.apply(params, x, mask=mask), mine.apply(params, x, mask=mask), name)
    if empty is not None:
      got_empty, ref_empty = empty
      # jattn: attention output 0, so the layer outputs the out-projection bias (zeros-init).
      np.testing.assert_array_equal(got_empty, 0.0)
      assert np.abs(ref_empty).max() > 1e-3  # flax: the projected mean of V


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_nnx_layer_matches_flax_gqa(impl):
  x = _inputs(1)
  layer = nnx.MultiHeadAttention(
    num_heads=N, in_features=D, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0)
  )
  fn = jattn.make_attention_fn(**impl)
  for name, mask in _flax_masks().items():
    layer.attention_fn = nnx.dot_product_attention
    ref = layer(x, mask=mask)
    layer.attention_fn = fn
    _check_rows(ref, layer(x, mask=mask), name)
  # nnx's call-time is_causal flag (top-left, as jax.nn).
  layer.attention_fn = nnx.dot_product_attention
  ref = layer(x, is_causal=True)
  layer.attention_fn = fn
  np.testing.assert_allclose(layer(x, is_causal=True), ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_linen_decode_path_matches_flax(impl):
  """flax's own cache (decode=True): one token at a time, mask from the cache index."""
  x = _inputs(2)
  kw = dict(num_heads=N, decode=True)
  ref = nn.MultiHeadDotProductAttention(**kw)
  mine = nn.MultiHeadDotProductAttention(**kw, attention_fn=jattn.make_attention_fn(**impl))
  variables = ref.init(jax.random.key(3), x)  # cache sized from x: S_max = T
  params, cache_r = variables["params"], variables["cache"]
  cache_m = cache_r
  step_r = jax.jit(lambda c, t: ref.apply({"params": params, "cache": c}, t, mutable=["cache"]))
  step_m = jax.jit(lambda c, t: mine.apply({"params": params, "cache": c}, t, mutable=["cache"]))
  for t in range(T):
    out_r, upd = step_r(cache_r, x[:, t : t + 1])
    cache_r = upd["cache"]
    out_m, upd = step_m(cache_m, x[:, t : t + 1])
    cache_m = upd["cache"]
    np.testing.assert_allclose(out_m, out_r, atol=2e-6, rtol=0)
  # ... and decoding equals the causal forward pass.
  full = nn.MultiHeadDotProductAttention(num_heads=N).apply(
    {"params": params}, x, mask=nn.make_causal_mask(x[..., 0])
  )
  np.testing.assert_allclose(out_m[:, 0], full[:, -1], atol=2e-6, rtol=0)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_nnx_decode_path_matches_flax(impl):
  x = _inputs(3)
  layer = nnx.MultiHeadAttention(
    num_heads=N, in_features=D, num_kv_heads=2, decode=True, rngs=nnx.Rngs(0)
  )
  outs = {}
  for name, fn in (("flax", nnx.dot_product_attention), ("jattn", jattn.make_attention_fn(**impl))):
    layer.attention_fn = fn
    layer.init_cache((B, T, D))
    outs[name] = jnp.concatenate([layer(x[:, t : t + 1]) for t in range(T)], axis=1)
  np.testing.assert_allclose(outs["jattn"], outs["flax"], atol=2e-6, rtol=0)


CAUSAL_OPTIONS = [False, True, "top_left", "bottom_right"]


def _decode_nnx(fn, x):
  layer = nnx.MultiHeadAttention(
    num_heads=N, in_features=D, num_kv_heads=2, decode=True, rngs=nnx.Rngs(0)
  )
  layer.attention_fn = fn
  layer.init_cache((B, T, D))
  return jnp.concatenate([layer(x[:, t : t + 1]) for t in range(T)], axis=1)


def _decode_linen(fn, x):
  kw = dict(num_heads=N, decode=True)
  params = nn.MultiHeadDotProductAttention(**kw).init(jax.random.key(3), x)["params"]
  layer = nn.MultiHeadDotProductAttention(**kw, attention_fn=fn)
  cache = layer.init(jax.random.key(3), x)["cache"]
  outs = []
  for t in range(T):
    out, upd = layer.apply({"params": params, "cache": cache}, x[:, t : t + 1], mutable=["cache"])
    cache = upd["cache"]
    outs.append(out)
  return jnp.concatenate(outs, axis=1), params


@pytest.mark.parametrize("is_causal", CAUSAL_OPTIONS, ids=str)
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_decode_cache_with_every_is_causal_option(api, is_causal):
  """flax's own decode cache calls the function with T = 1 against its S slots. Bottom-right
  causality (or none: flax's cache mask) equals the layer run on the whole sequence with a causal
  mask; top-left would let every step see key 0 only, so it is refused, naming the fix."""
  x = _inputs(4)
  fn = jattn.make_attention_fn(is_causal=is_causal)
  if api == "nnx":
    full_layer = nnx.MultiHeadAttention(
      num_heads=N, in_features=D, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0)
    )
    full = full_layer(x, mask=nn.make_causal_mask(x[..., 0]))
    run = lambda: _decode_nnx(fn, x)
  else:
    params = nn.MultiHeadDotProductAttention(num_heads=N, decode=True).init(jax.random.key(3), x)[
      "params"
    ]
    full = nn.MultiHeadDotProductAttention(num_heads=N).apply(
      {"params": params}, x, mask=nn.make_causal_mask(x[..., 0])
    )
    run = lambda: _decode_linen(fn, x)[0]
  if is_causal in (True, "top_left"):
    with pytest.raises(ValueError, match='is_causal="bottom_right"'):
      run()
    # Training-shaped calls (T == S) keep top-left causality: it equals flax's causal mask.
    layer = nnx.MultiHeadAttention(
      num_heads=N, in_features=D, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0)
    )
    ref = layer(x, mask=nn.make_causal_mask(x[..., 0]))
    layer.attention_fn = fn
    np.testing.assert_allclose(layer(x), ref, atol=2e-6, rtol=0)
    return
  np.testing.assert_allclose(run(), full, atol=2e-6, rtol=0)


def test_deterministic_dropout_equals_flax():
  """dropout_rate > 0 but deterministic: no dropout, flax's numbers."""
  x = _inputs(4)
  kw = dict(num_heads=N, dropout_rate=0.3, deterministic=True)
  ref = nn.MultiHeadDotProductAttention(**kw)
  mine = nn.MultiHeadDotProductAttention(**kw, attention_fn=jattn.make_attention_fn())
  params = ref.init(jax.random.key(1), x)
  mask = nn.make_causal_mask(VALID)
  np.testing.assert_allclose(
    mine.apply(params, x, mask=mask), ref.apply(params, x, mask=mask), atol=2e-6, rtol=0
  )


def _keep_mask(impl, broadcast, rate, rng, b=2, n=4, s=64):
  """Recover the keep-mask: with q = k = 0 every weight is 1/S, and with V = identity
  (H = S) output[t, j] = keep[t, j] / ((1 - rate) S)."""
  q = jnp.zeros((b, s, n, s), jnp.float32)
  v = jnp.broadcast_to(jnp.eye(s, dtype=jnp.float32)[None, :, None, :], (b, s, n, s))
  fn = jattn.make_attention_fn(**impl)
  out = fn(
    q, q, v, dropout_rng=rng, dropout_rate=rate, deterministic=False, broadcast_dropout=broadcast
  )
  scaled = np.asarray(out, np.float64) * (1.0 - rate) * s  # (b, t, n, s): 0 or 1
  return scaled


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout_statistics(impl, broadcast):
  rate = 0.3
  kept = _keep_mask(impl, broadcast, rate, jax.random.key(7))
  np.testing.assert_allclose(kept, np.round(kept), atol=1e-5)  # exactly 0 or 1 / (1 - rate)
  # Expectation preserved: E[out] = 1 / S per entry, i.e. E[kept] = 1 - rate.
  if broadcast:
    # One (T, S) mask for every batch element and head, as flax's broadcast_dropout.
    np.testing.assert_array_equal(kept, np.broadcast_to(kept[:1, :, :1], kept.shape))
    sample = kept[0, :, 0]
  else:
    assert (kept[0, :, 0] != kept[1, :, 0]).any() and (kept[0, :, 0] != kept[0, :, 1]).any()
    sample = kept
  n = sample.size
  sigma = np.sqrt(rate * (1 - rate) / n)
  assert abs(sample.mean() - (1 - rate)) < 5 * sigma, (sample.mean(), sigma)
  # A different rng gives a different mask; deterministic=True gives none.
  assert (kept != _keep_mask(impl, broadcast, rate, jax.random.key(8))).any()
  q = jnp.zeros((1, 8, 2, 8), jnp.float32)
  fn = jattn.make_attention_fn(**impl)
  np.testing.assert_allclose(
    fn(q, q, q + 1.0, dropout_rate=rate, dropout_rng=jax.random.key(0), deterministic=True),
    1.0,
    rtol=0,
    atol=0,
  )


def test_dropout_in_layers_is_applied_and_reproducible():
  x = _inputs(5)
  kw = dict(num_heads=N, dropout_rate=0.5)
  mine = nn.MultiHeadDotProductAttention(**kw, attention_fn=jattn.make_attention_fn())
  params = mine.init(jax.random.key(1), x, deterministic=True)
  a = mine.apply(params, x, deterministic=False, dropout_rng=jax.random.key(3))
  b = mine.apply(params, x, deterministic=False, dropout_rng=jax.random.key(3))
  c = mine.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(4)})
  d = mine.apply(params, x, deterministic=True)
  np.testing.assert_array_equal(a, b)
  assert np.abs(a - c).max() > 1e-3 and np.abs(a - d).max() > 1e-3
  assert np.isfinite(np.asarray(a)).all()


@pytest.mark.parametrize("T_q, T_kv", [(0, T), (T, 0)], ids=["no-queries", "no-keys"])
def test_layers_on_empty_sequences_match_flax(T_q, T_kv):
  """An empty query or key sequence (an empty prompt, a step before any context) through flax's
  layers: the same outputs and sown weights as flax's own attention (no keys: every row sees
  nothing, so the attention output is 0 and the layer gives its out-projection's bias)."""
  xq, xkv = _normal(12, (B, T_q, D), (B, T_kv, D))
  ref = nn.MultiHeadDotProductAttention(num_heads=N)
  mine = nn.MultiHeadDotProductAttention(num_heads=N, attention_fn=jattn.make_attention_fn())
  params = ref.init(jax.random.key(1), xq, xkv)
  want, want_w = ref.apply(params, xq, xkv, sow_weights=True, mutable="intermediates")
  got, got_w = mine.apply(params, xq, xkv, sow_weights=True, mutable="intermediates")
  assert got.shape == want.shape == (B, T_q, D)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  for a, b in zip(jax.tree.leaves(got_w), jax.tree.leaves(want_w), strict=True):
    assert a.shape == b.shape == (B, N, T_q, T_kv)
  layer = nnx.MultiHeadAttention(
    num_heads=N, in_features=D, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0)
  )
  want = layer(xq, xkv)
  layer.attention_fn = jattn.make_attention_fn()
  np.testing.assert_allclose(layer(xq, xkv), want, atol=1e-6, rtol=0)


def test_fully_masked_row_is_zero_where_flax_gives_mean_of_v():
  q, k, v = _normal(10, *[(1, 3, 2, 4)] * 3)
  mask = jnp.array([[True, True, False], [False, False, False], [True, False, True]])
  mask = mask[None, None]
  ours = jattn.make_attention_fn()(q, k, v, mask=mask)
  theirs = nn.dot_product_attention(q, k, v, mask=mask)
  np.testing.assert_array_equal(ours[:, 1], 0.0)
  np.testing.assert_allclose(theirs[:, 1], v.mean(axis=1), atol=1e-6)
  np.testing.assert_allclose(ours[:, [0, 2]], theirs[:, [0, 2]], atol=2e-6)


def test_extra_batch_dims_bias_and_dtype():
  """[batch..., T, N, H] with two batch dims, a bias and a float mask, bf16 computation."""
  q, k, v, bias = _normal(11, (2, 3, 5, 2, 8), (2, 3, 7, 2, 8), (2, 3, 7, 2, 8), (1, 3, 1, 5, 7))
  # bias: broadcast over batch 0 and the heads
  mask = nn.make_attention_mask(
    jnp.ones((2, 3, 5)), (jnp.arange(7)[None, None] < 6).astype(jnp.float32)
  )
  fn = jattn.make_attention_fn(implementation="chunked", block_q=2, block_kv=4)
  ref = nn.dot_product_attention(q, k, v, bias=bias, mask=mask)
  np.testing.assert_allclose(fn(q, k, v, bias=bias, mask=mask), ref, atol=2e-6)
  np.testing.assert_allclose(
    fn(q, k, v, bias, mask, precision=jax.lax.Precision.HIGHEST), ref, atol=2e-6
  )
  out16 = fn(q, k, v, bias=bias, mask=mask, dtype=jnp.bfloat16)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out16, np.float32), ref, atol=5e-2)


def test_is_causal_option_and_unsupported_arguments():
  q, k, v = _normal(12, *[(1, 5, 2, 4)] * 3)
  causal = jattn.make_attention_fn(is_causal=True)
  np.testing.assert_allclose(
    causal(q, k, v),
    nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((1, 5)))),
    atol=2e-6,
  )
  np.testing.assert_allclose(
    jattn.make_attention_fn()(q, k, v, mask=jattn.masks.causal()), causal(q, k, v), atol=0, rtol=0
  )  # a jattn mask passes through
  with pytest.raises(ValueError, match="conflicts"):
    jattn.make_attention_fn(is_causal="bottom_right")(q, k[:, :4], v[:, :4], is_causal=True)
  with pytest.raises(TypeError, match="module .* must be the flax linen or nnx Module"):
    jattn.make_attention_fn()(q, k, v, module=object())
  with pytest.raises(NotImplementedError, match="qk_attn_weights_einsum"):
    jattn.make_attention_fn()(q, k, v, qk_attn_weights_einsum=jnp.einsum)
  with pytest.raises(ValueError, match="implementation"):
    jattn.make_attention_fn(implementation="fast")
  with pytest.raises(ValueError, match="block_q"):
    jattn.make_attention_fn(block_q=0)
  with pytest.raises(ValueError, match="mask of shape"):
    jattn.make_attention_fn()(q, k, v, mask=jnp.ones((1, 1, 1, 1, 5, 5), bool))


def test_broadcast_dropout_gradients_dense_equal_chunked():
  """The shared (T, S) mask is regenerated identically in the chunked backward pass."""
  q, k, v = _normal(13, (2, 12, 4, 8), (2, 12, 2, 8), (2, 12, 2, 8))

  def loss(impl, q, k, v):
    fn = jattn.make_attention_fn(**impl)
    out = fn(q, k, v, dropout_rate=0.4, dropout_rng=jax.random.key(5), broadcast_dropout=True)
    return (out * out).sum()

  g_dense = jax.grad(loss, argnums=(1, 2, 3))(IMPLS[0], q, k, v)
  g_chunk = jax.grad(loss, argnums=(1, 2, 3))(IMPLS[1], q, k, v)
  for a, b in zip(g_dense, g_chunk):
    np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-5)


# ---- a value head size of its own (called directly: flax's layers give value H) ---------------


def _value_head_case(case):
  """(query, key, value, bias, call keywords, make_attention_fn keywords, (B', N, T, S)
  visibility) for a value head size Hv = 6 of its own, H = 4, GQA (N = 4, K = 2)."""
  rng = np.random.default_rng(14)
  normal = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  if case == "batch-dims-padding":
    # Two batch dims, cross-attention shapes (T = 5, S = 7), flax's 0/1 float padding mask
    # (batch..., 1, T, S) (query 4 of example (0, 1) and key 6 of example (1, 2) are padding),
    # a bias broadcast over the first batch dim, bottom-right causality as the fn's option.
    lead, T_, S_ = (2, 3), 5, 7
    q_ok = np.ones(lead + (T_,), np.float32)
    q_ok[0, 1, 4] = 0
    kv_ok = np.ones(lead + (S_,), np.float32)
    kv_ok[1, 2, 6] = 0
    mask = nn.make_attention_mask(jnp.asarray(q_ok), jnp.asarray(kv_ok))
    bias = normal((1, 3, 4, T_, S_))
    vis = np.broadcast_to(np.asarray(mask) != 0, lead + (4, T_, S_)).reshape(6, 4, T_, S_)
    vis = vis & (np.arange(S_)[None, :] <= np.arange(T_)[:, None] + S_ - T_)
    call, make = dict(mask=mask), dict(is_causal="bottom_right")
  else:  # "call-time-causal": one batch dim, flax's is_causal=True at the call (top-left)
    lead, T_, S_ = (2,), 6, 6
    bias = normal((2, 4, T_, S_))
    vis = np.broadcast_to(np.arange(S_)[None, :] <= np.arange(T_)[:, None], (2, 4, T_, S_))
    call, make = dict(is_causal=True), dict()
  q, k, v = normal(lead + (T_, 4, 4)), normal(lead + (S_, 2, 4)), normal(lead + (S_, 2, 6))
  return q, k, v, bias, call, make, vis


@pytest.mark.parametrize("case", ["batch-dims-padding", "call-time-causal"])
@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_value_head_size_of_its_own_against_reference(impl, case):
  """attention_fn called as flax calls it, but with value [batch..., S, K, Hv], Hv = 6 != H = 4
  (no flax layer does: their value heads are the query's size): the output is
  [batch..., T, N, Hv] and it and the gradients of query, key, value and bias equal the float64
  reference's."""
  q, k, v, bias, call, make, vis = _value_head_case(case)
  fn = jattn.make_attention_fn(**impl, **make)
  lead, Hv = q.shape[:-3], v.shape[-1]
  do = _normal(15, q.shape[:-1] + (Hv,))[0]

  @jax.jit
  def forward_and_grads(q, k, v, bias, do):  # one program
    out, pull = jax.vjp(lambda q, k, v, bias: fn(q, k, v, bias=bias, **call), q, k, v, bias)
    return (out,) + pull(do)

  got = forward_and_grads(q, k, v, bias, do)
  out = got[0]
  assert out.shape == q.shape[:-1] + (Hv,) and Hv != q.shape[-1]
  flat = lambda x: np.asarray(x, np.float64).reshape((-1,) + x.shape[-3:])
  full_bias = np.broadcast_to(np.asarray(bias, np.float64), lead + bias.shape[-3:])
  want_out, _, cache = reference.attention(
    flat(q), flat(k), flat(v), visible=vis, bias=flat(full_bias)
  )
  dq, dk, dv, dbias, _ = reference.grads(cache, flat(do), bias_shape=flat(full_bias).shape)
  dbias = dbias.reshape(full_bias.shape)
  dbias = dbias.sum(axis=tuple(a for a in range(bias.ndim) if bias.shape[a] == 1), keepdims=True)
  want = (want_out, dq, dk, dv, dbias)
  for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
    b = np.asarray(b).reshape(np.shape(a))
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=f"{name} {case}")
