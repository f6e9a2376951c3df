"""The softmax algebra: running statistics, their update, merges, sinks and the finish.

softmax(s)_j = exp(s_j - m) / sum_i exp(s_i - m) for any m; taking m = max_i s_i keeps every
exponent <= 0, so nothing overflows (the max trick). Attention over a row is then carried as
three numbers per row and one vector: the running max ``m``, the sum ``l = sum exp(s - m)``, and
``acc = sum exp(s - m) v``; its log-sum-exp is ``lse = m + log(l)`` and its output ``acc / l``.

Two results over disjoint key sets merge exactly through their log-sum-exps (`merge_pair`,
`merge_over_devices`, `merge_stacked`); a sink (a logit with no value) joins the denominator
(`join_sink` for running statistics, `add_sink` for a finished result). Every kernel, the lane
merge, the device merges, ring attention and `jattn.merge_attention` use these; no other module
writes this math.

A row with nothing to attend to keeps ``m = NEG`` (every logit there was set to NEG, a finite
stand-in for -inf): its output is 0 and its lse NEG, never NaN (`empty_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Masked logits are set to a finite large negative, never -inf: exp(NEG - m) underflows to an
# exact 0 and `max` over a fully masked row stays finite, so no inf - inf = NaN can arise.
# Float32's range is used for every statistics dtype (as jax.nn does) so it survives a cast.
NEG = float(-0.7 * np.finfo(np.float32).max)


def stat_dtype(dtype):
  """Softmax statistics are float32 for 16-bit inputs (float64 stays float64)."""
  # Not jnp.promote_types: under jax_numpy_dtype_promotion='strict' it refuses (bfloat16, float32).
  return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def start(like, sink=None):
  """Running statistics (m, l) for rows shaped like ``like``: nothing seen (m NEG, l 0), or,
  with a ``sink`` broadcastable to it, the sink as the first logit (m = sink, l = 1)."""
  row0 = jnp.zeros_like(like)
  if sink is None:
    return row0 + jnp.asarray(NEG, like.dtype), row0
  return row0 + sink.astype(like.dtype), row0 + jnp.ones((), like.dtype)


def update(m, l, s, key_axes=(-1,), total=None):
  """One tile ``s`` (rows, keys) of logits into the running (m, l): returns (m', p, corr, l')
  with p = exp(s - m') the tile's unnormalised weights and corr = exp(m - m') the factor that
  rescales what was accumulated so far (acc' = acc * corr + p v). ``key_axes``: s's key axes
  (a tile whose keys come in pieces has two); m and l have s's shape without them.

  Masked entries (NEG) give exact zeros once the row has seen a visible key; before that
  (m' = NEG) they add junk that corr = exp(NEG - m) = 0 wipes when a visible key comes, and
  `normalize` discards if none ever does. ``total(p, axes)``: the row sum, `ordered_sum` unless
  given (a Pallas kernel's program sums one tile, the same shape whatever the batch holds, with
  its compiler's own reduction: Triton lowers no slices)."""
  m_new = jnp.maximum(m, s.max(axis=key_axes))
  p = jnp.exp(s - jnp.expand_dims(m_new, key_axes))
  corr = jnp.exp(m - m_new)
  row_sum = ordered_sum(p, key_axes) if total is None else total(p, key_axes)
  return m_new, p, corr, l * corr + row_sum


def ordered_sum(x, axes=(-1,)):
  """``x`` summed over ``axes`` in one fixed order: halves added pairwise, level by level.

  A reduction's order is otherwise the compiler's choice, and XLA picks it by shape: the same
  row summed in a batch of 4 and alone can round differently (measured on the CPU). A sum over a
  row's keys written as elementwise adds depends on nothing but the number of keys, so a row's
  softmax is the same bits whatever else the batch holds (batch invariance)."""
  axes = sorted(a % x.ndim for a in (axes if isinstance(axes, tuple) else (axes,)))
  for a in reversed(axes):
    x = _pairwise(x, a)
  return x


def _pairwise(x, axis):
  n = x.shape[axis]
  if n == 1:
    return jnp.squeeze(x, axis)
  h = n // 2
  part = lambda lo, hi: jax.lax.slice_in_dim(x, lo, hi, axis=axis)
  total = _pairwise(part(0, h) + part(h, 2 * h), axis)
  return total + jnp.squeeze(part(2 * h, n), axis) if n % 2 else total


def exp_rows(s, sink=None, *, keys_max=False):
  """The whole row at once (dense attention): (p, l, m) with p = exp(s - m), l its sum (the
  sink's term included). The max only shifts the exponent (softmax(x) = softmax(x - c)); its
  gradient cancels, so it is a constant for autodiff. Starting from NEG keeps all-masked rows
  finite: their p is junk that `normalize` and `lse` discard. ``keys_max``: also the max over
  the keys alone, before the sink joins (for `row_max`)."""
  neg = jnp.asarray(NEG, s.dtype)
  m = m_keys = jax.lax.stop_gradient(jnp.maximum(s.max(axis=-1), neg))
  if sink is not None:
    m = jnp.maximum(m, jax.lax.stop_gradient(sink))
  p = jnp.exp(s - m[..., None])
  # XLA's own reduction, not `ordered_sum`: the dense scores' key axis may be sharded
  # (sequence-sharded keys), and pairwise halves of a sharded axis move data between devices.
  # (Batch invariance of dense holds by test: the reduction over the minor axis.)
  l = p.sum(axis=-1)
  if sink is not None:
    l = l + jnp.exp(sink - m)
  return (p, l, m, m_keys) if keys_max else (p, l, m)


def probabilities(s, lse):
  """P = exp(s - lse) from a row's final log-sum-exp (the backward's recompute): exact 0 where
  a logit was masked (NEG) and in rows with nothing to attend to (their lse is +inf, see
  `lse_for_recompute`)."""
  return jnp.exp(s - lse)


def join_sink(m, l, acc, sink):
  """Running statistics with the sink joined: the denominator gains exp(sink - m'); the sink
  takes no value, so acc is only rescaled."""
  m2 = jnp.maximum(m, sink)
  corr = jnp.exp(m - m2)
  return m2, l * corr + jnp.exp(sink - m2), acc * corr[..., None]


def merge_into(rows, at, part):
  """Merge finished parts into their rows' running statistics (the parallel schedule: a part is
  the share of a row's keys one lane saw; parts of a row saw disjoint keys).

  ``rows`` = (m, l, acc) of R rows (leading axis R); ``part`` = (m, l, acc) of W parts (leading
  axis W) and ``at`` (W,) their rows, no two alike (see `distinct_rounds`; R or more: no part,
  dropped). Each row that gets a part is rescaled to the larger max and the part added; the
  writes are scatters with unique indices, so no two updates race (no atomics on a GPU). A row
  that held nothing (m NEG, l 0) takes the part bit for bit: exp(NEG - m) is 0, x * 1 + 0 is x.
  Returns the rows' (m, l, acc)."""
  m_r, l_r, acc_r = rows
  m, l, acc = part
  take = lambda x: jnp.take(x, at, axis=0, mode="clip")  # a dropped part reads any row
  old = take(m_r)
  new = jnp.maximum(old, m)
  keep, w = jnp.exp(old - new), jnp.exp(m - new)

  def fold(x_r, x):
    by_row = lambda s: s.reshape(s.shape + (1,) * (x.ndim - s.ndim))
    return _put(x_r, at, take(x_r) * by_row(keep) + x * by_row(w))

  return _put(m_r, at, new), fold(l_r, l), fold(acc_r, acc)


def _put(x_r, at, x):
  return x_r.at[at].set(x, mode="drop", unique_indices=True)


def add_into(rows, at, part):
  """Add parts (leading axis W, rows ``at``, no two alike, see `distinct_rounds`; R or more:
  dropped) into R rows (a pytree of sums: dK and dV per key block, dQ per query block)."""
  return jax.tree.map(lambda r, x: r.at[at].add(x, mode="drop", unique_indices=True), rows, part)


def distinct_rounds(at, R: int, rounds: int):
  """``at`` (W,): the rows of W parts, a row possibly repeated (up to ``rounds`` times among the
  rows below R), as ``rounds`` index vectors without repeats, for scatters with unique indices.

  Round r holds each part that has r earlier parts of its row (so a row's parts are merged in
  the order they stand in ``at``); every other entry points past the rows at R + its place
  (distinct, dropped). A floating-point scatter-add over repeated indices runs as atomics on a
  GPU, whose order, and so whose rounding, changes from run to run; the rounds make the order
  part of the program."""
  W = at.shape[0]
  place = jnp.arange(W, dtype=jnp.int32)
  at = at.astype(jnp.int32)
  rank = ((at[None, :] == at[:, None]) & (place[None, :] < place[:, None])).sum(axis=1)
  keep = (at >= 0) & (at < R)
  return [jnp.where(keep & (rank == r), at, R + place) for r in range(rounds)]


def merge_lanes(m, l, acc):
  """Merge the running statistics of lanes (the leading axis) that saw disjoint keys of the same
  rows (split-KV): one max, the sums and accumulators rescaled to it."""
  m_r = m.max(axis=0)
  w = jnp.exp(m - m_r[None])
  return m_r, ordered_sum(w * l, 0), ordered_sum(w[..., None] * acc, 0)


def no_rows(like, R: int, fill=0.0):
  """R rows shaped like one part of ``like`` (leading axis: parts), filled with ``fill``; made from
  ``like``, so they share its sharding under an Explicit mesh."""
  return jnp.zeros_like(like[:1]).repeat(R, axis=0) + jnp.asarray(fill, like.dtype)


def empty_rows(m, l):
  """Rows that saw no visible key: their running max m is still NEG (every logit was set to NEG).

  For such a row exp(s - m) = exp(NEG - NEG) = 1 on its masked entries, so its sum and
  accumulator hold junk; they are discarded here instead of zeroing every masked probability
  with a second select over the (tq, tk) tile. For any other row exp(NEG - m) is an exact 0.

  Only the mask can leave a row's max at NEG, so emptiness is never read from the sum: a NaN or
  +inf logit at a visible position must propagate to the output as in jax.nn, not pass for an
  empty row and become 0. XLA's max reductions may drop a NaN (CPU's vector max does), leaving
  m at NEG; the sum of such a row is NaN, while an empty row's sum counts its masked entries,
  so ``l`` tells the two apart. A row that is not empty has l >= 1 (its max term).
  """
  return (m <= jnp.asarray(NEG, m.dtype)) & ~jnp.isnan(l)


def row_max(m, l):
  """Each row's max logit over its visible keys (``return_max_logits``) from its running max
  ``m`` over the keys alone (a sink is not a key: it has not joined m) and its sum ``l``: -inf
  for a row with nothing to attend to (see `empty_rows`). A statistic, constant for autodiff."""
  empty = empty_rows(m, l)
  return jax.lax.stop_gradient(jnp.where(empty, jnp.asarray(-jnp.inf, m.dtype), m))


def max_over_devices(x, axes):
  """Inside a shard_map: the max of every device's `row_max` over its own keys, on every
  device (exact: a max of maxes; -inf where no device saw a key)."""
  return jax.lax.pmax(x, axes)


def lse(m, l):
  """log-sum-exp of a row from its max and sum; NEG for a row with nothing to attend to."""
  ok = ~empty_rows(m, l)
  return jnp.where(
    ok, m + jnp.log(jnp.where(ok, l, jnp.ones((), l.dtype))), jnp.asarray(NEG, m.dtype)
  )


def normalize(acc, l, m, dropout_rate: float):
  """acc / l with exact 0 (not NaN, not junk) for empty rows; dropout's 1 / (1 - rate) folded in."""
  ok = ~empty_rows(m, l)
  denom = jnp.where(ok, l, jnp.ones((), l.dtype))
  if dropout_rate > 0:
    denom = denom * jnp.asarray(1.0 - dropout_rate, l.dtype)
  return jnp.where(ok[..., None], acc / denom[..., None], jnp.zeros((), acc.dtype))


def lse_for_recompute(lse):
  """The log-sum-exp the backward pass divides by: +inf for empty rows, so that their recomputed
  probabilities exp(s - lse) are exact zeros without a select over the tile."""
  return jnp.where(lse <= jnp.asarray(NEG, lse.dtype), jnp.asarray(jnp.inf, lse.dtype), lse)


def returned_lse(lse, dtype):
  """A returned log-sum-exp in ``dtype``: a row with nothing to attend to keeps a finite very
  negative value there (float16's range is small: the kernels' sentinel would become -inf)."""
  return jnp.maximum(lse, jnp.asarray(jnp.finfo(dtype).min, lse.dtype)).astype(dtype)


def merge_pair(out_a, lse_a, out_b, lse_b):
  """Exact merge of two results over disjoint key sets, in the statistics dtype.

  The kernels mark a row with nothing to attend to by the finite lse NEG and output 0, so the
  weights stay finite: two NEG rows give weights (1, 1), out 0 and lse NEG + log 2 (= NEG in
  float32); a NEG row against a real one gets weight exp(NEG - lse) = 0.
  """
  m = jnp.maximum(lse_a, lse_b)
  wa = jnp.exp(lse_a - m)
  wb = jnp.exp(lse_b - m)
  tot = wa + wb  # >= 1
  out = (out_a * wa[..., None] + out_b * wb[..., None]) / tot[..., None]
  return out, m + jnp.log(tot)


def merge_over_devices(out, lse, axes):
  """Inside a shard_map: the exact merge of every device's result over its own key shard (out
  (B, T, N, H), lse (B, T, N)) into the result over all keys, on every device; a psum of the
  weighted outputs and of the weights, as `merge_pair` does for two parts (rows empty
  everywhere stay out 0, lse about NEG). Differentiable: only the shift is held constant."""
  sd = lse.dtype
  m = jax.lax.pmax(jax.lax.stop_gradient(lse), axes)
  w = jnp.exp(lse - m)
  tot = jax.lax.psum(w, axes)  # >= 1
  merged = jax.lax.psum(out.astype(sd) * w[..., None], axes) / tot[..., None]
  return merged, m + jnp.log(tot)


def merge_stacked(outs, lses, sd):
  """The merge of n stacked results (outs (n, ..., H), lses (n, ...)) in dtype ``sd``, for
  parts given by a caller: their lse may be -inf (not only NEG) where a part saw nothing, so
  the shift of a row that is -inf everywhere is 0 (exp(-inf - 0) = 0, not exp(-inf + inf) =
  NaN), and a row with no weight anywhere keeps its lse with output 0."""
  o = outs.astype(sd)
  l = lses.astype(sd)
  m = l.max(axis=0)
  # The shift only conditions the exponent (its gradient cancels).
  shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, jnp.zeros((), sd)))
  w = jnp.exp(l - shift[None])  # (n, ...)
  tot = w.sum(axis=0)
  ok = tot > 0
  safe_tot = jnp.where(ok, tot, jnp.ones((), sd))
  out = (w[..., None] * o).sum(axis=0) / safe_tot[..., None]
  return out, jnp.where(ok, shift + jnp.log(safe_tot), m)


def add_sink(out, lse, sink):
  """Merge the sink -- one more logit per row, with no value -- into a finished result (out
  (B, T, N, H), lse (B, T, N), sink (N,)): the softmax denominator gains exp(sink), so the output
  shrinks by exp(lse - lse'). An empty row (lse NEG, out 0) ends with lse = sink and out 0, as
  in the single-device kernel."""
  N = lse.shape[-1]
  s = sink.astype(lse.dtype).reshape(1, 1, N)
  m = jnp.maximum(lse, s)
  tot = jnp.exp(lse - m) + jnp.exp(s - m)
  return out * (jnp.exp(lse - m) / tot)[..., None], m + jnp.log(tot)


def output_delta(dout, out):
  """rowsum(dO * O) per query, (B, T, N) in the statistics dtype: the softmax backward's
  d loss / d s = P * (dP - delta)."""
  sd = stat_dtype(out.dtype)
  return jnp.einsum("btnh,btnh->btn", dout.astype(sd), out.astype(sd))


def sink_gradient(sink, lse, delta):
  """d loss / d sink for a (1, K, G, 1) sink, from the rows' final lse and delta (B, T, N).

  d out / d sink = -p_sink * out, so d loss / d sink = -sum_rows exp(sink - lse) * delta; rows
  without a gradient (padding) have delta = 0."""
  K, G = sink.shape[1], sink.shape[2]
  p_sink = jnp.exp(sink.astype(lse.dtype).reshape(1, 1, K * G) - lse)
  return (-(p_sink * delta).sum(axis=(0, 1))).reshape(sink.shape).astype(sink.dtype)
