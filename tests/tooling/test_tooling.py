"""The checks the suite runs over its own source, with the pinned tools of the `test` extra:
ruff's lint rules and formatting over the repository, mypy over the package (configs in
pyproject.toml). A violation of any fails here, so CI (which runs the suite) fails on it."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
  """The tool installed beside this interpreter (the venv's), else on PATH."""
  here = pathlib.Path(sys.executable).parent / name
  found = str(here) if here.exists() else shutil.which(name)
  if found is None:
    pytest.fail(f"{name} is not installed: pip install '.[test]' installs the pinned version")
  return found


def _run(*cmd: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, NO_COLOR="1")
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, check=False)


@pytest.mark.parametrize("check", [("check",), ("format", "--check")], ids=["lint", "format"])
def test_ruff(check):
  r = _run(_tool("ruff"), *check, ".")
  assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_over_the_package():
  r = _run(_tool("mypy"))
  assert r.returncode == 0, r.stdout + r.stderr
