"""Speculative decoding over a paged KV cache: a tree of draft tokens verified in one
`jattn.paged_attention` call, the accepted path moved into place with `jattn.write_pages`, and
every step checked against decoding the same tokens one at a time.

A tiny random one-layer model (plain JAX, RoPE on queries and keys) prefills B prompts of
different lengths, then runs speculative steps. A step of sequence b, whose cache holds
``prefix`` tokens and whose last chosen token (the *root*) is not cached yet:

1. Draft. A cheap draft model -- here the same model with its attention layer skipped, a bigram
   table -- proposes a tree of T tokens (``PARENTS``): row 0 is the root, and a parent's
   children are the draft's best and second-best next tokens after it.
2. Verify. The rows' keys and values are written in *row order* at cache slots prefix ..
   prefix + T - 1 (`write_pages`, kv_lengths = prefix + T), and all T rows attend in one
   `paged_attention(..., new_token_mask=tree_mask(PARENTS))` call. Row i sees the cache and its
   ancestors at *position* prefix + depth(i) -- the position its rotation is computed at --
   exactly as if its root-to-i path had been decoded alone.
3. Accept. From the root down, a child is accepted when it is the model's greedy choice after
   its parent; the greedy choice after the last accepted row is the next step's root. Sequences
   accept different numbers of tokens.
4. Move. The accepted tokens sit at the slots of their rows: path [0, 2, 4] at prefix + 0,
   prefix + 2, prefix + 4, with the rejected rows 1 and 3 between them. Decoding goes on from
   consecutive positions, so the path's keys and values (already rotated for prefix + 0, + 1,
   + 2: a row's position is its depth) are written again at slots prefix .. prefix + a - 1
   (`write_pages`, left-padded rows, ``new_lengths`` = each sequence's a accepted tokens) and
   kv_lengths becomes prefix + a. Left where they are, the next step would read the rejected
   row 1 as the token at prefix + 1 (``--no-move`` shows the check failing).

After each step the accepted rows' attention outputs are compared with a second cache that
decodes the same tokens one at a time (T = 1 per call, `write_pages` then `paged_attention`),
and at the end both caches' tokens are compared; the run returns 1 if either differs.

  python examples/speculative.py [--steps 6] [--page-size 4] [--seed 0] [--no-move]

Shapes: B sequences, T tree rows, A the longest root-to-leaf path (rows), N query heads, K
key/value heads, G = N // K, H head size, D model width, V vocabulary, P pages of ``page_size``
tokens.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import masks

V, D, N, K, H = 32, 32, 4, 2, 16
# The draft tree: row i's parent (-1: the root, which follows the cached prefix), and which of
# the draft's guesses after its parent it is (0 the best, 1 the second best).
PARENTS = np.array([-1, 0, 0, 1, 2, 2, 3, 4])
RANKS = np.array([0, 0, 1, 0, 0, 1, 0, 0])
T = len(PARENTS)


def depths(parents):
  """(T,) each row's depth in the tree (the root's is 0); parents come before children."""
  d = np.zeros(len(parents), np.int32)
  for i, p in enumerate(parents):
    d[i] = 0 if p < 0 else d[p] + 1
  return d


DEPTH = depths(PARENTS)
A = int(DEPTH.max()) + 1


def init(rng):
  """Random weights: embedding, attention projections, output projection and unembedding."""
  shapes = dict(embed=(V, D), wq=(D, N, H), wk=(D, K, H), wv=(D, K, H), wo=(N, H, D), wu=(D, V))
  return {
    name: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)
    for name, shape in shapes.items()
  }


def rope(x, pos):
  """Rotary embedding of x (..., N, H) at positions pos (...)."""
  half = x.shape[-1] // 2
  freq = 10000.0 ** (-np.arange(half) / half)
  ang = pos[..., None, None].astype(jnp.float32) * freq.reshape((1,) * pos.ndim + (1, half))
  a, b = x[..., :half], x[..., half:]
  return jnp.concatenate(
    [a * jnp.cos(ang) - b * jnp.sin(ang), a * jnp.sin(ang) + b * jnp.cos(ang)], -1
  )


def project(w, tokens, pos):
  """(x (..., D), q (..., N, H), k (..., K, H), v (..., K, H)) of tokens at positions pos."""
  x = w["embed"][tokens]
  q = rope(jnp.einsum("...d,dnh->...nh", x, w["wq"]), pos)
  k = rope(jnp.einsum("...d,dkh->...kh", x, w["wk"]), pos)
  return x, q, k, jnp.einsum("...d,dkh->...kh", x, w["wv"])


def logits_of(w, x, out):
  """(..., V): the attention output (..., N, H) projected, added to x, unembedded."""
  return (x + jnp.einsum("...nh,nhd->...d", out, w["wo"])) @ w["wu"]


@jax.jit
def prefill(w, pools, table, tokens, pos, query_start):
  """The prompts as ragged rows: (pools, the logits of each row (R, V))."""
  x, q, k, v = project(w, tokens, pos)
  lens = query_start[1:] - query_start[:-1]
  pools = jattn.write_pages(*pools, table, lens, k, v, query_start=query_start)[:2]
  out = jattn.paged_attention(q, *pools, table, lens, query_start=query_start)
  return pools, logits_of(w, x, out)


@jax.jit
def draft_tree(w, roots):
  """(B, T) the tree's tokens after each sequence's root (B,): row i is the RANKS[i]-th best
  guess of the draft model (x @ wu: the model without attention) after its parent's token."""
  rows = [roots]
  for i in range(1, T):
    guesses = jnp.argsort(-(w["embed"][rows[PARENTS[i]]] @ w["wu"]), axis=-1)
    rows.append(guesses[:, RANKS[i]])
  return jnp.stack(rows, axis=1)


@jax.jit
def verify(w, pools, table, prefix, tokens):
  """One step's tree of tokens (B, T) after ``prefix`` (B,) cached tokens per sequence: their
  keys and values written at slots prefix .. prefix + T - 1 in row order, all rows attending in
  one call. Returns (pools, k, v (B, T, K, H), out (B, T, N, H), logits (B, T, V))."""
  x, q, k, v = project(w, tokens, prefix[:, None] + DEPTH[None, :])  # positions: prefix + depth
  lens = prefix + T
  pools = jattn.write_pages(*pools, table, lens, k, v)[:2]
  mask = jnp.broadcast_to(masks.tree_mask(PARENTS), (tokens.shape[0], T, T))
  out = jattn.paged_attention(q, *pools, table, lens, new_token_mask=mask)
  return pools, k, v, out, logits_of(w, x, out)


def accept(tokens, greedy):
  """The accepted rows of one sequence's tree (a root-to-node path, root first) and the next
  root: ``tokens`` (T,) the tree's tokens, ``greedy`` (T,) the model's choice after each row."""
  path = [0]
  while True:
    here = path[-1]
    kids = [c for c in range(T) if PARENTS[c] == here and tokens[c] == greedy[here]]
    if not kids:
      return path, int(greedy[here])
    path.append(kids[0])


@jax.jit
def move(pools, table, prefix, k, v, rows, accepted):
  """The accepted rows' keys and values to consecutive slots prefix .. prefix + a - 1.

  ``rows`` (B, A) holds each sequence's accepted row indices right-aligned (left padding
  repeats its first row), ``accepted`` (B,) their count a: `write_pages` writes only the last
  a rows of each sequence (``new_lengths``), so padding never overwrites cached tokens."""
  take = lambda x: jnp.take_along_axis(x, rows[:, :, None, None], axis=1)  # (B, A, K, H)
  lens = prefix + accepted
  return jattn.write_pages(*pools, table, lens, take(k), take(v), new_lengths=accepted)[:2]


@jax.jit
def decode_one(w, pools, table, prefix, tokens, active):
  """Step-by-step decoding: one token (B,) per sequence at position prefix (B,), for the
  sequences where ``active`` (B,) is 1 (the others' rows are neither written nor used). Returns
  (pools, out (B, N, H))."""
  _, q, k, v = project(w, tokens[:, None], prefix[:, None])
  lens = prefix + active
  pools = jattn.write_pages(*pools, table, lens, k, v, new_lengths=active)[:2]
  return pools, jattn.paged_attention(q, *pools, table, lens)[:, 0]


def cached_tokens(pools, table, lens):
  """Each sequence's cached keys and values in order: B pairs of (S_b, K, H) NumPy arrays."""
  pages = [np.asarray(p) for p in pools]
  return [tuple(p[table[b]].reshape(-1, K, H)[: lens[b]] for p in pages) for b in range(len(lens))]


def run(w, prompts, *, steps, page_size, seed=0, moved=True):
  """Speculative decoding of the prompts (B lists of tokens) for ``steps`` steps, beside a cache
  that decodes the same tokens one at a time.

  Returns a dict: ``tokens`` (B lists: prompt and decoded tokens), ``accepted`` (steps, B) the
  tokens each step added (root included), ``paths`` (steps lists of B accepted row paths),
  ``outs`` (B lists of the decoded tokens' attention outputs (N, H), from the tree steps),
  ``out_diff`` the largest |tree - step-by-step| attention output over the accepted rows,
  ``cache_diff`` the largest difference between the two caches' tokens."""
  B, rng = len(prompts), np.random.default_rng(seed)
  pages = -(-(max(map(len, prompts)) + steps * A + T) // page_size)
  table = rng.permutation(B * pages).reshape(B, pages).astype(np.int32)  # shuffled pages
  empty = lambda: tuple(jnp.zeros((B * pages, page_size, K, H), jnp.float32) for _ in "kv")
  qs = np.cumsum([0] + [len(t) for t in prompts]).astype(np.int32)
  flat = np.concatenate(prompts).astype(np.int32)
  pos = np.concatenate([np.arange(len(t)) for t in prompts]).astype(np.int32)
  spec, logits = prefill(w, empty(), table, flat, pos, qs)
  seq, _ = prefill(w, empty(), table, flat, pos, qs)
  roots = np.asarray(jnp.argmax(logits[qs[1:] - 1], axis=-1))
  lens = np.array([len(t) for t in prompts], np.int32)
  tokens = [list(t) for t in prompts]
  accepted, paths, out_diff = [], [], 0.0
  outs = [[] for _ in range(B)]  # the accepted rows' attention outputs, in decoding order
  for _ in range(steps):
    tree = draft_tree(w, jnp.asarray(roots, jnp.int32))
    spec, k, v, out, step_logits = verify(w, spec, table, lens, tree)
    greedy, tree = np.asarray(jnp.argmax(step_logits, axis=-1)), np.asarray(tree)
    step = [accept(tree[b], greedy[b]) for b in range(B)]
    path = [p for p, _ in step]
    a = np.array([len(p) for p in path], np.int32)
    # Right-aligned (B, A) rows for write_pages' left padding.
    rows = np.array([[p[0]] * (A - len(p)) + p for p in path], np.int32)
    if moved:
      spec = move(spec, table, lens, k, v, rows, a)
    # The same tokens decoded one at a time, compared row by row with the tree's outputs.
    for j in range(int(a.max())):
      active = (a > j).astype(np.int32)
      toks = np.array([tree[b, p[min(j, len(p) - 1)]] for b, p in enumerate(path)], np.int32)
      seq, one = decode_one(w, seq, table, lens + j, toks, active)
      for b in np.flatnonzero(active):
        diff = np.abs(np.asarray(out[b, path[b][j]]) - np.asarray(one[b])).max()
        out_diff = max(out_diff, float(diff))
    for b in range(B):
      tokens[b] += [int(tree[b, r]) for r in path[b]]
      outs[b] += [np.asarray(out[b, r]) for r in path[b]]
    lens, roots = lens + a, np.array([r for _, r in step])
    accepted.append(a)
    paths.append(path)
  cache_diff = max(
    float(np.abs(x - y).max())
    for pair in zip(cached_tokens(spec, table, lens), cached_tokens(seq, table, lens))
    for x, y in zip(*pair)
  )
  return dict(
    tokens=tokens,
    accepted=np.array(accepted),
    paths=paths,
    outs=outs,
    out_diff=out_diff,
    cache_diff=cache_diff,
  )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=6, help="speculative steps")
  p.add_argument("--page-size", type=int, default=4)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-move", action="store_true", help="skip the move (the check then fails)")
  a = p.parse_args(argv)
  rng = np.random.default_rng(a.seed)
  w = init(rng)
  prompts = [rng.integers(0, V, n) for n in (5, 9)]
  r = run(w, prompts, steps=a.steps, page_size=a.page_size, seed=a.seed, moved=not a.no_move)
  print(f"tree of {T} draft rows (parents {PARENTS.tolist()}), {len(prompts)} sequences")
  for s, (acc, path) in enumerate(zip(r["accepted"], r["paths"])):
    print(f"step {s}: accepted {acc.tolist()} tokens, rows {path}")
  print(f"max |tree - step-by-step| attention output: {r['out_diff']:.2e}")
  print(f"max |moved cache - sequential cache|: {r['cache_diff']:.2e}")
  ok = r["out_diff"] < 1e-5 and r["cache_diff"] < 1e-5
  print("the tree steps equal step-by-step decoding" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
