"""Tuning tables: written by jattn-bench tune, used through jattn.tuning or $JATTN_TUNING for
the options a call leaves open, never changing results; bad files fail naming the file."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import _tuning
from jattn.bench import structure
from jattn.bench import tune as bench_tune

T = 64
ARGS = [jax.ShapeDtypeStruct((1, T, 2, 8), jnp.float32)] * 3
DEVICE = jax.devices()[0].device_kind


def _steps(**kw):
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="chunked", **kw)
  return structure.loop_structure(jax.jit(f).lower(*ARGS).compile().as_text()).steps


def _table(tmp_path, options, device=DEVICE, kind="full", version=None):
  table = jattn.TuningTable()
  table.add(device, "float32", 8, kind, 64, **options)
  if version is not None:
    table.jattn_version = version
  path = tmp_path / "tuning.json"
  table.save(path)
  return path


def test_table_fills_open_options_and_calls_win(tmp_path, monkeypatch):
  path = _table(tmp_path, dict(block_q=16, block_kv=8, schedule="serial", step_width=None))
  base, base_causal = _steps(), _steps(is_causal=True, schedule="parallel")
  assert base <= 1  # the default blocks cover T = 64 in one tile
  with jattn.tuning(path):
    assert _steps() == (T // 16) * (T // 8)
    assert _steps(block_q=32) == (T // 32) * (T // 8)  # an argument of the call wins
    # No entry for causal calls: they keep the defaults.
    assert _steps(is_causal=True, schedule="parallel") == base_causal
  assert _steps() == base  # only inside the block
  monkeypatch.setenv(_tuning.ENV_VAR, str(path))
  assert _steps() == (T // 16) * (T // 8)


def test_table_never_changes_results(tmp_path):
  path = _table(tmp_path, dict(block_q=16, block_kv=8, schedule="parallel", step_width=2))
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, T, 2, 8)) for key in keys)
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, implementation="chunked")
  want = f(q, k, v)
  with jattn.tuning(path):
    got = f(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("content,words", [
    ("not json", "not valid JSON"),
    (json.dumps({"entries": {}}), "format"),
    (json.dumps({"format": _tuning.FORMAT, "entries": {"cpu|float32|8|full": {}}}),
     "malformed entry"),
    (json.dumps({"format": _tuning.FORMAT, "entries": {"cpu|float32|8|full|64": {
        "block_q": 0}}}), "block_q must be a positive int"),
    (json.dumps({"format": _tuning.FORMAT, "entries": {"cpu|float32|8|full|64": {
        "schedule": "fast"}}}), "schedule"),
])
def test_bad_tables_are_errors_naming_the_file(tmp_path, content, words):
  path = tmp_path / "bad.json"
  path.write_text(content)
  with pytest.raises(ValueError, match=words) as info:
    jattn.load_tuning(path)
  assert str(path) in str(info.value)
  with pytest.raises(ValueError, match="cannot be read"):
    jattn.load_tuning(tmp_path / "missing.json")


def test_stale_or_foreign_tables_warn_naming_the_file(tmp_path):
  path = _table(tmp_path, dict(block_q=16, block_kv=8, schedule="serial", step_width=None),
                version="0.0.1")
  with pytest.warns(UserWarning, match="written by jattn 0.0.1") as rec:
    table = jattn.load_tuning(path)
  assert str(path) in str(rec[0].message)
  with table:
    assert _steps() == (T // 16) * (T // 8)  # still used
  other = _table(tmp_path, dict(block_q=16, block_kv=8, schedule="serial", step_width=None),
                 device="some other accelerator")
  base = _steps()
  with jattn.tuning(other), pytest.warns(UserWarning, match="no entry for this device"):
    assert _steps() == base


def test_jattn_bench_tune_writes_a_table_that_is_used(tmp_path, capsys):
  out = tmp_path / "tuned.json"
  assert bench_tune.main(["--T", "64", "--heads", "2", "--head-dim", "8", "--mask", "full",
                          "causal", "--blocks", "16x16", "--widths", "4", "--repeats", "1",
                          "--out", str(out)]) == 0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    table = jattn.load_tuning(out)
  assert set(table.entries) == {f"{DEVICE}|float32|8|full|64", f"{DEVICE}|float32|8|causal|64"}
  best = table.entries[f"{DEVICE}|float32|8|full|64"]
  assert (best["block_q"], best["block_kv"]) == (16, 16)
  assert best["schedule"] in ("serial", "parallel")
  with jattn.tuning(out):
    steps = _steps()
  expect = {"serial": (T // best["block_q"]) * (T // best["block_kv"]),
            "parallel": T // best["block_kv"]}[best["schedule"]]
  assert steps == expect
  assert "wrote" in capsys.readouterr().out
