"""jattn.dot_product_attention against the float64 reference and jax.nn, forward and gradients."""

import functools

import chex
import covering
import dropout_reference
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from attention_cases import IMPLS, TILE_IMPLS, inputs, plain_low_precision

import jattn
from jattn import _dropout


@functools.partial(jax.jit, static_argnames=("static", "make_mod"))
def _attention_vjp(q, k, v, bias, sinks, mod_args, arrays, do, *, static, make_mod):
  """jattn's (out, lse) and the gradients of every differentiable input for the output
  cotangent ``do``, in one compiled program (forward and backward: a program apart for each
  would compile longer). ``static``: the keywords' items; ``arrays``: the keywords given as
  arrays (lengths, segment ids, a boolean mask), run-time operands, so a call that differs
  from another only in their values reuses its program."""

  def f(q, k, v, bias, sinks, mod_args):
    extra = {} if make_mod is None else {"score_mod": make_mod(mod_args)}
    return jattn.dot_product_attention(
      q, k, v, bias, return_residual=True, sinks=sinks, **dict(static), **arrays, **extra
    )

  (out, lse), pull = jax.vjp(f, q, k, v, bias, sinks, mod_args)
  return out, lse, pull((do, jnp.zeros_like(lse)))


def _check(
  impl,
  *,
  B=2,
  T=37,
  S=45,
  N=4,
  K=2,
  H=16,
  mask=None,
  bias=None,
  causal=None,
  window=None,
  q_lengths=None,
  kv_lengths=None,
  segs=None,
  soft_cap=None,
  scale=None,
  sinks=None,
  score_mod=None,
  rtol=2e-5,
  atol=2e-5,
  jax_nn=False,
):
  """Forward, lse and all gradients of jattn against the float64 reference.

  ``score_mod`` is (make, args): ``make(args)`` is the score function, ``args`` the arrays it
  closes over; their gradients are checked too (against the autodiff reference).
  ``jax_nn``: the same call (the same compiled program) is also compared with
  jax.nn.dot_product_attention given the same arguments (`_check_jax_nn`).
  """
  q, k, v, do = inputs(B, T, S, N, K, H)
  static = dict(IMPLS[impl])
  arrays = {}  # run-time arguments: operands of the compiled program
  if causal is not None:
    static["is_causal"] = causal
  if window is not None:
    static["local_window_size"] = window
  if q_lengths is not None:
    arrays["query_seq_lengths"] = jnp.asarray(q_lengths, jnp.int32)
  if kv_lengths is not None:
    arrays["key_value_seq_lengths"] = jnp.asarray(kv_lengths, jnp.int32)
  if segs is not None:
    arrays["q_segment_ids"] = jnp.asarray(segs[0], jnp.int32)
    arrays["kv_segment_ids"] = jnp.asarray(segs[1], jnp.int32)
  if mask is not None:
    arrays["mask"] = jnp.asarray(mask)
  if soft_cap is not None:
    static["logits_soft_cap"] = soft_cap
  if scale is not None:
    static["scale"] = scale
  bias_arr = None if bias is None else jnp.asarray(bias, jnp.float32)
  sinks_arr = None if sinks is None else jnp.asarray(sinks, jnp.float32)

  make_mod, mod_args = score_mod if score_mod is not None else (None, ())
  out, lse, grads = _attention_vjp(
    q,
    k,
    v,
    bias_arr,
    sinks_arr,
    mod_args,
    arrays,
    do,
    static=tuple(static.items()),
    make_mod=make_mod,
  )
  dq, dk, dv, dbias, dsinks, dargs = grads

  vis = ref.visible_mask(
    B,
    N,
    T,
    S,
    mask=None if mask is None else np.asarray(mask),
    causal=(("top_left" if causal is True else causal) or None),
    window=(window, window) if isinstance(window, int) else window,
    q_lengths=q_lengths,
    kv_lengths=kv_lengths,
    q_seg=None if segs is None else segs[0],
    kv_seg=None if segs is None else segs[1],
  )
  r_dargs = None
  if make_mod is None:
    r_out, r_lse, cache = ref.attention(
      q, k, v, visible=vis, bias=bias, scale=scale, soft_cap=soft_cap, sinks=sinks
    )
    r_dq, r_dk, r_dv, r_dbias, r_dsinks = ref.grads(
      cache, do, None if bias is None else np.shape(bias)
    )
  else:
    r_out, r_lse, g = ref.attention_vjp(
      q,
      k,
      v,
      do,
      visible=vis,
      bias=bias,
      scale=scale,
      soft_cap=soft_cap,
      sinks=sinks,
      make_score_mod=make_mod,
      score_args=mod_args,
    )
    r_dq, r_dk, r_dv, r_dbias, r_dsinks, r_dargs = (
      g["dq"],
      g["dk"],
      g["dv"],
      g["dbias"],
      g["dsinks"],
      g["dargs"],
    )
  np.testing.assert_allclose(out, r_out, rtol=rtol, atol=atol)
  # Rows with something to attend to (B, T, N); with sinks every row has (the sink), and a row
  # that sees no key has lse = its sink logit.
  rows = np.isfinite(r_lse)
  if sinks is not None:
    assert rows.all()
  np.testing.assert_allclose(np.asarray(lse)[rows], r_lse[rows], rtol=rtol, atol=atol)
  assert np.all(np.asarray(lse)[~rows] < -1e30)
  for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv), (dbias, r_dbias), (dsinks, r_dsinks)):
    if want is not None:
      np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * 5)
  if r_dargs is not None:
    chex.assert_trees_all_close(dargs, r_dargs, rtol=rtol, atol=atol * 5)
  if jax_nn:
    _check_jax_nn(
      (q, k, v, do),
      (out, lse, (dq, dk, dv)),
      vis,
      bias=bias_arr,
      mask=arrays.get("mask"),
      is_causal=causal,
      local_window_size=window,
      query_seq_lengths=arrays.get("query_seq_lengths"),
      key_value_seq_lengths=arrays.get("key_value_seq_lengths"),
      scale=scale,
    )
  return out


def _check_jax_nn(arrays, got, vis, **kw):
  """jattn's out, lse and (dq, dk, dv) for the cotangent ``do`` (on every row) against
  jax.nn.dot_product_attention on the same arguments ``kw`` (None: not given). jax.nn returns
  the mean of V on rows with nothing visible: the comparison is on defined rows, its gradients
  through them only (a cotangent of 0 elsewhere). jattn's gradients are the same for either
  cotangent: a row that sees nothing takes no part in them (its cotangent is multiplied by
  weights of 0), which `_check` asserts by comparing them, for the cotangent on every row,
  with the float64 reference's, which is built so."""
  q, k, v, do = arrays
  out, lse, ours = got
  kw = {name: x for name, x in kw.items() if x is not None}
  operands = {name: kw.pop(name) for name in list(kw) if isinstance(kw[name], jax.Array)}
  if "bias" in operands:  # jax.nn takes rank-4 biases only
    bias = operands["bias"]
    operands["bias"] = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  defined = vis.any(-1).transpose(0, 2, 1)[..., None]  # (B, T, N, 1)
  o_jax, lse_jax, g_jax = _jax_nn_vjp(
    q, k, v, jnp.where(defined, do, 0.0), operands, static=tuple(kw.items())
  )
  chex.assert_trees_all_close(
    jnp.where(defined, out, 0.0), jnp.where(defined, o_jax, 0.0), rtol=2e-5, atol=2e-5
  )
  chex.assert_trees_all_close(ours, g_jax, rtol=2e-4, atol=2e-5)
  # return_residual: same shape, same values on defined rows.
  assert lse.shape == lse_jax.shape and lse.dtype == lse_jax.dtype
  np.testing.assert_allclose(lse[defined[..., 0]], lse_jax[defined[..., 0]], rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnames=("static",))
def _jax_nn_vjp(q, k, v, do, operands, *, static):
  """jax.nn.dot_product_attention's output, residual and (dq, dk, dv) for the cotangent ``do``,
  one compiled program per configuration (``static``: the keywords that are not arrays)."""
  f = lambda q, k, v: jax.nn.dot_product_attention(
    q, k, v, return_residual=True, **operands, **dict(static)
  )
  out, pull, lse = jax.vjp(f, q, k, v, has_aux=True)
  return out, lse, pull(do)


@pytest.mark.parametrize("impl", IMPLS)
class TestAgainstReference:
  """Every implementation and both chunked schedules: the plain call, GQA/MHA/MQA, empty rows
  (lengths of 0, sinks over rows that see nothing) and the features composed."""

  def test_plain_gqa(self, impl):
    _check(impl, jax_nn=True)

  @pytest.mark.parametrize("K", [1, 4])
  def test_mha_and_mqa(self, impl, K):
    _check(impl, K=K, T=20, S=33, jax_nn=True)

  def test_lengths_with_zero_and_causal(self, impl):
    _check(impl, q_lengths=[0, 12], kv_lengths=[17, 0], causal=True, jax_nn=True)

  def test_sinks_with_empty_rows(self, impl):
    # Rows that see no key: the sink takes all the mass, the output is 0, lse is the sink logit.
    _check(
      impl,
      sinks=[0.5, -1.0, 2.0, 0.0],
      kv_lengths=[0, 20],
      q_lengths=[37, 11],
      bias=np.random.default_rng(4).normal(size=(1, 4, 37, 45)),
    )

  def test_score_mod_nonlinear_after_soft_cap_and_bias(self, impl):
    # s -> s + w[h] * s^2 / 8 per batch: its derivative depends on s, so a chain rule that skips
    # the score_mod VJP (or applies it in the wrong order with the soft cap) is caught.
    def make(w):
      return lambda s, b, h, qi, ki: s + w[b, h] * s * s / 8.0

    w = jnp.asarray(np.random.default_rng(5).uniform(0.1, 0.5, (2, 4)), jnp.float32)
    rng = np.random.default_rng(6)
    _check(
      impl,
      score_mod=(make, w),
      soft_cap=3.0,
      bias=rng.normal(size=(2, 1, 37, 45)),
      sinks=[0.0, 1.0, -1.0, 0.5],
      window=(9, 4),
      kv_lengths=[45, 30],
    )

  def test_everything_together(self, impl):
    rng = np.random.default_rng(3)
    _check(
      impl,
      causal="bottom_right",
      window=(30, 0),
      kv_lengths=[40, 45],
      q_lengths=[37, 30],
      segs=(np.sort(rng.integers(0, 3, (2, 37))), np.sort(rng.integers(0, 3, (2, 45)))),
      bias=rng.normal(size=(1, 4, 37, 45)),
      soft_cap=5.0,
      scale=0.7,
      mask=jnp.asarray(rng.random((2, 1, 37, 45)) > 0.2),
    )


@pytest.mark.parametrize("impl", TILE_IMPLS)
class TestFeaturesAgainstReference:
  """One feature at a time, on `attention_cases.TILE_IMPLS` (the parallel schedule takes these
  features in the matrix and composed in TestAgainstReference)."""

  def test_window_with_bottom_right_causal(self, impl):
    _check(impl, window=(6, 0), causal="bottom_right", T=21, S=50)

  def test_lengths(self, impl):
    _check(impl, q_lengths=[30, 37], kv_lengths=[45, 5], jax_nn=True)

  def test_segments_packed(self, impl):
    q_seg = np.array([[0] * 10 + [1] * 20 + [2] * 7, [0] * 37])
    kv_seg = np.array([[0] * 12 + [1] * 3 + [2] * 30, [0] * 20 + [5] * 25])
    _check(impl, segs=(q_seg, kv_seg))

  def test_segments_unsorted(self, impl):
    rng = np.random.default_rng(0)
    q_seg = rng.integers(0, 3, (2, 37))
    kv_seg = rng.integers(0, 3, (2, 45))
    _check(impl, segs=(q_seg, kv_seg))

  def test_soft_cap_and_scale(self, impl):
    _check(impl, soft_cap=2.0, scale=0.9, causal=True)

  def test_sinks(self, impl):
    _check(impl, sinks=[0.0, 1.0, -2.0, 3.0], causal=True, kv_lengths=[45, 3])

  # score_mod: non-additive functions (derivative != 1), closed-over arrays with gradients, with a
  # mask here and composed with soft cap, bias and sinks in TestAgainstReference; the chunked path
  # differentiates it tile by tile through its own VJP.
  def test_score_mod_alibi_and_temperature_gradients(self, impl):
    def make(a):
      slopes, temp = a
      return lambda s, b, h, qi, ki: s / temp[h] - slopes[h] * jnp.abs(qi - ki).astype(s.dtype)

    args = (jnp.asarray([0.5, 0.25, 0.125, 0.0625]), jnp.asarray([1.0, 2.0, 0.5, 1.5]))
    _check(impl, score_mod=(make, args), causal=True)

  def test_score_mod_relative_table_with_mask(self, impl):
    def make(table):
      return lambda s, b, h, qi, ki: s * 1.5 + table[h, qi - ki + 45]

    table = jnp.asarray(np.random.default_rng(7).normal(size=(4, 37 + 45)), jnp.float32)
    _check(
      impl,
      score_mod=(make, table),
      mask=jnp.asarray(np.random.default_rng(8).random((2, 4, 37, 45)) > 0.3),
      causal="bottom_right",
    )


# Causal masks and windows are one mechanism for every implementation (`jattn.masks`' band,
# from `keyword_band`): a square problem's bottom-right alignment is the band top-left gives (it
# is not run twice), and dense evaluates every band the same way over the whole (T, S) grid,
# so it runs each alignment once (bottom-right where it leaves rows empty) and a window as an
# int and as a pair. The chunked kernels walk a different block map for each: every case.
_CAUSAL = [
  (True, 37, 45),
  (True, 45, 37),
  (True, 40, 40),
  ("bottom_right", 37, 45),
  ("bottom_right", 45, 37),
]
_DENSE_CAUSAL = [(True, 37, 45), ("bottom_right", 45, 37)]


@pytest.mark.parametrize(
  "impl,causal,T,S",
  [(impl, *c) for impl in IMPLS for c in (_DENSE_CAUSAL if impl == "dense" else _CAUSAL)],
)
def test_causal(impl, causal, T, S):
  _check(impl, causal=causal, T=T, S=S, jax_nn=causal is True)  # jax.nn: top-left only


@pytest.mark.parametrize(
  "impl,window",
  [
    (impl, w)
    for impl in IMPLS
    for w in ([3, (20, 2)] if impl == "dense" else [3, (5, 0), (0, 7), (20, 2)])
  ],
)
def test_window(impl, window):
  _check(impl, window=window, jax_nn=True)


# A bias of every broadcast. The chunked kernels slice each tile's bias by which of T and S it
# has and sum dBias per broadcast (the parallel schedule where each block has one writer): every
# shape. Dense adds the (B|1, K|1, G|1, T|1, S|1) bias to the whole score matrix and autodiff
# sums its gradient over the broadcast axes, one code for all: a full bias, a rank-2 one (the
# reshape every implementation shares) and a scalar one.
_BIASES = [(2, 4, 37, 45), (1, 4, 37, 45), (2, 1, 1, 45), (37, 45), (2, 4, 37, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize(
  "impl,shape",
  [
    (impl, b)
    for impl in IMPLS
    for b in _BIASES
    if impl != "dense" or b in ((2, 4, 37, 45), (37, 45), (1, 1, 1, 1))
  ],
)
def test_bias_broadcast_with_grad(impl, shape):
  bias = np.random.default_rng(1).normal(size=shape)
  _check(impl, bias=bias, jax_nn=True)


# Boolean masks of every broadcast. The chunked kernels reduce each block's part of the mask to
# the block map, per broadcast: every shape. Dense evaluates the broadcast mask over the whole
# score matrix, one code for all: one of them.
@pytest.mark.parametrize(
  "impl,shape",
  [
    (impl, m)
    for impl in IMPLS
    for m in [(2, 4, 37, 45), (1, 1, 37, 45), (2, 1, 1, 45)]
    if impl != "dense" or m == (2, 1, 1, 45)
  ],
)
def test_boolean_mask(impl, shape):
  mask = np.random.default_rng(2).random(shape) > 0.4
  _check(impl, mask=jnp.asarray(mask), jax_nn=True)


def test_closed_form_two_keys():
  # One query, two keys, logits 0 and 1: weights 1/(1+e) and e/(1+e).
  q = jnp.ones((1, 1, 1, 1))
  k = jnp.array([0.0, 1.0]).reshape(1, 2, 1, 1)
  v = jnp.array([1.0, 0.0]).reshape(1, 2, 1, 1)
  for impl in IMPLS:
    out, lse = jattn.dot_product_attention(q, k, v, scale=1.0, return_residual=True, **IMPLS[impl])
    np.testing.assert_allclose(out.ravel(), [1 / (1 + np.e)], rtol=1e-6)
    np.testing.assert_allclose(lse.ravel(), [np.log(1 + np.e)], rtol=1e-6)


# --------------------------------------------------------------------------------------------
# Parity with jax.nn.dot_product_attention on its whole argument set: the cases above that
# jax.nn can express compare the same call with it too (``jax_nn=True``: no case is compiled
# twice); here what they leave out. Each of jax.nn's arguments is so compared on its own:
# plain with GQA groups 1, 2 and 4 (test_plain_gqa, test_mha_and_mqa), causal (test_causal),
# local_window_size as an int and as pairs (test_window), both lengths (test_lengths and with
# zeros), biases of every broadcast (test_bias_broadcast_with_grad), masks (test_boolean_mask);
# below a scale, and everything at once with groups 1, 2 and 4.
# --------------------------------------------------------------------------------------------

JAX_CASES = {
  "scale": dict(scale=0.3),
  "all": dict(
    causal=True,
    window=(10, 0),
    bias=np.ones((1, 4, 37, 45), np.float32),
    kv_lengths=[40, 45],
  ),
}
# Implementations x GQA groups (K = 2, 4, 1) x the two cases, every pair once (a covering
# design; G = 1, 2, 4 plain in every implementation: test_mha_and_mqa, test_plain_gqa).
JAX_ROWS = covering.pairwise({"impl": list(IMPLS), "K": [2, 4, 1], "case": list(JAX_CASES)})


@pytest.mark.parametrize(
  "impl,K,case", [tuple(r.values()) for r in JAX_ROWS], ids=covering.ids(JAX_ROWS)
)
def test_matches_jax_nn(impl, case, K):
  _check(impl, K=K, jax_nn=True, **JAX_CASES[case])


def keep_mask(rng, rate, B, N, T, S, broadcast=False):
  """The (B, N, T, S) dropout keep-mask for ``rng`` ((1, 1, T, S) when broadcast over batch and
  heads), from the specification in docs/dropout.md (not from jattn's code)."""
  return dropout_reference.keep_mask(rng, rate, B, N, T, S, broadcast)


def test_dropout_hash_matches_its_specification():
  """jattn's keep-mask equals the hash written from docs/dropout.md at scattered (b, n, t, s)
  points, large indices included (a dropped or swapped index shows)."""
  rng = jax.random.key(11)
  pts = np.array(
    [
      [0, 0, 0, 0],
      [1, 0, 0, 0],
      [0, 1, 0, 0],
      [0, 0, 1, 0],
      [0, 0, 0, 1],
      [3, 7, 100, 5],
      [2, 5, 4095, 65535],
      [1000, 63, 123456, 7],
    ],
    np.int32,
  )
  for rate in (0.1, 0.5, 0.9):
    got = _dropout.keep_mask(
      _dropout.seed_words(rng), rate, *(jnp.asarray(pts[:, i]) for i in range(4))
    )
    want = dropout_reference.keep(rng, rate, *(pts[:, i] for i in range(4)))
    np.testing.assert_array_equal(np.asarray(got), want)
  # Each index changes the mask: over a grid, varying one index alone flips some entries.
  full = dropout_reference.keep_mask(rng, 0.5, 3, 3, 8, 8)
  for axis in range(4):
    assert (np.take(full, 0, axis) != np.take(full, 1, axis)).any(), axis


@pytest.mark.parametrize("impl", IMPLS)
def test_rank3_inputs_match_jax_nn(impl):
  q, k, v, _ = inputs(B=1)
  q, k, v = q[0], k[0], v[0]
  out = jattn.dot_product_attention(q, k, v, is_causal=True, **IMPLS[impl])
  chex.assert_trees_all_close(
    out, jax.nn.dot_product_attention(q, k, v, is_causal=True), rtol=2e-5, atol=2e-5
  )
  out, lse = jattn.dot_product_attention(q, k, v, return_residual=True, **IMPLS[impl])
  assert out.shape == q.shape and lse.shape == q.shape[:-1]


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_and_jit(impl):
  q, k, v, _ = inputs()
  f = functools.partial(jattn.dot_product_attention, is_causal=True, **IMPLS[impl])
  # vmap over the batch with rank-3 per-example inputs, against jax.nn's batched answer.
  got = jax.jit(jax.vmap(f))(q, k, v)
  chex.assert_trees_all_close(
    got, jax.nn.dot_product_attention(q, k, v, is_causal=True), rtol=2e-5, atol=2e-5
  )
  # vmap of the gradient too.
  g = jax.vmap(jax.grad(lambda q, k, v: f(q, k, v).sum()))(q, k, v)
  g_ref = jax.grad(lambda q: jax.nn.dot_product_attention(q, k, v, is_causal=True).sum())(q)
  chex.assert_trees_all_close(g, g_ref, rtol=2e-4, atol=2e-5)


# --------------------------------------------------------------------------------------------
# Numerics at the edges.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_give_zero_and_zero_grads(impl):
  q, k, v, do = inputs()
  mask = np.ones((2, 1, 37, 45), bool)
  mask[0, :, 5] = False
  mask[1, :, 30:] = False
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, mask=jnp.asarray(mask), **IMPLS[impl])
  out, pull = jax.vjp(f, q, k, v)
  assert np.all(np.asarray(out)[0, 5] == 0) and np.all(np.asarray(out)[1, 30:] == 0)
  # jax.nn silently returns the mean of V on those rows.
  jout = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask))
  assert not np.allclose(jout[0, 5], 0)
  dq, dk, dv = pull(do)
  assert np.all(np.asarray(dq)[0, 5] == 0) and np.all(np.asarray(dq)[1, 30:] == 0)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(g))


@pytest.mark.parametrize("impl", IMPLS)
def test_garbage_in_masked_positions_does_not_leak(impl):
  q, k, v, do = inputs()
  lens = jnp.array([30, 45], jnp.int32)
  qlens = jnp.array([37, 20], jnp.int32)
  k = k.at[0, 30:].set(jnp.nan).at[0, 31].set(jnp.inf)
  v = v.at[0, 30:].set(jnp.inf).at[0, 40].set(jnp.nan)
  q = q.at[1, 20:].set(jnp.nan)
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, key_value_seq_lengths=lens, query_seq_lengths=qlens, **IMPLS[impl]
  )
  out, pull = jax.vjp(f, q, k, v)
  assert np.all(np.isfinite(out))
  for g in pull(do):
    assert np.all(np.isfinite(g))
  clean_q, clean_k, clean_v, _ = inputs()
  want = jattn.dot_product_attention(
    clean_q, clean_k, clean_v, key_value_seq_lengths=lens, query_seq_lengths=qlens, **IMPLS[impl]
  )
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_huge_logits_stay_finite_and_correct(impl, dtype):
  # Logits of magnitude ~1e4: exp would overflow any float without the max trick.
  q, k, v, _ = inputs(T=8, S=12, dtype=dtype)
  out = jattn.dot_product_attention(q, k, v, scale=1e4 / 4, is_causal=True, **IMPLS[impl])
  assert out.dtype == dtype
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  vis = ref.visible_mask(2, 4, 8, 12, causal="top_left")
  want, _, _ = ref.attention(
    np.asarray(q, np.float64),
    np.asarray(k, np.float64),
    np.asarray(v, np.float64),
    visible=vis,
    scale=1e4 / 4,
  )
  # At this scale softmax is (nearly) a hard argmax. Logits and statistics are float32, so every
  # entry is the float64 answer on the same rounded inputs, rounded once to the output dtype.
  err = np.abs(np.asarray(out, np.float64) - want)
  assert np.all(err <= float(jnp.finfo(dtype).eps) * np.abs(want) + 1e-6), err.max()


# --------------------------------------------------------------------------------------------
# Low precision: the FlashAttention rule.
# --------------------------------------------------------------------------------------------


# Every implementation in both 16-bit dtypes, with and without the causal mask, each pair once
# (a covering design). Causal in every implementation x dtype is also test_guarantees' rule
# (with bias, mask, sinks and soft cap) and test_precision16's (T = 2048).
_LOW_PRECISION = covering.pairwise(
  {"impl": list(IMPLS), "dtype": ["bfloat16", "float16"], "causal": [False, True]}
)


@pytest.mark.parametrize(
  "impl,dtype,causal",
  [tuple(r.values()) for r in _LOW_PRECISION],
  ids=covering.ids(_LOW_PRECISION),
)
def test_low_precision_rule(impl, dtype, causal):
  dtype = jnp.dtype(dtype)
  q32, k32, v32, do32 = inputs(T=64, S=96, H=32)
  q, k, v, do = (x.astype(dtype) for x in (q32, k32, v32, do32))
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=causal, **IMPLS[impl])
  g = lambda q, k, v: plain_low_precision(q, k, v, causal)
  out, pull = jax.vjp(f, q, k, v)
  base, pull_base = jax.vjp(g, q, k, v)
  # The float64 reference on the same (rounded) inputs.
  qq, kk, vv = (np.asarray(x, np.float64) for x in (q, k, v))
  vis = ref.visible_mask(2, 4, 64, 96, causal="top_left" if causal else None)
  want, _, cache = ref.attention(qq, kk, vv, visible=vis)
  want_grads = ref.grads(cache, np.asarray(do, np.float64))[:3]
  err = lambda a, b: np.max(np.abs(np.asarray(a, np.float64) - b))
  assert err(out, want) <= 2 * err(base, want) + 1e-3
  for got, plain, w in zip(pull(do), pull_base(do), want_grads):
    assert err(got, w) <= 2 * err(plain, w) + 1e-3
  assert out.dtype == dtype


# --------------------------------------------------------------------------------------------
# Dropout.
# --------------------------------------------------------------------------------------------


def test_dropout_same_entries_for_every_implementation_and_block():
  q, k, v, _do = inputs()
  rng = jax.random.key(7)
  runs = [
    jattn.dot_product_attention(
      q, k, v, dropout_rate=0.3, dropout_rng=rng, is_causal=True, implementation="dense"
    )
  ]
  for bq, bk in ((16, 24), (37, 45), (8, 5)):
    runs.append(
      jattn.dot_product_attention(
        q,
        k,
        v,
        dropout_rate=0.3,
        dropout_rng=rng,
        is_causal=True,
        implementation="chunked",
        block_q=bq,
        block_kv=bk,
      )
    )
  for r in runs[1:]:
    np.testing.assert_allclose(r, runs[0], rtol=2e-5, atol=2e-5)
  other = jattn.dot_product_attention(
    q, k, v, dropout_rate=0.3, dropout_rng=jax.random.key(8), is_causal=True
  )
  assert not np.allclose(other, runs[0])


@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_against_reference_with_grads(impl):
  B, T, S, N = 2, 37, 45, 4
  q, k, v, do = inputs()
  rate, rng = 0.25, jax.random.key(3)
  keep = keep_mask(rng, rate, B, N, T, S)
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, dropout_rate=rate, dropout_rng=rng, is_causal=True, **IMPLS[impl]
  )
  out, pull = jax.vjp(f, q, k, v)
  vis = ref.visible_mask(B, N, T, S, causal="top_left")
  want, _, cache = ref.attention(q, k, v, visible=vis, keep=keep, dropout_rate=rate)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  for got, w in zip(pull(do), ref.grads(cache, do)[:3]):
    np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-4)


def test_dropout_mask_statistics():
  seed = _dropout.seed_words(jax.random.key(0))
  shape_idx = (
    jnp.arange(4).reshape(4, 1, 1, 1),
    jnp.arange(8).reshape(1, 8, 1, 1),
    jnp.arange(128).reshape(1, 1, 128, 1),
    jnp.arange(128).reshape(1, 1, 1, 128),
  )
  for rate in (0.1, 0.5, 0.9):
    keep = np.asarray(_dropout.keep_mask(seed, rate, *shape_idx))
    n = keep.size
    # Binomial: 5 standard deviations.
    assert abs(keep.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / n)
    # Neighbouring entries are independent (no stripes along any axis).
    for axis in range(4):
      a = np.take(keep, range(keep.shape[axis] - 1), axis=axis)
      b = np.take(keep, range(1, keep.shape[axis]), axis=axis)
      both = np.mean(a & b)
      assert abs(both - (1 - rate) ** 2) < 0.02


# --------------------------------------------------------------------------------------------
# Compilation.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_no_recompilation_on_second_call(impl):
  chex.clear_trace_counter()
  traces = []

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(q, k, v):
    traces.append(1)
    return jattn.dot_product_attention(q, k, v, is_causal=True, **IMPLS[impl])

  q, k, v, _ = inputs()
  step(q, k, v)
  step(q + 1, k, v)
  assert len(traces) == 1
  # The public function itself keeps one jit cache entry per configuration.
  before = jattn._attention._attention._cache_size()
  jattn.dot_product_attention(q, k, v, is_causal=True, **IMPLS[impl])
  jattn.dot_product_attention(q * 2, k, v, is_causal=True, **IMPLS[impl])
  assert jattn._attention._attention._cache_size() - before <= 1


def test_a_gradient_traces_each_kernel_forward_once(monkeypatch):
  """Under jit(grad) a kernel with a custom derivative is traced when its call is staged and
  asked for again by its JVP rule when the staged call is differentiated; the second trace is
  the first's, from jit's cache (`jattn._derivatives.traced_once`). Counted for the chunked
  kernels' forward walk and for the sparse path's forward (a kernel through
  `_derivatives.with_derivatives`, as the fused kernels are). The gradients are checked
  elsewhere; this pins what a model's compile pays."""
  from jattn._backends import sparse
  from jattn._chunked import kernel

  jax.clear_caches()  # a program traced before would be reused: nothing traced to count
  counts = {"walk_rows": 0, "_forward": 0}

  def counting(module, name):
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
      counts[name] += 1
      return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)

  counting(kernel, "walk_rows")
  counting(sparse, "_forward")
  q, k, v, _ = inputs()
  idx = jnp.asarray(np.broadcast_to(np.array([1, 0]), (2, 37, 2, 2)), jnp.int32)
  calls = {
    "walk_rows": dict(is_causal=True, **IMPLS["chunked"]),
    "_forward": dict(implementation="sparse", mask=jattn.masks.selected_blocks(idx, 16)),
  }
  for name, kw in calls.items():
    loss = lambda q, k, v, kw=kw: jnp.sum(jattn.dot_product_attention(q, k, v, **kw))
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v)
    assert counts[name] == 1, (name, counts)
