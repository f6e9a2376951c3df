"""Parallelism as a layer over the chunked kernels: one device's part of a call, at its place.

A bound call reaches the kernels in one of four ways, chosen here and nowhere else:

- whole, on one device (or sharded only by examples and heads under an Explicit mesh, which
  the kernels' types carry through);
- split along T under an Explicit mesh (`sequence_sharded`, ``split_query``): each device runs
  its query rows against the whole (gathered) K and V, as dense attention's partitioned matmuls
  do; the devices' dK/dV partial sums are added by the shard_map's transpose;
- K and V split along S under an Explicit mesh with the query whole (a decoding step against a
  sharded cache): each device attends all queries to its own keys, and the parts are merged
  through their log-sum-exps across the devices (`jattn._softmax.merge_over_devices`);
- under an Auto mesh, through the partitioning rule of `jattn._parallel.partition`, which runs `part` on
  each device's share of the partitioned program.

Ring attention (`jattn._parallel.ring`) is the fifth: K and V travel round the devices.
Each way calls `jattn._chunked.attend` with the part's global positions (``q_offset``,
``kv_offset``, ``batch0``, ``head0``), so masks, score_mod and dropout see the whole call's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jattn import _call, _chunked, _sharding, _softmax
from jattn._parallel import partition as _partition


def chunked(call):
  """The chunked backend's run: (out (B, T, N, Hv), lse (B, T, N)) of a bound call, and its
  max logits (B, T, N) with ``return_max_logits``."""
  s = call.static
  split = s.split
  if split.q_shards is not None:
    axes, count = split.q_shards
    res = sequence_sharded(call, axes, count, split_query=True)
  elif split.kv_shards is not None:
    axes, count = split.kv_shards
    res = sequence_sharded(call, axes, count, split_query=False)
  else:
    cfg, score_args = s.config((s.B, s.N) + s.block_sizes())
    if split.spec is not None:
      call = dataclasses.replace(call, query=_sharding.unshard_axis(call.query, 1))
    if split.spec is None and _partition.applies(call.mask, score_args):
      operands = _partition.Operands(
        call.query, call.key, call.value, call.bias, call.mask, call.seed, call.sink
      )
      problem = _partition.Problem(
        s.B,
        s.T,
        s.S,
        s.N,
        s.K,
        functools.partial(part, s),
        None if call.bias is None else call.bias.shape,
      )
      # Forward mode through the plain kernels (their own rules), unpartitioned.
      whole = lambda ops: part(s, ops, _call.Place())
      res = _partition.attention(problem, operands, whole)
    else:
      res = _chunked.attend(call, cfg, score_args)
  out, *stats = res
  if split.spec is not None and _sharding.spec_of(out) != split.spec:
    out = jax.sharding.reshard(out, split.spec)
  return (out, *stats)


def part(static, operands, cut, saved=None):
  """The chunked kernels on one device's part of the call (``operands``: its
  `_partition.Operands`; ``cut``: its `_call.Place` in the whole), as `_partition` runs them
  when XLA partitions the program: (out, lse), or with ``saved`` (see `jattn._chunked.attend`)
  the operands' cotangents."""
  q, k, v, bias, mask, seed, sink = operands
  Bl, Tl, Nl, _ = q.shape
  Sl, Kl = k.shape[1], k.shape[2]
  local = dataclasses.replace(static, B=Bl, T=Tl, S=Sl, N=Nl, K=Kl)
  cfg, score_args = local.config((Bl, Nl) + local.block_sizes())
  call = _call.Call(q, k, v, bias, mask, seed, sink, None, local, cut)
  return _chunked.attend(call, cfg, score_args, saved=saved)


def sequence_sharded(call, axes, count, split_query: bool):
  """The chunked kernels per shard of the sequence under an Explicit mesh, inside a shard_map
  over its mesh ``axes`` (``count`` shards), with masks, score_mod and dropout at global
  positions: the query split along T (``split_query``; the kernels take query blocks out of Q at
  loop indices, so otherwise the partitioner would need the whole Q on every device), else K
  and V along S, merged across the devices with the sinks joining once, after the merge
  (gradients flow through the merge: the kernels' VJP takes the lse's cotangent)."""
  s = call.static
  Tl, Sl = (s.T // count, s.S) if split_query else (s.T, s.S // count)
  local = dataclasses.replace(s, T=Tl, S=Sl)
  cfg, score_args = local.config((s.B, s.N) + local.block_sizes(), replay=True)
  P = jax.sharding.PartitionSpec
  seq = _sharding.spec_entry(axes)
  split = (call.query,) if split_query else (call.given.key, call.given.value)
  split = tuple(_sharding.shard_dim(x, 1, axes) for x in split)
  bias_dim = 3 if split_query else 4  # T or S of (B|1, K|1, G|1, T|1, S|1)
  local_bias = call.bias is not None and call.bias.shape[bias_dim] != 1
  bias = (
    _sharding.shard_dim(call.bias, bias_dim, axes)
    if local_bias
    else _sharding.replicate_over(call.bias, axes)
  )
  whole = (call.key, call.value) if split_query else (call.query,)
  whole = _sharding.replicate_over(
    (whole, call.mask, call.seed, call.sink if split_query else None, score_args), axes
  )

  def body(split, bias, whole):
    whole, mask, seed, sink, score_args = whole
    q, k, v = split + whole if split_query else whole + split
    offset = jax.lax.axis_index(axes) * (Tl if split_query else Sl)
    place = _call.Place(q_offset=offset) if split_query else _call.Place(kv_offset=offset)
    part = _call.Call(q, k, v, bias, mask, seed, sink, None, local, place)
    out, lse, *mx = _chunked.attend(part, cfg, score_args)
    if split_query:
      return (out, lse, *mx)
    # The max logits over all keys: the max of each device's (the sinks are in none).
    mx = [_softmax.max_over_devices(x, axes) for x in mx]
    return (*_softmax.merge_over_devices(out, lse, axes), *mx)

  rows = P(None, seq) if split_query else P()
  fn = jax.shard_map(
    body,
    mesh=jax.sharding.get_abstract_mesh(),
    in_specs=(P(None, seq), P(*(None,) * bias_dim, seq) if local_bias else P(), P()),
    out_specs=(rows,) * (3 if cfg.max_logits else 2),
    axis_names=frozenset(axes),
    check_vma=False,
  )
  out, lse, *mx = fn(split, bias, whole)
  if not split_query and call.given.sinks is not None:
    out, lse = _softmax.add_sink(out, lse, call.given.sinks)
  return (out.astype(s.dtype), lse, *mx)
