"""Run a test's worker source in a fresh Python (its own XLA flags, e.g. 4 host devices) with the
tests' support directory importable, and read the JSON it prints after ``RESULTS ``."""

import json
import os
import subprocess
import sys


def run_source(source: str, timeout: int = 600) -> subprocess.CompletedProcess:
  """``python -c source`` with tests/support on its path (the float64 reference, the workers)."""
  here = os.path.dirname(os.path.abspath(__file__))
  path = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
  return subprocess.run(
    [sys.executable, "-c", source],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=dict(os.environ, PYTHONPATH=path),
  )


def run_worker(source: str, timeout: int = 600) -> dict:
  r = run_source(source, timeout)
  line = [x for x in r.stdout.splitlines() if x.startswith("RESULTS ")]
  assert line, r.stderr[-3000:]
  return json.loads(line[0][len("RESULTS ") :])
