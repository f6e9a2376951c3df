"""`prefix_tree`: packed token trees (RL rollouts: a prompt and its sampled responses, turns and
branches within them) as a `hidden_rows` mask and the positions each token would have alone.

In depth-first order every subtree is one run of packed tokens, so a key column is hidden from
exactly the rows past its node's subtree: one lower interval per column, with causality the
rest. Everything is computed per example in O(T + M log M) vectorised steps (M nodes), traced or
not: no (T, S) array and no loop over nodes in Python."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _sharding, _validation
from jattn._types import ArrayLike
from jattn.masks._intervals import hidden_rows
from jattn.masks._protocol import Mask
from jattn.masks._structural import causal

_NAME = "masks.prefix_tree"


class PrefixTree(NamedTuple):
  """What `prefix_tree` returns. ``mask``: causal attention within each root-to-leaf path
  (``causal() & hidden_rows(...)``); ``positions``: int32 (B, T), each token's position in its
  path run alone (the tokens of its ancestors, then its offset in its own node; 0 for padding),
  for RoPE and for ``q_positions``/``kv_positions``; ``previous``: int32 (B, T), the token before
  each one on its path (-1 for a path's first token and padding), whose logits predict it -- a
  response's first token is predicted by its prompt's last; ``node_ids``: int32 (B, T), each
  token's node (-1: padding)."""

  mask: Mask
  positions: Any
  previous: Any
  node_ids: Any


def prefix_tree(
  parents: ArrayLike,
  node_ids: ArrayLike | None = None,
  *,
  lengths: ArrayLike | None = None,
  size: int | None = None,
) -> PrefixTree:
  """Packed trees of tokens, each token attending causally to its own node and its ancestors.

  Args:
    parents: int (B, M) or (M,) (shared by the batch): node m's parent, or -1 for a root. Nodes
      are numbered in depth-first order (a parent before its children, each subtree's nodes
      consecutive); several roots make a forest (several prompts in one row).
    node_ids: int (B, T) or (T,): the node of each packed token, -1 for padding. A node's
      tokens are consecutive and nodes come in order.
    lengths: instead of ``node_ids``: int (B, M) or (M,), the tokens of each node, packed in
      node order from position 0 and padded to ``size`` (T, an int). A GRPO group is
      ``parents=[-1, 0, 0, ...]``, ``lengths=[prompt, response_1, ...]``.

  Returns a `PrefixTree`: the mask (query i sees key j iff j <= i and j's node is i's or one of
  its ancestors; padding is seen by no one, and a row of padding after the trees sees nothing),
  the positions, each token's predecessor on its path and the node ids. Every array may be traced; known values are checked
  (ValueError naming the argument and the first bad entry). See docs/prefix_trees.md.
  """
  p: Any = _validation.int_array(f"{_NAME}: parents", parents)
  if p.ndim not in (1, 2):
    raise ValueError(f"{_NAME}: parents must be (B, M) or (M,), got shape {p.shape}")
  if (node_ids is None) == (lengths is None):
    raise ValueError(f"{_NAME}: give node_ids or lengths (with size), got {_given(node_ids)}")
  if lengths is not None:
    node_ids = _from_lengths(lengths, p.shape[-1], size)
  elif size is not None:
    raise ValueError(f"{_NAME}: size goes with lengths (node_ids sets T), got size={size}")
  ids: Any = _validation.int_array(f"{_NAME}: node_ids", node_ids)
  if ids.ndim not in (1, 2):
    raise ValueError(f"{_NAME}: node_ids must be (B, T) or (T,), got shape {ids.shape}")
  p, ids = _batched(p.astype(jnp.int32), ids.astype(jnp.int32))
  # Under an Explicit mesh: the tree's integer bookkeeping (its scatters and pointer jumps mix
  # per-token and per-node arrays) on whole arrays on every device, the per-token results
  # sharded back as the node ids were.
  spec = _sharding.spec_of(ids)
  p, ids = _sharding.replicated((p, ids))
  _check_parents(p)
  _check_node_ids(ids, p.shape[1])
  lower_start, positions, previous, nxt = _tree(p, ids)
  _check_depth_first(p, nxt)
  lower_start, positions, previous, ids = (
    _sharding.reshard_to(x, spec) for x in (lower_start, positions, previous, ids)
  )
  return PrefixTree(causal() & hidden_rows(lower_start=lower_start), positions, previous, ids)


def _given(node_ids) -> str:
  return "both" if node_ids is not None else "neither"


def _batched(parents, node_ids):
  """(B, M) parents and (B, T) node ids, the batch of either broadcast to the other's."""
  parents = parents[None] if parents.ndim == 1 else parents
  node_ids = node_ids[None] if node_ids.ndim == 1 else node_ids
  B = max(parents.shape[0], node_ids.shape[0])
  for name, x in (("parents", parents), ("node_ids", node_ids)):
    if x.shape[0] not in (1, B):
      raise ValueError(
        f"{_NAME}: parents and node_ids (or lengths) must have one batch B (or 1), got "
        f"{name} with B={x.shape[0]} against B={B}"
      )
  return (
    jnp.broadcast_to(parents, (B, parents.shape[1])),
    jnp.broadcast_to(node_ids, (B, node_ids.shape[1])),
  )


def _from_lengths(lengths, M, size):
  """(B, T) node ids of nodes packed in order from position 0, padding (-1) up to ``size``."""
  size = _validation.positive_int(f"{_NAME}: size", size)
  lengths = _validation.int_array(f"{_NAME}: lengths", lengths)
  if lengths.ndim not in (1, 2) or lengths.shape[-1] != M:
    raise ValueError(
      f"{_NAME}: lengths must be (B, M) or (M,) with M={M} (parents' nodes), got shape "
      f"{lengths.shape}"
    )
  lengths = lengths.astype(jnp.int32)
  lengths = lengths[None] if lengths.ndim == 1 else lengths
  if not isinstance(lengths, jax.core.Tracer):
    known = np.asarray(lengths)
    _first_bad(known < 0, "lengths", known, "must be >= 0")
    total = known.sum(axis=1)
    _first_bad(total > size, "lengths", total, f"must sum to at most size={size}", total=True)
  return _packed_ids(lengths, size)


@functools.partial(jax.jit, static_argnums=1)
def _packed_ids(lengths, size):
  """(B, T = size) node ids of nodes of ``lengths`` (B, M) packed in order, padding -1."""
  ends = jnp.cumsum(lengths, axis=1)
  t = jnp.arange(size, dtype=jnp.int32)
  node = jax.vmap(lambda e: jnp.searchsorted(e, t, side="right"))(ends).astype(jnp.int32)
  return jnp.where(node < lengths.shape[1], node, -1)


# One compiled program: called on known arrays outside jit, op by op it compiled ~75 small
# programs (1.7 s the first time, measured on jax 0.12).
@jax.jit
def _tree(parents, node_ids):
  """(lower_start, positions, previous (B, T), next (B, M)): each key's first hidden row (the end
  of its node's subtree; 0 for padding), each token's position alone and the token before it on
  its path (-1: none), and each node's first later node that is not its descendant (M if
  none)."""
  B, M = parents.shape
  T = node_ids.shape[1]
  real = node_ids >= 0
  slot = jnp.where(real, node_ids, M)  # padding scatters nowhere
  rows = jnp.arange(B)[:, None]
  t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
  start = jnp.full((B, M), T, jnp.int32).at[rows, slot].min(t, mode="drop")
  stop = jnp.zeros((B, M), jnp.int32).at[rows, slot].max(t + 1, mode="drop")
  count = jnp.zeros((B, M), jnp.int32).at[rows, slot].add(1, mode="drop")
  above = _over_ancestors(parents, count) - count  # tokens of the strict ancestors
  depth = _over_ancestors(parents, jnp.ones_like(count))
  # The last token of the nearest ancestor that has any: the deepest one's is the greatest.
  last = jnp.where(count > 0, stop - 1, -1)
  up = jnp.where(parents >= 0, jnp.take_along_axis(last, jnp.maximum(parents, 0), axis=1), -1)
  before = _over_ancestors(parents, up, jnp.maximum)
  nxt = _next_not_deeper(depth)
  # Nodes in depth-first order hold consecutive runs of tokens: a subtree's last token is the
  # furthest stop among the nodes before its next non-descendant.
  reach = jax.lax.cummax(stop, axis=1)
  subtree_end = jnp.take_along_axis(reach, jnp.maximum(nxt - 1, 0), axis=1)
  node = jnp.clip(node_ids, 0, max(M - 1, 0))
  at = lambda x: jnp.take_along_axis(x, node, axis=1)
  lower_start = jnp.where(real, at(subtree_end), 0)
  positions = jnp.where(real, at(above) + t - at(start), 0)
  previous = jnp.where(real, jnp.where(t > at(start), t - 1, at(before)), -1)
  return lower_start, positions, previous, nxt


def _over_ancestors(parents, value, op=jnp.add):
  """(B, M): each node's ``value`` reduced by ``op`` (add, or max of values >= -1) over itself
  and its ancestors, by pointer jumping: after s steps a node holds the reduction over its 2^s
  nearest and points 2^s levels up."""
  acc, up = value, parents
  neutral = 0 if op is jnp.add else -1
  for _ in range(max(parents.shape[1] - 1, 0).bit_length()):
    ok = up >= 0
    safe = jnp.maximum(up, 0)
    acc = op(acc, jnp.where(ok, jnp.take_along_axis(acc, safe, axis=1), neutral))
    up = jnp.where(ok, jnp.take_along_axis(up, safe, axis=1), -1)
  return acc


def _next_not_deeper(depth):
  """(B, M): for node m the first n > m with depth[n] <= depth[m] (M if none) -- where m's
  subtree ends in depth-first order. A sparse table of range minima, searched by binary lifting
  from the largest jump down: O(M log M), no loop over nodes."""
  B, M = depth.shape
  levels = max(M, 1).bit_length()
  width = M + (1 << levels)
  # Past the last node the depth is -1: every search stops at M.
  table = [jnp.concatenate([depth, jnp.full((B, width - M), -1, jnp.int32)], axis=1)]
  index = jnp.arange(width, dtype=jnp.int32)
  for k in range(1, levels + 1):
    half = jnp.minimum(index + (1 << (k - 1)), width - 1)
    table.append(jnp.minimum(table[-1], jnp.take(table[-1], half, axis=1)))
  pos = jnp.broadcast_to(jnp.arange(1, M + 1, dtype=jnp.int32)[None], (B, M))
  for k in range(levels, -1, -1):
    # table[k][pos] is the least depth in [pos, pos + 2^k): all deeper, the subtree goes on.
    deeper = jnp.take_along_axis(table[k], pos, axis=1) > depth
    pos = jnp.where(deeper, pos + (1 << k), pos)
  return pos


def _first_bad(bad, name, values, rule, total=False) -> None:
  """ValueError for the first True of ``bad``: ``{name} {rule}, got {name}[index]={value}``
  (``total``: the values are per-example sums of ``name``)."""
  where = np.argwhere(bad)
  if where.size:
    i = tuple(int(a) for a in where[0])
    label = f"sum({name}[{i[0]}])" if total else f"{name}[{', '.join(map(str, i))}]"
    raise ValueError(f"{_NAME}: {name} {rule}, got {label}={int(values[i])}")


def _check_parents(parents) -> None:
  if isinstance(parents, jax.core.Tracer):
    return
  p = np.asarray(parents)
  earlier = np.arange(p.shape[1])[None]
  _first_bad(
    (p < -1) | (p >= earlier),
    "parents",
    p,
    "must each be -1 (a root) or an earlier node (parents before children)",
  )


def _check_node_ids(node_ids, M) -> None:
  if isinstance(node_ids, jax.core.Tracer):
    return
  ids = np.asarray(node_ids)
  _first_bad((ids < -1) | (ids >= M), "node_ids", ids, f"must each be -1 (padding) or in [0, {M})")
  for b, row in enumerate(ids):
    t = np.flatnonzero(row >= 0)
    real = row[t]
    # Nodes in order (ids never fall), and a node's tokens in one run (no padding inside).
    back = np.flatnonzero(real[1:] < real[:-1])
    gap = np.flatnonzero((real[1:] == real[:-1]) & (t[1:] != t[:-1] + 1))
    for where, why in (
      (back, "after a later node's token"),
      (gap, "after padding inside its node"),
    ):
      if where.size:
        i = int(t[where[0] + 1])
        raise ValueError(
          f"{_NAME}: node_ids must hold each node's tokens in one run, nodes in depth-first "
          f"order, got node_ids[{b}, {i}]={int(row[i])} {why}"
        )


def _check_depth_first(parents, nxt) -> None:
  """Each node must lie inside its parent's run of descendants."""
  if isinstance(parents, jax.core.Tracer) or isinstance(nxt, jax.core.Tracer):
    return
  p, n = np.asarray(parents), np.asarray(nxt)
  m = np.arange(p.shape[1])[None]
  ends = np.take_along_axis(n, np.maximum(p, 0), axis=1)
  bad = np.argwhere((p >= 0) & (m >= ends))
  if bad.size:
    b, i = (int(a) for a in bad[0])
    raise ValueError(
      f"{_NAME}: parents must number nodes in depth-first order (each subtree's nodes "
      f"consecutive), got parents[{b}, {i}]={int(p[b, i])}: node {i} comes after node "
      f"{int(p[b, i])}'s subtree ended at node {int(n[b, p[b, i]])}"
    )
