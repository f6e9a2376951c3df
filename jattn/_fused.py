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
from typing import NoReturn

import jax
import jax.numpy as jnp
from jax.extend import core as _core
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir

from jattn import _plan
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def zero_empty_rows(forward, plain, pure, empty_rows, lse_of, diff, aux):
  """(out, lse) of ``forward(*diff, *aux)``, with the rows where ``empty_rows(lse)`` holds set
  to 0 (lse NEG); differentiable in ``diff`` (a tuple whose first entry is the query, laid out
  like the output; None entries are skipped) through ``plain(*diff, *aux) -> out`` and, for the
  log-sum-exp, ``lse_of(*diff, *aux) -> lse`` (plain JAX; differentiated only where the lse's
  cotangent is not a symbolic zero: the lse is used, as in a merge of parts). ``aux``: a tuple
  of arrays without gradient (segment ids).

  ``pure`` (same signature as ``plain``, in plain JAX, or None) differentiates the backward
  itself (a gradient of a gradient): the kernels have no derivative of their own backward, and
  a platform_dependent call differentiates every platform's branch, so without it a second
  derivative would fail on every platform, also where the kernel is never lowered."""
  out, lse = forward(*diff, *aux)
  empty = empty_rows(lse)
  # jattn's log-sum-exp of an empty row is NEG on every path (the kernel's may be -inf or its
  # own sentinel).
  return (
    jnp.where(empty[..., None], jnp.zeros((), out.dtype), out),
    jnp.where(empty, jnp.asarray(NEG, lse.dtype), lse),
  )


def _fwd(forward, plain, pure, empty_rows, lse_of, diff, aux):
  # symbolic_zeros: the primals come wrapped (their .value), the cotangents may be SymbolicZero.
  diff, aux = jax.tree.map(lambda x: x.value, (diff, aux))
  out, lse = zero_empty_rows(forward, plain, pure, empty_rows, lse_of, diff, aux)
  return (out, lse), (diff, aux, empty_rows(lse))


def _pullback(fn, diff, given, xs, aux, d_out):
  """The gradients of ``fn(*diff, *aux)`` for the entries ``given`` of ``diff`` (now ``xs``)."""

  def f(*xs):
    full = list(diff)
    for i, x in zip(given, xs):
      full[i] = x
    return fn(*full, *aux)

  _, pull = jax.vjp(f, *xs)
  return pull(d_out)


def _bwd(forward, plain, pure, empty_rows, lse_of, res, cts):
  diff, aux, empty = res
  d_out, d_lse = cts
  zero = lambda x: jnp.where(empty[..., None], jnp.zeros((), x.dtype), x)
  given = [i for i, x in enumerate(diff) if x is not None]
  xs = tuple(diff[i] for i in given)
  shape = [None if x is None else 0 for x in diff]  # the structure, without the arrays
  if isinstance(d_out, _SymbolicZero):
    d_out = jnp.zeros(d_out.shape, d_out.dtype)

  def pullback(fn):
    return lambda xs, d_out, aux: _pullback(fn, shape, given, xs, aux, d_out)

  if pure is None:
    grads = pullback(plain)(xs, zero(d_out), aux)
  else:
    grads_of = jax.custom_jvp(pullback(plain))
    # aux (integer ids) has no tangent: the rule differentiates in xs and d_out only.
    grads_of.defjvp(
      lambda primals, tangents: jax.jvp(
        lambda xs, d: pullback(pure)(xs, d, primals[2]), primals[:2], tangents[:2]
      )
    )
    grads = grads_of(xs, zero(d_out), aux)
  if not isinstance(d_lse, _SymbolicZero):
    # d lse / d logits = P: the lse's own gradient, from the plain computation of it (empty
    # rows' lse is a constant).
    d_lse = jnp.where(empty, jnp.zeros((), d_lse.dtype), d_lse)
    lse_like = lambda *a: lse_of(*a).reshape(d_lse.shape).astype(d_lse.dtype)
    grads = jax.tree.map(jnp.add, tuple(grads), tuple(pullback(lse_like)(xs, d_lse, aux)))
  grads = dict(zip(given, grads))
  grads[0] = zero(grads[0])
  return tuple(grads.get(i) for i in range(len(diff))), tuple(None for _ in aux)


_SymbolicZero = jax.custom_derivatives.SymbolicZero
zero_empty_rows.defvjp(_fwd, _bwd, symbolic_zeros=True)


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
  # Never evaluated (its primal fails to lower): zero tangents let a gradient of a gradient
  # trace through the branch.
  del tangents
  out = _unavailable_p.bind(*primals, avals=avals, message=message)
  return out, [jnp.zeros(shape, dtype) for shape, dtype in avals]


_unavailable_p.def_abstract_eval(_unavailable_abstract)
_ad.primitive_jvps[_unavailable_p] = _unavailable_jvp
_mlir.register_lowering(_unavailable_p, _unavailable_lowering)
_batching.primitive_batchers[_unavailable_p] = _unavailable_batched


def unavailable(message: str, like, *operands):
  """Arrays shaped like the pytree ``like`` (abstract values) whose lowering raises
  NotImplementedError(``message``); differentiable in ``operands`` (their cotangents lower to
  the same error)."""
  leaves, tree = jax.tree.flatten(like)
  avals = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves)

  @jax.custom_vjp
  def stand_in(*xs):
    return _unavailable_p.bind(*xs, avals=avals, message=message)

  def fwd(*xs):
    return stand_in(*xs), xs

  def bwd(xs, cts):
    del cts
    back = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in xs)
    return tuple(_unavailable_p.bind(*xs, avals=back, message=message))

  stand_in.defvjp(fwd, bwd)
  return jax.tree.unflatten(tree, stand_in(*operands))


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
