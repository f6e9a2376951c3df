"""jattn's Pallas GPU (Triton) flash attention (`jattn._backends.pallas_gpu`, implementation="pallas_gpu")
against the float64 reference, forward and gradients.

The kernels run here in Pallas's interpret mode (`jattn._lowering.gpu_interpret_mode`): the very
kernels a GPU gets, their grids walked on the CPU (slowly: the shapes are small). Lengths are
not multiples of the blocks, so padding is always in play; every case has several query and key
blocks, and GQA (or MQA) groups. The lowering for CUDA (Pallas to Triton) is made from this CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from accelerators import abstract_gpu

import jattn
from jattn import _lowering

B, N = 2, 4
BLOCKS = dict(block_q=16, block_kv=32)
TRITON = "__gpu$xla.gpu.triton"


def _inputs(T, S, K, H, Hv=None, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, Hv or H), (B, T, N, Hv or H), (B, T, N))
  q, k, v, dout, dlse = (rng.standard_normal(s) for s in shapes)
  cast = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
  # The 16-bit inputs' exact values, for the reference.
  return [jnp.asarray(x, dtype) for x in (q, k, v, dout)] + [jnp.asarray(dlse, jnp.float32)], [
    cast(x) for x in (q, k, v, dout)
  ] + [dlse]


def _kernel(args, sinks, kw):
  """(out, lse, (dq, dk, dv, dsinks)) of the kernel, cotangents given for out and lse."""
  q, k, v, dout, dlse = args

  def f(q, k, v, sinks):
    return jattn.dot_product_attention(
      q, k, v, sinks=sinks, implementation="pallas_gpu", return_residual=True, **BLOCKS, **kw
    )

  with _lowering.gpu_interpret_mode():
    (out, lse), pull = jax.vjp(f, q, k, v, sinks)
    grads = pull((dout, dlse.astype(lse.dtype)))
  return out, lse, grads


def _reference(exact, T, S, K, sinks, kw):
  q, k, v, dout, dlse = exact
  mask_kw = dict(
    causal=kw.get("is_causal") if kw.get("is_causal") is not True else "top_left",
    window=kw.get("local_window_size"),
    q_lengths=kw.get("query_seq_lengths"),
    kv_lengths=kw.get("key_value_seq_lengths"),
    q_seg=kw.get("q_segment_ids"),
    kv_seg=kw.get("kv_segment_ids"),
  )
  mask_kw = {
    n: None if x is None else (np.asarray(x) if n != "causal" and n != "window" else x)
    for n, x in mask_kw.items()
  }
  vis = ref.visible_mask(B, N, T, S, **mask_kw)
  out, lse, g = ref.attention_vjp(
    q,
    k,
    v,
    dout,
    visible=vis,
    soft_cap=kw.get("logits_soft_cap"),
    sinks=None if sinks is None else np.asarray(sinks),
    dlse=dlse,
  )
  return out, lse, g


def _close(got, want, tol, what):
  got = np.asarray(got, np.float64)
  err = np.abs(got - want).max()
  assert err <= tol * max(1.0, np.abs(want).max()), (what, err)


# Band edges that fall on block edges (S - T = 17, a left window of 33 with blocks 16 and 32):
# a loop bound one block short would drop keys there. The window is wide enough for blocks
# inside it (unmasked) between the blocks its edges cross.
CASES = {
  "causal-top-left": (72, 72, 2, dict(is_causal=True)),
  "causal-bottom-right": (40, 57, 2, dict(is_causal="bottom_right")),
  "window-both-sides": (72, 72, 2, dict(local_window_size=(33, 20))),
  "causal-window-mqa": (72, 72, 1, dict(is_causal=True, local_window_size=(20, 0))),
  "lengths-empty-rows": (
    72,
    72,
    2,
    dict(
      query_seq_lengths=np.array([72, 30], np.int32),
      key_value_seq_lengths=np.array([50, 0], np.int32),
    ),
  ),
  "segment-ids": (
    72,
    72,
    2,
    dict(
      q_segment_ids=np.repeat(np.array([[0, 1, 2], [0, 0, 5]]), 24, axis=1).astype(np.int32),
      kv_segment_ids=np.repeat(np.array([[0, 1, 3], [0, 0, 5]]), 24, axis=1).astype(np.int32),
      sinks=True,
    ),
  ),  # document 2 has no keys: rows with only the sink (output 0, lse = sink)
  "soft-cap-sinks": (72, 72, 2, dict(is_causal=True, logits_soft_cap=2.0, sinks=True)),
  # S a multiple of the key block and no lengths or segment ids: the tiles compare no ids, and
  # those inside the band are not masked at all; the first five rows see nothing.
  "unpadded-keys-band": (72, 64, 2, dict(is_causal="bottom_right", local_window_size=(17, 3))),
  "unpadded-keys-mqa": (40, 64, 1, dict()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradients_match_the_reference(case):
  T, S, K, kw = CASES[case]
  kw = dict(kw)
  sinks = jnp.linspace(-1.0, 1.5, N, dtype=jnp.float32) if kw.pop("sinks", False) else None
  args, exact = _inputs(T, S, K, 32, seed=len(case))
  out, lse, (dq, dk, dv, dsinks) = _kernel(args, sinks, kw)
  want, want_lse, g = _reference(exact, T, S, K, sinks, kw)
  _close(out, want, 1e-5, "out")
  seen = np.isfinite(want_lse)
  _close(np.where(seen, lse, 0.0), np.where(seen, want_lse, 0.0), 1e-5, "lse")
  # Rows that see nothing: output 0, lse far below any real one (jattn's NEG).
  assert (np.asarray(out)[~seen] == 0).all() and (np.asarray(lse)[~seen] < -1e30).all()
  for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
    _close(got, g[name], 1e-4, name)
  if sinks is not None:
    _close(dsinks, g["dsinks"], 1e-4, "dsinks")
  if case == "lengths-empty-rows":
    assert not seen[1].any() and (np.asarray(dq)[1] == 0).all()


def test_garbage_past_the_lengths_stays_out():
  # inf and NaN in keys, values and queries that the lengths hide: the output and gradients
  # are those of clean inputs (hidden positions are zeroed before the matmuls), with zero
  # gradients there.
  T = S = 40
  kw = dict(
    query_seq_lengths=np.array([33, 40], np.int32),
    key_value_seq_lengths=np.array([21, 40], np.int32),
    is_causal=True,
  )
  args, _ = _inputs(T, S, 2, 16, seed=5)
  clean = _kernel(args, None, kw)
  q, k, v = (np.array(x) for x in args[:3])
  q[0, 33:], k[0, 21:], v[0, 21:] = np.nan, np.inf, np.nan
  dirty = _kernel([jnp.asarray(x) for x in (q, k, v)] + args[3:], None, kw)
  for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty)):
    np.testing.assert_array_equal(a, b)
  dq, dk = dirty[2][:2]
  assert (np.asarray(dq)[0, 33:] == 0).all() and (np.asarray(dk)[0, 21:] == 0).all()


def test_under_vmap_equals_dense():
  # A leading axis vmapped over the call (the kernels' grids gain a dimension), forward and
  # gradient, against jattn's dense path.
  q = jnp.asarray(np.random.default_rng(2).standard_normal((3, B, 20, 2, 16)), jnp.float32)

  def loss(impl):
    f = lambda q: jattn.dot_product_attention(
      q, q, q, is_causal=True, logits_soft_cap=3.0, implementation=impl
    )
    return lambda q: (jax.vmap(f)(q) ** 2).sum()

  with _lowering.gpu_interpret_mode():
    got = jax.value_and_grad(loss("pallas_gpu"))(q)
  want = jax.value_and_grad(loss("dense"))(q)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_value_head_size_of_its_own():
  # MLA-like: value head size 16 under key head size 32.
  T = S = 40
  args, exact = _inputs(T, S, 2, 32, Hv=16, seed=3)
  out, _lse, (dq, dk, dv, _) = _kernel(args, None, dict(is_causal=True))
  want, _, g = _reference(exact, T, S, 2, None, dict(is_causal=True))
  assert out.shape == (B, T, N, 16)
  _close(out, want, 1e-5, "out")
  for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
    _close(got, g[name], 1e-4, name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_within_rounding_of_the_exact_answer(dtype):
  # 16-bit inputs, float32 statistics and accumulation: the error against float64 (on the
  # 16-bit inputs' exact values) stays within a small factor of rounding the exact answer to
  # the input dtype; gradients likewise, against rounding the exact gradient.
  T = S = 72
  kw = dict(is_causal=True, logits_soft_cap=5.0)
  sinks = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32)
  args, exact = _inputs(T, S, 2, 32, seed=7, dtype=dtype)
  out, _, (dq, dk, dv, _) = _kernel(args, sinks, kw)
  assert out.dtype == dq.dtype == dk.dtype == dtype
  want, _, g = _reference(exact, T, S, 2, sinks, kw)
  for name, got, exact_value, factor in (
    ("out", out, want, 2),
    ("dq", dq, g["dq"], 4),
    ("dk", dk, g["dk"], 4),
    ("dv", dv, g["dv"], 4),
  ):
    err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - exact_value).max()
    rounding = np.abs(
      np.asarray(jnp.asarray(exact_value, dtype).astype(jnp.float32), np.float64) - exact_value
    ).max()
    assert err <= factor * rounding, (name, err, rounding)


@pytest.mark.parametrize(
  "kw,words",
  [
    (dict(bias=np.zeros((1, N, 40, 40), np.float32)), "pallas_gpu.*bias"),
    (dict(mask=np.tril(np.ones((40, 40), bool))), "pallas_gpu.*mask"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "pallas_gpu.*dropout"),
    (dict(H=24), "pallas_gpu.*H=24"),
    (dict(block_q=24), "pallas_gpu.*block_q=24"),
  ],
)
def test_what_it_cannot_take_is_refused_by_name(kw, words):
  kw = dict(kw)
  H = kw.pop("H", 16)
  q = jnp.ones((B, 40, N, H))
  k = v = jnp.ones((B, 40, 2, H))
  with _lowering.gpu_interpret_mode(), pytest.raises(NotImplementedError, match=words):
    jattn.dot_product_attention(q, k, v, implementation="pallas_gpu", **kw)


def test_a_gradient_of_the_gradient_is_refused_by_name():
  q = jnp.ones((1, 16, 2, 16))
  f = lambda q: jattn.dot_product_attention(q, q, q, implementation="pallas_gpu").sum()
  with (
    _lowering.gpu_interpret_mode(),
    pytest.raises(NotImplementedError, match="higher-order AD.*pallas_gpu"),
  ):
    jax.grad(lambda q: (jax.grad(f)(q) ** 2).sum())(q)


def test_lowered_for_cuda_it_is_three_triton_kernels():
  # Forward, dK/dV and dQ, lowered from this CPU (Pallas to Triton), with every option at once,
  # a group of 3 query heads per key/value head and padded lengths (48, 80) that are not powers
  # of two (the kernels' whole-sequence blocks).
  T, S, N3, K = 40, 72, 6, 2
  sds = jax.ShapeDtypeStruct

  def loss(q, k, v, sinks):
    out, lse = jattn.dot_product_attention(
      q,
      k,
      v,
      is_causal="bottom_right",
      local_window_size=(20, 0),
      logits_soft_cap=3.0,
      sinks=sinks,
      q_segment_ids=jnp.zeros((B, T), jnp.int32),
      kv_segment_ids=jnp.zeros((B, S), jnp.int32),
      key_value_seq_lengths=jnp.array([3, 50]),
      implementation="pallas_gpu",
      return_residual=True,
      block_q=16,
      block_kv=16,
    )
    return out.astype(jnp.float32).sum() + lse.astype(jnp.float32).sum()

  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    args = (
      sds((B, T, N3, 32), dtype),
      sds((B, S, K, 32), dtype),
      sds((B, S, K, 16), dtype),
      sds((N3,), jnp.float32),
    )
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    with abstract_gpu():  # jax 0.12's Triton lowering asks which GPU, even from a CPU
      text = grad.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON) == 3, dtype
  # Lowered for a CPU outside interpret mode: an error naming the way out.
  with pytest.raises(NotImplementedError, match="pallas_gpu.*interpret_mode"):
    jax.jit(loss).trace(*args).lower(lowering_platforms=("cpu",))
  # A sequence falls through to the next implementation where it lowers for another platform.
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, is_causal=True, implementation=("pallas_gpu", "chunked")
  )
  args = args[:2] + (sds((B, S, K, 32), jnp.float32),)
  assert TRITON not in jax.jit(f).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
  with abstract_gpu():
    assert TRITON in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
