"""The chunked kernels (and the sparse path's, `whole_sequences`) as one custom-partitioned
operation, for programs XLA partitions itself.

Under plain ``jax.jit`` on sharded arrays (an Auto mesh, or no mesh set at all) an array's
sharding is decided by XLA's partitioner after jattn has traced the call, so jattn cannot pick
the work split while it traces. Left to the partitioner, the chunked kernels' loops, which take
query blocks out of Q at loop indices, need the whole Q on every device: a sequence-sharded
query was gathered and the whole attention computed on every device.

Here the kernels become one operation with a partitioning rule
(`jax.experimental.custom_partitioning`): when the program is partitioned, the rule reads the
query's sharding and runs the kernels on each device's part, the way dense attention's
partitioned matmuls do:

- examples (B) and heads (N, in whole GQA groups: K divisible by the axis size) split as the
  query is: nothing moves;
- query rows (T) split as the query is: K and V are gathered along S, masks, ``score_mod`` and
  dropout see each device's rows at their global positions, the output comes back sharded like
  the query; the backward adds the devices' dK, dV partial sums (an all-reduce, as jax.nn's);
- keys (S), where the query rows are whole and K, V are sharded along S (a decoding step against
  a sharded cache): each device attends to its own keys and the parts are merged through their
  log-sum-exps (split-KV over devices); the backward runs on each device's keys from the merged
  statistics, so dK and dV stay sharded and only dQ's partial sums are added;
- everything else (lengths, segment ids, a boolean mask array, the sinks) is read whole and each
  device takes its examples' and heads' part.

Where the program is not partitioned (one device, inside a `jax.shard_map`) the operation is the
plain computation. Under `jax.vmap` it is too (the primitive has no batching rule: a
`jax.custom_batching.custom_vmap` maps the plain computation instead), and XLA partitions a
vmapped call as ordinary code. Derivatives (`jattn._derivatives.with_derivatives`): reverse mode
is a second partitioned operation, the kernels' backward pass on each device's part from the
forward's output and log-sum-exp; forward mode is JAX's tangent of the plain computation.

Shapes: q (B, T, N, H), k and v (B, S, K, H), bias (B|1, K|1, G|1, T|1, S|1), sinks (1, K, G, 1);
out (B, T, N, H), lse (B, T, N).

One cost: a program partitioned over several devices that holds such an operation cannot be
serialized by `jax.export` (its rule is a Python callback). `jattn.auto_partitioning(False)`
turns the operation off for the calls traced inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import custom_batching
from jax.experimental.custom_partitioning import (
  ArrayMapping,
  SdyShardingRule,
  custom_partitioning,
)
from jax.sharding import NamedSharding, PartitionSpec

from jattn import _call, _derivatives, _sharding, _softmax
from jattn import masks as _masks

# Part of jit's cache key (a function traced with the rule on is traced anew with it off).
_ENABLED = jax.make_user_context(True)


@contextlib.contextmanager
def auto_partitioning(enabled: bool = True):
  """Within this context, chunked and sparse calls traced under plain `jax.jit` on several
  devices use (True, the default outside any context) or do not use (False) jattn's
  partitioning rule (see docs/sharding.md). Turn it off to `jax.export` a program partitioned
  over several devices: the rule is a Python callback, which an exported program cannot carry.
  Off, XLA partitions the kernels as ordinary code (a sequence-sharded query is then gathered
  on every device; the sparse path's batch too).
  The setting is part of `jax.jit`'s cache key, so a function already traced with the other
  setting is traced again."""
  if not isinstance(enabled, bool):
    raise TypeError(f"auto_partitioning: enabled must be a bool, got {type(enabled).__name__}")
  with _ENABLED(enabled):
    yield


def applies(mask, score_args) -> bool:
  """Whether a chunked call traced now goes through the partitioning rule: the program may be
  partitioned by XLA (several devices, no mesh axis Explicit or manual), and every array of the
  call has a known layout (no arrays hoisted out of a ``score_mod``, only jattn's mask kinds)."""
  if not _ENABLED.value or jax.device_count() == 1:
    return False
  mesh = _sharding.current_mesh()
  if mesh is not None and any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return False
  return not score_args and _masks.can_take_part(mask)


class Split(NamedTuple):
  """How the work is cut into devices' parts: the mesh axes the examples, query rows, query
  heads and keys are split over (empty: whole). Keys are split only where the query rows are
  not: each device attends to its own keys and the parts are merged across devices."""

  batch: tuple = ()
  rows: tuple = ()
  heads: tuple = ()
  keys: tuple = ()

  def offset(self, axes, size: int):
    """The global index of the first element of this device's part along ``axes``."""
    return jax.lax.axis_index(axes) * size if axes else jnp.zeros((), jnp.int32)


WHOLE = Split()


def _split(mesh, q_spec, k_spec, problem) -> Split:
  """The split the query's sharding ``q_spec`` (over (B, T, N, H)) asks for, and, where the
  query rows are whole, the key sharding ``k_spec`` (over (B, S, K, H)) along S on other mesh
  axes. A dimension whose size the axes do not divide (heads: K, so that GQA groups stay
  whole) stays whole."""
  pad = lambda spec: tuple(spec) + (None,) * (4 - len(tuple(spec)))
  q_entries, k_entries = pad(q_spec), pad(k_spec or ())

  def axes(entry, size):
    names = _sharding._names(entry)
    return names if names and size % _sharding.axes_size(mesh, names) == 0 else ()

  rows = () if problem.whole_sequences else axes(q_entries[1], problem.T)
  split = Split(axes(q_entries[0], problem.B), rows, axes(q_entries[2], problem.K))
  keys = () if problem.whole_sequences else axes(k_entries[1], problem.S)
  taken = {a for entry in q_entries for a in _sharding._names(entry)}
  if not split.rows and keys and not taken & set(keys):
    split = split._replace(keys=keys)
  return split


class Operands(NamedTuple):
  """The arrays of the operation, whole or one device's part: q (B, T, N, H), k and v
  (B, S, K, H), bias (B|1, K|1, G|1, T|1, S|1) or None, mask a `jattn.masks` object or None, seed
  dropout's (2,) words or None, sink (1, K, G, 1) or None (each has a role: `OPERAND_ROLES`)."""

  q: Any
  k: Any
  v: Any
  bias: Any
  mask: Any
  seed: Any
  sink: Any


class Problem(NamedTuple):
  """The static sizes of the call and how to run one device's part.

  ``local(operands, place, saved=None)`` runs the kernels on one device's `Operands`
  (``place``: its `jattn._call.Place` in the whole call) and returns (out, lse); with ``saved`` =
  (out, lse, dout, dlse) it returns the operands' cotangents (fields q, k, v, bias and sink).
  ``whole_sequences``: the kernels take whole sequences only (the sparse path: a query's chosen
  blocks lie anywhere in them): query rows and keys are never split, only examples and heads
  (a sequence-sharded query or key is gathered)."""

  B: int
  T: int
  S: int
  N: int
  K: int
  local: Callable
  bias_shape: tuple | None = None  # the whole bias's (B|1, K|1, G|1, T|1, S|1)
  whole_sequences: bool = False


def _part(problem: Problem, split: Split, mesh, operands: Operands):
  """This device's operands and its `jattn._call.Place` in the whole call (the global index of
  its first example and query head; of its first query row and key where T or S is cut);
  operands read whole are cut here (the sinks along heads, the mask along examples and heads)."""
  if split == WHOLE:
    return operands, _call.Place()
  B, T, S, N, K = problem.B, problem.T, problem.S, problem.N, problem.K
  G = N // K
  local = lambda size, axes: size // _sharding.axes_size(mesh, axes)
  nb, nk, Tl, Sl = (
    local(B, split.batch),
    local(K, split.heads),
    local(T, split.rows),
    local(S, split.keys),
  )
  part = _call.Place(
    q_offset=split.offset(split.rows, Tl) if Tl != T else None,
    kv_offset=split.offset(split.keys, Sl) if Sl != S else None,
    batch0=split.offset(split.batch, nb),
    head0=split.offset(split.heads, nk * G),
  )
  sink = operands.sink
  if sink is not None and nk != K:
    sink = jax.lax.dynamic_slice_in_dim(sink, part.head0 // G, nk, 1)
  mask = _masks.take_part(operands.mask, part.batch0, nb, part.head0, nk * G, (B, N, T, None))
  return operands._replace(mask=mask, sink=sink), part


# Each array of the operation (the `Operands`, in order) has a role, which says where it keeps the examples, query rows,
# heads and keys: "q" (B, T, N, ...) laid out like the query (the output, its lse and their
# cotangents too), "kv" (B, S, K, H), "bias" (B|1, K|1, G|1, T|1, S|1), and "whole" (read whole
# by every device: mask arrays, the dropout seed, the sinks, the kernels' constants).
OPERAND_ROLES = ("q", "kv", "kv", "bias", "whole", "whole", "whole")


def _bias_dims(problem: Problem, split: Split):
  """Per dimension of the whole bias (B|1, K|1, G|1, T|1, S|1): (factor, mesh axes) where it
  is the call's examples, key/value heads, query rows or keys, None where it is broadcast or
  G."""
  assert problem.bias_shape is not None  # asked for the bias's role only
  own = (
    ("b", problem.B, split.batch),
    ("k", problem.K, split.heads),
    None,
    ("t", problem.T, split.rows),
    ("s", problem.S, split.keys),
  )
  return tuple(
    None if d is None or d[1] == 1 or size != d[1] else (d[0], d[2])
    for d, size in zip(own, problem.bias_shape)
  )


def _spec(problem: Problem, split: Split, role: str):
  """The PartitionSpec an array of ``role`` is asked for (or produced with) under ``split``: the
  query as split, K and V whole along S, the bias split where it has the dimension (read from
  the whole bias's shape: inside a device's part, a split dimension looks broadcast)."""
  P, e = PartitionSpec, _sharding.spec_entry
  if role == "q":
    return P(e(split.batch), e(split.rows), e(split.heads))
  if role == "kv":
    return P(e(split.batch), e(split.keys), e(split.heads))
  if role == "bias":
    return P(*(None if d is None else e(d[1]) for d in _bias_dims(problem, split)))
  return P()


def _factors(problem: Problem, role: str, x, fresh) -> ArrayMapping:
  """The factors of ``x``'s dimensions in the operation's sharding rule: arrays of one role
  share the factors of the examples, rows, heads and keys (so Shardy gives an output the
  sharding of the input it is laid out like); every other dimension is a factor of its own."""
  shape = jnp.shape(x)
  named: tuple[str | None, ...]
  if role == "q":
    named = ("b", "t", "n")
  elif role == "kv":
    named = ("b", "s", "k")  # "k": key/value heads
  elif role == "bias":
    named = tuple(None if d is None else d[0] for d in _bias_dims(problem, WHOLE))
  else:
    named = ()
  named = named[: len(shape)] + (None,) * (len(shape) - len(named))
  return ArrayMapping(*(f if f is not None else fresh() for f in named))


def _unsplit_axes(split: Split, spec) -> tuple:
  """The axes the work is split over that an operand of ``spec`` is not: its gradient's partial
  sums over those devices are added."""
  held: set[str] = set()
  for entry in spec or ():
    held.update(_sharding._names(entry))
  return tuple(a for a in split.batch + split.rows + split.heads + split.keys if a not in held)


def _forward(problem: Problem, split: Split, mesh, operands: Operands, extra):
  del extra
  ops, part = _part(problem, split, mesh, operands)
  if not split.keys:
    return tuple(problem.local(ops, part))
  # Each device's keys, merged across devices through their log-sum-exps (split-KV); the
  # sinks, one more logit per row, join once, after the merge.
  sink = ops.sink
  out, lse, *mx = problem.local(ops._replace(sink=None), part)
  out, lse = _softmax.merge_over_devices(out, lse, split.keys)
  if sink is not None:
    out, lse = _softmax.add_sink(out, lse, sink.reshape(-1))
  # The max logits (when asked for): the max of every device's over its keys.
  mx = [_softmax.max_over_devices(x, split.keys) for x in mx]
  return (out.astype(operands.q.dtype), lse, *mx)


def _backward(problem: Problem, split: Split, mesh, operands: Operands, extra):
  """The cotangents of (q, k, v, bias, sink) from the forward's (out, lse) and theirs: the
  kernels' backward pass on this device's part. An operand read whole, or not split like the
  work, gets this device's partial sum, added over the devices that split it."""
  ops, part = _part(problem, split, mesh, operands)
  sink = operands.sink
  # With the keys split, the kernels' backward runs on this device's keys from the merged
  # (final) out and lse: the probabilities it recomputes are already normalised over every key
  # and the sinks, so dK, dV are this device's whole and dQ a partial sum; the sinks' gradient,
  # from the final statistics alone, is the same on every device of the key axes.
  grads = problem.local(ops, part, saved=extra)
  dsink = grads.sink
  if split != WHOLE and dsink is not None and dsink.shape != sink.shape:
    # This device's heads' part of the (1, K, G, 1) sinks.
    dsink = jax.lax.dynamic_update_slice_in_dim(
      jnp.zeros_like(sink), dsink, part.head0 // (problem.N // problem.K), 1
    )
  grads = (grads.q, grads.k, grads.v, grads.bias, dsink)
  if split == WHOLE:
    return grads

  def total(g, role):
    if g is None:
      return g
    axes = _unsplit_axes(split, _spec(problem, split, role))
    if role == "whole":
      axes = tuple(a for a in axes if a not in split.keys)  # the sinks': complete already
    return jax.lax.psum(g, axes) if axes else g

  return tuple(total(g, r) for g, r in zip(grads, BACKWARD_ROLES))


BACKWARD_ROLES = ("q", "kv", "kv", "bias", "whole")


def _op(problem: Problem, body: Callable, operands: Operands, extra, out_roles: tuple):
  """``body(problem, split, mesh, operands, extra)`` as one operation that XLA partitions by
  the query's sharding. ``extra``: arrays laid out like the query (cotangents); ``out_roles``:
  the role of each output of ``body``."""
  flat, tree = jax.tree.flatten((operands, extra))
  in_roles = [r for x, r in zip(operands, OPERAND_ROLES) for _ in jax.tree.leaves(x)]
  in_roles += ["q"] * len(jax.tree.leaves(extra))

  def run(split, mesh, xs):
    ops, ex = jax.tree.unflatten(tree, xs)
    return tuple(body(problem, split, mesh, ops, ex))

  closed, outs_struct = jax.make_jaxpr(lambda *xs: run(WHOLE, None, xs), return_shape=True)(*flat)
  live_roles = [r for o, r in zip(outs_struct, out_roles) if o is not None]
  out_leaves = [o for o in outs_struct if o is not None]

  # custom_partitioning traces its function without constants (the kernels' block lists are
  # NumPy constants): they become operands, read whole.
  def plain(consts, *xs):
    return tuple(jax.core.eval_jaxpr(closed.jaxpr, consts, *xs))

  def split_of(mesh, shapes):
    # shapes[0]: the constants; then q, k.
    q_spec, k_spec = (getattr(x.sharding, "spec", None) for x in shapes[1:3])
    return WHOLE if q_spec is None else _split(mesh, q_spec, k_spec, problem)

  def out_shardings(mesh, split):
    return tuple(NamedSharding(mesh, _spec(problem, split, r)) for r in live_roles)

  def partition(mesh, shapes, result_shape):
    del result_shape
    split = split_of(mesh, shapes)
    ins = tuple(NamedSharding(mesh, _spec(problem, split, r)) for r in in_roles)
    consts = tuple(NamedSharding(mesh, PartitionSpec()) for _ in closed.consts)

    def lower(consts_, *xs):
      del consts_  # the per-device trace makes its own
      return tuple(o for o in run(split, mesh, xs) if o is not None)

    return mesh, lower, out_shardings(mesh, split), (consts,) + ins

  def infer(mesh, shapes, result_shape):
    del result_shape
    return out_shardings(mesh, split_of(mesh, shapes))

  count = iter(range(1 << 30))
  fresh = lambda: f"d{next(count)}"
  rule = SdyShardingRule(
    operand_mappings=tuple(_factors(problem, "whole", c, fresh) for c in closed.consts)
    + tuple(_factors(problem, r, x, fresh) for r, x in zip(in_roles, flat)),
    result_mappings=tuple(_factors(problem, r, o, fresh) for r, o in zip(live_roles, out_leaves)),
  )
  op = custom_partitioning(plain)
  op.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)

  # The primitive has no batching rule: under vmap, the plain computation is mapped.
  @custom_batching.custom_vmap
  def call(*xs):
    return op(tuple(closed.consts), *xs)

  @call.def_vmap
  def _(axis_size, in_batched, *xs):
    del axis_size
    outs = jax.vmap(
      lambda *ys: tuple(o for o in run(WHOLE, None, ys) if o is not None),
      in_axes=[0 if b else None for b in in_batched],
    )(*xs)
    return outs, tuple(True for _ in outs)

  it = iter(call(*flat))
  return tuple(None if o is None else next(it) for o in outs_struct)


def attention(problem: Problem, operands: Operands, reference: Callable):
  """(out, lse) of the kernels on the `Operands`, partitioned by the query's sharding when XLA
  partitions the program (see the module docstring); (out, lse, max logits) when the problem's
  ``local`` returns them too (``return_max_logits``: laid out like the lse). Differentiable in
  every mode: reverse mode by the kernels' backward as a second partitioned operation, forward
  mode by JAX's tangent of ``reference(operands)`` (the same outputs computed whole, whose
  program XLA partitions as ordinary code). A custom VJP alone would refuse forward mode
  (`jax.jvp`, `jacfwd`) on any process with several devices."""
  diff = (operands.q, operands.k, operands.v, operands.bias, operands.sink)
  aux = (operands.mask, operands.seed)
  as_operands = lambda d, a: Operands(d[0], d[1], d[2], d[3], a[0], a[1], d[4])

  def kernel(d, a):
    return _op(problem, _forward, as_operands(d, a), (), ("q", "q", "q")), ()

  def backward(d, a, outs, saved, cts):
    out, lse = outs[:2]
    # The max logits' cotangent, if any, is dropped: they are a statistic.
    dout, dlse = (jnp.zeros_like(x) if c is None else c for c, x in zip(cts[:2], (out, lse)))
    extra = (out, lse, dout, dlse)
    return _op(problem, _backward, as_operands(d, a), extra, BACKWARD_ROLES)

  ref = lambda d, a, saved: tuple(reference(as_operands(d, a)))
  return _derivatives.with_derivatives(kernel, ref, backward, diff, aux)
