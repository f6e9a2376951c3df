"""Where the suite's time goes: a pytest plugin that counts, per test file, XLA compilations and
their seconds, seconds spent waiting on subprocesses, and wall seconds.

    pytest -n 2 --jattn-costs            # or JATTN_COSTS=1 in the environment

prints a table after the run, the costliest file first. Compilations are counted from jax's own
monitoring events (one ``backend_compile_duration`` per compiled program), so a test that hits
jax's caches counts nothing; their seconds are split in two: ``trace s`` (Python: tracing to a
jaxpr and lowering it to MLIR) and ``xla s`` (XLA's compile), as the cure differs -- fewer or
smaller traced functions against fewer or smaller programs. Under
pytest-xdist each worker measures its own tests and hands the figures to the controller in the
reports' ``user_properties``, which is the one channel xdist carries back.
"""

from __future__ import annotations

import collections
import os
import subprocess
import threading
import time

import pytest

_KEY = "jattn_costs"
_COMPILE_EVENTS = (
  "/jax/core/compile/jaxpr_trace_duration",
  "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "/jax/core/compile/backend_compile_duration",
)


class _Meter:
  """Running totals in this process; a test's cost is the difference across its run."""

  def __init__(self):
    self.compiles = 0
    self.trace_s = 0.0
    self.xla_s = 0.0
    self.subprocess_s = 0.0
    self._local = threading.local()

  def on_event(self, name, secs, **_):
    if name == _COMPILE_EVENTS[-1]:
      self.xla_s += secs
      self.compiles += 1
    elif name in _COMPILE_EVENTS:
      self.trace_s += secs

  def snapshot(self):
    return (self.compiles, self.trace_s, self.xla_s, self.subprocess_s, time.perf_counter())

  def waiting(self, wait):
    # Popen.communicate calls Popen.wait: count the outermost call only.
    def timed(proc, *args, **kwargs):
      if getattr(self._local, "depth", 0):
        return wait(proc, *args, **kwargs)
      self._local.depth = 1
      t0 = time.perf_counter()
      try:
        return wait(proc, *args, **kwargs)
      finally:
        self.subprocess_s += time.perf_counter() - t0
        self._local.depth = 0

    return timed


def wanted(config) -> bool:
  return bool(config.getoption("jattn_costs", False)) or os.environ.get("JATTN_COSTS", "") not in (
    "",
    "0",
  )


def pytest_addoption(parser):
  parser.addoption(
    "--jattn-costs",
    action="store_true",
    dest="jattn_costs",
    help="print XLA compilations, their seconds, subprocess and wall seconds per test file",
  )


def pytest_configure(config):
  if not wanted(config):
    return
  import jax.monitoring

  meter = _Meter()
  jax.monitoring.register_event_duration_secs_listener(meter.on_event)
  subprocess.Popen.wait = meter.waiting(subprocess.Popen.wait)  # type: ignore[method-assign]
  subprocess.Popen.communicate = meter.waiting(subprocess.Popen.communicate)  # type: ignore[method-assign]
  config._jattn_meter = meter


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  meter = getattr(item.config, "_jattn_meter", None)
  before = meter.snapshot() if meter else None
  yield
  if meter is None:
    return
  after = meter.snapshot()
  figures = [a - b for a, b in zip(after, before)]
  # The protocol's reports are already sent; the figures ride on the next report of this worker
  # (the controller attributes them by the file named here, not by the report they ride on).
  item.config._jattn_pending = (item.nodeid.split("::")[0], figures)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  pending = getattr(item.config, "_jattn_pending", None)
  if pending is not None:
    outcome.get_result().user_properties.append((_KEY, pending))
    item.config._jattn_pending = None


def pytest_runtest_logreport(report):
  for key, value in getattr(report, "user_properties", ()):
    if key == _KEY:
      _add(report.config if hasattr(report, "config") else None, value)


# A file's row: tests, compiles, then the seconds of `_Meter.snapshot` after its count.
_ROW = [0, 0, 0.0, 0.0, 0.0, 0.0]
_TOTALS: dict = collections.defaultdict(lambda: list(_ROW))


def _add(_config, value):
  path, (compiles, *seconds) = value
  row = _TOTALS[path]
  row[0] += 1
  row[1] += int(compiles)
  for i, s in enumerate(seconds, 2):
    row[i] += s


def _flush_last(config):
  # The last test of a worker has no later report to carry its figures: send them now.
  pending = getattr(config, "_jattn_pending", None)
  if pending is not None:
    _add(config, pending)
    config._jattn_pending = None


def pytest_sessionfinish(session):
  if not wanted(session.config):
    return
  worker = getattr(session.config, "workeroutput", None)
  pending = getattr(session.config, "_jattn_pending", None)
  if worker is not None:
    # An xdist worker: its last test's figures travel in workeroutput.
    worker[_KEY] = pending
  else:
    _flush_last(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  pending = getattr(node, "workeroutput", {}).get(_KEY)
  if pending:
    _add(None, pending)


def table(totals=None) -> str:
  totals = _TOTALS if totals is None else totals
  rows = sorted(totals.items(), key=lambda kv: -kv[1][-1])
  width = max([len(p) for p in totals] + [4])
  lines = [
    f"{'file':<{width}} {'tests':>6} {'compiles':>9} {'trace s':>8} {'xla s':>8}"
    f" {'subproc s':>10} {'wall s':>8}"
  ]
  sums = list(_ROW)
  for path, row in rows:
    lines.append(
      f"{path:<{width}} {row[0]:>6} {row[1]:>9} {row[2]:>8.1f} {row[3]:>8.1f}"
      f" {row[4]:>10.1f} {row[5]:>8.1f}"
    )
    sums = [s + r for s, r in zip(sums, row)]
  lines.append(
    f"{'total':<{width}} {sums[0]:>6} {sums[1]:>9} {sums[2]:>8.1f} {sums[3]:>8.1f}"
    f" {sums[4]:>10.1f} {sums[5]:>8.1f}"
  )
  return "\n".join(lines)


def pytest_terminal_summary(terminalreporter, config):
  if not wanted(config) or getattr(config, "workeroutput", None) is not None:
    return
  if not _TOTALS:
    return
  terminalreporter.section("jattn costs per test file (wall s summed over workers)")
  for line in table().splitlines():
    terminalreporter.write_line(line)
