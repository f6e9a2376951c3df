"""Shared-prefix cascade: many requests over one long prompt, the prompt's pages read once.

Requests that share a system prompt (or the beams of one request) keep the prompt's keys and
values in the same pages of a paged pool: every request's page table starts with the prefix's
pages and goes on with its own. A step of these requests can attend two ways:

- plain: one `jattn.paged_attention` call over each request's whole page table. Each of the R
  requests of a group reads the prefix again: R * (prefix + own) tokens of pages read.
- cascade (`cascade_attention`): one call over the prefix for the whole group, the group's
  query rows stacked as the rows of one sequence whose keys are the prefix; one causal call
  over each request's own pages; the two merged by their log-sum-exps
  (`jattn.merge_attention`): prefix + R * own tokens read.

Softmax over the union of two disjoint key sets is the log-sum-exp weighted mix of the softmaxes
over each, so both ways give the same attention; the example checks that they agree (float32),
prints both times and returns 1 if they differ. Decoding (``--T 1``) and prefill chunks of
each request's own tokens (``--T 8``: T new tokens per request, causal among themselves) work
alike.

Shared pages hold whole pages of the prefix: a prefix that ends inside a page leaves that last
page to each request (a copy of its tokens in the request's first own page, as copy-on-write
does in vLLM), so the cascade's shared part is the prefix's whole pages and its own part the
rest of each request's tokens. Own lengths differ from request to request.

  python examples/shared_prefix.py [--groups 2] [--requests 16] [--prefix 2048] [--own 128]
                                   [--T 1] [--page-size 16] [--heads 8] [--kv-heads 2]

Shapes: B = groups * R requests (those of a group consecutive), R requests per group, T new
tokens per request, N query heads, K key/value heads, G = N // K, H head size, P pages of
``page_size`` tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn.bench import interleaved


@dataclasses.dataclass
class Problem:
  """One step of B requests in groups of R over a shared prefix per group."""

  query: jax.Array  # (B, T, N, H)
  key_pages: jax.Array  # (P, page_size, K, H)
  value_pages: jax.Array  # (P, page_size, K, H)
  table: jax.Array  # (B, max_pages): each request's whole table, shared pages then own ones
  lengths: jax.Array  # (B,) tokens cached per request: prefix + own (the T new ones included)
  shared_table: jax.Array  # (groups, shared pages): the prefix's whole pages, once per group
  shared_lengths: jax.Array  # (groups,) tokens in them
  own_table: jax.Array  # (B, own pages): the rest of each request's tokens
  own_lengths: jax.Array  # (B,)
  keys: list  # B float32 NumPy arrays (S_b, K, H): each request's tokens in order
  values: list  # likewise


def cascade_attention(
  query, key_pages, value_pages, shared_table, shared_lengths, own_table, own_lengths
):
  """Attention of each request over its group's shared pages and then its own, (B, T, N, H).

  Args:
    query: (B, T, N, H), the R = B // groups requests of a group consecutive; query t of
      request b sits at position shared_lengths[b // R] + own_lengths[b] - T + t.
    key_pages, value_pages: the pool, (P, page_size, K, H).
    shared_table: int (groups, shared pages); shared_lengths: int (groups,) tokens in them.
    own_table: int (B, own pages); own_lengths: int (B,) each request's tokens after the shared
      ones, its T new ones included (so at least T).
  """
  B, T, N, H = query.shape
  groups = shared_table.shape[0]
  R = B // groups
  # The prefix, once per group: its R * T query rows are the rows of one sequence. Every one of
  # them comes after the whole prefix, so each sees all of it: not causal. (Causal, the rows
  # would be placed bottom-right at positions prefix - R*T .. prefix - 1, and all but the last
  # would miss the prefix's last keys.) GQA folds the G heads of a key head as usual, so one
  # key block serves R * T * G rows.
  stacked = query.reshape(groups, R * T, N, H)
  out_s, lse_s = jattn.paged_attention(
    stacked,
    key_pages,
    value_pages,
    shared_table,
    shared_lengths,
    is_causal=False,
    return_residual=True,
  )
  # Each request's own tokens: causal and bottom-right aligned. Its queries' and keys' positions
  # are both shifted by the shared length, which changes no causal comparison.
  out_o, lse_o = jattn.paged_attention(
    query, key_pages, value_pages, own_table, own_lengths, is_causal=True, return_residual=True
  )
  out, _ = jattn.merge_attention(
    [out_s.reshape(B, T, N, -1), out_o], [lse_s.reshape(B, T, N), lse_o]
  )
  return out


def plain_attention(query, key_pages, value_pages, table, lengths):
  """The same attention from each request's whole page table, (B, T, N, H)."""
  return jattn.paged_attention(query, key_pages, value_pages, table, lengths, is_causal=True)


def make_problem(
  seed=0, *, groups, requests, prefix, own, T, page_size, heads, kv_heads, head_dim
) -> Problem:
  """Random keys, values and queries laid into a pool in shuffled pages: per group a prefix of
  ``prefix`` tokens (its whole pages stored once), per request T .. ``own`` own tokens."""
  rng = np.random.default_rng(seed)
  K, H = kv_heads, head_dim
  B = groups * requests
  shared_pages = prefix // page_size  # whole pages only (see the module docstring)
  shared_len = shared_pages * page_size
  own_lens = rng.integers(T, own + 1, B)
  rest = prefix - shared_len + own_lens  # tokens on each request's own pages
  own_pages = -(-rest // page_size)
  P = groups * shared_pages + int(own_pages.sum())
  ids = iter(rng.permutation(P))  # pages in shuffled order, as a pool has them after a while
  key_pages = np.zeros((P, page_size, K, H), np.float32)
  value_pages = np.zeros_like(key_pages)
  shared_table = np.zeros((groups, max(shared_pages, 1)), np.int32)
  own_table = np.zeros((B, int(own_pages.max())), np.int32)

  def store(pages_of, row, kv):  # a run of tokens into fresh pages, their ids into a table row
    for i in range(0, len(kv[0]), page_size):
      page = pages_of[row, i // page_size] = next(ids)
      for pool, x in zip((key_pages, value_pages), kv):
        pool[page, : len(x[i : i + page_size])] = x[i : i + page_size]

  keys, values = [], []
  for g in range(groups):
    pre = [rng.standard_normal((prefix, K, H), np.float32) for _ in range(2)]
    store(shared_table, g, [x[:shared_len] for x in pre])
    for r in range(requests):
      b = g * requests + r
      mine = [rng.standard_normal((own_lens[b], K, H), np.float32) for _ in range(2)]
      full = [np.concatenate([p, m]) for p, m in zip(pre, mine)]
      store(own_table, b, [x[shared_len:] for x in full])
      keys.append(full[0])
      values.append(full[1])
  table = np.concatenate([np.repeat(shared_table[:, :shared_pages], requests, 0), own_table], 1)
  query = rng.standard_normal((B, T, heads, H), np.float32)
  return Problem(
    query=jnp.asarray(query),
    key_pages=jnp.asarray(key_pages),
    value_pages=jnp.asarray(value_pages),
    table=jnp.asarray(table),
    lengths=jnp.asarray(prefix + own_lens, jnp.int32),
    shared_table=jnp.asarray(shared_table),
    shared_lengths=jnp.full((groups,), shared_len, jnp.int32),
    own_table=jnp.asarray(own_table),
    own_lengths=jnp.asarray(rest, jnp.int32),
    keys=keys,
    values=values,
  )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--groups", type=int, default=2, help="prefixes (one per group of requests)")
  p.add_argument("--requests", type=int, default=16, help="requests per group (R)")
  p.add_argument("--prefix", type=int, default=2048, help="tokens of each shared prefix")
  p.add_argument("--own", type=int, default=128, help="most own tokens of a request")
  p.add_argument("--T", type=int, default=1, help="new tokens per request (1: decoding)")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)
  if a.own < a.T:
    p.error(f"--own {a.own} must be at least --T {a.T} (the new tokens are a request's own)")
  pb = make_problem(
    a.seed,
    groups=a.groups,
    requests=a.requests,
    prefix=a.prefix,
    own=a.own,
    T=a.T,
    page_size=a.page_size,
    heads=a.heads,
    kv_heads=a.kv_heads,
    head_dim=a.head_dim,
  )
  pool = (pb.query, pb.key_pages, pb.value_pages)
  plain = jax.jit(plain_attention)
  cascade = jax.jit(cascade_attention)
  fns = {
    "plain": lambda: plain(*pool, pb.table, pb.lengths),
    "cascade": lambda: cascade(
      *pool, pb.shared_table, pb.shared_lengths, pb.own_table, pb.own_lengths
    ),
  }
  want, got = (np.asarray(f()) for f in fns.values())
  ms = interleaved(fns, a.repeats)
  # Pages read, in tokens: the plain call reads every request's whole table, the cascade each
  # group's shared pages once and every request's own pages.
  plain_tokens = int(pb.lengths.sum())
  cascade_tokens = int(pb.shared_lengths.sum() + pb.own_lengths.sum())
  print(
    f"{a.groups} groups of {a.requests} requests, prefix {a.prefix}, own <= {a.own}, T={a.T}, "
    f"N={a.heads} K={a.kv_heads} H={a.head_dim}, page size {a.page_size}"
  )
  print(f"plain:   {ms['plain']:8.2f} ms  ({plain_tokens} tokens of pages read)")
  print(f"cascade: {ms['cascade']:8.2f} ms  ({cascade_tokens} tokens of pages read)")
  print(f"plain / cascade: {ms['plain'] / ms['cascade']:.2f}x")
  err = float(np.abs(got - want).max())
  if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
    print(f"the cascade differs from the plain call: max abs diff {err:.1e}", file=sys.stderr)
    return 1
  print(f"the cascade equals the plain call (max abs diff {err:.1e})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
