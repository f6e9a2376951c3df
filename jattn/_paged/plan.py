"""The static plan of a paged_attention call (`PagedPlan`): what its tiles, walks and kernels are
built from, made once the call is checked -- the pool's sizes and scales, the query's rows and
heads, the options -- and hashable, so that it is the jitted program's static argument.

Shapes: B sequences, T new tokens each (or ``total`` ragged rows), N query heads, K key/value
heads, G = N // K, H query/key head size, Hv value head size, P pages of ``page_size`` tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jattn import _tile
from jattn._paged.pool import PoolSizes
from jattn._validation import concrete

# Keys per step of the XLA walk: whole pages adding up to about this many (a page larger than it
# is cut). On the CPU a block read from the pool should stay in the core's cache until the
# matmuls use it (docs/benchmarks.md, "Tuning constants"); elsewhere the chunked kernels' key
# block. Its split-KV parts on GPU and TPU are the chunked kernels' decoding split.
PAGED_BLOCK_KV = {"cpu": 128, "default": _tile.DEFAULT_BLOCK_KV}
# None: jattn's Pallas kernel on a TPU or NVIDIA GPU where it takes the call, the XLA walk
# elsewhere; "chunked": the XLA walk everywhere; "pallas": the kernel (`jattn._paged.pallas_tpu`,
# `jattn._paged.pallas_gpu`) or an error naming why not.
IMPLEMENTATIONS = (None, "chunked", "pallas")
# HND pages at least this long are multiplied page by page; shorter ones are first laid side by
# side per head (a matmul of a few keys costs more than the copy).
PAGE_MATMUL_MIN = 64
# Ragged tiles hold at most this many rows: a sequence's rows fill one tile, the rest pad it
# (padded queries have one tile per sequence, of all its T rows).
RAGGED_TILE_ROWS = 16


class Queries(NamedTuple):
  """A call's arrays on the query's side: query (B, T, N, H) or ragged (total, N, H), the ragged
  rows' offsets query_start (B + 1,), sinks (N,), new_token_mask and the key selection (a
  `jattn.masks.selected_blocks` over the rows), None where not given."""

  query: Any
  query_start: Any = None
  sinks: Any = None
  new_token_mask: Any = None
  selection: Any = None


class Options(NamedTuple):
  """A call's options: the logit scale, causality, the window in positions, the soft cap, the
  pool's layout and the implementation; as passed until `jattn._validation` makes them values
  (the default scale resolved, causality a bool)."""

  scale: Any
  causal: Any
  window: Any
  logits_soft_cap: Any
  kv_layout: Any
  implementation: Any


class PagedPlan(NamedTuple):
  """What a call's tiles, walks and kernels are built from (hashable)."""

  # The tile config of the chunked kernels (B sequences, T = rows, S = the page table's reach):
  # the logit scale and soft cap apply through `_tile.scale_cap_bias`, as in every other walk.
  cfg: _tile.Config
  Hv: int
  page_size: int
  kv_layout: str  # "NHD" | "HND" | "combined"
  pages_per_block: int
  max_pages: int
  tq: int  # query rows per tile
  max_tiles: int  # an upper bound on the tiles (static)
  ragged: bool
  rows: int  # T (padded) or total (ragged)
  causal: bool
  window: tuple | None
  k_scale_kind: str | None  # "tensor" | "head" | "token" | None (pages not quantised)
  v_scale_kind: str | None
  dtype: Any  # the query's (and output's)
  # Each pool page read as ``sub`` pages of page_size keys (page_size and max_pages count
  # these): a page longer than a block is cut so that a step still reads one block.
  sub: int = 1
  # Pages become float32 before the matmuls (the CPU's program: XLA's CPU matmuls of 16-bit
  # floats are slower than float32 ones, and float8 converts run in software).
  upcast: bool = False
  # One of IMPLEMENTATIONS (the kernel or the walk is chosen where the program is lowered).
  implementation: str | None = None
  # new_token_mask's columns (T padded, T_max ragged): the most new rows a sequence may have
  # and what a tree is planned for; 0 without a mask (positions as usual).
  tree: int = 0
  # Absorbed MLA: no value pool, the values are the keys' first Hv features (read with them).
  latent: bool = False
  # A key selection: each row reads only its chosen keys (`jattn._paged.selected`).
  selected: bool = False

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
    return self.kv_layout != "HND"

  @property
  def block(self) -> int:
    return self.pages_per_block * self.page_size

  @property
  def blocks(self) -> int:
    return -(-self.max_pages // self.pages_per_block)

  @property
  def pieces(self) -> int:
    """A block's keys go to the matmuls as ``pieces`` runs of ``block // pieces`` keys."""
    per_page = self.kv_layout == "HND" and self.page_size >= PAGE_MATMUL_MIN
    return self.pages_per_block if per_page else 1

  def with_block(self, keys: int) -> PagedPlan:
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


def check_implementation(implementation) -> None:
  """``implementation`` is one paged_attention knows."""
  if implementation not in IMPLEMENTATIONS:
    error = NotImplementedError if isinstance(implementation, (str, tuple)) else ValueError
    raise error(
      f"paged_attention runs jattn's own kernels: None, 'chunked' (the XLA walk) or "
      f"'pallas' (its Pallas kernel), got implementation={implementation!r}; the "
      f"other kernels take contiguous keys and values (dot_product_attention)"
    )


def plan(queries: Queries, pool: PoolSizes, table: tuple, opts: Options) -> PagedPlan:
  """The plan of a checked call: ``pool`` its pool's sizes, ``table`` = (B, max_pages) its page
  table's; the sinks' shape against the query's heads, and an implementation="pallas" that no
  kernel can take, refused here."""
  query, ragged = queries.query, queries.query_start is not None
  rows, N = query.shape[-3], query.shape[-2]
  B, max_pages = table
  if queries.sinks is not None and queries.sinks.shape != (N,):
    raise ValueError(f"sinks must be (N,) = ({N},), got shape {queries.sinks.shape}")
  tq = max(1, min(RAGGED_TILE_ROWS, rows) if ragged else rows)
  cfg = _tile.Config(
    B=B,
    T=rows,
    S=max_pages * pool.page_size,
    K=pool.K,
    G=N // pool.K,
    H=pool.H,
    scale=opts.scale,
    logits_soft_cap=opts.logits_soft_cap,
    dropout_rate=0.0,
  )
  st = PagedPlan(
    cfg=cfg,
    Hv=pool.Hv,
    page_size=pool.page_size,
    kv_layout=opts.kv_layout,
    pages_per_block=1,
    max_pages=max_pages,
    tq=tq,
    max_tiles=(-(-rows // tq) + B) if ragged else B,
    ragged=ragged,
    rows=rows,
    causal=opts.causal,
    window=opts.window,
    k_scale_kind=pool.k_scale,
    v_scale_kind=pool.v_scale,
    dtype=query.dtype,
    implementation=opts.implementation,
    tree=0 if queries.new_token_mask is None else queries.new_token_mask.shape[-1],
    latent=pool.latent,
    selected=queries.selection is not None,
  )
  why = why_no_kernel(st)
  if opts.implementation == "pallas" and why:
    raise NotImplementedError(f"implementation='pallas' cannot take {why}")
  return st


def why_no_kernel(st: PagedPlan) -> str | None:
  """Why no Pallas kernel can take the call, or None: a grid is planned from known sizes, the
  kernels see keys by position only (no tree) and read a value pool (no absorbed MLA)."""
  if not concrete(st.B):
    return f"a symbolic number of sequences B={st.B}: a Pallas grid is planned from known sizes"
  if st.tree:
    return (
      "new_token_mask (a tree of new tokens): the Pallas kernels see keys by position only; "
      "implementation=None or 'chunked' runs the XLA walk, which takes it"
    )
  if st.selected:
    return (
      "key_selection: the Pallas kernels walk every cached block; implementation=None or "
      "'chunked' reads only the selected keys"
    )
  if st.latent:
    return (
      f"absorbed MLA (value_pages=None, value_head_dim={st.Hv}): the Pallas kernels read a "
      "separate value pool; the XLA walk reads the latent pool once"
    )
  return None
