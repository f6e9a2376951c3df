"""User-level checks: jattn against jax.nn and flax on the argument mixes users pass, and the
errors they see.

Shapes are small (<= 16) so the file runs in seconds.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

B, T, S, N, K, H = 2, 5, 7, 4, 2, 8


def _rand(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _jax_nn(*args, **kwargs):
  # jax.nn promotes bf16/f16 logits to float32 implicitly, which conftest's strict mode forbids.
  with jax.numpy_dtype_promotion("standard"):
    return jax.nn.dot_product_attention(*args, **kwargs)


# ---- a malformed dropout_rng is reported by name, not from inside jax.random ------------------


@pytest.mark.parametrize(
  "rng",
  [3, jnp.zeros((2,), jnp.float32), "split"],
  ids=["python int", "float array", "batch of keys"],
)
def test_malformed_dropout_rng_error_names_the_argument(rng):
  rng_ = np.random.default_rng(0)
  q, k, v = _rand(rng_, (B, T, N, H)), _rand(rng_, (B, S, K, H)), _rand(rng_, (B, S, K, H))
  if isinstance(rng, str):
    rng = jax.random.split(jax.random.key(0), 2)
  with pytest.raises((TypeError, ValueError), match="dropout_rng"):
    jattn.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=rng)


# ---- pinned behaviour: agreement with jax.nn on the argument combinations users mix -----------


@pytest.mark.parametrize(
  "dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 3e-2), (jnp.float16, 3e-3)]
)
@pytest.mark.parametrize(
  "impl",
  [
    dict(implementation="dense"),
    dict(implementation="chunked", block_q=3, block_kv=4, schedule="serial"),
    dict(implementation="chunked", block_q=3, block_kv=4, schedule="parallel"),
  ],
  ids=["dense", "chunked-3x4", "parallel-3x4"],
)
def test_gqa_bias_mask_causal_matches_jax_nn_in_every_dtype(dtype, tol, impl):
  rng = np.random.default_rng(1)
  q, k, v = (
    _rand(rng, (B, T, N, H), dtype),
    _rand(rng, (B, S, K, H), dtype),
    _rand(rng, (B, S, K, H), dtype),
  )
  bias = _rand(rng, (B, 1, T, S), dtype)
  mask = jnp.asarray(rng.random((1, N, 1, S)) < 0.7).at[..., 0].set(True)  # every row sees key 0
  got = jattn.dot_product_attention(q, k, v, bias, mask, is_causal=True, **impl)
  want = _jax_nn(q, k, v, bias, mask, is_causal=True)
  assert got.dtype == dtype
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=0
  )


@pytest.mark.parametrize(
  "impl",
  [
    dict(implementation="dense"),
    dict(implementation="chunked", block_q=2, block_kv=3, schedule="serial"),
    dict(implementation="chunked", block_q=2, block_kv=3, schedule="parallel", step_width=2),
  ],
  ids=["dense", "chunked-2x3", "parallel-2x3"],
)
def test_nan_and_inf_in_padding_never_leak(impl):
  """Padded keys, values and queries hold garbage (NaN/inf); valid rows match jax.nn on clean
  inputs, padded rows are 0, and every gradient is finite."""
  rng = np.random.default_rng(2)
  q, k, v = _rand(rng, (B, T, N, H)), _rand(rng, (B, S, K, H)), _rand(rng, (B, S, K, H))
  q_len, kv_len = jnp.array([3, T], jnp.int32), jnp.array([4, 0], jnp.int32)
  qp = q.at[0, 3:].set(jnp.nan)
  kp = k.at[0, 4:].set(jnp.inf).at[1].set(jnp.nan)
  vp = v.at[0, 4:].set(jnp.nan).at[1].set(-jnp.inf)

  def f(q, k, v):
    return jattn.dot_product_attention(
      q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len, **impl
    )

  got = f(qp, kp, vp)
  want = _jax_nn(q[:1, :3], k[:1, :4], v[:1, :4])
  np.testing.assert_allclose(got[:1, :3], want, atol=2e-6, rtol=0)
  np.testing.assert_array_equal(got[0, 3:], 0.0)
  np.testing.assert_array_equal(got[1], 0.0)
  grads = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(qp, kp, vp)
  for g in grads:
    assert bool(jnp.all(jnp.isfinite(g)))
  np.testing.assert_array_equal(grads[0][1], 0.0)  # batch 1 has no keys: no gradient


def test_flax_linen_float_masks_through_make_attention_fn_match_flax():
  """flax's make_causal_mask / make_attention_mask / combine_masks are float32 0/1 arrays."""
  rng = np.random.default_rng(3)
  x = _rand(rng, (B, 6, 16))
  tokens = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
  mask = nn.combine_masks(
    nn.make_causal_mask(tokens), nn.make_attention_mask(tokens > 0, tokens > 0)
  )
  assert mask.dtype == jnp.float32
  ref_layer = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)
  layer = ref_layer.clone(
    attention_fn=jattn.make_attention_fn(implementation="chunked", block_q=4, block_kv=4)
  )
  params = ref_layer.init(jax.random.key(0), x)
  want = ref_layer.apply(params, x, mask=mask)
  got = layer.apply(params, x, mask=mask)
  valid = np.asarray(tokens > 0)[:, :, None]  # padded query rows: flax gives mean-of-V rows
  np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), atol=2e-6)


def test_dot_product_attention_itself_is_not_a_flax_attention_fn():
  """Passing jattn.dot_product_attention directly as attention_fn works in linen only without a
  mask; flax's float masks are refused with a TypeError naming the mask (make_attention_fn is
  the adapter)."""
  x = _rand(np.random.default_rng(4), (B, 6, 16))
  ref_layer = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16)
  layer = ref_layer.clone(attention_fn=jattn.dot_product_attention)
  params = ref_layer.init(jax.random.key(0), x)
  np.testing.assert_allclose(layer.apply(params, x), ref_layer.apply(params, x), atol=2e-6)
  with pytest.raises(TypeError, match="mask"):
    layer.apply(params, x, mask=nn.make_causal_mask(jnp.ones((B, 6))))


def test_import_jattn_does_not_import_flax():
  # jattn.linen / jattn.nnx load on first use, as flax.linen / flax.nnx do.
  import subprocess
  import sys

  code = (
    "import sys, jattn; assert 'flax' not in sys.modules, sorted(m for m in sys.modules "
    "if m.startswith('flax')); jattn.nnx; assert 'flax.nnx' in sys.modules; "
    "assert 'linen' in dir(jattn)"
  )
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
