"""The dispatcher: which registered implementation runs a bound call, per platform.

It reads only the registry (`jattn._registry`): a name given alone runs as asked; a sequence is
tried in order, skipping one that cannot take the call (its ``supports`` gives a reason, or it
raises NotImplementedError while tracing: a warning gives that reason) and one that lowers for
another platform than the program's; ``None`` follows `implementation_by_platform` (below),
with a backend that asks to go first for long calls (splash on a TPU) and a tuning table's
fastest fused kernel in front.
Per-platform choices are made where the program is lowered (`jattn._lowering.by_platform`).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _backends, _lowering, _registry, _softmax, _validation  # noqa: F401
from jattn import masks as _masks
from jattn._chunked import plan as _chunked_plan
from jattn._tile import block_sizes
from jattn._validation import concrete
from jattn.masks import BlockGrid


def run(call):
  """(out (B, T, N, Hv), lse (B, T, N), max logits (B, T, N) or None) of a bound call
  (`jattn._call.Call`): the max logits where the call asks for them (``return_max_logits``)."""
  s = call.static
  if s.T * s.S == 0 or (_validation.concrete(s.B, s.N) and s.B * s.N == 0):
    # No examples, heads, queries or keys: nothing to compute, whatever the implementation (a
    # kernel's plan would divide by the empty sizes, splash's block map reduce over them). The
    # answer is jax.nn's: empty, or with no keys every row sees nothing, so 0 (and an lse of
    # NEG, or of the row's sink alone: the sinks' gradient flows through it).
    rows = (s.B, s.T, s.N)
    mx = jnp.full(rows, -jnp.inf, s.stat_dtype) if call.opts.return_max_logits else None
    if call.sink is None:
      lse = jnp.full(rows, _softmax.NEG, s.stat_dtype)
    else:
      lse = jnp.broadcast_to(call.sink.reshape(s.N), rows)
    return jnp.zeros(rows + (s.Hv,), s.dtype), lse, mx
  names = _validation.implementation_names(call.opts.implementation)
  runners = {name: functools.partial(attempt, name, call) for name in _registry.REGISTRY}
  if len(names) == 1:
    res = runners[names[0]]()
  else:
    fns = _takers(names, runners, say_skipped=True) if names else automatic(call, runners)
    res = _lowering.by_platform(fns)
  out, lse, *mx = res
  return out, lse, (mx[0] if mx else None)


def attempt(name: str, call):
  """Run the backend ``name`` on ``call``, or raise the NotImplementedError its ``supports``
  (or its lack of the max logits a call asks for) gives."""
  backend = _registry.get(name)
  why: str | None
  if call.opts.return_max_logits and backend.max_logits is not None:
    why = f"return_max_logits: {backend.max_logits}; 'chunked' and 'dense' return them"
  else:
    why = backend.supports(call)
  if why is not None:
    raise NotImplementedError(f"implementation={name!r} does not support {why}")
  return backend.run(call)


def automatic(call, runners) -> dict:
  """implementation=None: {platform or "default": runner}, the first of `order`'s names per
  platform that takes the call."""
  fns = {}
  for platform, names in order(call).items():
    takers = _takers(names, runners)
    fns[platform] = takers.get(platform, takers.get("default"))
  return fns


def order(call) -> dict:
  """The decision behind implementation=None: {platform or "default": names to try in order}.

  `implementation_by_platform`'s rule, with each registered backend whose ``first``
  holds for the call in front on its platforms (splash on a TPU, cuDNN on a GPU). A tuning table
  entry for the case says otherwise where it measured otherwise (measured wins over reasoned):
  a fused kernel it names goes first; "chunked" or "dense" goes first and the fused kernel is
  not tried."""
  s = call.static
  decoding = _chunked_plan.decoding(s.T, s.S, s.G)
  first = {}  # platform -> the backend that asks to go first there
  for name, backend in _registry.REGISTRY.items():
    if backend.first is not None and backend.first(call) and backend.traced_cheaply(call):
      first.update(dict.fromkeys(backend.platforms or (), name))
  choice = implementation_by_platform(
    (s.B, s.N, s.T, s.S),
    s.G,
    s.dtype,
    call.mask,
    fused=first,
    keys_split=s.split.kv_shards is not None,
  )
  tuned = s.tuned.implementation
  if tuned in ("chunked", "dense") and not decoding:
    # Measured: jattn's kernels beat the device's fused kernel for calls like this one.
    for platform in first:
      choice[platform] = (tuned,) + tuple(
        n for n in choice[platform] if n != tuned and not _registry.get(n).fused
      )
  elif (
    tuned in _registry.REGISTRY
    and s.split.unpartitioned
    and s.split.kv_shards is None
    and not decoding
    and _registry.get(tuned).traced_cheaply(call)
  ):
    # The device's tuning table measured its fused kernel faster for calls like this one
    # (square ones: decoding-shaped calls share a length bucket but were not measured). Only
    # where the program cannot be partitioned, as for splash above: jax.nn's cuDNN call
    # refuses sequence-sharded inputs when the program is partitioned, after tracing.
    for platform in _registry.platforms(tuned) or ():
      rest = choice.get(platform, choice["default"])
      choice[platform] = (tuned,) + tuple(n for n in rest if n != tuned)
  return choice


def _takers(names, runners, say_skipped=False):
  """{platform or "default": runner}: per platform, the first of ``names`` that takes the call
  (tokamax's rule: fall through on NotImplementedError). One that lowers only for some platforms
  serves those; the first that lowers anywhere serves the rest ("default").

  Whether an implementation takes the call is found by tracing it once aside
  (`jax.eval_shape`): inside `platform_dependent` an error could not be told from its siblings'.
  The last universal candidate is not tried aside: its own error, if any, is the call's.

  ``say_skipped`` (a sequence the caller named): one that cannot take the call and is skipped
  is reported in a warning with its reason, the error it would raise asked for alone (no
  implementation taking the call: one error with every reason)."""
  if len(names) == 1:
    return {"default": runners[names[0]]}
  fns, errors = {}, []
  for i, name in enumerate(names):
    platforms = _registry.platforms(name)
    if platforms is not None and all(p in fns for p in platforms):
      continue
    if platforms is not None or i < len(names) - 1:
      try:
        jax.eval_shape(runners[name])
      except NotImplementedError as e:
        errors.append(str(e))
        continue
    if platforms is None:
      fns["default"] = runners[name]
      break
    for p in platforms:
      fns.setdefault(p, runners[name])
  if not fns:
    raise NotImplementedError("no implementation takes this call: " + "; ".join(errors))
  if say_skipped and errors:
    warnings.warn(f"implementation={names!r} fell through: " + "; ".join(errors), stacklevel=2)
  return fns


# --------------------------------------------------------------------------------------------
# The rule behind implementation=None.
# --------------------------------------------------------------------------------------------

# implementation=None picks chunked once the (T, S) score matrix per head reaches this many
# entries. Below it dense's single fused pass wins; above it dense is limited by the (T, S)
# temporaries falling out of cache (and by their memory). Measured crossover: see README (and
# docs/benchmarks.md).
AUTO_CHUNKED_MIN_SCORES = 1024 * 1024


# implementation=None on GPU and TPU, where no fused kernel takes the call: dense while the
# (B, N, T, S) float32 scores fit in this many bytes, chunked beyond. Reasoned, not measured: an
# accelerator's dense pass (one batched matmul, one softmax) is fast while its score tensor is a
# small part of device memory; its backward holds about four such tensors, so 256 MiB of scores
# keeps it near the chunked kernels' 1 GiB (B=4, N=16, T=S=2048 was 1 GiB of scores and 3.6 GiB
# of temporaries forward+backward; the chunked kernels' is ~0.5 GiB there).
ACCELERATOR_DENSE_SCORES_BYTES = 256 << 20


# implementation=None on the CPU runs a `masks.selected_blocks` selection through "sparse" (each
# query's chosen blocks only) where the chunked kernels would run, when its blocks hold at least
# SPARSE_MIN_BLOCK keys and a query reads at most SPARSE_MAX_KEYS of them (n x block <= that x S):
# a chunk's matmul is G x 128 rows against one block, slow for small blocks (DSA's tokens), and
# past the fraction the chunked kernels' larger tiles win although they read every key.
# Measured (benchmarks/sparse_bench.py --sweep, causal, fwd+bwd; docs/benchmarks.md, "Where the
# defaults come from"): blocks of 64 cost as much as chunked at n x block ~ 0.53 S, blocks of 16
# take 0.58x chunked's time at 1/8 of the keys, tokens (block 1) 2.6x.
SPARSE_MIN_BLOCK = 16
SPARSE_MAX_KEYS = 0.25


def sparse_enough(mask, S: int) -> bool:
  """Whether ``mask`` holds one `masks.selected_blocks` (among its &-ed parts) of blocks of at
  least SPARSE_MIN_BLOCK keys naming at most SPARSE_MAX_KEYS of the S keys per query."""
  chosen, _ = _masks.split_selection(mask)
  selection = chosen[0].selection() if len(chosen) == 1 else None
  if selection is None:
    return False
  indices, block = selection
  return block >= SPARSE_MIN_BLOCK and indices.shape[-1] * block <= SPARSE_MAX_KEYS * S


def choose_implementation(T: int, S: int, G: int = 1, dtype=None, mask=None, shape=None) -> str:
  """The CPU's rule behind implementation=None: dense for small score matrices, chunked
  otherwise (the crossover measured on the CPU), and chunked for decoding-shaped calls -- except
  a 16-bit call with few rows whose ``mask`` (the call's `jattn.masks` object over ``shape``) has
  a block map known at trace time: XLA's CPU backend then converts the whole cache to float32
  ahead of the kernel's loop, and dense wins below T x G = 32 rows. The figures behind each
  branch: docs/benchmarks.md, "Where the defaults come from"."""
  if T * S >= AUTO_CHUNKED_MIN_SCORES:
    return "chunked"
  if not _chunked_plan.decoding(T, S, G):
    return "dense"
  narrow = dtype is not None and jnp.dtype(dtype).itemsize < 4
  return "dense" if narrow and T * G <= 8 and static_block_map(mask, T, S, shape) else "chunked"


def static_block_map(mask, T: int, S: int, shape) -> bool:
  """Whether ``mask`` (a `jattn.masks` object or None) has a block map known at trace time."""
  if mask is None:
    return True
  grid = BlockGrid(T, S, *block_sizes(T, S, None, None))
  return isinstance(_masks.reduce_states(mask.block_states(grid, shape), shape), np.ndarray)


def implementation_by_platform(
  scores: tuple[int, int, int, int],
  G: int = 1,
  dtype=None,
  mask=None,
  fused=None,
  keys_split: bool = False,
) -> dict[str, tuple[str, ...]]:
  """implementation=None per platform ({"cpu": names, "default": names, maybe "tpu": names}):
  the implementations to try in order, picked where the program is lowered. ``scores``: the
  call's (B, N, T, S), the shape of its score matrices (as `choose_implementation` takes it).

  GPU and TPU (reasoned, not measured): decoding-shaped calls go to the chunked kernels (their
  parallel schedule splits the cache over lanes, split-KV), others to dense while the
  (B, N, T, S) float32 scores fit ACCELERATOR_DENSE_SCORES_BYTES, and beyond that to the chunked
  kernels -- and before either, at every size, to the platform's fused kernel where ``fused``
  ({platform: name}) names one that takes the call (`jattn._registry.Backend.first`: splash on
  a TPU, cuDNN on a GPU for 16-bit calls, where the program cannot be partitioned). A fused
  kernel reads each score tile once from on-chip memory, where XLA's dense pass writes the
  (B, N, T, S) scores to HBM and reads them back; published figures put cuDNN's and
  FlashAttention-3's forward at about 65% of an H100's peak and XLA-only attention several
  times slower. Decoding-shaped calls keep split-KV (a fused kernel would pad their few query
  rows to a whole block). ``keys_split``: K and V are split along S over devices (an Explicit
  mesh): the chunked kernels merge per-shard parts across devices, where dense would gather
  the whole of K and V (a decoding step's cache). A tuning table can say otherwise for its case
  (see `jattn._dispatch.order`).

  A `masks.selected_blocks` selection sparse enough (`sparse_enough`) runs through "sparse" on
  the CPU where chunked would run (measured), falling through to chunked for a call it refuses;
  not on GPU and TPU: not measured there, and its chunk loop is thousands of small sequential
  steps, each a few kernel launches on a GPU."""
  # A symbolic batch or head count (jax.export) bounds nothing: the program must serve every
  # size, so the scores are taken not to fit.
  if keys_split:
    return {"default": ("chunked",)}
  B, N, T, S = scores
  decode = _chunked_plan.decoding(T, S, G)
  cpu = choose_implementation(T, S, G, dtype, mask, scores)
  fits = concrete(B, N) and B * N * T * S * 4 <= ACCELERATOR_DENSE_SCORES_BYTES
  accelerator = "dense" if fits and not decode else "chunked"
  choice: dict[str, tuple[str, ...]] = {"cpu": (cpu,), "default": (accelerator,)}
  if cpu == "chunked" and not decode and sparse_enough(mask, S):
    # Tried first; a call it refuses (a bias, dropout, ...) falls through to chunked.
    choice["cpu"] = ("sparse", cpu)
  if not decode:
    for platform, name in (fused or {}).items():
      choice[platform] = (name, accelerator)
  return choice
