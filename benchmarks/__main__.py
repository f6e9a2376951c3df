"""``python -m benchmarks``: the same as the ``jattn-bench`` console script."""

from benchmarks.cli import main

raise SystemExit(main())
