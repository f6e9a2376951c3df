"""`jattn-demo` / `python -m jattn.bench.demo`: the numerical-stability experiments of the article.

1. sharpness  Scaled vs unscaled softmax over head dims d: q, k ~ N(0, 1) make Var(q.k) = d, so
              without the 1/sqrt(d) scale the softmax saturates and its gradient vanishes.
2. overflow   Naive exp(x) / sum(exp(x)) vs the max-subtracted softmax vs jattn in float16,
              bfloat16 and float32 as the logits grow: where the naive one returns NaN.
3. masked     A query row with every key masked: NaN from the -inf-masked softmax, the mean of V
              from jax.nn, 0 from jattn.
4. precision  Attention error against a float64 reference as T grows: jattn dense and chunked in
              float32 and bfloat16, a plain all-bfloat16 attention, and the bfloat16 rounding
              floor.

Each experiment is a function returning plain data (dataclasses of floats and NumPy arrays);
printing and plotting are separate, so the tests check the claims on the same numbers.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn import _validation, diagnostics
from jattn.bench import demo_report as report
from jattn.bench.demo_report import MaskedRowResult, OverflowRow, PrecisionRow, SharpnessRow

EXPERIMENTS = ("sharpness", "overflow", "masked", "precision")
DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}


def _softmax64(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def softmax_jacobian_norm(p):
  """Frobenius norm of the softmax Jacobian diag(p) - p p^T, for probabilities p (..., S).

  ||J||_F^2 = sum p^2 - 2 sum p^3 + (sum p^2)^2: it goes to 0 as p becomes one-hot, which is how a
  saturated softmax stops passing gradient to its logits.
  """
  p = np.asarray(p, np.float64)
  p2 = (p * p).sum(-1)
  return np.sqrt(np.maximum(p2 - 2.0 * (p**3).sum(-1) + p2 * p2, 0.0))


# --------------------------------------------------------------------------------------------
# 1. Sharpness: the 1/sqrt(d) scale.
# --------------------------------------------------------------------------------------------


def sharpness(
  dims: Sequence[int] = (32, 64, 128, 512), num_keys: int = 8, seeds: int = 256, seed: int = 0
) -> list[SharpnessRow]:
  """One query against ``num_keys`` keys, entries N(0, 1), ``seeds`` independent draws per d.

  Probabilities, entropy and the Jacobian norm are computed in float64 NumPy; the entropy fraction
  and saturation come from `jattn.diagnostics.attention_stats` on the same float32 q and k.
  """
  dims = _int_list("dims", dims)
  num_keys = _validation.positive_int("num_keys", num_keys)
  seeds = _validation.positive_int("seeds", seeds)
  seed = _validation.non_negative_int("seed", seed)
  rows = []
  rng = np.random.default_rng(seed)
  for d in dims:
    q = rng.standard_normal((seeds, 1, 1, d)).astype(np.float32)  # (B, T=1, N=1, H=d)
    k = rng.standard_normal((seeds, num_keys, 1, d)).astype(np.float32)  # (B, S, K=1, H)
    raw = np.einsum("bh,bsh->bs", q[:, 0, 0].astype(np.float64), k[:, :, 0].astype(np.float64))
    for scaled in (False, True):
      scale = 1.0 / math.sqrt(d) if scaled else 1.0
      logits = raw * scale
      p = _softmax64(logits)
      # The scale folded into q keeps one compiled program per d for both rows.
      stats = diagnostics.attention_stats(
        jnp.asarray(q * np.float32(scale)), jnp.asarray(k), scale=1.0
      )
      rows.append(
        SharpnessRow(
          d=int(d),
          scaled=scaled,
          logit_std=float(logits.std()),
          max_prob=float(p.max(-1).mean()),
          min_prob=float(p.min(-1).mean()),
          entropy=float((-(p * np.log(np.maximum(p, 1e-300))).sum(-1)).mean()),
          entropy_fraction=float(np.mean(stats.entropy_fraction)),
          saturated_fraction=float(np.mean(stats.saturated_fraction)),
          jacobian_norm=float(softmax_jacobian_norm(p).mean()),
        )
      )
  return rows


# --------------------------------------------------------------------------------------------
# 2. Overflow: the max trick.
# --------------------------------------------------------------------------------------------

PATTERNS = {
  # logits spread over [-M, M]: exp(M) overflows the naive softmax.
  "spread": lambda M, S: M * np.linspace(-1.0, 1.0, S),
  # logits in [-M - 1, -M]: every exp(x) underflows to 0 and the naive softmax is 0 / 0.
  "shifted": lambda M, S: -M + np.linspace(-1.0, 0.0, S),
}


@jax.jit
def _naive_softmax(x):
  return jnp.exp(x) / jnp.exp(x).sum()


@jax.jit
def _stable_softmax(x):
  e = jnp.exp(x - x.max())
  return e / e.sum()


def _status(p):
  p = np.asarray(p, np.float64)
  if np.isnan(p).any():
    return "NaN"
  if np.isinf(p).any():
    return "inf"
  if not (p > 0).any():
    return "zeros"
  return "ok"


def overflow(
  magnitudes: Sequence[float] = (1, 10, 100, 1e3, 1e4, 1e5),
  num_keys: int = 8,
  dtypes: Sequence[str] = ("float16", "bfloat16", "float32"),
  patterns: Sequence[str] = ("spread", "shifted"),
) -> list[OverflowRow]:
  """Softmax of one row of logits x = q * k_i, computed three ways from q and k in ``dtype``.

  naive: exp(x) / sum(exp(x)) in the dtype; stable: exp(x - max x) / sum(...) in the dtype;
  jattn: `jattn.dot_product_attention` with value = identity, whose output row is the softmax
  (logits and statistics in float32). The reference is the float64 softmax of the exact products
  of the rounded inputs.
  """
  magnitudes = [
    _validation.real(f"magnitudes[{i}]", m, at_least=0)
    for i, m in enumerate(_sequence("magnitudes", magnitudes))
  ]
  S = _validation.positive_int("num_keys", num_keys)
  dtypes = [
    _validation.one_of(f"dtypes[{i}]", d, tuple(DTYPES))
    for i, d in enumerate(_sequence("dtypes", dtypes))
  ]
  patterns = [
    _validation.one_of(f"patterns[{i}]", p, tuple(PATTERNS))
    for i, p in enumerate(_sequence("patterns", patterns))
  ]
  rows = []
  for name in dtypes:
    dtype = DTYPES[name]
    for pattern in patterns:
      for M in magnitudes:
        x = PATTERNS[pattern](float(M), S)
        r = math.sqrt(abs(float(M)))
        # q = r e_1 and k_i = (x_i / r) e_1, so q.k_i = x_i; H = S lets value be the identity.
        q = np.zeros((1, 1, 1, S))
        q[0, 0, 0, 0] = r
        k = np.zeros((1, S, 1, S))
        k[0, :, 0, 0] = x / r
        qd = jnp.asarray(q, jnp.float32).astype(dtype)
        kd = jnp.asarray(k, jnp.float32).astype(dtype)
        vd = jnp.asarray(np.eye(S).reshape(1, S, 1, S), jnp.float32).astype(dtype)
        q64 = np.asarray(qd.astype(jnp.float32), np.float64)[0, 0, 0, 0]
        k64 = np.asarray(kd.astype(jnp.float32), np.float64)[0, :, 0, 0]
        ref = _softmax64(q64 * k64)
        xd = qd[0, 0, 0, 0] * kd[0, :, 0, 0]  # the logits, computed in the dtype
        got = {
          "naive": _naive_softmax(xd),
          "stable": _stable_softmax(xd),
          "jattn": jattn.dot_product_attention(qd, kd, vd, scale=1.0)[0, 0, 0],
        }
        for method, p in got.items():
          p = np.asarray(p.astype(jnp.float32), np.float64)
          status = _status(p)
          err = float(np.abs(p - ref).max()) if status == "ok" else float("nan")
          rows.append(OverflowRow(name, pattern, float(M), method, status, err))
  return rows


# --------------------------------------------------------------------------------------------
# 3. A fully masked row.
# --------------------------------------------------------------------------------------------


def _jax_nn_attention(q, k, v, mask):
  return jax.nn.dot_product_attention(q, k, v, mask=mask)


def _jattn_attention(q, k, v, mask):
  return jattn.dot_product_attention(q, k, v, mask=mask)


def _naive_masked_attention(q, k, v, mask):
  """The textbook version: masked logits set to -inf, then the max-subtracted softmax."""
  s = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
  s = jnp.where(mask, s, -jnp.inf)
  s = s - jax.lax.stop_gradient(s.max(axis=-1, keepdims=True))  # -inf - (-inf) = NaN
  p = jnp.exp(s)
  p = p / p.sum(axis=-1, keepdims=True)
  return jnp.einsum("bnts,bsnh->btnh", p, v)


def _with_grad(f):
  grad = jax.grad(lambda q, k, v, mask: f(q, k, v, mask).sum(), argnums=(0, 1, 2))
  return jax.jit(f), jax.jit(grad)


_MASKED_FNS = {
  "naive -inf": _with_grad(_naive_masked_attention),
  "jax.nn": _with_grad(_jax_nn_attention),
  "jattn": _with_grad(_jattn_attention),
}


def masked_row(
  T: int = 4, S: int = 6, H: int = 8, masked_query: int = 1, seed: int = 0
) -> list[MaskedRowResult]:
  """Attention in float32 with a mask that hides every key from query ``masked_query``."""
  T, S, H = (_validation.positive_int(n, x) for n, x in (("T", T), ("S", S), ("H", H)))
  masked_query = _validation.non_negative_int("masked_query", masked_query)
  if masked_query >= T:
    raise ValueError(f"masked_query must be a query index in [0, T={T}), got {masked_query}")
  rng = np.random.default_rng(_validation.non_negative_int("seed", seed))
  q, k, v = (rng.standard_normal((1, L, 1, H)).astype(np.float32) for L in (T, S, S))
  vis = np.ones((1, 1, T, S), bool)
  vis[0, 0, masked_query] = False
  vis[0, 0, (masked_query + 1) % T, S // 2 :] = False  # a partly masked row for contrast
  s = np.einsum("th,sh->ts", q[0, :, 0].astype(np.float64), k[0, :, 0].astype(np.float64))
  s = np.where(vis[0, 0], s / math.sqrt(H), -np.inf)
  seen = vis[0, 0].any(-1)
  p = np.zeros_like(s)
  p[seen] = _softmax64(s[seen])
  ref = p @ v[0, :, 0].astype(np.float64)  # (T, H)
  mean_v = v[0, :, 0].astype(np.float64).mean(0)
  mask = jnp.asarray(vis)
  out = []
  for name, (f, grad) in _MASKED_FNS.items():
    o = np.asarray(f(q, k, v, mask), np.float64)[0, :, 0]  # (T, H)
    grads = grad(q, k, v, mask)
    err = np.abs(o[seen] - ref[seen])
    out.append(
      MaskedRowResult(
        method=name,
        masked_row=o[masked_query],
        output_nan=bool(np.isnan(o).any()),
        grad_nan=bool(any(np.isnan(np.asarray(g)).any() for g in grads)),
        other_rows_error=float(np.nanmax(err)) if not np.isnan(err).all() else float("nan"),
        mean_of_v_error=float(np.abs(o[masked_query] - mean_v).max()),
      )
    )
  return out


# --------------------------------------------------------------------------------------------
# 4. Precision as T grows.
# --------------------------------------------------------------------------------------------


PRECISION_METHODS = (
  "jattn dense fp32",
  "jattn chunked fp32",
  "jattn dense bf16",
  "jattn chunked bf16",
  "plain bf16",
  "bf16 rounding of ref",
)


@jax.jit
def _plain_attention(q, k, v):
  """Every step in the input dtype (logits, max-subtracted softmax, P V): what a hand-written
  attention does when the whole model is cast to bfloat16."""
  dt = q.dtype
  s = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=dt)
  s = s * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), dt)
  e = jnp.exp(s - s.max(axis=-1, keepdims=True))
  p = e / e.sum(axis=-1, keepdims=True, dtype=dt)
  return jnp.einsum("bnts,bsnh->btnh", p, v, preferred_element_type=dt)


def _reference64(q, k, v):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
  return np.einsum("bnts,bsnh->btnh", _softmax64(s), v)


def precision(
  lengths: Sequence[int] = (128, 256, 512, 1024, 2048),
  heads: int = 2,
  head_dim: int = 64,
  block: int = 128,
  seed: int = 0,
) -> list[PrecisionRow]:
  """Self-attention (T = S), q, k, v ~ N(0, 1) rounded to bfloat16 so every dtype sees the same
  values; errors against the float64 attention of those values. Chunked uses block x block tiles.
  """
  lengths = _int_list("lengths", lengths)
  heads, head_dim, block = (
    _validation.positive_int(n, x)
    for n, x in (("heads", heads), ("head_dim", head_dim), ("block", block))
  )
  rng = np.random.default_rng(_validation.non_negative_int("seed", seed))
  rows = []
  impls: dict[str, dict[str, Any]] = {
    "dense": dict(implementation="dense"),
    "chunked": dict(implementation="chunked", block_q=block, block_kv=block),
  }
  # jattn's functions are jitted inside; its compilation cache is shared across calls.
  fns: dict[str, tuple[Callable[..., Any], Any]] = {
    f"jattn {impl} {tag}": (functools.partial(jattn.dot_product_attention, **kw), dt)
    for impl, kw in impls.items()
    for tag, dt in (("fp32", jnp.float32), ("bf16", jnp.bfloat16))
  }
  fns["plain bf16"] = (_plain_attention, jnp.bfloat16)
  for T in lengths:
    x = [
      jnp.asarray(rng.standard_normal((1, T, heads, head_dim)), jnp.float32).astype(jnp.bfloat16)
      for _ in range(3)
    ]
    x32 = [a.astype(jnp.float32) for a in x]
    ref = _reference64(*x32)
    norm = float(np.sqrt((ref * ref).sum()))
    outs = {
      name: np.asarray(f(*[a.astype(dt) for a in x32]).astype(jnp.float32), np.float64)
      for name, (f, dt) in fns.items()
    }
    outs["bf16 rounding of ref"] = np.asarray(
      jnp.asarray(ref, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64
    )
    for name in PRECISION_METHODS:
      diff = outs[name] - ref
      rows.append(
        PrecisionRow(
          int(T), name, float(np.sqrt((diff * diff).sum())) / norm, float(np.abs(diff).max())
        )
      )
  return rows


# --------------------------------------------------------------------------------------------
# CLI.
# --------------------------------------------------------------------------------------------


def _sequence(name, values):
  """A list or tuple (a lone str or number is refused: TypeError)."""
  return list(_validation.instance(name, values, (list, tuple), "a list or tuple"))


def _int_list(name, values):
  return [
    _validation.positive_int(f"{name}[{i}]", v) for i, v in enumerate(_sequence(name, values))
  ]


# Command-line types: argparse turns their ArgumentTypeError into "argument --keys: ..." (exit 2).


def _int(text, minimum):
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
  if value < minimum:
    raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {value}")
  return value


def _positive(text):
  return _int(text, 1)


def _non_negative(text):
  return _int(text, 0)


def _ints(text):
  return tuple(_positive(t) for t in text.split(",") if t)


def _floats(text):
  values = []
  for t in text.split(","):
    if not t:
      continue
    try:
      v = float(t)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a number, got {t!r}") from None
    if not (math.isfinite(v) and v >= 0):
      raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {t!r}")
    values.append(v)
  return tuple(values)


def _experiments(text):
  names = []
  for t in text.split(","):
    t = t.strip()
    if t.isdigit() and 1 <= int(t) <= len(EXPERIMENTS):
      t = EXPERIMENTS[int(t) - 1]
    if t not in EXPERIMENTS:
      raise argparse.ArgumentTypeError(
        f"unknown experiment {t!r}; choose from {', '.join(EXPERIMENTS)} (or 1-4)"
      )
    names.append(t)
  return tuple(dict.fromkeys(names))


def build_parser():
  p = argparse.ArgumentParser(
    prog="jattn-demo",
    description="Reproduce the numerical-stability experiments: softmax sharpness with and "
    "without 1/sqrt(d), naive vs stable softmax overflow, fully masked rows, and bf16/fp32 "
    "attention error against float64.",
  )
  p.add_argument(
    "-e",
    "--experiments",
    type=_experiments,
    default=EXPERIMENTS,
    help="comma-separated subset of sharpness,overflow,masked,precision (or 1-4); default all",
  )
  p.add_argument("--seed", type=_non_negative, default=0, help="base random seed")
  p.add_argument(
    "--seeds",
    type=_positive,
    default=256,
    help="sharpness: independent draws averaged per head dim (default 256)",
  )
  p.add_argument(
    "--keys",
    type=_positive,
    default=8,
    help="sharpness and overflow: number of keys S (default 8, as the article)",
  )
  p.add_argument(
    "--dims",
    type=_ints,
    default=(32, 64, 128, 512),
    help="sharpness: head dims (default 32,64,128,512)",
  )
  p.add_argument(
    "--magnitudes",
    type=_floats,
    default=(1, 10, 100, 1e3, 1e4, 1e5),
    help="overflow: logit magnitudes M (default 1,10,100,1e3,1e4,1e5)",
  )
  p.add_argument(
    "--lengths",
    type=_ints,
    default=(128, 256, 512, 1024, 2048),
    help="precision: sequence lengths T (default 128,...,2048)",
  )
  p.add_argument("--heads", type=_positive, default=2, help="precision: heads N (default 2)")
  p.add_argument(
    "--head-dim", type=_positive, default=64, help="precision: head dim H (default 64)"
  )
  p.add_argument(
    "--block", type=_positive, default=128, help="precision: chunked block size (default 128)"
  )
  p.add_argument(
    "--plot",
    metavar="DIR",
    default=None,
    help="also write PNG figures (one per experiment) into DIR",
  )
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  if args.plot:
    os.makedirs(args.plot, exist_ok=True)
  for name in args.experiments:
    t0 = time.perf_counter()
    # Each experiment's rows have their own type: bind them to their plot function here.
    plot: Callable[[str], None]
    if name == "sharpness":
      sharp = sharpness(args.dims, args.keys, args.seeds, args.seed)
      text = report.format_sharpness(sharp, args.keys, args.seeds)
      plot = functools.partial(report.plot_sharpness, sharp)
    elif name == "overflow":
      over = overflow(args.magnitudes, args.keys)
      text = report.format_overflow(over)
      plot = functools.partial(report.plot_overflow, over)
    elif name == "masked":
      masked = masked_row(seed=args.seed)
      text = report.format_masked(masked)
      plot = functools.partial(report.plot_masked, masked)
    else:
      prec = precision(args.lengths, args.heads, args.head_dim, args.block, args.seed)
      text = report.format_precision(prec, args.heads, args.head_dim, args.block)
      plot = functools.partial(report.plot_precision, prec)
    print(text)
    if args.plot:
      path = os.path.join(args.plot, f"{EXPERIMENTS.index(name) + 1}_{name}.png")
      plot(path)
      print(f"  wrote {path}")
    print(f"  ({time.perf_counter() - t0:.1f} s)\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
