"""masks.selected_blocks: each query token's chosen key blocks per KV head (NSA, MoBA; DSA at
block size 1).

Its evaluation is the definition built index by index; its block summary is EMPTY exactly
where no query of a block chose a key of it (ragged grids too); it combines with the other
masks; it cuts to a device's examples and heads; attention with it (GQA, causal, lengths,
sinks, bias; dense and chunked in both schedules) equals the float64 reference under the
equivalent boolean mask, forward and gradients, float32 and bfloat16; known bad indices are
ValueErrors naming the argument; traced ones never reach another row's keys."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from selections import by_hand, f64_attention, indices

import jattn
from jattn import masks as M

B, N, H = 2, 4, 8
IMPLS = {
  "dense": dict(implementation="dense"),
  "chunked": dict(implementation="chunked", schedule="serial", block_q=16, block_kv=8),
  "parallel": dict(
    implementation="chunked", schedule="parallel", step_width=3, block_q=16, block_kv=8
  ),
}


def _dense(mask, Bm, T, S):
  out = mask.evaluate(jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32), (Bm, N, T, S))
  return np.broadcast_to(np.asarray(out), (Bm, N, T, S))


@pytest.mark.parametrize(
  "K, n, block, T, S", [(2, 3, 4, 29, 37), (1, 5, 1, 21, 17), (4, 2, 16, 33, 50)]
)
def test_evaluation_is_the_definition_and_empty_blocks_are_exactly_the_unchosen(K, n, block, T, S):
  idx = indices(np.random.default_rng(K + n), B, T, K, n, S, block)
  mask = M.selected_blocks(jnp.asarray(idx), block)
  want = by_hand(idx, block, N, T, S)
  np.testing.assert_array_equal(_dense(mask, B, T, S), want)
  for bq, bk in ((8, 8), (16, 5), (7, 13)):
    grid = M.BlockGrid(T, S, bq, bk)
    st = np.broadcast_to(
      np.asarray(jax.jit(lambda grid=grid: mask.block_states(grid, (B, N, T, S)))()),
      (B, N, grid.num_q_blocks, grid.num_kv_blocks),
    )
    for i, j in itertools.product(range(grid.num_q_blocks), range(grid.num_kv_blocks)):
      none = ~want[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any(axis=(2, 3))
      np.testing.assert_array_equal(st[..., i, j] == M.EMPTY, none, err_msg=f"block {(i, j)}")
      assert not np.any(st[..., i, j] == M.FULL)


def test_combinations_and_a_part_of_the_heads_and_examples():
  T = S = 24
  idx = indices(np.random.default_rng(1), B, T, 2, 3, S, 4)
  sel = M.selected_blocks(jnp.asarray(idx), 4)
  want = by_hand(idx, 4, N, T, S)
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  lens = M.lengths(jnp.asarray([20, 24]), jnp.asarray([11, 24]))
  lens_want = np.stack([(t < 20) & (s < 11), (t < 24) & (s < 24)])[:, None]
  for mask, w in (
    (sel & M.causal(), want & (s <= t)),
    (sel | M.local_window(2, 0), want | ((s <= t) & (s >= t - 2))),
    (sel & lens, want & lens_want),
  ):
    np.testing.assert_array_equal(_dense(mask, B, T, S), np.broadcast_to(w, (B, N, T, S)))
  part = M.take_part(sel, 1, 1, 2, 2, (B, N, T, S))  # example 1, heads 2-3 (KV head 1)
  got = part.evaluate(jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32), (1, 2, T, S))
  np.testing.assert_array_equal(np.broadcast_to(got, (1, 2, T, S)), want[1:2, 2:4])
  assert M.can_take_part(sel) and M.is_position_based(sel)


# The 16-bit rule of tests/properties/test_precision16.py: the error against float64 within a
# small factor of the error of rounding the exact answer to the dtype. The output keeps its 1.5x.
# Gradients get 3x here: with a handful of keys per row, dS = P * (dP - rowsum(P * dP)) cancels
# between a few large probabilities, and dS is rounded to the input dtype for the dQ and dK
# matmuls (as in FlashAttention); measured 1.4-2.9x on dense (autodiff) and chunked alike at
# n = 4 tokens per row, 1.4-1.9x at n = 16, against 1.75x allowed for dense rows.
FORWARD, GRADIENTS = 1.5, 3.0


@pytest.mark.parametrize(
  "impl, dtype, K, block",
  [
    ("dense", jnp.float32, 2, 4),
    ("chunked", jnp.float32, 2, 4),
    ("parallel", jnp.float32, 1, 1),
    ("chunked", jnp.bfloat16, 1, 1),
    ("dense", jnp.bfloat16, 2, 8),
  ],
)
def test_attention_equals_float64_under_the_equivalent_boolean_mask(impl, dtype, K, block):
  T = S = 40
  rng = np.random.default_rng(11)
  x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)
  q, k, v, do = x(B, T, N, H), x(B, S, K, H), x(B, S, K, H), x(B, T, N, H)
  bias = x(B, N, T, S)
  sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
  idx = indices(rng, B, T, K, 4, S, block)
  kv_len = np.array([S, 29])
  visible = ref.visible_mask(B, N, T, S, mask=by_hand(idx, block, N, T, S), causal="top_left")
  visible &= ref.visible_mask(B, N, T, S, kv_lengths=kv_len)

  def f(q, k, v, bias, sinks):
    return jattn.dot_product_attention(
      q,
      k,
      v,
      bias,
      mask=M.selected_blocks(idx, block),
      is_causal=True,
      key_value_seq_lengths=jnp.asarray(kv_len),
      sinks=sinks,
      **IMPLS[impl],
    )

  out, pull = jax.vjp(f, q, k, v, bias, sinks)
  got = dict(zip(("out", "dq", "dk", "dv", "dbias", "dsinks"), (out, *pull(do))))
  want_out, _, want = ref.attention_vjp(q, k, v, do, visible=visible, bias=bias, sinks=sinks)
  want["out"] = want_out
  assert not np.isnan(np.asarray(out, np.float32)).any()
  for name, g in got.items():
    if dtype == jnp.float32:
      np.testing.assert_allclose(g, want[name], atol=5e-5, rtol=5e-5, err_msg=name)
      continue
    rounding = ref.rel_error(ref.round_to_dtype(want[name], dtype), want[name])
    err = ref.rel_error(g, want[name])
    factor = FORWARD if name == "out" else GRADIENTS
    assert err <= factor * max(rounding, 1e-30), (
      f"{name}: error {err:.3e} is {err / rounding:.2f}x the rounding error {rounding:.3e}"
    )


def test_a_row_that_selects_nothing_outputs_zero_and_gradients_stay_finite():
  T = 16
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.standard_normal((1, T, N, H)), jnp.float32) for _ in range(3))
  idx = np.full((1, T, 1, 2), -1, np.int32)
  idx[0, ::2, 0, 0] = 1  # odd rows choose nothing
  for impl in ("dense", "chunked"):
    f = lambda q, k, v, impl=impl: jattn.dot_product_attention(
      q, k, v, mask=M.selected_blocks(idx, 4), implementation=impl
    )
    out = f(q, k, v)
    np.testing.assert_array_equal(np.asarray(out)[0, 1::2], 0.0)
    grads = jax.grad(lambda q, k, v, f=f: f(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize(
  "idx, block, words",
  [
    ([[[[0, 5]]]], 4, "a key block in [0, 4) (S=16, block_size=4), got a row of indices[0, 0, 0]"),
    ([[[[0, -2]]]], 4, "holding -2"),
    ([[[[3, 3]]]], 4, "must not repeat a block within a row, got indices[0, 0, 0] holding block 3"),
    ([[[[0]]], [[[1]]]], 4, "indices must be (B, T, K, n) with B=1 (or 1) and T=1"),
    ([[[[0], [1], [2]]]], 4, "K=3 (axis 2) must divide the query heads N=4"),
  ],
)
def test_known_bad_indices_are_value_errors_naming_the_argument(idx, block, words):
  q = jnp.ones((1, 1, N, H))
  kv = jnp.ones((1, 16, 2, H))
  with pytest.raises(ValueError) as e:
    jattn.dot_product_attention(q, kv, kv, mask=M.selected_blocks(np.asarray(idx), block))
  assert words in str(e.value) and "masks.selected_blocks" in str(e.value), str(e.value)


def test_malformed_selections_are_named_where_they_are_built():
  with pytest.raises(TypeError, match="masks.selected_blocks: indices must be an integer array"):
    M.selected_blocks(np.zeros((1, 2, 1, 1)))
  with pytest.raises(ValueError, match=r"must be \(B, T, K, n\), got shape \(2, 1\)"):
    M.selected_blocks(np.zeros((2, 1), np.int32))
  with pytest.raises(ValueError, match="block_size"):
    M.selected_blocks(np.zeros((1, 2, 1, 1), np.int32), 0)


def test_traced_indices_out_of_range_select_nothing_and_never_another_rows_keys():
  T = S = 8
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.standard_normal((2, T, N, H)), jnp.float32) for _ in range(3))
  idx = np.zeros((2, T, 1, 2), np.int32)
  idx[..., 1] = 1
  idx[1, :, 0, 1] = 99  # out of range: example 1 sees block 0 only
  idx[0, 3, 0, :] = [-7, 0]  # a negative one other than -1: nothing
  f = jax.jit(lambda i: jattn.dot_product_attention(q, k, v, mask=M.selected_blocks(i, 4)))
  want_vis = np.zeros((2, N, T, S), bool)
  want_vis[0, :, :, :8] = True
  want_vis[1, :, :, :4] = True
  want_vis[0, :, 3, 4:] = False
  want, _, _ = ref.attention(q, k, v, visible=want_vis)
  np.testing.assert_allclose(f(jnp.asarray(idx)), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("impl, block", [("dense", 1), ("chunked", 4)])
def test_forward_mode_and_the_bias_gradient_equal_float64(impl, block):
  # jax.jvp in q, k, v and the bias at once, and the bias's gradient, through the mask path
  # (dense: autodiff; chunked: its own tangent rule), with causal and key lengths.
  T = S = 24
  K = 2
  rng = np.random.default_rng(9)
  x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  args = (x(B, T, N, H), x(B, S, K, H), x(B, S, K, H), x(B, N, T, S))
  tangents = tuple(x(*a.shape) for a in args)
  idx = indices(rng, B, T, K, 3, S, block)
  kv_len = np.array([S, 17])
  visible = by_hand(idx, block, N, T, S) & ref.visible_mask(
    B, N, T, S, causal="top_left", kv_lengths=kv_len
  )
  f = lambda q, k, v, b: jattn.dot_product_attention(
    q,
    k,
    v,
    b,
    mask=M.selected_blocks(idx, block),
    is_causal=True,
    key_value_seq_lengths=jnp.asarray(kv_len),
    **IMPLS[impl],
  )
  out, tangent = jax.jvp(f, args, tangents)
  dbias = jax.grad(lambda b: (f(*args[:3], b) ** 2).sum())(args[3])
  with jax.enable_x64(True):
    f64 = lambda t: tuple(jnp.asarray(np.asarray(a, np.float64)) for a in t)
    g = lambda q, k, v, b: f64_attention(q, k, v, b, jnp.asarray(visible))
    want_out, want_tangent = jax.jvp(g, f64(args), f64(tangents))
    want_dbias = jax.grad(lambda b: (g(*f64(args[:3]), b) ** 2).sum())(f64(args)[3])
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(tangent, want_tangent, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(dbias, want_dbias, atol=1e-4, rtol=1e-4)
