"""Sharding in types: what the kernels need under a mesh with Explicit axes.

Under ``jax.sharding.AxisType.Explicit`` an array's sharding is part of its type, so a loop carry
or a switch branch must produce exactly the sharding the other side has, and an operation that
would need communication must be asked for (``jax.sharding.reshard``). Under Auto axes (and with
no mesh) every function here is the identity.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import PartitionSpec


def current_mesh():
  """The abstract mesh the call is traced under, or None when there is none."""
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = get() if get is not None else None
  return None if mesh is None or getattr(mesh, "empty", True) else mesh


def _names(entry) -> tuple:
  """The mesh axis names of one PartitionSpec entry (None, a name, or a tuple of names)."""
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def spec_entry(names):
  """The PartitionSpec entry for a dimension sharded over the mesh axes ``names`` (the inverse
  of `_names`): None, a name, or a tuple of names."""
  names = tuple(names)
  return None if not names else names[0] if len(names) == 1 else names


def reshard_to(x, spec):
  """``x`` with sharding ``spec`` (a reshard only where its type says otherwise) under an
  Explicit mesh; elsewhere, and for None, ``x`` unchanged."""
  if x is None or not explicit_mesh() or spec_of(x) == spec:
    return x
  return jax.sharding.reshard(x, spec)


def explicit_mesh() -> bool:
  """Whether the call is traced under a mesh with Explicit axes."""
  mesh = current_mesh()
  return mesh is not None and any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def per_device(fn, in_specs, out_specs):
  """``fn`` run by each device on its own part, inside a `jax.shard_map` manual over every mesh
  axis not manual yet (replicated over those the specs leave out), its types unchecked
  (``check_vma=False``): a call split by examples and heads, with no communication."""
  mesh = jax.sharding.get_abstract_mesh()
  free = frozenset(
    n for n, t in zip(mesh.axis_names, mesh.axis_types) if t != jax.sharding.AxisType.Manual
  )
  return jax.shard_map(
    fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=free, check_vma=False
  )


def unpartitioned() -> bool:
  """Whether the program being traced runs on one device as written: no mesh is set and the
  process has one device, or every axis of the mesh is manual (inside a `jax.shard_map`, each
  device's part). Only then may a Pallas TPU kernel stand outside a shard_map: XLA cannot
  partition one, and under an Auto mesh (or plain `jit` on sharded arrays) whether the program
  will be partitioned is decided after the call is traced."""
  mesh = current_mesh()
  if mesh is None:
    return jax.device_count() == 1
  return all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


def examples_and_heads(query, key, value):
  """Under an Explicit mesh: (batch axes, head axes) when query (B, T, N, H), key and value
  (B, S, K, H) are sharded over their batch and head dimensions only, and alike -- a call that
  splits into independent per-device calls; else a phrase saying what stands in the way."""
  mesh = current_mesh()
  if any(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return "a mesh with Auto axes besides Explicit ones"
  specs = []
  for x in (query, key, value):
    spec = tuple(spec_of(x) or ())
    specs.append(spec + (None,) * (x.ndim - len(spec)))
  if any(s[1] is not None for s in specs):
    return "sequence-sharded inputs"
  if any(s[3] is not None for s in specs):
    return "inputs sharded along the head dimension H"
  if any((s[0], s[2]) != (specs[0][0], specs[0][2]) for s in specs[1:]):
    return "key and value sharded unlike the query"
  return _names(specs[0][0]), _names(specs[0][2])


def checks_vma(x) -> bool:
  """Whether the call is traced inside a `jax.shard_map` with ``check_vma=True`` (values typed
  device-varying or invariant). JAX's own flag when it has one, else whether ``x`` is typed
  varying over some manual axis."""
  from jax._src import config

  flag = getattr(config, "_check_vma", None)
  if flag is not None and hasattr(flag, "value"):
    return bool(flag.value)
  return bool(varying_axes(x))


def spec_of(x) -> PartitionSpec | None:
  sharding = getattr(jax.typeof(x), "sharding", None)
  return getattr(sharding, "spec", None)


def reshard_like(tree, like):
  """Give each array of ``tree`` the sharding of the matching abstract value of ``like``."""

  def one(x, want):
    if x is None:
      return None
    spec = getattr(getattr(want, "sharding", None), "spec", None)
    if spec is None or spec_of(x) == spec:
      return x
    return jax.sharding.reshard(x, spec)

  return jax.tree.map(one, tree, like, is_leaf=lambda x: x is None)


def unshard_axis(x, axis: int):
  """``x`` with dimension ``axis`` whole on every device (an all-gather when it was sharded)."""
  spec = spec_of(x)
  if spec is None:
    return x
  entries = tuple(spec) + (None,) * (x.ndim - len(spec))
  if entries[axis] is None:
    return x
  entries = entries[:axis] + (None,) + entries[axis + 1 :]
  return jax.sharding.reshard(x, PartitionSpec(*entries))


def axes_size(mesh, axes) -> int:
  """The number of devices along the mesh ``axes`` (a tuple of names) together."""
  return int(np.prod([mesh.shape[a] for a in axes]))


def sequence_shards(x):
  """Under an Explicit mesh, the mesh axes the sequence dimension (axis 1) of a (B, T|S, n, H)
  array is sharded over, as a tuple, and the number of shards; None when it is whole (or the
  shards would be uneven)."""
  spec = spec_of(x) if explicit_mesh() else None
  if spec is None or len(spec) < 2 or spec[1] is None:
    return None
  axes = _names(spec[1])
  mesh = current_mesh()
  count = axes_size(mesh, axes)
  if x.shape[1] % count:
    return None
  return axes, count


def sequence_layout(query, key, value):
  """Under an Explicit mesh, where the sequence is split: (the query's spec, (axes, count) when
  only the query's T is split, (axes, count) when the query is whole and K, V are split alike
  along S); see `jattn._call.SequenceSplit`. Batch- and head-sharded inputs are neither."""
  spec = spec_of(query)
  q_shards = sequence_shards(query)
  if q_shards is not None and not sharded_only_over((query, key, value), q_shards[0]):
    q_shards = None  # other axes in use too: the gather path (see sharded_only_over)
  kv_shards = None
  if q_shards is None and spec_of(key) is not None and spec_of(key) == spec_of(value):
    kv_shards = sequence_shards(key)
    if kv_shards is not None and not sharded_only_over((query, key, value), kv_shards[0]):
      kv_shards = None
  return spec, q_shards, kv_shards


def sharded_only_over(arrays, axes) -> bool:
  """Whether no array of ``arrays`` is sharded over a mesh axis outside ``axes``.

  A shard_map manual over some axes only (``axis_names``) makes XLA gather the arrays along
  the others inside it (measured on JAX 0.10's CPU lowering, even for an elementwise body), so
  the per-shard paths of a sequence-sharded call are taken only when the sequence axes are the
  only ones in use."""
  return all(n in axes for x in arrays for e in spec_of(x) or () for n in _names(e))


def _without(spec, ndim, axes):
  """``spec``'s entries (padded to ``ndim``) with the mesh ``axes`` removed."""
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  out = []
  for e in entries:
    out.append(spec_entry(n for n in _names(e) if n not in axes))
  return out


def replicate_over(tree, axes):
  """Every array of ``tree`` whole along the mesh ``axes`` (gathered where it was sharded over
  them); other shardings are kept."""

  def one(x):
    spec = spec_of(x)
    if spec is None:
      return x
    return reshard_to(x, PartitionSpec(*_without(spec, x.ndim, axes)))

  return jax.tree.map(one, tree)


def shard_dim(x, dim: int, axes):
  """``x`` with dimension ``dim`` sharded over the mesh ``axes`` (and no other dimension
  over them); other shardings are kept."""
  entries = _without(spec_of(x) or (), x.ndim, axes)
  entries[dim] = spec_entry(axes)
  return reshard_to(x, PartitionSpec(*entries))


def varying(x, *like):
  """Type a fresh loop carry as device-varying over the manual mesh axes of ``like``.

  Inside `jax.shard_map` with ``check_vma=True`` (ring attention), a carry that starts as a
  constant but becomes device-dependent in the loop body would change type; this declares it
  device-dependent from the start. Outside shard_map it returns ``x`` unchanged.
  """
  if x is None:
    return None
  # Only the axes x does not vary over yet: a carry made from an input already varies.
  axes = set().union(*(varying_axes(a) for a in jax.tree.leaves(like))) - varying_axes(x)
  return jax.lax.pcast(x, tuple(sorted(axes, key=str)), to="varying") if axes else x


def varying_tree(tree, *like):
  """`varying` for every array of ``tree``."""
  return jax.tree.map(lambda x: varying(x, *like), tree)


def varying_axes(x) -> frozenset:
  """Manual mesh axes over which ``x`` varies (``typeof(x).mat.varying``; ``.vma`` before)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


_TYPED_SHARDINGS = ("sharding", "out_sharding")


class VaryingReplay:
  """A traced function (a closed jaxpr) replayed on arguments that may already be typed
  device-varying where the trace cast them (``pvary``) itself.

  Inside ``shard_map(check_vma=True)``, a function that combines an invariant array (the table a
  score_mod closes over) with device-varying ones records a cast of that array to varying. Ring
  attention passes such arrays in already varying, so that their gradient is not summed across
  devices inside its per-block loops (a collective there deadlocks: devices run different
  numbers of blocks); here the recorded cast keeps only the axes an argument does not vary over
  yet. Everything else is bound as recorded.
  """

  def __init__(self, closed_jaxpr):
    self.closed_jaxpr = closed_jaxpr

  def __call__(self, *args):
    jaxpr = self.closed_jaxpr.jaxpr
    env = dict(zip(jaxpr.constvars, self.closed_jaxpr.consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if hasattr(v, "val") else env[v]
    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      if eqn.primitive.name == "pvary":
        want = set(eqn.params["axes"])
        outs = [
          jax.lax.pcast(x, tuple(sorted(want - varying_axes(x), key=str)), to="varying")
          if want - varying_axes(x)
          else x
          for x in ins
        ]
      else:
        # A sharding recorded in the types of the trace (an Explicit mesh outside the
        # shard_map) does not hold inside it, where every axis is manual.
        params = {
          k: (None if k in _TYPED_SHARDINGS and p is not None else p) for k, p in eqn.params.items()
        }
        outs = eqn.primitive.bind(*ins, **params)
        if not eqn.primitive.multiple_results:
          outs = [outs]
      env.update(zip(eqn.outvars, outs))
    out = [read(v) for v in jaxpr.outvars]
    return out[0] if len(out) == 1 else out


def sharded_reshape(x, shape):
  """``x.reshape(shape)``; under an Explicit mesh with the output's sharding spelled out: a
  sharded input dimension stays sharded on the output dimension it is the major part of (the
  batch of a (B, nq, bq, ...) -> (B, T, ...) reshape)."""
  # Symbolic dimensions (jax.export) stay as they are.
  shape = tuple(int(d) if isinstance(d, (int, np.integer)) else d for d in shape)
  if -1 in shape:
    known = math.prod(d for d in shape if not (isinstance(d, int) and d == -1))
    shape = tuple(
      math.prod(x.shape) // known if isinstance(d, int) and d == -1 else d for d in shape
    )
  spec = spec_of(x)
  if not explicit_mesh() or spec is None or all(e is None for e in spec):
    return x.reshape(shape)
  entries = tuple(spec) + (None,) * (x.ndim - len(spec))
  in_start = np.cumprod((1,) + x.shape[:-1])
  out_start = np.cumprod((1,) + shape[:-1])
  out = [None] * len(shape)
  for d, entry in enumerate(entries):
    if entry is None:
      continue
    # The output dimension that starts where d does and holds whole multiples of it (size-1
    # dimensions share their start with the next one: (1, B, ..) -> (1, B, .., 1) keeps B's),
    # or is its major part with room for every shard (heads N split into (K, G)).
    count = axes_size(current_mesh(), _names(entry))
    fits = [
      o
      for o in range(len(shape))
      if out_start[o] == in_start[d]
      and out[o] is None
      and (shape[o] % x.shape[d] == 0 or (x.shape[d] % shape[o] == 0 and shape[o] % count == 0))
    ]
    if not fits:
      raise ValueError(f"reshape {x.shape} -> {shape} would split sharded dimension {d}")
    out[fits[0]] = entry
  return jax.lax.reshape(x, shape, out_sharding=PartitionSpec(*out))


def aligned_to_query(args):
  """Under an Explicit mesh, the call's other arrays laid out for the query's computation: a
  bias (broadcastable to (B, N, T, S)) sharded as the scores are (B, N and T as the query, S
  whole unless only K and V are split along it); a boolean mask by example and head, segment
  ids, lengths and positions by example, their sequence dimensions whole (masks read them at
  positions, by gathers a sharded operand cannot follow), and so the arrays of a mask object;
  the sinks replicated. Elsewhere unchanged.

  ``args``: a `jattn._call.Arrays`."""
  if not explicit_mesh():
    return args
  q = tuple(spec_of(args.query) or ()) + (None,) * 4
  k = tuple(spec_of(args.key) or ()) + (None,) * 4
  B, T, N, _ = args.query.shape
  S = args.key.shape[1]
  # Keys whole, except where only K and V are split along S (the query rows whole): the call
  # then runs per key shard, and a bias keeps its keys where K and V are.
  keys = k[1] if q[1] is None else None
  scores = ((B, q[0]), (N, q[2]), (T, q[1]), (S, keys))

  def like_scores(x, rows=True):
    if x is None or not hasattr(x, "ndim"):
      return x
    dims = (scores if rows else scores[:2] + ((None, None),) * 2)[4 - x.ndim :]
    return reshard_to(
      x, PartitionSpec(*(e if size == n else None for size, (n, e) in zip(x.shape, dims)))
    )

  def per_example(x):
    if x is None:
      return x
    return reshard_to(x, PartitionSpec(q[0] if x.shape[0] == B else None, *(None,) * (x.ndim - 1)))

  mask = args.mask
  if mask is not None and not hasattr(mask, "ndim"):
    # A mask object's arrays (positions, segment ids, lengths, offsets) likewise by example.
    mask = jax.tree.map(lambda x: per_example(x) if getattr(x, "ndim", 0) else replicated(x), mask)
  else:
    mask = like_scores(mask, rows=False)
  return dataclasses.replace(
    args,
    bias=like_scores(args.bias),
    mask=mask,
    q_lengths=per_example(args.q_lengths),
    kv_lengths=per_example(args.kv_lengths),
    q_seg=per_example(args.q_seg),
    kv_seg=per_example(args.kv_seg),
    q_positions=per_example(args.q_positions),
    kv_positions=per_example(args.kv_positions),
    sinks=replicated(args.sinks),
  )


def replicated(tree):
  """Under an Explicit mesh, every array of ``tree`` whole on every device (the arrays a
  score_mod closes over: it indexes them with its own index arithmetic, which a sharded
  operand's gather cannot follow); elsewhere unchanged."""
  return jax.tree.map(lambda x: reshard_to(x, PartitionSpec()), tree)
