"""The zigzag layout: the load-balanced order of a causal sequence sharded over P devices.

The sequence is cut into 2P equal chunks and ordered [0, 2P-1, 1, 2P-2, ..., P-1, P], so that
sharding it evenly over P devices gives device d chunks d and 2P-1-d: one early and one late
chunk, and under a causal mask every device the same share of the work. `zigzag_permute` and
`zigzag_unpermute` reorder arrays into and out of that layout (public as ``jattn.zigzag_permute``
and ``jattn.zigzag_unpermute``); `shard_positions` gives the global position of every row a
device holds, for either layout ("contiguous" or "zigzag"), which ring attention
(`jattn._parallel.ring`) uses to evaluate masks, score_mod and dropout on global positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _validation


def _check_num_devices(num_devices):
  return _validation.positive_int("num_devices", num_devices)


def zigzag_order(num_devices: int) -> np.ndarray:
  """The chunk order of the zigzag layout: [0, 2P-1, 1, 2P-2, ..., P-1, P].

  The sequence is cut into 2P equal chunks; device d holds chunks d and 2P-1-d, in that order.
  """
  P = _check_num_devices(num_devices)
  d = np.arange(P)
  return np.stack([d, 2 * P - 1 - d], axis=1).reshape(-1)


def _zigzag_take(x, num_devices, axis, inverse):
  P = _check_num_devices(num_devices)
  x = jnp.asarray(x)
  axis = _validation.axis("axis", axis, x.shape)
  L = x.shape[axis]
  if L % (2 * P):
    raise ValueError(
      f"the zigzag layout cuts the sequence into 2 * num_devices = {2 * P} equal "
      f"chunks, but x.shape[{axis}] = {L} (x.shape={x.shape}) is not a multiple "
      f"of {2 * P}"
    )
  index = np.arange(L).reshape(2 * P, L // (2 * P))[zigzag_order(P)].reshape(-1)
  if inverse:
    index = np.argsort(index)
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
    # Under an Explicit mesh the gather must be told its output sharding: keep the input's.
    return x.at[(slice(None),) * axis + (index,)].get(out_sharding=sharding)
  return jnp.take(x, index, axis=axis)


def zigzag_permute(x, num_devices: int, *, axis: int = 1):
  """Reorder a sequence into the zigzag (load-balanced causal) layout.

  Cuts axis ``axis`` (the sequence; 1 for (B, T, N, H) arrays and (B, T) segment ids) into
  2 * num_devices chunks and orders them [0, 2P-1, 1, 2P-2, ...], so that sharding the result
  evenly over P devices gives device d chunks d and 2P-1-d: under a causal mask every device then
  has the same amount of work. Use it on query, key, value and segment ids before
  ``ring_attention(..., layout="zigzag")``, and `zigzag_unpermute` on the output.
  ``query_seq_lengths`` and ``key_value_seq_lengths`` stay as they are: they are global positions.
  """
  return _zigzag_take(x, num_devices, axis, inverse=False)


def zigzag_unpermute(x, num_devices: int, *, axis: int = 1):
  """The inverse of `zigzag_permute`: back from the zigzag layout to sequence order."""
  return _zigzag_take(x, num_devices, axis, inverse=True)


def shard_positions(index, length: int, num_devices: int, layout: str):
  """(length,) int32 global sequence positions of the rows that device ``index`` holds.

  ``length`` is the shard length (T / P); ``index`` may be traced (`jax.lax.axis_index`).
  """
  p = jnp.arange(length, dtype=jnp.int32)
  index = jnp.asarray(index, jnp.int32)
  if layout == "contiguous":
    return index * length + p
  c = length // 2
  return jnp.where(p < c, index * c + p, (2 * num_devices - 1 - index) * c + (p - c))
