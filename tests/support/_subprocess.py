"""Run a test's worker source in a fresh Python (its own XLA flags, e.g. 4 host devices) with the
tests directory importable, and read the JSON it prints after ``RESULTS ``."""

import json
import os
import subprocess
import sys


def run_worker(source: str, timeout: int = 600) -> dict:
  env = dict(os.environ)
  here = os.path.dirname(os.path.abspath(__file__))
  env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
  r = subprocess.run(
    [sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout, env=env
  )
  line = [x for x in r.stdout.splitlines() if x.startswith("RESULTS ")]
  assert line, r.stderr[-3000:]
  return json.loads(line[0][len("RESULTS ") :])
