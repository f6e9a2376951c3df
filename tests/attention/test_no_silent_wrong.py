"""No silent wrong answers: NaN at visible positions propagates, mask objects and score functions
are checked against the call, a traced scale works as in jax.nn, one meaning of an int window,
flax's sow_weights."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from attention_cases import IMPLS, TILE_IMPLS, inputs
from flax import nnx

import jattn
from jattn import masks

B, T, S, N, K, H = 2, 37, 45, 4, 2, 16


# --------------------------------------------------------------------------------------------
# NaN / inf at visible positions propagate like jax.nn; at hidden positions they never leak.
# --------------------------------------------------------------------------------------------


def _nan_cases():
  q, k, v, _ = inputs()
  zero_bias = jnp.zeros((B, N, T, S))
  return {
    "key": (q, k.at[0, 7, 1, 3].set(jnp.nan), v, None),
    "query": (q.at[1, 4, 2, 0].set(jnp.nan), k, v, None),
    "value_inf": (q, k, v.at[0, 9, 0, 1].set(jnp.inf), None),
    "bias_nan_inf": (q, k, v, zero_bias.at[0, 1, 20, 3].set(jnp.nan).at[1, 2, 30, 7].set(jnp.inf)),
  }


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(_nan_cases()))
def test_nan_at_visible_positions_propagates_like_jax_nn(impl, case):
  q, k, v, bias = _nan_cases()[case]
  _, _, _, do = inputs()
  # Causal: the NaN key (position 7) is visible to rows >= 7 only; the other rows stay finite.
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, bias, is_causal=True, **IMPLS[impl])
  g = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias, is_causal=True)
  out, pull = jax.vjp(f, q, k, v)
  want, pull_want = jax.vjp(g, q, k, v)
  assert np.isnan(out).any()
  np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
  ok = ~np.isnan(want)
  np.testing.assert_allclose(np.asarray(out)[ok], np.asarray(want)[ok], rtol=2e-5, atol=2e-5)
  # The gradients carry the NaN too (where jax.nn's do), instead of looking finite.
  for name, got, w in zip("qkv", pull(do), pull_want(do)):
    assert np.isnan(got).any() == np.isnan(w).any(), name


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_bias_at_hidden_positions_never_leaks(impl):
  q, k, v, do = inputs()
  mask = np.random.default_rng(0).random((B, 1, T, S)) > 0.4
  bias = np.zeros((B, N, T, S), np.float32)
  bias[np.broadcast_to(~mask, bias.shape)] = np.nan
  bias[..., :5][np.broadcast_to(~mask, bias.shape)[..., :5]] = np.inf
  f = lambda q, k, v, b: jattn.dot_product_attention(q, k, v, b, jnp.asarray(mask), **IMPLS[impl])
  out, pull = jax.vjp(f, q, k, v, jnp.asarray(bias))
  vis = ref.visible_mask(B, N, T, S, mask=mask)
  want, _, cache = ref.attention(q, k, v, visible=vis)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  grads = pull(do)
  for got, w in zip(grads[:3], ref.grads(cache, do)[:3]):
    np.testing.assert_allclose(got, w, rtol=2e-4, atol=1e-4)
  assert np.all(np.asarray(grads[3])[np.broadcast_to(~mask, bias.shape)] == 0)


# --------------------------------------------------------------------------------------------
# Mask objects are checked against the call, with the keyword arguments' messages.
# --------------------------------------------------------------------------------------------

BAD_MASKS = [
  (
    "from_array wrong S",
    lambda: masks.from_array(jnp.ones((T, S - 1), bool)),
    ValueError,
    r"masks.from_array: mask of shape \(1, 1, 37, 44\) is not broadcastable to "
    r"\(B, N, T, S\)=\(2, 4, 37, 45\)",
  ),
  (
    "from_array rank 5",
    lambda: masks.from_array(jnp.ones((1, 1, 1, T, S), bool)),
    ValueError,
    "rank <= 4",
  ),
  (
    "segments short q",
    lambda: masks.segments(jnp.zeros((B, 10), jnp.int32), jnp.zeros((B, S), jnp.int32)),
    ValueError,
    r"masks.segments: q_segment_ids must have shape \(B, T\)=\(2, 37\), got \(2, 10\)",
  ),
  (
    "segments long q",
    lambda: masks.segments(jnp.zeros((B, T + 3), jnp.int32), jnp.zeros((B, S), jnp.int32)),
    ValueError,
    r"q_segment_ids must have shape \(B, T\)=\(2, 37\)",
  ),
  (
    "segments kv rank 1",
    lambda: masks.segments(jnp.zeros((B, T), jnp.int32), jnp.zeros((S,), jnp.int32)),
    ValueError,
    r"masks.segments: kv_segment_ids must have shape \(B, S\)=\(2, 45\), got \(45,\)",
  ),
  (
    "segments float",
    lambda: masks.segments(jnp.zeros((B, T)), jnp.zeros((B, S))),
    TypeError,
    "masks.segments: q_segment_ids must be an integer array, got dtype float32",
  ),
  (
    "lengths wrong B",
    lambda: masks.lengths(None, jnp.asarray([3, 4, 5])),
    ValueError,
    r"masks.lengths: kv_lengths must have shape \(B,\)=\(2,\), got \(3,\)",
  ),
  (
    "lengths float",
    lambda: masks.lengths(jnp.asarray([3.7, 4.0])),
    TypeError,
    "masks.lengths: q_lengths must be an integer array, got dtype float32",
  ),
  (
    "causal offset wrong B",
    lambda: masks.causal(offset=jnp.asarray([1, 2, 3])),
    ValueError,
    r"masks.causal: offset must be .* \(B,\)=\(2,\), got shape \(3,\)",
  ),
  (
    "inside a combination",
    lambda: masks.causal() & ~masks.lengths(jnp.asarray([1]), None),
    ValueError,
    r"masks.lengths: q_lengths must have shape \(B,\)=\(2,\), got \(1,\)",
  ),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,make,exc,msg", BAD_MASKS, ids=[c[0] for c in BAD_MASKS])
def test_malformed_mask_objects_raise_naming_the_argument(impl, name, make, exc, msg):
  q, k, v, _ = inputs()
  with pytest.raises(exc, match=msg):
    jax.block_until_ready(jattn.dot_product_attention(q, k, v, mask=make(), **IMPLS[impl]))


def test_mask_object_and_keyword_give_the_same_message():
  q, k, v, _ = inputs()
  msgs = []
  for kw in (
    dict(key_value_seq_lengths=jnp.asarray([3, 4, 5])),
    dict(mask=masks.lengths(None, jnp.asarray([3, 4, 5]))),
  ):
    with pytest.raises(ValueError) as e:
      jattn.dot_product_attention(q, k, v, **kw)
    msgs.append(str(e.value))
  assert msgs[0].replace("key_value_seq_lengths", "X") == msgs[1].replace(
    "masks.lengths: kv_lengths", "X"
  )


# --------------------------------------------------------------------------------------------
# score_mod is checked on its first trace.
# --------------------------------------------------------------------------------------------

BAD_MODS = [
  (
    "broadcast",
    lambda s, b, h, qi, ki: s[..., :1],
    ValueError,
    r"score_mod must return an array of the score's shape \(B, N, tq, tk\)",
  ),
  ("scalar", lambda s, b, h, qi, ki: jnp.float32(0.0), ValueError, "score_mod must return"),
  (
    "booleans",
    lambda s, b, h, qi, ki: s > 0,
    TypeError,
    "score_mod must return floating scores, got dtype bool",
  ),
  (
    "ints",
    lambda s, b, h, qi, ki: (qi - ki) + 0 * b + 0 * h,
    TypeError,
    "score_mod must return floating scores",
  ),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,mod,exc,msg", BAD_MODS, ids=[c[0] for c in BAD_MODS])
def test_malformed_score_mod_raises(impl, name, mod, exc, msg):
  q, k, v, _ = inputs()
  with pytest.raises(exc, match=msg):
    jattn.dot_product_attention(q, k, v, score_mod=mod, **IMPLS[impl])


# --------------------------------------------------------------------------------------------
# scale: Python, NumPy and jnp scalars, traced under jit, with its gradient.
# --------------------------------------------------------------------------------------------


# The parallel schedule takes a scale in test_attention's everything-together case.
@pytest.mark.parametrize("impl", TILE_IMPLS)
def test_scale_as_array_and_traced_equals_jax_nn(impl):
  q, k, v, do = inputs()
  want = jax.nn.dot_product_attention(q, k, v, scale=0.3, is_causal=True)
  for s in (0.3, np.float32(0.3), np.asarray(0.3), jnp.float32(0.3)):
    got = jattn.dot_product_attention(q, k, v, scale=s, is_causal=True, **IMPLS[impl])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=repr(s))
  f = jax.jit(
    lambda q, k, v, s: jattn.dot_product_attention(q, k, v, scale=s, is_causal=True, **IMPLS[impl])
  )
  g = jax.jit(lambda q, k, v, s: jax.nn.dot_product_attention(q, k, v, scale=s, is_causal=True))
  for s in (0.3, 1.7):
    np.testing.assert_allclose(
      f(q, k, v, jnp.float32(s)), g(q, k, v, jnp.float32(s)), rtol=2e-5, atol=2e-5
    )
  # A traced scale is an operand: one compilation serves every value.
  assert f._cache_size() == 1
  # Its gradient equals jax.nn's (and d/d scale of the float64 reference, by central difference).
  loss = lambda fn: lambda s: jnp.sum(fn(q, k, v, s) * do)
  ds = jax.grad(loss(f))(jnp.float32(0.3))
  np.testing.assert_allclose(ds, jax.grad(loss(g))(jnp.float32(0.3)), rtol=1e-3, atol=1e-3)
  vis = ref.visible_mask(B, N, T, S, causal="top_left")
  ref_loss = lambda s: np.sum(ref.attention(q, k, v, visible=vis, scale=s)[0] * np.asarray(do))
  fd = (ref_loss(0.3 + 1e-5) - ref_loss(0.3 - 1e-5)) / 2e-5
  np.testing.assert_allclose(ds, fd, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
def test_float16_query_near_its_range_with_a_power_of_two_scale(impl):
  # The chunked kernels fold the scale into the query only where that product cannot round
  # worse than the float32 logits: never for float16, where 2 * 40000 overflows to inf.
  rng = np.random.default_rng(0)
  q = rng.uniform(-4e4, 4e4, size=(1, 6, 2, 8))  # representable; twice it is not
  k = rng.normal(size=(1, 6, 1, 8)) * 1e-4
  v = rng.normal(size=(1, 6, 1, 8))
  q, k, v = (np.asarray(x, np.float16) for x in (q, k, v))
  assert float(np.abs(q).max()) * 2 > float(np.finfo(np.float16).max)
  out = jattn.dot_product_attention(q, k, v, scale=2.0, is_causal=True, **IMPLS[impl])
  want, _, _ = ref.attention(
    q.astype(np.float64),
    k.astype(np.float64),
    v.astype(np.float64),
    visible=ref.visible_mask(1, 2, 6, 6, causal="top_left"),
    scale=2.0,
  )
  assert np.isfinite(np.asarray(out, np.float32)).all()
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=5e-3, rtol=5e-3)


def test_bad_scales_raise():
  q, k, v, _ = inputs()
  with pytest.raises(ValueError, match=r"scale must be a scalar, got an array of shape \(2,\)"):
    jattn.dot_product_attention(q, k, v, scale=jnp.ones(2))
  with pytest.raises(TypeError, match="scale must be a real number or None, got str"):
    jattn.dot_product_attention(q, k, v, scale="0.5")
  with pytest.raises(TypeError, match="scale must be a real number, got dtype bool"):
    jattn.dot_product_attention(q, k, v, scale=jnp.asarray(True))


# --------------------------------------------------------------------------------------------
# One meaning of an int window: (w, w), as jax.nn; None sides in both spellings.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("w", [0, 3, (4, None), (None, 2), (None, None)])
def test_window_spellings_agree_with_reference(impl, w):
  q, k, v, _ = inputs()
  pair = (w, w) if isinstance(w, int) else w
  left, right = pair

  def spellings(q, k, v):  # the calls of every spelling, in one compiled program
    attend = lambda **kw: jattn.dot_product_attention(q, k, v, **kw, **IMPLS[impl])
    by_int = attend(mask=masks.local_window(w)) if isinstance(w, int) else None
    return attend(local_window_size=w), attend(mask=masks.local_window(*pair)), by_int

  by_kw, by_mask, by_int = jax.jit(spellings)(q, k, v)
  if isinstance(w, int):
    np.testing.assert_array_equal(by_mask, by_int)
    np.testing.assert_allclose(
      by_kw, jax.nn.dot_product_attention(q, k, v, local_window_size=w), rtol=2e-5, atol=2e-5
    )
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  vis = np.ones((T, S), bool)
  if left is not None:
    vis &= s >= t - left
  if right is not None:
    vis &= s <= t + right
  want, _, _ = ref.attention(q, k, v, visible=np.broadcast_to(vis, (B, N, T, S)))
  np.testing.assert_allclose(by_kw, want, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(by_mask, want, rtol=2e-5, atol=2e-5)


# --------------------------------------------------------------------------------------------
# flax's sow_weights: the same weights as flax's own layer.
# --------------------------------------------------------------------------------------------


def _flax_weights_case():
  x = jax.random.normal(jax.random.key(0), (2, 9, 16))
  mask = np.asarray(nn.make_causal_mask(jnp.ones((2, 9)))).astype(bool)
  mask = mask & (np.arange(9) < np.array([9, 6])[:, None])[:, None, None, :]
  mask[1, :, 2] = False  # an empty row: flax gives uniform weights there, jattn zeros
  return x, jnp.asarray(mask)


@pytest.mark.parametrize("impl", ["dense", "chunked"])  # weights are formed apart: no schedule
def test_linen_sow_weights_equal_flax(impl):
  x, mask = _flax_weights_case()
  ours = nn.MultiHeadDotProductAttention(
    num_heads=4, attention_fn=jattn.make_attention_fn(implementation=impl, block_q=4, block_kv=4)
  )
  theirs = nn.MultiHeadDotProductAttention(num_heads=4)
  params = theirs.init(jax.random.key(1), x, mask=mask)
  o1, st1 = theirs.apply(params, x, mask=mask, sow_weights=True, mutable=["intermediates"])
  o2, st2 = ours.apply(params, x, mask=mask, sow_weights=True, mutable=["intermediates"])
  w1 = np.asarray(st1["intermediates"]["attention_weights"][0])
  w2 = np.asarray(st2["intermediates"]["attention_weights"][0])
  assert w1.shape == w2.shape == (2, 4, 9, 9)
  rows = np.asarray(mask).any(-1)  # (B, 1, T)
  full_rows = np.broadcast_to(rows[..., None], w1.shape)
  np.testing.assert_allclose(w2[full_rows], w1[full_rows], rtol=1e-5, atol=1e-5)
  assert np.all(w2[~full_rows] == 0)
  np.testing.assert_allclose(
    np.asarray(o2)[np.broadcast_to(rows[:, 0, :, None], o2.shape)],
    np.asarray(o1)[np.broadcast_to(rows[:, 0, :, None], o1.shape)],
    rtol=1e-5,
    atol=1e-5,
  )


def test_nnx_sow_weights_equal_flax():
  x, mask = _flax_weights_case()
  kw = dict(num_heads=4, in_features=16, decode=False)
  theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ours = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0), attention_fn=jattn.make_attention_fn())
  theirs(x, mask=mask, sow_weights=True)
  ours(x, mask=mask, sow_weights=True)
  w1 = np.asarray(theirs.attention_weights.value[0])
  w2 = np.asarray(ours.attention_weights.value[0])
  full_rows = np.broadcast_to(np.asarray(mask).any(-1)[..., None], w1.shape)
  np.testing.assert_allclose(w2[full_rows], w1[full_rows], rtol=1e-5, atol=1e-5)
  assert np.all(w2[~full_rows] == 0)


def test_jattn_modules_sow_weights_against_reference():
  x = jax.random.normal(jax.random.key(0), (2, 9, 16))
  layer = jattn.linen.MultiHeadAttention(num_heads=4, num_kv_heads=2, is_causal=True)
  params = layer.init(jax.random.key(1), x)
  _out, st = layer.apply(params, x, sow_weights=True, mutable=["intermediates"])
  w = np.asarray(st["intermediates"]["attention_weights"][0])
  p = jax.tree.map(np.asarray, params["params"])
  q = np.einsum("btd,dnh->btnh", x, p["query"]["kernel"]) + p["query"]["bias"]
  k = np.einsum("btd,dnh->btnh", x, p["key"]["kernel"]) + p["key"]["bias"]
  vis = ref.visible_mask(2, 4, 9, 9, causal="top_left")
  _, _, cache = ref.attention(q, k, k, visible=vis)
  np.testing.assert_allclose(w, cache["p"], rtol=1e-5, atol=1e-6)
  # nnx: the same weights for the same projections.
  m = jattn.nnx.MultiHeadAttention(
    num_heads=4, num_kv_heads=2, in_features=16, is_causal=True, rngs=nnx.Rngs(0)
  )
  m(x, sow_weights=True)
  assert np.asarray(m.attention_weights.value[0]).shape == (2, 4, 9, 9)
  np.testing.assert_allclose(np.asarray(m.attention_weights.value[0]).sum(-1), 1.0, rtol=1e-5)
