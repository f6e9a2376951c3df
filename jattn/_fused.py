"""Fused kernels that are not jattn's own (Pallas splash on TPU, cuDNN through jax.nn) with
jattn's edge semantics restored around them.

Such a kernel leaves a row with nothing to attend to undefined (NaN, or the mean of the values it
visited). Its log-sum-exp tells the row apart, but the kernels return it only from a forward
call that cannot be differentiated. So the custom VJP here runs that forward call, sets the empty
rows of the output to 0, and in the backward recomputes the forward inside the kernel's own VJP
(its differentiable call), with the empty rows' output cotangent zeroed, and their query
gradient set to 0: an empty row adds nothing to any gradient. The price is one extra forward
kernel when differentiating.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import jax
import jax.numpy as jnp
from jax.extend import core as _core
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir

from jattn import _linear_tangent, _plan
from jattn._tile import NEG


def refuse(implementation: str, name: str, reason: str) -> NoReturn:
  """The NotImplementedError of a kernel that cannot take the call (a sequence falls through)."""
  raise NotImplementedError(f"implementation={implementation!r} does not support {name}: {reason}")


def missing_input(kernel: str, inputs) -> str | None:
  """A kernel's `supports` reason for the first of ``inputs`` ((name, given) pairs) that the call
  gives and the kernel has no input for, or None."""
  for name, given in inputs:
    if given:
      return f"{name}: {kernel} has no such input"
  return None


def zero_empty_rows(forward, plain, pure, empty_rows, lse_of, diff, aux, *, int32=False):
  """(out, lse) of ``forward(*diff, *aux)``, with the rows where ``empty_rows(lse)`` holds set
  to 0 (lse NEG); differentiable in ``diff`` (a tuple whose first entry is the query, laid out
  like the output; None entries are skipped) in every mode (`with_derivatives`).

  Reverse mode runs the kernel's own backward: ``plain(*diff, *aux) -> out`` (the kernel's
  differentiable call) recomputed inside its VJP, with the empty rows' output cotangent zeroed
  and their query gradient set to 0 (an empty row adds nothing to any gradient), and, where the
  lse's cotangent is not a symbolic zero (the lse is used, as in a merge of parts),
  ``lse_of(*diff, *aux) -> lse`` (plain JAX). ``aux``: a tuple of arrays without gradient
  (segment ids).

  ``pure`` (same signature as ``plain``, in plain JAX) is the kernel's definition: forward mode
  (jvp, jacfwd, linearize) takes its tangent (with ``lse_of``'s), and a derivative of the
  backward (a gradient of a gradient) differentiates it, since the kernels have neither. A
  platform_dependent call differentiates every platform's branch, so without it forward mode
  would fail on every platform, also where the kernel is never lowered.

  ``int32``: the kernel's forward and backward are traced with jax_enable_x64 off (Mosaic's
  TPU kernels take no 64-bit integers, which x64 makes of Python's in their index arithmetic)."""
  if int32:
    forward = _without_x64(forward)
  kernel = functools.partial(_zeroed_kernel, forward, empty_rows)
  reference = functools.partial(_reference, pure, lse_of)
  backward = functools.partial(_zeroed_backward, _Definitions(plain, pure, lse_of, int32))
  return with_derivatives(kernel, reference, backward, diff, aux)


def _zeroed_kernel(forward, empty_rows, diff, aux):
  out, lse = forward(*diff, *aux)
  empty = empty_rows(lse)
  # jattn's log-sum-exp of an empty row is NEG on every path (the kernel's may be -inf or its
  # own sentinel).
  outs = (
    jnp.where(empty[..., None], jnp.zeros((), out.dtype), out),
    jnp.where(empty, jnp.asarray(NEG, lse.dtype), lse),
  )
  # Saved as a float array: its tangent is a zero array, which a symbolic shape can have.
  return outs, (empty.astype(jnp.float32),)


def _reference(pure, lse_of, diff, aux, saved):
  """The kernel's (out, lse) by its plain-JAX definition, empty rows constant (0, NEG)."""
  empty = saved[0] > 0
  out, lse = pure(*diff, *aux), lse_of(*diff, *aux)
  lse = lse.reshape(empty.shape)
  return (
    jnp.where(empty[..., None], jnp.zeros((), out.dtype), out),
    jnp.where(empty, jnp.asarray(NEG, lse.dtype), lse),
  )


def _pullback(fn, diff, given, xs, aux, d_out):
  """The gradients of ``fn(*diff, *aux)`` for the entries ``given`` of ``diff`` (now ``xs``)."""

  def f(*xs):
    full = list(diff)
    for i, x in zip(given, xs):
      full[i] = x
    return fn(*full, *aux)

  _, pull = jax.vjp(f, *xs)
  return pull(d_out)


def _without_x64(fn):
  def traced(*args):
    with jax.enable_x64(False):
      return fn(*args)

  return traced


class _Definitions(NamedTuple):
  """The kernel's differentiable call (``plain``), its plain-JAX definition (``pure``) and
  log-sum-exp (``lse_of``), and whether the kernel is traced with x64 off (``int32``)."""

  plain: Callable
  pure: Callable
  lse_of: Callable
  int32: bool


def _zeroed_backward(defs: _Definitions, diff, aux, outs, saved, cts):
  """The cotangents of ``diff`` (None where an entry is None) for those of (out, lse) (None: a
  symbolic zero), by the kernel's own VJP with the empty rows' cotangents zeroed."""
  del outs
  empty = saved[0] > 0
  d_out, d_lse = cts
  zero = lambda x: jnp.where(empty[..., None], jnp.zeros((), x.dtype), x)
  given = [i for i, x in enumerate(diff) if x is not None]
  xs = tuple(diff[i] for i in given)
  shape = [None if x is None else 0 for x in diff]  # the structure, without the arrays

  def pullback(fn, int32=False):
    back = lambda xs, d_out, aux: _pullback(fn, shape, given, xs, aux, d_out)
    return _without_x64(back) if int32 else back

  if d_out is None:
    grads = tuple(jnp.zeros_like(x) for x in xs)
  else:
    # The kernel's backward has no derivative of its own: differentiated (a gradient of a
    # gradient, a Hessian), it is the definition's backward that is.
    defined = lambda diff, aux: tuple(pullback(defs.pure)(diff[:-1], diff[-1], aux))
    grads = with_derivatives(
      lambda diff, aux: (tuple(pullback(defs.plain, defs.int32)(diff[:-1], diff[-1], aux)), ()),
      lambda diff, aux, saved: defined(diff, aux),
      lambda diff, aux, outs, saved, cts: jax.vjp(lambda d: defined(d, aux), diff)[1](
        tuple(jnp.zeros_like(o) if c is None else c for c, o in zip(cts, outs))
      )[0],
      (*xs, zero(d_out)),
      aux,
    )
  if d_lse is not None:
    # d lse / d logits = P: the lse's own gradient, from the plain computation of it (empty
    # rows' lse is a constant).
    d_lse = jnp.where(empty, jnp.zeros((), d_lse.dtype), d_lse)
    lse_like = lambda *a: defs.lse_of(*a).reshape(d_lse.shape).astype(d_lse.dtype)
    grads = jax.tree.map(jnp.add, tuple(grads), tuple(pullback(lse_like)(xs, d_lse, aux)))
  by_index = dict(zip(given, grads))
  by_index[0] = zero(by_index[0])
  return tuple(by_index.get(i) for i in range(len(diff)))


# --------------------------------------------------------------------------------------------
# A kernel with a reverse mode of its own and forward mode from its plain-JAX definition.
# --------------------------------------------------------------------------------------------
#
# A fused kernel with only a VJP fails under jvp, jacfwd, hessian and linearize -- and inside
# `platform_dependent`, whose every branch is differentiated, it fails on every platform. So,
# as jattn's chunked kernels, it is a custom JVP whose tangent is a primitive linear in the
# operands' tangents (`jattn._linear_tangent`): evaluating it is forward mode (the jvp of the
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
  """The tangent primitive's rule (`jattn._linear_tangent`), hashed by identity: the three
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


def _differentiable(kernel, reference, backward):
  """The custom JVP around ``kernel``: (diff, aux) -> (outs, saved)."""

  @jax.custom_jvp
  def fn(diff, aux):
    outs, saved = kernel(diff, aux)
    return tuple(outs), tuple(saved)

  @fn.defjvp
  def fn_jvp(primals, tangents):
    diff, aux = primals
    outs, saved = fn(diff, aux)  # under an outer forward mode, differentiated the same way
    rule = _Rule(kernel, reference, backward, diff, aux, len(outs), len(saved))
    dots = [_ad.instantiate_zeros(t) for t in jax.tree.leaves(tangents[0])]
    primal = [*jax.tree.leaves(diff), *jax.tree.leaves(aux), *outs, *saved]
    d_outs = _linear_tangent.bind(rule, primal, dots, tuple(jax.typeof(x) for x in outs))
    zeros = tuple(jnp.zeros_like(x) for x in saved)
    return (outs, saved), (tuple(d_outs), zeros)

  return fn


# --------------------------------------------------------------------------------------------
# A fused kernel named alone, in a program lowered for a platform it has no kernel for.
# --------------------------------------------------------------------------------------------
#
# Whether the program will be lowered for the kernel's platform is known only when it is
# lowered (a program exported for tpu from a CPU is traced here), so the refusal is an
# operation whose lowering raises: it stands in the other platforms' branch of
# `jax.lax.platform_dependent`, which lowers only the branches of the platforms asked for.

_unavailable_p = _core.Primitive("jattn_unavailable")
_unavailable_p.multiple_results = True


def _unavailable_abstract(*args, avals, message):
  del args, message
  return [jax.core.ShapedArray(shape, dtype) for shape, dtype in avals]


def _unavailable_lowering(ctx, *args, avals, message):
  del args, avals
  platforms = getattr(getattr(ctx, "module_context", None), "platforms", None) or ("?",)
  raise NotImplementedError(message.format(platform=", ".join(platforms)))


def _unavailable_batched(args, dims, *, avals, message):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  avals = tuple(((size,) + tuple(shape), dtype) for shape, dtype in avals)
  return _unavailable_p.bind(*args, avals=avals, message=message), [0] * len(avals)


def _unavailable_jvp(primals, tangents, *, avals, message):
  # Never evaluated (its primal fails to lower): tangents that fail the same way (a program
  # that keeps only the tangent must not lower to zeros), linear in the operands' tangents so
  # that reverse mode can transpose them.
  out = _unavailable_p.bind(*primals, avals=avals, message=message)
  dots = [_ad.instantiate_zeros(t) for t in tangents]
  return out, _unavailable_p.bind(*primals, *dots, avals=avals, message=message)


def _unavailable_transpose(cts, *args, avals, message):
  known = [x for x in args if not _ad.is_undefined_primal(x)]
  cts = [_ad.instantiate_zeros(ct) for ct in cts]
  return [
    _unavailable_p.bind(*known, *cts, avals=((x.aval.shape, x.aval.dtype),), message=message)[0]
    if _ad.is_undefined_primal(x)
    else None
    for x in args
  ]


_unavailable_p.def_abstract_eval(_unavailable_abstract)
_ad.primitive_jvps[_unavailable_p] = _unavailable_jvp
_ad.primitive_transposes[_unavailable_p] = _unavailable_transpose
_mlir.register_lowering(_unavailable_p, _unavailable_lowering)
_batching.primitive_batchers[_unavailable_p] = _unavailable_batched


def unavailable(message: str, like, *operands):
  """Arrays shaped like the pytree ``like`` (abstract values) whose lowering raises
  NotImplementedError(``message``); differentiable in ``operands`` in every mode (their
  tangents and cotangents lower to the same error)."""
  leaves, tree = jax.tree.flatten(like)
  avals = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves)
  return jax.tree.unflatten(tree, _unavailable_p.bind(*operands, avals=avals, message=message))


def only_on(platform: str, go, call, message: str):
  """A fused kernel's (out (B, T, N, Hv), lse (B, T, N) float32) of a bound ``call``: ``go()``
  where the program is lowered for ``platform``, elsewhere stand-ins whose lowering raises
  NotImplementedError(``message``, its ``{platform}`` filled in)."""
  s = call.static
  like = (
    jax.ShapeDtypeStruct((s.B, s.T, s.N, s.Hv), s.dtype),
    jax.ShapeDtypeStruct((s.B, s.T, s.N), jnp.float32),
  )
  return _plan.by_platform(
    {
      platform: go,
      "default": lambda: unavailable(message, like, call.query, call.key, call.value),
    }
  )


def interpreting() -> bool:
  """Whether Pallas's TPU interpret mode is on where the call is traced
  (`jax.experimental.pallas.tpu.force_tpu_interpret_mode`): the Pallas TPU kernels then run on
  any platform."""
  from jax._src import config

  setting = getattr(config, "pallas_tpu_interpret_mode_context_manager", None)
  return setting is not None and setting.value is not None
