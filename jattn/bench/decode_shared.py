"""The shared-prefix step of `jattn-bench decode` (`jattn.bench.decode_bench`): R requests after
one prefix whose pages the pool holds once (a system prompt), timed two ways per page layout.
``plain`` is one `jattn.paged_attention` call over every request's whole page table (the prefix's
pages read once per request); ``cascade`` one call over the prefix for all requests (their query
rows stacked as one sequence's, not causal) and one causal call over each request's own pages,
merged by `jattn.merge_attention` (examples/shared_prefix.py shows it step by step)."""

from __future__ import annotations

import functools

from jattn.bench.timing import interleaved


def _cascade(q, kp, vp, shared_table, shared_lens, own_table, own_lens, *, layout):
  """One group's step over a shared prefix: the prefix once for all R requests (their query
  rows stacked as one sequence's, not causal: all come after the prefix), each request's own
  pages causal, merged by log-sum-exp. q (R, T, N, H) -> (R, T, N, Hv)."""
  import jattn

  R, T, N, H = q.shape
  out_s, lse_s = jattn.paged_attention(
    q.reshape(1, R * T, N, H),
    kp,
    vp,
    shared_table,
    shared_lens,
    is_causal=False,
    kv_layout=layout,
    return_residual=True,
  )
  out_o, lse_o = jattn.paged_attention(
    q, kp, vp, own_table, own_lens, kv_layout=layout, return_residual=True
  )
  out, _ = jattn.merge_attention(
    [out_s.reshape(out_o.shape), out_o], [lse_s.reshape(lse_o.shape), lse_o]
  )
  return out


def _shared_pool(cfg: dict):
  """A float32 pool (NHD) holding one prefix of whole pages, stored once, and R requests' own
  pages, in shuffled order: (kp, vp, the plain tables (R, all pages), the prefix's table (1,
  prefix pages), the own tables (R, own pages))."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  K, H, ps = cfg["kv_heads"], cfg["head_dim"], cfg["shared_page_size"]
  R, n_pre, n_own = cfg["shared_requests"], cfg["shared_prefix"] // ps, -(-cfg["shared_own"] // ps)
  ids = np.random.default_rng(cfg["shared_prefix"]).permutation(n_pre + R * n_own).astype(np.int32)
  shared, own = ids[:n_pre].reshape(1, n_pre), ids[n_pre:].reshape(R, n_own)
  plain = np.concatenate([np.repeat(shared, R, 0), own], axis=1)
  kp, vp = (
    jax.random.normal(k, (ids.size, ps, K, H), jnp.float32)
    for k in jax.random.split(jax.random.key(cfg["shared_prefix"]), 2)
  )
  # The prefix's table (1, 1) when it has no pages: a row is needed, its length 0 reads none.
  shared = shared if n_pre else np.zeros((1, 1), np.int32)
  return kp, vp, *(jnp.asarray(t) for t in (plain, shared, own))


def run_shared_prefix(cfg: dict, log=print) -> list[dict]:
  """The shared-prefix rows: R requests over one prefix, the plain paged call over each
  request's whole page table against the cascade (`_cascade`), per page layout."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jattn

  N, K, H, T = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["T"]
  R, prefix, own = cfg["shared_requests"], cfg["shared_prefix"], cfg["shared_own"]
  kp, vp, plain_table, shared_table, own_table = _shared_pool(cfg)
  hnd = jax.jit(lambda x: jnp.swapaxes(x, 1, 2))  # pages (P, K, page_size, H)
  q = jax.random.normal(jax.random.key(1), (R, T, N, H), jnp.float32)
  lens = jnp.full((R,), prefix + own, jnp.int32)
  shared_lens, own_lens = jnp.full((1,), prefix, jnp.int32), jnp.full((R,), own, jnp.int32)
  rows = []
  for layout in cfg["page_layouts"]:
    pools = (kp, vp) if layout == "NHD" else (hnd(kp), hnd(vp))
    plain = jax.jit(functools.partial(jattn.paged_attention, kv_layout=layout))
    cascade = jax.jit(functools.partial(_cascade, layout=layout))
    calls = {
      "plain": functools.partial(plain, q, *pools, plain_table, lens),
      "cascade": functools.partial(
        cascade, q, *pools, shared_table, shared_lens, own_table, own_lens
      ),
    }
    outs = {name: np.asarray(jax.block_until_ready(f())) for name, f in calls.items()}
    for _ in range(cfg["warmup"]):
      for f in calls.values():
        jax.block_until_ready(f())
    ms = interleaved(calls, cfg["repeats"], warmup=False, settle=True)
    token_mib = 2 * K * H * 4 / 2**20  # one token's keys and values, float32
    rows.append(
      dict(
        kind="shared_prefix",
        layout=layout,
        page_dtype="float32",
        page_size=cfg["shared_page_size"],
        B=R,
        N=N,
        K=K,
        H=H,
        T=T,
        prefix=prefix,
        own=own,
        status="ok",
        ms=ms,
        plain_vs_cascade=ms["plain"] / ms["cascade"],
        # Pages each reads: every request's whole table, or the prefix once and the own pages.
        read_mib=dict(plain=R * (prefix + own) * token_mib, cascade=(prefix + R * own) * token_mib),
        max_abs_diff=float(np.abs(outs["cascade"] - outs["plain"]).max()),
      )
    )
    log(
      f"shared prefix {prefix} x {R} requests + {own} own, {layout}: plain {ms['plain']:.1f} ms, "
      f"cascade {ms['cascade']:.1f} ms"
    )
  return rows


def shared_prefix_table(rows: list[dict]) -> str:
  head = (
    "| shared prefix | requests | own tokens | layout | page size | plain ms | cascade ms | "
    "plain / cascade | MiB read plain | MiB read cascade | max abs diff |"
  )
  lines = [head, "|---" * (head.count("|") - 1) + "|"]
  for r in rows:
    lines.append(
      f"| {r['prefix']} | {r['B']} | {r['own']} | {r['layout']} | {r['page_size']} | "
      f"{r['ms']['plain']:.1f} | {r['ms']['cascade']:.1f} | {r['plain_vs_cascade']:.2f}x | "
      f"{r['read_mib']['plain']:.1f} | {r['read_mib']['cascade']:.1f} | "
      f"{r['max_abs_diff']:.1e} |"
    )
  return "\n".join(lines)
