"""jattn: numerically stable scaled dot-product attention for JAX, dense and chunked."""

from jattn import diagnostics as diagnostics
from jattn import linen as linen
from jattn import masks as masks
from jattn import nnx as nnx
from jattn._attention import dot_product_attention as dot_product_attention
from jattn._flax_fn import make_attention_fn as make_attention_fn
from jattn._ring import merge_attention as merge_attention
from jattn._ring import ring_attention as ring_attention
from jattn._ring import ring_attention_sharded as ring_attention_sharded
from jattn._ring import zigzag_permute as zigzag_permute
from jattn._ring import zigzag_unpermute as zigzag_unpermute

__version__ = "0.1.0"
