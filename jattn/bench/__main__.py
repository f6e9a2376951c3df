"""``python -m jattn.bench``: the same as the ``jattn-bench`` console script."""

from jattn.bench.cli import main

raise SystemExit(main())
