"""A strict numerical environment: no implicit dtype promotion, no implicit rank broadcasting.

The tests live in folders by concept (attention/, paged/, parallel/, backends/, flax/,
properties/, tooling/); what they share -- references, the feature matrix, workers, the cost
plugin -- lives in support/, which this conftest puts on sys.path so that a test imports a
helper by its bare name (``import reference as ref``). A test file never imports another test
file (tooling/test_code_shape.py checks it).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

# Tests run on the CPU; a few need float64 for the references computed with jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles a thousand small programs and runs each a few times: compiling dominates.
# This lowers only LLVM's code generation effort (XLA's backend optimization level 0); the HLO
# passes -- fusion, loop analysis, buffer assignment, everything the structure and memory tests
# read -- are the ones users get. Subprocess tests inherit it through the environment.
# JATTN_TEST_FULL_OPT=1 runs the suite with full code generation instead.
if os.environ.get("JATTN_TEST_FULL_OPT", "") not in ("", "0"):
  os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
else:
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  # jaxlib 0.10's CPU backend still has its older elemental fusion emitters: they compile the
  # suite's programs in about 0.6x the time of the MLIR ones (the whole suite 511 s instead of
  # 887 s on 2 cores). Same HLO passes (fusion decisions, loops, buffers), except that every
  # scatter becomes a loop, which jattn.bench.structure does not count as the program's. Only
  # where the flag is known to exist: XLA aborts on an unknown flag, and jaxlib 0.12 has none.
  import importlib.metadata

  _FLAG = "--xla_cpu_use_fusion_emitters=false"
  try:
    _JAXLIB = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:  # a jaxlib built in place: leave XLA as is
    _JAXLIB = ""
  if _JAXLIB.startswith("0.10.") and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax
import pytest

# The cost table (--jattn-costs): its hooks are this conftest's.
from _costs import (  # noqa: F401
  pytest_addoption,
  pytest_runtest_logreport,
  pytest_runtest_makereport,
  pytest_runtest_protocol,
  pytest_sessionfinish,
  pytest_terminal_summary,
  pytest_testnodedown,
)
from _costs import (
  pytest_configure as _costs_configure,
)

import jattn

# The suite tests the jattn this process imports: the installed package (CI runs it from tests/,
# so the checkout is not on the path) or a checkout on PYTHONPATH. Subprocess tests (ring and
# matrix workers) inherit the same one through PYTHONPATH.
JATTN_HOME = os.path.dirname(os.path.dirname(os.path.abspath(jattn.__file__)))
if os.path.basename(JATTN_HOME) not in ("site-packages", "dist-packages"):
  os.environ["PYTHONPATH"] = os.pathsep.join(
    [JATTN_HOME] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  )

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_configure(config):
  _costs_configure(config)
  config.addinivalue_line(
    "markers", "long: one of the few tests that run for a minute or more; started first"
  )
  config.addinivalue_line(
    "markers",
    "slow: needs several processes (host devices of a mesh, a distributed run); deselected by "
    "pyproject's addopts, run by `pytest -m slow` (.ci/run runs both)",
  )


def pytest_report_header(config):
  return f"jattn {jattn.__version__} from {os.path.dirname(jattn.__file__)}"


def pytest_collection_modifyitems(config, items):
  # Under `pytest -n 2` a minute-long test that is handed out last keeps one worker busy while
  # the other has finished: start them first, the short tests then even out the two workers
  # (pyproject's `--dist worksteal`: a worker that runs out takes the other's pending tests).
  items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable


@pytest.fixture(scope="session", autouse=True)
def _start_ring_runs(request, tmp_path_factory):
  # The multi-device ring runs compile for about a minute each in subprocesses: start them with
  # the session, beside the rest of the suite, rather than when the first ring test asks.
  import _ring_runs

  root = _ring_runs.session_dir(tmp_path_factory)
  items = request.session.items
  for devices in (4, 8):
    if any(f"ring{devices}" in getattr(item, "fixturenames", ()) for item in items):
      _ring_runs.start(devices, root)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  # Every compiled CPU program keeps its machine code in memory mappings of its own: a worker
  # that ran half the suite held more than Linux's default 65530 (vm.max_map_count), and XLA
  # then aborted or segfaulted while compiling whichever test came next. Dropping jax's caches
  # after each module frees them (test_paged alone: 15380 mappings -> 609).
  yield
  import gc

  jax.clear_caches()
  gc.collect()
