"""jattn-bench: time, memory and FLOP rate of jattn's attention against the usual alternatives.

Run as ``jattn-bench`` or ``python -m jattn.bench`` (docs/benchmarks.md); ``import jattn`` does not
import this package.

Modules: ``config`` (TOML sweeps -> cases), ``masks`` (mask specs and exact visible-pair counts),
``flops`` (FLOP and memory estimates), ``impls`` (the implementations compared), ``torch_peer``
(PyTorch in its own process), ``runner`` (compile, warm up, interleaved timing), ``report``
(table, JSON, CSV, machine info), ``plots`` (PNG figures), ``cli`` (the command line) and
``timing`` (`interleaved`: the one timing loop of every benchmark and example).
"""

from jattn.bench.timing import alternating as alternating
from jattn.bench.timing import interleaved as interleaved
