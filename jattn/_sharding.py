"""Sharding in types: what the kernels need under a mesh with Explicit axes.

Under ``jax.sharding.AxisType.Explicit`` an array's sharding is part of its type, so a loop carry
or a switch branch must produce exactly the sharding the other side has, and an operation that
would need communication must be asked for (``jax.sharding.reshard``). Under Auto axes (and with
no mesh) every function here is the identity.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec


def explicit_mesh() -> bool:
  """Whether the call is traced under a mesh with Explicit axes."""
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  mesh = get() if get is not None else None
  if mesh is None or getattr(mesh, "empty", True):
    return False
  return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


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
  entries = entries[:axis] + (None,) + entries[axis + 1:]
  return jax.sharding.reshard(x, PartitionSpec(*entries))
