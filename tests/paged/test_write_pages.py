"""`jattn.write_pages`: a serving engine's cache writes, checked through what is read after.

An engine run (ragged prefill chunks and decodes of several requests, a finished request's pages
given to a new one) writes each step's tokens with write_pages and attends with
paged_attention; every step's output is compared with a float64 NumPy reference over each
request's tokens kept contiguously -- quantised as the definition says (per token and head, the
largest magnitude at the dtype's largest value), written plainly here.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

K, H, N, PS, P = 2, 8, 4, 4, 24


def quantized(x, dtype):
  """x (..., H) float32 as its pool stores it, dequantised (float64): each token and head
  scaled so its largest magnitude is the dtype's largest, then rounded to the dtype."""
  if dtype is None:
    return np.asarray(x, np.float64)
  x = np.asarray(x, np.float32)
  dtype = np.dtype(dtype)
  top = np.float32(127.0 if dtype == np.int8 else float(jnp.finfo(dtype).max))
  amax = np.abs(x).max(axis=-1, keepdims=True)
  scale = np.where(amax > 0, amax / top, np.float32(1))
  y = np.clip(x / scale, -top, top)
  y = np.round(y) if dtype == np.int8 else y
  return y.astype(dtype).astype(np.float64) * scale


def attend(q, keys, values, n):
  """Float64: the last n of a request's len(keys) tokens, queries q (n, N, H), causal."""
  L = keys.shape[0]
  G = N // K
  s = np.einsum("tnh,snh->nts", q, np.repeat(keys, G, axis=1)) / np.sqrt(H)
  pos = np.arange(L - n, L)[:, None]
  s = np.where(np.arange(L)[None, :] <= pos, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("nts,snh->tnh", p, np.repeat(values, G, axis=1))


def pools(dtype, layout):
  pool_dtype = jnp.float32 if dtype is None else dtype
  shape = (P, K, PS, H) if layout == "HND" else (P, PS, 2 * K if layout == "combined" else K, H)
  kp = jnp.zeros(shape, pool_dtype)
  vp = None if layout == "combined" else jnp.zeros(shape, pool_dtype)
  scale_shape = (P, K, PS) if layout == "HND" else (P, PS, K)
  scales = (None, None) if dtype is None else (jnp.ones(scale_shape), jnp.ones(scale_shape))
  return kp, vp, scales


# (request, new tokens) per step; request 1 finishes after step 2 and request 3 takes its pages.
# Request 2 is in the first step's batch with no tokens yet (an empty sequence: nothing written,
# nothing attended). Every step has three sequences and ROWS query rows (its tokens, then
# padding), so the jitted step compiles once for the whole run.
STEPS = [
  [(0, 5), (1, 3), (2, 0)],
  [(0, 1), (1, 4), (2, 6)],
  [(0, 1), (2, 1), (3, 7)],
  [(0, 1), (2, 1), (3, 1)],
]
ROWS = 15  # at least two rows of padding past the last request in every step
PAGES = {0: [7, 2, 11], 1: [4, 9, 0], 2: [15, 1, 20], 3: [9, 4, 0]}  # 3 reuses 1's pages


@pytest.mark.parametrize("layout", ["NHD", "HND", "combined"])
@pytest.mark.parametrize("dtype", [None, jnp.int8, jnp.float8_e4m3fn])
def test_engine_run_matches_contiguous_float64(dtype, layout):
  rng = np.random.default_rng(0)
  kp, vp, (ks, vs) = pools(dtype, layout)
  history = {r: (np.zeros((0, K, H)), np.zeros((0, K, H))) for r in PAGES}
  step = jax.jit(
    lambda kp, vp, ks, vs, table, lens, qs, q, k, v: _step(
      kp, vp, ks, vs, table, lens, qs, q, k, v, layout
    ),
    donate_argnums=(0, 1, 2, 3),
  )
  for batch in STEPS:
    counts = [n for _, n in batch]
    total = ROWS
    lens = np.array([history[r][0].shape[0] + n for r, n in batch], np.int32)
    table = np.array([PAGES[r] for r, _ in batch], np.int32)
    qs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    q, k, v = (rng.normal(size=(total, n, H)).astype(np.float32) for n in (N, K, K))
    out, (kp, vp, ks, vs) = step(kp, vp, ks, vs, table, lens, qs, q, k, v)
    assert qs[-1] <= ROWS - 2
    for i, (r, n) in enumerate(batch):
      rows = slice(qs[i], qs[i + 1])
      keys = np.concatenate([history[r][0], quantized(k[rows], dtype)])
      values = np.concatenate([history[r][1], quantized(v[rows], dtype)])
      history[r] = (keys, values)
      if n:
        want = attend(q[rows].astype(np.float64), keys, values, n)
        np.testing.assert_allclose(np.asarray(out[rows]), want, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(out[qs[-1] :]), 0)
    if batch is STEPS[1]:  # request 1 finishes: a new request's tokens start over its pages
      history[3] = (np.zeros((0, K, H)), np.zeros((0, K, H)))


def _step(kp, vp, ks, vs, table, lens, qs, q, k, v, layout):
  kp, vp, ks, vs = jattn.write_pages(
    kp, vp, table, lens, k, v, query_start=qs, k_scale=ks, v_scale=vs, kv_layout=layout
  )
  out = jattn.paged_attention(
    q, kp, vp, table, lens, query_start=qs, k_scale=ks, v_scale=vs, kv_layout=layout
  )
  return out, (kp, vp, ks, vs)


@pytest.mark.parametrize("dtype", [None, jnp.int8])
def test_donated_pools_are_updated_in_place(dtype):
  """The compiled program aliases every donated pool and scale to its update and needs no
  temporary the size of a pool (the scatter writes where the pool lies)."""
  shape = (512, 16, K, 64)  # pools far larger than a step's tokens
  kp, vp = (jnp.zeros(shape, jnp.float32 if dtype is None else dtype) for _ in "kv")
  ks, vs = (None if dtype is None else jnp.ones(shape[:3]) for _ in "kv")
  table = np.arange(2 * 3, dtype=np.int32).reshape(2, 3)
  k = jnp.ones((2, 1, K, 64))
  write = jax.jit(
    jattn.write_pages, donate_argnames=("key_pages", "value_pages", "k_scale", "v_scale")
  )
  compiled = write.lower(kp, vp, table, np.array([3, 5]), k, k, k_scale=ks, v_scale=vs).compile()
  donated = [x for x in (kp, vp, ks, vs) if x is not None]
  stats = compiled.memory_analysis()
  assert stats.alias_size_in_bytes == sum(x.nbytes for x in donated)
  assert stats.temp_size_in_bytes < min(x.nbytes for x in donated) // 8
  assert len(re.findall(r"may-alias|must-alias", compiled.as_text())) >= len(donated)


def test_padded_tokens_land_at_the_fill_level_and_negative_positions_are_dropped():
  kp, vp, _ = pools(None, "NHD")
  table = np.array([[3, 5], [6, 2]], np.int32)
  k = jnp.asarray(np.arange(2 * 3 * K * H, dtype=np.float32).reshape(2, 3, K, H) + 1)
  new = jattn.write_pages(kp, vp, table, np.array([6, 2]), k, -k)
  got = np.asarray(new.key_pages)
  # request 0: positions 3, 4, 5 -> page 3 slot 3, page 5 slots 0, 1
  np.testing.assert_array_equal(got[3, 3], k[0, 0])
  np.testing.assert_array_equal(got[5, :2], k[0, 1:])
  # request 1 (2 tokens cached, 3 new): the first new token would sit at position -1
  np.testing.assert_array_equal(got[6, :2], k[1, 1:])
  np.testing.assert_array_equal(np.asarray(new.value_pages)[6, :2], -k[1, 1:])
  assert np.count_nonzero(got.any(axis=(2, 3))) == 5
  assert new.k_scale is None and new.v_scale is None


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_padded_write_with_fewer_new_tokens_keeps_the_cache(traced):
  """Speculative decoding accepts a different number of drafts per sequence: padded (B, T) with
  left padding. new_lengths says how many rows are new; the padding rows before them must not
  overwrite cached tokens (the issue's reproduction: sequence 1 has 3 cached tokens of 7.0 and
  one new token, its row 0 padding), and the next decode step equals float64 on the
  contiguous tokens."""
  kp = jnp.zeros((P, PS, K, H), jnp.float32).at[2, :3].set(7.0)
  table = np.array([[0, 1], [2, 3]], np.int32)
  rng = np.random.default_rng(5)
  acc = rng.normal(size=(2, 2, K, H)).astype(np.float32)
  acc[1, 0] = 0.0  # padding
  write = jax.jit(jattn.write_pages) if traced else jattn.write_pages
  new = write(kp, kp + 0, table, np.array([2, 4]), acc, acc, new_lengths=np.array([2, 1]))
  got = np.asarray(new.key_pages)
  np.testing.assert_array_equal(got[2, :3], 7.0)  # the cached tokens survive
  np.testing.assert_array_equal(got[2, 3], acc[1, 1])  # the one new token at position 3
  np.testing.assert_array_equal(got[0, :2], acc[0])  # sequence 0: both rows new
  assert np.count_nonzero(got.any(axis=(2, 3))) == 2 + 4
  # The next step of sequence 1 (one query, 5 tokens: 4 cached + itself) against float64.
  q = rng.normal(size=(2, 1, N, H)).astype(np.float32)
  nk = rng.normal(size=(2, 1, K, H)).astype(np.float32)
  step = write(new.key_pages, new.value_pages, table, np.array([3, 5]), nk, nk)
  out = jattn.paged_attention(q, step.key_pages, step.value_pages, table, np.array([3, 5]))
  seq1 = np.concatenate([np.full((3, K, H), 7.0), acc[1, 1:], nk[1]]).astype(np.float64)
  np.testing.assert_allclose(out[1], attend(q[1].astype(np.float64), seq1, seq1, 1), atol=2e-6)
  # Without new_lengths every row is new: row 0 of sequence 1 lands on position 2.
  plain = np.asarray(jattn.write_pages(kp, kp + 0, table, np.array([2, 4]), acc, acc).key_pages)
  np.testing.assert_array_equal(plain[2, 2], 0.0)


def test_new_lengths_is_checked():
  kp, vp, _ = pools(None, "NHD")
  k = jnp.ones((2, 2, K, H))
  table = np.array([[0, 1], [2, 3]], np.int32)
  lens = np.array([2, 1])
  with pytest.raises(
    ValueError, match=re.escape("new_lengths[1]=2 must be in [0, T=2] and at most kv_lengths[1]=1")
  ):
    jattn.write_pages(kp, vp, table, lens, k, k, new_lengths=np.array([1, 2]))
  with pytest.raises(ValueError, match=re.escape("new_lengths[0]=3 must be in [0, T=2]")):
    jattn.write_pages(kp, vp, table, lens, k, k, new_lengths=np.array([3, 0]))
  with pytest.raises(ValueError, match=re.escape("new_lengths must be (B,) = (2,)")):
    jattn.write_pages(kp, vp, table, lens, k, k, new_lengths=np.array([1]))
  with pytest.raises(TypeError, match="new_lengths must be an integer array"):
    jattn.write_pages(kp, vp, table, lens, k, k, new_lengths=np.array([1.0, 1.0]))
  with pytest.raises(ValueError, match="new_lengths is for the padded form"):
    jattn.write_pages(
      kp, vp, table, lens, k[0], k[0], query_start=np.array([0, 1, 2]), new_lengths=lens
    )
  # Traced counts out of range: that sequence writes nothing, the other writes its tokens.
  new = jax.jit(jattn.write_pages)(kp, vp, table, lens, k, 2 * k, new_lengths=jnp.array([1, 5]))
  written = np.asarray(new.key_pages).any(axis=(1, 2, 3))
  assert written.tolist() == [True] + [False] * (P - 1)


def test_keys_only_pool_and_calibrated_scales():
  """A latent pool (absorbed MLA: value_pages=None, value=None) and per-head int8 scales: the
  tokens divided by the given scale, rounded, the scale returned as it was."""
  pages = jnp.zeros((P, PS, 1, H), jnp.int8)
  scale = jnp.asarray([0.05], jnp.float32)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 2, 1, H)), jnp.float32)
  new = jattn.write_pages(pages, None, np.array([[4]]), np.array([2]), x, None, k_scale=scale)
  assert new.value_pages is None and new.v_scale is None and new.k_scale is scale
  want = np.clip(np.round(np.asarray(x[0]) / np.float32(0.05)), -127, 127)
  np.testing.assert_array_equal(np.asarray(new.key_pages)[4, :2], want)


def test_traced_faulty_metadata_writes_nothing_of_that_request():
  """A page id out of range under jit (it cannot raise there) must not be clamped onto another
  request's page: that request writes nothing, the others write their tokens."""
  kp, vp, _ = pools(None, "NHD")
  k = jnp.ones((2, 1, K, H))
  table = np.array([[P + 3], [P - 1]], np.int32)
  new = jax.jit(jattn.write_pages)(kp, vp, table, np.array([1, 1]), k, k)
  written = np.asarray(new.key_pages).any(axis=(1, 2, 3))
  assert written.tolist() == [False] * (P - 1) + [True]
  with pytest.raises(ValueError, match=re.escape(f"page_table[0, 0]={P + 3} is not a page")):
    jattn.write_pages(kp, vp, table, np.array([1, 1]), k, k)


def test_checkify_names_the_faulty_request():
  from jax.experimental import checkify

  kp, vp, _ = pools(None, "NHD")
  k = jnp.ones((2, 1, K, H))
  f = checkify.checkify(
    jax.jit(lambda t: jattn.write_pages(kp, vp, t, np.array([1, 1]), k, k, on_invalid="checkify"))
  )
  err, _ = f(jnp.array([[0], [-1]], jnp.int32))
  assert "sequence 1 breaks metadata rule 2" in str(err.get())


@pytest.mark.parametrize(
  "change, error, message",
  [
    (dict(key=jnp.ones((2, 1, K + 1, H))), ValueError, "key must be (B, T, K, H) = (B, T, 2, 8)"),
    (dict(value=jnp.ones((2, 2, K, H))), ValueError, "value must have key's tokens"),
    (dict(key=jnp.ones((2, 1, K, H), jnp.bfloat16)), TypeError, "key.dtype=bfloat16"),
    (dict(value=None), TypeError, "value must be the new values, (B, T, K, Hv)"),
    (dict(value_pages=None), ValueError, "pass value=None"),
    (dict(page_table=np.zeros((3, 2), np.int32)), ValueError, "kv_lengths must be (B,) = (3,)"),
    (dict(page_table=np.zeros((2, 2))), TypeError, "page_table must be an integer array"),
    (dict(k_scale=jnp.ones(())), ValueError, "k_scale is for int8 / float8 pages"),
    (dict(kv_layout="NDH"), ValueError, "kv_layout must be one of"),
    (dict(on_invalid="nan"), ValueError, "on_invalid must be one of ('skip', 'checkify')"),
    (dict(query_start=np.array([0, 1])), ValueError, "query_start must be (B + 1,) = (3,)"),
    (dict(key="keys"), TypeError, "key must be a floating array"),
  ],
)
def test_bad_calls_name_the_argument(change, error, message):
  kp, vp, _ = pools(None, "NHD")
  call = dict(
    key_pages=kp,
    value_pages=vp,
    page_table=np.zeros((2, 2), np.int32),
    kv_lengths=np.array([1, 1]),
    key=jnp.ones((2, 1, K, H)),
    value=jnp.ones((2, 1, K, H)),
  )
  call.update(change)
  with pytest.raises(error, match=re.escape(message)):
    jattn.write_pages(**call)


def test_quantised_pool_needs_its_scales():
  pages = jnp.zeros((P, PS, K, H), jnp.int8)
  k = jnp.ones((1, 1, K, H))
  with pytest.raises(ValueError, match="need k_scale"):
    jattn.write_pages(pages, pages + 0, np.array([[0]]), np.array([1]), k, k)
  with pytest.raises(ValueError, match=re.escape("k_scale must be () per tensor, (K,) = (2,)")):
    jattn.write_pages(
      pages,
      pages + 0,
      np.array([[0]]),
      np.array([1]),
      k,
      k,
      k_scale=jnp.ones(3),
      v_scale=jnp.ones(()),
    )


def test_a_faulty_query_start_moves_no_sound_sequence_rows():
  """Traced offsets where sequence 2 starts before sequence 1 ends: sequence 2 (and 3, whose
  run starts before 2's end) are faulty and write nothing; 0 and 1 write every token, each at
  its own position (rows are matched to the sound run holding them, not counted by starts)."""
  table = np.arange(8, dtype=np.int32).reshape(4, 2)
  lens = np.array([2, 2, 4, 4], np.int32)
  pages = jnp.zeros((8, 4, 1, 2))
  key = jnp.arange(1.0, 6.0)[:, None, None] * jnp.ones((5, 1, 2))
  write = jax.jit(
    lambda qs: jattn.write_pages(pages, pages + 0, table, lens, key, key, query_start=qs)
  )
  got = np.asarray(write(jnp.array([0, 2, 4, 1, 5], jnp.int32)).key_pages)[..., 0, 0]
  np.testing.assert_array_equal(got[0, :2], [1, 2])  # sequence 0: rows 0, 1 at positions 0, 1
  np.testing.assert_array_equal(got[2, :2], [3, 4])  # sequence 1: rows 2, 3
  assert not got[4:].any()  # sequences 2, 3: nothing


def test_padded_write_exports_with_a_symbolic_batch():
  b = jax.export.symbolic_shape("b")[0]
  spec = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
  exported = jax.export.export(jax.jit(jattn.write_pages))(
    spec((P, PS, K, H)),
    spec((P, PS, K, H)),
    spec((b, 3), jnp.int32),
    spec((b,), jnp.int32),
    spec((b, 2, K, H)),
    spec((b, 2, K, H)),
  )
  kp, vp, _ = pools(None, "NHD")
  k = jnp.ones((2, 2, K, H))
  new = exported.call(
    kp, vp, np.array([[0, 1, 2], [5, 6, 7]], np.int32), np.array([2, 6]), k, 2 * k
  )
  want = jattn.write_pages(kp, vp, np.array([[0, 1, 2], [5, 6, 7]]), np.array([2, 6]), k, 2 * k)
  np.testing.assert_array_equal(new[1], want.value_pages)
  assert np.asarray(want.value_pages)[6, :2].min() == 2


def test_bfloat16_token_scales_are_stored_as_the_tokens_were_divided():
  """Per-token scales kept in bfloat16: the tokens are divided by the scale as stored, so the
  stored scale times the stored int8 is within int8 rounding of the token."""
  pages = jnp.zeros((P, PS, K, H), jnp.int8)
  scales = jnp.ones((P, PS, K), jnp.bfloat16)
  x = jnp.asarray(np.random.default_rng(4).normal(size=(1, 2, K, H)) * 3, jnp.float32)
  new = jattn.write_pages(
    pages, pages + 0, np.array([[2]]), np.array([2]), x, x, k_scale=scales, v_scale=scales
  )
  assert new.k_scale.dtype == jnp.bfloat16
  got = (
    np.asarray(new.key_pages[2, :2], np.float64)
    * np.asarray(new.k_scale[2, :2], np.float64)[..., None]
  )
  step = np.asarray(new.k_scale[2, :2], np.float64)[..., None]
  assert (np.abs(got - np.asarray(x[0])) <= 0.5 * step + 1e-7).all()


def test_a_calibration_must_be_positive():
  pages = jnp.zeros((P, PS, K, H), jnp.int8)
  k = jnp.ones((1, 1, K, H))
  with pytest.raises(ValueError, match=re.escape("k_scale must be > 0")):
    jattn.write_pages(
      pages,
      pages + 0,
      np.array([[0]]),
      np.array([1]),
      k,
      k,
      k_scale=jnp.zeros(()),
      v_scale=jnp.ones(()),
    )


@pytest.mark.parametrize("layout", ["NHD", "HND", "combined"])
@pytest.mark.parametrize("dtype", [None, jnp.int8])
def test_numpy_pools_on_every_layout(layout, dtype):
  """paged_attention takes NumPy pools, so write_pages does (it returns jax arrays): the same
  pools as jax arrays give the same result, bit for bit."""
  kp, vp, (ks, vs) = pools(dtype, layout)
  k = jnp.asarray(np.random.default_rng(2).normal(size=(2, 2, K, H)), jnp.float32)
  table, lens = np.array([[3, 5], [6, 2]], np.int32), np.array([6, 3], np.int32)
  as_numpy = lambda x: None if x is None else np.asarray(x)
  want = jattn.write_pages(kp, vp, table, lens, k, -k, k_scale=ks, v_scale=vs, kv_layout=layout)
  got = jattn.write_pages(
    *map(as_numpy, (kp, vp)),
    table,
    lens,
    k,
    -k,
    k_scale=as_numpy(ks),
    v_scale=as_numpy(vs),
    kv_layout=layout,
  )
  for g, w in zip(got, want):
    if w is None:
      assert g is None
    else:
      np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("scale_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_token_scales_divide_the_tokens_exactly_as_stored(dtype, scale_dtype):
  """Per-token scales: each stored token is the token divided by its scale *as stored* (rounded
  to the scales' dtype first), rounded (int8) and clipped, bit for bit: dividing by the
  unrounded scale leaves the dequantised value up to 0.75 int8 steps off (bf16 scales)."""
  pages = jnp.zeros((P, PS, K, H), dtype)
  scales = jnp.ones((P, PS, K), scale_dtype)
  x = np.random.default_rng(7).normal(size=(2, 8, K, H)).astype(np.float32) * 3
  table = np.array([[0, 1], [2, 3]], np.int32)
  new = jattn.write_pages(
    pages, pages + 0, table, np.array([8, 8]), x, x, k_scale=scales, v_scale=scales
  )
  stored = np.asarray(new.k_scale, np.float32)[table].reshape(2, 8, K)
  top = np.float32(127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max))
  want = np.clip(x / stored[..., None], -top, top)
  want = (np.round(want) if dtype == jnp.int8 else want).astype(dtype)
  got = np.asarray(new.key_pages)[table].reshape(2, 8, K, H)
  np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
  # The scale itself: the largest magnitude over the dtype's largest (XLA may divide by a
  # reciprocal: within an ulp), in the scales' dtype.
  amax = np.abs(x).max(axis=-1)
  want_scale = (amax / top).astype(scale_dtype).astype(np.float32)
  np.testing.assert_allclose(stored, want_scale, rtol=float(jnp.finfo(scale_dtype).eps), atol=0)


def _marked_pools():
  """Key and value pools whose every slot holds its own value: a write shows where it landed
  and that nothing else moved."""
  base = np.arange(P * PS, dtype=np.float32).reshape(P, PS, 1, 1) + 1000
  kp = np.broadcast_to(base, (P, PS, K, H)).copy()
  return jnp.asarray(kp), jnp.asarray(-kp)


def _expected_write(pool, table, lens, runs, new, faulty):
  """The pool after write_pages, by its definition: sound sequence b's i-th of its n_b new
  tokens (rows ``runs[b]``) at position lens[b] - n_b + i, through its table; a position below
  0 or past the table nowhere; a faulty sequence's nowhere."""
  pool = np.array(pool)
  for b, rows in enumerate(runs):
    if b in faulty:
      continue
    for i, r in enumerate(rows):
      p = lens[b] - len(rows) + i
      if 0 <= p < table.shape[1] * PS:
        pool[table[b, p // PS], p % PS] = np.asarray(new[r])
  return pool


@pytest.mark.parametrize(
  "fault,form",
  [
    ("length", "padded"),
    ("page", "padded"),
    ("length", "ragged"),
    ("page", "ragged"),
    ("start", "ragged"),
    ("rows", "ragged"),
  ],
)
def test_a_traced_faulty_sequence_writes_nothing_of_any_fault_kind(fault, form):
  """Under jit a faulty sequence writes nothing -- also where its own page ids are in range
  (the page-range check alone would not stop it) -- and every other sequence writes exactly
  its tokens: both pools compared bit for bit with the definition's."""
  kp, vp = _marked_pools()
  # Sequence 0 (pages 4, 5) and 2 (pages 8, 9) sound, sequence 1 (pages 6, 7) faulty.
  table = np.array([[4, 5], [6, 7], [8, 9]], np.int32)
  lens = np.array([5, 6, 3], np.int32)
  faulty = {1}
  if fault == "length":
    lens[1] = 2 * PS + 1  # past the table's capacity; its new tokens would land in page 7
  elif fault == "page":
    table[1, 0] = P + 3  # out of range in a column its length covers; page 7 is in range
  elif fault == "rows":
    lens[1] = 1  # two new rows, one cached token
  if form == "padded":
    runs = [[0, 1], [2, 3], [4, 5]]
    new = jnp.asarray(np.arange(6 * K * H, dtype=np.float32).reshape(6, K, H))
    key, kw = new.reshape(3, 2, K, H), {}
  else:
    runs = [[0, 1], [2, 3], [4]]
    qs = np.array([0, 2, 4, 5], np.int32)
    if fault == "start":
      qs = np.array([0, 2, 1, 5], np.int32)  # sequence 1 ends before it starts; 2 overlaps
      faulty, runs = {1, 2}, [[0, 1], [], [1, 2, 3, 4]]
    new = jnp.asarray(np.arange(6 * K * H, dtype=np.float32).reshape(6, K, H))
    key, kw = new, dict(query_start=qs)
  got = jax.jit(jattn.write_pages)(kp, vp, table, lens, key, -key, **kw)
  want = _expected_write(kp, table, lens, runs, new, faulty)
  np.testing.assert_array_equal(np.asarray(got.key_pages), want)
  np.testing.assert_array_equal(np.asarray(got.value_pages), -want)


def test_ragged_padding_rows_write_nothing():
  """Rows past query_start[B] belong to no sequence: they write nowhere (not as sequence 0's
  tokens over its cached ones), eager and traced; whole pools compared bit for bit."""
  kp, vp = _marked_pools()
  table = np.array([[4, 5], [8, 9]], np.int32)
  lens = np.array([7, 3], np.int32)
  qs = np.array([0, 1, 2], np.int32)
  new = jnp.asarray(np.arange(5 * K * H, dtype=np.float32).reshape(5, K, H))  # 3 padding rows
  want = _expected_write(kp, table, lens, [[0], [1]], new, set())
  for write in (jattn.write_pages, jax.jit(jattn.write_pages)):
    got = write(kp, vp, table, lens, new, -new, query_start=qs)
    np.testing.assert_array_equal(np.asarray(got.key_pages), want)
    np.testing.assert_array_equal(np.asarray(got.value_pages), -want)
