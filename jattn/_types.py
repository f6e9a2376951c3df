"""Type aliases that match the docs: the option strings jattn accepts, and array arguments.

They are the annotations of the public functions; `typing.get_args` of a ``Literal`` alias is the
tuple of accepted strings that `jattn._validation` checks against, so annotation and check cannot
drift apart.
"""

from __future__ import annotations

from typing import Literal, Union

import jax

__all__ = [
  "ArrayLike",
  "CausalAlignment",
  "Implementation",
  "IsCausal",
  "LocalWindowSize",
  "RingOrder",
]

# Anything `jnp.asarray` takes: a jax or NumPy array, a NumPy scalar, a Python bool/int/float.
ArrayLike = jax.typing.ArrayLike

# `implementation=` of dot_product_attention, the modules, make_attention_fn and diagnostics:
# jattn's own "dense" (jax.nn's name "xla" is accepted) and "chunked", JAX's Pallas TPU kernel
# "splash", jax.nn's cuDNN kernel "cudnn", jattn's Triton kernel "pallas_gpu"; None is
# automatic, and a sequence of names is tried in order.
Implementation = Literal["dense", "xla", "chunked", "sparse", "splash", "cudnn", "pallas_gpu"]

# Where the causal diagonal sits when T != S: "top_left" (query i sees keys <= i, jax.nn's
# convention) or "bottom_right" (the last query sees the last key: KV-cache decoding).
CausalAlignment = Literal["top_left", "bottom_right"]

# `is_causal=`: False, True (= "top_left") or an alignment. `typing.Union` rather than `|` so the
# alias evaluates on every supported Python (>= 3.10) whatever the operands.
IsCausal = Union[bool, CausalAlignment]  # noqa: UP007

# The chunked kernels' schedule: "serial" walks the blocks one tile at a time (a CPU's cache
# likes it); "parallel" computes every query block's next block in one step (an accelerator's
# thousands of lanes and per-kernel launch cost want it). None: the platform's default.
Schedule = Literal["serial", "parallel"]

# How ring attention's sequence shards map to positions (see `jattn.zigzag_permute`).
RingOrder = Literal["contiguous", "zigzag"]

# `local_window_size=`: ``w`` (= (w, w)) or (left, right); None on a side: unbounded.
LocalWindowSize = Union[int, tuple[int | None, int | None]]  # noqa: UP007
