"""The chunked backend's entry into its kernels: `attend` takes a bound call, or one device's part
of one (from `jattn._parallel.split`), to the kernels (`jattn._chunked.derivatives`).

It fixes the block sizes, gives a part's rows and keys their global positions (the mask
remapped to them, score_mod and dropout told), makes the plan and block map for each schedule
and runs the call's schedule, else the platform's default, chosen where the program is lowered.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jattn import _lowering, _tile
from jattn import masks as _masks
from jattn._chunked import plan as _plan
from jattn._chunked.derivatives import chunked_attention, chunked_attention_grads
from jattn._chunked.plan import Operands


def attend(call, cfg, score_args, saved=None):
  """The chunked kernels on a bound call (`jattn._call.Call`), or on one device's part of one:
  queries (B, cfg.T, N, H), keys (B, cfg.S, K, H); ``cfg`` and ``score_args`` from its
  `Static.config`. Returns (out, lse).

  Where the call is a part (``call.place``): rows of a query shard, or keys of a key/value
  shard, see their global positions (the mask is remapped to them; score_mod and dropout see
  them too), and examples and heads their global indices (the mask is already cut to them).
  A part with its keys cut is merged with the other parts' through their log-sum-exps: its
  output comes back in the statistics dtype (`jattn._chunked.plan.Plan.out_dtype`).
  ``saved``: (out, lse, dout, dlse) of an earlier call on the same operands; the operands'
  cotangents (an `Operands`) are returned instead. The schedule is the call's, else the
  platform's default, chosen where the program is lowered."""
  tuned, place, mask = call.static.tuned, call.place, call.mask
  bq, bk = call.static.block_sizes(cfg.T, cfg.S)
  positions = None
  if any(x is not None for x in place):
    q_table = _position_table(place.q_offset, cfg.T, bq)
    kv_table = _position_table(place.kv_offset, cfg.S, bk)
    if mask is not None and (place.q_offset is not None or place.kv_offset is not None):
      mask = _masks.remap(mask, q_table, kv_table)
    if cfg.score_mod is not None or cfg.dropout_rate > 0:
      positions = _plan.Positions(
        q_table,
        kv_table,
        0 if place.batch0 is None else place.batch0,
        0 if place.head0 is None else place.head0,
      )
  merged = place.kv_offset is not None
  out_dtype = _tile.stat_dtype(call.query.dtype) if merged else None
  run = {}
  for schedule in (tuned.schedule,) if tuned.schedule else _plan.SCHEDULES:
    plan, states = _plan.make_plan(cfg, mask, bq, bk, schedule, tuned.step_width, out_dtype)
    ops = Operands(
      q=call.query,
      k=call.key,
      v=call.value,
      bias=call.bias,
      mask=mask,
      states=states,
      seed=call.seed,
      score_args=score_args,
      sink=call.sink,
      positions=positions,
    )
    run[schedule] = (
      functools.partial(chunked_attention, plan, ops)
      if saved is None
      else functools.partial(chunked_attention_grads, plan, ops, *saved)
    )
  if tuned.schedule:
    return run[tuned.schedule]()
  return _lowering.by_platform({p: run[s] for p, s in _plan.SCHEDULE_DEFAULTS.items()})


def _position_table(offset, n: int, block: int):
  """The global positions of ``n`` rows padded to whole blocks, starting at ``offset``; padding
  rows repeat the last row's position (hidden, or sliced off)."""
  rows = jnp.minimum(jnp.arange(-(-n // block) * block, dtype=jnp.int32), n - 1)
  return rows if offset is None else offset + rows
