"""Where a program is lowered: the per-platform switch, the stand-in of a kernel on a platform it
has no code for, and Pallas's interpret modes (the kernels a TPU or GPU gets, walked on a CPU).

jattn chooses per platform where the program is lowered, not where it is traced
(`jax.lax.platform_dependent`): a program exported for cuda or tpu from a CPU gets the
accelerator's choice. Shape vocabulary: B T N H, Hv the value head size.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.extend import core as _core
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir


def by_platform(fns):
  """Call ``fns[platform]`` (a "default" entry, if any, for the rest), chosen where the program
  is lowered, not where it is traced: a program exported for cuda or tpu from this CPU gets the
  accelerator's choice. One distinct function for every platform is simply called."""
  if len(set(fns.values())) == 1 and "default" in fns:
    return next(iter(fns.values()))()
  rest = {p: f for p, f in fns.items() if p != "default"}
  return jax.lax.platform_dependent(**rest, default=fns.get("default"))


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
  return by_platform(
    {
      platform: go,
      "default": lambda: unavailable(message, like, call.query, call.key, call.value),
    }
  )


# --------------------------------------------------------------------------------------------
# Interpret modes: the Pallas kernels of a TPU or a GPU, run on any platform (tests).
# --------------------------------------------------------------------------------------------


def tpu_interpreting() -> bool:
  """Whether Pallas's TPU interpret mode is on where the call is traced
  (`jax.experimental.pallas.tpu.force_tpu_interpret_mode`): the Pallas TPU kernels (splash,
  the paged kernel) then run on any platform."""
  from jax._src import config

  setting = getattr(config, "pallas_tpu_interpret_mode_context_manager", None)
  return setting is not None and setting.value is not None


_GPU_INTERPRET = contextvars.ContextVar("jattn_gpu_interpret", default=False)


@contextlib.contextmanager
def gpu_interpret_mode():
  """Run jattn's Pallas GPU kernels -- the paged kernel (``paged_attention(implementation=
  "pallas")``) and the flash attention of ``implementation="pallas_gpu"`` -- in Pallas's
  interpret mode, on any platform (tests: the kernels a GPU gets, walked on the CPU). JAX has
  no switch of its own for the GPU's interpret mode, as it has for the TPU's."""
  token = _GPU_INTERPRET.set(True)
  try:
    yield
  finally:
    _GPU_INTERPRET.reset(token)


def gpu_interpreting() -> bool:
  return _GPU_INTERPRET.get()
