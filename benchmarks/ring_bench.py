"""Ring attention benchmark from a checkout: ``python benchmarks/ring_bench.py [--devices P] ...``

The benchmark itself is ``jattn.bench.ring_bench`` (also ``python -m jattn.bench.ring_bench``, or
``jattn-bench ring``); see its docstring and docs/ring.md. This script only runs its ``main()``,
with the checkout first on ``sys.path`` so that it works without installing jattn.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jattn.bench.ring_bench import main

if __name__ == "__main__":
  raise SystemExit(main())
