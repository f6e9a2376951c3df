"""The program of a planned paged_attention call: the sequences whose metadata breaks the rules
found and run as empty ones, the query rows cut into tiles, every tile's running softmax from
the walk the platform gets -- the XLA walk (one lane on the CPU, split-KV lanes on accelerators)
or jattn's Pallas kernel on a TPU or an NVIDIA GPU, chosen where the program is lowered -- and
one epilogue for all of them: sinks, normalisation, log-sum-exp, rows back in place, NaN rows
of faulty sequences.

Shapes: B sequences, T new tokens each (or ``total`` ragged rows), N query heads, K key/value
heads, G = N // K, Hv value head size; M tiles of tq rows (R = G * tq rows per tile and head).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jattn import _lowering, _softmax, _tile
from jattn._chunked.plan import SPLIT_KV_PARTS
from jattn._paged import metadata, pallas_gpu, pallas_tpu, selected, tiles, walk
from jattn._paged.plan import PAGED_BLOCK_KV, PagedPlan, Queries, why_no_kernel
from jattn._paged.pool import Pool
from jattn._validation import concrete


def attend(st: PagedPlan, queries: Queries, pool: Pool):
  """(out (B, T, N, Hv) or (total, N, Hv) in the query's dtype, log-sum-exp (B, T, N) or
  (total, N)) of a checked call; forward only."""
  if concrete(st.B) and st.B * st.rows == 0:
    return _nothing_to_attend(st, queries.query)
  return _attend(st, queries, pool)


def _nothing_to_attend(st: PagedPlan, query):
  """No sequences (B = 0) or no query rows: every row there is (ragged rows past
  query_start[0] = 0) belongs to no sequence, output 0 and log-sum-exp NEG, as documented."""
  lead = query.shape[:-2]
  return (
    jnp.zeros(lead + (st.N, st.Hv), st.dtype),
    jnp.full(lead + (st.N,), _softmax.NEG, _tile.stat_dtype(st.dtype)),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st: PagedPlan, queries: Queries, pool: Pool):
  return _jitted(st, queries, pool)


def _attend_fwd(st, queries, pool):
  return _attend(st, queries, pool), None


def _attend_bwd(st, res, ct):
  raise NotImplementedError(
    "paged_attention is forward only (serving): its gradient is not implemented; for "
    "training use dot_product_attention on contiguous keys and values"
  )


_attend.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def _jitted(st: PagedPlan, queries: Queries, pool: Pool):
  """`attend`'s program: (out, lse) as it returns them."""
  # A sequence whose metadata breaks the rules runs as an empty one and comes back NaN.
  g = metadata.Geometry(pool.key_pages.shape[0], st.page_size * st.sub, st.rows, st.ragged)
  md = metadata.Metadata(
    pool.page_table, pool.kv_lengths, queries.query_start, queries.new_token_mask
  )
  bad = metadata.faults(jnp, g, md) != metadata.OK
  at = metadata.owners(jnp, queries.query_start, st.rows, bad)
  pool = pool._replace(kv_lengths=jnp.where(bad, 0, pool.kv_lengths.astype(jnp.int32)))
  if st.selected:  # each row reads its chosen keys: no tiles, rows already in place
    out, lse = selected.attend(st, queries, pool, at)
    return _in_place(st, at, out), _in_place(st, at, lse[..., None])[..., 0]
  programs = _programs(st)  # the plan alone decides which walk each platform runs
  t = tiles.cut(st, at, pool.kv_lengths, queries.new_token_mask)
  q = tiles.gather(st, queries.query, t)  # (M, K, G * tq, H)
  landing = tiles.landing(st, t)
  m, l, acc = _lowering.by_platform(
    {platform: functools.partial(run, q, t, pool) for platform, run in programs.items()}
  )
  if queries.sinks is not None:
    sink = jnp.repeat(queries.sinks.astype(jnp.float32).reshape(1, st.K, st.G, 1), st.tq, -1)
    m, l, acc = _softmax.join_sink(m, l, acc, sink.reshape(1, st.K, st.G * st.tq))
  out = _softmax.normalize(acc, l, m, 0.0).astype(st.dtype)  # (M, K, G * tq, Hv)
  lse = _softmax.lse(m, l)[..., None]
  # Tile rows back to the query's rows: ``fill`` where none lands.
  n, M = (st.rows if st.ragged else st.B * st.rows), q.shape[0]
  back = []
  for x, fill in ((out, 0.0), (lse, _softmax.NEG)):
    X = x.shape[-1]
    x = jnp.transpose(x.reshape(M, st.K, st.G, st.tq, X), (0, 3, 1, 2, 4))
    x = x.reshape(M * st.tq, st.N, X)
    x = jnp.full((n, st.N, X), fill, x.dtype).at[landing].set(x, mode="drop", unique_indices=True)
    back.append(_in_place(st, at, x))
  return back[0], back[1][..., 0]


def _in_place(st: PagedPlan, at, x):
  """Rows (n, N, X) as the query lays them out, NaN where only a faulty sequence claims the
  row."""
  x = jnp.where(at.lost[:, None, None], jnp.asarray(jnp.nan, x.dtype), x)
  return x.reshape((st.B, st.rows) + x.shape[1:]) if not st.ragged else x


def _programs(st: PagedPlan) -> dict[str, Any]:
  """{platform: (q, tiles, pool) -> every tile's (m, l, acc)}: the XLA walk (one lane on the
  CPU, split-KV lanes on accelerators) and, where the call asks for it or leaves the choice,
  jattn's Pallas kernels on a TPU and an NVIDIA GPU (or anywhere in their interpret modes)."""
  run: dict[str, Any] = {}
  for platform in ("cpu", "default"):
    sp = st.with_block(PAGED_BLOCK_KV[platform])._replace(upcast=platform == "cpu")
    lanes = 1 if platform == "cpu" else min(SPLIT_KV_PARTS, sp.blocks)
    run[platform] = functools.partial(walk.walk, sp, lanes)
  if st.implementation == "chunked":
    return run
  kernels: dict[str, Any] = {}  # a kernel, or why it cannot take the call
  for platform, module, why in (
    ("tpu", pallas_tpu, None),
    ("cuda", pallas_gpu, pallas_gpu.supports(st)),
  ):
    why = why_no_kernel(st) or why
    kernels[platform] = why if why is not None else functools.partial(module.walk, st)
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
    return _refusals(st, kernels)
  return dict(run, **{p: k for p, k in kernels.items() if not isinstance(k, str)})


def _refusals(st: PagedPlan, kernels: dict[str, Any]) -> dict[str, Any]:
  """implementation="pallas": the kernels where they take the call, and everywhere else a
  stand-in that fails where the program is lowered, saying why."""
  message = (
    "paged_attention(implementation='pallas') runs jattn's Pallas kernels on a TPU "
    "or an NVIDIA GPU: this program is lowered for {platform}. On a CPU, run it "
    "inside jax.experimental.pallas.tpu.force_tpu_interpret_mode() (slow; for "
    "tests), or use implementation=None (the kernels where they run, the XLA walk "
    "elsewhere)"
  )

  def fail(why):
    def run(q, _tiles, _pool):
      M, R = q.shape[0], st.G * st.tq
      like = (jax.ShapeDtypeStruct((M, st.K, R), jnp.float32),) * 2 + (
        jax.ShapeDtypeStruct((M, st.K, R, st.Hv), jnp.float32),
      )
      return _lowering.unavailable(why, like, q)

    return run

  return {"default": fail(message)} | {
    p: fail(f"implementation='pallas' on {p} cannot take {k}") if isinstance(k, str) else k
    for p, k in kernels.items()
  }
