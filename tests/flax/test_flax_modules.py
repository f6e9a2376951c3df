"""jattn.linen / jattn.nnx MultiHeadAttention: agreement with each other, with the float64 NumPy
layer of tests/support/reference_modules.py built from the same weights (projections, RoPE, GQA,
masks, scale, padding, cross-attention, dropout with jattn's keep mask, bf16 by the FlashAttention
rule), and KV-cache decoding against the reference's decoding loop and the full forward pass at
every position; paged and quantised caches decoded token by token to their last slot against the
float64 layer; the errors of the decoding path."""

import dropout_reference
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference
import reference_modules as rm
from flax import linen as nn
from flax import nnx

import jattn
from jattn import masks

B, T, D, N, K = 2, 8, 16, 4, 2
H = D // N
IMPLS = [dict(implementation="dense"), dict(implementation="chunked", block_q=4, block_kv=4)]
IMPL_IDS = ["dense", "chunked"]
NAMES = ("query", "key", "value", "out")


def _x(seed=0, shape=(B, T, D)):
  """Standard normal float32 inputs, drawn by NumPy (jax.random would compile a program for
  every shape)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _biases(params, seed):
  """``params`` (linen's tree) with random nonzero biases, drawn by NumPy."""
  rng = np.random.default_rng([seed, 100])
  return {
    n: dict(
      params[n], bias=jnp.asarray(0.1 * rng.standard_normal(params[n]["bias"].shape), jnp.float32)
    )
    for n in NAMES
  }


def _linen_pair(seed=0, **kw):
  """A linen module with random (nonzero-bias) params, and an nnx module holding the same."""
  lin = jattn.linen.MultiHeadAttention(num_heads=N, num_kv_heads=K, **kw)
  params = _biases(lin.init(jax.random.key(seed), _x())["params"], seed)
  mod = jattn.nnx.MultiHeadAttention(N, D, num_kv_heads=K, rngs=nnx.Rngs(0), **kw)
  for n in NAMES:
    getattr(mod, n).kernel[...] = params[n]["kernel"]
    getattr(mod, n).bias[...] = params[n]["bias"]
  return lin, params, mod


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_linen_nnx_and_reference_agree(impl):
  x = _x(1)
  seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 2, 2]], np.int32)
  kv_len = np.array([8, 5], np.int32)
  cases = [
    (dict(), dict(), dict()),
    (dict(is_causal=True, rope=True), dict(), dict(causal="top_left", rope_base=10000.0)),
    (
      dict(is_causal=True, local_window_size=(2, 0), logits_soft_cap=2.0),
      dict(),
      dict(causal="top_left", window=(2, 0), soft_cap=2.0),
    ),
    (
      dict(rope=True),
      dict(q_segment_ids=seg, kv_segment_ids=seg, key_value_seq_lengths=kv_len),
      dict(rope_base=10000.0, q_seg=seg, kv_seg=seg, kv_lengths=kv_len),
    ),
  ]
  for ctor, call, ref in cases:
    lin, params, mod = _linen_pair(**ctor, **impl)
    a = lin.apply({"params": params}, x, **call)
    b = mod(x, **call)
    np.testing.assert_array_equal(a, b)  # same weights, same numbers
    np.testing.assert_allclose(
      a, rm.mha(rm.params_from_linen(params), x, **ref), atol=2e-5, rtol=0, err_msg=str(ctor)
    )


def test_mask_object_cross_attention_and_bf16():
  lin, params, mod = _linen_pair(2)
  x, kv = _x(3), _x(4, (B, 5, D))
  m = masks.causal(offset=1) | masks.local_window(0, 2)
  np.testing.assert_array_equal(lin.apply({"params": params}, x, kv, mask=m), mod(x, kv, mask=m))
  # bf16 computation with float32 parameters stays close to float32.
  lin16 = jattn.linen.MultiHeadAttention(num_heads=N, num_kv_heads=K, dtype=jnp.bfloat16)
  out16 = lin16.apply({"params": params}, x)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(out16, np.float32), lin.apply({"params": params}, x), atol=6e-2
  )


# ---- decoding ------------------------------------------------------------------------------

# A prefill of 2, then 1, 2, 1, 2 tokens: a prefill, single tokens and several tokens at once at
# every fill level's parity, in two step lengths (each a program of its own under jit).
STEPS = [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8)]


@pytest.mark.parametrize(
  "impl,window",
  [(IMPLS[0], None), (IMPLS[1], None), (IMPLS[0], (2, 0))],
  ids=["dense", "chunked", "dense-window"],
)
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
  assert len(traces) == 2  # one trace per step length (2, 1): the index is data, not shape

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
  steps = [mod(gen[:, t : t + 1], decode=True) for t in range(3)]
  for b in range(B):
    seq = jnp.concatenate([prompt[b : b + 1, : lengths[b]], gen[b : b + 1]], axis=1)
    full = lin.apply({"params": params}, seq)[0]
    np.testing.assert_allclose(pre[b, : lengths[b]], full[: lengths[b]], atol=2e-6, rtol=0)
    for t in range(3):
      np.testing.assert_allclose(steps[t][b, 0], full[lengths[b] + t], atol=2e-6, rtol=0)
  # The padded prompt rows attended to nothing: the output projection of 0 is its bias.
  np.testing.assert_allclose(pre[1, 3:], np.broadcast_to(params["out"]["bias"], (2, D)), atol=1e-6)


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
  ref = nn.MultiHeadDotProductAttention(num_heads=N).apply(
    params, x, mask=nn.make_causal_mask(x[..., 0])
  )
  got = jattn.linen.MultiHeadAttention(num_heads=N, is_causal=True).apply(params, x)
  np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)


# ---- against the float64 layer of tests/support/reference_modules.py -----------------------
#
# Shapes ragged against the chunked blocks of 8: T2 = 13 queries, S2 = 11 cross-attention keys;
# N = 4 query heads over K = 2 key/value heads of H = 8 features. Every check runs both modules
# on the same weights (identical numbers expected) and compares each with the float64 layer
# built from its own parameters (linen's params tree, nnx's variables).

T2, S2, D2, DKV = 13, 11, 32, 24
IMPLS2 = [dict(implementation="dense"), dict(implementation="chunked", block_q=8, block_kv=8)]
ATOL = 2e-5  # float32 module against the float64 layer, outputs of order 1


def _pair(seed, *, kv_features=None, **kw):
  """linen and nnx modules with the same random weights (nonzero biases), for queries of D2
  features and (with ``kv_features``) cross-attention inputs of that many features."""
  x = jnp.zeros((B, T2, D2))
  kv = None if kv_features is None else jnp.zeros((B, S2, kv_features))
  lin = jattn.linen.MultiHeadAttention(num_heads=N, num_kv_heads=K, **kw)
  params = _biases(lin.init(jax.random.key(seed), x, kv, deterministic=True)["params"], seed)
  mod = jattn.nnx.MultiHeadAttention(
    N, D2, num_kv_heads=K, in_kv_features=kv_features, rngs=nnx.Rngs(params=0, dropout=7), **kw
  )
  for n in NAMES:
    getattr(mod, n).kernel[...] = params[n]["kernel"]
    getattr(mod, n).bias[...] = params[n]["bias"]
  return lin, params, mod


def _vs_ref(out, p, args, ref_kw, atol=ATOL):
  """A module's output against the float64 layer with parameters p on the same inputs."""
  x_q, x_kv = args[0], (args[1] if len(args) > 1 else None)
  np.testing.assert_allclose(out, rm.mha(p, x_q, x_kv, **ref_kw), atol=atol, rtol=0)


def _check(lin, params, mod, args, ref_kw, *, call=None):
  """linen == nnx exactly, and both equal the float64 layer read from their own parameters
  (linen's params tree, nnx's variables). ``call``: keyword arguments of both calls."""
  call = call or {}
  a = lin.apply({"params": params}, *args, **call)
  b = mod(*args, **call)
  np.testing.assert_array_equal(a, b)
  _vs_ref(a, rm.params_from_linen(params), args, ref_kw)
  _vs_ref(b, rm.params_from_nnx(mod), args, ref_kw)
  return a


def _keep(rng, rate, shape, broadcast=False):
  """The dropout keep mask (B, N, T, S) that jattn draws from ``rng``: its counter-based hash of
  (batch, query head, query index, key index), as in tests/attention/test_attention.py (batch and
  head 0 for every entry with broadcast dropout)."""
  Bs, Ns, Ts, Ss = shape
  b = jnp.arange(Bs).reshape(Bs, 1, 1, 1)
  h = jnp.arange(Ns).reshape(1, Ns, 1, 1)
  if broadcast:
    b, h = jnp.zeros_like(b[:1]), jnp.zeros_like(h[:, :1])
  t = jnp.arange(Ts).reshape(1, 1, Ts, 1)
  s = jnp.arange(Ss).reshape(1, 1, 1, Ss)
  keep = dropout_reference.keep(rng, rate, b, h, t, s)
  return np.broadcast_to(np.asarray(keep), shape)


def test_reference_layer_is_self_consistent():
  """The float64 layer's own pieces agree: its RoPE is the rotate-half formula written out with
  sin and cos, and its decoding loop reproduces its causal forward pass at every position."""
  rng = np.random.default_rng(0)
  hd = 8  # head dim: feature i < 4 pairs with i + 4, frequency 10000 ** (-2 i / 8)
  x = rng.normal(size=(B, T2, N, hd))
  pos = rng.integers(0, 50, size=(B, T2))
  h = hd // 2
  ang = pos[:, :, None, None] * 10000.0 ** (-2.0 * np.arange(h) / hd)
  x1, x2 = x[..., :h], x[..., h:]
  np.testing.assert_allclose(
    rm.rope(x, pos),
    np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1),
    atol=1e-12,
  )
  shapes = [((D2, N, 8), (N, 8)), ((D2, K, 8), (K, 8)), ((D2, K, 8), (K, 8)), ((N, 8, D2), (D2,))]
  params = {
    n: {"kernel": rng.normal(size=ks) / 4, "bias": rng.normal(size=bs) / 10}
    for n, (ks, bs) in zip(NAMES, shapes)
  }
  xs = rng.normal(size=(B, T2, D2))
  kw = dict(window=(3, 0), scale=0.4, rope_base=500.0)
  full = rm.mha(params, xs, causal="top_left", **kw)
  outs = rm.decode(params, [(xs[:, a:b], None) for a, b in [(0, 4), (4, 5), (5, 8), (8, 13)]], **kw)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS2, ids=IMPL_IDS)
def test_cross_attention_against_reference(impl):
  """Separate key/value inputs of another length (S2 != T2) and width (DKV != D2), GQA, RoPE with
  the default positions (queries arange(T2), keys arange(S2)), padding of the keys and an
  output width of its own."""
  lin, params, mod = _pair(20, kv_features=DKV, rope=True, out_features=12, **impl)
  x, kv = _x(21, (B, T2, D2)), _x(22, (B, S2, DKV))
  kv_len = np.array([S2, 6], np.int32)
  out = _check(
    lin,
    params,
    mod,
    (x, kv),
    dict(rope_base=10000.0, kv_lengths=kv_len),
    call=dict(key_value_seq_lengths=jnp.asarray(kv_len)),
  )
  assert out.shape == (B, T2, 12)


@pytest.mark.parametrize("impl", IMPLS2, ids=IMPL_IDS)
def test_mask_objects_against_reference(impl):
  """jattn.masks objects, combined with & and |, against boolean visibilities written out from
  their definitions; self-attention and cross-attention."""
  lin, params, mod = _pair(23, kv_features=DKV, **impl)
  x, kv = _x(24, (B, T2, D2)), _x(25, (B, S2, DKV))
  t, s = np.arange(T2)[:, None], np.arange(S2)[None, :]
  # cross-attention, with &, | and ~: keys k <= q - 2 except q - 5 <= k <= q - 4, or the two
  # keys q + 8 and q + 9
  m = (masks.causal(offset=-2) & ~masks.local_window(1, 0, offset=-4)) | masks.local_window(
    0, 1, offset=8
  )
  want = ((s <= t - 2) & ~((s >= t - 5) & (s <= t - 4))) | ((s >= t + 8) & (s <= t + 9))
  _check(lin, params, mod, (x, kv), dict(mask=want), call=dict(mask=m))
  lin, params, mod = _pair(26, **impl)
  x = _x(27, (B, T2, D2))
  t, s = np.arange(T2)[:, None], np.arange(T2)[None, :]
  _check(
    lin,
    params,
    mod,
    (x,),
    dict(mask=(s <= t) & (s >= t - 3)),
    call=dict(mask=masks.causal() & masks.local_window(3, 0)),
  )
  arr = np.random.default_rng(1).random((B, 1, T2, T2)) < 0.6  # a boolean array mask
  _check(
    lin,
    params,
    mod,
    (x,),
    dict(mask=arr & ((s // 4) == (t // 4))),
    call=dict(mask=masks.from_array(jnp.asarray(arr)) & masks.chunked_local(4)),
  )


@pytest.mark.parametrize("impl", IMPLS2, ids=IMPL_IDS)
def test_rope_positions_against_reference(impl):
  """Explicit RoPE positions: (B, T) query positions with (T,) key positions, (T,) positions
  that the keys follow in self-attention, and (B, S) key positions in cross-attention."""
  lin, params, mod = _pair(50, is_causal=True, rope=True, rope_base=500.0, **impl)
  x = _x(51, (B, T2, D2))
  rng = np.random.default_rng(2)
  pos = rng.integers(0, 40, (B, T2)).astype(np.int32)  # arbitrary, not monotone
  kvp = rng.integers(0, 40, (T2,)).astype(np.int32)
  ref = dict(causal="top_left", rope_base=500.0)
  _check(
    lin,
    params,
    mod,
    (x,),
    dict(ref, positions=pos, kv_positions=kvp),
    call=dict(positions=jnp.asarray(pos), kv_positions=jnp.asarray(kvp)),
  )
  p1 = (3 * np.arange(T2) + 7).astype(np.int32)
  _check(lin, params, mod, (x,), dict(ref, positions=p1), call=dict(positions=jnp.asarray(p1)))
  lin, params, mod = _pair(20, kv_features=DKV, rope=True, out_features=12, **impl)
  kv = _x(52, (B, S2, DKV))
  kvp = rng.integers(0, 40, (B, S2)).astype(np.int32)
  _check(
    lin,
    params,
    mod,
    (x, kv),
    dict(rope_base=10000.0, positions=p1, kv_positions=kvp),
    call=dict(positions=jnp.asarray(p1), kv_positions=jnp.asarray(kvp)),
  )


@pytest.mark.parametrize("impl", IMPLS2, ids=IMPL_IDS)
def test_scale_bottom_right_cross_attention_against_reference(impl):
  """A non-default scale (0.9, against the default 1 / sqrt(8)) with bottom-right causal
  cross-attention (T2 = 13 queries over S2 = 11 keys: the first two queries see nothing)."""
  lin, params, mod = _pair(60, kv_features=DKV, scale=0.9, is_causal="bottom_right", **impl)
  x, kv = _x(61, (B, T2, D2)), _x(62, (B, S2, DKV))
  out = _check(lin, params, mod, (x, kv), dict(scale=0.9, causal="bottom_right"))
  np.testing.assert_allclose(
    out[:, :2], np.broadcast_to(params["out"]["bias"], (B, 2, D2)), atol=1e-6
  )


@pytest.mark.parametrize("impl", IMPLS2, ids=IMPL_IDS)
def test_query_seq_lengths_against_reference(impl):
  """Padding of queries and keys: rows past query_seq_lengths attend to nothing (the output is
  the out projection's bias), keys past key_value_seq_lengths are invisible."""
  lin, params, mod = _pair(70, is_causal=True, rope=True, **impl)
  x = _x(71, (B, T2, D2))
  ql, kvl = np.array([T2, 6], np.int32), np.array([12, 9], np.int32)
  out = _check(
    lin,
    params,
    mod,
    (x,),
    dict(causal="top_left", rope_base=10000.0, q_lengths=ql, kv_lengths=kvl),
    call=dict(query_seq_lengths=jnp.asarray(ql), key_value_seq_lengths=jnp.asarray(kvl)),
  )
  np.testing.assert_allclose(
    out[1, 6:], np.broadcast_to(params["out"]["bias"], (T2 - 6, D2)), atol=1e-6
  )


def _plain_bf16_mha(params, x, *, rope_base):
  """Causal GQA attention in which every tensor is rounded to bfloat16 (inputs, weights,
  projections, rotary tables, logits, softmax, output), each operation computed in float32 from
  bf16 operands as 16-bit hardware does: the error budget of a plain 16-bit implementation."""
  r = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
  P = {n: {w: r(a) for w, a in params[n].items()} for n in NAMES}
  xb = r(x)
  proj = lambda n, spec: r(r(np.einsum(spec, xb, P[n]["kernel"])) + P[n]["bias"])
  q, k, v = (proj(n, "btd,dnh->btnh") for n in ("query", "key", "value"))
  Tn, h = x.shape[1], q.shape[-1] // 2
  ang = np.arange(Tn, dtype=np.float32)[:, None, None] * np.float32(rope_base) ** (
    np.float32(-2.0) * np.arange(h, dtype=np.float32) / np.float32(2 * h)
  )
  cos, sin = r(np.cos(ang)), r(np.sin(ang))
  rot = lambda z: np.concatenate(
    [r(r(z[..., :h] * cos) - r(z[..., h:] * sin)), r(r(z[..., h:] * cos) + r(z[..., :h] * sin))], -1
  )
  q, k = rot(q), rot(k)
  k, v = (np.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
  s = r(r(np.einsum("btnh,bsnh->bnts", q, k)) * r(1.0 / np.sqrt(q.shape[-1])))
  s = np.where(np.tril(np.ones((Tn, Tn), bool)), s, -np.inf)
  e = r(np.exp(r(s - s.max(-1, keepdims=True))))
  p = r(e / r(e.sum(-1, keepdims=True)))
  o = r(np.einsum("bnts,bsnh->btnh", p, v))
  return r(r(np.einsum("btnh,nho->bto", o, P["out"]["kernel"])) + P["out"]["bias"])


@pytest.mark.parametrize("impl", IMPLS2, ids=IMPL_IDS)
def test_bf16_against_reference_flash_attention_rule(impl):
  """bfloat16 computation (float32 parameters), causal, RoPE, GQA: the max error against the
  float64 layer is at most twice that of a plain all-bf16 layer, plus 1e-3 (the README's rule)."""
  lin, params, mod = _pair(40, dtype=jnp.bfloat16, is_causal=True, rope=True, **impl)
  x = _x(41, (B, T2, D2))
  a = lin.apply({"params": params}, x)
  assert a.dtype == jnp.bfloat16
  np.testing.assert_array_equal(a, mod(x))
  want = rm.mha(rm.params_from_linen(params), x, causal="top_left", rope_base=10000.0)
  err = np.abs(np.asarray(a, np.float64) - want).max()
  err_plain = np.abs(
    np.asarray(_plain_bf16_mha(params, x, rope_base=10000.0), np.float64) - want
  ).max()
  assert 0 < err <= 2 * err_plain + 1e-3, (err, err_plain)


@pytest.mark.parametrize("impl", IMPLS2, ids=IMPL_IDS)
def test_dropout_against_reference_with_the_modules_rng(impl):
  """Attention dropout against the float64 layer given jattn's keep mask for the key each module
  draws: linen's dropout_rng= and its 'dropout' rng stream (make_rng), nnx's call-time rngs and
  the stream kept at construction; independent masks per batch element and head, and
  broadcast_dropout's single (T, S) mask."""
  rate = 0.3
  lin, params, mod = _pair(30, dropout_rate=rate, is_causal=True, **impl)
  x = _x(31, (B, T2, D2))
  shape = (B, N, T2, T2)
  pl, pn = rm.params_from_linen(params), rm.params_from_nnx(mod)
  ref = lambda key, bc=False: dict(
    causal="top_left", dropout_rate=rate, keep=_keep(key, rate, shape, bc)
  )
  key = jax.random.key(5)
  out = lin.apply({"params": params}, x, deterministic=False, dropout_rng=key)
  _vs_ref(out, pl, (x,), ref(key))
  # The same key through nnx's call-time rngs: the same numbers.
  np.testing.assert_array_equal(
    mod(x, deterministic=False, rngs=nnx.Rngs(dropout=5)),
    lin.apply(
      {"params": params}, x, deterministic=False, dropout_rng=nnx.Rngs(dropout=5).dropout()
    ),
  )
  _vs_ref(
    mod(x, deterministic=False, rngs=nnx.Rngs(dropout=5)),
    pn,
    (x,),
    ref(nnx.Rngs(dropout=5).dropout()),
  )

  class Probe(nn.Module):  # the key a top-level linen module's make_rng('dropout') returns
    @nn.compact
    def __call__(self):
      return self.make_rng("dropout")

  rngs = {"dropout": jax.random.key(9)}
  _vs_ref(
    lin.apply({"params": params}, x, deterministic=False, rngs=rngs),
    pl,
    (x,),
    ref(Probe().apply({}, rngs=rngs)),
  )
  # nnx's own stream: Rngs(params=0, dropout=7).dropout.fork() at construction (see _pair).
  _vs_ref(
    mod(x, deterministic=False), pn, (x,), ref(nnx.Rngs(params=0, dropout=7).dropout.fork()())
  )
  # deterministic: no dropout
  _vs_ref(mod(x, deterministic=True), pn, (x,), dict(causal="top_left"))

  lin, params, mod = _pair(32, dropout_rate=rate, broadcast_dropout=True, is_causal=True, **impl)
  out = lin.apply({"params": params}, x, deterministic=False, dropout_rng=key)
  _vs_ref(out, rm.params_from_linen(params), (x,), ref(key, True))


# ---- decoding against the float64 decoding loop ----------------------------------------------


@pytest.mark.parametrize("impl", IMPLS2, ids=IMPL_IDS)
def test_decode_window_padded_prompts_every_position(impl):
  """A right-padded batch of prompts (lengths 3 and 1) prefilled together, then steps of 1, 3,
  1, 3, 1 tokens; causal sliding window (3, 0), RoPE, GQA, scale 0.5. Every decoded position
  (not only the last) equals the float64 decoding loop and the module's own full forward pass
  over each example's sequence; padded prefill rows give the bias; the fill levels advance per
  example."""
  kw = dict(is_causal=True, rope=True, local_window_size=(3, 0), scale=0.5, **impl)
  lin, params, mod = _pair(80, **kw)
  lengths, n_gen = np.array([3, 1], np.int32), 9
  prompt, gen = _x(81, (B, 3, D2)), _x(82, (B, n_gen, D2))
  bounds = [(0, 1), (1, 4), (4, 5), (5, 8), (8, 9)]
  steps = [(prompt, lengths)] + [(gen[:, a:b], None) for a, b in bounds]
  want = rm.decode(
    rm.params_from_linen(params),
    [(np.asarray(s), n) for s, n in steps],
    window=(3, 0),
    scale=0.5,
    rope_base=10000.0,
  )
  S_max = T2  # the cache's init pass and the full pass below reuse _pair's compiled attention
  call = lambda n: {} if n is None else dict(query_seq_lengths=jnp.asarray(n))

  dec = lin.clone(decode=True)
  cache = dec.init(jax.random.key(0), jnp.zeros((B, S_max, D2)))["cache"]
  lin_outs = []
  for s, n in steps:
    o, upd = dec.apply({"params": params, "cache": cache}, s, mutable=["cache"], **call(n))
    cache = upd["cache"]
    lin_outs.append(o)
  np.testing.assert_array_equal(cache["cache_index"], lengths + n_gen)

  mod.init_cache(B, S_max)
  nnx_outs = [mod(s, decode=True, **call(n)) for s, n in steps]
  np.testing.assert_array_equal(mod.cache_index[...], lengths + n_gen)

  for i, (a, b, w) in enumerate(zip(lin_outs, nnx_outs, want)):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, w, atol=ATOL, rtol=0, err_msg=f"step {i}")
  np.testing.assert_allclose(
    lin_outs[0][1, 1:], np.broadcast_to(params["out"]["bias"], (2, D2)), atol=1e-6
  )
  # The full forward pass over each example's own sequence, at every position: one batch, the
  # sequences right-padded with zeros to T2 (causal, so padding after them changes nothing).
  seqs = [
    jnp.concatenate([prompt[b, : lengths[b]], gen[b], jnp.zeros((T2 - n_gen - lengths[b], D2))])
    for b in range(B)
  ]
  full = lin.apply({"params": params}, jnp.stack(seqs))
  for b in range(B):
    got = jnp.concatenate([lin_outs[0][b, : lengths[b]]] + [o[b] for o in lin_outs[1:]])
    np.testing.assert_allclose(got, full[b, : lengths[b] + n_gen], atol=2e-6, rtol=0)


def test_decode_errors_name_the_argument():
  """What the decoding path validates raises the documented error, naming the argument, and a
  rejected call leaves the cache as it was."""
  mod = jattn.nnx.MultiHeadAttention(
    N, D2, num_kv_heads=K, is_causal=True, rope=True, implementation="dense", rngs=nnx.Rngs(0)
  )
  x = _x(90, (B, 2, D2))
  with pytest.raises(ValueError, match=r"init_cache"):
    mod(x, decode=True)
  mod.init_cache(B, 4)
  with pytest.raises(ValueError, match=r"T=5 tokens does not fit the cache of S_max=4"):
    mod(_x(91, (B, 5, D2)), decode=True)
  with pytest.raises(NotImplementedError, match=r"inputs_k/inputs_v"):
    mod(x, x, decode=True)
  for name, val in [
    ("kv_positions", jnp.arange(2)),
    ("key_value_seq_lengths", jnp.array([1, 1])),
    ("q_segment_ids", jnp.zeros((B, 2), jnp.int32)),
    ("kv_segment_ids", jnp.zeros((B, 2), jnp.int32)),
  ]:
    with pytest.raises(ValueError, match=rf"{name} is set by the cache"):
      mod(x, decode=True, **{name: val})
  with pytest.raises(ValueError, match=r"query_seq_lengths must be an int array of shape"):
    mod(x, decode=True, query_seq_lengths=jnp.array([1, 2, 3]))
  with pytest.raises(TypeError, match=r"query_seq_lengths must be an integer array"):
    mod(x, decode=True, query_seq_lengths=jnp.array([1.0, 2.0]))
  with pytest.raises(ValueError, match=r"positions must have shape \(L,\)=\(2,\)"):
    mod(x, decode=True, positions=jnp.arange(3))
  with pytest.raises(TypeError, match=r"positions must be an integer array"):
    mod(x, decode=True, positions=jnp.arange(2.0))
  np.testing.assert_array_equal(mod.cache_index[...], [0, 0])
  mod.init_cache(B + 1, 4)
  with pytest.raises(ValueError, match=r"cache of shape \(3, 4, 2, 8\)"):
    mod(x, decode=True)
  mod.init_cache(B, 4, dtype=jnp.bfloat16)
  with pytest.raises(TypeError, match=r"must have the cache's dtype \(bfloat16\)"):
    mod(x, decode=True)
  free = jattn.nnx.MultiHeadAttention(N, D2, num_kv_heads=K, rngs=nnx.Rngs(0))
  free.init_cache(B, 4)
  with pytest.raises(ValueError, match=r"decode=True needs is_causal"):
    free(x, decode=True)
  # linen: the same checks through its cache collection
  dec = jattn.linen.MultiHeadAttention(
    num_heads=N, num_kv_heads=K, is_causal=True, decode=True, implementation="dense"
  )
  variables = dec.init(jax.random.key(0), jnp.zeros((B, 4, D2)))
  with pytest.raises(ValueError, match=r"T=5 tokens does not fit the cache of S_max=4"):
    dec.apply(variables, _x(91, (B, 5, D2)), mutable=["cache"])
  with pytest.raises(NotImplementedError, match=r"inputs_k/inputs_v"):
    dec.apply(variables, x, x, mutable=["cache"])
  with pytest.raises(ValueError, match=r"kv_segment_ids is set by the cache"):
    dec.apply(variables, x, kv_segment_ids=jnp.zeros((B, 2), jnp.int32), mutable=["cache"])
  with pytest.raises(ValueError, match=r"decode=True needs is_causal"):
    dec.clone(is_causal=False).apply(variables, x, mutable=["cache"])
  # Outside decoding, RoPE positions of the wrong shape or dtype.
  lin = jattn.linen.MultiHeadAttention(num_heads=N, num_kv_heads=K, rope=True)
  params = lin.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"kv_positions must have shape \(L,\)=\(3,\)"):
    lin.apply(params, x, _x(92, (B, 3, D2)), kv_positions=jnp.arange(2))
  with pytest.raises(TypeError, match=r"positions must be an integer array"):
    lin.apply(params, x, positions=jnp.arange(2.0))


def test_decode_past_the_cache_drops_the_writes():
  """Documented: a step past S_max cannot raise under jit; its writes are dropped, never clamped
  onto the last valid slots. Step by step, a cache of 4 holds exactly the first 4 slots of what a
  cache of 8 holds, through a step that crosses the end and one entirely past it."""
  mod = jattn.nnx.MultiHeadAttention(
    N, D2, num_kv_heads=K, is_causal=True, implementation="dense", rngs=nnx.Rngs(0)
  )
  steps = [_x(93, (B, 3, D2)), _x(94, (B, 2, D2)), _x(95, (B, 1, D2))]  # slots 0-2, 3-4, 5
  caches = {}
  for S_max in (8, 4):
    mod.init_cache(B, S_max)
    caches[S_max] = []
    for s in steps:
      mod(s, decode=True)
      caches[S_max].append((np.asarray(mod.cached_key[...]), np.asarray(mod.cached_value[...])))
    np.testing.assert_array_equal(mod.cache_index[...], [6, 6])
  for (k8, v8), (k4, v4) in zip(caches[8], caches[4]):
    np.testing.assert_array_equal(k4, k8[:, :4])
    np.testing.assert_array_equal(v4, v8[:, :4])


# ---- seams: flax's own masks, decoding with a user mask and explicit positions ---------------


def test_flax_float_masks_are_taken_as_flax_reads_them():
  """flax's make_attention_mask / make_causal_mask / combine_masks build float32 0/1 masks,
  which flax's own modules read as jnp.where(mask, ...): linen and nnx take them, equal to the
  boolean mask and to the float64 reference."""
  x = _x(31)
  pad = np.array([[1] * T, [1] * 5 + [0] * (T - 5)], np.int32)
  mask = nnx.combine_masks(nnx.make_attention_mask(pad, pad), nnx.make_causal_mask(pad))
  assert mask.dtype == jnp.float32
  lin, params, mod = _linen_pair(32)
  vis = np.asarray(mask, bool)
  want = rm.mha(rm.params_from_linen(params), np.asarray(x), mask=vis)
  for got in (
    lin.apply({"params": params}, x, mask=mask),
    mod(x, mask=mask),
    lin.apply({"params": params}, x, mask=mask.astype(jnp.int32)),
  ):
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(got, mod(x, mask=np.asarray(mask, bool)))


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_decode_with_a_user_mask_equals_the_uncached_pass(impl):
  """Decoding with mask= over the cache slots (here: every query hides key 2 of example 0 and
  key 4 of example 1, as a flax 0/1 float mask) equals one uncached pass over the finished
  sequence with the same keys hidden, at every position (a mask dropped while decoding
  shows)."""
  lin, params, mod = _linen_pair(33, is_causal=True, rope=True, **impl)
  x = _x(34)
  S_max = T
  hidden = np.ones((B, 1, 1, S_max), np.float32)
  hidden[0, ..., 2] = 0
  hidden[1, ..., 4] = 0
  full = lin.apply({"params": params}, x, mask=jnp.asarray(hidden[..., :T]))
  mod.init_cache(B, S_max)
  outs = []
  for a, b in STEPS:
    m = np.broadcast_to(hidden, (B, 1, b - a, S_max))
    outs.append(mod(x[:, a:b], decode=True, mask=jnp.asarray(m)))
  got = jnp.concatenate(outs, 1)
  np.testing.assert_allclose(got, full, atol=2e-6, rtol=0)
  # The mask changed something: without it, the outputs differ.
  assert float(jnp.abs(full - lin.apply({"params": params}, x)).max()) > 1e-3


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_decode_with_explicit_positions_equals_the_uncached_pass(impl):
  """Explicit RoPE positions= while decoding are the tokens' positions as given (not offset by
  the cache index again): stepping through a sequence with positions 0, 3, 6, ... equals one
  uncached pass with the same positions, at every position."""
  lin, params, mod = _linen_pair(35, is_causal=True, rope=True, **impl)
  x = _x(36)
  pos = np.broadcast_to(3 * np.arange(T, dtype=np.int32), (B, T))
  full = lin.apply({"params": params}, x, positions=jnp.asarray(pos))
  mod.init_cache(B, T)
  dec = lin.clone(decode=True)
  cache = dec.init(jax.random.key(0), jnp.zeros((B, T, D)))["cache"]
  nnx_outs, lin_outs = [], []
  for a, b in STEPS:
    p = jnp.asarray(pos[:, a:b])
    nnx_outs.append(mod(x[:, a:b], decode=True, positions=p))
    o, upd = dec.apply(
      {"params": params, "cache": cache}, x[:, a:b], positions=p, mutable=["cache"]
    )
    cache = upd["cache"]
    lin_outs.append(o)
  np.testing.assert_allclose(jnp.concatenate(nnx_outs, 1), full, atol=2e-6, rtol=0)
  np.testing.assert_allclose(jnp.concatenate(lin_outs, 1), full, atol=2e-6, rtol=0)
  # The positions matter: arange(T) gives another answer.
  assert float(jnp.abs(full - lin.apply({"params": params}, x)).max()) > 1e-3


# ---- quantised caches ----------------------------------------------------------------------


def _dequantized_forward(lin, params, x, dtype):
  """The uncached forward pass with keys and values rounded as a quantised cache stores them
  (per token and head), through the float64-free path of dense attention: what a decode with
  that cache must give."""
  from jattn._paged.write import quantize

  def round_trip(t):
    y, s = quantize(t, dtype)
    return (y.astype(jnp.float32) * s[..., None]).astype(t.dtype)

  real = jattn.dot_product_attention

  def rounded(q, k, v, *a, **kw):
    return real(q, round_trip(k), round_trip(v), *a, **kw)

  import jattn._flax.modules as mha_module

  saved = mha_module.dot_product_attention
  mha_module.dot_product_attention = rounded
  try:
    return lin.apply({"params": params}, x)
  finally:
    mha_module.dot_product_attention = saved


def _linen_steps(dec, params, cache, x):
  """A linen decoding module applied over STEPS: (outputs joined, the final cache)."""
  outs = []
  for a, b in STEPS:
    o, upd = dec.apply({"params": params, "cache": cache}, x[:, a:b], mutable=["cache"])
    cache = upd["cache"]
    outs.append(o)
  return jnp.concatenate(outs, 1), cache


@pytest.mark.parametrize(
  "dtype, window, linen",
  [
    (jnp.int8, None, True),
    (jnp.int8, (2, 0), False),
    (jnp.float8_e4m3fn, None, False),
    (jnp.float8_e4m3fn, (2, 0), True),
  ],
  ids=["int8-None-linen", "int8-window", "float8_e4m3fn-None", "float8_e4m3fn-window-linen"],
)
def test_quantized_cache_decode_equals_the_rounded_full_forward(dtype, window, linen):
  # An nnx module with an int8 / float8 cache (init_cache(dtype=...)) decodes step by step
  # (prefill 2, then 1, 2, 1, 2 tokens) to the uncached forward pass whose keys and values are
  # rounded exactly as the cache stores them; and within the rounding's own error of the float
  # forward pass. The linen module's cache_dtype plumbing is its own; its decoding is nnx's
  # (the same _mha step): checked with each dtype once and with and without the window.
  kw = dict(is_causal=True, rope=True, local_window_size=window)
  lin, params, mod = _linen_pair(5, **kw)
  x = _x(6)
  mod.init_cache(B, 11, dtype=dtype)
  assert mod.cached_key[...].dtype == dtype and mod.cached_key_scale[...].shape == (B, 11, K)
  step = nnx.jit(lambda m, xt: m(xt, decode=True))
  got = jnp.concatenate([step(mod, x[:, a:b]) for a, b in STEPS], 1)
  np.testing.assert_array_equal(mod.cache_index[...], [T, T])
  np.testing.assert_allclose(got, _dequantized_forward(lin, params, x, dtype), atol=2e-5)
  full = lin.apply({"params": params}, x)
  bound = 0.05 if dtype == jnp.int8 else 0.3
  assert float(jnp.abs(got - full).max()) < bound * float(jnp.abs(full).max())
  if not linen:
    return
  # The linen module with cache_dtype: the same numbers.
  dec = lin.clone(decode=True, cache_dtype=dtype)
  cache = dec.init(jax.random.key(0), jnp.zeros((B, 11, D)))["cache"]
  assert cache["cached_value"].dtype == dtype and cache["cached_value_scale"].shape == (B, 11, K)
  np.testing.assert_allclose(_linen_steps(dec, params, cache, x)[0], got, atol=1e-6)


def test_quantized_cache_padded_prompts_and_refusals():
  lin, params, mod = _linen_pair(7, is_causal=True, rope=True)
  lengths = np.array([5, 3], np.int32)
  prompt, gen = _x(8, (B, 5, D)), _x(9, (B, 3, D))
  mod.init_cache(B, 10)
  float_pre = mod(prompt, decode=True, query_seq_lengths=jnp.asarray(lengths))
  mod.init_cache(B, 10, dtype=jnp.int8)
  pre = mod(prompt, decode=True, query_seq_lengths=jnp.asarray(lengths))
  np.testing.assert_array_equal(mod.cache_index[...], lengths)
  # Padded queries attend to nothing, as with a float cache (the projection's bias remains).
  np.testing.assert_allclose(pre[1, 3:], float_pre[1, 3:], atol=1e-6)
  steps = [mod(gen[:, t : t + 1], decode=True) for t in range(3)]
  for b in range(B):
    seq = jnp.concatenate([prompt[b : b + 1, : lengths[b]], gen[b : b + 1]], axis=1)
    full = lin.apply({"params": params}, seq)[0]
    np.testing.assert_allclose(pre[b, : lengths[b]], full[: lengths[b]], atol=5e-2)
    for t in range(3):
      np.testing.assert_allclose(steps[t][b, 0], full[lengths[b] + t], atol=5e-2)
  mod.init_cache(B, 10, dtype=jnp.int8)
  with pytest.raises(NotImplementedError, match="quantised cache.*a mask"):
    mod(prompt, decode=True, mask=jnp.ones((B, 1, 5, 10), bool))


# ---- a value head size of its own, paged caches -------------------------------------------


def test_value_head_size_of_its_own_in_the_modules():
  # value_head_dim = 6 with H = 4 (MLA-style): value kernel (D, K, 6), out kernel (N, 6, D);
  # linen and nnx give the float64 layer's answer, and decoding step by step with a contiguous,
  # a paged and an int8 cache gives the uncached pass's.
  kw = dict(value_head_dim=6, is_causal=True, rope=True)
  lin, params, mod = _linen_pair(11, **kw)
  assert params["value"]["kernel"].shape == (D, K, 6)
  assert params["out"]["kernel"].shape == (N, 6, D)
  x = _x(12)
  want = rm.mha(rm.params_from_linen(params), x, causal="top_left", rope_base=10000.0)
  np.testing.assert_allclose(lin.apply({"params": params}, x), want, atol=2e-5)
  np.testing.assert_allclose(mod(x), want, atol=2e-5)
  step = nnx.jit(lambda m, xt: m(xt, decode=True))
  for cache_kw in ({}, dict(page_size=3), dict(dtype=jnp.int8)):
    mod.init_cache(B, 11, **cache_kw)
    assert mod.cached_value[...].shape[-1] == 6
    got = jnp.concatenate([step(mod, x[:, a:b]) for a, b in STEPS], 1)
    ref = want if "dtype" not in cache_kw else _dequantized_forward(lin, params, x, jnp.int8)
    np.testing.assert_allclose(got, ref, atol=2e-5, err_msg=str(cache_kw))
  with pytest.raises(ValueError, match="value_head_dim"):
    jattn.nnx.MultiHeadAttention(N, D, value_head_dim=0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dtype", [None, jnp.int8])
def test_paged_cache_decode_equals_the_uncached_pass(dtype):
  # init_cache(page_size=3): pools (P, 3, K, H) and a page table; with the table shuffled,
  # decoding step by step (prefill 2, then 1, 2, 1, 2 tokens) writes each position to the
  # page the table names and gives the uncached pass (keys and values rounded as stored, for
  # int8); the linen module with cache_page_size gives the same numbers.
  kw = dict(is_causal=True, rope=True, local_window_size=(3, 0))
  lin, params, mod = _linen_pair(13, **kw)
  x = _x(14)
  want = (
    lin.apply({"params": params}, x)
    if dtype is None
    else _dequantized_forward(lin, params, x, dtype)
  )
  mod.init_cache(B, 11, dtype=dtype, page_size=3)
  assert mod.cached_key[...].shape == (B * 4, 3, K, H)
  np.testing.assert_array_equal(mod.page_table[...], np.arange(B * 4).reshape(B, 4))
  table = np.random.default_rng(0).permutation(B * 4).reshape(B, 4).astype(np.int32)
  mod.page_table[...] = jnp.asarray(table)
  step = nnx.jit(lambda m, xt: m(xt, decode=True))
  got = jnp.concatenate([step(mod, x[:, a:b]) for a, b in STEPS], 1)
  np.testing.assert_allclose(got, want, atol=2e-5)
  # The pool read through the table is the contiguous cache a float module keeps.
  flat = lin.clone(decode=True, cache_dtype=dtype)
  cache = flat.init(jax.random.key(0), jnp.zeros((B, 12, D)))["cache"]
  _, cache = _linen_steps(flat, params, cache, x)
  through = np.asarray(mod.cached_key[...])[table].reshape(B, 12, K, H)
  np.testing.assert_array_equal(through[:, :T], np.asarray(cache["cached_key"])[:, :T])
  dec = lin.clone(decode=True, cache_dtype=dtype, cache_page_size=3)
  cache = dec.init(jax.random.key(0), jnp.zeros((B, 11, D)))["cache"]
  assert cache["cached_value"].shape == (B * 4, 3, K, H) and cache["page_table"].shape == (B, 4)
  cache = dict(cache, page_table=jnp.asarray(table))
  np.testing.assert_allclose(_linen_steps(dec, params, cache, x)[0], got, atol=1e-6)
  with pytest.raises(NotImplementedError, match="paged or quantised cache.*a mask"):
    mod(x[:, :1], decode=True, mask=jnp.ones((B, 1, 1, 12), bool))


# ---- a paged or quantised cache decoded to its last slot -----------------------------------

S_FULL = 8  # the caches below hold exactly 8 positions: paged ones 2 pages of 4 or 4 of 2
FULL_CACHES = {
  "paged": dict(page_size=4),
  "int8": dict(dtype=jnp.int8),
  "float8_e4m3fn-paged": dict(dtype=jnp.float8_e4m3fn, page_size=2),
  "float8_e5m2": dict(dtype=jnp.float8_e5m2),
}


def _stored(cache, table):
  """A module's cache as float64 (B, S_FULL, K, H|Hv) keys and values, in position order:
  paged pools read through the table, quantised ones times their scales."""
  keys, values = (np.asarray(cache[n], np.float64) for n in ("cached_key", "cached_value"))
  if "cached_key_scale" in cache:
    keys = keys * np.asarray(cache["cached_key_scale"], np.float64)[..., None]
    values = values * np.asarray(cache["cached_value_scale"], np.float64)[..., None]
  if table is not None:
    keys, values = (x[table].reshape((B, S_FULL) + x.shape[2:]) for x in (keys, values))
  return keys, values


def _nnx_cache(mod):
  names = ("cached_key", "cached_value", "cached_key_scale", "cached_value_scale")
  return {n: getattr(mod, n)[...] for n in names if getattr(mod, n) is not None}


def _rounding_bound(dtype, x, amax):
  """How far quantize() may move x (float64, (..., H)) whose token and head have the largest
  magnitude amax (..., 1): half a step of the dtype's grid at x / scale, times the scale, and a
  float32 computation's slack."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.int8:
    half = np.broadcast_to(amax / 127 / 2, x.shape)
  else:
    fi = ml_dtypes.finfo(dtype)
    scale = amax / float(fi.max)
    half = np.maximum(np.abs(x) * float(fi.eps) / 2, float(fi.smallest_subnormal) / 2 * scale)
  return half * (1 + 1e-3) + 1e-5 * amax


@pytest.mark.parametrize("cache_kw", FULL_CACHES.values(), ids=FULL_CACHES.keys())
def test_cache_decoded_token_by_token_to_its_last_slot(cache_kw):
  """nnx and linen modules decode one token at a time until the cache's last slot is filled;
  each step equals the float64 layer's causal attention of that token over every key so far
  (quantised: over the keys and values as stored, dequantised, which are in turn within half a
  step of the dtype's grid of the float64 ones). A fill level one short of the capacity at the
  last step (its own key dropped) fails: the check is far tighter than that key's weight."""
  dtype, ps = cache_kw.get("dtype"), cache_kw.get("page_size")
  lin, params, mod = _linen_pair(41, is_causal=True, rope=True)
  p64 = rm.params_from_linen(params)
  x = _x(42, (B, S_FULL, D))
  q, k, v = rm.project_qkv(p64, x, x)
  pos = np.broadcast_to(np.arange(S_FULL), (B, S_FULL))
  q, k = rm.rope(q, pos), rm.rope(k, pos)
  table = None
  if ps is not None:  # a shuffled table: example b's positions live in the pages it names
    table = np.random.default_rng(3).permutation(B * S_FULL // ps).reshape(B, -1).astype(np.int32)

  mod.init_cache(B, S_FULL, **cache_kw)
  if table is not None:
    mod.page_table[...] = jnp.asarray(table)
  nstep = nnx.jit(lambda m, xt: m(xt, decode=True))
  dec = lin.clone(decode=True, cache_dtype=dtype, cache_page_size=ps)
  cache = dec.init(jax.random.key(0), jnp.zeros((B, S_FULL, D)))["cache"]
  if table is not None:
    cache = dict(cache, page_table=jnp.asarray(table))
  lstep = jax.jit(lambda c, xt: dec.apply({"params": params, "cache": c}, xt, mutable=["cache"]))

  def want(keys, values, i, n):
    """The out projection of query i over keys 0 .. n - 1 (all visible to it), float64."""
    o, _, _ = reference.attention(q[:, i : i + 1], keys[:, :n], values[:, :n])
    return rm.project_out(p64, o)[:, 0]

  for i in range(S_FULL):
    got_nnx = nstep(mod, x[:, i : i + 1])
    got_lin, upd = lstep(cache, x[:, i : i + 1])
    cache = upd["cache"]
    for name, got, stored in (("nnx", got_nnx, _nnx_cache(mod)), ("linen", got_lin, cache)):
      keys, values = (k, v) if dtype is None else _stored(stored, table)
      np.testing.assert_allclose(
        got[:, 0], want(keys, values, i, i + 1), atol=2e-5, rtol=0, err_msg=f"{name} step {i}"
      )
  for name, idx in (("nnx", mod.cache_index[...]), ("linen", cache["cache_index"])):
    np.testing.assert_array_equal(idx, [S_FULL] * B, err_msg=name)
  if dtype is not None:
    # The stored keys and values are the float64 ones rounded once, per token and head.
    for name, stored in (("nnx", _nnx_cache(mod)), ("linen", cache)):
      for what, x64, x_st in zip(("keys", "values"), (k, v), _stored(stored, table)):
        amax = np.abs(x64).max(-1, keepdims=True)
        assert np.all(np.abs(x_st - x64) <= _rounding_bound(dtype, x64, amax)), (name, what)
  # What the tolerance guards: the last key's weight is visible at the last step.
  keys, values = (k, v) if dtype is None else _stored(cache, table)
  last = want(keys, values, S_FULL - 1, S_FULL)
  short = want(keys, values, S_FULL - 1, S_FULL - 1)
  assert np.abs(last - short).max() > 100 * 2e-5
