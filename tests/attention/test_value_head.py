"""A value head size of its own: value (B, S, K, Hv) with Hv != H (MLA: query/key 192, value 128).

Every jattn kernel -- dense, chunked in both schedules -- gives the float64 reference's output and
gradients; the fused kernels refuse it by name (a sequence falls through); a value whose other
dimensions differ from key's is a ValueError naming both shapes.
"""

from __future__ import annotations

import covering
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from attention_cases import IMPLS

import jattn

B, T, S, N, K, H, HV = 2, 37, 45, 4, 2, 16, 24


def _inputs(Hv=HV):
  ks = jax.random.split(jax.random.key(3), 5)
  return (
    jax.random.normal(ks[0], (B, T, N, H)),
    jax.random.normal(ks[1], (B, S, K, H)),
    jax.random.normal(ks[2], (B, S, K, Hv)),
    jax.random.normal(ks[3], (B, T, N, Hv)),
    jax.random.normal(ks[4], (B, N, T, S)),
  )


# Each implementation with a value head smaller and one larger than H, and with and without a
# causal mask, each pair of those once (a covering design: the head size is the value's matmul
# and dV's shape, the mask the block map; they do not meet elsewhere).
_ROWS = covering.pairwise({"impl": sorted(IMPLS), "Hv": [8, HV], "causal": [None, "bottom_right"]})


@pytest.mark.parametrize(
  "impl,Hv,causal", [tuple(r.values()) for r in _ROWS], ids=covering.ids(_ROWS)
)
def test_value_head_size_against_reference(impl, Hv, causal):
  q, k, v, do, bias = _inputs(Hv)
  sinks = jnp.linspace(-1.0, 1.0, N)
  kw = dict(IMPLS[impl], is_causal=causal, logits_soft_cap=4.0, return_residual=True)

  def f(q, k, v, bias, sinks):
    return jattn.dot_product_attention(q, k, v, bias, sinks=sinks, **kw)

  def out_and_grads(*primals):  # forward and backward: one compiled program
    (out, lse), pull = jax.vjp(f, *primals)
    return (out, lse) + pull((do, jnp.zeros_like(lse)))

  got = jax.jit(out_and_grads)(q, k, v, bias, sinks)
  assert got[0].shape == (B, T, N, Hv) and got[0].dtype == q.dtype
  vis = ref.visible_mask(B, N, T, S, causal=causal)
  want_out, want_lse, cache = ref.attention(
    q, k, v, visible=vis, bias=bias, soft_cap=4.0, sinks=sinks
  )
  want = (want_out, want_lse) + tuple(ref.grads(cache, do, bias_shape=bias.shape))
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias", "dsinks"), got, want):
    assert np.shape(a) == np.shape(b), name
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(
      np.asarray(a) / scale,
      np.asarray(b) / scale,
      atol=2e-5,
      err_msg=f"{name} {impl} Hv={Hv} {causal}",
    )


def test_fused_kernels_refuse_it_by_name_and_a_sequence_falls_through():
  q, k, v, _, _ = _inputs()
  for name in ("splash", "cudnn"):
    with pytest.raises(NotImplementedError, match=f"{name}.*Hv=24.*H=16"):
      jattn.dot_product_attention(q, k, v, implementation=name)
  with pytest.warns(UserWarning, match="fell through: .*splash.*Hv=24"):
    got = jattn.dot_product_attention(q, k, v, implementation=("splash", "chunked"))
  want = jattn.dot_product_attention(q, k, v, implementation="dense")
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_value_must_match_key_but_for_its_head_size():
  q, k, v, _, _ = _inputs()
  with pytest.raises(ValueError, match=r"value must have key's \(B, S, K\).*value.shape="):
    jattn.dot_product_attention(q, k, v[:, :-1])
  with pytest.raises(ValueError, match=r"value must have key's \(B, S, K\)"):
    jattn.dot_product_attention(q, k, v[:, :, :1])
