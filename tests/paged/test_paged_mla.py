"""Absorbed MLA in `jattn.paged_attention`: one latent pool, values its first Hc features.

DeepSeek's multi-head latent attention caches one latent per token, [c, k_rope] of Hc + Hr
features, shared by every head (K = 1). With W_uk absorbed into the queries, a head's logits are
q . [c, k_rope] and its output the softmax-weighted sum of c (later up-projected by W_uv). The
tests hold ``paged_attention(q, latent, None, ..., value_head_dim=Hc)`` to a float64 NumPy
reference written here from that definition, and to the same call with two pools K = [c, k_rope]
and V = c (the non-absorbed cache), which must agree to float rounding.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import _lowering

HC, HR, N = 32, 8, 8  # latent (compressed) and rotary sizes; query heads (K = 1)
H = HC + HR


def mla_reference(q, latent, table, lens, qs=None, *, scale, scales=None, cap=None, sinks=None):
  """Float64 (B, T, N, Hc) or (total, N, Hc): each head's softmax over the visible latents of
  its sequence (causal, in positions) of q . latent * scale, times the latents' first Hc
  features. ``scales`` (P, page_size): per-token dequantisation scales."""
  q, latent = np.asarray(q, np.float64), np.asarray(latent, np.float64)[:, :, 0]  # (P, ps, H)
  if scales is not None:
    latent = latent * np.asarray(scales, np.float64)[..., None]
  table, lens = np.asarray(table), np.asarray(lens)
  ps = latent.shape[1]
  rows = np.arange(len(lens) + 1) * q.shape[1] if qs is None else np.asarray(qs)
  flat = q.reshape(-1, N, H)
  out = np.zeros((flat.shape[0], N, HC))
  for b, L in enumerate(lens):
    cache = np.concatenate([latent[table[b, i // ps], i % ps][None] for i in range(L)])
    n = rows[b + 1] - rows[b]
    for i in range(n):
      r, pos = rows[b] + i, L - n + i
      for h in range(N):
        s = cache[: pos + 1] @ flat[r, h] * scale
        if cap is not None:
          s = cap * np.tanh(s / cap)
        logits = s if sinks is None else np.append(s, sinks[h])
        w = np.exp(logits - logits.max())
        out[r, h] = (w[: pos + 1] / w.sum()) @ cache[: pos + 1, :HC]
  return out.reshape(q.shape[:-1] + (HC,)) if qs is None else out


def latent_pool(P, ps, lens, seed=0):
  """(latent (P, ps, 1, H) float32 with NaN in every slot no sequence holds, table (B, pages))
  of B sequences of ``lens`` tokens in shuffled pages (table entries past them out of range)."""
  rng = np.random.default_rng(seed)
  latent = rng.standard_normal((P, ps, 1, H)).astype(np.float32)
  need = [-(-int(L) // ps) for L in lens]
  perm = rng.permutation(P)
  table = np.full((len(lens), max(need) + 1), P + 3, np.int32)
  used = np.zeros((P, ps), bool)
  at = 0
  for b, (n, L) in enumerate(zip(need, lens)):
    table[b, :n] = perm[at : at + n]
    at += n
    for i in range(L):
      used[table[b, i // ps], i % ps] = True
  latent[~used] = np.nan  # garbage must not leak into any output
  return latent, table, used


def queries(B, T, seed=1):
  return np.random.default_rng(seed).standard_normal((B, T, N, H)).astype(np.float32)


def separate_pools(latent, ks=None):
  """The non-absorbed cache of the same tokens: keys [c, k_rope], values c (and their scales)."""
  return dict(key_pages=latent, value_pages=latent[..., :HC], k_scale=ks, v_scale=ks)


def absorbed(q, latent, table, lens, ks=None, layout="NHD", **kw):
  if layout == "HND":  # K = 1: (P, 1, page_size, H), token scales (P, 1, page_size)
    latent = jnp.swapaxes(latent, 1, 2)
    ks = ks if ks is None or jnp.ndim(ks) < 3 else jnp.swapaxes(ks, 1, 2)
  return jattn.paged_attention(
    q, latent, None, table, jnp.asarray(lens), value_head_dim=HC, k_scale=ks, kv_layout=layout, **kw
  )


def close(got, want, atol):
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape and np.isfinite(got).all()
  np.testing.assert_allclose(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize(
  "layout,T,kw",
  [
    ("NHD", 1, {}),
    ("HND", 3, {}),
    ("NHD", 1, dict(sinks=True)),
    ("HND", 4, dict(logits_soft_cap=3.0, sinks=True)),
  ],
)
def test_absorbed_equals_separate_pools_and_reference(layout, T, kw):
  lens = np.array([37, 5, 16])
  latent, table, _ = latent_pool(20, 4, lens)
  q = queries(len(lens), T)
  sinks = np.linspace(-1.0, 2.0, N) if kw.pop("sinks", False) else None
  kw = dict(kw, sinks=None if sinks is None else jnp.asarray(sinks, jnp.float32))
  out = absorbed(q, jnp.asarray(latent), table, lens, layout=layout, **kw)
  assert out.shape == (len(lens), T, N, HC)
  pools = separate_pools(jnp.asarray(latent))
  two = jattn.paged_attention(q, pools["key_pages"], pools["value_pages"], table, lens, **kw)
  close(out, np.asarray(two, np.float64), 1e-6)
  want = mla_reference(
    q, latent, table, lens, scale=1 / np.sqrt(H), cap=kw.get("logits_soft_cap"), sinks=sinks
  )
  close(out, want, 2e-5)


def test_ragged_prefill_and_decode_mixed():
  lens = np.array([9, 30, 1, 12])
  rows = [9, 1, 1, 3]  # a whole prefill, two decode tokens, a prefill chunk
  qs = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
  latent, table, _ = latent_pool(24, 8, lens, seed=3)
  q = queries(1, int(qs[-1]), seed=4)[0]
  out, lse = absorbed(q, jnp.asarray(latent), table, lens, query_start=qs, return_residual=True)
  assert out.shape == (qs[-1], N, HC) and lse.shape == (qs[-1], N)
  want = mla_reference(q, latent, table, lens, qs, scale=1 / np.sqrt(H))
  close(out, want, 2e-5)
  pools = separate_pools(jnp.asarray(latent))
  two, lse2 = jattn.paged_attention(
    q, pools["key_pages"], pools["value_pages"], table, lens, query_start=qs, return_residual=True
  )
  close(out, np.asarray(two, np.float64), 1e-6)
  close(lse, np.asarray(lse2, np.float64), 1e-6)


def test_bf16_within_a_few_roundings_of_float64():
  lens = np.array([40, 23])
  latent, table, _ = latent_pool(16, 8, lens, seed=5)
  q = queries(2, 2, seed=6)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  out = absorbed(bf(q), bf(latent), table, lens)
  assert out.dtype == jnp.bfloat16
  q64, lat64 = (np.asarray(bf(x), np.float64) for x in (q, latent))  # the rounded inputs
  want = mla_reference(q64, lat64, table, lens, scale=1 / np.sqrt(H))
  rounding = np.abs(np.asarray(bf(want), np.float64) - want).max()
  assert np.abs(np.asarray(out, np.float64) - want).max() <= 4 * rounding + 1e-6


@pytest.mark.parametrize(
  "dtype,kind,layout",
  [(jnp.int8, "token", "NHD"), (jnp.float8_e4m3fn, "token", "HND"), (jnp.int8, "tensor", "HND")],
)
def test_quantized_latent_pool(dtype, kind, layout):
  lens = np.array([29, 14])
  latent, table, used = latent_pool(16, 4, lens, seed=7)
  clean = np.where(np.isnan(latent), 0.0, latent)
  top = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
  amax = np.abs(clean[:, :, 0]).max(axis=-1)  # (P, ps)
  s = np.maximum(amax, 1e-3) / top if kind == "token" else np.float32(amax.max() / top)
  x = clean / np.broadcast_to(s, amax.shape)[..., None, None]
  lq = jnp.asarray(np.round(x) if dtype == jnp.int8 else x).astype(dtype)
  ks = jnp.asarray(s, jnp.float32)
  if kind == "token":  # (P, ps, 1); slots no sequence holds get a NaN scale: it must not leak
    ks = jnp.where(jnp.asarray(used), ks, jnp.nan)[..., None]
  q = queries(2, 2, seed=8)
  out = absorbed(q, lq, table, lens, ks=ks, layout=layout)
  two = jattn.paged_attention(q, lq, lq[..., :HC], table, lens, k_scale=ks, v_scale=ks)
  close(out, np.asarray(two, np.float64), 1e-6)
  deq = np.asarray(lq.astype(jnp.float32))
  sc = None if kind == "tensor" else np.asarray(ks)[..., 0]
  want = mla_reference(
    q, deq * (s if kind == "tensor" else 1), table, lens, scale=1 / H**0.5, scales=sc
  )
  close(out, want, 2e-5)
  exact = mla_reference(q, clean, table, lens, scale=1 / np.sqrt(H))
  assert np.abs(np.asarray(out) - exact).max() < {jnp.int8: 0.05, jnp.float8_e4m3fn: 0.15}[dtype]


def test_the_pool_is_gathered_once_per_block():
  # The values are sliced from the gathered keys: the latent call gathers pages of the latent
  # pool as often as the two-pool call gathers its key pool, and nothing else of a pool.
  lens = np.array([64, 20])
  latent, table, _ = latent_pool(24, 8, lens)
  latent, q = jnp.asarray(np.nan_to_num(latent)), queries(2, 1)

  def pool_gathers(f):  # the operand types of the gathers reading a (24, 8, 1, X) pool
    hlo = jax.jit(f).lower(q, latent).as_text()
    ops = [line.split(":")[-1] for line in hlo.splitlines() if "stablehlo.gather" in line]
    return [op.split(",")[0].strip(" (") for op in ops if "tensor<24x8x1x" in op]

  one = pool_gathers(lambda q, lat: absorbed(q, lat, table, lens))
  two = pool_gathers(lambda q, lat: jattn.paged_attention(q, lat, lat[..., :HC], table, lens))
  assert one and one == [t for t in two if t.endswith(f"x{H}xf32>")] and len(two) == 2 * len(one)


def _args():
  lens = np.array([5, 9])
  latent, table, _ = latent_pool(8, 4, lens)
  return queries(2, 1), jnp.asarray(np.nan_to_num(latent)), table, lens


@pytest.mark.parametrize(
  "kw,error,words",
  [
    (dict(value_head_dim=0), ValueError, "value_head_dim must be in 1 .. H"),
    (dict(value_head_dim=-3), ValueError, "value_head_dim must be in 1 .. H"),
    (dict(value_head_dim=H + 1), ValueError, f"value_head_dim={H + 1} must be in 1 .. H={H}"),
    (dict(value_head_dim=16.0), TypeError, "value_head_dim must be an int"),
    (dict(value_head_dim=True), TypeError, "value_head_dim must be an int"),
    (dict(value_head_dim=HC, v_scale=1.0), ValueError, "v_scale must be None"),
    (dict(value_head_dim=None), TypeError, "value_head_dim=Hv"),
    (dict(value_head_dim=HC, kv_layout="combined"), ValueError, "kv_layout='combined'"),
  ],
)
def test_bad_latent_calls_name_the_argument(kw, error, words):
  q, latent, table, lens = _args()
  with pytest.raises(error, match=re.escape(words)):
    jattn.paged_attention(q, latent, None, table, lens, **kw)


def test_value_head_dim_cross_checks_a_value_pool():
  q, latent, table, lens = _args()
  with pytest.raises(ValueError, match="value_head_dim=16 but value_pages.shape"):
    jattn.paged_attention(q, latent, latent[..., :HC], table, lens, value_head_dim=16)
  got = jattn.paged_attention(q, latent, latent[..., :HC], table, lens, value_head_dim=HC)
  close(got, np.asarray(absorbed(q, latent, table, lens), np.float64), 1e-6)


def test_pallas_kernels_refuse_with_the_reason_and_none_falls_back():
  from jax.experimental.pallas import tpu as pltpu

  q, latent, table, lens = _args()
  want = np.asarray(absorbed(q, latent, table, lens), np.float64)
  for mode in (pltpu.force_tpu_interpret_mode, _lowering.gpu_interpret_mode):
    with mode():
      with pytest.raises(NotImplementedError, match="absorbed MLA"):
        absorbed(q, latent, table, lens, implementation="pallas")
      close(absorbed(q, latent, table, lens), want, 0)


def test_the_same_pool_as_keys_and_values_points_to_value_head_dim():
  q, latent, table, lens = _args()
  with pytest.raises(ValueError, match="value_pages=None with value_head_dim=Hv"):
    jattn.paged_attention(q, latent, latent, table, lens)
