"""A kernel differentiable in every mode: a custom JVP whose tangent is one primitive, linear in
the operands' tangents, that a rule evaluates (forward mode) and transposes (reverse mode).

JAX gives a function a custom JVP or a custom VJP, not both (jax#3996), and cannot run a custom
VJP forwards. A kernel with a backward of its own (FlashAttention's, or a fused kernel's) gets
both this way: its custom JVP returns the tangent as `bind(rule, primal operands, tangent
operands, avals)`. JAX's reverse mode linearizes and transposes that primitive, which is the
rule's backward from the primal operands (the residuals: operands, output, log-sum-exp); forward
mode evaluates it, which is the rule's tangent. Users of it: the chunked kernels
(`jattn._chunked.derivatives`) and the fused kernels (`with_derivatives`, below: a kernel with a
backward of its own whose forward mode is its plain-JAX definition's tangent).

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

import functools
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir

from jattn._validation import concrete


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


# --------------------------------------------------------------------------------------------
# A kernel with a reverse mode of its own and forward mode from its plain-JAX definition.
# --------------------------------------------------------------------------------------------
#
# A fused kernel with only a VJP fails under jvp, jacfwd, hessian and linearize -- and inside
# `platform_dependent`, whose every branch is differentiated, it fails on every platform. So,
# as jattn's chunked kernels, it is a custom JVP whose tangent is a primitive linear in the
# operands' tangents (the primitive above): evaluating it is forward mode (the jvp of the
# kernel's plain-JAX definition); transposing it is the kernel's own backward, from the
# residuals the forward saved (reverse mode is what it was: no extra forward kernel).


def with_derivatives(kernel, reference, backward, diff, aux):
  """``kernel(diff, aux)``'s outputs, differentiable in ``diff`` in every mode.

  ``kernel(diff, aux) -> (outs, saved)``: outs a tuple of float arrays (the call's outputs),
  saved a tuple of float arrays the backward reads that have no derivative (masks as 0/1: their
  tangent is zero).
  ``reference(diff, aux, saved) -> outs``: the same outputs in plain JAX (forward mode is its
  jvp). ``backward(diff, aux, outs, saved, cts) -> the cotangents of diff``: cts one per out,
  None for a symbolic zero; None for a None entry of diff. ``diff``, ``aux``: tuples of arrays or
  None (aux without gradient)."""
  return _differentiable(kernel, reference, backward)(tuple(diff), tuple(aux))[0]


class _Rule:
  """The tangent primitive's rule (for a kernel with a backward of its own), hashed by identity: the three
  functions and the operands' trees. Primal operands: diff's and aux's leaves, the outputs and
  the saved arrays; tangent operands: diff's leaves' tangents."""

  def __init__(self, kernel, reference, backward, diff, aux, n_outs, n_saved):
    self.kernel, self.reference, self.backward = kernel, reference, backward
    self.diff_tree: Any = jax.tree.structure(diff)
    self.aux_tree: Any = jax.tree.structure(aux)
    self.n_diff, self.n_aux = len(jax.tree.leaves(diff)), len(jax.tree.leaves(aux))
    self.n_outs, self.n_saved = n_outs, n_saved
    self.n_primal = self.n_diff + self.n_aux + n_outs + n_saved

  def split(self, args):
    """Operands -> (diff, aux, outs, saved, tangents of diff's leaves)."""
    n = [self.n_diff, self.n_aux, self.n_outs, self.n_saved]
    at = [sum(n[:i]) for i in range(5)]
    diff = jax.tree.unflatten(self.diff_tree, list(args[: at[1]]))
    aux = jax.tree.unflatten(self.aux_tree, list(args[at[1] : at[2]]))
    return diff, aux, tuple(args[at[2] : at[3]]), tuple(args[at[3] : at[4]]), args[at[4] :]

  def tangent(self, *args):
    diff, aux, outs, saved, dots = self.split(args)
    leaves = jax.tree.leaves(diff)
    f = lambda leaves: self.reference(jax.tree.unflatten(self.diff_tree, leaves), aux, saved)
    _, d_outs = jax.jvp(f, (leaves,), (list(dots),))
    return [d.astype(o.dtype) for d, o in zip(d_outs, outs)]

  tangent_differentiable = tangent  # the reference is plain JAX

  def transpose(self, primal, cts):
    diff, aux, outs, saved, _ = self.split(primal)
    grads = self.backward(diff, aux, outs, saved, tuple(cts))
    leaves = jax.tree.leaves(diff)
    got = self.diff_tree.flatten_up_to(tuple(grads))
    return [jnp.zeros_like(x) if g is None else g.astype(x.dtype) for g, x in zip(got, leaves)]


def traced_once(fn, static_argnums=()):
  """``fn`` jitted, and called under the abstract mesh in force made explicit.

  A function with a custom derivative is traced when its call is staged (jattn's calls are
  jitted) and again when the staged call is differentiated, by its JVP or forward rule. JAX
  sets the context's abstract mesh between the two (none, then the empty mesh), and that alone
  keeps the second trace out of jit's cache; made explicit, it is the same in both and the
  second trace is the first's: a gradient traces its kernel's forward once, not twice; the
  compiled program is the same (the inner call is inlined)."""
  jitted = jax.jit(fn, static_argnums=static_argnums)

  @functools.wraps(fn)
  def call(*args):
    with jax.sharding.use_abstract_mesh(jax.sharding.get_abstract_mesh()):
      return jitted(*args)

  return call


def _differentiable(kernel, reference, backward):
  """The custom JVP around ``kernel``: (diff, aux) -> (outs, saved)."""
  kernel = traced_once(kernel)

  @jax.custom_jvp
  def fn(diff, aux):
    outs, saved = kernel(diff, aux)
    return tuple(outs), tuple(saved)

  @fn.defjvp
  def fn_jvp(primals, tangents):
    diff, aux = primals
    outs, saved = fn(diff, aux)  # under an outer forward mode, differentiated the same way
    rule = _Rule(kernel, reference, backward, diff, aux, len(outs), len(saved))
    dots = [ad.instantiate_zeros(t) for t in jax.tree.leaves(tangents[0])]
    primal = [*jax.tree.leaves(diff), *jax.tree.leaves(aux), *outs, *saved]
    d_outs = bind(rule, primal, dots, tuple(jax.typeof(x) for x in outs))
    zeros = tuple(jnp.zeros_like(x) for x in saved)
    return (outs, saved), (tuple(d_outs), zeros)

  return fn


def zero_cotangent(x):
  """The cotangent of a non-differentiable operand: zeros, or float0 for integer arrays."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  if not concrete(*x.shape):
    # A symbolic shape (jax.export) has no NumPy float0 array: None is the custom VJP's zero.
    return None
  return np.zeros(x.shape, jax.dtypes.float0)
