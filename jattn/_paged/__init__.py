"""Serving: attention against a paged KV cache and the writes into it."""

from jattn._paged.attention import paged_attention as paged_attention
from jattn._paged.pool import is_quantized as is_quantized
from jattn._paged.write import KVPages as KVPages
from jattn._paged.write import write_pages as write_pages
