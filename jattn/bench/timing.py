"""The one timing loop of jattn's benchmarks and examples: interleaved calls, medians.

A shared, noisy machine slows every call of a round alike, so calls are run in turn (A B C A B
C ...) and each one's median is taken: the ratios between them hold where absolute times drift.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any


def interleaved(
  calls: Mapping[Any, Callable[[], Any]],
  repeats: int,
  *,
  warmup: bool = True,
  settle: bool = False,
) -> dict[Any, float]:
  """{name: median milliseconds} of ``calls`` (name -> a function of nothing returning jax
  arrays), each run ``repeats`` times in turn after one untimed call (``warmup``: compiling
  is not timed). ``settle``: before each call wait until this process is idle
  (`jattn.bench.runner.settle`: a large call's buffers are released after it returns, and that
  work must not land in the next call's time)."""
  import jax

  if settle:
    from jattn.bench.runner import settle as wait_idle
  if warmup:
    for f in calls.values():
      jax.block_until_ready(f())
  times: dict[Any, list[float]] = {name: [] for name in calls}
  for _ in range(repeats):
    for name, f in calls.items():
      if settle:
        wait_idle()
      start = time.perf_counter()
      jax.block_until_ready(f())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) * 1e3 for name, t in times.items()}
