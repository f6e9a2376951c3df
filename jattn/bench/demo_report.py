"""The printing and plotting half of `jattn-demo` (`jattn.bench.demo`): each experiment's rows as
a text table and as a matplotlib figure (matplotlib imported only when a plot is asked for), and
the row types themselves, so that the report needs nothing from the experiments."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# --------------------------------------------------------------------------------------------
# The experiments' rows (what `jattn.bench.demo` measures, what this module prints).
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SharpnessRow:
  """Means over seeds for one head dim d, with or without the 1/sqrt(d) scale."""

  d: int
  scaled: bool
  logit_std: float  # std of the logits: sqrt(d) unscaled, 1 scaled
  max_prob: float
  min_prob: float
  entropy: float  # nats; log(S) is the uniform maximum
  entropy_fraction: float  # entropy / log(S), from jattn.diagnostics
  saturated_fraction: float  # share of rows with max prob > 0.99, from jattn.diagnostics
  jacobian_norm: float  # Frobenius norm of the softmax Jacobian


@dataclasses.dataclass(frozen=True)
class OverflowRow:
  dtype: str
  pattern: str
  magnitude: float
  method: str  # "naive" | "stable" | "jattn"
  status: str  # "ok" | "NaN" | "inf" | "zeros"
  max_error: float  # max |p - p_ref| over the row; nan unless status == "ok"


@dataclasses.dataclass(frozen=True)
class MaskedRowResult:
  method: str  # "naive -inf" | "jax.nn" | "jattn"
  masked_row: np.ndarray  # (H,) output of the query row that sees no key
  output_nan: bool  # any NaN in the output
  grad_nan: bool  # any NaN in d(sum of outputs)/d(q, k, v)
  other_rows_error: float  # max |out - ref| over the rows that do see keys
  mean_of_v_error: float  # max |masked_row - mean over keys of V|


@dataclasses.dataclass(frozen=True)
class PrecisionRow:
  T: int
  method: str  # see jattn.bench.demo.PRECISION_METHODS
  rel_error: float  # ||out - ref||_F / ||ref||_F
  max_error: float  # max |out - ref|


# --------------------------------------------------------------------------------------------
# Printing.
# --------------------------------------------------------------------------------------------


def _methods(rows) -> list[str]:
  """The precision experiment's methods in its own order (its rows list them so for every T)."""
  return list(dict.fromkeys(r.method for r in rows))


def _table(headers, rows) -> str:
  cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
  line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))
  return "\n".join(
    [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]
  )


def format_sharpness(rows: list[SharpnessRow], num_keys: int, seeds: int) -> str:
  head = (
    f"1. Softmax sharpness, 1 query x {num_keys} keys, q, k ~ N(0, 1), mean of {seeds} "
    f"draws (uniform: max = min = {1 / num_keys:.3f}, entropy = log S = "
    f"{math.log(num_keys):.3f})"
  )
  body = _table(
    ["d", "scale", "logit std", "max p", "min p", "entropy", "H/logS", "saturated", "|J|_F"],
    [
      [
        r.d,
        "1/sqrt(d)" if r.scaled else "none",
        f"{r.logit_std:.2f}",
        f"{r.max_prob:.3f}",
        f"{r.min_prob:.2e}",
        f"{r.entropy:.3f}",
        f"{r.entropy_fraction:.3f}",
        f"{r.saturated_fraction:.2f}",
        f"{r.jacobian_norm:.3f}",
      ]
      for r in rows
    ],
  )
  return head + "\n" + body


def format_overflow(rows: list[OverflowRow]) -> str:
  out = [
    "2. Naive exp(x)/sum(exp(x)) vs max-subtracted softmax vs jattn: max |p - p_ref| "
    "(float64 reference), or what went wrong"
  ]
  mags = sorted({r.magnitude for r in rows})
  for pattern in dict.fromkeys(r.pattern for r in rows):
    desc = {"spread": "logits in [-M, M]", "shifted": "logits in [-M-1, -M]"}[pattern]
    table = []
    for dtype in dict.fromkeys(r.dtype for r in rows):
      for method in ("naive", "stable", "jattn"):
        cells = {
          r.magnitude: r for r in rows if (r.pattern, r.dtype, r.method) == (pattern, dtype, method)
        }
        table.append(
          [dtype, method]
          + [
            (f"{cells[M].max_error:.1e}" if cells[M].status == "ok" else cells[M].status)
            if M in cells
            else ""
            for M in mags
          ]
        )
    out.append(f"  {desc}")
    out.append(_table(["dtype", "method"] + [f"M={M:g}" for M in mags], table))
  out.append(
    "  naive/stable compute the logits in the dtype (float16's max is 65504); jattn "
    "computes them in float32."
  )
  return "\n".join(out)


def format_masked(results: list[MaskedRowResult]) -> str:
  head = "3. A query row with every key masked (float32)"
  body = _table(
    ["method", "masked row output", "NaN out", "NaN grad", "other rows err", "= mean(V)?"],
    [
      [
        r.method,
        np.array2string(r.masked_row[:3], precision=3, separator=",")[:-1] + ",...]",
        r.output_nan,
        r.grad_nan,
        f"{r.other_rows_error:.1e}",
        "yes" if r.mean_of_v_error < 1e-5 else "no",
      ]
      for r in results
    ],
  )
  return head + "\n" + body


def format_precision(rows: list[PrecisionRow], heads: int, head_dim: int, block: int) -> str:
  head = (
    f"4. Relative error ||out - ref|| / ||ref|| against float64, self-attention, N={heads}, "
    f"H={head_dim}, chunked blocks {block}x{block}"
  )
  lengths = sorted({r.T for r in rows})
  table = []
  for method in _methods(rows):
    by_t = {r.T: r for r in rows if r.method == method}
    table.append([method] + [f"{by_t[T].rel_error:.2e}" for T in lengths])
  return head + "\n" + _table(["method"] + [f"T={T}" for T in lengths], table)


# --------------------------------------------------------------------------------------------
# Plots (matplotlib is imported only when asked for).
# --------------------------------------------------------------------------------------------


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def plot_sharpness(rows, path):
  plt = _pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
  for scaled, style in ((False, "o-"), (True, "s--")):
    rs = [r for r in rows if r.scaled == scaled]
    label = "scaled 1/sqrt(d)" if scaled else "unscaled"
    d = [r.d for r in rs]
    axes[0].plot(d, [r.max_prob for r in rs], style, label=label)
    axes[1].plot(d, [r.entropy for r in rs], style, label=label)
    axes[2].plot(d, [r.jacobian_norm for r in rs], style, label=label)
  for ax, title in zip(axes, ("max probability", "entropy (nats)", "softmax Jacobian |J|_F")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("head dim d")
    ax.set_title(title)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_overflow(rows, path):
  plt = _pyplot()
  dtypes = list(dict.fromkeys(r.dtype for r in rows))
  patterns = list(dict.fromkeys(r.pattern for r in rows))
  fig, axes = plt.subplots(
    len(patterns), len(dtypes), figsize=(4 * len(dtypes), 3.2 * len(patterns)), squeeze=False
  )
  for i, pattern in enumerate(patterns):
    for j, dtype in enumerate(dtypes):
      ax = axes[i][j]
      for method, style in (("naive", "o-"), ("stable", "s--"), ("jattn", "^:")):
        rs = [r for r in rows if (r.pattern, r.dtype, r.method) == (pattern, dtype, method)]
        ok = [r for r in rs if r.status == "ok"]
        bad = [r for r in rs if r.status != "ok"]
        (line,) = ax.plot(
          [r.magnitude for r in ok], [max(r.max_error, 1e-12) for r in ok], style, label=method
        )
        # Failures are drawn as crosses pinned at the top of the axis.
        ax.plot(
          [r.magnitude for r in bad], [10.0] * len(bad), "x", color=line.get_color(), markersize=9
        )
      ax.set_xscale("log")
      ax.set_yscale("log")
      ax.set_ylim(1e-12, 30)
      ax.set_title(f"{dtype}, {pattern} (x = NaN/inf/zeros)")
      ax.set_xlabel("logit magnitude M")
      ax.set_ylabel("max |p - p_ref|")
      ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_masked(results, path):
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 3.5))
  H = results[0].masked_row.shape[0]
  width = 0.8 / len(results)
  for i, r in enumerate(results):
    vals = np.nan_to_num(r.masked_row, nan=0.0)
    ax.bar(
      np.arange(H) + i * width, vals, width, label=r.method + (" (NaN)" if r.output_nan else "")
    )
  ax.set_xlabel("output feature of the fully masked query row")
  ax.set_title("fully masked row: NaN (naive), mean of V (jax.nn), 0 (jattn)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_precision(rows, path):
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for method in _methods(rows):
    rs = sorted((r for r in rows if r.method == method), key=lambda r: r.T)
    ax.plot([r.T for r in rs], [r.rel_error for r in rs], "o-", label=method)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length T")
  ax.set_ylabel("relative error vs float64")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
