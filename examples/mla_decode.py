"""Absorbed MLA decoding (DeepSeek-style) against a paged *latent* cache, checked against MLA
computed the ordinary way.

Multi-head latent attention caches, per token, one latent vector shared by every head: the
compressed ``c = x W_dkv`` (Hc features) and one rotary key ``k_rope`` (Hr), Hc + Hr features
in all, instead of N heads' keys and values. Head n's key is [c W_uk[n], k_rope] and its value
c W_uv[n]. *Absorbed*, W_uk moves into the query (q_nope[n] W_uk[n]^T, Hc features) so that a
head's logits are [q_nope W_uk^T, q_rope] . [c, k_rope], and W_uv moves after the attention:
the weighted sum of c is up-projected once per head. That is
``jattn.paged_attention(q, latent_pages, None, ..., value_head_dim=Hc)``: one pool
(P, page_size, 1, Hc + Hr), read once per step, its first Hc features the values.

A tiny random one-layer model (``LatentAttention``, a Flax nnx module whose cache is the latent
pool) prefills B prompts of different lengths (one ragged call), then decodes greedily, one token per sequence per step, writing each token's latent into its page
(``jattn.write_pages`` with ``value_pages=None``: a pool of keys only). At every step the logits
are compared with an uncached float64 NumPy forward of the non-absorbed model (per-head keys and
values up-projected, plain softmax attention) over the sequence so far; the run returns 1 if
they differ beyond float32 rounding.

  python examples/mla_decode.py [--steps 8] [--page-size 4] [--seed 0]

Shapes: B sequences, T tokens, N heads, D model width, V vocabulary, Hc latent, Hr rotary,
Hn a head's non-rotary query/key size, Hv a head's value size, P pages.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jattn

V, D, N, HC, HR, HN, HV = 64, 48, 8, 32, 8, 16, 16
H = HC + HR  # the latent's (and absorbed query's) size


WEIGHTS = ("embed", "w_dkv", "w_kr", "w_qn", "w_qr", "w_uk", "w_uv", "w_o")


def init(rng):
  """The model's weights: embedding, MLA projections, output projection (NumPy's generator:
  no compilation per shape)."""
  shapes = dict(
    embed=(V, D),
    w_dkv=(D, HC),  # x -> c
    w_kr=(D, HR),  # x -> k_rope (one rotary key shared by the heads)
    w_qn=(D, N, HN),  # x -> q_nope
    w_qr=(D, N, HR),  # x -> q_rope
    w_uk=(HC, N, HN),  # c -> a head's non-rotary key
    w_uv=(HC, N, HV),  # c -> a head's value
    w_o=(N, HV, D),
  )
  return {
    name: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)
    for name, shape in shapes.items()
  }


def rope(x, pos, xp=jnp):
  """Rotary embedding of x (..., T, [N,] Hr) at positions pos (..., T); ``xp``: jax.numpy, or
  NumPy for the float64 check."""
  half = x.shape[-1] // 2
  freq = 1.0 / (10000.0 ** (np.arange(half) / half))
  ang = pos[..., None] * freq.reshape((1,) * pos.ndim + (half,))  # (..., T, Hr / 2)
  if x.ndim == pos.ndim + 2:  # a head axis
    ang = ang[..., None, :]
  cos, sin = xp.cos(ang).astype(x.dtype), xp.sin(ang).astype(x.dtype)
  a, b = x[..., :half], x[..., half:]
  return xp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def project(w, tokens, pos, xp=jnp):
  """(x (..., T, D), latent (..., T, H) = [c, rope(k_rope)], q_nope (..., T, N, Hn),
  q_rope (..., T, N, Hr) rotated) of tokens at positions pos."""
  x = w["embed"][tokens]
  latent = xp.concatenate([x @ w["w_dkv"], rope(x @ w["w_kr"], pos, xp)], axis=-1)
  q_nope = xp.einsum("...d,dnh->...nh", x, w["w_qn"])
  q_rope = rope(xp.einsum("...d,dnh->...nh", x, w["w_qr"]), pos, xp)
  return x, latent, q_nope, q_rope


def absorbed_query(w, q_nope, q_rope):
  """(..., N, Hc + Hr): W_uk absorbed, q_nope W_uk^T beside the rotary part."""
  return jnp.concatenate([jnp.einsum("...nh,cnh->...nc", q_nope, w["w_uk"]), q_rope], axis=-1)


def head_out(w, x, out_latent):
  """Logits (..., V) from the attention's latent output (..., N, Hc): W_uv, W_o, residual."""
  o = jnp.einsum("...nc,cnh->...nh", out_latent, w["w_uv"])
  x = x + jnp.einsum("...nh,nhd->...d", o, w["w_o"])
  return x @ w["embed"].T


SCALE = 1 / np.sqrt(HN + HR)  # the non-absorbed heads' size sets the logit scale


def uncached_logits(w, tokens):
  """The non-absorbed model over one whole sequence (T,), in float64 NumPy: (T, V). Per-head
  keys [c W_uk, k_rope] and values c W_uv, causal softmax attention."""
  w = {name: np.asarray(x, np.float64) for name, x in w.items()}
  pos = np.arange(len(tokens))
  x, latent, q_nope, q_rope = project(w, np.asarray(tokens), pos, np)
  c, k_rope = latent[:, :HC], latent[:, HC:]
  k_nope = np.einsum("tc,cnh->tnh", c, w["w_uk"])
  v = np.einsum("tc,cnh->tnh", c, w["w_uv"])
  s = np.einsum("qnh,knh->nqk", q_nope, k_nope) + np.einsum("qnh,kh->nqk", q_rope, k_rope)
  s = np.where(np.tril(np.ones((len(pos),) * 2, bool)), s * SCALE, -np.inf)
  p = np.exp(s - s.max(axis=-1, keepdims=True))
  o = np.einsum("nqk,knh->qnh", p / p.sum(axis=-1, keepdims=True), v)
  return (x + np.einsum("qnh,nhd->qd", o, w["w_o"])) @ w["embed"].T


class LatentAttention(nnx.Module):
  """An absorbed-MLA model layer that caches the latent: its weights (``nnx.Param``) and a
  paged latent cache (``nnx.Cache``): the pool (P, page_size, 1, Hc + Hr), the page table
  (B, max_pages) and each sequence's cached tokens (B,)."""

  def __init__(self, w, table, page_size: int):
    for name, x in w.items():
      setattr(self, name, nnx.Param(x))
    pages = int(np.asarray(table).max()) + 1
    self.pool = nnx.Cache(jnp.zeros((pages, page_size, 1, H), jnp.float32))
    self.table = nnx.Cache(jnp.asarray(table, jnp.int32))
    self.lens = nnx.Cache(jnp.zeros((table.shape[0],), jnp.int32))

  def __call__(self, tokens, positions, query_start):
    """Ragged rows (tokens (R,) at ``positions`` (R,); sequence b's rows query_start[b] ..
    query_start[b + 1] - 1): their latents written into the cache, one absorbed call; logits
    (R, V). Prefill chunks and decode tokens alike."""
    w = {name: getattr(self, name)[...] for name in WEIGHTS}
    x, latent, q_nope, q_rope = project(w, tokens, positions.astype(jnp.float32))
    lens = self.lens[...] + (query_start[1:] - query_start[:-1])
    # A pool of keys only (value_pages=None, value=None): each token's one latent, K = 1.
    pool, *_ = jattn.write_pages(
      self.pool[...], None, self.table[...], lens, latent[:, None], None, query_start=query_start
    )
    out = jattn.paged_attention(
      absorbed_query(w, q_nope, q_rope),
      pool,
      None,
      self.table[...],
      lens,
      query_start=query_start,
      scale=SCALE,
      value_head_dim=HC,
    )  # (R, N, Hc)
    self.pool[...], self.lens[...] = pool, lens
    return head_out(w, x, out)


@nnx.jit
def step(model, tokens, positions, query_start):
  return model(tokens, positions, query_start)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=8, help="decoded tokens per sequence")
  p.add_argument("--page-size", type=int, default=4)
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)
  rng = np.random.default_rng(a.seed)
  w = init(rng)
  prompts = [rng.integers(0, V, n) for n in (5, 11, 1)]
  B, ps = len(prompts), a.page_size
  pages = -(-(max(map(len, prompts)) + a.steps) // ps)
  model = LatentAttention(w, rng.permutation(B * pages).reshape(B, pages), ps)
  qs = jnp.asarray(np.cumsum([0] + [len(t) for t in prompts]), jnp.int32)
  pos = jnp.asarray(np.concatenate([np.arange(len(t)) for t in prompts]), jnp.int32)
  logits = step(model, jnp.asarray(np.concatenate(prompts), jnp.int32), pos, qs)[qs[1:] - 1]
  seqs, lens, steps = [list(t) for t in prompts], np.array([len(t) for t in prompts]), []
  one_each = jnp.arange(B + 1, dtype=jnp.int32)  # decoding: one row per sequence
  for _ in range(a.steps):
    token = jnp.argmax(logits, axis=-1)
    steps.append(logits)
    for b in range(B):
      seqs[b].append(int(token[b]))
    logits = step(model, token.astype(jnp.int32), jnp.asarray(lens, jnp.int32), one_each)
    lens = lens + 1
  steps.append(logits)
  # Causal: one uncached forward over each finished sequence gives every step's logits.
  worst = 0.0
  for b in range(B):
    want = uncached_logits(w, seqs[b])[len(prompts[b]) - 1 :]
    got = np.stack([np.asarray(x[b], np.float64) for x in steps])
    worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
  ok = worst < 1e-4
  shape = model.pool[...].shape
  print(f"{B} sequences, {a.steps} absorbed-MLA decoding steps from a latent pool {shape}")
  print(f"max |cached - uncached non-absorbed logits| / max |logits| = {worst:.2e}")
  print("absorbed MLA equals the non-absorbed model" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
