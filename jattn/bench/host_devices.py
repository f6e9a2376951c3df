"""Running a benchmark on P host CPU devices: the device count is fixed when JAX starts, so the
benchmark re-runs itself in a child process with
``XLA_FLAGS=--xla_force_host_platform_device_count=P``, which prints its rows as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# The directory holding the ``jattn`` package (a checkout's root, or site-packages): the child
# process imports the benchmark module from there, so parent and child run the same code.
ROOT = Path(__file__).resolve().parent.parent.parent
# The child imports the module by name, with ROOT in place of the current directory at the head
# of sys.path (as a script's directory would be): it finds the same jattn as this process, also in
# a bare checkout. Run as a file instead, jattn/bench/ would head sys.path and its module names
# (config, masks, report, ...) would shadow top-level modules.
_CHILD = (
  "import sys; sys.path[0] = {root!r}; from jattn.bench import {module}; "
  "raise SystemExit({module}.main())"
)
_ROWS = "ROWS "


def print_rows(rows) -> None:
  """In the child: hand the rows to the parent."""
  print(_ROWS + json.dumps(rows), flush=True)


def run_child(module: str, argv: list[str], devices: int):
  """Run ``jattn.bench.<module>.main(argv + ["--child"])`` on ``devices`` host CPU devices.

  Returns (rows, 0), or (None, the child's exit status or 1) after writing its output to stderr
  when it failed."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
    [sys.executable, "-c", _CHILD.format(root=str(ROOT), module=module), *argv, "--child"],
    env=env,
    capture_output=True,
    text=True,
  )
  rows = next(
    (json.loads(line[len(_ROWS) :]) for line in proc.stdout.splitlines() if line.startswith(_ROWS)),
    None,
  )
  if proc.returncode or rows is None:
    sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
    return None, proc.returncode or 1
  return rows, 0


def main(module: str, argv, cfg: dict, *, child, report, json_path, is_child: bool) -> int:
  """A host-device benchmark's main: in the child, ``child(cfg)`` computes the rows; in the
  parent, the child is started, ``report(rows)`` prints them, and with ``json_path`` they are
  written there with the config."""
  if is_child:
    print_rows(child(cfg))
    return 0
  rows, status = run_child(module, list(argv if argv is not None else sys.argv[1:]), cfg["devices"])
  if rows is None:
    return status
  report(rows)
  if json_path:
    Path(json_path).write_text(json.dumps({"config": cfg, "rows": rows}, indent=1))
  return 0
