"""One decoding step: a few new queries against a long KV cache, against the memory floor.

  jattn-bench decode [configs/decode.toml] [--S 4096 16384] [--dtypes bfloat16] [--json out]
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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from jattn.bench.config import configs_dir, read_table

DEFAULT_CONFIG = configs_dir() / "decode.toml"
KEYS = {"name", "description", "repeats", "warmup", "batch", "heads", "kv_heads", "head_dim",
        "T", "S", "dtypes", "max_memory_gib"}
IMPLS = ("jattn", "jattn-chunked", "jattn-dense", "jax.nn", "floor")


def load_config(path, overrides=None) -> dict:
  cfg = read_table(path, KEYS, {
      "repeats": 5, "warmup": 1, "batch": 4, "heads": 32, "kv_heads": 8, "head_dim": 128,
      "T": 1, "S": [4096, 16384], "dtypes": ["bfloat16", "float32"], "max_memory_gib": 12.0})
  cfg.update({k: v for k, v in (overrides or {}).items() if v is not None})
  if isinstance(cfg["S"], int):
    cfg["S"] = [cfg["S"]]
  for name in ("repeats", "batch", "heads", "kv_heads", "head_dim", "T"):
    if not isinstance(cfg[name], int) or cfg[name] < 1:
      raise ValueError(f"{path}: {name} must be a positive int, got {cfg[name]!r}")
  if cfg["heads"] % cfg["kv_heads"]:
    raise ValueError(f"{path}: heads={cfg['heads']} must be a multiple of "
                     f"kv_heads={cfg['kv_heads']}")
  bad = [S for S in cfg["S"] if not isinstance(S, int) or S < cfg["T"]]
  if bad:
    raise ValueError(f"{path}: every S must be an int >= T={cfg['T']}, got {bad}")
  bad = set(cfg["dtypes"]) - {"bfloat16", "float16", "float32"}
  if bad:
    raise ValueError(f"{path}: dtypes has {sorted(bad)}; allowed: bfloat16, float16, float32")
  return cfg


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
          q, k, v, key_value_seq_lengths=n, implementation="chunked"),
      "jattn-dense": lambda q, k, v, n: jattn.dot_product_attention(
          q, k, v, key_value_seq_lengths=n, implementation="dense"),
      "jax.nn": lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v,
                                                                key_value_seq_lengths=n),
      "floor": lambda q, k, v, n: (k.astype(jnp.float32).sum(), v.astype(jnp.float32).sum()),
  }


def run(cfg: dict, log=print) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jattn.bench.runner import settle

  B, N, K, H, T = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["T"]
  fns = {name: jax.jit(f) for name, f in _functions().items()}
  rows = []
  for dtype in cfg["dtypes"]:
    for S in cfg["S"]:
      dt = jnp.dtype(dtype)
      cache_bytes = 2 * B * S * K * H * dt.itemsize
      # Inputs, and the whole-cache copies dense and jax.nn make (float32 on a CPU).
      need = cache_bytes + 2 * B * S * K * H * 4
      base = dict(dtype=dtype, B=B, N=N, K=K, H=H, T=T, S=S, cache_mib=cache_bytes / 2 ** 20)
      if need > cfg["max_memory_gib"] * 2 ** 30:
        rows.append(dict(base, status="skipped",
                         reason=f"needs ~{need / 2 ** 30:.1f} GiB > {cfg['max_memory_gib']}"))
        log(f"{dtype} S={S}: skipped (~{need / 2 ** 30:.1f} GiB)")
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
      times = {name: [] for name in fns}
      for _ in range(cfg["repeats"]):
        for name, f in fns.items():
          settle()
          start = time.perf_counter()
          jax.block_until_ready(f(*args))
          times[name].append(time.perf_counter() - start)
      ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
      want = np.asarray(outs["jattn-dense"], np.float32)
      row = dict(base, status="ok", ms=ms, first_call_s=compile_s,
                 vs_floor={n: ms[n] / ms["floor"] for n in ms if n != "floor"},
                 jattn_speedup_vs_jax_nn=ms["jax.nn"] / ms["jattn"],
                 max_abs_diff={n: float(np.abs(np.asarray(outs[n], np.float32) - want).max())
                               for n in ("jattn", "jattn-chunked", "jax.nn")})
      rows.append(row)
      log(f"{dtype} S={S}: " + ", ".join(f"{n} {t:.1f} ms" for n, t in ms.items()))
  return rows


def table(rows: list[dict]) -> str:
  head = ("| dtype | S | cache MiB | jattn ms | chunked ms | dense ms | jax.nn ms | floor ms | "
          "jattn / floor | jattn speed-up vs jax.nn | max abs diff |")
  lines = [head, "|---" * (head.count("|") - 1) + "|"]
  for r in rows:
    if r["status"] != "ok":
      lines.append(f"| {r['dtype']} | {r['S']} | {r['cache_mib']:.0f} | {r['reason']} "
                   "| | | | | | | |")
      continue
    ms = r["ms"]
    lines.append(
        f"| {r['dtype']} | {r['S']} | {r['cache_mib']:.0f} | {ms['jattn']:.1f} | "
        f"{ms['jattn-chunked']:.1f} | {ms['jattn-dense']:.1f} | {ms['jax.nn']:.1f} | "
        f"{ms['floor']:.1f} | {r['vs_floor']['jattn']:.1f}x | "
        f"{r['jattn_speedup_vs_jax_nn']:.2f} | {max(r['max_abs_diff'].values()):.1e} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="jattn-bench decode", description=__doc__.split("\n")[0])
  p.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG),
                 help="TOML config (default: the shipped configs/decode.toml)")
  p.add_argument("--S", type=int, nargs="+", help="cache lengths (override the config)")
  p.add_argument("--dtypes", nargs="+", help="dtypes (override the config)")
  p.add_argument("--repeats", type=int, help="timed rounds (override the config)")
  p.add_argument("--json", help="also write the rows to this JSON file")
  a = p.parse_args(argv)
  try:
    cfg = load_config(a.config, dict(S=a.S, dtypes=a.dtypes, repeats=a.repeats))
  except (OSError, ValueError) as e:
    print(f"jattn-bench decode: {e}", file=sys.stderr)
    return 2
  log = lambda s: print(s, file=sys.stderr, flush=True)
  rows = run(cfg, log)
  print(f"<!-- jattn-bench decode: B={cfg['batch']} N={cfg['heads']} K={cfg['kv_heads']} "
        f"H={cfg['head_dim']} T={cfg['T']}, medians of {cfg['repeats']} interleaved rounds -->")
  print(table(rows))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(config=cfg, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
