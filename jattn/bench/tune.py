"""``jattn-bench tune``: time the chunked kernels' options on this device, write a tuning table.

For each length and mask, every candidate (block sizes x schedule x step width) is compiled and
timed, interleaved round by round (A B C A B C ...), on forward+backward by default; the fastest
median becomes the table's entry for (this device kind, dtype, head dim, mask kind, length
bucket). The device's fused kernel (``--fused``: cuDNN on a GPU for 16-bit inputs, splash on a
TPU, at each block sizes an entry would give it) is timed in the same rounds; where it beats
the fastest chunked candidate the entry also says ``"implementation": name``, and
``implementation=None`` then tries it first on that platform (the chunked options stay in the
entry for the calls it cannot take). Use the table with ``with jattn.tuning(path):`` or
``JATTN_TUNING=path``.

  jattn-bench tune --T 1024 4096 --mask full causal --dtype bfloat16 --out tuning.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # jax (which jattn imports) is imported only when tuning runs
  from jattn._types import Implementation


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="jattn-bench tune", description=__doc__.split("\n")[0])
  p.add_argument("--T", type=int, nargs="+", required=True, help="query lengths (S = T)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, help="K (default: heads)")
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
  p.add_argument(
    "--mask",
    nargs="+",
    default=["full"],
    help="mask specs as in the configs: full, causal, window:W, causal+window:W",
  )
  p.add_argument(
    "--blocks",
    nargs="+",
    default=["512x256", "512x512", "256x256", "1024x256"],
    help="block sizes to try, BQxBK",
  )
  p.add_argument(
    "--schedules", nargs="+", default=["serial", "parallel"], choices=("serial", "parallel")
  )
  p.add_argument(
    "--widths",
    type=int,
    nargs="+",
    default=[64],
    help="step widths to try with the parallel schedule",
  )
  p.add_argument(
    "--pass", dest="pass_", default="forward+backward", choices=("forward", "forward+backward")
  )
  p.add_argument(
    "--fused",
    default="auto",
    choices=("auto", "none", "cudnn", "splash"),
    help="the fused kernel to time against jattn's: auto = cuDNN on a GPU for "
    "bfloat16/float16, splash on a TPU, none elsewhere",
  )
  p.add_argument("--repeats", type=int, default=3, help="timed rounds")
  p.add_argument("--out", required=True, help="the JSON table to write")
  p.add_argument(
    "--update", action="store_true", help="add to the table in --out instead of replacing it"
  )
  return p


def _blocks(text):
  try:
    bq, bk = (int(x) for x in text.lower().split("x"))
  except ValueError:
    raise SystemExit(f"jattn-bench tune: --blocks entries are BQxBK, got {text!r}") from None
  if bq <= 0 or bk <= 0:
    raise SystemExit(f"jattn-bench tune: block sizes must be positive, got {text!r}")
  return bq, bk


def candidates(blocks, schedules, widths):
  """Every option dict to time: block sizes x schedule (x step width for parallel)."""
  out = []
  for (bq, bk), schedule in itertools.product(blocks, schedules):
    for width in widths if schedule == "parallel" else [None]:
      out.append(dict(block_q=bq, block_kv=bk, schedule=schedule, step_width=width))
  return out


def fused_kernel(choice: str, backend: str, dtype) -> Implementation | None:
  """The fused implementation ``--fused`` asks to time on ``backend`` for ``dtype``."""
  if choice != "auto":
    # argparse's choices for --fused are "auto", "none" and implementation names.
    return None if choice == "none" else cast("Implementation", choice)
  if backend == "gpu" and str(dtype) in ("bfloat16", "float16"):
    return "cudnn"
  return "splash" if backend == "tpu" else None


def fused_blocks(name: str, block_q: int, block_kv: int):
  """The block sizes the fused kernel ``name`` runs with under a table entry of these sizes
  (None: its own default): splash takes a table's multiples of 128 (see
  `jattn._tuning.splash_block`); cuDNN has none."""
  if name == "splash":
    from jattn import _tuning

    return _tuning.splash_block(None, block_q), _tuning.splash_block(None, block_kv)
  return None, None


def entry(chunked, fused=None) -> dict:
  """The table entry from (median seconds, options) of the chunked candidates and, if timed,
  {(block_q, block_kv): (median seconds, name)} of the fused kernel at each block sizes it
  runs with: the fastest chunked options, and the fused kernel's name where it was faster
  still at the block sizes it takes from that entry."""
  best_time, best = min(chunked, key=lambda r: r[0])
  out = dict(best)
  if fused:
    name = next(iter(fused.values()))[1]
    timed = fused.get(fused_blocks(name, best["block_q"], best["block_kv"]))
    if timed is not None:
      # Measured wins over reasoned: implementation=None tries the fused kernel first on its
      # platform unless the table says jattn's kernels were faster.
      out["implementation"] = name if timed[0] < best_time else "chunked"
  return out


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  import jax
  import jax.numpy as jnp

  import jattn
  from jattn import _tuning
  from jattn.bench import masks as _masks
  from jattn.bench import runner as _runner

  blocks = [_blocks(b) for b in args.blocks]
  specs = [_masks.parse(m) for m in args.mask]
  device_kind = jax.devices()[0].device_kind
  table = (
    _tuning.load(args.out) if args.update and os.path.exists(args.out) else _tuning.TuningTable()
  )
  dtype = jnp.dtype(args.dtype)
  fused = fused_kernel(args.fused, jax.default_backend(), dtype)
  K = args.kv_heads or args.heads
  print(
    f"jattn-bench tune on {device_kind!r} ({jax.default_backend()}), {args.dtype}, "
    f"B={args.batch} N={args.heads} K={K} H={args.head_dim}, {args.pass_}"
    + (f", against {fused}" if fused else "")
  )
  for T, spec in itertools.product(args.T, specs):
    if spec.segments is not None:
      raise SystemExit("jattn-bench tune: segment masks are not tuned (mask kind 'masked')")
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (args.batch, T, args.heads, args.head_dim)).astype(dtype)
    k = jax.random.normal(keys[1], (args.batch, T, K, args.head_dim)).astype(dtype)
    v = jax.random.normal(keys[2], (args.batch, T, K, args.head_dim)).astype(dtype)
    kw: dict[str, Any] = dict(is_causal=spec.causal or False, local_window_size=spec.window)
    # (options dict, or (fused name, its blocks); compiled function; timings)
    compiled: list[
      tuple[
        dict[str, Any] | tuple[Implementation, tuple[int | None, int | None]],
        Callable[..., Any],
        list[float],
      ]
    ] = []
    for opts in candidates(blocks, args.schedules, args.widths):
      if opts["block_q"] > T or opts["block_kv"] > T:
        continue
      g = lambda q, k, v, o=opts: jattn.dot_product_attention(
        q, k, v, implementation="chunked", **kw, **o
      )
      compiled.append((opts, _compile(g, args.pass_, q, k, v), []))
    if not compiled:
      continue
    if fused is not None:
      # The fused kernel at each block sizes an entry of these candidates would give it (all
      # of them chunked so far: the isinstance only tells the type checker).
      for blocks in dict.fromkeys(
        fused_blocks(fused, o["block_q"], o["block_kv"])
        for o, _, _ in compiled
        if isinstance(o, dict)
      ):
        f = lambda q, k, v, b=blocks: jattn.dot_product_attention(
          q, k, v, implementation=fused, block_q=b[0], block_kv=b[1], **kw
        )
        try:
          compiled.append(((fused, blocks), _compile(f, args.pass_, q, k, v), []))
        except NotImplementedError as e:  # the kernel cannot take this call: not a candidate
          print(f"T={T} {spec.name}: {fused} not timed: {e}")
    for _ in range(args.repeats):  # interleaved rounds: a slow spell hits every candidate
      for _, fn, times in compiled:
        _runner.settle()
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        times.append(time.perf_counter() - start)
    results = sorted(((statistics.median(t), o) for o, _, t in compiled), key=lambda r: r[0])
    best = entry(
      [r for r in results if isinstance(r[1], dict)],
      {o[1]: (t, o[0]) for t, o in results if isinstance(o, tuple)},
    )
    kind = _tuning.mask_kind(spec.causal, spec.window, False)
    table.add(device_kind, str(dtype), args.head_dim, kind, _tuning.length_bucket(T, T), **best)
    label = lambda o: (
      f"{o[0]}" + ("" if o[1] == (None, None) else f" {o[1][0]}x{o[1][1]}")
      if isinstance(o, tuple)
      else f"{o['block_q']}x{o['block_kv']} {o['schedule']}"
      f"{'' if o['step_width'] is None else '/' + str(o['step_width'])}"
    )
    print(
      f"T={T} {spec.name}: entry {best}; " + ", ".join(f"{label(o)} {t:.3g} s" for t, o in results)
    )
  table.save(args.out)
  print(f"wrote {args.out} ({len(table.entries)} entries)")
  return 0


def _compile(f, pass_, q, k, v):
  """``f`` (or its forward+backward) compiled for these inputs and run once (warm-up)."""
  import jax
  import jax.numpy as jnp

  if pass_ == "forward+backward":
    f = jax.grad(lambda q, k, v, f=f: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  fn = jax.jit(f).lower(q, k, v).compile()
  jax.block_until_ready(fn(q, k, v))
  return fn


if __name__ == "__main__":
  sys.exit(main())
