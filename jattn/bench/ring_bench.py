"""Ring attention on host CPU devices: its overhead against the same problem on one device.

  python benchmarks/ring_bench.py [configs/ring.toml] [--devices P] [--T 4096 ...] [--json out]
  python -m jattn.bench.ring_bench [...]   # the same; or `jattn-bench ring` (the shipped config)

The number of host devices is fixed when JAX starts, so the script re-runs itself in a child
process with ``XLA_FLAGS=--xla_force_host_platform_device_count=P``. In the child, for every
(T, mask, layout, pass) it times ``jattn.ring_attention_sharded`` over a P-device mesh and
``jattn.dot_product_attention(implementation="chunked")`` on one device, with the same global
problem and block size: warm-up first, ``block_until_ready``, the median of the repeats, compile
time apart.

Host devices share the machine's cores, so nothing runs faster: ``ring / one`` is the cost of
splitting the sequence (P^2 smaller kernel calls, the ppermute copies, merging partial results)
plus load imbalance, the part that real accelerators do not hide. The table also gives the
tiles each device computes (max / min over devices, from the kernel's block maps) and the
paper estimate of one ring step: bytes of the K and V shard sent versus FLOPs of one
(query shard, key shard) block (see docs/ring.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

from jattn.bench import host_devices
from jattn.bench.config import configs_dir, read_table

DEFAULT_CONFIG = configs_dir() / "ring.toml"
KEYS = {
  "name",
  "description",
  "devices",
  "repeats",
  "warmup",
  "batch",
  "heads",
  "kv_heads",
  "head_dim",
  "T",
  "block",
  "dtype",
  "layouts",
  "masks",
  "passes",
}
MASKS = ("full", "causal")
PASSES = ("forward", "forward+backward")


def load_config(path, overrides):
  cfg = read_table(
    path,
    KEYS,
    {
      "devices": 4,
      "repeats": 3,
      "warmup": 1,
      "batch": 1,
      "heads": 8,
      "head_dim": 64,
      "T": [2048],
      "block": 512,
      "dtype": "float32",
      "layouts": ["contiguous", "zigzag"],
      "masks": ["causal"],
      "passes": list(PASSES),
    },
  )
  cfg.update({k: v for k, v in overrides.items() if v is not None})
  cfg.setdefault("kv_heads", cfg["heads"])
  if isinstance(cfg["T"], int):
    cfg["T"] = [cfg["T"]]
  for key, allowed in (("masks", MASKS), ("passes", PASSES), ("layouts", ("contiguous", "zigzag"))):
    bad = set(cfg[key]) - set(allowed)
    if bad:
      raise ValueError(f"{path}: {key} has {sorted(bad)}; allowed: {allowed}")
  P = cfg["devices"]
  for T in cfg["T"]:
    if T % (2 * P):
      raise ValueError(f"T={T} must be a multiple of 2 * devices = {2 * P} (the zigzag chunks)")
  return cfg


def _median_time(fn, args, repeats, warmup):
  import jax

  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - start
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times), compile_s


def child(cfg):
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jattn
  from jattn._parallel import ring_loop

  P = cfg["devices"]
  assert jax.device_count() >= P, jax.devices()
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:P]), ("seq",))
  seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))
  dtype = jnp.dtype(cfg["dtype"])
  B, N, K, H, blk = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["block"]
  rows = []
  for T in cfg["T"]:
    rng = np.random.default_rng(0)
    q, do = (jnp.asarray(rng.standard_normal((B, T, N, H)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), dtype) for _ in range(2))
    Ts = T // P
    for mask in cfg["masks"]:
      causal = mask == "causal"
      kw = dict(is_causal=causal)
      for pss in cfg["passes"]:
        one = lambda q, k, v, do: jattn.dot_product_attention(
          q, k, v, implementation="chunked", block_q=blk, block_kv=blk, **kw
        )
        t_one, c_one = _median_time(_pass(one, pss), (q, k, v, do), cfg["repeats"], cfg["warmup"])
        for layout in cfg["layouts"]:
          # Inputs are laid out once, as a data pipeline would, outside the timed function.
          lay = (lambda x: jattn.zigzag_permute(x, P)) if layout == "zigzag" else (lambda x: x)
          args = tuple(jax.device_put(lay(x), seq) for x in (q, k, v, do))
          # Zigzag blocks stay within one of a device's two chunks. The kernel only clips an
          # explicit block to the shard, so pass it the block the tiles below are counted for.
          bq = min(blk, Ts // 2) if layout == "zigzag" else min(blk, Ts)
          ring = lambda q, k, v, do, layout=layout, bq=bq: jattn.ring_attention_sharded(
            q, k, v, mesh=mesh, seq_axis="seq", layout=layout, block_q=bq, block_kv=bq, **kw
          )
          t_ring, c_ring = _median_time(_pass(ring, pss), args, cfg["repeats"], cfg["warmup"])
          work, _ = ring_loop.tiles_per_device(P, layout, Ts, Ts, bq, bq, hi=0 if causal else None)
          itemsize = dtype.itemsize
          rows.append(
            dict(
              case=f"T={T} B={B} N={N} K={K} H={H} {cfg['dtype']} {mask}",
              layout=layout,
              passes=pss,
              devices=P,
              block=bq,
              one_s=t_one,
              ring_s=t_ring,
              ratio=t_ring / t_one,
              compile_one_s=c_one,
              compile_ring_s=c_ring,
              tiles_max=int(work.max()),
              tiles_min=int(work.min()),
              step_bytes=2 * B * Ts * K * H * itemsize,
              step_flops=4 * B * N * Ts * Ts * H,
            )
          )
  return rows


def _pass(fn, pss):
  import jax
  import jax.numpy as jnp

  if pss == "forward":
    return lambda q, k, v, do: fn(q, k, v, do)
  loss = lambda q, k, v, do: jnp.sum(fn(q, k, v, do) * do)
  return jax.grad(loss, argnums=(0, 1, 2))


def print_table(rows, cfg):
  print(
    f"ring_attention on {cfg['devices']} host CPU devices vs chunked attention on one "
    f"(median of {cfg['repeats']}, seconds; compile apart)"
  )
  print(
    f"{'case':44} {'layout':10} {'pass':16} {'one':>7} {'ring':>7} {'ring/one':>8} "
    f"{'compile one/ring':>16} {'tiles max/min':>13} {'step MB':>7} {'step GFLOP':>10}"
  )
  for r in rows:
    print(
      f"{r['case']:44} {r['layout']:10} {r['passes']:16} {r['one_s']:7.3f} "
      f"{r['ring_s']:7.3f} {r['ratio']:8.2f} "
      f"{r['compile_one_s']:7.2f}/{r['compile_ring_s']:<8.2f} "
      f"{r['tiles_max']:>6}/{r['tiles_min']:<6} {r['step_bytes'] / 1e6:7.2f} "
      f"{r['step_flops'] / 1e9:10.3f}"
    )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG))
  p.add_argument("--devices", type=int, help="ring size P (host devices)")
  p.add_argument("--T", type=int, nargs="+", help="global sequence lengths")
  p.add_argument("--repeats", type=int)
  p.add_argument("--json", help="also write the rows to this JSON file")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  cfg = load_config(a.config, {"devices": a.devices, "T": a.T, "repeats": a.repeats})

  def report(rows):
    print(f"{cfg.get('name', 'ring')}: {cfg.get('description', '')}")
    print_table(rows, cfg)

  return host_devices.main(
    "ring_bench", argv, cfg, child=child, report=report, json_path=a.json, is_child=a.child
  )


if __name__ == "__main__":
  raise SystemExit(main())
