"""benchmarks/device_check.py, the script a lent GPU or TPU runs, in its CPU smoke mode: every
section runs, its rows have the documented fields, and what it checks holds here."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "device_check.py"


def _load():
  spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_smoke_mode_runs_every_section(tmp_path):
  dc = _load()
  out = tmp_path / "dc"
  assert dc.main(["--smoke", "--out", str(out)]) == 0
  report = json.loads((tmp_path / "dc.json").read_text())
  assert report["backend"] == "cpu" and report["jax"]
  sections = report["sections"]
  assert set(sections) == {"correctness", "determinism", "batch_invariance", "speed", "decode"}
  for name, rows in sections.items():
    assert isinstance(rows, list) and rows, (name, rows)
  # Correctness: every implementation here, both dtypes, every case; float32 close to the
  # float64 reference, bfloat16 within a small factor of rounding the exact answer.
  ok = [r for r in sections["correctness"] if r["status"] == "ok"]
  assert {r["implementation"] for r in ok} == {"dense", "chunked", "None"}
  assert {r["case"] for r in ok} == set(dc.SPEED_CASES)
  for r in ok:
    if r["dtype"] == "float32":
      assert r["err"] < 1e-5 and r["grad_err"] < 1e-4, r
    else:
      assert r["err_over_rounding"] < 3 and r["grad_err"] < 3e-2, r
  # Determinism: the CPU programs give the same bits twice.
  assert all(r["forward_bitwise"] and r["grads_bitwise"] for r in sections["determinism"])
  # Batch invariance: a sequence alone and in a batch of four, the same bits here.
  inv = sections["batch_invariance"]
  assert {r["implementation"] for r in inv} == {"dense", "chunked", "None"}
  assert all(r["status"] == "ok" and r["batch_invariant"] for r in inv), inv
  # Speed: jattn and jax.nn (where jax.nn has the case) timed per case.
  speed = {(r["case"], r["implementation"]): r for r in sections["speed"]}
  assert speed["causal", "jattn"]["status"] == "ok" and speed["causal", "jattn"]["tflops"] > 0
  assert ("causal", "jax.nn xla") in speed and ("segments", "jax.nn xla") not in speed
  # Decode: the XLA walk and None (the walk too, on a CPU), equal, bitwise on a rerun.
  decode = sections["decode"]
  assert all(r["status"] == "ok" and r["bitwise_rerun"] for r in decode)
  assert decode[-1]["max_abs_diff_vs_chunked"] == 0.0
  md = (tmp_path / "dc.md").read_text()
  for heading in (
    "## correctness",
    "## determinism",
    "## batch_invariance",
    "## speed",
    "## decode",
  ):
    assert heading in md


def test_a_failing_section_is_recorded_and_the_rest_run(tmp_path, monkeypatch):
  dc = _load()
  monkeypatch.setattr(dc, "speed", lambda smoke: 1 / 0)
  assert dc.main(["--smoke", "--out", str(tmp_path / "dc"), "--sections", "speed", "decode"]) == 0
  report = json.loads((tmp_path / "dc.json").read_text())
  assert "ZeroDivisionError" in report["sections"]["speed"]["error"]
  assert report["sections"]["decode"][0]["status"] == "ok"
  with pytest.raises(SystemExit):
    dc.main(["--no-such-flag"])
