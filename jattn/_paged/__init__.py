"""Serving: attention against a paged KV cache and the writes into it, one wing.

The API: `attention` (`paged_attention`) and `write` (`write_pages`, `KVPages`, and the core
that the Flax modules' paged caches write through, `write_cache`). A call is checked room by
room: `pool` (the pool's format and its one check against the tokens that meet it), `metadata`
(the per-sequence rules, `owners` of the query rows, `faults`), `plan` (`PagedPlan`, the static
plan); then `run` (the program: faults, tiles, the walk or a kernel per platform, the
epilogue), `tiles` (query rows cut into tiles of one sequence, and back), `walk` (the XLA walk
over key blocks), `read` (blocks read from the pool where it lies), `fold` (the arithmetic the
walk and the kernels share), `pallas_tpu` and `pallas_gpu` (jattn's Pallas kernels), `selected`
(a key selection's rows, each reading only its chosen keys).
"""

from jattn._paged.attention import paged_attention as paged_attention
from jattn._paged.pool import Pool as Pool
from jattn._paged.pool import is_quantized as is_quantized
from jattn._paged.write import KVPages as KVPages
from jattn._paged.write import write_cache as write_cache
from jattn._paged.write import write_pages as write_pages
