"""Kernels that are not jattn's own (Pallas splash on TPU, cuDNN through jax.nn) with jattn's
edge semantics restored around them, and the refusals every fused kernel shares.

Such a kernel leaves a row with nothing to attend to undefined (NaN, or the mean of the values it
visited). Its log-sum-exp tells the row apart, but the kernels return it only from a forward
call that cannot be differentiated. So `zero_empty_rows` runs that forward call and sets the
empty rows of the output to 0; its backward recomputes the forward inside the kernel's own VJP
(its differentiable call), with the empty rows' output cotangent zeroed and their query gradient
set to 0: an empty row adds nothing to any gradient. The price is one extra forward kernel when
differentiating. Forward mode, and a derivative of the backward, take the kernel's definition in
plain JAX (`jattn._derivatives.with_derivatives`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, NoReturn

import jax
import jax.numpy as jnp

from jattn._derivatives import with_derivatives
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
