"""The multi-device ring runs (tests/support/_ring_worker.py with 4 and 8 host devices), started in
the background when the session starts (tests/conftest.py) and read by test_ring's fixtures.

Each run is a subprocess of about a minute of compiling. Started on demand from a fixture, it
held up the pytest-xdist worker that needed it, and the other worker too when it reached a ring
test first and had to wait for the same run (the runs are shared, once per session). Started
with the session, they compile beside the rest of the suite and are done before the ring tests
come.

One run per session under pytest-xdist: the first worker to create a run's ``started`` file
(O_EXCL) launches it, and every worker waits for its result file, which the launcher writes
whole with a rename. The files live in the session's base temporary directory (shared by
xdist's workers), which pytest rotates like any other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def session_dir(tmp_path_factory) -> str:
  """This session's directory: under xdist the parent of the worker's base temp directory
  (pytest-N/, shared by the session's workers), else the base temp directory itself."""
  base = tmp_path_factory.getbasetemp()
  return str(base.parent if "PYTEST_XDIST_WORKER" in os.environ else base)


def env() -> dict:
  # XLA_FLAGS passes through (conftest's); the worker appends its own device count, and the
  # last of a repeated XLA flag is the one that holds (as in jattn.bench.host_devices).
  e = dict(os.environ)
  e["JAX_PLATFORMS"] = "cpu"
  return e


def start(devices: int, root: str) -> None:
  """Launch the run for ``devices`` unless this session already has (from any worker)."""
  try:
    fd = os.open(os.path.join(root, f"started-{devices}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
  except FileExistsError:
    return
  os.close(fd)
  # The launcher outlives nothing: it runs the worker, writes its result file, and exits.
  subprocess.Popen(
    [
      sys.executable,
      os.path.join(HERE, "_ring_worker.py"),
      "--devices",
      str(devices),
      "--out",
      os.path.join(root, f"results-{devices}.json"),
    ],
    env=env(),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )


def results(devices: int, root: str, timeout: float = 900.0) -> dict:
  """The run's per-case results; starts it first if nothing has (a test selected by hand)."""
  start(devices, root)
  path = os.path.join(root, f"results-{devices}.json")
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise TimeoutError(f"the {devices}-device ring run wrote no {path} in {timeout:.0f} s")
    time.sleep(0.5)
  with open(path) as f:
    run = json.load(f)
  assert run["rc"] == 0 and run["results"] is not None, (
    f"worker with {devices} devices failed (rc={run['rc']}):\n{run['stderr'][-4000:]}"
  )
  return run["results"]
