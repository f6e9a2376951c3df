"""jattn.diagnostics against closed forms and a float64 NumPy reference; dense == chunked."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import diagnostics, masks

IMPLS = {
  "dense": dict(implementation="dense"),
  # Small non-dividing blocks: ragged edges, many blocks, skipped (EMPTY) blocks.
  "chunked": dict(implementation="chunked", block_q=8, block_kv=7),
}
FIELDS = diagnostics.AttentionStats._fields


def _two_keys(logits, dtype=jnp.float32):
  """q = [1], k_i = [logit_i], scale 1: the logits are exactly the given values."""
  q = jnp.ones((1, 1, 1, 1), dtype)
  k = jnp.asarray(np.asarray(logits, np.float32).reshape(1, -1, 1, 1)).astype(dtype)
  return q, k


@pytest.mark.parametrize("impl", IMPLS)
def test_two_keys_closed_form(impl):
  # Logits 0 and 1: weights 1/(1+e) and e/(1+e); H = log(1+e) - e/(1+e).
  q, k = _two_keys([0.0, 1.0])
  st = diagnostics.attention_stats(q, k, scale=1.0, **{**IMPLS[impl], "block_kv": 1})
  e = math.e
  H = math.log1p(e) - e / (1 + e)
  np.testing.assert_allclose(st.max_prob[0, 0], e / (1 + e), rtol=1e-6)
  np.testing.assert_allclose(st.entropy[0, 0], H, rtol=1e-6)
  np.testing.assert_allclose(st.entropy_fraction[0, 0], H / math.log(2), rtol=1e-6)
  assert float(st.max_logit[0, 0]) == 1.0 and float(st.min_logit[0, 0]) == 0.0
  assert float(st.saturated_fraction[0, 0]) == 0.0
  assert int(st.masked_rows[0, 0]) == 0 and not bool(st.overflow[0, 0])


def test_saturation_threshold():
  # Logits 0 and 10: max weight 1 / (1 + e^-10) = 0.9999546.
  q, k = _two_keys([0.0, 10.0])
  st = diagnostics.attention_stats(q, k, scale=1.0)
  np.testing.assert_allclose(st.max_prob[0, 0], 1 / (1 + math.exp(-10)), rtol=1e-6)
  assert float(st.saturated_fraction[0, 0]) == 1.0
  st = diagnostics.attention_stats(q, k, scale=1.0, saturation_threshold=0.99999)
  assert float(st.saturated_fraction[0, 0]) == 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_overflow_flag_matches_naive_float16_softmax(impl):
  # log(65504) = 11.09. Logits (11, 11): each exp is finite in float16 but their sum is not, so
  # the naive softmax returns zeros; (10, 10) is fine. The flag is about the log-sum-exp.
  naive = lambda x: jnp.exp(x) / jnp.exp(x).sum()
  for logits, expect in (([10.0, 10.0], False), ([11.0, 11.0], True), ([12.0, 0.0], True)):
    q, k = _two_keys(logits, jnp.float16)
    st = diagnostics.attention_stats(q, k, scale=1.0, **{**IMPLS[impl], "block_kv": 1})
    assert bool(st.overflow[0, 0]) == expect, logits
    p = np.asarray(naive(jnp.asarray(logits, jnp.float16)).astype(jnp.float32))
    assert (np.isfinite(p).all() and abs(p.sum() - 1) < 1e-2) == (not expect), (logits, p)
    # The same logits in float32 are far from its overflow threshold (88.7).
    q32, k32 = _two_keys(logits, jnp.float32)
    assert not bool(diagnostics.attention_stats(q32, k32, scale=1.0).overflow[0, 0])


# --------------------------------------------------------------------------------------------
# A float64 NumPy reference on random inputs with masks.
# --------------------------------------------------------------------------------------------


def _reference(
  q, k, *, vis, bias=None, scale=None, soft_cap=None, sinks=None, threshold=0.99, score_mod=None
):
  """Per-query statistics (B, N, T) from the definitions, in float64."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  kr = np.repeat(k, N // K, axis=2)
  s = np.einsum("btnh,bsnh->bnts", q, kr) * (1 / math.sqrt(H) if scale is None else scale)
  if soft_cap is not None:
    s = soft_cap * np.tanh(s / soft_cap)
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  if score_mod is not None:
    # f(scores, b, n, t, s) on the (B, N, T, S) logits, index arrays broadcasting against them.
    s = score_mod(s, *np.ix_(np.arange(B), np.arange(N), np.arange(T), np.arange(S)))
  vis = np.broadcast_to(vis, s.shape)
  out = {f: np.zeros((B, N, T)) for f in FIELDS}
  for b, n, t in np.ndindex(B, N, T):
    x = s[b, n, t][vis[b, n, t]]
    cand = list(x) + ([float(sinks[n])] if sinks is not None else [])
    out["masked_rows"][b, n, t] = x.size == 0
    if not cand:
      continue
    c = np.asarray(cand)
    p = np.exp(c - c.max()) / np.exp(c - c.max()).sum()
    lse = c.max() + np.log(np.exp(c - c.max()).sum())
    ent = -(p * np.log(p, where=p > 0, out=np.zeros_like(p))).sum()
    out["overflow"][b, n, t] = lse > np.log(np.finfo(np.float32).max)
    out["entropy"][b, n, t] = ent
    if x.size:
      out["max_logit"][b, n, t], out["min_logit"][b, n, t] = x.max(), x.min()
      out["max_prob"][b, n, t] = p[: x.size].max()
    if c.size >= 2:
      out["entropy_fraction"][b, n, t] = ent / np.log(c.size)
      out["saturated_fraction"][b, n, t] = out["max_prob"][b, n, t] > threshold
  return out, vis


def _per_head(ref, vis, has_sink):
  """Aggregate the per-query reference as documented: extremes over rows with keys, means over
  rows with at least two candidates."""
  nkeys = vis.sum(-1)
  has_key = nkeys > 0
  choice = nkeys + has_sink >= 2
  out = {}
  for f in ("max_prob", "entropy", "entropy_fraction", "saturated_fraction"):
    cnt = choice.sum(-1)
    out[f] = np.where(cnt > 0, (ref[f] * choice).sum(-1) / np.maximum(cnt, 1), 0.0)
  out["max_logit"] = np.where(
    has_key.any(-1), np.where(has_key, ref["max_logit"], -np.inf).max(-1), 0.0
  )
  out["min_logit"] = np.where(
    has_key.any(-1), np.where(has_key, ref["min_logit"], np.inf).min(-1), 0.0
  )
  out["masked_rows"] = ref["masked_rows"].sum(-1)
  out["overflow"] = ref["overflow"].any(-1)
  return out


def _visible(B, N, T, S, *, causal=False, q_len=None, kv_len=None, window=None, array=None):
  t, s = np.arange(T)[:, None], np.arange(S)[None, :]
  vis = np.ones((B, N, T, S), bool)
  if causal:
    vis &= (s <= t)[None, None]
  if window is not None:
    vis &= ((s >= t - window[0]) & (s <= t + window[1]))[None, None]
  for b in range(B):
    if q_len is not None:
      vis[b, :, q_len[b] :] = False
    if kv_len is not None:
      vis[b, :, :, kv_len[b] :] = False
  if array is not None:
    vis &= array
  return vis


def _inputs(B=2, T=19, S=23, N=4, K=2, H=8, seed=0, dtype=jnp.float32):
  kq, kk = jax.random.split(jax.random.key(seed))
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32) * 2.0
  k = jax.random.normal(kk, (B, S, K, H), jnp.float32)
  return q.astype(dtype), k.astype(dtype)


def _case(name):
  """(jattn kwargs, reference kwargs) for a named masking case on the default shapes."""
  B, T, S, N = 2, 19, 23, 4
  rng = np.random.default_rng(1)
  if name == "causal+lengths":
    q_len, kv_len = np.array([19, 11]), np.array([23, 9])
    return (
      dict(
        is_causal=True,
        query_seq_lengths=jnp.asarray(q_len, jnp.int32),
        key_value_seq_lengths=jnp.asarray(kv_len, jnp.int32),
      ),
      dict(vis=_visible(B, N, T, S, causal=True, q_len=q_len, kv_len=kv_len)),
    )
  if name == "array mask+bias+softcap":
    arr = rng.random((B, 1, T, S)) < 0.6
    arr[0, 0, 3] = False  # a fully masked row
    bias = rng.standard_normal((1, N, T, S)).astype(np.float32)
    return (
      dict(mask=jnp.asarray(arr), bias=jnp.asarray(bias), logits_soft_cap=3.0),
      dict(vis=_visible(B, N, T, S, array=arr), bias=bias, soft_cap=3.0),
    )
  if name == "window+mask object+sinks":
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    return (
      dict(mask=masks.local_window(4, 2), sinks=jnp.asarray(sinks), scale=0.7),
      dict(vis=_visible(B, N, T, S, window=(4, 2)), sinks=sinks, scale=0.7),
    )
  if name == "score_mod+causal":
    # ALiBi-like slopes per head and a relative-position table gathered by (t - s): statistics
    # are of the modified logits.
    table = rng.standard_normal((N, T + S)).astype(np.float32)
    jt = jnp.asarray(table)

    def score_mod(x, b, h, t, s):
      return x - 0.25 * (h + 1).astype(x.dtype) * jnp.abs(t - s).astype(x.dtype) + jt[h, t - s + S]

    def reference_mod(x, b, h, t, s):
      return x - 0.25 * (h + 1) * np.abs(t - s) + table.astype(np.float64)[h, t - s + S]

    return (
      dict(is_causal=True, score_mod=score_mod),
      dict(vis=_visible(B, N, T, S, causal=True), score_mod=reference_mod),
    )
  raise AssertionError(name)


CASES = (
  "causal+lengths",
  "array mask+bias+softcap",
  "window+mask object+sinks",
  "score_mod+causal",
)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_against_float64_reference(case, impl):
  q, k = _inputs()
  kw, rkw = _case(case)
  ref, vis = _reference(q, k, **rkw)
  assert ref["masked_rows"].sum() > 0 or case.startswith(("window", "score_mod"))
  checks = [
    (diagnostics.attention_stats(q, k, per_query=True, **kw, **IMPLS[impl]), ref, (2, 4, 19))
  ]
  if impl == "dense":
    # The reduction over rows is shared code after the per-row pass; checking it once suffices.
    checks.append(
      (
        diagnostics.attention_stats(q, k, **kw, **IMPLS[impl]),
        _per_head(ref, vis, rkw.get("sinks") is not None),
        (2, 4),
      )
    )
  for got, want, shape in checks:
    for f in FIELDS:
      g = np.asarray(getattr(got, f))
      assert g.shape == shape, (f, g.shape)
      np.testing.assert_allclose(
        g.astype(np.float64), want[f], rtol=2e-5, atol=2e-5, err_msg=f"{f} ({case}, {impl})"
      )


def test_chunked_equals_dense():
  # Bottom-right causal (T > S: the first T - S queries see nothing) with kv lengths and sinks:
  # skipped, partial and full blocks, ragged edges on both axes, a fully masked example.
  q, k = _inputs(T=40, S=33, seed=3)
  kw = dict(
    is_causal="bottom_right",
    key_value_seq_lengths=jnp.asarray([30, 5], jnp.int32),
    sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32),
    per_query=True,
  )
  dense = diagnostics.attention_stats(q, k, implementation="dense", **kw)
  chunked = diagnostics.attention_stats(
    q, k, implementation="chunked", block_q=16, block_kv=7, **kw
  )
  assert int(dense.masked_rows.sum()) > 0 and float(dense.saturated_fraction.sum()) > 0
  for f in FIELDS:
    np.testing.assert_allclose(
      np.asarray(getattr(chunked, f)).astype(np.float64),
      np.asarray(getattr(dense, f)).astype(np.float64),
      rtol=1e-5,
      atol=1e-5,
      err_msg=f,
    )


def test_masked_rows_agree_with_attention_output():
  # Rows reported fully masked are exactly the rows jattn returns as 0.
  q, k = _inputs(B=2, T=12, S=10, N=2, K=2)
  seg_q = jnp.asarray([[0] * 4 + [1] * 4 + [2] * 4, [0] * 12], jnp.int32)
  seg_kv = jnp.asarray([[0] * 5 + [1] * 5, [0] * 10], jnp.int32)
  kw = dict(q_segment_ids=seg_q, kv_segment_ids=seg_kv)
  st = diagnostics.attention_stats(q, k, per_query=True, **kw)
  out = jattn.dot_product_attention(q, k, k, **kw)  # (B, T, N, H)
  zero_rows = np.transpose(np.all(np.asarray(out) == 0, axis=-1), (0, 2, 1))
  np.testing.assert_array_equal(np.asarray(st.masked_rows) == 1, zero_rows)
  assert int(st.masked_rows.sum()) == 2 * 4  # segment 2 of example 0 has no keys, both heads
  assert float(jnp.abs(st.max_prob[0, :, 8:]).max()) == 0.0


def test_minus_inf_bias_is_a_mask_and_gives_no_nan():
  q, k = _two_keys([0.0, 1.0, 2.0])
  bias = jnp.asarray([[[[0.0, -jnp.inf, 0.0]]]], jnp.float32)
  st = diagnostics.attention_stats(q, k, bias, scale=1.0)
  ref = diagnostics.attention_stats(q[:, :, :, :], k[:, ::2], scale=1.0)
  for f in FIELDS:
    np.testing.assert_allclose(
      np.asarray(getattr(st, f)).astype(np.float64),
      np.asarray(getattr(ref, f)).astype(np.float64),
      rtol=1e-6,
    )
  all_inf = jnp.full((1, 1, 1, 3), -jnp.inf, jnp.float32)
  st = diagnostics.attention_stats(q, k, all_inf, scale=1.0, per_query=True)
  assert int(st.masked_rows[0, 0, 0]) == 1
  assert all(np.isfinite(np.asarray(x, np.float64)).all() for x in st)


def test_bfloat16_inputs_use_float32_statistics():
  q, k = _inputs(dtype=jnp.bfloat16)
  st = diagnostics.attention_stats(q, k, is_causal=True)
  assert st.entropy.dtype == jnp.float32 and st.masked_rows.dtype == jnp.int32
  ref, vis = _reference(
    q.astype(jnp.float32), k.astype(jnp.float32), vis=_visible(2, 4, 19, 23, causal=True)
  )
  np.testing.assert_allclose(st.entropy, _per_head(ref, vis, False)["entropy"], rtol=1e-5)


def test_unbatched_and_jit_without_retracing():
  q, k = _inputs(B=1)
  traces = []

  @jax.jit
  def f(q, k, lengths):
    traces.append(1)
    return diagnostics.attention_stats(q, k, key_value_seq_lengths=lengths)

  a = f(q, k, jnp.asarray([23], jnp.int32))  # every key: the same as no mask
  b = f(q * 2.0, k, jnp.asarray([5], jnp.int32))
  assert len(traces) == 1
  assert float(a.max_logit[0, 0]) != float(b.max_logit[0, 0])
  unbatched = diagnostics.attention_stats(q[0], k[0])
  assert unbatched.entropy.shape == (4,)
  for f_ in FIELDS:
    np.testing.assert_allclose(
      np.asarray(getattr(unbatched, f_)).astype(np.float64),
      np.asarray(getattr(a, f_))[0].astype(np.float64),
      rtol=1e-6,
    )


def test_bad_arguments():
  q, k = _inputs()
  with pytest.raises(ValueError, match="saturation_threshold"):
    diagnostics.attention_stats(q, k, saturation_threshold=0.0)
  with pytest.raises(TypeError, match="saturation_threshold"):
    diagnostics.attention_stats(q, k, saturation_threshold="high")
  with pytest.raises(TypeError, match="per_query"):
    diagnostics.attention_stats(q, k, per_query=1)
  with pytest.raises(ValueError, match="implementation"):
    diagnostics.attention_stats(q, k, implementation="flash")
  with pytest.raises(ValueError, match="heads"):
    diagnostics.attention_stats(q, k[:, :, :1].repeat(3, axis=2))
  with pytest.raises(TypeError, match="AttentionStats"):
    diagnostics._resolve(lambda: 3.0)


# --------------------------------------------------------------------------------------------
# Collection from Flax modules.
# --------------------------------------------------------------------------------------------


def test_sow_linen_is_lazy_and_collects():
  import flax.linen as nn

  calls = []

  class Probe(nn.Module):
    @nn.compact
    def __call__(self, q, k):
      def compute():
        calls.append(1)
        return diagnostics.attention_stats(q, k, is_causal=True)

      diagnostics.sow_linen(self, compute)
      return jattn.dot_product_attention(q, k, k, is_causal=True)

  q, k = _inputs()
  m = Probe()
  m.apply({}, q, k)
  assert not calls  # not collecting: nothing computed
  _, state = m.apply({}, q, k, mutable=["intermediates"])
  (stats,) = state["intermediates"][diagnostics.COLLECTION_NAME]
  want = diagnostics.attention_stats(q, k, is_causal=True)
  np.testing.assert_array_equal(stats.entropy, want.entropy)


def test_sow_nnx_collects():
  from flax import nnx

  class Probe(nnx.Module):
    def __call__(self, q, k):
      diagnostics.sow_nnx(self, diagnostics.attention_stats(q, k, is_causal=True))
      return jattn.dot_product_attention(q, k, k, is_causal=True)

  q, k = _inputs()
  forward = nnx.capture(nnx.Intermediate)(lambda m, q, k: m(q, k))
  _, inter = forward(Probe(), q, k)
  (stats,) = inter[diagnostics.COLLECTION_NAME]
  want = diagnostics.attention_stats(q, k, is_causal=True)
  np.testing.assert_array_equal(stats.max_prob, want.max_prob)


def test_modules_collect_stats_of_their_own_attention():
  """jattn.linen / jattn.nnx MultiHeadAttention(collect_stats=True) record the statistics of the
  attention they compute (checked against attention_stats on their own projected q and k), and
  record nothing when off."""
  from flax import nnx

  x = jax.random.normal(jax.random.key(0), (2, 24, 16))
  seg = jnp.asarray(np.repeat([[0] * 10 + [1] * 14], 2, axis=0), jnp.int32)
  kw = dict(num_heads=4, num_kv_heads=2, is_causal=True, logits_soft_cap=30.0)
  lin = jattn.linen.MultiHeadAttention(**kw, collect_stats=True)
  params = lin.init(jax.random.key(1), x)
  _, state = lin.apply(params, x, q_segment_ids=seg, kv_segment_ids=seg, mutable=["intermediates"])
  (got,) = state["intermediates"][diagnostics.COLLECTION_NAME]
  p = params["params"]
  q = jnp.einsum("btd,dnh->btnh", x, p["query"]["kernel"]) + p["query"]["bias"][None, None]
  k = jnp.einsum("btd,dnh->btnh", x, p["key"]["kernel"]) + p["key"]["bias"][None, None]
  want = diagnostics.attention_stats(
    q, k, is_causal=True, logits_soft_cap=30.0, q_segment_ids=seg, kv_segment_ids=seg
  )
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Off: no collection is created even when 'intermediates' is mutable.
  off = jattn.linen.MultiHeadAttention(**kw)
  _, state = off.apply(params, x, mutable=["intermediates"])
  assert not state.get("intermediates")

  mod = jattn.nnx.MultiHeadAttention(
    num_heads=4,
    in_features=16,
    num_kv_heads=2,
    is_causal=True,
    logits_soft_cap=30.0,
    collect_stats=True,
    rngs=nnx.Rngs(0),
  )
  forward = nnx.capture(nnx.Intermediate)(lambda m, x: m(x))
  _, inter = forward(mod, x)
  (got,) = inter[diagnostics.COLLECTION_NAME]
  q = mod.query(x)
  k = mod.key(x)
  want = diagnostics.attention_stats(q, k, is_causal=True, logits_soft_cap=30.0)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
