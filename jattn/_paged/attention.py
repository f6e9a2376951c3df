"""Attention against a paged KV cache: a pool of fixed-size pages and a page table per sequence.

Serving systems keep each sequence's keys and values in pages of a shared pool (vLLM,
FlashAttention's ``block_table``): sequence b's tokens 0 .. kv_lengths[b] - 1 live in pages
page_table[b, 0], page_table[b, 1], ... in order. Queries are the new tokens of each sequence,
bottom-right aligned: the last query of sequence b sits at position kv_lengths[b] - 1. They come
padded, (B, T, N, H), or ragged, (total, N, H) with offsets ``query_start`` (B + 1,), so prefill
chunks and single decode tokens of different sequences share one call (continuous batching).

`paged_attention` checks a call room by room -- every array as an array of its kind
(`jattn._validation`), the pool against the query (`pool.check`), the metadata against both
(`metadata`), then the static plan (`plan`) -- and hands it to its program (`run`): query rows
cut into tiles of one sequence (`tiles`), each tile's keys read block by block from the pool
where it lies (`read`) and folded into the tile's running softmax by the XLA walk (`walk`) or
jattn's Pallas kernels (`pallas_tpu`, `pallas_gpu`), all through one arithmetic (`fold`). The
kernel never builds a contiguous cache.

Shapes: B sequences, T new tokens each (or ``total`` ragged rows), N query heads, K key/value
heads, G = N // K, H query/key head size, Hv value head size, P pages of ``page_size`` tokens.
"""

from __future__ import annotations

import jax.numpy as jnp

from jattn import _tile, _validation, masks
from jattn._paged import metadata, plan, run
from jattn._paged import pool as _pool
from jattn._paged.plan import Options, Queries
from jattn._paged.pool import Pool


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
  key_selection=None,
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
    key_selection: `jattn.masks.selected_blocks` ``(indices, block_size)``: each new row reads
      only the keys it chose (DSA's top-k tokens at block size 1, NSA's blocks; a decoding step
      of a learned sparse model): indices (B, T, K', n) padded or (1, total, K', n) ragged (B
      may be 1: one selection for every sequence), K' = 1 (shared by every head) or K, block c
      being the sequence's positions [c * block_size, (c + 1) * block_size) wherever their
      pages lie. A row sees a key iff it is selected and cached and causality and the window
      allow it; -1 selects nothing. Known indices are checked (ValueError): each -1 or a block
      within the table's reach, ceil(max_pages * page_size / block_size), none twice in a row;
      traced ones outside it select nothing and a repeat counts once. Work and pool reads
      O(rows x n x block_size): the other pages are never read. The XLA program on every
      platform (implementation=None or "chunked"; "pallas" raises); not with new_token_mask.

  Returns:
    (B, T, N, Hv) or (total, N, Hv) in the query's dtype; a sequence with no cached tokens, or a
    query that sees none, gives zeros.
  """
  metadata.check_on_invalid("paged_attention", on_invalid)
  plan.check_implementation(implementation)
  _check_selection_kind(key_selection, new_token_mask)
  # As passed: NumPy metadata stays concrete under jit, and is checked by its values.
  given = metadata.Metadata(page_table, kv_lengths, query_start, new_token_mask)
  same = key_pages is value_pages and key_pages is not None
  declared = _pool.Declared(kv_layout, page_size, num_kv_heads, value_head_dim, same)
  queries, pool, opts = _as_arrays(
    Queries(query, query_start, sinks, new_token_mask, key_selection),
    Pool(key_pages, value_pages, page_table, kv_lengths, k_scale, v_scale),
    Options(scale, is_causal, local_window_size, logits_soft_cap, kv_layout, implementation),
  )
  ragged = queries.query_start is not None
  pool, sizes = _pool.check(pool, _pool.Tokens(query=queries.query, ragged=ragged), declared)
  md = metadata.Metadata(
    pool.page_table, pool.kv_lengths, queries.query_start, queries.new_token_mask
  )
  B, max_pages, rows = metadata.check_shapes(md, queries.query.shape, ragged)
  g = metadata.Geometry(sizes.P, sizes.page_size, rows, ragged)
  metadata.check(g, given)
  if key_selection is not None:
    _check_selection(key_selection, queries.query.shape, ragged, B, sizes, max_pages)
  if on_invalid == "checkify":
    metadata.checkify("paged_attention", metadata.faults(jnp, g, md))
  st = plan.plan(queries, sizes, (B, max_pages), opts)
  out, lse = run.attend(st, queries, pool)
  return (out, lse) if return_residual else out


def _as_arrays(queries: Queries, pool: Pool, opts: Options) -> tuple[Queries, Pool, Options]:
  """Every array of a call as an array of its kind and every option as a value (TypeError or
  ValueError naming the argument; shapes are the pool's and the metadata's to check). Only the
  number of sequences B may be symbolic (jax.export): the tiles and blocks are planned from
  the other sizes."""
  pages = [
    None if x is None else _validation.as_array(name, x, "an array of pages")
    for name, x in (("key_pages", pool.key_pages), ("value_pages", pool.value_pages))
  ]
  scales = [
    None if x is None else _validation.float_array(name, x)
    for name, x in (("k_scale", pool.k_scale), ("v_scale", pool.v_scale))
  ]
  table = _validation.int_array("page_table", pool.page_table)
  lens = _validation.int_array("kv_lengths", pool.kv_lengths)
  pool = Pool(pages[0], pages[1], table, lens, scales[0], scales[1])
  query, sinks, mask = queries.query, queries.sinks, queries.new_token_mask
  queries = Queries(
    _validation.float_array("query", query),
    _validation.int_array("query_start", queries.query_start, optional=True),
    None if sinks is None else _validation.float_array("sinks", sinks),
    None
    if mask is None
    else _validation.bool_array(
      "new_token_mask", mask, "a boolean array (True: the row sees that new row)"
    ),
    queries.selection,
  )
  query, pages_shape = queries.query, getattr(pool.key_pages, "shape", ())
  known = query.shape[1:] if queries.query_start is None else query.shape
  if not _validation.concrete(*known, *pages_shape, *table.shape[1:]):
    raise NotImplementedError(
      "paged_attention plans its tiles and blocks from known sizes: only the number of "
      "sequences B may be symbolic (jax.export), got query.shape="
      f"{query.shape}, key_pages.shape={pages_shape}, page_table.shape={table.shape}"
    )
  causal = _validation.causal(opts.causal)
  if causal == "top_left" and opts.causal is not True:
    raise ValueError(
      "is_causal here is True or False: queries are placed at their positions "
      "(bottom-right, after the cache), not aligned to the top-left"
    )
  scale = opts.scale
  if scale is not None:
    scale = _validation.real("scale", scale)
  elif query.ndim:  # the query's head size, which the pool check holds to the pool's
    scale = _tile.default_scale(query.shape[-1])
  return (
    queries,
    pool,
    opts._replace(
      scale=scale,
      causal=causal is not None,
      window=_validation.window(opts.window),
      logits_soft_cap=_validation.soft_cap(opts.logits_soft_cap),
    ),
  )


def _check_selection_kind(selection, new_token_mask) -> None:
  """``key_selection`` is one `jattn.masks.selected_blocks` (TypeError otherwise), without a
  tree of new tokens (NotImplementedError)."""
  if selection is None:
    return
  is_mask = isinstance(selection, masks.Mask)
  chosen, rest = masks.split_selection(selection) if is_mask else ((), None)
  if len(chosen) != 1 or rest is not None:
    raise TypeError(
      "key_selection must be one jattn.masks.selected_blocks(indices, block_size) (causality "
      f"and the window are paged_attention's own arguments), got {type(selection).__name__}"
    )
  if new_token_mask is not None:
    raise NotImplementedError(
      "key_selection with new_token_mask: a tree of draft tokens selecting keys is not "
      "implemented (verify the draft without a selection, or decode it token by token)"
    )


def _check_selection(selection, query_shape, ragged: bool, B, sizes, max_pages) -> None:
  """The selection's indices against the query's rows and the pool's heads and reach, their
  known values checked (ValueError naming the argument)."""
  chosen = selection.chosen
  rows, N = query_shape[-3], query_shape[-2]
  want = f"(1, total={rows}, K', n)" if ragged else f"(B={B} or 1, T={rows}, K', n)"
  if (ragged and chosen.shape[0] != 1) or chosen.shape[1] != rows:
    raise ValueError(f"key_selection: indices must be {want}, got shape {chosen.shape}")
  if chosen.shape[2] not in (1, sizes.K):
    raise ValueError(
      f"key_selection: indices' K'={chosen.shape[2]} must be 1 or the pool's KV heads "
      f"K={sizes.K}, got shape {chosen.shape}"
    )
  try:
    selection.check_known((1 if ragged else B, N, rows, max_pages * sizes.page_size))
  except ValueError as e:
    raise ValueError(f"key_selection: {e} (S: the page table's reach)") from None
