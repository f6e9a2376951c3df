"""Covering designs for option matrices: every pair of values of two factors together at least
once (strength 2, the "allpairs" rule), instead of every combination.

A full product tests each value of a factor against every combination of the others; most bugs
need one value or two to meet (a kernel and an option, an option and a mode), so a design that
holds every pair finds them with far fewer cases: 7 implementations x 19 options x 4 modes is
532 cases, their pairs fit in 133. Rows that cannot run (``allowed`` says so) are never chosen,
and a pair no allowed row holds is not asked for.

Greedy (AETG's rule): each new row is the allowed combination that covers the most pairs not yet
covered, the first in the product's order on a tie, so the design is the same on every run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable


def _pairs(row: tuple) -> set:
  return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(row), 2)}


def pairwise(
  factors: dict[str, list], allowed: Callable[[dict], bool] = lambda row: True
) -> list[dict]:
  """Rows ({factor: value}) that hold every pair of values of two factors that some allowed
  row holds. ``factors``: name -> values (hashable), in the order rows list them."""
  names = list(factors)
  rows = [
    r for r in itertools.product(*(factors[n] for n in names)) if allowed(dict(zip(names, r)))
  ]
  pairs = [_pairs(r) for r in rows]
  todo = set().union(*pairs) if pairs else set()
  design = []
  while todo:
    best = max(range(len(rows)), key=lambda i: (len(pairs[i] & todo), -i))
    design.append(dict(zip(names, rows[best])))
    todo -= pairs[best]
  return design


def ids(rows: list[dict]) -> list[str]:
  """Test ids: the row's values joined by '-'."""
  return ["-".join(str(v) for v in row.values()) for row in rows]
