"""A backend added through the registry alone (`jattn._registry.register`): chosen by name,
refused with its own reason, fallen through in a sequence, named in the errors of unknown
names, refused by ring attention with a reason (no KeyError), and gone once unregistered.

The toy backend computes attention in float64 NumPy on the host (`jax.pure_callback`) and
supports only what it can compute from the bound call's arrays: no mask, bias, dropout,
score_mod or sinks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jattn
from jattn import _registry
from jattn._parallel import ring as _ring

NAME = "float64-host"
RUNS = []


def _host(q, k, v, scale):
  """q (B, T, N, H), k/v (B, S, K, H) -> out (B, T, N, H) in q's dtype, lse (B, T, N) float32."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  G = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, k) * scale
  m = s.max(-1, keepdims=True)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  out = np.einsum("bnts,bsnh->btnh", p / l, v)
  lse = (m + np.log(l))[..., 0].transpose(0, 2, 1)
  return out, lse


def _supports(call):
  given = {
    "a mask": call.mask is not None,
    "bias": call.bias is not None,
    "dropout": call.opts.dropout_rate > 0,
    "score_mod": call.opts.score_mod is not None,
    "sinks": call.sink is not None,
  }
  for name, is_given in given.items():
    if is_given:
      return f"{name}: the float64 host backend computes plain softmax attention only"
  return None


def _run(call):
  RUNS.append(call.static.T)
  s = call.static
  like = (
    jax.ShapeDtypeStruct((s.B, s.T, s.N, s.Hv), s.dtype),
    jax.ShapeDtypeStruct((s.B, s.T, s.N), jnp.float32),
  )

  def host(q, k, v):
    out, lse = _host(q, k, v, s.scale)
    return out.astype(like[0].dtype), lse.astype(np.float32)

  return jax.pure_callback(host, like, call.query, call.key, call.value)


@pytest.fixture
def toy():
  RUNS.clear()
  backend = _registry.register(_registry.Backend(NAME, _run, supports=_supports))
  try:
    yield backend
  finally:
    _registry.unregister(NAME)


def _inputs(T=24, S=40, N=4, K=2, H=8):
  rng = np.random.default_rng(0)
  return tuple(
    rng.standard_normal(shape).astype(np.float32)
    for shape in ((2, T, N, H), (2, S, K, H), (2, S, K, H))
  )


def test_chosen_by_name(toy):
  q, k, v = _inputs()
  out, lse = jattn.dot_product_attention(q, k, v, implementation=NAME, return_residual=True)
  want, want_lse, _ = ref.attention(q, k, v)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  assert RUNS == [24]
  # A sequence takes it first when it supports the call.
  jattn.dot_product_attention(q, k, v, implementation=(NAME, "chunked"))
  assert len(RUNS) >= 2


def test_refused_with_its_reason(toy):
  q, k, v = _inputs()
  with pytest.raises(
    NotImplementedError, match=f"implementation='{NAME}' does not support a mask: the float64 host"
  ):
    jattn.dot_product_attention(q, k, v, is_causal=True, implementation=NAME)
  assert RUNS == []


def test_fallen_through(toy):
  q, k, v = _inputs()
  with pytest.warns(UserWarning, match=f"fell through: implementation='{NAME}' does not support"):
    out = jattn.dot_product_attention(
      q, k, v, is_causal=True, implementation=(NAME, "chunked"), block_q=8, block_kv=8
    )
  want = jattn.dot_product_attention(
    q, k, v, is_causal=True, implementation="chunked", block_q=8, block_kv=8
  )
  np.testing.assert_array_equal(out, want)
  assert RUNS == []  # refused by `supports`, never run


def test_named_in_errors_and_refused_by_ring(toy):
  q, k, v = _inputs()
  with pytest.raises(ValueError, match=f"'{NAME}'"):
    jattn.dot_product_attention(q, k, v, implementation="no-such-kernel")
  with pytest.raises(
    NotImplementedError, match=f"cannot run '{NAME}' per shard pair.*not one of jattn's own kernels"
  ):
    _ring._ring_kernel(NAME)
  assert _ring._ring_kernel((NAME, "dense")) == "dense"


def test_gone_once_unregistered():
  q, k, v = _inputs()
  _registry.register(_registry.Backend(NAME, _run, supports=_supports))
  _registry.unregister(NAME)
  with pytest.raises(ValueError, match="implementation"):
    jattn.dot_product_attention(q, k, v, implementation=NAME)


def test_the_bound_call_is_a_pytree():
  # Arrays are its leaves and its static description the tree's metadata, so a bound call
  # crosses jit as an argument and a backend runs on it there.
  from jattn import _call, _dispatch

  q, k, v = _inputs()
  opts, _ = _call.options(
    _call.Keywords(
      scale=None,
      is_causal=True,
      local_window_size=None,
      logits_soft_cap=None,
      dropout_rate=0.0,
      dropout_rng=None,
      dropout_broadcast=False,
      implementation="chunked",
      block_q=8,
      block_kv=8,
      schedule=None,
      step_width=None,
      return_residual=False,
      score_mod=None,
    )
  )
  call = _call.bind(_call.Given(q, k, v, sinks=jnp.zeros(4)), opts)
  leaves, tree = jax.tree.flatten(call)
  assert all(hasattr(x, "shape") for x in leaves)
  assert jax.tree.unflatten(tree, leaves).static == call.static
  out, _, max_logits = jax.jit(_dispatch.run)(call)
  assert max_logits is None  # the call did not ask for them
  want = jattn.dot_product_attention(
    q, k, v, is_causal=True, implementation="chunked", block_q=8, block_kv=8, sinks=jnp.zeros(4)
  )
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
