"""jattn.linen / jattn.nnx MultiHeadAttention: agreement with each other, with a float64 NumPy
reference built from the same weights, and KV-cache decoding against the full forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
from jattn import masks

B, T, D, N, K = 2, 8, 16, 4, 2
H = D // N
IMPLS = [dict(implementation="dense"),
         dict(implementation="chunked", block_q=4, block_kv=4)]
IMPL_IDS = ["dense", "chunked"]
NAMES = ("query", "key", "value", "out")


def _x(seed=0, shape=(B, T, D)):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _linen_pair(seed=0, **kw):
  """A linen module with random (nonzero-bias) params, and an nnx module holding the same."""
  lin = jattn.linen.MultiHeadAttention(num_heads=N, num_kv_heads=K, **kw)
  params = lin.init(jax.random.key(seed), _x())["params"]
  keys = jax.random.split(jax.random.key(seed + 100), len(NAMES))
  params = {n: dict(params[n], bias=0.1 * jax.random.normal(kk, params[n]["bias"].shape))
            for n, kk in zip(NAMES, keys)}
  mod = jattn.nnx.MultiHeadAttention(N, D, num_kv_heads=K, rngs=nnx.Rngs(0), **kw)
  for n in NAMES:
    getattr(mod, n).kernel[...] = params[n]["kernel"]
    getattr(mod, n).bias[...] = params[n]["bias"]
  return lin, params, mod


# ---- the float64 reference -----------------------------------------------------------------


def _rope64(x, pos, base=10000.0):
  h = x.shape[-1] // 2
  ang = pos[:, :, None].astype(np.float64) * base ** (-2.0 * np.arange(h) / x.shape[-1])
  c, s = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
  x1, x2 = x[..., :h], x[..., h:]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _reference(params, x, *, causal=False, rope=False, window=None, q_seg=None, kv_lengths=None,
               cap=None):
  """Multi-head attention written out in float64 NumPy from the parameter dict."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  x = np.asarray(x, np.float64)
  q = np.einsum("btd,dnh->btnh", x, p["query"]["kernel"]) + p["query"]["bias"]
  k = np.einsum("btd,dkh->btkh", x, p["key"]["kernel"]) + p["key"]["bias"]
  v = np.einsum("btd,dkh->btkh", x, p["value"]["kernel"]) + p["value"]["bias"]
  b, t = x.shape[:2]
  if rope:
    pos = np.broadcast_to(np.arange(t), (b, t))
    q, k = _rope64(q, pos), _rope64(k, pos)
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head n uses kv head n // g
  s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  if cap is not None:
    s = cap * np.tanh(s / cap)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  ok = np.ones((b, 1, t, t), bool)
  if causal:
    ok &= j <= i
  if window is not None:
    ok &= (j >= i - window[0]) & (j <= i + window[1])
  if q_seg is not None:
    ok &= (q_seg[:, :, None] == q_seg[:, None, :])[:, None]
  if kv_lengths is not None:
    ok &= (np.arange(t)[None, :] < kv_lengths[:, None])[:, None, None, :]
  s = np.where(ok, s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  e = np.where(ok, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
  l = e.sum(-1, keepdims=True)
  w = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)  # an empty row attends to nothing: 0
  o = np.einsum("bnts,bsnh->btnh", w, v)
  return np.einsum("btnh,nho->bto", o, p["out"]["kernel"]) + p["out"]["bias"]


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_linen_nnx_and_reference_agree(impl):
  x = _x(1)
  seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 2, 2]], np.int32)
  kv_len = np.array([8, 5], np.int32)
  cases = [
      (dict(), dict(), dict()),
      (dict(is_causal=True, rope=True), dict(), dict(causal=True, rope=True)),
      (dict(is_causal=True, local_window_size=(2, 0), logits_soft_cap=2.0), dict(),
       dict(causal=True, window=(2, 0), cap=2.0)),
      (dict(rope=True), dict(q_segment_ids=seg, kv_segment_ids=seg, key_value_seq_lengths=kv_len),
       dict(rope=True, q_seg=seg, kv_lengths=kv_len)),
  ]
  for ctor, call, ref in cases:
    lin, params, mod = _linen_pair(**ctor, **impl)
    a = lin.apply({"params": params}, x, **call)
    b = mod(x, **call)
    np.testing.assert_array_equal(a, b)  # same weights, same numbers
    np.testing.assert_allclose(a, _reference(params, x, **ref), atol=2e-5, rtol=0,
                               err_msg=str(ctor))


def test_mask_object_cross_attention_and_bf16():
  lin, params, mod = _linen_pair(2)
  x, kv = _x(3), _x(4, (B, 5, D))
  m = masks.causal(offset=1) | masks.local_window(0, 2)
  np.testing.assert_array_equal(lin.apply({"params": params}, x, kv, mask=m), mod(x, kv, mask=m))
  # bf16 computation with float32 parameters stays close to float32.
  lin16 = jattn.linen.MultiHeadAttention(num_heads=N, num_kv_heads=K, dtype=jnp.bfloat16)
  out16 = lin16.apply({"params": params}, x)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out16, np.float32), lin.apply({"params": params}, x),
                             atol=6e-2)


# ---- decoding ------------------------------------------------------------------------------

STEPS = [(0, 3), (3, 4), (4, 5), (5, 7), (7, 8)]  # prefill 3, then 1, 1, 2, 1 tokens


@pytest.mark.parametrize("impl,window", [(IMPLS[0], None), (IMPLS[1], None), (IMPLS[0], (2, 0))],
                         ids=["dense", "chunked", "dense-window"])
def test_decode_reproduces_full_forward(impl, window):
  kw = dict(is_causal=True, rope=True, local_window_size=window, **impl)
  lin, params, mod = _linen_pair(5, **kw)
  x = _x(6)
  full = lin.apply({"params": params}, x)
  S_max = 11  # larger than T: unused cache slots must stay invisible

  dec = lin.clone(decode=True)
  cache = dec.init(jax.random.key(0), jnp.zeros((B, S_max, D)))["cache"]
  assert cache["cached_key"].shape == (B, S_max, K, H)  # K heads only (GQA)
  traces = []

  @jax.jit
  def step(cache, xt):
    traces.append(xt.shape)
    return dec.apply({"params": params, "cache": cache}, xt, mutable=["cache"])

  outs = []
  for a, b in STEPS:
    o, upd = step(cache, x[:, a:b])
    cache = upd["cache"]
    outs.append(o)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-6, rtol=0)
  np.testing.assert_array_equal(cache["cache_index"], [T, T])
  assert len(traces) == 3  # one trace per step length (3, 1, 2): the index is data, not shape

  mod.init_cache(B, S_max)
  nstep = nnx.jit(lambda m, xt: m(xt, decode=True))
  outs = [nstep(mod, x[:, a:b]) for a, b in STEPS]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-6, rtol=0)
  np.testing.assert_array_equal(mod.cache_index[...], [T, T])


def test_decode_padded_batch_of_prompts():
  """Prompts of lengths 5 and 3 padded to 5: each example continues from its own length."""
  lin, params, mod = _linen_pair(7, is_causal=True, rope=True, **IMPLS[1])
  lengths = np.array([5, 3], np.int32)
  prompt, gen = _x(8, (B, 5, D)), _x(9, (B, 3, D))
  mod.init_cache(B, 10)
  pre = mod(prompt, decode=True, query_seq_lengths=jnp.asarray(lengths))
  np.testing.assert_array_equal(mod.cache_index[...], lengths)
  steps = [mod(gen[:, t:t + 1], decode=True) for t in range(3)]
  for b in range(B):
    seq = jnp.concatenate([prompt[b:b + 1, :lengths[b]], gen[b:b + 1]], axis=1)
    full = lin.apply({"params": params}, seq)[0]
    np.testing.assert_allclose(pre[b, :lengths[b]], full[:lengths[b]], atol=2e-6, rtol=0)
    for t in range(3):
      np.testing.assert_allclose(steps[t][b, 0], full[lengths[b] + t], atol=2e-6, rtol=0)
  # The padded prompt rows attended to nothing: the output projection of 0 is its bias.
  np.testing.assert_allclose(pre[1, 3:], np.broadcast_to(params["out"]["bias"], (2, D)),
                             atol=1e-6)


def test_module_errors():
  with pytest.raises(ValueError, match="num_kv_heads"):
    jattn.nnx.MultiHeadAttention(4, 16, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="even"):
    jattn.nnx.MultiHeadAttention(4, 12, rope=True, rngs=nnx.Rngs(0))
  mod = jattn.nnx.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="init_cache"):
    mod(_x(), decode=True)
  mod.init_cache(B, 8)
  with pytest.raises(ValueError, match="is_causal"):
    mod(_x(), decode=True)
  mod = jattn.nnx.MultiHeadAttention(4, 16, is_causal=True, rngs=nnx.Rngs(0))
  mod.init_cache(B, 4)
  with pytest.raises(ValueError, match="does not fit"):
    mod(_x(), decode=True)
  with pytest.raises(ValueError, match="in_features"):
    mod(_x(shape=(B, T, 8)))
  drop = jattn.nnx.MultiHeadAttention(4, 16, dropout_rate=0.1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="deterministic"):
    drop(_x())


def test_flax_layer_weights_load_unchanged():
  """flax's own MultiHeadDotProductAttention parameters drive jattn.linen's module as they are."""
  import flax.linen as nn
  x = _x(10)
  params = nn.MultiHeadDotProductAttention(num_heads=N).init(jax.random.key(0), x)
  ref = nn.MultiHeadDotProductAttention(num_heads=N).apply(params, x,
                                                            mask=nn.make_causal_mask(x[..., 0]))
  got = jattn.linen.MultiHeadAttention(num_heads=N, is_causal=True).apply(params, x)
  np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)
