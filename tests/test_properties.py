"""Property tests: random shapes, block sizes and mask combinations, both implementations against
the float64 reference (forward and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jattn
import reference as ref


@st.composite
def problems(draw):
  B = draw(st.integers(1, 2))
  K = draw(st.sampled_from([1, 2]))
  G = draw(st.sampled_from([1, 2, 3]))
  T = draw(st.integers(1, 40))
  S = draw(st.integers(1, 40))
  H = draw(st.sampled_from([4, 8]))
  causal = draw(st.sampled_from([None, "top_left", "bottom_right"]))
  window = draw(st.one_of(st.none(), st.tuples(st.integers(0, 12), st.integers(0, 12))))
  kv_lengths = draw(st.one_of(st.none(), st.lists(st.integers(0, S), min_size=B, max_size=B)))
  use_segments = draw(st.booleans())
  use_bias = draw(st.booleans())
  soft_cap = draw(st.sampled_from([None, 1.5]))
  block_q = draw(st.integers(1, 24))
  block_kv = draw(st.integers(1, 24))
  seed = draw(st.integers(0, 2**16))
  return dict(B=B, K=K, G=G, T=T, S=S, H=H, causal=causal, window=window, kv_lengths=kv_lengths,
              use_segments=use_segments, use_bias=use_bias, soft_cap=soft_cap, block_q=block_q,
              block_kv=block_kv, seed=seed)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_problems_match_reference(p):
  B, K, G, T, S, H = p["B"], p["K"], p["G"], p["T"], p["S"], p["H"]
  N = K * G
  rng = np.random.default_rng(p["seed"])
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k = rng.normal(size=(B, S, K, H)).astype(np.float32)
  v = rng.normal(size=(B, S, K, H)).astype(np.float32)
  do = rng.normal(size=(B, T, N, H)).astype(np.float32)
  bias = rng.normal(size=(1, N, T, S)).astype(np.float32) if p["use_bias"] else None
  q_seg = np.sort(rng.integers(0, 3, (B, T)), axis=1) if p["use_segments"] else None
  kv_seg = np.sort(rng.integers(0, 3, (B, S)), axis=1) if p["use_segments"] else None
  kw = dict(is_causal=p["causal"] or False, local_window_size=p["window"],
            logits_soft_cap=p["soft_cap"])
  if p["kv_lengths"] is not None:
    kw["key_value_seq_lengths"] = jnp.asarray(p["kv_lengths"], jnp.int32)
  if q_seg is not None:
    kw["q_segment_ids"] = jnp.asarray(q_seg, jnp.int32)
    kw["kv_segment_ids"] = jnp.asarray(kv_seg, jnp.int32)

  vis = ref.visible_mask(B, N, T, S, causal=p["causal"], window=p["window"],
                         kv_lengths=p["kv_lengths"], q_seg=q_seg, kv_seg=kv_seg)
  want, _, cache = ref.attention(q, k, v, visible=vis, bias=bias, soft_cap=p["soft_cap"])
  want_grads = ref.grads(cache, do)[:3]

  for impl in ({"implementation": "dense"},
               {"implementation": "chunked", "block_q": p["block_q"], "block_kv": p["block_kv"]}):
    f = lambda q, k, v: jattn.dot_product_attention(
        q, k, v, None if bias is None else jnp.asarray(bias), **kw, **impl)
    out, pull = jax.vjp(f, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5, err_msg=str(impl))
    for got, w in zip(pull(jnp.asarray(do)), want_grads):
      np.testing.assert_allclose(got, w, rtol=2e-4, atol=1e-4, err_msg=str(impl))
