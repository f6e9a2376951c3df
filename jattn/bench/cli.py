"""``jattn-bench``: the benchmark command line.

Runs the sweep of a config (configs/default.toml when none is given), prints one table block per
case as it finishes (progress on stderr), and writes JSON, CSV and Markdown results to ``--out``
and PNG plots to ``--plot``. See docs/benchmarks.md for how to read the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from typing import Any

from jattn.bench import config as _config
from jattn.bench import flops as _flops
from jattn.bench import report as _report
from jattn.bench import torch_peer as _torch_peer

_EPILOG = """\
examples:
  jattn-bench                                  # configs/default.toml, about 2 minutes on 2 cores
  jattn-bench quick --plot results/plots       # a tiny sweep, with figures
  jattn-bench configs/long_context.toml --max-memory 20
  jattn-bench --impl jattn-chunked,jax-nn --repeats 9
  jattn-bench long_context --compile-only      # compile time and XLA memory only, no runs
  jattn-bench quick --platform cuda            # the structure of the programs a GPU would run
  jattn-bench tune --T 1024 4096 --mask full causal --out tuning.json   # see jattn.tuning
  jattn-bench sharding --devices 4 --T 1024     # collectives and memory per device, sharded inputs
  jattn-bench decode --S 4096 16384             # one decoding step vs jax.nn and the memory floor

columns: compile_s (lower+compile, apart from run time); median_s and min..max_s over the timed
repeats; temp_MiB (XLA compiled temporaries); GFLOP/s (visible pairs only, see docs); %peak (of
the fp32/bf16 matmul peak measured at the start of the run); vs_<baseline> (baseline time /
this time: > 1 is faster); max|diff| (largest difference from the reference implementation's
output and gradients); steps (sequential loop steps of one call, read from the compiled HLO;
"run-time" when a trip count is computed when it runs); ops/step (HLO ops in the innermost loop
body, a fusion counting one); work (the matmul FLOPs the compiled program runs, loop trip counts
multiplied through, over the case's FLOPs: 1.00 computes nothing the mask hides; the two-pass
backward recomputes P once more, 1.29 at best forward+backward); status (ok, compiled, skipped,
unsupported, oom, error: with the reason).
"""


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="jattn-bench",
    description=(
      "Benchmark jattn's dense and chunked attention against jax.nn, flax (and PyTorch's "
      "SDPA when torch is importable): time, compile time, XLA memory, FLOP rate."
    ),
    epilog=_EPILOG,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument(
    "config_pos",
    nargs="?",
    metavar="CONFIG",
    help="config file, or a name in configs/ (default: default)",
  )
  p.add_argument("--config", help="the same as the positional CONFIG")
  p.add_argument("--quick", action="store_true", help="use configs/quick.toml (a tiny sweep)")
  p.add_argument(
    "--out",
    default="results",
    metavar="DIR",
    help="directory for the JSON, CSV and Markdown results (default: results)",
  )
  p.add_argument("--no-out", action="store_true", help="write no result files")
  p.add_argument("--plot", metavar="DIR", help="also write PNG plots (time and memory vs T) here")
  p.add_argument(
    "--max-memory",
    type=float,
    metavar="GIB",
    help="skip cases that would need more memory than this many GiB: dense "
    "implementations by their (B, N, T, S) score estimate before compiling, "
    "every JAX implementation by its compiled memory (default: the config's "
    "max_memory_gib, else 16)",
  )
  p.add_argument("--repeats", type=int, metavar="N", help="timed calls per case (overrides)")
  p.add_argument("--warmup", type=int, metavar="N", help="untimed calls first (overrides)")
  p.add_argument(
    "--impl",
    action="append",
    metavar="NAMES",
    help="only these implementations, comma-separated, repeatable: names "
    "(jattn-dense, jattn-chunked, jattn-serial, jattn-parallel, "
    "jattn-splash, jattn-cudnn, jax-nn, jax-nn-cudnn, flax, torch; "
    "'jattn-chunked' keeps every block size) or labels "
    "('jattn-chunked-256x256')",
  )
  p.add_argument(
    "--peak-size",
    type=int,
    metavar="N",
    help="n of the n^3 matmul that measures the FLOP peak (overrides the config)",
  )
  p.add_argument(
    "--compile-only",
    action="store_true",
    help="compile and report compile time and memory, run nothing",
  )
  p.add_argument(
    "--platform",
    choices=("cuda", "tpu"),
    help="lower every JAX implementation for this accelerator with jax.export and "
    "report its compiled structure (loop steps, ops per step) and memory as "
    "compiled here, without running (implies --compile-only)",
  )
  p.add_argument(
    "--dry-run",
    action="store_true",
    help="list the cases with their FLOPs and dense memory estimates, and stop",
  )
  p.add_argument("--quiet", action="store_true", help="no progress display on stderr")
  return p


def _select(cfg: _config.Config, args) -> tuple[list[_config.Case], list[str]]:
  """Apply the command line's overrides and filters; returns (cases, notes on what was dropped)."""
  import jax

  notes = []
  wanted = None
  if args.impl:
    wanted = [w.strip() for a in args.impl for w in a.split(",") if w.strip()]
  backend = jax.default_backend()
  torch_ok = _torch_peer.available()
  dropped = set()
  cases = []
  for case in cfg.cases:
    keep = []
    for impl in case.impls:
      if wanted is not None and impl.label not in wanted and impl.name not in wanted:
        continue
      if impl.name in ("jax-nn-cudnn", "jattn-cudnn") and backend != "gpu":
        # Also with --platform cuda: jax.nn checks for cuDNN on this machine when it traces.
        dropped.add(f"{impl.name} needs a GPU backend (this run's backend: {backend})")
        continue
      if impl.name == "jattn-splash" and backend != "tpu":
        # With --platform tpu too: its kernels are TPU custom calls, and the exported program
        # is read by compiling it here.
        dropped.add(f"jattn-splash needs a TPU backend (this run's backend: {backend})")
        continue
      if impl.name == "torch" and args.platform:
        dropped.add(f"torch cannot be lowered for {args.platform} with jax.export: left out")
        continue
      if impl.name == "torch" and not torch_ok:
        dropped.add("torch is not importable: the PyTorch SDPA peer is left out")
        continue
      keep.append(impl)
    if not keep:
      continue
    changes: dict[str, Any] = {"impls": tuple(keep)}  # keyword overrides of dataclasses.replace
    if args.repeats is not None:
      changes["repeats"] = args.repeats
    if args.warmup is not None:
      changes["warmup"] = args.warmup
    cases.append(dataclasses.replace(case, **changes))
  if wanted is not None:
    known = {x for c in cfg.cases for i in c.impls for x in (i.name, i.label)}
    for w in wanted:
      if w not in known:
        dropped.add(f"--impl {w!r} matches no implementation of this config")
  notes.extend(sorted(dropped))
  return cases, notes


def _groups(cases, compares) -> list[list[tuple[int, _config.Case]]]:
  """Cases that differ only in the fields of a ``[[compare]]``, as (index, case) groups.

  Each group is timed in shared rounds, so the compared ratio is not skewed by load changing
  between cases; without a compare every case is its own group.
  """
  fields = {c.field for c in compares} - {"impl"}
  groups: dict[tuple, list[tuple[int, _config.Case]]] = {}
  for i, case in enumerate(cases):
    key = tuple(v for f, v in case.fields().items() if f not in fields)
    groups.setdefault(key, []).append((i, case))
  return list(groups.values())


def _is_ring_config(path) -> bool:
  """configs/ring.toml has the ring benchmark's schema (a device count), not a sweep's."""
  try:
    import tomllib
  except ModuleNotFoundError:  # Python 3.10
    return False
  try:
    with open(path, "rb") as f:
      return "devices" in tomllib.load(f)
  except (OSError, tomllib.TOMLDecodeError):
    return False


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["tune"]:
    from jattn.bench import tune as _tune

    return _tune.main(argv[1:])
  if argv[:1] == ["decode"]:
    from jattn.bench import decode_bench

    return decode_bench.main(argv[1:])
  if argv[:1] == ["sharding"]:
    # Needs several host devices, set up before JAX starts: its own runner.
    from jattn.bench import sharding_bench

    return sharding_bench.main(argv[1:])
  args = build_parser().parse_args(argv)
  if args.config and args.config_pos:
    print("jattn-bench: give the config once (positional or --config)", file=sys.stderr)
    return 2
  if args.quick and (args.config or args.config_pos):
    print("jattn-bench: --quick selects configs/quick.toml; give no other config", file=sys.stderr)
    return 2
  for name in ("repeats", "peak_size"):
    v = getattr(args, name)
    if v is not None and v < 1:
      print(f"jattn-bench: --{name.replace('_', '-')} must be >= 1, got {v}", file=sys.stderr)
      return 2
  if args.warmup is not None and args.warmup < 0:
    print(f"jattn-bench: --warmup must be >= 0, got {args.warmup}", file=sys.stderr)
    return 2
  if args.max_memory is not None and args.max_memory <= 0:
    print(f"jattn-bench: --max-memory must be > 0 GiB, got {args.max_memory}", file=sys.stderr)
    return 2
  try:
    path = _config.resolve_path("quick" if args.quick else (args.config or args.config_pos))
    if _is_ring_config(path):
      # Ring attention needs several (host) devices, set up before JAX starts: its own runner.
      from jattn.bench import ring_bench

      return ring_bench.main([str(path)])
    cfg = _config.load(path)
  except _config.ConfigError as e:
    print(f"jattn-bench: {e}", file=sys.stderr)
    return 2

  cases, notes = _select(cfg, args)
  if not cases:
    print("jattn-bench: no case left after the filters", file=sys.stderr)
    return 2
  max_memory_gib = args.max_memory if args.max_memory is not None else cfg.max_memory_gib

  if args.dry_run:
    for i, c in enumerate(cases):
      print(
        f"[{i + 1}/{len(cases)}] {c.name}: {c.flops / 1e9:.4g} GFLOP, dense estimate "
        f"{c.dense_memory_estimate / 2**30:.3g} GiB, "
        f"{', '.join(x.label for x in c.impls)}"
      )
    for n in notes:
      print(f"note: {n}")
    return 0
  return _run(cfg, cases, notes, args, argv, max_memory_gib)


def _run(cfg, cases, notes, args, argv, max_memory_gib) -> int:
  from jattn.bench import runner as _runner  # the implementations: after argument errors

  progress = _report.Progress(len(cases), enabled=not args.quiet)
  machine = _report.machine_info()
  peak_n = args.peak_size or cfg.peak_matmul_size
  dtypes = sorted({c.dtype for c in cases})
  peak_start = {}
  for d in dtypes:
    if not args.quiet:
      print(f"measuring the {d} matmul peak ({peak_n}^3) ...", file=sys.stderr, flush=True)
    peak_start[d] = _runner.measure_matmul_peak(d, peak_n)

  threads = machine["cpu_affinity"] or machine["cpu_count"] or 1
  peer = (
    _torch_peer.TorchPeer(threads)
    if any(i.name == "torch" for c in cases for i in c.impls)
    else None
  )
  ctx = _runner.Context(
    max_memory_bytes=int(max_memory_gib * 2**30),
    baseline=cfg.baseline,
    seed=cfg.seed,
    backend=machine["backend"],
    peak_flops={d: p["flops_per_s"] for d, p in peak_start.items()},
    compile_only=args.compile_only or args.platform is not None,
    platform=args.platform,
    torch_peer=peer,
    progress=progress.detail,
  )

  impl_labels = list(dict.fromkeys(i.label for c in cases for i in c.impls))
  peaks = ", ".join(f"{d} {p['flops_per_s'] / 1e9:.1f}" for d, p in peak_start.items())
  print(
    f"jattn-bench: config {cfg.name!r} ({len(cases)} cases; {', '.join(impl_labels)}) on "
    f"{machine['backend']} ({', '.join(sorted(set(machine['devices'])))}, "
    f"{machine['cpu_affinity']} cores); matmul peak GFLOP/s: {peaks}"
  )
  for n in notes:
    print(f"note: {n}")
  sys.stdout.flush()

  rows = []
  interrupted = False
  try:
    for group in _groups(cases, cfg.compare):
      case = group[0][1]
      name = case.name if len(group) == 1 else f"{case.name} and {len(group) - 1} more, together"
      progress.case(name, count=len(group))
      results = _runner.run_group([c for _, c in group], [i for i, _ in group], ctx)
      progress.clear()
      for case_rows in results:
        rows.extend(case_rows)
        print("\n" + _report.format_case(case_rows, cfg.baseline), flush=True)
  except KeyboardInterrupt:
    interrupted = True
    progress.clear()
    print("\ninterrupted: writing the cases finished so far", file=sys.stderr)
  finally:
    if peer is not None:
      if peer.info:
        machine["torch"] = {k: peer.info.get(k) for k in ("torch", "threads", "cuda")}
      peer.close()

  peak_end = {}
  if not interrupted:
    for d in dtypes:
      peak_end[d] = _runner.measure_matmul_peak(d, peak_n)
      drift = peak_end[d]["flops_per_s"] / peak_start[d]["flops_per_s"]
      if abs(drift - 1) > 0.15:
        notes.append(
          f"the {d} matmul peak moved {100 * (drift - 1):+.0f}% between the start and "
          f"the end of the run: the machine's load changed; compare within one run "
          f"and treat differences under ~15% as noise"
        )
        print(f"note: {notes[-1]}")
  machine["load_average_end"] = _report._loadavg()

  rows.sort(key=lambda r: r["case_index"])  # stable: each case keeps its implementation order
  comps = _report.comparisons(rows, cfg.compare)
  if comps:
    print("\ncomparisons (median time ratios):\n" + _report.format_comparisons(comps))
  result = {
    "schema_version": 1,
    "tool": "jattn-bench",
    "argv": argv,
    "config": {"name": cfg.name, "path": cfg.path, "description": cfg.description, "raw": cfg.raw},
    "machine": machine,
    "max_memory_gib": max_memory_gib,
    "baseline": cfg.baseline,
    "peak": {
      d: {
        "n": peak_n,
        "flops_per_s": peak_start[d]["flops_per_s"],
        "times_s": peak_start[d]["times_s"],
        "flops_per_s_end": peak_end[d]["flops_per_s"] if d in peak_end else None,
      }
      for d in dtypes
    },
    "flop_convention": _flops.__doc__.strip(),
    "notes": notes,
    "interrupted": interrupted,
    "compile_only": args.compile_only or args.platform is not None,
    "platform": args.platform,
    "rows": rows,
    "comparisons": comps,
  }
  stem = f"{cfg.name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
  if not args.no_out:
    paths = _report.write_results(args.out, stem, result)
    print("\nresults: " + ", ".join(str(p) for p in paths.values()))
  if args.plot:
    from jattn.bench import plots as _plots

    written = _plots.write_plots(rows, args.plot, stem)
    print(f"plots: {len(written)} PNG in {args.plot}")
  return 130 if interrupted else 0


if __name__ == "__main__":
  sys.exit(main())
