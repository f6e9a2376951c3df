"""jattn: numerically stable scaled dot-product attention for JAX, dense and chunked.

``jattn.linen`` and ``jattn.nnx`` (the Flax modules) are imported on first use, as
``flax.linen``/``flax.nnx`` are, so ``import jattn`` does not import flax.
"""

import importlib as _importlib

from jattn import diagnostics as diagnostics
from jattn import masks as masks
from jattn._attention import attention_received as attention_received
from jattn._attention import dot_product_attention as dot_product_attention
from jattn._attention import merge_attention as merge_attention
from jattn._flax.attention_fn import make_attention_fn as make_attention_fn
from jattn._paged import KVPages as KVPages
from jattn._paged import paged_attention as paged_attention
from jattn._paged import write_pages as write_pages
from jattn._parallel.partition import auto_partitioning as auto_partitioning
from jattn._parallel.ring import ring_attention as ring_attention
from jattn._parallel.ring import ring_attention_sharded as ring_attention_sharded
from jattn._parallel.zigzag import zigzag_permute as zigzag_permute
from jattn._parallel.zigzag import zigzag_unpermute as zigzag_unpermute
from jattn._tuning import TuningTable as TuningTable
from jattn._tuning import load as load_tuning
from jattn._tuning import tuning as tuning
from jattn._version import __version__ as __version__

__all__ = [
  "KVPages",
  "TuningTable",
  "attention_received",
  "auto_partitioning",
  "diagnostics",
  "dot_product_attention",
  "load_tuning",
  "make_attention_fn",
  "masks",
  "merge_attention",
  "paged_attention",
  "ring_attention",
  "ring_attention_sharded",
  "tuning",
  "write_pages",
  "zigzag_permute",
  "zigzag_unpermute",
]

_LAZY_SUBMODULES = ("linen", "nnx")


def __getattr__(name):
  if name in _LAZY_SUBMODULES:
    module = _importlib.import_module(f"jattn.{name}")
    globals()[name] = module
    return module
  raise AttributeError(f"module 'jattn' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_LAZY_SUBMODULES))
