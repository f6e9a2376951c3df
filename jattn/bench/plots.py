"""PNG figures: run time and compiled memory against T, log-log, one line per implementation.

One figure per group of cases that differ only in T (and S when S = T): pass, dtype, mask, B, N,
K, H. matplotlib is imported only here, with the Agg backend, when ``--plot`` is given.
"""

from __future__ import annotations

import re
from pathlib import Path

_GROUP = ("pass", "dtype", "mask", "B", "N", "K", "H")
_MARKERS = ("o", "s", "^", "D", "v", "P")
_DASHES = ("-", "--", "-.", ":")


def _group_key(row):
  s = "S=T" if row["S"] == row["T"] else f"S={row['S']}"
  return tuple(row[f] for f in _GROUP) + (s,)


def write_plots(rows: list[dict], out_dir, stem: str) -> list[Path]:
  """Write one PNG per group into ``out_dir``; returns the paths."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    groups.setdefault(_group_key(r), []).append(r)
  paths = []
  for key, group in groups.items():
    lines: dict[str, list[dict]] = {}
    for r in group:
      lines.setdefault(r["impl"], []).append(r)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    plotted = False
    for k, (impl, rs) in enumerate(lines.items()):
      # Distinct markers and dashes, so lines that coincide (dense implementations often share
      # their memory exactly) stay visible.
      style = dict(
        marker=_MARKERS[k % len(_MARKERS)],
        linestyle=_DASHES[k % len(_DASHES)],
        markersize=7 - k % 3,
        label=impl,
      )
      rs = sorted(rs, key=lambda r: r["T"])
      timed = [r for r in rs if r["status"] == "ok"]
      if timed:
        ts = [r["T"] for r in timed]
        (line,) = ax_t.plot(ts, [r["time_median_s"] for r in timed], **style)
        # The spread (min..max over repeats) as a band.
        ax_t.fill_between(
          ts,
          [r["time_min_s"] for r in timed],
          [r["time_max_s"] for r in timed],
          alpha=0.2,
          color=line.get_color(),
        )
        plotted = True
      mem = [r for r in rs if r["temp_bytes"]]
      if mem:
        ax_m.plot([r["T"] for r in mem], [r["temp_bytes"] / 2**20 for r in mem], **style)
        plotted = True
    if not plotted:
      plt.close(fig)
      continue
    for ax, ylabel in (
      (ax_t, "time per call (s), median; band: min..max"),
      (ax_m, "XLA compiled temp memory (MiB)"),
    ):
      ax.set_xscale("log", base=2)
      ticks = sorted({r["T"] for r in group})
      ax.set_xticks(ticks, [str(t) for t in ticks])
      ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
      ax.set_yscale("log")
      ax.set_xlabel("T (query length)")
      ax.set_ylabel(ylabel)
      ax.grid(True, which="both", alpha=0.3)
      if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    pass_, dtype, mask, B, N, K, H, s = key
    fig.suptitle(f"{pass_}  {dtype}  mask={mask}  B={B} N={N} K={K} H={H} {s}", fontsize=10)
    fig.tight_layout()
    name = re.sub(
      r"[^A-Za-z0-9._=-]+", "_", f"{pass_}-{dtype}-{mask}-B{B}-N{N}-K{K}-H{H}-{s}".replace("+", "_")
    )
    path = out / f"{stem}-{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths
