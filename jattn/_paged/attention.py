"""Attention against a paged KV cache: a pool of fixed-size pages and a page table per sequence.

Serving systems keep each sequence's keys and values in pages of a shared pool (vLLM,
FlashAttention's ``block_table``): sequence b's tokens 0 .. kv_lengths[b] - 1 live in pages
page_table[b, 0], page_table[b, 1], ... in order. Queries are the new tokens of each sequence,
bottom-right aligned: the last query of sequence b sits at position kv_lengths[b] - 1. They come
padded, (B, T, N, H), or ragged, (total, N, H) with offsets ``query_start`` (B + 1,), so prefill
chunks and single decode tokens of different sequences share one call (continuous batching).

The kernel never builds a contiguous cache. Query rows are cut into *tiles* of at most ``tq``
rows of one sequence (a decoding step: one tile per sequence); each step gathers, for every tile,
the pages of its sequence's next key block straight from the pool (int8 / float8 pages
converted to float32 there, their scales applied to scores and probabilities) and folds the
block into the tile's running softmax. It is the chunked kernels' arithmetic on gathered blocks:
their tile config (`_tile.Config`: scale and soft cap through `_tile.scale_cap_bias`), the
positions mask's rule (`masks.visible_by_position`), the softmax algebra of `jattn._softmax`
(start, update, lanes merged, sinks joined, normalised), all through `jattn._paged_fold`, which
the Pallas kernels share. Causality, windows and the cache's fill level are measured in
positions. A tree of draft tokens (``new_token_mask``, speculative decoding) places each new
row and its key at prefix + depth, and the walk hides the new keys the mask hides (`_tree_rows`,
`_tree_keys`); the Pallas kernels take no mask. Pages are token-major (NHD: (page_size, K, H)) or
head-major (HND: (K, page_size, H)); a block reaches the matmuls as *pieces* of keys batched
with the tile and the head (`_block`). On the CPU one lane walks the blocks; on GPU and TPU
(chosen where the program is lowered) the blocks are dealt over up to `SPLIT_KV_PARTS` lanes
side by side and merged by log-sum-exp (split-KV). Block sizes: `PAGED_BLOCK_KV`.
Absorbed MLA (``value_pages=None, value_head_dim=Hv``) has no value pool: each block's values
are its gathered keys' first Hv features (`_latent_values`), so the latent pool is read once.

Shapes: B sequences, T new tokens each (or ``total`` ragged rows), N query heads, K key/value
heads, G = N // K, H query/key head size, Hv value head size, P pages of ``page_size`` tokens.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _lowering, _softmax, _tile, _validation
from jattn._paged import fold as _paged_fold
from jattn._paged import metadata as _page_metadata
from jattn._paged import pallas_gpu as _paged_gpu
from jattn._paged import pallas_tpu as _paged_tpu
from jattn._paged import pool as _pool
from jattn._chunked.plan import SPLIT_KV_PARTS
from jattn._tile import DEFAULT_BLOCK_KV
from jattn._validation import concrete

# Keys per step of the paged walk: whole pages adding up to about this many (a page larger than
# it is cut). On the CPU a block read from the pool stays in the core's cache until the matmuls
# use it (128 keys: measured, docs/benchmarks.md "Tuning constants"); elsewhere the chunked
# kernels' key block. Its split-KV parts on GPU and TPU are the chunked kernels' decoding split.
PAGED_BLOCK_KV = {"cpu": 128, "default": DEFAULT_BLOCK_KV}

# None: jattn's Pallas kernel on a TPU or NVIDIA GPU where it takes the call, the XLA walk
# elsewhere; "chunked": the XLA walk everywhere; "pallas": the kernel (`jattn._paged_tpu`,
# `jattn._paged_gpu`) or an error naming why not.
IMPLEMENTATIONS = (None, "chunked", "pallas")
# HND pages at least this long are multiplied page by page; shorter ones are first laid side by
# side per head (a matmul of a few keys costs more than the copy).
PAGE_MATMUL_MIN = 64


class _Static(NamedTuple):
  """What the kernel is planned from (hashable)."""

  # The tile config of the chunked kernels (B sequences, T = rows, S = the page table's reach):
  # the logit scale and soft cap apply through `_tile.scale_cap_bias`, as in every other walk.
  cfg: _tile.Config
  Hv: int
  page_size: int
  layout: str  # "NHD" | "HND" | "combined"
  pages_per_block: int
  max_pages: int
  tq: int  # query rows per tile
  tiles: int  # an upper bound on the tiles (static)
  ragged: bool
  rows: int  # T (padded) or total (ragged)
  causal: bool
  window: tuple | None
  k_scale: str | None  # "tensor" | "head" | "token" | None (pages not quantised)
  v_scale: str | None
  dtype: Any  # the query's (and output's)
  # Each pool page read as ``sub`` pages of page_size keys (page_size and max_pages count
  # these): a page longer than a block is cut so that a step still reads one block.
  sub: int = 1
  # Pages become float32 before the matmuls (the CPU's program: XLA's CPU matmuls of 16-bit
  # floats are several times slower than float32 ones, and float8 converts run in software).
  upcast: bool = False
  # One of IMPLEMENTATIONS (the kernel or the walk is chosen where the program is lowered).
  implementation: str | None = None
  # new_token_mask's columns (T padded, T_max ragged): the most new rows a sequence may have
  # and what a tree is planned for; 0 without a mask (positions as usual).
  tree: int = 0
  # Absorbed MLA: no value pool, the values are the keys' first Hv features (read with them).
  latent: bool = False

  @property
  def B(self) -> int:
    return self.cfg.B

  @property
  def N(self) -> int:
    return self.cfg.N

  @property
  def K(self) -> int:
    return self.cfg.K

  @property
  def G(self) -> int:
    return self.cfg.G

  @property
  def H(self) -> int:
    return self.cfg.H

  @property
  def token_major(self) -> bool:
    return self.layout != "HND"

  @property
  def block(self) -> int:
    return self.pages_per_block * self.page_size

  @property
  def blocks(self) -> int:
    return -(-self.max_pages // self.pages_per_block)

  @property
  def pieces(self) -> int:
    """A block's keys go to the matmuls as ``pieces`` runs of ``block // pieces`` keys."""
    per_page = self.layout == "HND" and self.page_size >= PAGE_MATMUL_MIN
    return self.pages_per_block if per_page else 1

  def with_block(self, keys: int) -> _Static:
    """Planned for blocks of about ``keys`` keys: whole pages, or a page cut into pieces of
    ``keys`` when it is longer and they divide it."""
    size, count = self.page_size * self.sub, self.max_pages // self.sub  # the pool's pages
    sub = size // keys if size > keys and size % keys == 0 else 1
    return self._replace(
      page_size=size // sub,
      max_pages=count * sub,
      sub=sub,
      pages_per_block=min(max(1, keys * sub // size), count * sub),
    )


class _Arrays(NamedTuple):
  """A call's arrays, checked: the query, the pool, the ragged rows' offsets and the sinks."""

  query: Any
  pool: _pool.Pool
  query_start: Any
  sinks: Any
  new_token_mask: Any = None


class _Options(NamedTuple):
  """A call's options as passed (checked by `_check`)."""

  scale: Any
  is_causal: Any
  local_window_size: Any
  logits_soft_cap: Any
  kv_layout: Any
  implementation: Any


def paged_attention(
  query,
  key_pages,
  value_pages,
  page_table,
  kv_lengths,
  *,
  query_start=None,
  scale=None,
  is_causal=True,
  local_window_size=None,
  logits_soft_cap=None,
  sinks=None,
  k_scale=None,
  v_scale=None,
  kv_layout="NHD",
  value_head_dim=None,
  page_size=None,
  num_kv_heads=None,
  on_invalid="nan",
  implementation=None,
  return_residual=False,
  new_token_mask=None,
):
  """Attention of new tokens against a paged KV cache (forward only; see the module docstring).

  Args:
    query: (B, T, N, H) -- T new tokens per sequence, query t of sequence b at position
      kv_lengths[b] - T + t -- or, with ``query_start``, ragged (total, N, H).
    key_pages: (P, page_size, K, H) pool of key pages (``kv_layout="HND"``: (P, K, page_size,
      H)): float (the query's dtype), or int8 / float8_e4m3fn / float8_e5m2 with ``k_scale``.
    value_pages: (P, page_size, K, Hv) (HND: (P, K, page_size, Hv)), likewise with ``v_scale``;
      or None with ``value_head_dim`` (absorbed MLA, below).
    page_table: int (B, max_pages): sequence b's pages in order, each in [0, P); entries past
      its last page are ignored (any value, including out of range).
    kv_lengths: int (B,): the valid cached tokens of each sequence, the new ones included, in
      [0, max_pages * page_size].
    query_start: int (B + 1,) offsets of a ragged query (FlashAttention varlen's
      ``cu_seqlens_q``): sequence b's queries are rows query_start[b] .. query_start[b+1] - 1,
      the last at position kv_lengths[b] - 1. Starts at 0, never decreases, ends at most at
      ``total``; a sequence has at most kv_lengths[b] rows. Rows past query_start[B] belong to
      no sequence: their output is 0 and their log-sum-exp that of a row that sees nothing.
    scale: logit scale (default 1 / sqrt(H)).
    is_causal: a query sees keys at its position or before (positions, not array indices).
    local_window_size: ``w`` or ``(left, right)`` in positions, as in dot_product_attention.
    logits_soft_cap: ``cap * tanh(logits / cap)``.
    sinks: (N,) one extra logit per head with no value.
    k_scale, v_scale: dequantisation scales of quantised pages, broadcasting against the pages
      without their last axis: ``()`` per tensor, ``(K,)`` per head, ``(P, page_size, K)`` per
      token and head (HND: ``(P, K, page_size)``); applied per tile in float32.
    kv_layout: "NHD" (token-major pages, vLLM's and FlashAttention's), "HND" (head-major
      pages, FlashInfer's other layout: each head's keys of a page contiguous; faster on the
      CPU, see docs/benchmarks.md) or "combined" (one pool (P, page_size, 2K, H), key head k
      at 2k and its values at 2k + 1, as vLLM's TPU cache; ``value_pages=None``).
    value_head_dim: Hv with ``value_pages=None``: absorbed MLA (DeepSeek), one *latent* pool
      whose keys are also the values, these being their first Hv features (the compressed
      latent c of a key [c, k_rope]; H = Hc + Hr, Hv = Hc). The pool is read once per block;
      quantised latent pages take ``k_scale`` only (the values share it: ``v_scale`` must be
      None). With ``value_pages`` given it only cross-checks their last size. Not with
      ``kv_layout="combined"`` (a pool of interleaved key and value heads).
    page_size, num_kv_heads: optional cross-checks of the pools' shapes under ``kv_layout``
      (a token-major pool read as head-major has the right rank and may have fitting sizes).
    on_invalid: what a sequence whose metadata breaks the rules above gets when the metadata
      is traced (concrete metadata -- eager calls, NumPy arrays under ``jit`` -- raises a
      ValueError naming it first): "nan" (its rows' output and log-sum-exp are NaN, no page of
      it is read, every other sequence is exact) or "checkify" (the same, and an error through
      `jax.experimental.checkify`: wrap the caller in ``checkify.checkify``).
    implementation: None (jattn's Pallas kernel on a TPU, and on an NVIDIA GPU where Triton
      takes the sizes; the XLA walk elsewhere; chosen where the program is lowered), "chunked"
      (the XLA walk everywhere) or "pallas" (the kernel; on a CPU only under Pallas's TPU
      interpret mode).
    return_residual: also return the log-sum-exp per query row and head, (B, T, N) / (total, N).
    new_token_mask: bool, which of its sequence's new rows each new row sees: a tree of draft
      tokens verified in one step (speculative decoding; `jattn.masks.tree_mask` builds it
      from parent indices). Padded: (B, T, T), row i of sequence b sees its new row c iff
      mask[b, i, c]. Ragged: (total, T_max), row r (sequence b's i-th new row) sees b's c-th new
      row iff mask[r, c]; columns from b's count of rows on are ignored, and a sequence may
      have at most T_max rows. Sequence b's n new tokens fill cache slots kv_lengths[b] - n ..
      kv_lengths[b] - 1 in the order of its rows, but a new row's *position* is prefix + (the
      new rows it sees) - 1, prefix = kv_lengths[b] - n: prefix + depth in a tree. New keys
      sit at their rows' positions, cached keys (slots below the prefix) at their slots. A
      row sees a cached key as causality and the window allow in these positions, and a new
      key iff the mask says so and causality and the window allow it: each root-to-leaf path
      is attended exactly as if decoded alone, token after token. Every row must see itself
      (mask[b, i, i] / mask[r, i]): known values are checked (ValueError); traced ones break
      the sequence's metadata like any other rule (``on_invalid``). With ``is_causal=False``
      the mask still hides new keys and a window is still measured in these positions.
      The Pallas kernels take no mask: implementation=None runs the XLA walk, "pallas" raises.

  Returns:
    (B, T, N, Hv) or (total, N, Hv) in the query's dtype; a sequence with no cached tokens, or a
    query that sees none, gives zeros.
  """
  _pool.check_layout(key_pages, value_pages, kv_layout, page_size, num_kv_heads)
  latent = _pool.check_value_head_dim(key_pages, value_pages, kv_layout, value_head_dim, v_scale)
  if on_invalid not in _page_metadata.ON_INVALID:
    raise ValueError(
      f"on_invalid must be one of {_page_metadata.ON_INVALID}, got on_invalid={on_invalid!r}"
    )
  st, arrays = _check(
    _Arrays(
      query,
      _pool.Pool(key_pages, value_pages, page_table, kv_lengths, k_scale, v_scale),
      query_start,
      sinks,
      new_token_mask,
    ),
    _Options(scale, is_causal, local_window_size, logits_soft_cap, kv_layout, implementation),
    value_head_dim if latent else None,
  )
  if on_invalid == "checkify":
    pool = arrays.pool
    _page_metadata.checkify_faults(
      _page_metadata.faults(
        jnp, _geometry(st, pool.key_pages), pool.page_table, pool.kv_lengths, arrays.query_start
      )
    )
    if st.tree:
      _checkify_tree(st, arrays)
  if concrete(st.cfg.B) and st.cfg.B * st.rows == 0:
    out, lse = _nothing_to_attend(st, arrays.query)
  else:
    out, lse = _attend(st, arrays)
  return (out, lse) if return_residual else out


def _nothing_to_attend(st: _Static, query):
  """No sequences (B = 0) or no query rows: every row there is (ragged rows past
  query_start[0] = 0) belongs to no sequence, output 0 and log-sum-exp NEG, as documented."""
  N = st.cfg.K * st.cfg.G
  lead = query.shape[:-2]
  return (
    jnp.zeros(lead + (N, st.Hv), st.dtype),
    jnp.full(lead + (N,), _softmax.NEG, _tile.stat_dtype(st.dtype)),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st: _Static, arrays: _Arrays):
  return _jitted(st, arrays)


def _attend_fwd(st, arrays):
  return _attend(st, arrays), None


def _attend_bwd(st, res, ct):
  raise NotImplementedError(
    "paged_attention is forward only (serving): its gradient is not implemented; for "
    "training use dot_product_attention on contiguous keys and values"
  )


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def _jitted(st: _Static, arrays: _Arrays):
  pool, query_start, sinks = arrays.pool, arrays.query_start, arrays.sinks
  # A sequence whose metadata breaks the rules runs as an empty one and comes back NaN.
  bad = (
    _page_metadata.faults(
      jnp, _geometry(st, pool.key_pages), pool.page_table, pool.kv_lengths, query_start
    )
    != _page_metadata.OK
  )
  if st.tree:
    bad = bad | _tree_faults(jnp, st, arrays.new_token_mask, query_start)
  pool = pool._replace(kv_lengths=jnp.where(bad, 0, pool.kv_lengths.astype(jnp.int32)))
  tiles = _tiles(st, query_start, pool.kv_lengths, bad, arrays.new_token_mask)
  q = _gather_queries(st, arrays.query, tiles)  # (M, K, G * tq, H)
  m, l, acc = _lowering.by_platform(_walks(st, q, tiles, pool))
  if sinks is not None:
    sink = jnp.repeat(sinks.astype(jnp.float32).reshape(1, st.K, st.G, 1), st.tq, axis=-1)
    m, l, acc = _softmax.join_sink(m, l, acc, sink.reshape(1, st.K, st.G * st.tq))
  out = _softmax.normalize(acc, l, m, 0.0).astype(st.dtype)  # (M, K, G * tq, Hv)
  lse = _softmax.lse(m, l)
  out = _scatter_rows(st, out, tiles, 0.0)
  lse = _scatter_rows(st, lse[..., None], tiles, _softmax.NEG)[..., 0]
  nan = _faulty_rows(st, bad, query_start)
  return (
    jnp.where(nan[..., None, None], jnp.asarray(jnp.nan, out.dtype), out),
    jnp.where(nan[..., None], jnp.asarray(jnp.nan, lse.dtype), lse),
  )


def _walks(st: _Static, q, tiles: _Tiles, pool: _pool.Pool):
  """{platform: the walk that returns every tile's (m, l, acc)}: the XLA walk (one lane on the
  CPU, split-KV lanes on accelerators) and, where the call asks for it or leaves the choice,
  jattn's Pallas kernels on a TPU and an NVIDIA GPU (or anywhere in their interpret modes)."""
  run: dict[str, Any] = {}
  for platform in ("cpu", "default"):
    sp = st.with_block(PAGED_BLOCK_KV[platform])._replace(upcast=platform == "cpu")
    lanes = 1 if platform == "cpu" else min(SPLIT_KV_PARTS, sp.blocks)
    run[platform] = functools.partial(_walk, sp, lanes, q, tiles, pool)
  if st.implementation == "chunked":
    return run
  kernels: dict[str, Any] = {}  # a kernel, or why it cannot take the call
  for platform, module, why in (
    ("tpu", _paged_tpu, None),
    ("cuda", _paged_gpu, _paged_gpu.supports(st)),
  ):
    why = _no_grid(st) or _no_tree(st) or _no_latent(st) or why
    kernels[platform] = (
      why
      if why is not None
      else functools.partial(module.walk, st, q, tiles, pool, pool.kv_lengths[tiles.seq])
    )
  interpreted = (
    "tpu" if _lowering.tpu_interpreting() else "cuda" if _lowering.gpu_interpreting() else None
  )
  if interpreted is not None:
    kernel = kernels[interpreted]
    if not isinstance(kernel, str):
      return {
        "default": kernel if interpreted == "tpu" else functools.partial(kernel, interpret=True)
      }
    if st.implementation == "pallas":  # in interpret mode, as on the device: say why not
      raise NotImplementedError(f"implementation='pallas' on {interpreted} cannot take {kernel}")
  if st.implementation == "pallas":
    M, R = q.shape[0], st.G * st.tq
    like = (jax.ShapeDtypeStruct((M, st.K, R), jnp.float32),) * 2 + (
      jax.ShapeDtypeStruct((M, st.K, R, st.Hv), jnp.float32),
    )
    message = (
      "paged_attention(implementation='pallas') runs jattn's Pallas kernels on a TPU "
      "or an NVIDIA GPU: this program is lowered for {platform}. On a CPU, run it "
      "inside jax.experimental.pallas.tpu.force_tpu_interpret_mode() (slow; for "
      "tests), or use implementation=None (the kernels where they run, the XLA walk "
      "elsewhere)"
    )
    fail = lambda why: lambda: _lowering.unavailable(why, like, q)
    run = {"default": fail(message)}
    kernels = {
      p: fail(f"implementation='pallas' on {p} cannot take {k}") if isinstance(k, str) else k
      for p, k in kernels.items()
    }
  return dict(run, **{p: k for p, k in kernels.items() if not isinstance(k, str)})


def _no_latent(st: _Static) -> str | None:
  """Why the Pallas kernels cannot take an absorbed-MLA call (they read a value pool), or None."""
  if not st.latent:
    return None
  return (
    f"absorbed MLA (value_pages=None, value_head_dim={st.Hv}): the Pallas kernels read a "
    "separate value pool; the XLA walk reads the latent pool once"
  )


def _no_grid(st: _Static) -> str | None:
  """Why no Pallas kernel can take the call (a grid is planned from known sizes), or None."""
  if concrete(st.B):
    return None
  return f"a symbolic number of sequences B={st.B}: a Pallas grid is planned from known sizes"


def _no_tree(st: _Static) -> str | None:
  """Why the Pallas kernels cannot take the call's new_token_mask, or None (no mask)."""
  if not st.tree:
    return None
  return (
    "new_token_mask (a tree of new tokens): the Pallas kernels see keys by position only; "
    "implementation=None or 'chunked' runs the XLA walk, which takes it"
  )


def _geometry(st: _Static, key_pages) -> _page_metadata.Geometry:
  return _page_metadata.Geometry(key_pages.shape[0], st.page_size * st.sub, st.rows, st.ragged)


def _faulty_rows(st: _Static, bad, query_start):
  """(B, T) or (total,) bool: the rows of faulty sequences (in the ragged form, those no
  sound sequence also claims: offsets that overlap are the faulty sequence's error)."""
  if not st.ragged:
    return jnp.broadcast_to(bad[:, None], (st.B, st.rows))
  qs = query_start.astype(jnp.int32)
  r = jnp.arange(st.rows, dtype=jnp.int32)[:, None]
  mine = (r >= qs[None, :-1]) & (r < qs[None, 1:])  # (total, B)
  return (mine & bad[None, :]).any(axis=1) & ~(mine & ~bad[None, :]).any(axis=1)


# --------------------------------------------------------------------------------------------
# Tiles: query rows of one sequence each.
# --------------------------------------------------------------------------------------------


class _Tiles(NamedTuple):
  seq: Any  # (M,) the tile's sequence (clipped into range; see ``rows``)
  rows: Any  # (M, tq) the flat query row of each tile row, or -1 (none)
  pos: Any  # (M, tq) the position of each tile row (meaningless where rows is -1)
  lo: Any  # (M,) the first key position the tile needs
  hi: Any  # (M,) one past the last
  # With a new_token_mask (a tree; None without), C = its columns:
  sees: Any = None  # (M, tq, C) which new rows of its sequence each tile row sees
  new_pos: Any = None  # (M, C) the positions of its sequence's new keys (prefix + depth)
  first_new: Any = None  # (M,) the slot of its sequence's first new key (the prefix)


def _tiles(st: _Static, query_start, kv_lengths, bad, new_token_mask=None) -> _Tiles:
  """Cut each sequence's query rows into tiles of at most tq rows (at run time: the offsets are
  data). A padded query has query_start = (0, T, 2T, ...) and one tile per sequence; a faulty
  sequence (``bad``) has none. With a new_token_mask, rows sit at their depths in the tree."""
  kv_lengths = kv_lengths.astype(jnp.int32)
  if query_start is None:
    query_start = jnp.arange(st.B + 1, dtype=jnp.int32) * st.rows
  qs = query_start.astype(jnp.int32)
  counts = jnp.where(bad, 0, qs[1:] - qs[:-1])  # (B,) queries per sequence
  per_seq = (counts + st.tq - 1) // st.tq
  # Tiles of sequences 0 .. b, a running sum written as a triangular one: jaxlib 0.12's CPU
  # compiler aborts on the cumsum lowered for cuda (the accelerators' program run here).
  b = jnp.arange(st.B, dtype=jnp.int32)
  ends = jnp.where(b[:, None] >= b[None, :], per_seq[None, :], 0).sum(axis=1, dtype=jnp.int32)
  m = jnp.arange(st.tiles, dtype=jnp.int32)
  # The tile's sequence: how many sequences' tiles end at or before it (a count, not a
  # searchsorted, so that B may be a symbolic dimension of an exported program).
  seq = jnp.minimum((ends[None, :] <= m[:, None]).sum(axis=1, dtype=jnp.int32), st.B - 1)
  within = m - (ends[seq] - per_seq[seq])  # the tile's index within its sequence
  offset = within[:, None] * st.tq + jnp.arange(st.tq, dtype=jnp.int32)[None, :]
  valid = (m < ends[-1])[:, None] & (offset < counts[seq][:, None])
  rows = jnp.where(valid, qs[seq][:, None] + offset, -1)
  # Bottom-right: the sequence's last query sits at its last cached position.
  pos = kv_lengths[seq][:, None] - counts[seq][:, None] + offset
  first_new = kv_lengths[seq] - counts[seq]
  tree = {}
  if st.tree:  # a tree's rows sit at prefix + depth, not at their slots
    sees, new_pos = _tree_rows(st, new_token_mask, qs[seq], counts[seq], first_new)
    at = jnp.clip(offset, 0, st.tree - 1)  # (M, tq): the tile rows among the sequence's
    pos = jnp.take_along_axis(new_pos, at, axis=1)
    tree = dict(sees=jnp.take_along_axis(sees, at[..., None], 1), new_pos=new_pos)
  lo, hi = _key_range(
    st, jnp.where(valid, pos, jnp.int32(2**30)), jnp.where(valid, pos, -1), kv_lengths[seq]
  )
  if st.tree:
    # A tree's new keys lie at slots past their positions (prefix + i, not prefix + depth): a
    # tile with rows reads every one of them; the cached blocks are still cut by the window.
    some = valid.any(axis=1)
    lo = jnp.where(some, jnp.minimum(lo, first_new), lo)
    hi = jnp.where(some, kv_lengths[seq], hi)
    tree["first_new"] = first_new
  return _Tiles(seq, rows, pos, lo, hi, **tree)


def _tree_rows(st: _Static, new_token_mask, start, count, first_new):
  """A tree's rows per tile, of the tile's sequence (``start`` its first row, ``count`` its new
  rows and ``first_new`` its prefix, each (M,)): (sees (M, C, C), which of the sequence's new
  rows each sees, columns past its count cleared; new_pos (M, C), each new row's position,
  prefix + the rows it sees - 1)."""
  C = st.tree
  flat = new_token_mask.reshape(-1, C)  # (B * T | total, C)
  a = jnp.arange(C, dtype=jnp.int32)
  ok = a[None, :] < count[:, None]  # (M, C)
  sees = jnp.take(flat, jnp.clip(start[:, None] + a[None, :], 0, flat.shape[0] - 1), axis=0)
  sees = sees & ok[:, :, None] & ok[:, None, :]
  return sees, first_new[:, None] + sees.sum(axis=-1, dtype=jnp.int32) - 1


def _key_range(st: _Static, pos_min, pos_max, kv_len):
  """[lo, hi) key positions a tile needs: keys below its sequence's length, and within its
  rows' causal and window reach."""
  lo_key = jnp.zeros_like(kv_len)
  hi_key = kv_len
  if st.window is not None and st.window[0] is not None:
    lo_key = jnp.maximum(lo_key, pos_min.min(axis=1) - st.window[0])
  reach = None
  if st.causal:
    reach = 0
  if st.window is not None and st.window[1] is not None:
    reach = st.window[1] if reach is None else min(reach, st.window[1])
  if reach is not None:
    hi_key = jnp.minimum(hi_key, pos_max.max(axis=1) + reach + 1)
  return lo_key, jnp.maximum(hi_key, lo_key)


def _block_range(st: _Static, tiles: _Tiles):
  """[first, last) key blocks each tile needs."""
  first = jnp.clip(tiles.lo // st.block, 0, st.blocks)
  last = jnp.clip((tiles.hi + st.block - 1) // st.block, 0, st.blocks)
  return first, jnp.maximum(last, first)


def _gather_queries(st: _Static, query, tiles: _Tiles):
  """(M, K, G * tq, H): each tile's query rows (zeros for rows it does not have), the G heads of
  a group stacked as rows (row g * tq + t is query head k * G + g of tile row t)."""
  flat = query.reshape((-1,) + query.shape[-2:])  # (B * T | total, N, H)
  q = jnp.take(flat, jnp.maximum(tiles.rows, 0), axis=0)  # (M, tq, N, H)
  q = jnp.where((tiles.rows >= 0)[..., None, None], q, jnp.zeros((), q.dtype))
  M = q.shape[0]
  q = jnp.transpose(q.reshape(M, st.tq, st.K, st.G, st.H), (0, 2, 3, 1, 4))
  return q.reshape(M, st.K, st.G * st.tq, st.H)


def _scatter_rows(st: _Static, x, tiles: _Tiles, fill):
  """Tile results (M, K, G * tq, X) back to the query's rows: (B, T, N, X) or (total, N, X);
  ``fill`` where no tile row lands."""
  M, X = x.shape[0], x.shape[-1]
  x = jnp.transpose(x.reshape(M, st.K, st.G, st.tq, X), (0, 3, 1, 2, 4))
  x = x.reshape(M * st.tq, st.N, X)
  n = st.B * st.rows if not st.ragged else st.rows
  rows = tiles.rows.reshape(-1)
  # Each row sits in one tile; tile rows holding none write past the end, each at its own place:
  # indices without repeats, a scatter without atomics on a GPU.
  rows = jnp.where(rows >= 0, rows, n + jnp.arange(rows.shape[0], dtype=rows.dtype))
  out = jnp.full((n, st.N, X), fill, x.dtype).at[rows].set(x, mode="drop", unique_indices=True)
  return out.reshape(st.B, st.rows, st.N, X) if not st.ragged else out


# --------------------------------------------------------------------------------------------
# The walk over key blocks.
# --------------------------------------------------------------------------------------------


def _walk(st: _Static, lanes: int, q, tiles: _Tiles, pool: _pool.Pool):
  """Every tile's running softmax over its key blocks: (m, l, acc) of (M, K, G * tq[, Hv]).

  ``lanes`` lanes side by side, lane p taking blocks p, p + lanes, ... of every tile; one lane
  walks from the first block any tile needs to the last (bounds known at run time), several
  walk ceil(blocks / lanes) steps each (a static count) and are merged by log-sum-exp."""
  M = q.shape[0]
  like = jnp.zeros((M, st.K, st.G * st.tq), jnp.float32)
  m0, l0 = _softmax.start(like)
  acc0 = jnp.zeros((M, st.K, st.G * st.tq, st.Hv), jnp.float32)
  kv_len = pool.kv_lengths.astype(jnp.int32)[tiles.seq]
  first, last = _block_range(st, tiles)
  step = functools.partial(_block, st, q, tiles, (first, last), kv_len, pool)
  if lanes == 1:
    # int32 both (under jax_enable_x64 the range's arithmetic may come out int64).
    lo, hi = first.min().astype(jnp.int32), last.max().astype(jnp.int32)
    return jax.lax.fori_loop(lo, jnp.maximum(hi, lo), step, (m0, l0, acc0))
  steps = -(-st.blocks // lanes)

  def lane(p):
    body = lambda t, carry: step(t * lanes + p, carry)
    return jax.lax.fori_loop(0, steps, body, (m0, l0, acc0))

  m, l, acc = jax.vmap(lane)(jnp.arange(lanes, dtype=jnp.int32))
  return _softmax.merge_lanes(m, l, acc)


def _block(st: _Static, q, tiles: _Tiles, needed, kv_len, pool: _pool.Pool, j, carry):
  """Fold key block j of every tile's sequence into the tiles' running (m, l, acc).

  The block reaches the matmuls as (M, c, K, bk / c, X): c pieces of keys per head, batched
  with the tile and the head, so that no head-major pool is relaid out. Quantised pages are
  only converted; their scales (one per key and head, or coarser) multiply the scores and the
  probabilities, which is the same sum: q . (k * s) = s * (q . k)."""
  m, l, acc = carry
  ids = _page_ids(st, pool.page_table, tiles.seq, j, pool.key_pages.shape[0])
  k, ks = _read(st, pool.key_pages, ids, pool.k_scale, st.k_scale, q.dtype, heads=0)
  vis = _visible(st, tiles, kv_len, j)  # (M, 1, G * tq, bk)
  live = (j >= needed[0]) & (j < needed[1])
  vis = vis & live[:, None, None, None]
  # Hidden keys' values are zeroed: a masked weight is an exact 0, but 0 * NaN is NaN (a page
  # of garbage, past a sequence's last token, must not leak).
  M, c = q.shape[0], st.pieces
  keep = vis.any(axis=(1, 2)).reshape(M, c, 1, st.block // c, 1)
  if st.latent:
    v, vs = _latent_values(st, k, ks, keep)
  else:
    v, vs = _read(st, pool.value_pages, ids, pool.v_scale, st.v_scale, q.dtype, keep, heads=1)
  qp = jnp.broadcast_to(q[:, None].astype(k.dtype), (M, c) + q.shape[1:])
  s = jnp.einsum("mckxh,mckrh->mckrx", k, qp, preferred_element_type=jnp.float32)
  # (M, c, K, R, bk / c): the softmax runs on the pieces as they come
  s = _paged_fold.scores(st, s, ks, _pieces(st, vis))
  m_new, p, corr, l = _softmax.update(m, l, s, key_axes=(1, 4))
  if vs is not None:
    p = p * vs
  # Piece by piece, then summed: one contraction over (c, x) would relay V out per head.
  pv = jnp.einsum("mckrx,mckxh->mckrh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  pv = _softmax.ordered_sum(pv, 1)
  return m_new, l, acc * corr[..., None] + pv


def _latent_values(st: _Static, k, ks, keep):
  """Absorbed MLA's values and their scale from the block's keys (M, c, K, bk / c, H) as read:
  their first Hv features and the keys' scale (no second gather of the pages), hidden keys'
  values and per-token scales zeroed as `_read` zeroes a value pool's."""
  v = jnp.where(keep, k[..., : st.Hv], jnp.zeros((), k.dtype))
  if ks is not None and st.k_scale == "token":
    ks = jnp.where(jnp.swapaxes(keep, -1, -2), ks, jnp.zeros((), ks.dtype))
  return v, ks


def _pieces(st: _Static, x):
  """(M, K', R, bk) -> (M, c, K', R, bk / c): a block's keys as its pieces."""
  c = st.pieces
  x = x.reshape(x.shape[:3] + (c, st.block // c))
  return jnp.moveaxis(x, 3, 1)


def _page_ids(st: _Static, page_table, seq, j, P):
  """(M, pages per block): the pages of key block j of each tile's sequence, counted as
  `_take_pages` reads them (pool page p cut into ``st.sub`` pieces: pages p * sub + i)."""
  cols = j * st.pages_per_block + jnp.arange(st.pages_per_block, dtype=jnp.int32)
  cols = jnp.minimum(cols, st.max_pages - 1)
  ids = jnp.take(page_table, seq, axis=0)  # (M, max_pages of the pool)
  ids = jnp.take(ids, cols // st.sub, axis=1, mode="clip")
  # Entries past a sequence's last page may be anything: read a page that exists; the mask
  # hides what it holds.
  return jnp.clip(ids.astype(jnp.int32), 0, P - 1) * st.sub + (cols % st.sub)[None, :]


def _take_pages(st: _Static, pages, ids):
  """Pages ``ids`` (M, ppb) of the pool (or of its per-token scales), cut into ``st.sub``
  pieces each: piece i of pool page p is page p * sub + i."""
  if st.sub == 1:
    return jnp.take(pages, ids, axis=0)
  if st.token_major:  # (P, sub * ps, ...) is (P * sub, ps, ...) as it lies
    return jnp.take(pages.reshape((-1, st.page_size) + pages.shape[2:]), ids, axis=0)
  cut = pages.reshape(pages.shape[:2] + (st.sub, st.page_size) + pages.shape[3:])
  return cut[ids // st.sub, :, ids % st.sub]  # (M, ppb, K, ps, ...)


def _as_pieces(st: _Static, x):
  """Gathered pages (M, ppb, page_size, K, X) (NHD) or (M, ppb, K, page_size, X) (HND) as the
  block's pieces, (M, c, K, bk / c, X)."""
  M, X = x.shape[0], x.shape[-1]
  if st.token_major:
    return jnp.moveaxis(x, 3, 1).reshape(M, 1, st.K, st.block, X)
  if st.pieces == 1:
    return jnp.moveaxis(x, 2, 1).reshape(M, 1, st.K, st.block, X)
  return x  # HND page by page: the pages are the pieces


def _read(st: _Static, pages, ids, scale, scale_kind, dtype, keep=None, heads=0):
  """A block of the pool as (M, c, K, bk / c, X) and its scale as (M, c, K, 1, bk / c) (or one
  that broadcasts so; None for float pages). Quantised pages become float32, float pages stay
  in the query's dtype; ``keep`` (M, c, 1, bk / c, 1) zeroes the keys it marks False; ``heads``
  (0 keys, 1 values) picks the pages' half of a combined pool."""
  if st.upcast and pages.dtype.itemsize < 4 and jnp.issubdtype(pages.dtype, jnp.floating):
    # Gathered as unsigned integers of their width and converted by arithmetic on their bits
    # (`_pool.float32_from_bits`): XLA's CPU gather of 16- and 8-bit floats, and its float8 converts, are
    # several times slower (measured, a step at S = 16384: bfloat16 pages 210 -> 105 ms,
    # float8_e4m3fn 310 -> 80 ms).
    raw = jax.lax.bitcast_convert_type(pages, _pool.UINT[pages.dtype.itemsize])
    x = _pool.float32_from_bits(_half(st, _take_pages(st, raw, ids), heads), pages.dtype)
  else:
    x = _half(st, _take_pages(st, pages, ids), heads)  # (M, ppb, ps, K, X) | (M, ppb, K, ps, X)
  x = _as_pieces(st, x)
  x = x.astype(jnp.float32) if scale_kind is not None else x
  if keep is not None:
    x = jnp.where(keep, x, jnp.zeros((), x.dtype))
  if scale_kind is None:
    return x.astype(jnp.float32 if st.upcast else dtype), None
  if scale_kind == "tensor":
    return x, scale.astype(jnp.float32)
  if scale_kind == "head":
    return x, scale.astype(jnp.float32).reshape(1, 1, st.K, 1, 1)
  # Per token and head: laid out as the block is, one value per key.
  sc = jnp.swapaxes(_as_pieces(st, _take_pages(st, scale, ids)[..., None]), -1, -2)
  sc = sc.astype(jnp.float32)  # (M, c, K, 1, bk / c)
  if keep is not None:  # a hidden key's scale may be garbage too: 0 * NaN is NaN
    sc = jnp.where(jnp.swapaxes(keep, -1, -2), sc, jnp.zeros((), sc.dtype))
  return x, sc


def _half(st: _Static, x, heads):
  """Gathered pages' key (heads=0) or value (1) heads: a combined pool's 2K heads alternate."""
  return x[..., heads::2, :] if st.layout == "combined" else x


def _visible(st: _Static, tiles: _Tiles, kv_len, j):
  """(M, 1, G * tq, bk) bool: which keys of block j each tile row sees, in positions."""
  slot = j * st.block + jnp.arange(st.block, dtype=jnp.int32)  # (bk,)
  key, real = slot[None, None, :], (tiles.rows >= 0)[:, :, None]
  if st.tree:
    key, real = _tree_keys(st, tiles, slot, real)
  vis = _paged_fold.visible(
    st, key, tiles.pos[:, :, None], real, kv_len[:, None, None], slot=slot[None, None, :]
  )  # (M, tq, bk)
  M = vis.shape[0]
  vis = jnp.broadcast_to(vis[:, None], (M, st.G, st.tq, st.block))
  return vis.reshape(M, 1, st.G * st.tq, st.block)


# --------------------------------------------------------------------------------------------
# Checking the call.
# --------------------------------------------------------------------------------------------


def _tree_keys(st: _Static, tiles: _Tiles, slot, real):
  """A tree's keys at cache slots ``slot`` (bk,): (their positions (M, 1, bk) -- a cached key's
  is its slot, a new key's its row's depth position -- and ``real`` (M, tq, 1) narrowed to the
  keys each tile row sees by the mask, (M, tq, bk); cached keys pass it)."""
  c = slot[None, :] - tiles.first_new[:, None]  # (M, bk): the new row each slot holds
  new = c >= 0
  at = jnp.clip(c, 0, st.tree - 1)
  key = jnp.where(new, jnp.take_along_axis(tiles.new_pos, at, axis=1), slot[None, :])
  M = at.shape[0]
  at = jnp.broadcast_to(at[:, None, :], (M, st.tq, st.block))
  seen = jnp.take_along_axis(tiles.sees, at, axis=2) | ~new[:, None, :]
  return key[:, None, :], real & seen


def _check(given: _Arrays, opts: _Options, latent_dim=None) -> tuple[_Static, _Arrays]:
  """(_Static, arrays) of a call, every argument checked (errors name the argument; concrete
  metadata by its values too): first each array's kind, then the pool's and the metadata's
  shapes against each other, then concrete metadata's values. ``latent_dim``: Hv of absorbed
  MLA (value_pages None, already checked by `_pool.check_value_head_dim`), or None."""
  _check_choices(opts)
  metadata = (given.pool.page_table, given.pool.kv_lengths, given.query_start)  # NumPy stays
  # concrete under jit: kept as given for `check_concrete`
  mask_given = given.new_token_mask
  given = _as_arrays(given)
  query, pool, ragged = given.query, given.pool, given.query_start is not None
  if query.ndim != (3 if ragged else 4):
    raise ValueError(
      f"query must be {'(total, N, H) with query_start' if ragged else '(B, T, N, H)'}, got "
      f"query.shape={query.shape}"
    )
  latent = latent_dim is not None
  key_pages, value_pages, (P, page_size, K, H), kinds = _check_pool(query, pool, opts, latent_dim)
  N = query.shape[-2]
  B, max_pages = _page_metadata.check_shapes(
    pool.page_table, pool.kv_lengths, given.query_start, None if ragged else query.shape[0]
  )
  rows = query.shape[0] if ragged else query.shape[1]
  if not concrete(rows, N, H, max_pages, P, page_size, K):
    raise NotImplementedError(
      "paged_attention plans its tiles and blocks from known sizes: only the number of "
      "sequences B may be symbolic (jax.export), got query.shape="
      f"{query.shape}, key_pages.shape={key_pages.shape}, page_table.shape={pool.page_table.shape}"
    )
  if given.sinks is not None and given.sinks.shape != (N,):
    raise ValueError(f"sinks must be (N,) = ({N},), got shape {given.sinks.shape}")
  _page_metadata.check_concrete(_page_metadata.Geometry(P, page_size, rows, ragged), *metadata)
  tree = _check_tree(given.new_token_mask, mask_given, metadata[2], (B, rows, ragged))
  # Ragged tiles hold at most 16 rows (a sequence's rows fill one tile, the rest pad it);
  # padded queries one tile per sequence of all T rows.
  tq = max(1, min(16, rows) if ragged else rows)
  scale, causal, window, soft_cap = _score_options(H, opts)
  cfg = _tile.Config(
    B=B,
    T=rows,
    S=max_pages * page_size,
    K=K,
    G=N // K,
    H=H,
    scale=scale,
    logits_soft_cap=soft_cap,
    dropout_rate=0.0,
  )
  st = _Static(
    cfg=cfg,
    Hv=latent_dim if latent else value_pages.shape[-1],
    page_size=page_size,
    layout=opts.kv_layout,
    pages_per_block=1,
    max_pages=max_pages,
    tq=tq,
    tiles=(-(-rows // tq) + B) if ragged else B,
    ragged=ragged,
    rows=rows,
    k_scale=kinds[0],
    v_scale=kinds[1],
    dtype=query.dtype,
    causal=causal,
    window=window,
    tree=tree,
    latent=latent,
  )
  st = st.with_block(PAGED_BLOCK_KV["default"])._replace(implementation=opts.implementation)
  why = _no_grid(st) or _no_tree(st) or _no_latent(st)
  if opts.implementation == "pallas" and why:
    raise NotImplementedError(f"implementation='pallas' cannot take {why}")
  value_pages = None if latent else value_pages
  return st, given._replace(pool=pool._replace(key_pages=key_pages, value_pages=value_pages))


def _check_pool(query, pool: _pool.Pool, opts: _Options, latent_dim):
  """The pools against the query: (key_pages, value_pages, (P, page_size, K, H), the scales'
  kinds); absorbed MLA's latent pool (``latent_dim`` its Hv) is checked as keys and values."""
  latent = latent_dim is not None  # the latent pool is checked as keys and values both
  key_pages, value_pages, (P, page_size, K, H) = _pool.checked_pools(
    pool.key_pages, pool.key_pages if latent else pool.value_pages, opts.kv_layout
  )
  if latent and latent_dim > H:
    raise ValueError(
      f"value_head_dim={latent_dim} must be in 1 .. H={H} (the values are the first "
      f"value_head_dim features of the latent pool), key_pages.shape={key_pages.shape}"
    )
  N = query.shape[-2]
  if query.shape[-1] != H:
    raise ValueError(f"query's head size must be key_pages' H={H}: query.shape={query.shape}")
  if N % K:
    raise ValueError(f"the query heads N={N} must be a multiple of the key/value heads K={K}")
  kinds = tuple(
    _pool.scale_kind(name, sc, pages, query.dtype, _pool.DIMS[opts.kv_layout], K)
    for name, sc, pages in (
      ("k_scale", pool.k_scale, key_pages),
      ("v_scale", pool.v_scale, value_pages),
    )[: 1 if latent else 2]
  ) + ((None,) if latent else ())
  return key_pages, value_pages, (P, page_size, K, H), kinds


def _check_choices(opts: _Options) -> None:
  """The layout and the implementation are among the names paged_attention knows."""
  _pool.check_layout_name(opts.kv_layout)
  implementation = opts.implementation
  if implementation not in IMPLEMENTATIONS:
    error = NotImplementedError if isinstance(implementation, (str, tuple)) else ValueError
    raise error(
      f"paged_attention runs jattn's own kernels: None, 'chunked' (the XLA walk) or "
      f"'pallas' (its Pallas kernel), got implementation={implementation!r}; the "
      f"other kernels take contiguous keys and values (dot_product_attention)"
    )


def _as_arrays(given: _Arrays) -> _Arrays:
  """Every array of a call as an array of its kind (TypeError naming the argument); shapes
  are checked after. value_pages may be None (a combined pool) and so may the optional ones."""
  pool, sinks = given.pool, given.sinks
  pages = [
    None if x is None else _validation.as_array(name, x, "an array of pages")
    for name, x in (("key_pages", pool.key_pages), ("value_pages", pool.value_pages))
  ]
  scales = [
    None if x is None else _validation.float_array(name, x)
    for name, x in (("k_scale", pool.k_scale), ("v_scale", pool.v_scale))
  ]
  pool = _pool.Pool(
    pages[0],
    pages[1],
    _validation.int_array("page_table", pool.page_table),
    _validation.int_array("kv_lengths", pool.kv_lengths),
    scales[0],
    scales[1],
  )
  return _Arrays(
    _validation.float_array("query", given.query),
    pool,
    _validation.int_array("query_start", given.query_start, optional=True),
    None if sinks is None else _validation.float_array("sinks", sinks),
    None
    if given.new_token_mask is None
    else _validation.bool_array(
      "new_token_mask", given.new_token_mask, "a boolean array (True: the row sees that new row)"
    ),
  )


def _check_tree(mask, given, query_start, sizes) -> int:
  """new_token_mask's columns C (0: none), its shape checked against the query's (``sizes``:
  B, rows, ragged) and, where the mask (``given``, as passed) and the offsets are known now,
  its values: every row sees itself, no sequence has more rows than C (ValueError)."""
  if mask is None:
    return 0
  B, rows, ragged = sizes
  if ragged:
    if mask.ndim != 2 or mask.shape[0] != rows or mask.shape[1] < 1:
      raise ValueError(
        f"new_token_mask must be (total, T_max) = ({rows}, T_max) with a ragged query (row r "
        f"sees its sequence's new row c iff mask[r, c]), got shape {mask.shape}"
      )
  elif mask.shape != (B, rows, rows):
    raise ValueError(
      f"new_token_mask must be (B, T, T) = ({B}, {rows}, {rows}) with a padded query (row i "
      f"of sequence b sees its new row c iff mask[b, i, c]), got shape {mask.shape}"
    )
  C = mask.shape[-1]
  known = (given, query_start)
  if any(isinstance(x, jax.core.Tracer) for x in known):
    return C  # traced: a fault makes the sequence's rows NaN (`_tree_faults`)
  m = np.asarray(given)
  qs = None if query_start is None else np.asarray(query_start)
  bad = np.flatnonzero(_tree_faults(np, _Sizes(B, rows, ragged, C), m, qs))
  if bad.size:
    raise ValueError(_describe_tree_fault(int(bad[0]), m, qs))
  return C


class _Sizes(NamedTuple):
  """What `_tree_faults` reads of a plan (a `_Static` has these too)."""

  B: int
  rows: int
  ragged: bool
  tree: int


def _tree_faults(xp, st, mask, query_start):
  """(B,) bool: the sequences whose new_token_mask breaks its rules: one of their rows hides
  itself, or (ragged) they have more rows than the mask's C columns."""
  if not st.ragged:
    return ~xp.diagonal(mask, axis1=1, axis2=2).all(axis=1)
  qs = query_start.astype(np.int32)
  r = xp.arange(st.rows, dtype=np.int32)[:, None]
  i = r - qs[None, :-1]  # (total, B): the row's index among sequence b's rows
  mine = (i >= 0) & (r < qs[None, 1:])
  itself = xp.take_along_axis(mask, xp.clip(i, 0, st.tree - 1), axis=1)
  return (mine & ((i >= st.tree) | ~itself)).any(axis=0)


def _describe_tree_fault(b: int, mask, qs) -> str:
  """The message for sequence b's new_token_mask fault (NumPy values)."""
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


def _checkify_tree(st: _Static, arrays: _Arrays) -> None:
  """Under `jax.experimental.checkify` (on_invalid="checkify"): an error naming the first
  sequence whose new_token_mask breaks its rules."""
  from jax.experimental import checkify

  bad = _tree_faults(jnp, st, arrays.new_token_mask, arrays.query_start)
  first = jnp.argmax(bad)
  checkify.check(
    ~bad.any(),
    "paged_attention: sequence {b}'s new_token_mask hides one of its rows from itself, or "
    "(ragged) the sequence has more new rows than the mask's columns",
    b=first,
  )


def _score_options(H, opts: _Options):
  """The logits' options, checked: (scale, causal, window, soft_cap)."""
  scale, is_causal = opts.scale, opts.is_causal
  causal = _validation.causal(is_causal)
  if causal == "top_left" and is_causal is not True:
    raise ValueError(
      "is_causal here is True or False: queries are placed at their positions "
      "(bottom-right, after the cache), not aligned to the top-left"
    )
  return (
    _tile.default_scale(H) if scale is None else _validation.real("scale", scale),
    causal is not None,
    _validation.window(opts.local_window_size),
    _validation.soft_cap(opts.logits_soft_cap),
  )
