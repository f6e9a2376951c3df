"""jattn's implementations, one registry entry each (see `jattn._registry`).

A new backend is a module with ``run(call)`` (and ``supports(call)`` for what it refuses) and
one `register` call here; the dispatcher, tuning tables, ring attention and the tests' feature
matrix read the table.
"""

from jattn._backends import cudnn, dense, pallas_gpu, sparse, splash, splash_masks
from jattn._parallel import split as _split
from jattn._registry import Backend, register

register(Backend("dense", dense.run, aliases=("xla",), max_logits=None))
# The chunked kernels, through the parallel layer (Explicit-mesh splits, the Auto partitioning
# rule) where the call is sharded.
register(Backend("chunked", _split.chunked, max_logits=None))
register(
  Backend(
    "splash",
    splash.run,
    platforms=("tpu",),
    supports=splash.supports,
    fused=True,
    first=splash.first,
    traced_cheaply=lambda call: splash_masks.builds_lazily(call.mask),
    ring="while splash attention compiles its mask in",
    traced_mask=True,
    max_logits="splash attention does not return its running max",
  )
)
register(
  Backend(
    "cudnn",
    cudnn.run,
    platforms=("cuda",),
    supports=cudnn.supports,
    fused=True,
    first=cudnn.first,
    ring="while cuDNN's kernel takes only its own causal/window/length options",
    max_logits="cuDNN's kernel does not return its running max",
  )
)
register(
  Backend(
    "pallas_gpu",
    pallas_gpu.run,
    platforms=("cuda",),
    supports=pallas_gpu.supports,
    fused=True,
    ring="while the Pallas GPU kernel's causal and window band is fixed when the call is traced",
    max_logits="the Pallas GPU kernel does not return its running max",
  )
)
# Each query's selected key blocks only (masks.selected_blocks): work O(T x n x block).
register(
  Backend(
    "sparse",
    sparse.run,
    supports=sparse.supports,
    ring="while the sparse path gathers each query's blocks from the whole sequence",
    max_logits=None,
    only="calls with a masks.selected_blocks selection",
  )
)
