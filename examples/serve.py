"""Continuous batching with a paged KV cache: `jattn.paged_attention`, one ragged call per layer.

A small decoder-only Transformer (random weights, plain JAX: embeddings, per layer RMSNorm,
attention with GQA, an MLP) serves requests that arrive over time with prompts of different
lengths. Each layer keeps its keys and values in a shared pool of pages; every engine step

- admits waiting requests into free slots (as many as ``--slots``),
- gives each running request its next piece of work -- a prefill chunk of its prompt (at most
  ``--chunk`` tokens) or one decode token -- packed into one ragged batch of at most
  ``--budget`` query rows,
- writes the new tokens' keys and values into their pages (allocated as a sequence grows) and
  runs one `paged_attention` call per layer for all of them at once, prefill chunks and decode
  tokens mixed (``query_start`` offsets; positions from each sequence's ``kv_lengths``),
- takes the greedy next token of every request whose prompt is done, and frees a request's
  pages when it has its tokens.

The engine step is one jit-compiled function for the whole run (fixed shapes: slots, row budget,
pool). At the end every request's tokens are checked against an uncached greedy run of that
request alone (`jattn.dot_product_attention` over the whole sequence, recomputed per token); the
run fails if any differs. It prints tokens/s.

  python examples/serve.py [--tiny] [--requests 12] [--slots 4] [--budget 32] [--chunk 16]

Shapes: B slots, R ragged rows (the step's budget), D model width, N query heads, K key/value
heads, H head size, P pages of ``page_size`` tokens, V vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jattn


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 256
  width: int = 128
  heads: int = 8
  kv_heads: int = 2
  layers: int = 2
  mlp: int = 256
  page_size: int = 16
  pages: int = 256
  max_len: int = 256  # positions per sequence (the page table has max_len / page_size columns)

  @property
  def head_dim(self) -> int:
    return self.width // self.heads


TINY = Config(
  vocab=32, width=32, heads=4, kv_heads=2, layers=2, mlp=64, page_size=4, pages=96, max_len=48
)


def init(cfg: Config, key):
  """Random weights: embeddings (V, D) and positions (max_len, D), per layer the attention and
  MLP matrices, an output head."""
  keys = iter(jax.random.split(key, 4 + 6 * cfg.layers))
  dense = lambda shape: jax.random.normal(next(keys), shape) / np.sqrt(shape[0])
  H = cfg.head_dim
  layers = [
    dict(
      wq=dense((cfg.width, cfg.heads * H)),
      wk=dense((cfg.width, cfg.kv_heads * H)),
      wv=dense((cfg.width, cfg.kv_heads * H)),
      wo=dense((cfg.heads * H, cfg.width)),
      w1=dense((cfg.width, cfg.mlp)),
      w2=dense((cfg.mlp, cfg.width)),
    )
    for _ in range(cfg.layers)
  ]
  return dict(
    embed=jax.random.normal(next(keys), (cfg.vocab, cfg.width)),
    pos=0.1 * jax.random.normal(next(keys), (cfg.max_len, cfg.width)),
    head=dense((cfg.width, cfg.vocab)),
    layers=layers,
  )


def _norm(x):
  return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def _qkv(cfg: Config, layer, x):
  H = cfg.head_dim
  h = _norm(x)
  return (
    (h @ layer["wq"]).reshape(x.shape[:-1] + (cfg.heads, H)),
    (h @ layer["wk"]).reshape(x.shape[:-1] + (cfg.kv_heads, H)),
    (h @ layer["wv"]).reshape(x.shape[:-1] + (cfg.kv_heads, H)),
  )


def _after_attention(layer, x, attended):
  x = x + attended.reshape(x.shape[:-1] + (-1,)) @ layer["wo"]
  return x + jax.nn.gelu(_norm(x) @ layer["w1"]) @ layer["w2"]


@functools.partial(jax.jit, static_argnums=0)
def uncached_logits(cfg: Config, params, tokens):
  """(L, V) logits of one whole sequence (L,), causal attention recomputed from scratch (rows
  past the sequence's end, if padded, change nothing before them)."""
  x = params["embed"][tokens] + params["pos"][: tokens.shape[0]]
  for layer in params["layers"]:
    q, k, v = _qkv(cfg, layer, x)
    x = _after_attention(layer, x, jattn.dot_product_attention(q, k, v, is_causal=True))
  return _norm(x) @ params["head"]


# The pools are donated: write_pages updates them in place, as a serving engine must.
@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def engine_step(cfg: Config, params, pools, tokens, positions, query_start, kv_lengths, page_table):
  """One engine step: R ragged rows (tokens (R,), positions (R,); slot b's rows are
  query_start[b] .. query_start[b + 1] - 1, rows past query_start[B] unused) of B slots; writes
  their keys and values into the pools and returns (pools, (R, V) logits)."""
  x = params["embed"][tokens] + params["pos"][jnp.clip(positions, 0, cfg.max_len - 1)]
  new_pools = []
  for layer, (kp, vp) in zip(params["layers"], pools):
    q, k, v = _qkv(cfg, layer, x)
    # The step's metadata serves the write and the read: sequence b's rows go to its last
    # positions (kv_lengths counts them); rows past query_start[B] are not written.
    kp, vp, _, _ = jattn.write_pages(kp, vp, page_table, kv_lengths, k, v, query_start=query_start)
    attended = jattn.paged_attention(q, kp, vp, page_table, kv_lengths, query_start=query_start)
    x = _after_attention(layer, x, attended)
    new_pools.append((kp, vp))
  return new_pools, _norm(x) @ params["head"]


@dataclasses.dataclass
class Request:
  prompt: list
  new_tokens: int
  arrives: int  # engine step at which it arrives
  out: list = dataclasses.field(default_factory=list)
  done_prefill: int = 0  # prompt tokens already in the cache
  slot: int | None = None
  pages: list = dataclasses.field(default_factory=list)


def serve(cfg: Config, params, requests, *, slots: int, budget: int, chunk: int):
  """Run the engine until every request has its tokens; returns (engine steps, tokens made)."""
  H = cfg.head_dim
  pools = [
    (
      jnp.zeros((cfg.pages, cfg.page_size, cfg.kv_heads, H)),
      jnp.zeros((cfg.pages, cfg.page_size, cfg.kv_heads, H)),
    )
    for _ in range(cfg.layers)
  ]
  free = list(range(cfg.pages))
  max_pages = cfg.max_len // cfg.page_size
  table = np.zeros((slots, max_pages), np.int32)
  lengths = np.zeros(slots, np.int32)  # tokens in each slot's cache
  running: list[Request | None] = [None] * slots
  waiting = sorted(requests, key=lambda r: r.arrives)
  step = made = 0
  while waiting or any(running):
    for s in range(slots):  # admit
      if running[s] is None and waiting and waiting[0].arrives <= step:
        running[s], lengths[s] = waiting.pop(0), 0
        running[s].slot = s
    # Each running request's next piece of work, packed into at most `budget` rows.
    tokens, positions, counts = [], [], np.zeros(slots, np.int32)
    for s, r in enumerate(running):
      if r is None:
        continue
      if r.done_prefill < len(r.prompt):
        piece = r.prompt[r.done_prefill : r.done_prefill + min(chunk, budget - len(tokens))]
      else:
        piece = [r.out[-1]] if len(tokens) < budget else []
      for i, t in enumerate(piece):
        tokens.append(t)
        positions.append(int(lengths[s]) + i)
      counts[s] = len(piece)
      need = -(-(int(lengths[s]) + len(piece)) // cfg.page_size)
      while len(r.pages) < need:  # grow the sequence's pages
        r.pages.append(free.pop())
        table[s, len(r.pages) - 1] = r.pages[-1]
    lengths += counts
    R = len(tokens)
    pad = budget - R
    query_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    pools, logits = engine_step(
      cfg,
      params,
      pools,
      jnp.asarray(tokens + [0] * pad, jnp.int32),
      jnp.asarray(positions + [0] * pad, jnp.int32),
      jnp.asarray(query_start),
      jnp.asarray(lengths),
      jnp.asarray(table),
    )
    logits = np.asarray(logits)
    for s, r in enumerate(running):
      if r is None or counts[s] == 0:
        continue
      if r.done_prefill < len(r.prompt):
        r.done_prefill += int(counts[s])
        if r.done_prefill < len(r.prompt):
          continue  # more prompt to go: no token yet
      r.out.append(int(logits[query_start[s + 1] - 1].argmax()))
      made += 1
      if len(r.out) == r.new_tokens:  # finished: its pages go back to the pool
        free.extend(r.pages)
        running[s] = None
        table[s] = 0
        lengths[s] = 0
    step += 1
  return step, made


def greedy_uncached(cfg: Config, params, prompt, new_tokens):
  """The request alone, without a cache: every token from the whole sequence recomputed (padded
  to max_len, so one program serves every length)."""
  seq = list(prompt)
  for _ in range(new_tokens):
    padded = jnp.asarray(seq + [0] * (cfg.max_len - len(seq)), jnp.int32)
    seq.append(int(np.asarray(uncached_logits(cfg, params, padded))[len(seq) - 1].argmax()))
  return seq[len(prompt) :]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tiny", action="store_true", help="a small model and few requests (CI)")
  p.add_argument("--requests", type=int, default=None)
  p.add_argument("--slots", type=int, default=4)
  p.add_argument("--budget", type=int, default=32, help="query rows per engine step")
  p.add_argument("--chunk", type=int, default=16, help="prompt tokens per prefill chunk")
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)
  cfg = TINY if a.tiny else Config()
  n = a.requests or (6 if a.tiny else 16)
  rng = np.random.default_rng(a.seed)
  params = init(cfg, jax.random.key(a.seed))
  top = cfg.max_len // 2
  requests = [
    Request(
      prompt=rng.integers(0, cfg.vocab, int(rng.integers(1, top))).tolist(),
      new_tokens=int(rng.integers(1, cfg.max_len - top)),
      arrives=int(rng.integers(0, 2 * n)),
    )
    for _ in range(n)
  ]
  start = time.perf_counter()
  steps, made = serve(cfg, params, requests, slots=a.slots, budget=a.budget, chunk=a.chunk)
  elapsed = time.perf_counter() - start
  print(
    f"{n} requests, {made} tokens in {steps} engine steps, {elapsed:.2f} s "
    f"({made / elapsed:.1f} tokens/s, compile included)"
  )
  bad = [
    i
    for i, r in enumerate(requests)
    if r.out != greedy_uncached(cfg, params, r.prompt, r.new_tokens)
  ]
  if bad:
    print(f"requests {bad} differ from their uncached greedy runs", file=sys.stderr)
    return 1
  print("every request's tokens equal its uncached greedy run")
  return 0


if __name__ == "__main__":
  sys.exit(main())
