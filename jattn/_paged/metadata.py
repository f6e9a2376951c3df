"""The rules a paged call's metadata must keep, so that no sequence reads or writes another's pages.

A paged call is told by data, not by shapes, which pages hold a sequence (``page_table``), how
many of its tokens are cached (``kv_lengths``), which query rows are its own (``query_start``)
and, for a tree of draft tokens, which of its new rows each row sees (``new_token_mask``), or, for
a padded write, how many of its rows are new (``new_lengths``). A wrong value there does not fail
like a wrong shape: read plainly, a page id past the pool would be clamped to the last page, i.e.
another request's keys and values. So the rules are written once, for NumPy and for jax.numpy
alike (``xp``), as one fault code per sequence (`faults`):

- concrete metadata (eager calls, NumPy arrays under ``jit``) is checked before anything runs,
  and the first faulty sequence is named in a ``ValueError`` (`check`, `describe`);
- traced metadata cannot raise: a faulty sequence is run as an empty one (no page of it is read,
  none written) and its rows come back NaN, output and log-sum-exp alike, while every other
  sequence is exact; with ``on_invalid="checkify"`` the call also raises through
  `jax.experimental.checkify` (`checkify`).

Which sequence owns a query row is answered once, from ``query_start``, by `owners`: the writes,
the tiles of the reads, their NaN rows and the tree rule all read it there.

Shapes: B sequences, ``max_pages`` table entries each, P pages of ``page_size`` tokens in the
pool, ``rows`` query rows (T per sequence padded, ``total`` ragged), C a tree mask's columns.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

# Fault codes per sequence, in the order they are reported (the first that holds).
OK, LENGTH, PAGE, START, ROWS, TREE, COUNT = 0, 1, 2, 3, 4, 5, 6
# What a traced faulty sequence gets, by call: paged_attention's rows come back NaN, write_pages
# writes none of its tokens; "checkify" does the same and adds a checkify error.
ON_INVALID = {"paged_attention": ("nan", "checkify"), "write_pages": ("skip", "checkify")}


class Geometry(NamedTuple):
  """The sizes the rules are measured against."""

  P: int  # pages in the pool
  page_size: int  # tokens per pool page
  rows: int  # T (padded) or total (ragged)
  ragged: bool


class Metadata(NamedTuple):
  """A call's per-sequence metadata: page_table (B, max_pages), kv_lengths (B,), query_start
  (B + 1,) or None (padded); a read's new_token_mask ((B, T, T) padded, (total, C) ragged) or a
  write's new_lengths (B,) (padded), None where the call has none."""

  page_table: Any
  kv_lengths: Any
  query_start: Any = None
  new_token_mask: Any = None
  new_lengths: Any = None


class Owners(NamedTuple):
  """Which sequence owns each query row, from ``query_start`` (B * T rows padded, ``total``
  ragged), faulty sequences owning none."""

  seq: Any  # (rows,) int32: the row's sequence (0 where no sound sequence holds it)
  within: Any  # (rows,) int32: its index among that sequence's new rows
  live: Any  # (rows,) bool: a sound sequence holds it
  lost: Any  # (rows,) bool: only faulty sequences claim it (its output is NaN)
  start: Any  # (B,) int32: each sequence's first row
  count: Any  # (B,) int32: its new rows (0 for a faulty sequence)


def check_on_invalid(call: str, on_invalid) -> None:
  """``on_invalid`` is one of ``call``'s choices, else a ValueError naming them."""
  if on_invalid not in ON_INVALID[call]:
    raise ValueError(f"on_invalid must be one of {ON_INVALID[call]}, got on_invalid={on_invalid!r}")


def owners(xp, query_start, rows: int, faulty, new_lengths=None) -> Owners:
  """Each query row's sequence and its index among that sequence's new rows.

  Padded (``query_start`` None): B * ``rows`` rows, sequence b's are b * rows .. (b + 1) * rows
  - 1, of which its new ones are the last ``new_lengths[b]`` (all without it: left padding is
  not new). Ragged: sequence b's are rows query_start[b] .. query_start[b + 1] - 1, matched as
  runs, not counted, so that a faulty sequence's offsets (a start out of order) cannot move a
  sound sequence's rows. ``faulty`` (B,) bool: sequences that own no row."""
  B = faulty.shape[0]
  i32 = np.int32
  if query_start is None:
    r = xp.arange(B * rows, dtype=i32)  # by arithmetic, so that B may be symbolic
    seq, within = r // rows, r % rows
    count = xp.full((B,), rows, i32)
    if new_lengths is not None:
      first = rows - new_lengths.astype(i32)  # left padding: the rows before a sequence's new ones
      within, count = within - first[seq], new_lengths.astype(i32)
    start = xp.arange(B, dtype=i32) * rows
    live = ~faulty[seq] & (within >= 0)
    return Owners(seq, within, live, faulty[seq], start, xp.where(faulty, 0, count).astype(i32))
  qs = query_start.astype(i32)
  r = xp.arange(rows, dtype=i32)[:, None]
  mine = (qs[None, :-1] <= r) & (r < qs[None, 1:])  # (total, B): the runs holding each row
  own = mine & ~faulty[None, :]
  if B == 0:  # no sequences: every row is padding (argmax has nothing to reduce)
    none = xp.zeros((rows,), bool)
    return Owners(xp.zeros((rows,), i32), xp.zeros((rows,), i32), none, none, qs[:-1], qs[:-1])
  seq = xp.argmax(own, axis=1).astype(i32)
  live = own.any(axis=1)
  lost = (mine & faulty[None, :]).any(axis=1) & ~live
  count = xp.where(faulty, 0, qs[1:] - qs[:-1]).astype(i32)
  return Owners(seq, r[:, 0] - qs[seq], live, lost, qs[:-1], count)


def faults(xp, g: Geometry, md: Metadata):
  """(B,) int32: each sequence's first broken rule (OK, LENGTH, PAGE, START, ROWS, TREE, COUNT).

  LENGTH: kv_lengths[b] outside [0, max_pages * page_size]. PAGE: an entry of page_table[b]
  outside [0, P) among the pages kv_lengths[b] covers (entries past them are never read and may
  hold anything). START (ragged): sequence b's rows [query_start[b], query_start[b + 1]) are not
  a run inside [0, rows) after every earlier sequence's rows, or query_start[0] != 0. ROWS
  (ragged): more query rows than cached tokens (the new tokens are cached before the call, so a
  sequence's length counts them). TREE: a row of sequence b hides itself in new_token_mask, or
  (ragged) b has more new rows than the mask's columns. COUNT: new_lengths[b] outside
  [0, min(T, kv_lengths[b])]."""
  table = md.page_table.astype(np.int32)  # NumPy's and jax's arrays alike
  lens = md.kv_lengths.astype(table.dtype)
  code = _cache_faults(xp, g, table, lens)
  if g.ragged:
    code = _row_faults(xp, g, md.query_start.astype(table.dtype), lens, code)
  if md.new_token_mask is not None:
    tree = tree_faults(xp, g, md.query_start, md.new_token_mask, code != OK)
    code = xp.where(tree & (code == OK), TREE, code)
  if md.new_lengths is not None:
    n = md.new_lengths.astype(table.dtype)
    code = xp.where(((n < 0) | (n > g.rows) | (n > lens)) & (code == OK), COUNT, code)
  return code.astype(table.dtype)


def _cache_faults(xp, g: Geometry, table, lens):
  """(B,) LENGTH, PAGE or OK: the lengths and the page ids they cover."""
  max_pages = table.shape[1]
  capacity = max_pages * g.page_size
  bad_len = (lens < 0) | (lens > capacity)
  covered = xp.clip(lens, 0, capacity)
  pages = (covered + g.page_size - 1) // g.page_size  # (B,) pages each sequence reads
  used = xp.arange(max_pages, dtype=table.dtype)[None, :] < pages[:, None]
  bad_page = (used & ((table < 0) | (table >= g.P))).any(axis=1)
  code = xp.where(bad_page, PAGE, OK)
  return xp.where(bad_len, LENGTH, code)


def _row_faults(xp, g: Geometry, qs, lens, code):
  """``code`` with START and ROWS: ragged rows' offsets against the rows and the lengths."""
  B = qs.shape[0] - 1
  start, end = qs[:-1], qs[1:]
  # The furthest row any earlier sequence reaches: a later one may not start before it.
  b = xp.arange(B, dtype=qs.dtype)
  earlier = xp.where(b[None, :] < b[:, None], end[None, :], 0).max(axis=1, initial=0)
  bad_start = (start < 0) | (end < start) | (end > g.rows) | (start < earlier)
  bad_start = bad_start | ((b == 0) & (qs[0] != 0))
  code = xp.where(~bad_start & (code == OK) & (end - start > lens), ROWS, code)
  return xp.where(bad_start & (code != LENGTH), START, code)


def tree_faults(xp, g: Geometry, query_start, mask, faulty):
  """(B,) bool: the sound sequences (not ``faulty``) whose new_token_mask breaks its rules: one
  of their rows hides itself, or (ragged) they have more new rows than the mask's C columns."""
  C = mask.shape[-1]
  at = owners(xp, query_start, g.rows, faulty)
  flat = mask.reshape(-1, C)  # (B * T | total, C): row r's view of its sequence's new rows
  itself = xp.take_along_axis(flat, xp.clip(at.within, 0, C - 1)[:, None], axis=1)[:, 0]
  broken = at.live & ((at.within >= C) | ~itself)
  if not g.ragged:
    return broken.reshape(-1, g.rows).any(axis=1)
  B = faulty.shape[0]
  return (broken[:, None] & (at.seq[:, None] == xp.arange(B, dtype=np.int32)[None, :])).any(axis=0)


def check_shapes(md: Metadata, shape: tuple, ragged: bool, name="query") -> tuple[int, int, int]:
  """(B, max_pages, rows): the metadata's shapes against each other and against the query's
  (or the new keys') ``shape``, (B, T, heads, H) padded or (total, heads, H) ragged."""
  page_table, kv_lengths, query_start = md.page_table, md.kv_lengths, md.query_start
  if page_table.ndim != 2:
    raise ValueError(f"page_table must be (B, max_pages), got shape {page_table.shape}")
  B = page_table.shape[0]
  if kv_lengths.shape != (B,):
    raise ValueError(
      f"kv_lengths must be (B,) = ({B},) like page_table's rows, got shape {kv_lengths.shape}"
    )
  if query_start is not None and query_start.shape != (B + 1,):
    raise ValueError(f"query_start must be (B + 1,) = ({B + 1},), got shape {query_start.shape}")
  heads = "N" if name == "query" else "K"
  if len(shape) != (3 if ragged else 4):
    form = f"(total, {heads}, H) with query_start" if ragged else f"(B, T, {heads}, H)"
    raise ValueError(f"{name} must be {form}, got {name}.shape={shape}")
  if not ragged and shape[0] != B:
    raise ValueError(f"{name}'s batch B={shape[0]} must be page_table's B={B}")
  rows = shape[0] if ragged else shape[1]
  g = Geometry(0, 1, rows, ragged)
  if md.new_token_mask is not None:
    _check_mask_shape(md.new_token_mask.shape, B, g)
  if md.new_lengths is not None:
    _check_count_shape(md.new_lengths.shape, B, g)
  return B, page_table.shape[1], rows


def _check_mask_shape(shape, B, g: Geometry) -> None:
  rows = g.rows
  if g.ragged:
    if len(shape) != 2 or shape[0] != rows or shape[1] < 1:
      raise ValueError(
        f"new_token_mask must be (total, T_max) = ({rows}, T_max) with a ragged query (row r "
        f"sees its sequence's new row c iff mask[r, c]), got shape {shape}"
      )
  elif shape != (B, rows, rows):
    raise ValueError(
      f"new_token_mask must be (B, T, T) = ({B}, {rows}, {rows}) with a padded query (row i "
      f"of sequence b sees its new row c iff mask[b, i, c]), got shape {shape}"
    )


def _check_count_shape(shape, B, g: Geometry) -> None:
  if g.ragged:
    raise ValueError(
      "new_lengths is for the padded form (B, T, K, H); ragged rows count their new tokens "
      "by query_start: pass one or the other"
    )
  if shape != (B,):
    raise ValueError(
      f"new_lengths must be (B,) = ({B},), one count per sequence of key's (B, T, K, H), got "
      f"shape {shape}"
    )


def _concrete(x) -> bool:
  return x is None or not isinstance(x, jax.core.Tracer)


def check(g: Geometry, given: Metadata) -> None:
  """Raise a ValueError naming the argument, the first faulty sequence and its value, for the
  rules whose inputs are known now (``given``: the metadata as passed, NumPy arrays being known
  under jit too); traced metadata is left to the run-time rule, `faults`."""
  known = Metadata(*(np.asarray(x) if x is not None and _concrete(x) else None for x in given))
  if all(_concrete(x) for x in given[:3]):
    code = faults(np, g, known)
  else:  # the rules that read none of the traced arrays: a tree's, a write's count of new rows
    code = np.zeros((0,), np.int32)
    mask, n, lens = known.new_token_mask, known.new_lengths, known.kv_lengths
    if mask is not None and _concrete(given.query_start):
      B = known.query_start.shape[0] - 1 if g.ragged else mask.shape[0]
      code = np.where(tree_faults(np, g, known.query_start, mask, np.zeros(B, bool)), TREE, OK)
    if n is not None and lens is not None:
      count = np.where((n < 0) | (n > g.rows) | (n > lens), COUNT, OK)
      code = np.where(code == OK, count, code) if code.size else count
  bad = np.flatnonzero(code != OK)
  if bad.size:
    b = int(bad[0])
    raise ValueError(describe(g, int(code[b]), b, known))


def describe(g: Geometry, code: int, b: int, md: Metadata) -> str:
  """The message for sequence b's fault ``code`` (NumPy metadata, None where not known)."""
  table, lens, qs = md.page_table, md.kv_lengths, md.query_start
  if code == LENGTH:
    capacity = table.shape[1] * g.page_size
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
  if code == ROWS:
    n = int(qs[b + 1] - qs[b])
    return (
      f"sequence {b} has {n} query rows but kv_lengths[{b}]={int(lens[b])}: kv_lengths "
      f"counts the cached tokens including the new ones (FlashAttention's cache_seqlens, "
      f"which excludes them, is kv_lengths - new tokens)"
    )
  if code == TREE:
    return _describe_tree(b, md.new_token_mask, qs)
  return (
    f"new_lengths[{b}]={int(md.new_lengths[b])} must be in [0, T={g.rows}] and at most "
    f"kv_lengths[{b}]={int(lens[b])} (the new tokens are the last cached ones)"
  )


def _describe_tree(b: int, mask, qs) -> str:
  if qs is None:
    i = int(np.flatnonzero(~np.diagonal(mask[b]))[0])
    return (
      f"new_token_mask[{b}, {i}, {i}] is False: every new row must see itself (row {i} of "
      f"sequence {b}; its position is counted from the rows it sees)"
    )
  n, C = int(qs[b + 1] - qs[b]), mask.shape[1]
  if n > C:
    return (
      f"sequence {b} has {n} new rows (query_start[{b}]={int(qs[b])}, query_start[{b + 1}]="
      f"{int(qs[b + 1])}) but new_token_mask has T_max={C} columns, one per new row"
    )
  i = int(np.flatnonzero(~mask[qs[b] + np.arange(n), np.arange(n)])[0])
  return (
    f"new_token_mask[{int(qs[b]) + i}, {i}] is False: every new row must see itself (row "
    f"{int(qs[b]) + i} is sequence {b}'s new row {i}; its position is counted from the rows it "
    f"sees)"
  )


def checkify(call: str, code) -> None:
  """Under `jax.experimental.checkify`: an error naming the first faulty sequence and its
  broken rule (a tree's in words of its own)."""
  import jax.numpy as jnp
  from jax.experimental import checkify  # only callers who ask for it pay the import

  bad = (code != OK) & (code != TREE)
  first = jnp.argmax(bad)
  checkify.check(
    ~bad.any(),
    f"{call}: sequence {{b}} breaks metadata rule {{rule}} "
    "(1: kv_lengths out of [0, capacity], 2: a page id out of [0, P) in its "
    "length, 3: query_start not a run after the previous sequence's, 4: more "
    "query rows than kv_lengths, 6: new_lengths out of [0, min(T, kv_lengths)])",
    b=first,
    rule=code[first],
  )
  tree = code == TREE
  checkify.check(
    ~tree.any(),
    f"{call}: sequence {{b}}'s new_token_mask hides one of its rows from itself, or "
    "(ragged) the sequence has more new rows than the mask's columns",
    b=jnp.argmax(tree),
  )
