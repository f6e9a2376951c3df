"""The one timing loop of jattn's benchmarks and examples: interleaved calls, medians.

A shared, noisy machine slows every call of a round alike, so calls are run in turn (A B C A B
C ...) and each one's median is taken: the ratios between them hold where absolute times drift.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any


def interleaved(
  calls: Mapping[Any, Callable[[], Any]],
  repeats: int,
  *,
  warmup: bool = True,
  settle: bool = False,
  order: Callable[[int], Sequence[Hashable]] | None = None,
  raw: bool = False,
) -> dict[Hashable, Any]:
  """{name: median milliseconds} of ``calls`` (name -> a function of nothing returning jax
  arrays), each run ``repeats`` times in turn after one untimed call (``warmup``: compiling
  is not timed). ``settle``: before each call wait until this process is idle
  (`jattn.bench.runner.settle`: a large call's buffers are released after it returns, and that
  work must not land in the next call's time). ``order(r)``: the names in the order round r
  runs them (default: as given; `alternating` reverses every other round, so that no call is
  always the one after another). ``raw``: {name: every time in ms} instead of the medians."""
  import jax

  if settle:
    from jattn.bench.runner import settle as wait_idle
  if warmup:
    for f in calls.values():
      jax.block_until_ready(f())
  times: dict[Any, list[float]] = {name: [] for name in calls}
  for r in range(repeats):
    for name in order(r) if order is not None else calls:
      if settle:
        wait_idle()
      start = time.perf_counter()
      jax.block_until_ready(calls[name]())
      times[name].append((time.perf_counter() - start) * 1e3)
  if raw:
    return times
  return {name: statistics.median(t) for name, t in times.items() if t}


def alternating(names: Sequence[Hashable]) -> Callable[[int], Sequence[Hashable]]:
  """An ``order`` for `interleaved`: ``names`` in even rounds, reversed in odd ones."""
  names = list(names)
  return lambda r: names if r % 2 == 0 else names[::-1]
