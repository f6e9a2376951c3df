"""The JAX implementations compared, each as a function of (query, key, value, aux) for one case.

Every implementation is called the way its users would call it for the case's mask: native
keywords where the library has them (``is_causal``, ``local_window_size``, segment ids), else a
boolean mask array built inside the jitted function (what a flax user's ``make_causal_mask`` or
``make_attention_mask`` does). The row's ``note`` says when that happened.

Layouts: query (B, T, N, H), key and value (B, S, K, H), output (B, T, N, H); ``aux`` holds the
int32 segment ids ``q_seg`` (B, T) and ``kv_seg`` (B, S) when the mask has segments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from jattn.bench import flops as _flops
from jattn.bench import masks as _masks
from jattn.bench.config import CHUNKED_IMPLEMENTATIONS, Case, Impl


class Unsupported(Exception):
  """This implementation cannot run this case (recorded as 'unsupported', not as an error)."""


def attention_fn(impl: Impl, case: Case) -> tuple[Callable, str]:
  """(attn(q, k, v, aux) -> out, note) for a JAX implementation; raises Unsupported."""
  if impl.name in ("jattn-dense", "jattn-splash", "jattn-cudnn") or (
    impl.name in CHUNKED_IMPLEMENTATIONS
  ):
    return _jattn(impl, case)
  if impl.name in ("jax-nn", "jax-nn-cudnn"):
    return _jax_nn(impl, case)
  if impl.name == "flax":
    return _flax(case)
  raise ValueError(f"attention_fn: {impl.name!r} is not a JAX implementation")


def _jattn(impl, case):
  m = case.mask
  kwargs = dict(is_causal=m.causal or False, local_window_size=m.window)
  if impl.name in CHUNKED_IMPLEMENTATIONS:
    # jattn-chunked: schedule=None, the platform's default (serial on CPU, parallel on GPU/TPU).
    schedule = {"jattn-serial": "serial", "jattn-parallel": "parallel"}.get(impl.name)
    kwargs.update(
      implementation="chunked", block_q=impl.block_q, block_kv=impl.block_kv, schedule=schedule
    )
  else:  # jattn-dense, jattn-splash, jattn-cudnn: their own default blocks
    kwargs.update(implementation=impl.name[len("jattn-") :])

  def attn(q, k, v, aux):
    return jattn.dot_product_attention(
      q, k, v, q_segment_ids=aux.get("q_seg"), kv_segment_ids=aux.get("kv_seg"), **kwargs
    )

  return attn, ""


def _jax_nn(impl, case):
  m = case.mask
  # jax.nn's own implementation names (not jattn's `Implementation`).
  implementation: Literal["xla", "cudnn"] = "cudnn" if impl.name == "jax-nn-cudnn" else "xla"
  # jax.nn's is_causal and local_window_size are top-left aligned and it has no segment ids.
  native = m.causal in (None, "top_left") and m.segments is None

  def attn(q, k, v, aux):
    if native:
      return jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=m.causal is not None,
        local_window_size=m.window,
        implementation=implementation,
      )
    mask = _masks.mask_array(m, case.T, case.S, aux.get("q_seg"), aux.get("kv_seg"))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)

  return attn, "" if native else "mask passed as a boolean array"


def _flax(case):
  import flax.linen as nn  # imported here so that a sweep without flax never needs it

  m = case.mask
  G = case.N // case.K
  notes = []
  if G > 1:
    notes.append(f"flax needs N == K: k/v heads repeated {G}x")
  if m != _masks.MaskSpec():
    notes.append("mask passed as a boolean array")

  def attn(q, k, v, aux):
    if G > 1:
      # (B, S, K, H) -> (B, S, N, H): each key/value head serves G consecutive query heads, the
      # grouping jax.nn and jattn use.
      k = jnp.repeat(k, G, axis=2)
      v = jnp.repeat(v, G, axis=2)
    mask = _masks.mask_array(m, case.T, case.S, aux.get("q_seg"), aux.get("kv_seg"))
    return nn.dot_product_attention(q, k, v, mask=mask)

  return attn, "; ".join(notes)


def trace_context(impl: Impl) -> contextlib.AbstractContextManager:
  """The JAX settings to trace ``impl`` under.

  jax.nn and flax are written for jax's default promotion rules and fail under the strict dtype
  and rank promotion that jattn's tests (and careful users) set globally; they are traced under
  the defaults, as their users run them. jattn is traced under whatever is set.
  """
  if impl.name in ("jax-nn", "jax-nn-cudnn", "flax"):
    stack = contextlib.ExitStack()
    stack.enter_context(jax.numpy_dtype_promotion("standard"))
    stack.enter_context(jax.numpy_rank_promotion("allow"))
    return stack
  return contextlib.nullcontext()


def pass_fn(attn: Callable, pass_: str) -> Callable:
  """The benchmarked function of one pass.

  forward: f(q, k, v, aux) -> out. forward+backward: f(q, k, v, dout, aux) -> (out, dq, dk, dv),
  the VJP of the attention with a fixed random cotangent (what a training step computes).
  """
  if pass_ == _flops.FORWARD:
    return attn

  def forward_backward(q, k, v, dout, aux):
    out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, aux), q, k, v)
    return (out, *vjp(dout))

  return forward_backward


def make_inputs(case: Case, seed: int) -> tuple:
  """Device arrays of the case: (q, k, v, aux) or (q, k, v, dout, aux), unit normal in its dtype."""
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(case.dtype)

  def normal(shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

  q = normal((case.B, case.T, case.N, case.H))
  k = normal((case.B, case.S, case.K, case.H))
  v = normal((case.B, case.S, case.K, case.H))
  aux = {}
  if case.mask.segments is not None:
    aux["q_seg"] = jnp.asarray(
      np.broadcast_to(_masks.segment_ids(case.T, case.mask.segments), (case.B, case.T))
    )
    aux["kv_seg"] = jnp.asarray(
      np.broadcast_to(_masks.segment_ids(case.S, case.mask.segments), (case.B, case.S))
    )
  if case.pass_ == _flops.FORWARD:
    return (q, k, v, aux)
  return (q, k, v, normal((case.B, case.T, case.N, case.H)), aux)
