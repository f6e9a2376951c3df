"""What a run reports: the terminal table, progress, machine info, comparisons, JSON / CSV /
Markdown."""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from jattn.bench.runner import ROW_FIELDS

# Environment variables that change what is measured: allocator, threads, XLA and JAX settings.
_ENV_PREFIXES = ("XLA_", "JAX_", "TF_CPP_", "OMP_", "MKL_", "OPENBLAS_", "CUDA_", "NVIDIA_TF32")
_ENV_NAMES = ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "LD_PRELOAD")


def machine_info() -> dict[str, Any]:
  """The machine, software and settings a result was measured under."""
  import jax
  import jaxlib
  import numpy as np

  info = {
    "timestamp_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "python": sys.version.split()[0],
    "platform": platform.platform(),
    "processor": platform.processor() or platform.machine(),
    "cpu_count": os.cpu_count(),
    "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    "cpu_model": _cpu_model(),
    "memory_gib": _memory_gib(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "numpy": np.__version__,
    "backend": jax.default_backend(),
    "devices": [str(d.device_kind) for d in jax.devices()],
    "device_count": jax.device_count(),
    # jax.config's options are attributes set at run time, declared in the type stubs of some
    # jax releases only (0.12 has it, 0.10 not).
    "matmul_precision": str(jax.config.jax_default_matmul_precision),  # type: ignore[attr-defined, unused-ignore]
    "env": {
      k: v for k, v in sorted(os.environ.items()) if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)
    },
    "load_average_start": _loadavg(),
    "jattn_git_commit": _git_commit(),
  }
  try:
    import flax

    info["flax"] = flax.__version__
  except ImportError:
    info["flax"] = None
  return info


def _cpu_model():
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return None


def _memory_gib():
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
  except (ValueError, OSError, AttributeError):
    return None


def _loadavg():
  try:
    return list(os.getloadavg())
  except OSError:
    return None


def _git_commit():
  try:
    out = subprocess.run(
      ["git", "rev-parse", "HEAD"],
      capture_output=True,
      text=True,
      timeout=5,
      cwd=Path(__file__).resolve().parent,
    )
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None


class Progress:
  """Progress on stderr: one line per case, overwritten in place with details on a terminal."""

  def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True):
    self.total = total
    self.stream = stream or sys.stderr
    self.enabled = enabled
    self.tty = self.stream.isatty()
    self.start = time.perf_counter()
    self.prefix = ""
    self.done = 0

  def case(self, name: str, count: int = 1):
    """Announce the next ``count`` cases (run together)."""
    elapsed = time.perf_counter() - self.start
    which = f"{self.done + 1}" if count == 1 else f"{self.done + 1}-{self.done + count}"
    self.done += count
    self.prefix = f"[{which}/{self.total} {elapsed:6.1f}s] {name}"
    if not self.enabled:
      return
    if self.tty:
      self._overwrite(self.prefix)
    else:
      print(self.prefix, file=self.stream, flush=True)

  def detail(self, text: str):
    if self.enabled and self.tty:
      self._overwrite(f"{self.prefix}: {text}")

  def clear(self):
    if self.enabled and self.tty:
      self.stream.write("\r\x1b[K")
      self.stream.flush()

  def _overwrite(self, text):
    width = 160
    self.stream.write("\r\x1b[K" + text[:width])
    self.stream.flush()


# ---------------------------------------------------------------------------------------- table

_COLUMNS = (
  "impl",
  "compile_s",
  "median_s",
  "min..max_s",
  "temp_MiB",
  "GFLOP/s",
  "%peak",
  "vs_base",
  "max|diff|",
  "steps",
  "ops/step",
  "work",
  "status",
)


def _fmt(x, spec=".3g"):
  return "-" if x is None else format(x, spec)


def _cells(row: dict) -> list[str]:
  ok = row["status"] == "ok"
  spread = f"{row['time_min_s']:.3g}..{row['time_max_s']:.3g}" if ok else "-"
  status = (
    row["status"] if row["status"] in ("ok", "compiled") else (f"{row['status']}: {row['reason']}")
  )
  if len(status) > 90:
    status = status[:87] + "..."
  return [
    row["impl"],
    _fmt(row["compile_s"]),
    _fmt(row["time_median_s"]),
    spread,
    _fmt(None if row["temp_bytes"] is None else row["temp_bytes"] / 2**20, ".4g"),
    _fmt(None if row["flops_per_s"] is None else row["flops_per_s"] / 1e9, ".3g"),
    _fmt(None if row["peak_fraction"] is None else 100 * row["peak_fraction"], ".0f"),
    "-" if row["speedup_vs_baseline"] is None else f"{row['speedup_vs_baseline']:.2f}x",
    _fmt(row["max_abs_diff"], ".1e"),
    _steps(row),
    _fmt(row["ops_per_step"] if row["loops"] else None, "d"),
    _fmt(row["work_vs_ideal"], ".2f"),
    status,
  ]


def _steps(row: dict) -> str:
  """Sequential loop steps of one call: '-' not read (torch), 'run-time' when a loop's trip
  count is only known when it runs."""
  if row["loops"] is None:
    return "-"
  return "run-time" if row["loop_steps"] is None else str(row["loop_steps"])


def case_header(row: dict) -> str:
  gflop = row["flops"] / 1e9
  return (
    f"{row['pass']} {row['dtype']} {row['mask']}  B={row['B']} N={row['N']} K={row['K']} "
    f"H={row['H']} T={row['T']} S={row['S']}  ({gflop:.4g} GFLOP per call)"
  )


def format_case(rows: list[dict], baseline: str) -> str:
  """One case's block of the terminal table."""
  header = list(_COLUMNS)
  header[_COLUMNS.index("vs_base")] = f"vs_{baseline}"
  body = [_cells(r) for r in rows]
  widths = [max(len(header[i]), *(len(b[i]) for b in body)) for i in range(len(header) - 1)]
  lines = [case_header(rows[0])]
  for cells in [header, *body]:
    parts = [cells[0].ljust(widths[0])]
    parts += [c.rjust(w) for c, w in zip(cells[1:-1], widths[1:])]
    parts.append(cells[-1])
    lines.append("  " + "  ".join(parts))
  return "\n".join(lines)


def format_markdown(rows: list[dict], baseline: str) -> str:
  """All rows as one Markdown table (for READMEs)."""
  cols = ["pass", "mask", "dtype", "B", "N", "K", "H", "T", "S", *_COLUMNS]
  cols[cols.index("vs_base")] = f"vs {baseline}"
  cols[cols.index("max|diff|")] = "max abs diff"
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for r in rows:
    cells = [str(r[c]) for c in ("pass", "mask", "dtype", "B", "N", "K", "H", "T", "S")]
    cells += [c.replace("|", "/") for c in _cells(r)]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- comparisons

_IDENTITY = ("pass", "dtype", "mask", "B", "N", "K", "H", "T", "S", "impl")


def comparisons(rows: list[dict], compares) -> list[dict]:
  """Time ratios between ok rows that differ only in one field: time(a) / time(b)."""
  out = []
  for cmp in compares:
    a_val, b_val = cmp.values
    others = [f for f in _IDENTITY if f != cmp.field]
    # identity of the other fields -> {compared value: row}
    by_key: dict[tuple, dict[Any, dict]] = {}
    for r in rows:
      if r["status"] == "ok" and r[cmp.field] in (a_val, b_val):
        by_key.setdefault(tuple(r[f] for f in others), {})[r[cmp.field]] = r
    for key, pair in by_key.items():
      if a_val in pair and b_val in pair:
        out.append(
          {
            "field": cmp.field,
            "a": a_val,
            "b": b_val,
            **dict(zip(others, key)),
            "time_a_s": pair[a_val]["time_median_s"],
            "time_b_s": pair[b_val]["time_median_s"],
            "time_ratio": pair[a_val]["time_median_s"] / pair[b_val]["time_median_s"],
          }
        )
  return out


def format_comparisons(items: list[dict]) -> str:
  lines = []
  for c in items:
    what = " ".join(f"{f}={c[f]}" for f in _IDENTITY if f in c and f != c["field"])
    lines.append(
      f"  {c['field']} {c['a']!s} vs {c['b']!s}: {c['time_ratio']:.3f}x the time "
      f"({c['time_a_s']:.3g} s / {c['time_b_s']:.3g} s)  [{what}]"
    )
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------- files


def write_results(out_dir: str | os.PathLike, stem: str, result: dict) -> dict[str, Path]:
  """Write ``stem``.json, .csv and .md into ``out_dir``; returns the paths."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  paths = {"json": out / f"{stem}.json", "csv": out / f"{stem}.csv", "md": out / f"{stem}.md"}
  with open(paths["json"], "w") as f:
    json.dump(result, f, indent=1, default=_json_default)
    f.write("\n")
  with open(paths["csv"], "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=ROW_FIELDS)
    writer.writeheader()
    for r in result["rows"]:
      writer.writerow(
        {
          k: (";".join(f"{t:.6g}" for t in r[k]) if k == "times_s" and r[k] else r[k])
          for k in ROW_FIELDS
        }
      )
  with open(paths["md"], "w") as f:
    f.write(f"<!-- jattn-bench {' '.join(result['argv'])} -->\n")
    f.write(format_markdown(result["rows"], result["baseline"]))
  return paths


def _json_default(x):
  if hasattr(x, "item"):
    return x.item()
  raise TypeError(f"not JSON serialisable: {type(x).__name__}")
