"""`jattn.paged_attention` against a float64 NumPy reference written from its definition.

The definition: sequence b's cached tokens 0 .. kv_lengths[b] - 1 live in pages
page_table[b, 0], page_table[b, 1], ... of the pool, in order; its queries are its new tokens,
the last one at position kv_lengths[b] - 1; a query sees the keys its causality and window allow
(in positions) among the cached ones. Quantised pages are dequantised (value times scale) first.
"""

from __future__ import annotations

import re

import covering
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from covering import pairwise
from paged_reference import check, combined, head_major, normal, options, pool, reference

import jattn


def call(layout, q, kp, vp, table, lens, **kw):
  """paged_attention on the NHD pool given, or on the same pool laid out head-major."""
  if layout == "HND":
    kp, vp, ks, vs = head_major(kp, vp, kw.pop("k_scale", None), kw.pop("v_scale", None))
    kw.update({} if ks is None else dict(k_scale=ks, v_scale=vs), kv_layout="HND")
  return jattn.paged_attention(q, kp, vp, table, jnp.asarray(lens), **kw)


# Every pair of layout, page size (4: several pages to a block; 16), new tokens (1: decoding;
# 5: a prefill chunk) and heads (GQA, MQA, MHA) together once: 7 calls for the 24 combinations.
HEADS = {"GQA": (4, 2), "MQA": (4, 1), "MHA": (2, 2)}  # (N, K)
DECODE_ROWS = pairwise({"layout": ["NHD", "HND"], "ps": [4, 16], "T": [1, 5], "heads": list(HEADS)})


@pytest.mark.parametrize("row", DECODE_ROWS, ids=covering.ids(DECODE_ROWS))
def test_decode_and_chunked_prefill(row):
  layout, ps, T, (N, K) = row["layout"], row["ps"], row["T"], HEADS[row["heads"]]
  B, H, Hv = 3, 8, 8
  lens = np.array([37, 5, 64])
  kp, vp, table = pool(0, 40, ps, K, H, Hv, B, lens)
  q = normal(1, (B, T, N, H))
  out, lse = call(layout, q, kp, vp, table, lens, return_residual=True)
  want, want_lse = reference(q, kp, vp, table, lens)
  check(out, want)
  check(lse, want_lse)


@pytest.mark.parametrize(
  "kw",
  [
    dict(local_window_size=(6, 0)),
    dict(logits_soft_cap=2.0),
    dict(sinks=True),
    dict(is_causal=False),
    dict(is_causal=False, local_window_size=(3, 2)),
    dict(scale=0.3),
  ],
)
def test_options_against_reference(kw):
  B, N, K, H, Hv, T, ps = 3, 4, 2, 8, 12, 6, 8
  lens = np.array([30, 6, 19])
  kp, vp, table = pool(2, 16, ps, K, H, Hv, B, lens)
  q = normal(3, (B, T, N, H))
  kw, ref_kw = options(kw, N)
  out = jattn.paged_attention(q, kp, vp, table, jnp.asarray(lens), **kw)
  want, _ = reference(q, kp, vp, table, lens, **ref_kw)
  check(out, want)


def test_ragged_batch_with_empty_sequences_mixes_prefill_and_decode():
  # Five sequences: a prefill chunk of 21 rows (more than a tile), two decode tokens, one with
  # no new queries and one with an empty cache; GQA and a value head size of its own.
  N, K, H, Hv, ps = 4, 2, 8, 6, 8
  lens = np.array([40, 9, 17, 0, 3])
  counts = np.array([21, 1, 0, 0, 1])
  qs = np.concatenate([[0], np.cumsum(counts)])
  B = len(lens)
  kp, vp, table = pool(4, 24, ps, K, H, Hv, B, lens)
  q = normal(5, (int(qs[-1]), N, H))
  for kw in ({}, dict(local_window_size=(7, 0), sinks=jnp.ones(N))):
    out, lse = jattn.paged_attention(
      q, kp, vp, table, jnp.asarray(lens), query_start=jnp.asarray(qs), return_residual=True, **kw
    )
    want, want_lse = reference(
      q,
      kp,
      vp,
      table,
      lens,
      qs,
      window=kw.get("local_window_size"),
      sinks=None if "sinks" not in kw else np.ones(N),
    )
    check(out, want)
    finite = np.isfinite(want_lse)
    check(np.where(finite, lse, 0), np.where(finite, want_lse, 0))


# Every page size with either layout, and each with and without a window and soft cap.
LONG_ROWS = pairwise(
  {"ps": [64, 256, 300, 512], "layout": ["NHD", "HND"], "window_cap": [True, False]}
)


@pytest.mark.parametrize("row", LONG_ROWS, ids=covering.ids(LONG_ROWS))
def test_long_pages_in_either_layout(row):
  # Pages of 64 keys (two to a CPU block; head-major: multiplied page by page), of 256 and 512
  # (cut into blocks of 128 keys on the CPU, 256 in the accelerators' program, run here from
  # its cuda export) and of 300 (a page longer than a block, read whole); windows reach back
  # across page boundaries; Hv != H.
  ps, layout = row["ps"], row["layout"]
  B, N, K, H, Hv, T = 3, 4, 2, 8, 6, 3
  lens = np.array([700, 64, 301])
  P = sum(-(-int(L) // ps) for L in lens) + 3  # three pages of garbage
  kp, vp, table = pool(14, P, ps, K, H, Hv, B, lens)
  q = normal(15, (B, T, N, H))
  kw = dict(local_window_size=(100, 0), logits_soft_cap=3.0) if row["window_cap"] else {}
  out = call(layout, q, kp, vp, table, lens, **kw)
  want, _ = reference(
    q, kp, vp, table, lens, window=kw.get("local_window_size"), cap=kw.get("logits_soft_cap")
  )
  check(out, want)
  if ps == 512:  # the same call exported for cuda
    f = lambda q, kp, vp, t: call(layout, q, kp, vp, t, lens, **kw)
    exp = jax.export.export(
      jax.jit(f), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.platform()]
    )(q, kp, vp, table)
    check(exp.call(q, kp, vp, table), want)


# Every pair of scale kind, page dtype, layout and page size (256: cut into CPU blocks, scales
# too) together once: 9 calls for the 36 combinations.
QUANT_ROWS = pairwise(
  {
    "kind": ["tensor", "head", "token"],
    "dtype": [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2],
    "layout": ["NHD", "HND"],
    "ps": [8, 256],
  }
)


@pytest.mark.parametrize(
  "row",
  QUANT_ROWS,
  ids=covering.ids([dict(r, dtype=jnp.dtype(r["dtype"]).name) for r in QUANT_ROWS]),
)
def test_quantized_pages(row):
  dtype, kind, layout, ps = row["dtype"], row["kind"], row["layout"], row["ps"]
  B, N, K, H, Hv, T, P = 2, 4, 2, 16, 16, 3, 12
  lens = np.array([41, 20])
  kp, vp, table = pool(6, P, ps, K, H, Hv, B, lens, garbage=False)
  shape = {"tensor": (), "head": (K,), "token": (P, ps, K)}[kind]
  k_amax = np.abs(np.asarray(kp)).max(axis=-1)
  v_amax = np.abs(np.asarray(vp)).max(axis=-1)
  top = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
  reduce = {
    "tensor": lambda a: a.max(),
    "head": lambda a: a.max(axis=(0, 1)),
    "token": lambda a: a,
  }[kind]
  ks, vs = reduce(k_amax) / top, reduce(v_amax) / top
  quant = lambda x, s: (
    np.round(x / np.broadcast_to(s, x.shape[:3])[..., None])
    if dtype == jnp.int8
    else x / np.broadcast_to(s, x.shape[:3])[..., None]
  )
  kq = jnp.asarray(np.clip(quant(np.asarray(kp), ks), -top, top)).astype(dtype)
  vq = jnp.asarray(np.clip(quant(np.asarray(vp), vs), -top, top)).astype(dtype)
  q = normal(7, (B, T, N, H))
  ks, vs = jnp.asarray(ks, jnp.float32).reshape(shape), jnp.asarray(vs, jnp.float32).reshape(shape)
  if kind == "token":
    # Scales past each sequence's last token (unused pages, the tail of a last page) are
    # garbage: NaN must not leak through them.
    used = np.zeros((P, ps), bool)
    for b, L in enumerate(lens):
      for i in range(L):
        used[np.asarray(table)[b, i // ps], i % ps] = True
    ks, vs = (jnp.where(jnp.asarray(used)[..., None], x, jnp.nan) for x in (ks, vs))
  out = call(layout, q, kq, vq, table, lens, k_scale=ks, v_scale=vs)
  # Exactly the attention of the dequantised cache (float32 arithmetic) ...
  want, _ = reference(
    q,
    kq.astype(jnp.float32),
    vq.astype(jnp.float32),
    table,
    lens,
    ks=np.asarray(ks),
    vs=np.asarray(vs),
  )
  check(out, want)
  # ... which is within the quantisation's own error of the unquantised cache's.
  exact, _ = reference(q, kp, vp, table, lens)
  bound = {jnp.int8: 0.05, jnp.float8_e4m3fn: 0.15, jnp.float8_e5m2: 0.3}[dtype]
  assert np.abs(np.asarray(out) - exact).max() < bound


def test_bf16_queries_keep_float32_statistics():
  # bfloat16 in and out; the error against float64 within a few roundings of the output.
  B, N, K, H, T, ps = 2, 4, 2, 32, 4, 16
  lens = np.array([300, 77])
  kp, vp, table = pool(8, 32, ps, K, H, H, B, lens, garbage=False)
  q = normal(9, (B, T, N, H))
  bf = lambda x: x.astype(jnp.bfloat16)
  out = jattn.paged_attention(bf(q), bf(kp), bf(vp), table, jnp.asarray(lens))
  assert out.dtype == jnp.bfloat16
  want, _ = reference(
    bf(q).astype(jnp.float32), bf(kp).astype(jnp.float32), bf(vp).astype(jnp.float32), table, lens
  )
  rounding = np.abs(np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64) - want).max()
  assert np.abs(np.asarray(out, np.float64) - want).max() <= 4 * rounding + 1e-6


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_split_kv_program_for_accelerators(layout):
  # Exported for cuda (split-KV lanes, chosen where the program is lowered) and run here: the
  # same result; a decoding step against S = 16384 runs ceil(S / 256 / 16) = 4 sequential steps,
  # with nothing of the cache's size per query.
  from jattn.bench import structure

  B, N, K, H, ps = 2, 4, 2, 8, 16
  lens = np.array([200, 57])
  kp, vp, table = pool(10, 32, ps, K, H, H, B, lens)
  q = normal(11, (B, 1, N, H))
  want, _ = reference(q, kp, vp, table, lens)
  f = lambda q, kp, vp, t, l: jattn.paged_attention(q, kp, vp, t, l, kv_layout=layout)
  if layout == "HND":
    kp, vp, _, _ = head_major(kp, vp)
  args = (q, kp, vp, table, jnp.asarray(lens))
  exp = jax.export.export(
    jax.jit(f), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.platform()]
  )(*args)
  check(exp.call(*args), want)
  check(f(*args), want)
  S, P = 16384, 16384 // 16 * 4 + 64  # spare pages: a copy of the cache has another size
  page = (16, 8, 128) if layout == "NHD" else (8, 16, 128)
  # float32: compiled here, a bfloat16 program is first rewritten by the CPU compiler to
  # float32 (pools included), which a GPU's or TPU's compiler does not do.
  shapes = (
    jax.ShapeDtypeStruct((4, 1, 32, 128), jnp.float32),
    jax.ShapeDtypeStruct((P,) + page, jnp.float32),
    jax.ShapeDtypeStruct((P,) + page, jnp.float32),
    jax.ShapeDtypeStruct((4, S // 16), jnp.int32),
    jax.ShapeDtypeStruct((4,), jnp.int32),
  )
  # The XLA walk's program (on a TPU, None takes the Pallas kernel:
  # tests/paged/test_paged_kernels.py).
  walk = lambda q, kp, vp, t, l: jattn.paged_attention(
    q, kp, vp, t, l, kv_layout=layout, implementation="chunked"
  )
  for platform in ("cuda", "tpu"):
    hlo = structure.lowered_for(walk, shapes, platform)
    assert structure.loop_structure(hlo).steps <= -(-S // 256 // 16) + 2
    # No copy of the cache (every other array is under half a pool: a block of keys per lane)
    # and no array with an axis of all S keys (as the scores (B, N, T, S) would have).
    pool_size = P * 16 * 8 * 128
    seen = {
      tuple(int(d) for d in dims.split(",") if d)
      for dims in re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", hlo)
    }
    others = [x for x in seen if np.prod(x) != pool_size]
    assert max(np.prod(x) for x in others) < pool_size // 2, platform
    assert max(max(x, default=0) for x in seen) < S, platform


@pytest.mark.parametrize(
  "call, error, words",
  [
    (lambda a: dict(a, query=a["query"][0]), ValueError, r"query must be \(B, T, N, H\)"),
    (lambda a: dict(a, page_table=a["page_table"][0]), ValueError, "page_table must be"),
    (lambda a: dict(a, kv_lengths=a["kv_lengths"][:1]), ValueError, "kv_lengths must be"),
    (lambda a: dict(a, value_pages=a["value_pages"][:, :2]), ValueError, "value_pages must have"),
    (lambda a: dict(a, key_pages=a["key_pages"].astype(jnp.int8)), ValueError, "need k_scale"),
    (
      lambda a: dict(a, key_pages=a["key_pages"].astype(jnp.int8), k_scale=jnp.ones(3)),
      ValueError,
      "k_scale must be",
    ),
    (lambda a: dict(a, key_pages=a["key_pages"].astype(jnp.bfloat16)), TypeError, "dtype"),
    (lambda a: dict(a, page_table=a["page_table"].astype(jnp.float32)), TypeError, "page_table"),
    (lambda a: dict(a, sinks=jnp.ones(3)), ValueError, r"sinks must be \(N,\)"),
    (lambda a: dict(a, implementation="splash"), NotImplementedError, "jattn's own kernel"),
    (lambda a: dict(a, kv_layout="BSHD"), ValueError, "kv_layout must be"),
    (
      lambda a: dict(
        a,
        kv_layout="HND",
        key_pages=a["key_pages"].astype(jnp.int8),
        value_pages=a["value_pages"].astype(jnp.int8),
        k_scale=jnp.ones((8, 4, 2)),
        v_scale=jnp.ones((8, 2, 4)),
      ),
      ValueError,
      r"v_scale must be .*\(P, K, page_size\)",
    ),
  ],
)
def test_malformed_calls_name_the_argument(call, error, words):
  lens = np.array([10, 3])
  kp, vp, table = pool(12, 8, 4, 2, 8, 8, 2, lens)
  a = dict(
    query=jnp.ones((2, 1, 4, 8)),
    key_pages=kp,
    value_pages=vp,
    page_table=table,
    kv_lengths=jnp.asarray(lens),
  )
  with pytest.raises(error, match=words):
    jattn.paged_attention(**call(a))


def test_gradients_are_refused_with_a_clear_error():
  lens = np.array([10, 3])
  kp, vp, table = pool(13, 8, 4, 2, 8, 8, 2, lens)
  q = jnp.ones((2, 1, 4, 8))
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda q: jattn.paged_attention(q, kp, vp, table, jnp.asarray(lens)).sum())(q)


@pytest.mark.parametrize("ragged", [False, True])
def test_symbolic_number_of_sequences_exports_and_runs(ragged):
  # One exported decode step (padded) or engine step (ragged, a fixed row budget) for any number
  # of sequences B, lowered for cpu, cuda and tpu; each program runs here on two batch sizes
  # of 1, 3 and 5 (each size on two of the programs).
  from jax import export

  b = export.symbolic_shape("b")[0]
  P, ps, N, K, H, rows = 40, 8, 4, 2, 8, 12
  lens_all = np.array([37, 5, 64, 1, 20])
  kp, vp, table_all = pool(30, P, ps, K, H, H, 5, lens_all)
  sds = jax.ShapeDtypeStruct
  if ragged:
    f = lambda q, t, l, s: jattn.paged_attention(q, kp, vp, t, l, query_start=s)
    shapes = (
      sds((rows, N, H), jnp.float32),
      sds((b, table_all.shape[1]), jnp.int32),
      sds((b,), jnp.int32),
      sds((b + 1,), jnp.int32),
    )
  else:
    f = lambda q, t, l: jattn.paged_attention(q, kp, vp, t, l)
    shapes = (
      sds((b, 1, N, H), jnp.float32),
      sds((b, table_all.shape[1]), jnp.int32),
      sds((b,), jnp.int32),
    )
  for platform, sizes in (("cpu", (1, 5)), ("cuda", (3, 1)), ("tpu", (5, 3))):
    exp = export.export(
      jax.jit(f), platforms=[platform], disabled_checks=[export.DisabledSafetyCheck.platform()]
    )(*shapes)
    for B in sizes:
      lens, table = lens_all[:B], table_all[:B]
      if ragged:  # one row per sequence, the first sequence a prefill chunk of 2
        counts = np.ones(B, int)
        counts[0] = 2
        qs = np.concatenate([[0], np.cumsum(counts)])
        q = normal(31, (rows, N, H))
        got = exp.call(q, table, jnp.asarray(lens, jnp.int32), jnp.asarray(qs, jnp.int32))
        want, _ = reference(q, kp, vp, table, lens, qs)
        check(np.asarray(got)[: qs[-1]], want[: qs[-1]])
      else:
        q = normal(31, (B, 1, N, H))
        got = exp.call(q, table, jnp.asarray(lens, jnp.int32))
        check(got, reference(q, kp, vp, table, lens)[0])


@pytest.mark.parametrize("quantized", [False, True])
def test_combined_pool_is_read_where_it_lies(quantized):
  # One pool holding keys and values, heads interleaved: the same attention as the split pools,
  # ragged prefill and decode rows, GQA, window, soft cap; int8 pages with per-token scales.
  N, K, H, ps = 4, 2, 8, 8
  lens = np.array([40, 9, 17])
  qs = np.array([0, 5, 6, 8])
  kp, vp, table = pool(32, 24, ps, K, H, H, 3, lens, garbage=not quantized)
  q = normal(33, (8, N, H))
  kw = dict(query_start=jnp.asarray(qs), local_window_size=(12, 0), logits_soft_cap=4.0)
  ref = dict(window=(12, 0), cap=4.0)
  if quantized:
    ks = np.abs(np.asarray(kp)).max(-1) / 127
    vs = np.abs(np.asarray(vp)).max(-1) / 127
    kp = jnp.asarray(np.round(np.asarray(kp) / ks[..., None]), jnp.int8)
    vp = jnp.asarray(np.round(np.asarray(vp) / vs[..., None]), jnp.int8)
    kw.update(k_scale=jnp.asarray(ks, jnp.float32), v_scale=jnp.asarray(vs, jnp.float32))
    ref.update(ks=ks, vs=vs)
    kp32, vp32 = kp.astype(jnp.float32), vp.astype(jnp.float32)
  else:
    kp32, vp32 = kp, vp
  out = jattn.paged_attention(
    q,
    combined(kp, vp),
    None,
    table,
    jnp.asarray(lens),
    kv_layout="combined",
    num_kv_heads=K,
    page_size=ps,
    **kw,
  )
  want, _ = reference(q, kp32, vp32, table, lens, qs, **ref)
  check(out, want)
  with pytest.raises(ValueError, match="value_pages=None"):
    jattn.paged_attention(
      q, combined(kp, vp), vp, table, jnp.asarray(lens), kv_layout="combined", **kw
    )
  with pytest.raises(ValueError, match="kv_layout='combined'"):
    c = combined(kp, vp)
    jattn.paged_attention(q, c, c, table, jnp.asarray(lens), **kw)
