"""jattn: numerically stable scaled dot-product attention for JAX, dense and chunked."""

from jattn import masks as masks
from jattn._attention import dot_product_attention as dot_product_attention

__version__ = "0.1.0"
