"""merge_attention's gradients against the float64 reference (tests/support/reference.py).

Attention over disjoint key ranges, merged, is attention over all the keys; so the gradient with
respect to q, k and v *through* the merge (through each part's output and its log-sum-exp, which
sets the part's weight) must equal the reference's dq, dk, dv over the whole key set. Forward
checks, closed forms and errors of merge_attention are in tests/parallel/test_ring.py, and so is the
split-KV decoding recipe of docs/ring.md, run on 4 devices
(test_split_kv_decoding_recipe_from_the_docs).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jattn
from jattn._tile import NEG

B, T, S, N, K, H = 2, 6, 13, 4, 2, 8
RANGES = ((0, 5), (5, 6), (6, 13))  # the middle part is a single key
TOL = 2e-5  # float32 against float64, relative to max(1, max |reference|)


def _inputs():
  rng = np.random.default_rng(7)
  q, k, v, do = (
    rng.standard_normal(shape).astype(np.float32)
    for shape in [(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)]
  )
  vis = ref.visible_mask(B, N, T, S, causal="bottom_right")
  vis[1, :, 2, :] = False  # a row that attends to nothing anywhere
  vis[0, 1, 4, 6:] = False  # a row (one head) that sees keys in the first parts only
  return q, k, v, do, vis


def _part(q, k, v, vis, empty_lse):
  """Attention over one key range with a differentiable lse, in float32 jax.numpy: the merge on
  its own, apart from jattn's kernels (see test_merge_of_jattn_parts_* below). A row with
  nothing visible here gets out 0 and lse ``empty_lse``."""
  G = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, kr) * (1.0 / float(np.sqrt(q.shape[-1])))
  s = jnp.where(vis, s, -jnp.inf)
  m = s.max(axis=-1, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  e = jnp.where(vis, jnp.exp(s - m), 0.0)
  den = e.sum(axis=-1, keepdims=True)
  ok = den > 0
  p = jnp.where(ok, e / jnp.where(ok, den, 1.0), 0.0)
  lse = jnp.where(ok, jnp.log(jnp.where(ok, den, 1.0)) + m, empty_lse)[..., 0]
  return jnp.einsum("bnts,bsnh->btnh", p, vr), jnp.transpose(lse, (0, 2, 1))


def _close(name, got, want):
  want = np.asarray(want, np.float64)
  err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
  assert err <= TOL * max(1.0, float(np.abs(want).max())), f"{name}: max error {err}"


@pytest.mark.parametrize("empty_lse", [-np.inf, NEG], ids=["empty_is_-inf", "empty_is_sentinel"])
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_merge_gradients_equal_reference(nested, empty_lse):
  """Three key ranges merged at once (flat), or the first two merged and the result merged with
  the third (nested: the merged lse then sets a weight, so its gradient is checked too), equal
  attention over all keys: forward, lse, and dq, dk, dv of sum(out * dout). Rows that see nothing
  in some ranges, and a row that sees nothing anywhere (out 0, gradients 0), included."""
  q, k, v, do, vis = _inputs()
  visj = jnp.asarray(vis)
  assert (~vis[..., 5:6]).any() and vis[..., 5:6].any()  # the one-key part is empty for some rows

  def merged(q, k, v):
    parts = [_part(q, k[:, a:b], v[:, a:b], visj[..., a:b], empty_lse) for a, b in RANGES]
    if nested:
      first = jattn.merge_attention([parts[0][0], parts[1][0]], [parts[0][1], parts[1][1]])
      parts = [first, parts[2]]
    return jattn.merge_attention([p[0] for p in parts], [p[1] for p in parts])

  def out_and_grads(q, k, v, do):  # one compiled program, not one per operation
    (out, lse), pull = jax.vjp(merged, q, k, v)
    return out, lse, pull((do, jnp.zeros_like(lse)))

  out, lse, (dq, dk, dv) = jax.jit(out_and_grads)(q, k, v, do)
  want, want_lse, cache = ref.attention(q, k, v, visible=vis)
  wdq, wdk, wdv, _, _ = ref.grads(cache, do)
  _close("out", out, want)
  live = np.isfinite(want_lse)
  assert (~live).any()
  _close("lse", np.asarray(lse)[live], want_lse[live])
  assert np.all(np.asarray(lse)[~live] < -1e30)
  np.testing.assert_array_equal(np.asarray(out)[1, 2], 0.0)
  for name, got, exp in (("dq", dq, wdq), ("dk", dk, wdk), ("dv", dv, wdv)):
    assert np.isfinite(np.asarray(got)).all(), name
    _close(name, got, exp)
  np.testing.assert_array_equal(np.asarray(dq)[1, 2], 0.0)


def test_merge_gradient_with_respect_to_lse_closed_form():
  """d out / d lse_i = w_i (out_i - out) and d lse / d lse_i = w_i, w_i = exp(lse_i - lse), for
  cotangents on both outputs -- checked against float64 NumPy, with a part of weight 0."""
  rng = np.random.default_rng(3)
  o = rng.standard_normal((3, 4, 5)).astype(np.float32)  # 3 parts, 4 rows, H = 5
  l = rng.standard_normal((3, 4)).astype(np.float32) * 3
  l[2, 1] = -np.inf
  d_out = rng.standard_normal((4, 5)).astype(np.float32)
  d_lse = rng.standard_normal(4).astype(np.float32)
  _, pull = jax.vjp(jattn.merge_attention, jnp.asarray(o), jnp.asarray(l))
  g_o, g_l = pull((jnp.asarray(d_out), jnp.asarray(d_lse)))
  o64, l64 = o.astype(np.float64), l.astype(np.float64)
  lse = np.log(np.exp(l64).sum(0))
  w = np.exp(l64 - lse)  # (3, 4)
  out = (w[..., None] * o64).sum(0)
  want_g_o = w[..., None] * d_out
  want_g_l = w * (((o64 - out) * d_out).sum(-1) + d_lse)
  np.testing.assert_allclose(g_o, want_g_o, rtol=0, atol=1e-5)
  np.testing.assert_allclose(g_l, want_g_l, rtol=0, atol=1e-5)
  assert g_l[2, 1] == 0.0


# Every implementation that runs here: splash in Pallas's TPU interpret mode (its static NumPy
# mask), jattn's kernels in both schedules.
PART_IMPLS = {
  "dense": dict(implementation="dense"),
  "chunked": dict(implementation="chunked", schedule="serial", block_q=4, block_kv=2),
  "parallel": dict(implementation="chunked", schedule="parallel", block_q=4, block_kv=2),
  "None": dict(implementation=None),
  "splash": dict(implementation="splash"),
}


def _jattn_parts(q, k, v, vis, impl):
  kw = PART_IMPLS[impl]
  as_mask = (lambda m: np.asarray(m)) if impl == "splash" else jnp.asarray
  return [
    jattn.dot_product_attention(
      q, k[:, a:b], v[:, a:b], mask=as_mask(vis[..., a:b]), return_residual=True, **kw
    )
    for a, b in RANGES
  ]


def _merged_jattn_parts(q, k, v, vis, impl):
  parts = _jattn_parts(q, k, v, vis, impl)
  return jattn.merge_attention([p[0] for p in parts], [p[1] for p in parts])[0]


def _interpret(impl):
  if impl != "splash":
    return contextlib.nullcontext()
  from jax.experimental.pallas import tpu as pltpu

  return pltpu.force_tpu_interpret_mode()


@pytest.mark.parametrize("impl", list(PART_IMPLS))
def test_merge_of_jattn_parts_equals_one_call(impl):
  """Parts from dot_product_attention(return_residual=True), merged: forward and dq, dk, dv
  through the merge (through each part's lse, which sets its weight) equal the reference over
  all the keys. The residual lse carries its gradient on every implementation."""
  q, k, v, do, vis = _inputs()
  if impl == "splash":
    # One kernel serves the batch: a mask shared by examples and heads, with an empty row.
    vis = np.broadcast_to(vis[:1, :1], vis.shape).copy()
    vis[..., 2, :] = False

  def out_and_grads(q, k, v, do):  # the parts, the merge and their gradients: one program
    out, pull = jax.vjp(lambda q, k, v: _merged_jattn_parts(q, k, v, vis, impl), q, k, v)
    return out, pull(do)

  with _interpret(impl):
    out, (dq, dk, dv) = jax.jit(out_and_grads)(q, k, v, do)
  want, _, cache = ref.attention(q, k, v, visible=vis)
  wdq, wdk, wdv, _, _ = ref.grads(cache, do)
  tol = 5e-3 if impl == "splash" else None  # splash's kernels round P to the input dtype
  for name, got, exp in (("out", out, want), ("dq", dq, wdq), ("dk", dk, wdk), ("dv", dv, wdv)):
    assert np.isfinite(np.asarray(got)).all(), name
    if tol is None:
      _close(name, got, exp)
    else:
      np.testing.assert_allclose(np.asarray(got), exp, atol=tol, rtol=0, err_msg=name)


@pytest.mark.parametrize("impl", ["dense", "chunked", "parallel"])
def test_residual_lse_gradient_equals_reference(impl):
  """The gradient of sum(lse * w) alone (no output cotangent) equals the float64 reference's:
  d lse / d logits = P, with sinks (a row that sees no key still sees its sink)."""
  q, k, v, _, vis = _inputs()
  sinks = np.linspace(-1.0, 1.0, N).astype(np.float32)
  w = np.random.default_rng(5).standard_normal((B, T, N)).astype(np.float32)

  def f(q, k, v, sinks):
    _, lse = jattn.dot_product_attention(
      q, k, v, mask=jnp.asarray(vis), sinks=sinks, return_residual=True, **PART_IMPLS[impl]
    )
    return jnp.sum(jnp.where(lse > -1e30, lse, 0.0) * w)

  got = jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, jnp.asarray(sinks))
  _, _, g = ref.attention_vjp(q, k, v, np.zeros_like(q), visible=vis, sinks=sinks, dlse=w)
  want = (g["dq"], g["dk"], g["dv"], g["dsinks"])
  for name, gr, wg in zip(("dq", "dk", "dv", "dsinks"), got, want):
    _close(name, gr, wg)


def test_cudnn_lse_of_the_call_equals_reference():
  """The cuDNN path's lse gradient comes from a plain-JAX lse of the call (jax.nn's cuDNN call
  returns its lse without one): that lse, with a bias, a mask array, causal, a window and
  lengths, equals the reference's (cuDNN itself needs a GPU)."""
  from jattn._backends import cudnn as _cudnn

  q, k, v, _, _ = _inputs()
  rng = np.random.default_rng(1)
  bias = rng.standard_normal((B, N, T, S)).astype(np.float32)
  mask = rng.random((B, 1, T, S)) < 0.8
  q_len, kv_len = np.array([T, 3]), np.array([S, 9])
  got = _cudnn._lse(
    q,
    k,
    bias,
    jnp.asarray(mask),
    jnp.asarray(q_len),
    jnp.asarray(kv_len),
    _cudnn.JaxNnOptions(scale=0.3, causal="top_left", window=(4, 0)),
  )
  vis = ref.visible_mask(
    B, N, T, S, mask=mask, causal="top_left", window=(4, 0), q_lengths=q_len, kv_lengths=kv_len
  )
  _, want, _ = ref.attention(q, k, v, visible=vis, bias=bias, scale=0.3)
  live = np.isfinite(want)
  assert (~live).any() and live.any()
  _close("lse", np.asarray(got)[live], want[live])
  assert np.all(np.asarray(got)[~live] < -1e30)
