"""jattn.attention_received (issue #42): the sum over queries of each key's softmax weight, per
query head, against the float64 definition; O(T + S) memory on chunked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import received_cases as rc
import reference as ref
from received_cases import CASES, IMPLS, B, N, S, T

import jattn


# implementation=None is tried once: at this size it is dense on this CPU (and so the same
# program as "dense" for every case).
@pytest.mark.parametrize(
  "case,impl",
  [
    (case, impl)
    for case in sorted(CASES)
    for impl in sorted(IMPLS)
    if impl != "None" or case == "bias, soft cap, sinks"
  ],
)
def test_received_equals_the_float64_definition(impl, case):
  q, k = rc.inputs()
  kw, vis, ref_kw = rc.case(case)
  got = jax.jit(lambda q, k: jattn.attention_received(q, k, **kw, **IMPLS[impl]))(q, k)
  want = rc.want(q, k, vis, **ref_kw)
  assert got.shape == (B, S, N) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_16_bit_inputs_give_float32_sums_of_their_exact_weights(impl):
  # The sums are float32 of the bf16 inputs' exact weights: a bfloat16 result (rounded to 8
  # bits) would miss by about 1e-2 of a sum of several.
  q, k = rc.inputs(jnp.bfloat16)
  got = jattn.attention_received(q, k, is_causal=True, **IMPLS[impl])
  want = rc.want(q, k, ref.visible_mask(B, N, T, S, causal="top_left"))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_unbatched_and_each_rows_weights_sum_to_one():
  q, k = rc.inputs()
  got = jattn.attention_received(q[0], k[0], is_causal=True, implementation="chunked")
  assert got.shape == (S, N)
  # Every query sees a key here (causal, T <= S): the weights of T rows add up to T per head.
  np.testing.assert_allclose(np.asarray(got).sum(axis=0), np.full(N, T), rtol=1e-5)


def test_chunked_memory_grows_linearly():
  # Compiled temporaries at T = S = 4096 and 8192: O(T + S), nothing of T x S (which would be
  # 4 x 8192^2 x 4 bytes = 1 GiB at 8192 for one example and head).
  def temp(T):
    q = jax.ShapeDtypeStruct((1, T, 4, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.float32)
    f = lambda q, k: jattn.attention_received(q, k, is_causal=True, implementation="chunked")
    return jax.jit(f).lower(q, k).compile().memory_analysis().temp_size_in_bytes

  small, large = temp(4096), temp(8192)
  assert large <= 2.2 * small, (small, large)
  assert large < 4 * 8192 * 8192, large


def test_errors_name_the_argument():
  q, k = rc.inputs()
  with pytest.raises(ValueError, match="multiple of the key/value heads"):
    jattn.attention_received(q, k[:, :, :1].repeat(3, axis=2))
  with pytest.raises(TypeError, match="query"):
    jattn.attention_received("q", k)
