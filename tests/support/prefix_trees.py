"""Packed prefix trees and each root-to-leaf path alone (tests/attention/test_prefix_tree.py, and
its ring runs on 4 host devices in tests/parallel/test_prefix_tree_ring.py): random trees and
their paths written plainly, the mask, positions and predecessors by hand, and `Problem`, packed
rows of trees beside their paths run alone, with the float64 answer of every path alone."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import reference as ref

from jattn import masks as M

B, N, K, H = 2, 4, 2, 8
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# float32: small trees in small blocks (nodes of 1..7 tokens, blocks of 16 x 8), every path through
# many block boundaries. bfloat16: nodes up to 160 tokens (paths of 170 to 460) in blocks of
# 128 x 128 (smaller blocks only multiply the CPU's loop trips: 64 x 32 took 61 s on jax 0.12).
# The 16-bit rule's factors hold for rows of hundreds of keys, as in
# tests/properties/test_precision16.py (T = 2048); on paths of tens of tokens the gradients' error
# is up to 2x the rounding, alone and packed alike (measured: dense dq 1.85x both ways at 7-token
# nodes; 1.72x here, chunked 1.66x).
SIZES = {
  "float32": dict(T=128, max_len=7, blocks=(16, 8)),
  "bfloat16": dict(T=1536, max_len=160, blocks=(128, 128)),
}


def random_tree(rng, depth, branches, max_len, first=0):
  """(parents, lengths) of one tree in depth-first order, its nodes numbered from ``first``:
  the root has 2..``branches`` children; below it, down to ``depth``, the first child of each
  node has 2..3 children and the others 0 or 2; node lengths 1..``max_len``."""
  parents, lengths = [], []

  def add(parent, d, fan):
    m = first + len(parents)
    parents.append(parent)
    lengths.append(int(rng.integers(1, max_len + 1)))
    if d < depth:
      for c in range(fan):
        add(m, d + 1, int(rng.integers(2, 4)) if c == 0 else int(rng.choice([0, 0, 2])))

  add(-1, 0, int(rng.integers(2, branches + 1)))
  return parents, lengths


def random_rows(seed, B, T, depth, branches, max_len, trees=(1, 2)):
  """(parents (B, M), lengths (B, M)): each row a forest of ``trees`` random trees that fits T
  tokens, rows padded with empty nodes (-1 parents) to one M."""
  rng = np.random.default_rng(seed)
  rows = []
  while len(rows) < B:
    parents, lengths = [], []
    for _ in range(int(rng.integers(trees[0], trees[1] + 1))):
      p, n = random_tree(rng, depth, branches, max_len, first=len(parents))
      parents += p
      lengths += n
    if sum(lengths) <= T:
      rows.append((parents, lengths))
  M_ = max(len(p) for p, _ in rows)
  pad = lambda x, fill: x + [fill] * (M_ - len(x))
  return (
    np.array([pad(p, -1) for p, _ in rows], np.int32),
    np.array([pad(n, 0) for _, n in rows], np.int32),
  )


def paths(parents, lengths):
  """Every root-to-leaf path of a row as its packed token indices (nodes packed in order)."""
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  children = {m: [c for c in range(len(parents)) if parents[c] == m] for m in range(len(parents))}
  out = []
  for leaf in range(len(parents)):
    if lengths[leaf] == 0 or any(lengths[c] for c in children[leaf]):
      continue  # padding nodes, inner nodes
    chain, m = [], leaf
    while m >= 0:
      chain.append(m)
      m = parents[m]
    out.append(np.concatenate([np.arange(starts[m], starts[m] + lengths[m]) for m in chain[::-1]]))
  return out


def visible_by_hand(parents, lengths, T):
  """(T, T): token i sees j iff j <= i and j's node is i's or an ancestor of it."""
  vis = np.zeros((T, T), bool)
  for p in paths(parents, lengths):
    vis[np.ix_(p, p)] |= np.arange(len(p))[None, :] <= np.arange(len(p))[:, None]
  return vis


def positions_by_hand(parents, lengths, T):
  pos = np.zeros(T, np.int32)
  for p in paths(parents, lengths):
    pos[p] = np.arange(len(p))
  return pos


def previous_by_hand(parents, lengths, T):
  prev = np.full(T, -1, np.int32)
  for p in paths(parents, lengths):
    prev[p[1:]] = p[:-1]
  return prev


class Problem:
  """B packed rows of random trees (depth up to 3, 2 to 8 branches at the root), their
  root-to-leaf paths as one batch of alone sequences (padded to the longest, hidden by lengths),
  and the map between them: path a's token i is packed token ``idx[a, i]`` of row ``row[a]``,
  and ``owner[a, i]`` says whether path a is the first through it (the one whose output stands
  for it, and the only one given its cotangent: the alone runs together then have the packed
  rows' loss). GQA, a bias (B, N, T, T) and float32 sinks; inputs rounded to ``dtype``."""

  def __init__(self, seed, dtype, *, T, max_len=0, bias=True, tree=None, **_):
    self.T = T
    self.parents, self.lengths = tree or random_rows(seed, B, T, 3, 8, max_len)
    self.tree = M.prefix_tree(self.parents, lengths=self.lengths, size=T)
    rng = np.random.default_rng(seed + 100)
    x = lambda *s: ref.round_to_dtype(rng.standard_normal(s), dtype)
    self.q, self.k, self.v, self.do = x(B, T, N, H), x(B, T, K, H), x(B, T, K, H), x(B, T, N, H)
    self.bias = x(B, N, T, T) if bias else None
    self.sinks = np.asarray(rng.standard_normal(N), np.float32)
    runs = [(b, p) for b in range(B) for p in paths(self.parents[b], self.lengths[b])]
    self.L = max(len(p) for _, p in runs)
    A = len(runs)
    self.row = np.array([b for b, _ in runs])
    self.len = np.array([len(p) for _, p in runs], np.int32)
    self.idx = np.zeros((A, self.L), int)
    self.owner = np.zeros((A, self.L), bool)
    seen = np.zeros((B, T), bool)
    for a, (b, p) in enumerate(runs):
      self.idx[a, : len(p)] = p
      self.owner[a, : len(p)] = ~seen[b, p]
      seen[b, p] = True

  def alone(self, x):
    """A (B, T, ...) array's tokens per path, (paths, L, ...); padding rows read token 0."""
    return np.stack([np.take(x[b], self.idx[a], axis=0) for a, b in enumerate(self.row)])

  def alone_bias(self):
    return np.stack([self.bias[b][:, i][:, :, i] for b, i in zip(self.row, self.idx)])

  def alone_do(self):
    return self.alone(self.do) * self.owner[:, :, None, None]

  def packed_out(self, out):
    """The alone runs' outputs in the packed rows, each token's from its owner."""
    res = np.zeros((B, self.T) + out.shape[2:])
    for a, b in enumerate(self.row):
      own = self.owner[a]
      res[b, self.idx[a][own]] = np.asarray(out[a], np.float64)[own]
    return res

  def packed(self, out, grads):
    """The alone runs' results in the packed rows: outputs from each token's owner, gradients
    summed over the paths through it."""
    res = dict(out=self.packed_out(out), dsinks=np.asarray(grads["dsinks"], np.float64))
    for name in ("dq", "dk", "dv"):
      g = np.asarray(grads[name], np.float64)
      res[name] = np.zeros((B, self.T) + g.shape[2:])
      for a, b in enumerate(self.row):
        live = np.arange(self.L) < self.len[a]
        np.add.at(res[name][b], self.idx[a][live], g[a][live])
    if grads.get("dbias") is not None:
      res["dbias"] = np.zeros((B, N, self.T, self.T))
      for a, b in enumerate(self.row):
        self.add_bias_grad(res["dbias"][b], a, np.asarray(grads["dbias"][a], np.float64))
    return res

  def add_bias_grad(self, dbias, a, g):
    """Add path a's bias gradient ``g`` (N, >= n, >= n) into its packed row's ``dbias`` (N, T,
    T), run of consecutive tokens by run (its nodes): slices, not a fancy index of n x n."""
    i = self.idx[a][: self.len[a]]
    cut = np.flatnonzero(np.diff(i) != 1) + 1
    runs = [(int(r[0]), len(r), int(o)) for r, o in zip(np.split(i, cut), np.r_[0, cut])]
    for t0, n0, o0 in runs:
      for t1, n1, o1 in runs:
        dbias[:, t0 : t0 + n0, t1 : t1 + n1] += g[:, o0 : o0 + n0, o1 : o1 + n1]

  def float64(self):
    """The float64 answer: every path alone (NumPy, reference.attention and .grads, path by
    path at its own length), put back in the packed rows."""
    outs, grads = [], {k: [] for k in ("dq", "dk", "dv", "dbias")}
    dsinks = np.zeros(N)
    for a, b in enumerate(self.row):
      i = self.idx[a][: self.len[a]]
      n = len(i)
      vis = ref.visible_mask(1, N, n, n, causal="top_left")
      bias = None if self.bias is None else self.bias[b][:, i][:, :, i][None]
      out, _, cache = ref.attention(
        self.q[b, i][None], self.k[b, i][None], self.v[b, i][None], visible=vis, bias=bias,
        sinks=self.sinks,
      )  # fmt: skip
      do = (self.do[b, i] * self.owner[a, :n, None, None])[None]
      dq, dk, dv, dbias, ds = ref.grads(cache, do, None if bias is None else bias.shape)
      pad = lambda x: np.pad(x[0], [(0, self.L - n)] + [(0, 0)] * (x.ndim - 2))
      outs.append(pad(out))
      for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        grads[name].append(pad(g))
      if dbias is not None:
        grads["dbias"].append(dbias[0])  # (N, n, n): add_bias_grad reads its n x n
      dsinks += ds
    stacked = {k: np.stack(v) if v and k != "dbias" else v or None for k, v in grads.items()}
    return self.packed(np.stack(outs), dict(stacked, dsinks=dsinks))


@functools.cache
def problem(dtype, bias):
  """The problem and its float64 answer, once for every implementation."""
  pb = Problem(1, DTYPES[dtype], bias=bias, **SIZES[dtype])
  return pb, pb.float64()
