"""The wheel installs the `jattn` package and nothing else: the benchmark CLI is jattn.bench, and
the sweep configs travel inside it as jattn/bench/configs/ (not the training example's config)."""

import importlib.util
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _build_wheel(out: pathlib.Path) -> pathlib.Path:
  for module, why in (
    ("pip", "pip builds the wheel"),
    (
      "hatchling",
      "hatchling (the build backend, in the 'test' extra) builds "
      "the wheel without build isolation, i.e. offline",
    ),
  ):
    if importlib.util.find_spec(module) is None:
      pytest.skip(f"{module} is not installed in {sys.executable}: {why}")
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "wheel",
      "--no-deps",
      "--no-build-isolation",
      "--no-index",
      "-q",
      "-w",
      str(out),
      str(ROOT),
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  wheels = list(out.glob("jattn-*.whl"))
  assert len(wheels) == 1, (wheels, r.stdout[-2000:])
  return wheels[0]


def test_wheel_holds_only_the_jattn_package_with_the_bench_configs(tmp_path):
  wheel = _build_wheel(tmp_path)
  version = wheel.name.split("-")[1]
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    entry_points = z.read(f"jattn-{version}.dist-info/entry_points.txt").decode()
  outside = [n for n in names if not n.startswith(("jattn/", f"jattn-{version}.dist-info/"))]
  assert not outside, f"the wheel installs more than jattn: {outside}"
  shipped = {
    n.removeprefix("jattn/bench/configs/") for n in names if n.startswith("jattn/bench/configs/")
  }
  assert "quick.toml" in shipped
  assert "train.toml" not in shipped and not any(n.endswith("train.toml") for n in names)
  # Every benchmark config of the checkout, and only those.
  assert shipped == {p.name for p in (ROOT / "configs").glob("*.toml")}
  assert {
    "jattn/bench/__init__.py",
    "jattn/bench/__main__.py",
    "jattn/bench/cli.py",
    "jattn/bench/ring_bench.py",
  } <= set(names)
  assert "jattn-bench = jattn.bench.cli:main" in entry_points, entry_points
