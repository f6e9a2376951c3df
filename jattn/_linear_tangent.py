"""A kernel differentiable in every mode: a custom JVP whose tangent is one primitive, linear in
the operands' tangents, that a rule evaluates (forward mode) and transposes (reverse mode).

JAX gives a function a custom JVP or a custom VJP, not both (jax#3996), and cannot run a custom
VJP forwards. A kernel with a backward of its own (FlashAttention's, or a fused kernel's) gets
both this way: its custom JVP returns the tangent as `bind(rule, primal operands, tangent
operands, avals)`. JAX's reverse mode linearizes and transposes that primitive, which is the
rule's backward from the primal operands (the residuals: operands, output, log-sum-exp); forward
mode evaluates it, which is the rule's tangent. Users of it: the chunked kernels
(`jattn._chunked.derivatives`) and the fused kernels (`jattn._fused.with_derivatives`).

A rule (hashed by identity) has ``n_primal`` (how many leading operands are primal: the rest are
tangents, each shaped like one of the primal operands it is linear in) and

- ``tangent(*operands) -> [output tangents]``;
- ``tangent_differentiable(*operands)``: the same, in a form JAX's own AD can differentiate
  (a derivative of the tangent: forward over forward, reverse over forward);
- ``transpose(primal operands, cotangents) -> [cotangents of the tangent operands]``, a
  cotangent None where it is a symbolic zero.

Under vmap the primal operands a level does not map stay unmapped (``in_axes=None``): they
include the block map, and a mapped block map would turn each skipped block's branch into a
select that computes it. Tangent operands are broadcast (their transposes sum them back).
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir


def bind(rule, primal, tangents, avals) -> list:
  """The output tangents (abstract values ``avals``) of ``rule`` at ``primal`` in the direction
  ``tangents`` (arrays, one per tangent operand)."""
  assert len(primal) == rule.n_primal
  return _p.bind(*primal, *tangents, rule=rule, levels=(), avals=tuple(avals))


def _vmapped(fn, levels):
  """``fn`` vmapped once per batching level (the earliest innermost): a level maps the primal
  operands it holds along their leading axis, and every tangent operand."""
  for _, mapped in levels:
    fn = _level(fn, mapped)
  return fn


def _level(fn, mapped):
  def vmapped(*args):
    axes = [0 if m else None for m in mapped] + [0] * (len(args) - len(mapped))
    return jax.vmap(fn, in_axes=axes)(*args)

  return vmapped


def _batched(avals, levels):
  if not levels:
    # The callers' own types (jax.typeof), sharding included: under an Explicit mesh the
    # cotangents reverse mode builds for the tangents are typed like them, and the backward
    # multiplies them with residuals sharded that way.
    return list(avals)
  # Each level moved its axis to the front: the latest level's size comes first.
  sizes = tuple(size for size, _ in reversed(levels))
  return [jax.core.ShapedArray(sizes + tuple(a.shape), a.dtype) for a in avals]


def _evaluate(*args, rule, levels, avals):
  return _vmapped(rule.tangent, levels)(*args)


def _abstract(*args, rule, levels, avals):
  return _batched(avals, levels)


def _transpose(cts, *args, rule, levels, avals):
  n = rule.n_primal
  assert not any(ad.is_undefined_primal(x) for x in args[:n])
  given = [None if type(ct) is ad.Zero else ct for ct in cts]
  if all(ct is None for ct in given):
    return [None] * len(args)
  if levels:
    # Under vmap the backward sees every operand as an array: symbolic zeros become real ones.
    given = [
      jnp.zeros(a.shape, a.dtype) if ct is None else ct
      for ct, a in zip(given, _batched(avals, levels))
    ]
  back = lambda *a: list(rule.transpose(a[:n], a[n:]))
  return [None] * n + list(_vmapped(back, levels)(*args[:n], *given))


def _batch(args, dims, *, rule, levels, avals):
  n = rule.n_primal
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  primal = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args[:n], dims[:n])]
  tangents = [
    jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
    for x, d in zip(args[n:], dims[n:])
  ]
  mapped = tuple(d is not None for d in dims[:n])
  out = _p.bind(*primal, *tangents, rule=rule, levels=(*levels, (size, mapped)), avals=avals)
  return out, [0] * len(out)


def _jvp(primals, tangents, *, rule, levels, avals):
  # Linear in its tangent operands; through the others, forward mode of the differentiable
  # form of the tangent, which a reverse mode over it (grad of a jvp) can transpose.
  n = rule.n_primal
  params = dict(rule=rule, levels=levels, avals=avals)
  out = _p.bind(*primals, **params)
  linear = _p.bind(*primals[:n], *map(ad.instantiate_zeros, tangents[n:]), **params)
  walk = lambda *p: _vmapped(rule.tangent_differentiable, levels)(*p, *primals[n:])
  _, through = jax.jvp(walk, tuple(primals[:n]), tuple(map(ad.instantiate_zeros, tangents[:n])))
  return out, [a + b for a, b in zip(linear, through)]


_p = jax.extend.core.Primitive("jattn_linear_tangent")
_p.multiple_results = True
_p.def_impl(_evaluate)
_p.def_abstract_eval(_abstract)
mlir.register_lowering(_p, mlir.lower_fun(_evaluate, multiple_results=True))
ad.primitive_jvps[_p] = _jvp
ad.primitive_transposes[_p] = _transpose
batching.primitive_batchers[_p] = _batch
