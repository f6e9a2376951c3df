"""masks.hidden_rows: the rows hidden from each key column as two intervals (FlashMask's form).

Its evaluation equals the definition built index by index; its block summary is sound on
ragged grids (EMPTY only where nothing is visible, FULL only where everything is), alone and
combined with other masks by &, | and ~; it cuts to a device's examples and heads; and attention
with it, with every keyword of the call (causal, window, lengths, sinks, soft cap, bias, dropout,
score_mod) and GQA, equals the float64 reference on dense and on chunked in both schedules,
forward and gradients. Known bad values and shapes are ValueErrors naming the argument; the
fused kernels refuse it by name."""

import itertools

import dropout_reference
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jattn
from jattn import masks as M

B, N, K, H = 2, 4, 2, 8
IMPLS = {
  "dense": dict(implementation="dense"),
  "chunked": dict(implementation="chunked", schedule="serial", block_q=16, block_kv=8),
  "parallel": dict(
    implementation="chunked", schedule="parallel", step_width=3, block_q=16, block_kv=8
  ),
}


def _intervals(rng, shape, T):
  """Random (start, end) pairs of row indices in [0, T + 2], some empty, some touching."""
  a, b = rng.integers(0, T + 3, shape), rng.integers(0, T + 3, shape)
  return np.minimum(a, b), np.maximum(a, b)


def _case(kind, T, S, seed=0):
  """(mask, its (B, N, T, S) definition by hand)."""
  rng = np.random.default_rng(seed)
  per_head = "head" in kind
  shape = (B, N, S) if per_head else (B, S)
  ls, le = _intervals(rng, shape, T)
  us, ue = _intervals(rng, shape, T)
  if "touching" in kind:  # causal above the diagonal and a lower interval starting at it
    us, ue = np.zeros(shape, int), np.broadcast_to(np.arange(S), shape).copy()
    ls, le = ue.copy(), np.full(shape, max(T, S))
    ls[..., ::3] = rng.integers(0, T + 1, ls[..., ::3].shape)
  kw = {}
  if "lower" in kind or "both" in kind or "touching" in kind:
    kw.update(lower_start=ls, lower_end=le)
  if "upper" in kind or "both" in kind or "touching" in kind:
    kw.update(upper_start=us, upper_end=ue)
  if kind == "lower to the end":
    kw = dict(lower_start=ls)
    le = np.full(shape, T)
  mask = M.hidden_rows(**{k: jnp.asarray(v, jnp.int32) for k, v in kw.items()})
  q = np.arange(T)[:, None]
  hidden = np.zeros((B, N, T, S), bool)
  for (s, e), given in (((ls, le), "lower_start" in kw), ((us, ue), "upper_end" in kw)):
    if given:
      s4, e4 = (np.broadcast_to(x[:, None] if not per_head else x, (B, N, S)) for x in (s, e))
      hidden |= (q[None, None] >= s4[:, :, None, :]) & (q[None, None] < e4[:, :, None, :])
  return mask, ~hidden


KINDS = ["lower", "upper", "both", "both per head", "touching", "lower to the end"]


def _dense(mask, T, S):
  out = mask.evaluate(jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32), (B, N, T, S))
  return np.broadcast_to(np.asarray(out), (B, N, T, S))


def _check_summary(mask, want, T, S, exact_empty=False):
  """Block states sound on ragged grids; ``exact_empty``: EMPTY exactly where nothing shows."""
  for bq, bk in ((8, 8), (16, 5), (7, 13)):
    grid = M.BlockGrid(T, S, bq, bk)
    st = np.broadcast_to(
      np.asarray(jax.jit(lambda: mask.block_states(grid, (B, N, T, S)))()),
      (B, N, grid.num_q_blocks, grid.num_kv_blocks),
    )
    for i, j in itertools.product(range(grid.num_q_blocks), range(grid.num_kv_blocks)):
      blk = want[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
      none, every = ~blk.any(axis=(2, 3)), blk.all(axis=(2, 3))
      at = st[..., i, j]
      assert np.all(none[at == M.EMPTY]), f"EMPTY block {(i, j)} with visible pairs"
      assert np.all(every[at == M.FULL]), f"FULL block {(i, j)} with hidden pairs"
      if exact_empty:
        np.testing.assert_array_equal(at == M.EMPTY, none, err_msg=f"block {(i, j)}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T, S", [(29, 29), (21, 43), (43, 21)])
def test_evaluation_is_the_definition_and_the_summary_is_sound(kind, T, S):
  mask, want = _case(kind, T, S)
  np.testing.assert_array_equal(_dense(mask, T, S), want)
  _check_summary(mask, want, T, S)


def test_the_summary_skips_what_one_interval_per_column_hides():
  # One lower interval per column that covers a block's rows in every column of a key block:
  # that block is EMPTY, not merely PARTIAL (the point of per-block minima and maxima).
  T = S = 40
  ends = np.repeat(np.arange(0, 40, 8) + 8, 8)  # documents of 8: key k hidden from its doc's end
  mask = M.hidden_rows(lower_start=jnp.asarray(np.broadcast_to(ends, (B, S)), jnp.int32))
  want = np.broadcast_to(np.arange(T)[:, None] < ends[None, :], (B, N, T, S))
  _check_summary(mask, want, T, S, exact_empty=True)


@pytest.mark.parametrize(
  "combine",
  ["& causal", "| window", "~", "& lengths", "& segments", "| other"],
)
def test_combinations_evaluate_and_summarise_soundly(combine):
  T, S = 27, 27
  mask, want = _case("both per head", T, S)
  other, other_want = _case("lower", T, S, seed=1)
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  seg = np.sort(np.random.default_rng(2).integers(0, 3, (B, T)), axis=1)
  mask, want = {
    "& causal": (mask & M.causal(), want & (s <= t)),
    "| window": (mask | M.local_window(2), want | (np.abs(s - t) <= 2)),
    "~": (~mask, ~want),
    "& lengths": (
      mask & M.lengths(jnp.asarray([20, 27]), jnp.asarray([11, 27])),
      want & np.stack([(t < 20) & (s < 11), (t < 27) & (s < 27)])[:, None],
    ),
    "& segments": (
      mask & M.segments(jnp.asarray(seg)),
      want & (seg[:, None, :, None] == seg[:, None, None, :]),
    ),
    "| other": (mask | other, want | other_want),
  }[combine]
  np.testing.assert_array_equal(_dense(mask, T, S), np.broadcast_to(want, (B, N, T, S)))
  _check_summary(mask, np.broadcast_to(want, (B, N, T, S)), T, S)


def test_take_part_is_the_slice_of_the_whole_mask():
  T = S = 19
  mask, want = _case("both per head", T, S)
  part = M.take_part(mask, 1, 1, 2, 2, (B, N, T, S))
  got = part.evaluate(jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32), (1, 2, T, S))
  np.testing.assert_array_equal(np.broadcast_to(got, (1, 2, T, S)), want[1:2, 2:4])
  assert M.can_take_part(mask) and M.is_position_based(mask)


def _inputs(T, dtype=jnp.float32):
  rng = np.random.default_rng(7)
  x = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return x(B, T, N, H), x(B, T, K, H), x(B, T, K, H), x(B, T, N, H)


# Each case: the call's keywords beside the mask, and the reference's (ref.attention_vjp).
CASES = {
  "causal, key lengths, sinks": (
    dict(is_causal=True, key_value_seq_lengths=np.array([30, 17]), sinks=True),
    dict(causal="top_left", kv_lengths=[30, 17]),
  ),
  "window, soft cap, bias": (dict(local_window_size=(6, 3), logits_soft_cap=5.0, bias=True), {}),
  "dropout, score_mod, | causal": (dict(dropout_rate=0.3, score_mod=True, mask_or_causal=True), {}),
}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
def test_attention_with_every_keyword_equals_float64(impl, case):
  T = 30
  mask, vis = _case("both per head", T, T)
  kw, vis_kw = CASES[case]
  kw = dict(kw)
  q, k, v, do = _inputs(T)
  rng = np.random.default_rng(3)
  sinks = jnp.asarray(rng.standard_normal(N), jnp.float32) if kw.pop("sinks", False) else None
  bias = jnp.asarray(rng.standard_normal((B, N, T, T)), jnp.float32) if kw.pop("bias", 0) else None
  table = jnp.asarray(rng.standard_normal(2 * T), jnp.float32)
  mod = kw.pop("score_mod", False)
  make_mod = lambda tbl: lambda s, b, h, qi, ki: s + tbl[qi - ki + T] * (h + 1).astype(s.dtype)
  if kw.pop("mask_or_causal", False):
    mask = mask | M.causal()
    vis = vis | (np.arange(T)[None, :] <= np.arange(T)[:, None])
  window = kw.get("local_window_size")
  visible = ref.visible_mask(B, N, T, T, mask=vis, window=window, **vis_kw)
  rate = kw.get("dropout_rate", 0.0)
  rng_key = jax.random.key(5)
  if rate:
    kw["dropout_rng"] = rng_key
  keep = dropout_reference.keep_mask(rng_key, rate, B, N, T, T) if rate else None

  def f(q, k, v, bias, sinks, tbl):
    return jattn.dot_product_attention(
      q,
      k,
      v,
      bias,
      mask=mask,
      sinks=sinks,
      score_mod=make_mod(tbl) if mod else None,
      **kw,
      **IMPLS[impl],
    )

  out, pull = jax.vjp(f, q, k, v, bias, sinks, table)
  grads = dict(zip(("dq", "dk", "dv", "dbias", "dsinks", "dargs"), pull(do)))
  want_out, _, want = ref.attention_vjp(
    q,
    k,
    v,
    do,
    visible=visible,
    bias=bias,
    soft_cap=kw.get("logits_soft_cap"),
    keep=keep,
    dropout_rate=rate,
    sinks=sinks,
    make_score_mod=make_mod if mod else None,
    score_args=table,
  )
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
  for name, got in grads.items():
    if want.get(name) is not None and (name != "dargs" or mod):
      np.testing.assert_allclose(got, want[name], atol=5e-5, rtol=5e-5, err_msg=name)


@pytest.mark.parametrize(
  "kwargs, words",
  [
    (dict(lower_start=[[-1, 2]]), "lower_start[0, 0]=-1 (key column 0)"),
    (dict(lower_start=[[1, 5]], lower_end=[[3, 4]]), "lower_start[0, 1]=5 > lower_end[0, 1]=4"),
    (dict(upper_start=[[0, 2]], upper_end=[[1, 1]]), "upper_start[0, 1]=2 > upper_end[0, 1]=1"),
    (dict(lower_end=[[3, 4]]), "lower_end without lower_start"),
    (dict(upper_start=[[3, 4]]), "upper_start without upper_end"),
    ({}, "give lower_start or upper_end"),
    (dict(lower_start=[[1, 2]], lower_end=[[3, 4, 5]]), "must have one shape"),
    (dict(lower_start=[1, 2]), "must be (B, S) or (B, N, S), got shape (2,)"),
  ],
)
def test_bad_values_are_value_errors_naming_the_argument(kwargs, words):
  with pytest.raises(ValueError, match=None) as e:
    M.hidden_rows(**{k: np.asarray(v) for k, v in kwargs.items()})
  assert words in str(e.value) and "masks.hidden_rows" in str(e.value)


def test_float_arrays_are_type_errors():
  with pytest.raises(TypeError, match="masks.hidden_rows: lower_start must be an integer array"):
    M.hidden_rows(lower_start=np.zeros((1, 4)))


def test_traced_values_are_taken_and_a_wrong_shape_for_the_call_is_named():
  T = 12
  q, k, v, _ = _inputs(T)
  f = jax.jit(lambda ls: jattn.dot_product_attention(q, k, v, mask=M.hidden_rows(lower_start=ls)))
  ls = jnp.full((B, T), T, jnp.int32)
  np.testing.assert_allclose(f(ls), jattn.dot_product_attention(q, k, v), atol=1e-6)
  with pytest.raises(ValueError, match=r"masks.hidden_rows: lower_start and lower_end must have"):
    f(jnp.full((B, T + 1), T, jnp.int32))
  with pytest.raises(ValueError, match=r"\(B and N may be 1\), got \(B, N, S\)=\(2, 3, 12\)"):
    jattn.dot_product_attention(q, k, v, mask=M.hidden_rows(upper_end=jnp.ones((B, 3, T), int)))


def test_fused_kernels_refuse_it_by_name():
  from jattn import _call
  from jattn._backends import pallas_gpu as _flash_gpu

  T = 16
  q, k, v, _ = _inputs(T)
  mask = M.causal() & M.hidden_rows(lower_start=jnp.full((B, T), T, jnp.int32))
  given = _call.Given(q, k, v, None, mask)
  opts, _ = _call.options(_call.Keywords(implementation="pallas_gpu"))
  reason = _flash_gpu.supports(_call.bind(given, opts))
  assert "mask: a _HiddenRows mask" in reason and "hidden_rows intervals" in reason, reason
  for impl, words in (("cudnn", "mask objects"), ("splash", "depends on run-time arrays")):
    with pytest.raises(NotImplementedError, match=words):
      jax.jit(
        lambda q, k, v, m, impl=impl: jattn.dot_product_attention(
          q, k, v, mask=m, implementation=impl
        )
      )(q, k, v, mask)


def test_the_docs_forms_are_the_masks_they_name():
  # docs/prefix_trees.md's table: FlashMask's causal document mask (causality as the upper
  # interval), prefix-LM with a per-example prefix, and a causal sliding window.
  T = S = 24
  k = np.arange(S)[None, :]
  doc_end = np.array([[9] * 9 + [24] * 15, [17] * 17 + [24] * 7])
  P = np.array([[5], [11]])
  w = 3
  prefix = np.stack([_dense(M.prefix_lm(int(p[0])), T, S)[b] for b, p in enumerate(P)])
  cases = [
    (
      M.hidden_rows(lower_start=jnp.asarray(doc_end), upper_end=jnp.asarray(np.repeat(k, B, 0))),
      _dense(M.causal() & M.hidden_rows(lower_start=jnp.asarray(doc_end)), T, S),
    ),
    (M.hidden_rows(upper_end=jnp.asarray(np.where(k < P, 0, k))), prefix),
    (
      M.causal() & M.hidden_rows(lower_start=jnp.asarray(np.repeat(k + w + 1, B, 0))),
      _dense(M.local_window(w, 0), T, S),
    ),
  ]
  for mask, expect in cases:
    np.testing.assert_array_equal(_dense(mask, T, S), expect)
    _check_summary(mask, expect, T, S)


def test_implementation_none_tries_no_fused_kernel_for_it():
  # On a GPU and a TPU, None puts a fused kernel first only for calls it takes (splash takes
  # the causal mask object, on a TPU); none takes the tree's mask: every platform's order is
  # jattn's own kernels.
  from jattn import _call, _dispatch

  T = 4096
  tree = M.prefix_tree(np.array([-1, 0, 0]), lengths=np.array([2048, 1024, 1024]), size=T)
  opts, _ = _call.options(_call.Keywords())
  seen = []

  def decide(q, k, v, mask):
    seen.append(_dispatch.order(_call.bind(_call.Given(q, k, v, None, mask), opts)))
    return q

  shape = lambda n: jax.ShapeDtypeStruct((1, T, n, 64), jnp.bfloat16)
  for mask in (M.causal(), tree.mask):
    jax.eval_shape(lambda q, k, v, mask=mask: decide(q, k, v, mask), shape(8), shape(4), shape(4))
  causal, ours = seen
  assert causal["tpu"][0] == "splash", causal
  assert set(ours) == {"cpu", "default"} and ours["default"] == ("chunked",), ours
