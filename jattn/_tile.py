"""The math of one (query-block, key-block) tile, shared by the dense and chunked kernels.

Dense attention is the special case of a single tile covering the whole (T, S) score matrix, so
both implementations compute logits, masks and dropout through these functions and cannot drift
apart.

Inside the kernels, arrays are head-major and grouped for GQA (K key/value heads, G = N // K query
heads per key/value head; query head n = k * G + g, as `jax.nn` numbers them):
  q  (B, K, G, tq, H)      k, v  (B, K, tk, H)      scores  (B, K, G, tq, tk)
or, in rows layout (the chunked forward), the G heads of a group stacked as rows (g * tq + t):
  q  (B, K, G * tq, H)                               scores  (B, K, G * tq, tk)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _dropout, _sharding
from jattn._softmax import NEG, stat_dtype  # noqa: F401  (the tiles' masked logit and dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
  """Static (hashable) description of one attention call, after validation."""

  B: int
  T: int
  S: int
  K: int
  G: int
  H: int
  scale: float
  logits_soft_cap: float | None
  dropout_rate: float
  score_mod: Callable | None = None
  # One (T, S) dropout mask shared by every batch element and head (flax's broadcast_dropout).
  dropout_broadcast: bool = False
  # The kernels also return each row's max logit over its visible keys (the sink excluded).
  max_logits: bool = False

  @property
  def N(self) -> int:
    return self.K * self.G


def default_scale(H: int) -> float:
  """1 / sqrt(H): q.k of unit-variance vectors has variance H; this keeps the logits at unit
  variance so the softmax neither saturates nor flattens as the head dimension grows (large
  logits make it one-hot, with vanishing gradients)."""
  return 1.0 / float(np.sqrt(H))


def matmul(a, b, spec: str, out_dtype, fold: bool = True):
  """A per-(batch, kv-head) matmul with the G query heads of a group stacked as extra rows.

  ``a`` is (B, K, G, t, x), or already in rows layout (B, K, G * t, x) (see `as_rows`), and ``b``
  (B, K, y, z); ``spec`` names the contraction of the last two axes of each (e.g.
  "qh,sh->qs"); when the output has the row axis q, the result is (B, K, G, t, .), or
  (B, K, G * t, .) for rows (else G is contracted away with q, as in dK = dS^T Q). Folding G
  into the row axis keeps every operand and result in plain row-major order: with a separate,
  often size-1, G axis XLA's CPU backend copies the (t, s) result to a new layout on every tile.

  ``fold=False`` keeps G and t separate dimensions of one dot_general (XLA merges them only
  after partitioning): merging puts t below G, where a sharded t cannot stay sharded, so the
  partitioner would gather a sequence-sharded query. The dense kernel, whose t is the whole
  query, uses it; the chunked kernels' tiles are never sharded on t.
  """
  lhs, out = spec.split("->")
  la, lb = lhs.split(",")
  if not fold:
    return jnp.einsum(f"bkg{la},bk{lb}->bkg{out}", a, b, preferred_element_type=out_dtype)
  if a.ndim == 4:
    return jnp.einsum(f"bk{la},bk{lb}->bk{out}", a, b, preferred_element_type=out_dtype)
  B, K, G, t = a.shape[:4]
  a2 = a.reshape(B, K, G * t, a.shape[-1])
  out2 = jnp.einsum(f"bk{la},bk{lb}->bk{out}", a2, b, preferred_element_type=out_dtype)
  if out[0] == la[0]:
    return out2.reshape(B, K, G, t, out2.shape[-1])
  return out2


def as_rows(x, G: int, t: int):
  """A (B|1, K|1, G|1, t|1, X|1) tile quantity (visibility, bias, dropout's keep-mask) in the
  rows layout (B|1, K|1, G * t, X|1) of a tile whose G query heads are stacked as rows."""
  b, k, g, tt, xx = x.shape
  if g == 1 and tt == 1:
    return x.reshape(b, k, 1, xx)
  return jnp.broadcast_to(x, (b, k, G, t, xx)).reshape(b, k, G * t, xx)


def query_takes_scale(cfg: Config, dtype) -> bool:
  """Whether the logit scale may multiply the query once instead of every (tq, tk) tile of
  logits: (c q).k = c (q.k) up to one rounding, and a whole pass over each tile cheaper. Only
  where that rounding is no coarser than the logits' own: float32 and float64 queries, or
  bfloat16 with a power-of-two scale (exact: bfloat16 has float32's exponent range). Not
  bfloat16 with another scale (the product would be rounded to bfloat16's 8-bit mantissa
  before the float32 matmul), and never float16: its narrow exponent range can overflow
  (scale 2, |q| > 32768) or flush small products to subnormals, even for a power of two."""
  dtype = jnp.dtype(dtype)
  if dtype in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
    return True
  mantissa, _ = np.frexp(cfg.scale)
  return dtype == jnp.dtype(jnp.bfloat16) and abs(mantissa) == 0.5


def prescaled_query(cfg: Config, q):
  """(q, scaled): the query times the scale where `query_takes_scale` allows it (scaled True),
  else the query as it is. The chunked forward and backward both take Q from here, so that
  both compute the logits with the same rounding."""
  scaled = query_takes_scale(cfg, q.dtype)
  return (q * jnp.asarray(cfg.scale, q.dtype) if scaled else q), scaled


def group_heads(x, K: int, G: int):
  """(B|1, N|1, t, s) -> (B|1, K|1, G|1, t, s), following query head n = k * G + g."""
  b, n, t, s = x.shape
  if n == 1:
    return x.reshape(b, 1, 1, t, s)
  return x.reshape(b, K, G, t, s)


class Index(NamedTuple):
  """The indices a tile's entries have in the whole problem, as score_mod and the dropout hash
  see them: query and key positions (tq,), (tk,) int32, and the index of the first batch element
  and query head the kernel holds (nonzero only for one device's shard in ring attention)."""

  q: Any
  kv: Any
  batch0: Any = 0
  head0: Any = 0


def logits(
  cfg: Config, q, k, bias, idx: Index, score_args=(), fold: bool = True, scaled: bool = False
):
  """Scaled logits of a tile in the statistics dtype, before masking.

  Order: scale * q.k, then soft-cap (cap * tanh(x / cap)), then + bias, then score_mod.
  Returns (scores, tanh_or_None); the tanh is kept for the soft-cap derivative. ``fold``: see
  `matmul`; a query in rows layout gives scores in rows layout (``bias`` is converted).
  ``scaled``: the query already carries the scale (see `query_takes_scale`).
  """
  if q.ndim == 4 and bias is not None:
    bias = as_rows(bias, cfg.G, q.shape[2] // cfg.G)
  s = matmul(q, k, "qh,sh->qs", stat_dtype(q.dtype), fold)
  s, t = scale_cap_bias(cfg, s, bias, scaled)
  if cfg.score_mod is not None:
    s = apply_score_mod(cfg, s, idx, score_args)
  return s, t


def scale_cap_bias(cfg: Config, s, bias, scaled: bool = False):
  """The steps of `logits` after the matmul and before score_mod, on raw q.k scores in the
  statistics dtype, in any layout that ``bias`` broadcasts against. Returns (scores, tanh|None).
  ``scaled``: the scores already carry the scale."""
  if not scaled:
    s = s * jnp.asarray(cfg.scale, s.dtype)
  t = None
  if cfg.logits_soft_cap is not None:
    cap = jnp.asarray(cfg.logits_soft_cap, s.dtype)
    t = jnp.tanh(s / cap)
    s = cap * t
  if bias is not None:
    s = s + bias.astype(s.dtype)
  return s, t


def index_grids(cfg: Config, idx: Index):
  """Broadcastable (batch, head, q, kv) int32 index arrays for a tile, heads as n = k * G + g."""
  b = jnp.arange(cfg.B, dtype=jnp.int32).reshape(cfg.B, 1, 1, 1, 1) + idx.batch0
  h = (
    jnp.arange(cfg.K, dtype=jnp.int32)[:, None] * cfg.G
    + jnp.arange(cfg.G, dtype=jnp.int32)[None, :]
  ).reshape(1, cfg.K, cfg.G, 1, 1) + idx.head0
  q = idx.q.astype(jnp.int32).reshape(1, 1, 1, -1, 1)
  k = idx.kv.astype(jnp.int32).reshape(1, 1, 1, 1, -1)
  return b, h, q, k


def apply_score_mod(cfg: Config, s, idx: Index, score_args):
  """score_mod on a tile (B, K, G, tq, tk), or in rows layout (B, K, G * tq, tk), presented to
  the user in (B, N, tq, tk) layout with index arrays of shapes (B,1,1,1), (1,N,1,1),
  (1,1,tq,1), (1,1,1,tk)."""
  shape = s.shape
  # Through _sharding.sharded_reshape: under an Explicit mesh a batch- or head-sharded tile keeps its
  # sharding on B or on N (K is the major part of N).
  s4 = _sharding.sharded_reshape(s, (shape[0], cfg.N, idx.q.shape[0], shape[-1]))
  b = jnp.arange(cfg.B, dtype=jnp.int32).reshape(cfg.B, 1, 1, 1) + idx.batch0
  h = jnp.arange(cfg.N, dtype=jnp.int32).reshape(1, cfg.N, 1, 1) + idx.head0
  q = idx.q.astype(jnp.int32).reshape(1, 1, -1, 1)
  k = idx.kv.astype(jnp.int32).reshape(1, 1, 1, -1)
  # The shape and dtype of the result were checked when the call was traced.
  assert cfg.score_mod is not None
  out = cfg.score_mod(s4, b, h, q, k, *score_args)
  return _sharding.sharded_reshape(out.astype(s.dtype), shape)


def visible(cfg: Config, mask, q_pos, kv_pos, *, ragged_kv: bool):
  """Boolean (B|1, K|1, G|1, tq, tk) visibility of a tile, or None when nothing is hidden."""
  vis = None
  if mask is not None:
    vis = group_heads(mask.evaluate(q_pos, kv_pos, (cfg.B, cfg.N, cfg.T, cfg.S)), cfg.K, cfg.G)
  if ragged_kv:
    # Key positions past S are padding of the last block.
    inside = (kv_pos < cfg.S).reshape(1, 1, 1, 1, -1)
    vis = inside if vis is None else vis & inside
  return vis


def sanitize(vis, q, k, v):
  """Zero query rows and key/value columns that the tile's mask hides entirely.

  A masked probability is an exact 0, but 0 * NaN = NaN: garbage (inf/NaN) in padded keys, values
  or queries would otherwise leak into outputs and gradients through the matmuls.
  """
  row = vis.any(axis=-1)[..., None]  # (B|1, K|1, G|1, tq, 1), or rows (B|1, K|1, G * tq, 1)
  col = vis.any(axis=tuple(range(2, vis.ndim - 1)))[..., None]  # (B|1, K|1, tk, 1)
  zero = lambda x: jnp.zeros((), x.dtype)
  return (jnp.where(row, q, zero(q)), jnp.where(col, k, zero(k)), jnp.where(col, v, zero(v)))


def keep(cfg: Config, seed, idx: Index):
  """Dropout keep-mask of a tile, (B, K, G, tq, tk) (or (1, 1, 1, tq, tk) when broadcast over
  batch and heads); a pure function of the absolute indices."""
  b, h, q, k = index_grids(cfg, idx)
  if cfg.dropout_broadcast:
    b, h = jnp.zeros_like(b[:1]), jnp.zeros_like(h[:, :1, :1])
  return _dropout.keep_mask(seed, cfg.dropout_rate, b, h, q, k)


def pv(p, v, fold: bool = True):
  """(B,K,G,tq,tk) (rows layout: (B,K,G*tq,tk)) weights times (B,K,tk,H) values; weights in
  the value dtype, fp32 accumulate."""
  return matmul(p.astype(v.dtype), v, "qs,sh->qh", stat_dtype(v.dtype), fold)


# --------------------------------------------------------------------------------------------
# Tile sizes and score functions.
# --------------------------------------------------------------------------------------------

# Default block sizes: the fastest forward and forward+backward of those measured on the CPU
# (docs/benchmarks.md, "Where the defaults come from"); a tuning table overrides them per device.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_KV = 256
# A sliding window (``local_window_size``) at most NARROW_WINDOW keys wide runs with square
# blocks of WINDOW_BLOCK by default: a 512-row block's band spans about 512 + w keys in whole
# 256-key blocks, most of them hidden when w is small (measured on the CPU, same page).
NARROW_WINDOW = 1024
WINDOW_BLOCK = 256


def block_sizes(
  T: int,
  S: int,
  block_q: int | None,
  block_kv: int | None,
  *,
  cap_q: int | None = None,
  cap_kv: int | None = None,
  window: tuple | None = None,
) -> tuple[int, int]:
  """The block sizes a call runs with: the request or the default, never more than T and S.

  ``cap_q``/``cap_kv`` bound only the defaults (ring attention keeps a default block inside one
  zigzag chunk; a block the caller asks for is the caller's choice). ``window``: the call's
  ``(left, right)`` sliding window; one at most NARROW_WINDOW wide defaults to WINDOW_BLOCK."""
  dq, dk = DEFAULT_BLOCK_Q, DEFAULT_BLOCK_KV
  if window is not None and None not in window and window[0] + window[1] + 1 <= NARROW_WINDOW:
    dq = dk = WINDOW_BLOCK
  bq = block_q or min(dq, cap_q or dq)
  bk = block_kv or min(dk, cap_kv or dk)
  return min(bq, T), min(bk, S)


def closure_convert_score_mod(score_mod, tile_shape, dtype, varying_like=(), replay=False):
  """Hoist the arrays a score_mod closes over into explicit arguments, so the chunked custom VJP
  can return their gradients (a learned relative-position table gets its gradient).

  Inside `shard_map` (ring attention) the function is traced on arguments typed device-varying
  like ``varying_like``, and must then be called with arguments typed that way: the jaxpr it
  becomes is replayed as traced, with no automatic casts between varying and invariant values.
  ``replay=True`` returns it as a `jattn._sharding.VaryingReplay`, whose equations are bound
  without the mesh context they were traced under: what a function traced outside a shard_map
  (or in one, on arguments already varying) needs to be called inside it.
  """
  B, N, tq, tk = tile_shape
  ex = (
    jax.ShapeDtypeStruct((B, N, tq, tk), dtype),
    jax.ShapeDtypeStruct((B, 1, 1, 1), jnp.int32),
    jax.ShapeDtypeStruct((1, N, 1, 1), jnp.int32),
    jax.ShapeDtypeStruct((1, 1, tq, 1), jnp.int32),
    jax.ShapeDtypeStruct((1, 1, 1, tk), jnp.int32),
  )
  out = jax.eval_shape(score_mod, *ex)
  if not hasattr(out, "shape") or tuple(out.shape) != (B, N, tq, tk):
    raise ValueError(
      f"score_mod must return an array of the score's shape (B, N, tq, tk)={(B, N, tq, tk)} "
      f"(it is applied tile by tile, so a broadcast result would differ between "
      f"implementations), got {getattr(out, 'shape', type(out).__name__)}"
    )
  if not jnp.issubdtype(out.dtype, jnp.floating):
    raise TypeError(
      f"score_mod must return floating scores, got dtype {out.dtype} "
      f"(to hide positions, use a mask: jattn.masks.from_function)"
    )
  if varying_like:
    ex = tuple(_sharding.varying(jnp.zeros(x.shape, x.dtype), *varying_like) for x in ex)
  converted, consts = jax.closure_convert(score_mod, *ex)
  if replay:
    converted = _sharding.VaryingReplay(jax.make_jaxpr(converted)(*ex, *consts))
  return converted, tuple(consts)
