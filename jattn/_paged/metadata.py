"""The rules a paged call's metadata must keep, so that no sequence reads another's pages.

A paged call is told by data, not by shapes, which pages hold a sequence (``page_table``), how
many of its tokens are cached (``kv_lengths``) and which query rows are its own
(``query_start``). A wrong value there does not fail like a wrong shape: read plainly, a page id
past the pool would be clamped to the last page, i.e. another request's keys and values. So the
rules are written once, for NumPy and for jax.numpy alike (``xp``):

- concrete metadata (eager calls, NumPy arrays under ``jit``) is checked before anything runs,
  and the first faulty sequence is named in a ``ValueError`` (`check_concrete`);
- traced metadata cannot raise: a faulty sequence is run as an empty one (no page of it is
  read) and its rows come back NaN, output and log-sum-exp alike, while every other sequence
  is exact (`faults`, used by the kernel); with ``on_invalid="checkify"`` the call also raises
  through `jax.experimental.checkify` (`checkify_faults`).

Shapes: B sequences, ``max_pages`` table entries each, P pages of ``page_size`` tokens in the
pool, ``rows`` query rows (T per sequence padded, ``total`` ragged).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

# Fault codes per sequence, in the order they are reported (the first that holds).
OK, LENGTH, PAGE, START, ROWS = 0, 1, 2, 3, 4
ON_INVALID = ("nan", "checkify")


class Geometry(NamedTuple):
  """The sizes the rules are measured against."""

  P: int  # pages in the pool
  page_size: int  # tokens per pool page
  rows: int  # T (padded) or total (ragged)
  ragged: bool


def faults(xp, g: Geometry, page_table, kv_lengths, query_start):
  """(B,) int32: each sequence's first broken rule (OK, LENGTH, PAGE, START, ROWS).

  LENGTH: kv_lengths[b] outside [0, max_pages * page_size]. PAGE: an entry of page_table[b]
  outside [0, P) among the pages kv_lengths[b] covers (entries past them are never read and may
  hold anything). START (ragged): sequence b's rows [query_start[b], query_start[b + 1]) are not
  a run inside [0, rows) after every earlier sequence's rows, or query_start[0] != 0. ROWS
  (ragged): more query rows than cached tokens (the new tokens are cached before the call, so a
  sequence's length counts them)."""
  table = page_table.astype(np.int32)  # NumPy's and jax's arrays alike
  lens = kv_lengths.astype(table.dtype)
  B, max_pages = table.shape
  capacity = max_pages * g.page_size
  bad_len = (lens < 0) | (lens > capacity)
  covered = xp.clip(lens, 0, capacity)
  pages = (covered + g.page_size - 1) // g.page_size  # (B,) pages each sequence reads
  used = xp.arange(max_pages, dtype=table.dtype)[None, :] < pages[:, None]
  bad_page = (used & ((table < 0) | (table >= g.P))).any(axis=1)
  code = xp.where(bad_page, PAGE, OK)
  code = xp.where(bad_len, LENGTH, code)
  if not g.ragged:
    return code.astype(table.dtype)
  qs = query_start.astype(table.dtype)
  start, end = qs[:-1], qs[1:]
  # The furthest row any earlier sequence reaches: a later one may not start before it.
  b = xp.arange(B, dtype=table.dtype)
  earlier = xp.where(b[None, :] < b[:, None], end[None, :], 0).max(axis=1, initial=0)
  bad_start = (start < 0) | (end < start) | (end > g.rows) | (start < earlier)
  bad_start = bad_start | ((b == 0) & (qs[0] != 0))
  code = xp.where(~bad_start & (code == OK) & (end - start > lens), ROWS, code)
  code = xp.where(bad_start & (code != LENGTH), START, code)
  return code.astype(table.dtype)


def check_shapes(
  page_table, kv_lengths, query_start, query_batch, query="query"
) -> tuple[int, int]:
  """(B, max_pages): page_table (B, max_pages), kv_lengths (B,) and query_start (B + 1,) or
  None, checked against each other and ``query_batch``, a padded query's B (None: ragged)."""
  if page_table.ndim != 2:
    raise ValueError(f"page_table must be (B, max_pages), got shape {page_table.shape}")
  B = page_table.shape[0]
  if kv_lengths.shape != (B,):
    raise ValueError(
      f"kv_lengths must be (B,) = ({B},) like page_table's rows, got shape {kv_lengths.shape}"
    )
  if query_start is not None and query_start.shape != (B + 1,):
    raise ValueError(f"query_start must be (B + 1,) = ({B + 1},), got shape {query_start.shape}")
  if query_batch is not None and query_batch != B:
    raise ValueError(f"{query}'s batch B={query_batch} must be page_table's B={B}")
  return B, page_table.shape[1]


def _concrete(x) -> bool:
  return x is None or not isinstance(x, jax.core.Tracer)


def check_concrete(g: Geometry, page_table, kv_lengths, query_start) -> None:
  """Raise a ValueError naming the argument, the first faulty sequence and its value, when the
  metadata is known now (traced metadata is left to the run-time rule, `faults`)."""
  if not all(_concrete(x) for x in (page_table, kv_lengths, query_start)):
    return
  table = np.asarray(page_table)
  lens = np.asarray(kv_lengths)
  qs = None if query_start is None else np.asarray(query_start)
  code = faults(np, g, table, lens, qs)
  bad = np.flatnonzero(code != OK)
  if not bad.size:
    return
  b = int(bad[0])
  raise ValueError(describe(g, int(code[b]), b, table, lens, qs))


def describe(g: Geometry, code: int, b: int, table, lens, qs) -> str:
  """The message for sequence b's fault ``code`` (NumPy metadata)."""
  capacity = table.shape[1] * g.page_size
  if code == LENGTH:
    return (
      f"kv_lengths[{b}]={int(lens[b])} is outside [0, {capacity}]: page_table's "
      f"{table.shape[1]} pages of {g.page_size} tokens hold at most {capacity}"
    )
  if code == PAGE:
    pages = -(-int(lens[b]) // g.page_size)
    i = int(np.flatnonzero((table[b, :pages] < 0) | (table[b, :pages] >= g.P))[0])
    return (
      f"page_table[{b}, {i}]={int(table[b, i])} is not a page of the pool [0, {g.P}) "
      f"and sequence {b}'s kv_lengths[{b}]={int(lens[b])} covers it (a page id out of "
      f"range would read another sequence's page)"
    )
  if code == START:
    return (
      f"query_start must start at 0, never decrease and end at most at the query's "
      f"{g.rows} rows; sequence {b} has query_start[{b}]={int(qs[b])}, "
      f"query_start[{b + 1}]={int(qs[b + 1])} (query_start={qs.tolist()})"
    )
  n = int(qs[b + 1] - qs[b])
  return (
    f"sequence {b} has {n} query rows but kv_lengths[{b}]={int(lens[b])}: kv_lengths "
    f"counts the cached tokens including the new ones (FlashAttention's cache_seqlens, "
    f"which excludes them, is kv_lengths - new tokens)"
  )


def checkify_faults(code) -> None:
  """Under `jax.experimental.checkify`: an error naming the first faulty sequence and its
  broken rule."""
  import jax.numpy as jnp
  from jax.experimental import checkify  # only callers who ask for it pay the import

  bad = code != OK
  first = jnp.argmax(bad)
  checkify.check(
    ~bad.any(),
    "paged_attention: sequence {b} breaks metadata rule {rule} "
    "(1: kv_lengths out of [0, capacity], 2: a page id out of [0, P) in its "
    "length, 3: query_start not a run after the previous sequence's, 4: more "
    "query rows than kv_lengths)",
    b=first,
    rule=code[first],
  )
