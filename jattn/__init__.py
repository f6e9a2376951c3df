"""jattn: numerically stable scaled dot-product attention for JAX, dense and chunked."""

from jattn import diagnostics as diagnostics
from jattn import linen as linen
from jattn import masks as masks
from jattn import nnx as nnx
from jattn._attention import dot_product_attention as dot_product_attention
from jattn._flax_fn import make_attention_fn as make_attention_fn

__version__ = "0.1.0"
