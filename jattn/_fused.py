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

import jax
import jax.numpy as jnp

from jattn._tile import NEG


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def zero_empty_rows(forward, plain, empty_rows, diff, aux):
  """(out, lse) of ``forward(*diff, *aux)``, with the rows where ``empty_rows(lse)`` holds set
  to 0; differentiable in ``diff`` (a tuple whose first entry is the query, laid out like the
  output; None entries are skipped) through ``plain(*diff, *aux) -> out``. ``aux``: a tuple of
  arrays without gradient (segment ids)."""
  out, lse = forward(*diff, *aux)
  empty = empty_rows(lse)
  # jattn's log-sum-exp of an empty row is NEG on every path (the kernel's may be -inf or its
  # own sentinel).
  return (jnp.where(empty[..., None], jnp.zeros((), out.dtype), out),
          jnp.where(empty, jnp.asarray(NEG, lse.dtype), lse))


def _fwd(forward, plain, empty_rows, diff, aux):
  out, lse = zero_empty_rows(forward, plain, empty_rows, diff, aux)
  return (out, lse), (diff, aux, empty_rows(lse))


def _bwd(forward, plain, empty_rows, res, cts):
  diff, aux, empty = res
  d_out, _ = cts  # the log-sum-exp is returned without gradient
  zero = lambda x: jnp.where(empty[..., None], jnp.zeros((), x.dtype), x)
  given = [i for i, x in enumerate(diff) if x is not None]

  def f(*xs):
    full = list(diff)
    for i, x in zip(given, xs):
      full[i] = x
    return plain(*full, *aux)

  _, pull = jax.vjp(f, *(diff[i] for i in given))
  grads = dict(zip(given, pull(zero(d_out))))
  grads[0] = zero(grads[0])
  return tuple(grads.get(i) for i in range(len(diff))), tuple(None for _ in aux)


zero_empty_rows.defvjp(_fwd, _bwd)
