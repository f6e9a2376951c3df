"""The chunked kernels' derivatives in every mode: forward (jvp, linearize, jacfwd), reverse with
the FlashAttention backward (grad), and reverse over reverse (grad of grad, Hessians).

JAX's public API gives a function a custom JVP or a custom VJP, not both (jax#3996). Forward
mode needs the first (JAX cannot run a custom VJP forwards), reverse mode at O(T + S) the second
(JAX cannot transpose the forward's loops). One function gets both through a primitive
(`jattn._derivatives`):

- `_kernel` (chunked attention of padded operands -> (out, lse)) is a custom JVP whose tangent
  is that primitive, linear in the operands' tangents, with `_Rule`;
- evaluating it is the tangent walk (`jattn._chunked.tangent`): forward mode;
- transposing it is the custom backward (`jattn._chunked.kernel.backward`): so reverse mode is
  what it was, the residuals the operands, the output and its log-sum-exp;
- under vmap both are vmapped, the block map unmapped (blocks still skipped); a derivative of
  the tangent (forward over forward, reverse over forward) differentiates its walk with fixed
  trip counts by JAX's own AD.

Reverse over reverse differentiates the backward, whose loops run over data-dependent ranges.
`_backward` is a custom JVP: its value is the fast backward; its tangent differentiates
`forward_fixed` (the forward with fixed trip counts, each query block rematerialised) twice with
JAX's own AD, which transposes at O(T + block_q * S) memory. The tangent of the backward
ignores those of ``out`` and ``lse``: it differentiates through the operands they come from.

`chunked_attention` pads to whole blocks around `_kernel`; `chunked_attention_grads` runs the
backward alone for a caller that keeps the residuals itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jattn import _derivatives, _sharding, _tile
from jattn._chunked import plan as _plan
from jattn._chunked.kernel import Residuals, backward, forward, forward_fixed
from jattn._chunked.plan import Operands, Plan
from jattn._chunked.tangent import tangent

_forward_once = _derivatives.traced_once(forward, static_argnums=0)
# The backward likewise, under a second derivative (staged, then differentiated by
# `_backward_jvp`).
_backward_once = _derivatives.traced_once(backward, static_argnums=0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _kernel(plan: Plan, ops: Operands):
  return _forward_once(plan, ops)


@_kernel.defjvp
def _kernel_jvp(plan: Plan, primals, tangents):
  (ops,), (dot,) = primals, tangents
  res = _kernel(plan, ops)
  out, lse = res[:2]
  rule = _Rule(plan, ops)
  dleaves = _up_to(rule.treedef, dot)
  primal = [jnp.asarray(x) for x in _up_to(rule.treedef, ops)] + [out, lse]
  dots = [d for d, f in zip(dleaves, rule.diff) if f]
  dout, dlse = _derivatives.bind(rule, primal, dots, (jax.typeof(out), jax.typeof(lse)))
  # The max logits (with ``plan.cfg.max_logits``) are a statistic: their tangent is zero, and
  # a cotangent given to them is dropped.
  return res, (dout, dlse, *(jnp.zeros_like(x) for x in res[2:]))


class _Rule:
  """The tangent primitive's rule (`jattn._derivatives`): the plan, the operands' tree and
  which of its leaves are differentiable (floating point). Primal operands: the operands'
  leaves, out and lse; tangent operands: the differentiable leaves' tangents."""

  def __init__(self, plan: Plan, ops: Operands):
    leaves, self.treedef = jax.tree.flatten(ops)
    self.plan = plan
    self.diff = tuple(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves)
    self.n_primal = len(self.diff) + 2

  def ops(self, leaves) -> Operands:
    return jax.tree.unflatten(self.treedef, list(leaves))

  def tangent(self, *args, fixed: bool = False):
    """(operand leaves, out, lse, differentiable leaves' tangents) -> [out', lse']. ``fixed``:
    by the walk of fixed trip counts, which JAX's reverse mode differentiates."""
    n = len(self.diff)
    tangents = iter(args[n + 2 :])
    dot = self.ops(next(tangents) if f else None for f in self.diff)
    return list(tangent(self.plan, self.ops(args[:n]), args[n], args[n + 1], dot, fixed))

  def tangent_differentiable(self, *args):
    return self.tangent(*args, fixed=True)

  def transpose(self, primal, cts):
    """(operand leaves, out, lse), (out's and lse's cotangents) -> differentiable leaves'."""
    n = len(self.diff)
    out, lse = primal[n], primal[n + 1]
    cts = [jnp.zeros_like(x) if ct is None else ct for ct, x in zip(cts, (out, lse))]
    return _backward(self.plan, self.ops(primal[:n]), out, lse, *cts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _backward(plan: Plan, ops: Operands, out, lse, dout, dlse):
  """The differentiable leaves' cotangents (in `jax.tree.leaves(ops)` order) by the backward."""
  grads = _grads(plan, Residuals(ops, out, lse), dout, dlse)
  treedef = jax.tree.structure(ops)
  leaves = _up_to(treedef, grads)
  return [g for g, x in zip(leaves, _up_to(treedef, ops)) if _differentiable(x)]


@_backward.defjvp
def _backward_jvp(plan: Plan, primals, tangents):
  ops, _out, _lse, dout, dlse = primals
  tops, _, _, tdout, tdlse = tangents
  treedef = jax.tree.structure(ops)
  leaves = _up_to(treedef, ops)
  diff = [_differentiable(x) for x in leaves]
  pick = lambda tree: [x for x, f in zip(_up_to(treedef, tree), diff) if f]

  def with_leaves(d):
    it = iter(d)
    return jax.tree.unflatten(treedef, [next(it) if f else x for x, f in zip(leaves, diff)])

  def cotangents(d, dout, dlse):
    _, vjp = jax.vjp(lambda d: forward_fixed(plan, with_leaves(d)), d)
    return vjp((dout, dlse))[0]

  primal_out = _backward(plan, *primals)
  _, tangent_out = jax.jvp(cotangents, (pick(ops), dout, dlse), (pick(tops), tdout, tdlse))
  return primal_out, tangent_out


def _up_to(treedef, tree) -> list:
  """The subtrees of ``tree`` at the leaves of ``treedef`` (None included)."""
  return treedef.flatten_up_to(tree)


def _differentiable(x) -> bool:
  return x is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _grads(plan: Plan, res: Residuals, dout, dlse) -> Operands:
  """`backward`, each cotangent typed like its operand under an Explicit mesh."""
  grads = _backward_once(plan, res, dout, dlse)
  if _sharding.explicit_mesh():
    # A cotangent must have its operand's type, sharding included: the sinks' gradient, summed
    # from head-sharded statistics, comes out sharded like the heads even where the sinks are
    # replicated.
    ops, fields = res.ops, ("q", "k", "v", "bias", "sink", "score_args")
    want = [jax.tree.map(jax.typeof, getattr(ops, f)) for f in fields]
    got = _sharding.reshard_like([getattr(grads, f) for f in fields], want)
    grads = grads._replace(**dict(zip(fields, got)))
  return grads


def chunked_attention(plan: Plan, ops: Operands):
  """Chunked attention of unpadded operands: q (B,T,N,H), k/v (B,S,K,H), bias
  (B|1,K|1,G|1,T|1,S|1). Pads T and S to whole blocks, runs the kernel, and slices the padding
  off. Returns out (B,T,N,H) and lse (B,T,N), and the max logits (B,T,N) with
  ``plan.cfg.max_logits``.
  """
  q, k, v, bias = _plan.pad_to_blocks(plan, ops.q, ops.k, ops.v, ops.bias)
  res = _kernel(plan, ops._replace(q=q, k=k, v=v, bias=bias))
  T = plan.cfg.T
  if plan.Tp != T:
    res = tuple(x[:, :T] for x in res)
  return tuple(res)


def chunked_attention_grads(plan: Plan, ops: Operands, out, lse, dout, dlse) -> Operands:
  """The cotangents of `chunked_attention`'s operands from its saved output and log-sum-exp
  (out (B, T, N, H), lse (B, T, N)) and their cotangents: its backward pass, run by a caller
  that keeps the residuals itself (the partitioned operation of `jattn._parallel.partition`)."""
  padded, unpad = jax.vjp(
    lambda q, k, v, bias: _plan.pad_to_blocks(plan, q, k, v, bias), ops.q, ops.k, ops.v, ops.bias
  )
  pt = plan.Tp - plan.cfg.T

  def rows(x, fill=0):
    pads = ((0, 0), (0, pt)) + ((0, 0),) * (x.ndim - 2)
    return jnp.pad(x, pads, constant_values=fill) if pt else x

  # Padded query rows get a huge positive lse: their recomputed probabilities, and their share
  # of the sinks' gradient (exp(sink - lse), times a zero delta), are exact zeros. (The empty-
  # row value NEG would give the sinks exp(sink - NEG) = inf times 0.)
  res = Residuals(
    ops._replace(q=padded[0], k=padded[1], v=padded[2], bias=padded[3]),
    rows(out),
    rows(lse, -_tile.NEG),
  )
  grads = _grads(plan, res, rows(dout), rows(dlse))
  dq, dk, dv, dbias = unpad((grads.q, grads.k, grads.v, grads.bias))
  return grads._replace(q=dq, k=dk, v=dv, bias=dbias)
