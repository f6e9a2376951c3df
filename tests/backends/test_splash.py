"""implementation="splash": JAX's Pallas TPU splash attention behind jattn's call.

The kernels run here in Pallas's TPU interpret mode (`force_tpu_interpret_mode`: the very
kernels a TPU compiles, executed step by step on the CPU), against the float64 reference,
forward and gradients. Interpret mode is slow (seconds per call), so each case combines
several features. The program lowered for "tpu" is checked for its fused kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from attention_cases import plain_low_precision
from jax.experimental.pallas import tpu as pltpu

import jattn
from jattn import masks as M

B, H = 2, 32


def _inputs(T, S, N, K, dtype=jnp.float32, seed=0):
  # Drawn by NumPy: jax.random would compile a program for every shape.
  rng = np.random.default_rng(seed)
  q, k, v, do = (
    jnp.asarray(rng.standard_normal(shape), jnp.float32)
    for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H))
  )
  sinks = jnp.linspace(-1.0, 1.5, N, dtype=jnp.float32)
  return [x.astype(dtype) for x in (q, k, v, do)] + [sinks]


def _positions(N, T, S):
  return np.arange(N)[:, None, None], np.arange(T)[None, :, None], np.arange(S)[None, None, :]


# Random keys hidden, a few whole key blocks hidden (skipped), the diagonal always visible.
_NUMPY_MASK = (np.random.default_rng(3).random((200, 300)) > 0.3) & (np.arange(300) // 128 != 1)
_NUMPY_MASK |= np.eye(200, 300, dtype=bool)

# Each case: shapes (T, S not multiples of 128, so both are padded to whole 128-blocks), jattn
# keywords, and the visible (T, S) positions (or None) written plainly for the reference.
CASES = {
  # GQA 2, causal top-left, sinks, and a NumPy boolean mask (static: splash builds its block
  # lists from it when the call is traced).
  "causal_gqa2_sinks_numpy_mask": dict(
    T=200,
    S=300,
    N=4,
    K=2,
    kw=dict(is_causal=True, mask=_NUMPY_MASK),
    sinks=True,
    vis=dict(causal="top_left"),
    mask=lambda h, q, k: _NUMPY_MASK,
  ),
  # GQA 4 (MQA-like groups), bottom-right causal with a window, soft cap.
  "bottom_right_window_softcap_gqa4": dict(
    T=140,
    S=290,
    N=4,
    K=1,
    kw=dict(is_causal="bottom_right", local_window_size=(70, 0), logits_soft_cap=4.0),
    vis=dict(causal="bottom_right", window=(70, 0)),
    soft_cap=4.0,
  ),
  # MHA (GQA 1), chunked-local & causal as a mask object, packed documents (segment ids).
  "chunked_local_causal_segments_mha": dict(
    T=260,
    S=260,
    N=2,
    K=2,
    kw=dict(mask=M.chunked_local(96) & M.causal()),
    mask=lambda h, q, k: (q // 96 == k // 96) & (k <= q),
    segments=True,
  ),
  # Prefix-LM, or a look-ahead of 5 for head 3 only (heads of one group with different
  # masks); lengths: example 0 has no keys at all (every row empty: 0, zero gradients),
  # example 1 padded queries (rows past the length: 0); NaN and inf at every hidden position.
  "prefix_lm_per_head_lengths_empty_rows": dict(
    T=150,
    S=170,
    N=4,
    K=2,
    kw=dict(mask=M.prefix_lm(40) | M.from_function(lambda b, h, q, k: (h == 3) & (k <= q + 5))),
    lengths=([150, 90], [0, 130]),
    garbage=True,
    mask=lambda h, q, k: (k < 40) | (k <= q) | ((h == 3) & (k <= q + 5)),
  ),
}


@pytest.mark.parametrize("case", CASES)
def test_splash_matches_reference(case):
  c = CASES[case]
  T, S, N, K = c["T"], c["S"], c["N"], c["K"]
  q, k, v, do, sinks = _inputs(T, S, N, K)
  kw = dict(c["kw"])
  rng = np.random.default_rng(1)
  q_seg = kv_seg = None
  if c.get("segments"):
    q_seg = np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32)
    kv_seg = q_seg.copy()
    kw.update(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
  q_len = kv_len = None
  if c.get("lengths"):
    q_len, kv_len = c["lengths"]
    kw.update(
      query_seq_lengths=jnp.asarray(q_len, jnp.int32),
      key_value_seq_lengths=jnp.asarray(kv_len, jnp.int32),
    )
  clean = (q, k, v)
  if c.get("garbage"):
    # NaN and inf where nothing sees them: keys and values past the lengths, queries past theirs
    # (the reference reads the clean arrays: hidden positions cannot matter).
    kv_hidden = np.arange(S)[None, :] >= np.asarray(kv_len)[:, None]  # (B, S)
    q_hidden = np.arange(T)[None, :] >= np.asarray(q_len)[:, None]
    k = jnp.where(kv_hidden[:, :, None, None], jnp.nan, k)
    v = jnp.where(kv_hidden[:, :, None, None], jnp.inf, v)
    q = jnp.where(q_hidden[:, :, None, None], jnp.nan, q)
  args = (q, k, v) + ((sinks,) if c.get("sinks") else ())

  def f(q, k, v, *s):
    return jattn.dot_product_attention(
      q, k, v, implementation="splash", block_q=128, block_kv=128, sinks=s[0] if s else None, **kw
    )

  with pltpu.force_tpu_interpret_mode():
    out, pull = jax.vjp(f, *args)
    grads = pull(do)

  mask = None if "mask" not in c else np.broadcast_to(c["mask"](*_positions(N, T, S)), (B, N, T, S))
  vis = ref.visible_mask(
    B,
    N,
    T,
    S,
    mask=mask,
    q_lengths=q_len,
    kv_lengths=kv_len,
    q_seg=q_seg,
    kv_seg=kv_seg,
    **c.get("vis", {}),
  )
  want, _, cache = ref.attention(
    *clean, visible=vis, soft_cap=c.get("soft_cap"), sinks=sinks if c.get("sinks") else None
  )
  want_grads = ref.grads(cache, np.asarray(do, np.float64))
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  names = ("dq", "dk", "dv") + (("dsinks",) if c.get("sinks") else ())
  wanted = want_grads[:3] + ((want_grads[4],) if c.get("sinks") else ())
  for name, got, w in zip(names, grads, wanted):
    np.testing.assert_allclose(got, w, rtol=2e-4, atol=2e-4, err_msg=name)
  empty = ~vis.any(-1).transpose(0, 2, 1)  # (B, T, N)
  if empty.any():  # exactly 0, and no gradient flows from them
    assert np.all(np.asarray(out)[empty] == 0)
    assert np.all(np.asarray(grads[0])[empty] == 0)


def test_splash_bfloat16_follows_the_flash_attention_rule():
  """bf16 (causal, GQA 2): the error against float64 is at most twice that of the plain dense
  bf16 computation, plus 1e-3, for the output and each gradient."""
  T = S = 192
  q, k, v, do, _ = _inputs(T, S, 4, 2, dtype=jnp.bfloat16)
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, is_causal=True, implementation="splash", block_q=128, block_kv=128
  )
  with pltpu.force_tpu_interpret_mode():
    out, pull = jax.vjp(f, q, k, v)
    grads = pull(do)
  base, pull_base = jax.vjp(lambda q, k, v: plain_low_precision(q, k, v, True), q, k, v)
  qq, kk, vv = (np.asarray(x, np.float64) for x in (q, k, v))
  want, _, cache = ref.attention(
    qq, kk, vv, visible=ref.visible_mask(B, 4, T, S, causal="top_left")
  )
  want_grads = ref.grads(cache, np.asarray(do, np.float64))[:3]
  err = lambda a, b: np.max(np.abs(np.asarray(a, np.float64) - b))
  assert out.dtype == jnp.bfloat16
  assert err(out, want) <= 2 * err(base, want) + 1e-3
  for got, plain, w in zip(grads, pull_base(do), want_grads):
    assert err(got, w) <= 2 * err(plain, w) + 1e-3


@pytest.mark.parametrize(
  "name, kw, dtype",
  [
    ("bias", dict(bias=jnp.zeros((1, 1, 8, 8))), jnp.float32),
    ("dropout", dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), jnp.float32),
    ("score_mod", dict(score_mod=lambda s, b, h, q, k: s), jnp.float32),
    ("float16", {}, jnp.float16),
    ("block_q", dict(block_q=100), jnp.float32),
    ("run-time arrays", dict(mask=jnp.ones((8, 8), bool)), jnp.float32),
  ],
)
def test_splash_refuses_what_it_cannot_do(name, kw, dtype):
  q = jnp.ones((1, 8, 2, 16), dtype)
  with pytest.raises(NotImplementedError, match=name):
    jattn.dot_product_attention(q, q, q, implementation="splash", **kw)


def test_splash_lowers_to_fused_tpu_kernels():
  """Forward+backward exported for "tpu" from this CPU: splash's forward and its two backward
  kernels are custom calls in the module (forward alone: one)."""
  q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True, implementation="splash")
  loss = lambda q, k, v: f(q, k, v).astype(jnp.float32).sum()
  fwd = jax.export.export(jax.jit(f), platforms=["tpu"])(q, kv, kv).mlir_module()
  both = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["tpu"])(
    q, kv, kv
  ).mlir_module()
  assert fwd.count("tpu_custom_call") == 1
  # The forward (with its log-sum-exp), the forward that splash's VJP recomputes, dq and dk/dv.
  assert both.count("tpu_custom_call") == 4


def test_splash_second_derivative_equals_dense():
  """A gradient of a gradient through splash (its kernels have no derivative of their own
  backward: jattn differentiates a plain-JAX twin of the kernels there)."""
  q, k, v, _, sinks = _inputs(136, 150, 4, 2)
  mask = M.causal() & M.local_window(60)

  def grad_sum(impl):
    f = lambda q, k, v, s: (
      jattn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        sinks=s,
        logits_soft_cap=5.0,
        implementation=impl,
        **({"block_q": 128, "block_kv": 128} if impl == "splash" else {}),
      )
      ** 2
    ).sum()
    return lambda *a: (jax.grad(f, argnums=(0, 1, 2, 3))(*a)[0] ** 2).sum()

  with pltpu.force_tpu_interpret_mode():
    got = jax.grad(grad_sum("splash"), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  want = jax.grad(grad_sum("dense"), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for name, a, b in zip(("q", "k", "v", "sinks"), got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def test_splash_under_an_explicit_mesh_runs_per_device_inside_a_shard_map():
  """Under an Explicit mesh the shardings are types, so splash (which XLA cannot partition) runs
  split over examples and heads inside a shard_map: here on a one-device mesh, which takes the
  same path (the 4-device programs, exported for a TPU, are checked in test_sharding; Pallas's
  interpret mode cannot run a kernel on several host devices at once). Results and gradients
  equal the call without a mesh. One block of 128 each way (the blocks' walk is the other
  tests'; in interpret mode each block pair costs)."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  T, S, N, K = 100, 120, 4, 2
  q, k, v, do, sinks = _inputs(T, S, N, K)
  lens = jnp.asarray([S, 0], jnp.int32)

  def f(q, k, v, sinks):
    return jattn.dot_product_attention(
      q,
      k,
      v,
      is_causal=True,
      key_value_seq_lengths=lens,
      sinks=sinks,
      implementation="splash",
      block_q=128,
      block_kv=128,
    )

  with pltpu.force_tpu_interpret_mode():
    out, pull = jax.vjp(f, q, k, v, sinks)
    want = (out,) + pull(do)
    mesh = jax.make_mesh((1, 1), ("d", "h"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
      put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
      args = [put(x, P("d", None, "h")) for x in (q, k, v)] + [put(sinks, P())]
      assert "shard_map" in str(jax.make_jaxpr(f)(*args))
      out, pull = jax.vjp(f, *args)
      got = (out,) + pull(put(do, P("d", None, "h")))
      got = jax.block_until_ready(got)
  assert tuple(got[0].sharding.spec)[:3] == ("d", None, "h")
  for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=name)
