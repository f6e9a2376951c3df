"""What the paged tests share: `jattn.paged_attention`'s float64 NumPy reference, written from
its definition (tests/paged/test_paged.py states it), the pools and data they run on, and the
comparison they make.

The definition: sequence b's cached tokens 0 .. kv_lengths[b] - 1 live in pages
page_table[b, 0], page_table[b, 1], ... of the pool, in order; its queries are its new tokens,
the last one at position kv_lengths[b] - 1; a query sees the keys its causality and window allow
(in positions) among the cached ones. Quantised pages are dequantised (value times scale) first.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def reference(
  q,
  kp,
  vp,
  table,
  lens,
  qs=None,
  *,
  scale=None,
  causal=True,
  window=None,
  cap=None,
  sinks=None,
  ks=None,
  vs=None,
  selection=None,
):
  """Float64 (out, lse), padded (B, T, N, Hv) or ragged (total, N, Hv). ``selection``:
  (indices, block_size) of a key selection, indices (B|1, T, K', n) padded or (1, total, K', n)
  ragged: a row also needs the key's block among its row's indices for its KV head."""
  q, kp, vp = (np.asarray(x, np.float64) for x in (q, kp, vp))
  if ks is not None:
    kp = kp * np.broadcast_to(np.asarray(ks, np.float64), kp.shape[:3])[..., None]
  if vs is not None:
    vp = vp * np.broadcast_to(np.asarray(vs, np.float64), vp.shape[:3])[..., None]
  table, lens = np.asarray(table), np.asarray(lens)
  B = table.shape[0]
  ps, K, H = kp.shape[1:]
  Hv = vp.shape[-1]
  N = q.shape[-2]
  G = N // K
  scale = 1 / np.sqrt(H) if scale is None else scale
  rows = (np.arange(B + 1) * q.shape[1]) if qs is None else np.asarray(qs)
  flat = q.reshape(-1, N, H)
  if selection is not None:
    idx, block = selection
    idx = np.asarray(idx)
    idx = np.broadcast_to(idx, (flat.shape[0] // idx.shape[1],) + idx.shape[1:])
    chosen = idx.reshape(flat.shape[0], idx.shape[2], idx.shape[3])
  out = np.zeros(flat.shape[:2] + (Hv,))
  lse = np.full(flat.shape[:2], -np.inf)
  for b in range(B):
    L = int(lens[b])
    keys = np.concatenate([kp[table[b, i]] for i in range(-(-L // ps))] or [np.zeros((0, K, H))])[
      :L
    ]
    vals = np.concatenate([vp[table[b, i]] for i in range(-(-L // ps))] or [np.zeros((0, K, Hv))])[
      :L
    ]
    n = rows[b + 1] - rows[b]
    for i in range(n):
      r, pos = rows[b] + i, L - n + i
      for h in range(N):
        s = keys[:, h // G] @ flat[r, h] * scale
        if cap is not None:
          s = cap * np.tanh(s / cap)
        key = np.arange(L)
        vis = np.ones(L, bool)
        if causal:
          vis &= key <= pos
        if selection is not None:
          row = chosen[r, (h // G) % chosen.shape[1]]
          vis &= np.isin(key // block, row[row >= 0])
        if window is not None:
          left, right = window
          if left is not None:
            vis &= key >= pos - left
          if right is not None:
            vis &= key <= pos + right
        logits = s[vis]
        if sinks is not None:
          logits = np.append(logits, sinks[h])
        if not vis.any():
          if sinks is not None:
            lse[r, h] = sinks[h]
          continue
        mx = logits.max()
        w = np.exp(logits - mx)
        tot = w.sum()
        out[r, h] = (w[: vis.sum()] / tot) @ vals[vis][:, h // G]
        lse[r, h] = mx + np.log(tot)
  if qs is None:
    return out.reshape(q.shape[:3] + (Hv,)), lse.reshape(q.shape[:3])
  return out, lse


def normal(seed, shape):
  """Standard normal float32 test data, drawn by NumPy: jax.random.normal would compile a
  program for every shape the tests use."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def pool(seed, P, ps, K, H, Hv, B, lens, dtype=jnp.float32, garbage=True):
  """A shuffled page pool holding B sequences of ``lens`` tokens, and its page table; unused
  pages and table entries hold garbage (NaN, out-of-range ids)."""
  rng = np.random.default_rng([seed, 1])  # another stream than normal(seed)'s
  kp = rng.standard_normal((P, ps, K, H)).astype(np.float32)
  vp = rng.standard_normal((P, ps, K, Hv)).astype(np.float32)
  need = [-(-int(L) // ps) for L in lens]
  max_pages = max(max(need), 1) + 1
  perm = rng.permutation(P)
  assert sum(need) <= P
  table = np.full((B, max_pages), P + 7, np.int32)  # past a sequence's pages: out of range
  at = 0
  for b, n in enumerate(need):
    table[b, :n] = perm[at : at + n]
    at += n
  used = set(perm[:at].tolist())
  if garbage:
    for p in range(P):
      if p not in used:
        kp[p] = np.nan
        vp[p] = np.nan
    # The tail of each sequence's last page is garbage too.
    for b, L in enumerate(lens):
      if L % ps:
        kp[table[b, L // ps], L % ps :] = np.nan
        vp[table[b, L // ps], L % ps :] = np.inf
  return jnp.asarray(kp, dtype), jnp.asarray(vp, dtype), jnp.asarray(table)


def head_major(kp, vp, ks=None, vs=None):
  """The same pool in the HND layout: pages (P, K, page_size, X), token scales (P, K, ps)."""
  t = lambda x: None if x is None else (jnp.swapaxes(x, 1, 2) if x.ndim >= 3 else x)
  return t(kp), t(vp), t(ks), t(vs)


def options(kw, N):
  """A test's options as paged_attention's keywords (``sinks=True``: N sinks) and as the
  reference's."""
  kw = dict(kw)
  if kw.pop("sinks", None):
    kw["sinks"] = jnp.linspace(-1.0, 2.0, N)
  return kw, dict(
    scale=kw.get("scale"),
    causal=kw.get("is_causal", True),
    window=kw.get("local_window_size"),
    cap=kw.get("logits_soft_cap"),
    sinks=None if "sinks" not in kw else np.asarray(kw["sinks"]),
  )


def check(got, want, atol=2e-5):
  """got (finite, the shape of want) equals want within atol, relative to want's largest
  magnitude (at least 1)."""
  got, want = np.asarray(got, np.float64), np.asarray(want)
  assert got.shape == want.shape
  assert np.isfinite(got).all()
  scale = max(1.0, np.abs(want).max())
  np.testing.assert_allclose(got / scale, want / scale, atol=atol)


def combined(kp, vp):
  """The NHD pools as one (P, page_size, 2K, H) pool, key head k at 2k and its values at 2k + 1
  (vLLM's TPU cache)."""
  P, ps, K, H = kp.shape
  return jnp.stack([kp, vp], axis=3).reshape(P, ps, 2 * K, H)
