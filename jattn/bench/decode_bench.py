"""One decoding step: a few new queries against a long KV cache, against the memory floor.

  jattn-bench decode [configs/decode.toml] [--S 4096 16384] [--dtypes bfloat16] [--json out]
  jattn-bench decode --shared-prefix-only [--shared-prefix 4096] [--shared-requests 64]
  python -m jattn.bench.decode_bench [...]   # the same

A decoding step reads the whole cache and does little arithmetic with it, so its floor is the
time to stream K and V from memory once (here: a float32 sum of each, one pass). For every cache
length S and dtype it times, interleaved (A B C ... A B C ...) with medians and the process
settled between calls (`jattn.bench.runner.settle`):

- ``jattn``: `jattn.dot_product_attention` with its defaults (implementation=None picks per
  platform where the program is lowered; see docs/implementations.md, "Decoding");
- ``jattn-chunked`` and ``jattn-dense``: each implementation asked for by name;
- ``jax.nn``: `jax.nn.dot_product_attention` (XLA);
- ``floor``: streaming K and V once.

Each row gives the median milliseconds, the ratio to the floor and jattn's speed-up over jax.nn
(above 1 is faster), and the largest difference from jattn dense's output. Cases whose inputs
and one full-size copy would not fit ``max_memory_gib`` are skipped and listed.

With ``page_sizes`` (and ``page_dtypes``: float32, bfloat16, int8, float8_e4m3fn, float8_e5m2)
it also times `jattn.paged_attention` on a pool of pages in shuffled order (each sequence S
tokens; quantised pages with per-token-and-head scales), interleaved with its own floor: one
read of exactly the pool's bytes in their dtype -- the faster of two one-pass readers, a float32
sum and a max over the bytes as unsigned integers of the same width (on XLA's CPU backend
either can be the slow one: integer reductions are not vectorised, float8 converts in
software). Each paged row gives its time, the ratio to that floor, the ratio to the float32
pool's step of the same S and page size, and the largest difference from jattn's chunked kernels
on the same (dequantised) cache laid out contiguously.

With ``shared_prefix`` (tokens, whole pages of ``shared_page_size``) it also times a shared-prefix
step: ``shared_requests`` requests, each with ``shared_own`` tokens of its own after one prefix
whose pages the pool holds once (a system prompt; float32 pages in shuffled order), per page
layout. ``plain`` is one `jattn.paged_attention` call over every request's whole page table (the
prefix's pages read once per request); ``cascade`` one call over the prefix for all requests
(their query rows stacked as one sequence's, not causal) and one causal call over each request's
own pages, merged by `jattn.merge_attention` (examples/shared_prefix.py shows it step by step).
The row gives both times, plain / cascade (above 1: the cascade is faster), the pages each reads
and the largest difference between the two (``--shared-prefix-only``: these rows alone).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from jattn.bench import decode_shared
from jattn.bench.config import configs_dir, read_table
from jattn.bench.timing import interleaved

DEFAULT_CONFIG = configs_dir() / "decode.toml"
KEYS = {
  "name",
  "description",
  "repeats",
  "warmup",
  "batch",
  "heads",
  "kv_heads",
  "head_dim",
  "T",
  "S",
  "dtypes",
  "max_memory_gib",
  "page_sizes",
  "page_dtypes",
  "page_layouts",
  "shared_prefix",
  "shared_requests",
  "shared_own",
  "shared_page_size",
}
PAGE_DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2")
IMPLS = ("jattn", "jattn-chunked", "jattn-dense", "jax.nn", "floor")


def load_config(path, overrides=None) -> dict:
  cfg = read_table(
    path,
    KEYS,
    {
      "repeats": 5,
      "warmup": 1,
      "batch": 4,
      "heads": 32,
      "kv_heads": 8,
      "head_dim": 128,
      "T": 1,
      "S": [4096, 16384],
      "dtypes": ["bfloat16", "float32"],
      "max_memory_gib": 12.0,
      "page_sizes": [],
      "page_dtypes": ["float32", "bfloat16", "int8", "float8_e4m3fn"],
      "page_layouts": ["NHD", "HND"],
      "shared_prefix": 0,
      "shared_requests": 64,
      "shared_own": 256,
      "shared_page_size": 16,
    },
  )
  cfg.update({k: v for k, v in (overrides or {}).items() if v is not None})
  if isinstance(cfg["S"], int):
    cfg["S"] = [cfg["S"]]
  for name in ("repeats", "batch", "heads", "kv_heads", "head_dim", "T"):
    if not isinstance(cfg[name], int) or cfg[name] < 1:
      raise ValueError(f"{path}: {name} must be a positive int, got {cfg[name]!r}")
  if cfg["heads"] % cfg["kv_heads"]:
    raise ValueError(
      f"{path}: heads={cfg['heads']} must be a multiple of kv_heads={cfg['kv_heads']}"
    )
  bad_lengths = [S for S in cfg["S"] if not isinstance(S, int) or S < cfg["T"]]
  if bad_lengths:
    raise ValueError(f"{path}: every S must be an int >= T={cfg['T']}, got {bad_lengths}")
  bad_dtypes = set(cfg["dtypes"]) - {"bfloat16", "float16", "float32"}
  if bad_dtypes:
    raise ValueError(
      f"{path}: dtypes has {sorted(bad_dtypes)}; allowed: bfloat16, float16, float32"
    )
  bad_page_dtypes = set(cfg["page_dtypes"]) - set(PAGE_DTYPES)
  if bad_page_dtypes:
    raise ValueError(
      f"{path}: page_dtypes has {sorted(bad_page_dtypes)}; allowed: {', '.join(PAGE_DTYPES)}"
    )
  bad_sizes = [p for p in cfg["page_sizes"] if not isinstance(p, int) or p < 1]
  if bad_sizes:
    raise ValueError(f"{path}: page_sizes must be positive ints, got {bad_sizes}")
  bad_layouts = set(cfg["page_layouts"]) - {"NHD", "HND"}
  if bad_layouts or not cfg["page_layouts"]:
    raise ValueError(f"{path}: page_layouts must be some of NHD, HND, got {cfg['page_layouts']}")
  _check_shared(path, cfg)
  return cfg


def _check_shared(path, cfg: dict) -> None:
  """The shared-prefix row's sizes: a prefix of whole pages (0: no row), own tokens >= T."""
  for name in ("shared_prefix", "shared_requests", "shared_own", "shared_page_size"):
    least = 0 if name == "shared_prefix" else 1
    if not isinstance(cfg[name], int) or cfg[name] < least:
      raise ValueError(f"{path}: {name} must be an int >= {least}, got {cfg[name]!r}")
  if cfg["shared_prefix"] % cfg["shared_page_size"]:
    raise ValueError(
      f"{path}: shared_prefix={cfg['shared_prefix']} must be whole pages of "
      f"shared_page_size={cfg['shared_page_size']} (the pages every request shares)"
    )
  if cfg["shared_own"] < cfg["T"]:
    raise ValueError(f"{path}: shared_own={cfg['shared_own']} must be at least T={cfg['T']}")


def _functions():
  import jax
  import jax.numpy as jnp

  import jattn

  # The cache's fill level as a run-time length per example, as a decoding loop under jit has
  # it (jattn's Flax modules pass the same as a run-time causal offset): the key blocks to read
  # are known only when the step runs. jax.nn takes the same argument.
  return {
    "jattn": lambda q, k, v, n: jattn.dot_product_attention(q, k, v, key_value_seq_lengths=n),
    "jattn-chunked": lambda q, k, v, n: jattn.dot_product_attention(
      q, k, v, key_value_seq_lengths=n, implementation="chunked"
    ),
    "jattn-dense": lambda q, k, v, n: jattn.dot_product_attention(
      q, k, v, key_value_seq_lengths=n, implementation="dense"
    ),
    "jax.nn": lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n),
    "floor": lambda q, k, v, n: (k.astype(jnp.float32).sum(), v.astype(jnp.float32).sum()),
  }


def run(cfg: dict, log=print) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  B, N, K, H, T = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["T"]
  fns = {name: jax.jit(f) for name, f in _functions().items()}
  rows = []
  for dtype in cfg["dtypes"]:
    for S in cfg["S"]:
      dt = jnp.dtype(dtype)
      cache_bytes = 2 * B * S * K * H * dt.itemsize
      # Inputs, and the whole-cache copies dense and jax.nn make (float32 on a CPU).
      need = cache_bytes + 2 * B * S * K * H * 4
      base = dict(dtype=dtype, B=B, N=N, K=K, H=H, T=T, S=S, cache_mib=cache_bytes / 2**20)
      if need > cfg["max_memory_gib"] * 2**30:
        rows.append(
          dict(
            base,
            status="skipped",
            reason=f"needs ~{need / 2**30:.1f} GiB > {cfg['max_memory_gib']}",
          )
        )
        log(f"{dtype} S={S}: skipped (~{need / 2**30:.1f} GiB)")
        continue
      keys = jax.random.split(jax.random.key(S), 3)
      q = jax.random.normal(keys[0], (B, T, N, H), dt)
      k = jax.random.normal(keys[1], (B, S, K, H), dt)
      v = jax.random.normal(keys[2], (B, S, K, H), dt)
      args = (q, k, v, jnp.full((B,), S, jnp.int32))  # a full cache
      outs, compile_s = {}, {}
      for name, f in fns.items():
        start = time.perf_counter()
        outs[name] = jax.block_until_ready(f(*args))
        compile_s[name] = time.perf_counter() - start
        for _ in range(cfg["warmup"]):
          jax.block_until_ready(f(*args))
      ms = interleaved(
        {name: functools.partial(f, *args) for name, f in fns.items()},
        cfg["repeats"],
        warmup=False,
        settle=True,
      )
      want = np.asarray(outs["jattn-dense"], np.float32)
      row = dict(
        base,
        status="ok",
        ms=ms,
        first_call_s=compile_s,
        vs_floor={n: ms[n] / ms["floor"] for n in ms if n != "floor"},
        jattn_speedup_vs_jax_nn=ms["jax.nn"] / ms["jattn"],
        max_abs_diff={
          n: float(np.abs(np.asarray(outs[n], np.float32) - want).max())
          for n in ("jattn", "jattn-chunked", "jax.nn")
        },
      )
      rows.append(row)
      log(f"{dtype} S={S}: " + ", ".join(f"{n} {t:.1f} ms" for n, t in ms.items()))
  return rows


def _pool(key, B, S, K, H, page_size, dtype):
  """A pool holding B sequences of S tokens in shuffled pages, its table, the scales of
  quantised pages (per token and head) and the contiguous dequantised (B, S, K, H) cache."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  n = -(-S // page_size)
  P = B * n
  table = np.random.default_rng(S + page_size).permutation(P).reshape(B, n).astype(np.int32)
  pools, scales, caches = [], [], []
  for k in jax.random.split(key, 2):
    x = jax.random.normal(k, (P, page_size, K, H), jnp.float32)
    if dtype in ("int8", "float8_e4m3fn", "float8_e5m2"):
      top = 127.0 if dtype == "int8" else float(jnp.finfo(dtype).max)
      scale = jnp.abs(x).max(axis=-1) / top
      q = x / scale[..., None]
      x = (jnp.round(q) if dtype == "int8" else q).astype(dtype)
      deq = x.astype(jnp.float32) * scale[..., None]
    else:
      x, scale = x.astype(dtype), None
      deq = x.astype(jnp.float32)
    pools.append(x)
    scales.append(scale)
    caches.append(deq[jnp.asarray(table)].reshape(B, n * page_size, K, H)[:, :S])
  return pools, scales, jnp.asarray(table), caches


def _floor_max(x):
  """Read every byte of ``x`` once, as unsigned integers of its width."""
  import jax
  import jax.numpy as jnp

  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
  return jax.lax.bitcast_convert_type(x, width).max()


def _floor_sum(x):
  """Read every element of ``x`` once, summed in float32."""
  import jax.numpy as jnp

  return x.astype(jnp.float32).sum()


def run_paged(cfg: dict, log=print) -> list[dict]:
  """The paged rows: `jattn.paged_attention` against its floor, per S, page size and dtype."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jattn

  B, N, K, H, T = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["T"]
  # implementation=None, and on an accelerator also the XLA walk beside the kernel it picks (on
  # a CPU None is the walk; the Pallas kernels' interpret mode is a test, not a figure).
  impls = [None] + (["chunked"] if jax.default_backend() in ("gpu", "tpu") else [])
  paged = {
    (layout, impl): jax.jit(functools.partial(_paged_call, layout=layout, impl=impl))
    for layout in ("NHD", "HND")
    for impl in impls
  }
  # The same pool head-major: pages (P, K, page_size, H), token scales (P, K, page_size).
  hnd = jax.jit(lambda *xs: [None if x is None else jnp.swapaxes(x, 1, 2) for x in xs])
  contiguous = jax.jit(
    lambda q, k, v, n: jattn.dot_product_attention(
      q, k, v, key_value_seq_lengths=n, is_causal="bottom_right", implementation="chunked"
    )
  )
  floor_max = jax.jit(lambda k, v: (_floor_max(k), _floor_max(v)))
  floor_sum = jax.jit(lambda k, v: (_floor_sum(k), _floor_sum(v)))
  rows: list[dict[str, Any]] = []
  for S in cfg["S"]:
    for page_size in cfg["page_sizes"]:
      for dtype in cfg["page_dtypes"]:
        base = dict(
          kind="paged",
          page_dtype=dtype,
          page_size=page_size,
          B=B,
          N=N,
          K=K,
          H=H,
          T=T,
          S=S,
          layout=None,
        )
        need = 4 * B * S * K * H * 4  # float32 pools while quantising, and the contiguous copy
        if need > cfg["max_memory_gib"] * 2**30:
          rows.extend(
            dict(
              base,
              layout=layout,
              status="skipped",
              reason=f"needs ~{need / 2**30:.1f} GiB > {cfg['max_memory_gib']}",
            )
            for layout in cfg["page_layouts"]
          )
          continue
        (kp, vp), (ks, vs), table, (kc, vc) = _pool(jax.random.key(S), B, S, K, H, page_size, dtype)
        qdt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
        q = jax.random.normal(jax.random.key(1), (B, T, N, H), jnp.float32).astype(qdt)
        lens = jnp.full((B,), S, jnp.int32)
        pools = {"NHD": (kp, vp, ks, vs)}
        if "HND" in cfg["page_layouts"]:
          pools["HND"] = tuple(hnd(kp, vp, ks, vs))
        paged_calls = {
          key: functools.partial(paged[key], q, p[0], p[1], table, lens, p[2], p[3])
          for key in paged
          for layout, p in pools.items()
          if key[0] == layout and layout in cfg["page_layouts"]
        }
        ran = {
          key: _ran(
            paged[key], q, pools[key[0]][0], pools[key[0]][1], table, lens, *pools[key[0]][2:]
          )
          for key in paged_calls
        }
        # Keyed by (layout, implementation) of a paged call, or by the name of a floor.
        calls: dict[tuple[str, str | None] | str, Callable[[], Any]] = dict(paged_calls.items())
        calls.update(
          {"floor-sum": lambda: floor_sum(kp, vp), "floor-max": lambda: floor_max(kp, vp)}
        )
        outs = {key: jax.block_until_ready(calls[key]()) for key in ran}
        for _ in range(cfg["warmup"] + 1):
          for f in calls.values():
            jax.block_until_ready(f())
        ms = interleaved(calls, cfg["repeats"], warmup=False, settle=True)
        floor = min(ms["floor-sum"], ms["floor-max"])
        want = np.asarray(contiguous(q.astype(jnp.float32), kc, vc, lens))
        for (layout, impl), out in outs.items():
          t = ms[layout, impl]
          rows.append(
            dict(
              base,
              layout=layout,
              status="ok",
              implementation=ran[layout, impl],
              requested=impl,
              ms=dict(paged=t, floor=floor, **{k: ms[k] for k in ("floor-sum", "floor-max")}),
              vs_floor=t / floor,
              pool_mib=2 * kp.size * jnp.dtype(kp.dtype).itemsize / 2**20,
              max_abs_diff=float(np.abs(np.asarray(out, np.float32) - want).max()),
            )
          )
          log(
            f"paged {layout} {dtype} page {page_size} S={S} ({ran[layout, impl]}): "
            f"{t:.1f} ms, floor {floor:.1f} ms"
          )
  f32 = {
    (r["S"], r["page_size"], r["layout"], r["requested"]): r["ms"]["paged"]
    for r in rows
    if r["status"] == "ok" and r["page_dtype"] == "float32"
  }
  for r in rows:
    if r["status"] == "ok":
      key = (r["S"], r["page_size"], r["layout"], r["requested"])
      r["vs_float32"] = r["ms"]["paged"] / f32[key] if key in f32 else None
  return rows


def _paged_call(q, kp, vp, table, lens, ks, vs, *, layout, impl):
  import jattn

  return jattn.paged_attention(
    q, kp, vp, table, lens, k_scale=ks, v_scale=vs, kv_layout=layout, implementation=impl
  )


def _ran(jitted, *args) -> str:
  """Which paged kernel a jitted call's program holds, read from the program lowered here."""
  text = jitted.lower(*args).as_text()
  if "tpu_custom_call" in text:
    return "pallas (Mosaic TPU)"
  if "triton" in text:
    return "pallas (Triton GPU)"
  return "chunked (XLA walk)"


def paged_table(rows: list[dict]) -> str:
  head = (
    "| paged pool | layout | kernel | page size | S | pool MiB | paged ms | floor ms | "
    "paged / floor | / float32 pool | max abs diff |"
  )
  lines = [head, "|---" * (head.count("|") - 1) + "|"]
  for r in rows:
    if r["status"] != "ok":
      lines.append(
        f"| {r['page_dtype']} | {r['layout']} | | {r['page_size']} | {r['S']} | "
        f"{r['reason']} | | | | | |"
      )
      continue
    rel = "-" if r["vs_float32"] is None else f"{r['vs_float32']:.2f}x"
    lines.append(
      f"| {r['page_dtype']} | {r['layout']} | {r['implementation']} | "
      f"{r['page_size']} | {r['S']} | "
      f"{r['pool_mib']:.0f} | "
      f"{r['ms']['paged']:.1f} | {r['ms']['floor']:.1f} | {r['vs_floor']:.2f}x | "
      f"{rel} | {r['max_abs_diff']:.1e} |"
    )
  return "\n".join(lines)


def table(rows: list[dict]) -> str:
  head = (
    "| dtype | S | cache MiB | jattn ms | chunked ms | dense ms | jax.nn ms | floor ms | "
    "jattn / floor | jattn speed-up vs jax.nn | max abs diff |"
  )
  lines = [head, "|---" * (head.count("|") - 1) + "|"]
  for r in rows:
    if r["status"] != "ok":
      lines.append(
        f"| {r['dtype']} | {r['S']} | {r['cache_mib']:.0f} | {r['reason']} | | | | | | | |"
      )
      continue
    ms = r["ms"]
    lines.append(
      f"| {r['dtype']} | {r['S']} | {r['cache_mib']:.0f} | {ms['jattn']:.1f} | "
      f"{ms['jattn-chunked']:.1f} | {ms['jattn-dense']:.1f} | {ms['jax.nn']:.1f} | "
      f"{ms['floor']:.1f} | {r['vs_floor']['jattn']:.1f}x | "
      f"{r['jattn_speedup_vs_jax_nn']:.2f} | {max(r['max_abs_diff'].values()):.1e} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="jattn-bench decode", description=__doc__.split("\n")[0])
  p.add_argument(
    "config",
    nargs="?",
    default=str(DEFAULT_CONFIG),
    help="TOML config (default: the shipped configs/decode.toml)",
  )
  p.add_argument("--S", type=int, nargs="+", help="cache lengths (override the config)")
  p.add_argument("--dtypes", nargs="+", help="dtypes (override the config)")
  p.add_argument("--repeats", type=int, help="timed rounds (override the config)")
  p.add_argument(
    "--page-sizes",
    type=int,
    nargs="*",
    help="time jattn.paged_attention with these page sizes (override the config)",
  )
  p.add_argument(
    "--page-dtypes", nargs="+", choices=PAGE_DTYPES, help="page pool dtypes (override the config)"
  )
  p.add_argument(
    "--page-layouts", nargs="+", choices=("NHD", "HND"), help="pool layouts (override the config)"
  )
  p.add_argument("--paged-only", action="store_true", help="only the paged rows")
  p.add_argument(
    "--shared-prefix",
    type=int,
    help="tokens of the shared-prefix row's prefix, 0: no such row (override the config)",
  )
  p.add_argument("--shared-requests", type=int, help="the shared-prefix row's requests")
  p.add_argument("--shared-own", type=int, help="own tokens of each of its requests")
  p.add_argument("--shared-prefix-only", action="store_true", help="only the shared-prefix rows")
  p.add_argument("--json", help="also write the rows to this JSON file")
  a = p.parse_args(argv)
  try:
    cfg = load_config(
      a.config,
      dict(
        S=a.S,
        dtypes=a.dtypes,
        repeats=a.repeats,
        page_sizes=a.page_sizes,
        page_dtypes=a.page_dtypes,
        page_layouts=a.page_layouts,
        shared_prefix=a.shared_prefix,
        shared_requests=a.shared_requests,
        shared_own=a.shared_own,
      ),
    )
  except (OSError, ValueError) as e:
    print(f"jattn-bench decode: {e}", file=sys.stderr)
    return 2
  log = lambda s: print(s, file=sys.stderr, flush=True)
  only = a.paged_only or a.shared_prefix_only
  rows = [] if only else run(cfg, log)
  paged = run_paged(cfg, log) if cfg["page_sizes"] and not a.shared_prefix_only else []
  shared = (
    decode_shared.run_shared_prefix(cfg, log) if cfg["shared_prefix"] and not a.paged_only else []
  )
  print(
    f"<!-- jattn-bench decode: B={cfg['batch']} (the shared-prefix rows: their requests) "
    f"N={cfg['heads']} K={cfg['kv_heads']} "
    f"H={cfg['head_dim']} T={cfg['T']}, medians of {cfg['repeats']} interleaved rounds -->"
  )
  if rows:
    print(table(rows))
  if paged:
    print(paged_table(paged))
  if shared:
    print(decode_shared.shared_prefix_table(shared))
  rows = rows + paged + shared
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(config=cfg, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
