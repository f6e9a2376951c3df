"""Old against new jattn in one process, interleaved: the CPU targets' calls (configs/cpu_targets
.toml: chunked at T = 4096, full and causal, forward and forward+backward), a decoding step
through the chunked kernels and one through paged_attention (B = 4, N = 32, K = 8, H = 128, a
cache of --S tokens, 16-token pages) timed alternately on this checkout and on an earlier
commit, so that the ratio new / old is read on the same machine state. jax.nn's time is taken
alongside, for the targets' ratios.

  python benchmarks/ab_versions.py --before 84fff63 [--repeats 16] [--T 4096]

The earlier commit's package is extracted with `git archive` into a temporary directory and
imported as ``jattn_before``. Prints one JSON object: medians (seconds) and ratios.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_before(commit: str):
  tmp = pathlib.Path(tempfile.mkdtemp())
  archive = subprocess.run(
    ["git", "archive", commit, "jattn"], cwd=ROOT, check=True, capture_output=True
  ).stdout
  subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
  (tmp / "jattn").rename(tmp / "jattn_before")
  for f in (tmp / "jattn_before").rglob("*.py"):
    text = re.sub(r"\b(from|import) jattn\b", r"\1 jattn_before", f.read_text())
    f.write_text(text)
  sys.path.insert(0, str(tmp))
  return importlib.import_module("jattn_before")


def decoding(lib, S: int):
  """name -> (a jitted function, its arguments): one new token per sequence against a cache of
  S tokens, through the chunked kernels (contiguous cache) and through paged_attention."""
  B, N, K, H, ps = 4, 32, 8, 128, 16
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (B, 1, N, H), jnp.float32)
  k, v = (jax.random.normal(key, (B, S, K, H), jnp.float32) for key in keys[1:])
  lengths = jnp.full((B,), S, jnp.int32)
  chunked = jax.jit(
    lambda q, k, v: lib.dot_product_attention(
      q, k, v, key_value_seq_lengths=lengths, implementation="chunked"
    )
  )
  # The same cache as pages, sequence b's pages b * S / ps ... in order.
  pages = lambda x: x.reshape(B * S // ps, ps, K, H)
  table = jnp.arange(B * S // ps, dtype=jnp.int32).reshape(B, S // ps)
  paged = jax.jit(lambda q, kp, vp: lib.paged_attention(q, kp, vp, table, lengths))
  return {
    "decode/chunked": (chunked, (q, k, v)),
    "decode/paged": (paged, (q, pages(k), pages(v))),
  }


def calls(lib, T: int):
  """name -> a jitted function of (q, k, v): the cpu_targets cases on ``lib``."""
  out = {}
  for causal in (False, True):
    kw = dict(implementation="chunked", block_q=512, block_kv=256, is_causal=causal)
    fwd = jax.jit(lambda q, k, v, kw=kw: lib.dot_product_attention(q, k, v, **kw))
    loss = lambda q, k, v, kw=kw: lib.dot_product_attention(q, k, v, **kw).astype(jnp.float32).sum()
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    tag = "causal" if causal else "full"
    out[f"forward/{tag}"] = fwd
    out[f"forward+backward/{tag}"] = bwd
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--before", required=True)
  parser.add_argument("--repeats", type=int, default=16)
  parser.add_argument("--T", type=int, default=4096)
  parser.add_argument("--S", type=int, default=8192, help="the decoding cases' cache length")
  args = parser.parse_args()
  import jattn
  from jattn.bench import interleaved

  before = load_before(args.before)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, args.T, 8, 64), jnp.float32) for key in keys)
  with_args = lambda fns: {name: (fn, (q, k, v)) for name, fn in fns.items()}
  libs = {
    "new": with_args(calls(jattn, args.T)) | decoding(jattn, args.S),
    "old": with_args(calls(before, args.T)) | decoding(before, args.S),
  }
  libs["jax.nn"] = with_args(
    {
      "forward/full": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v)),
      "forward+backward/full": jax.jit(
        jax.grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v).sum(), argnums=(0, 1, 2))
      ),
    }
  )
  timed = {
    (lib, name): lambda fn=fn, fn_args=fn_args: fn(*fn_args)
    for lib, fns in libs.items()
    for name, (fn, fn_args) in fns.items()
  }

  def order(r):
    # Alternate which version goes first (an even number of repeats gives each the same number
    # of first places), and time jax.nn before both: a call right after jax.nn's, whose
    # temporaries evict the caches, pays for it.
    libs_order = ["jax.nn", "new", "old"] if r % 2 == 0 else ["jax.nn", "old", "new"]
    return [(lib, n) for n in libs["new"] for lib in libs_order if (lib, n) in timed]

  ms = interleaved(timed, args.repeats, order=order)
  med = {lib: {n: ms[lib, n] / 1e3 for n in fns} for lib, fns in libs.items()}
  report = {
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "before": args.before,
    "T": args.T,
    "S": args.S,
    "repeats": args.repeats,
    "median_s": med,
    "new_over_old": {n: med["new"][n] / med["old"][n] for n in med["new"]},
    "targets": {
      side: {
        "forward_vs_jax_nn": med[side]["forward/full"] / med["jax.nn"]["forward/full"],
        "fwd_bwd_vs_jax_nn": (
          med[side]["forward+backward/full"] / med["jax.nn"]["forward+backward/full"]
        ),
        "causal_vs_full_fwd_bwd": (
          med[side]["forward+backward/causal"] / med[side]["forward+backward/full"]
        ),
      }
      for side in ("new", "old")
    },
  }
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
