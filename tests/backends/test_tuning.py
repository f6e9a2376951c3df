"""Tuning tables: written by jattn-bench tune, used through jattn.tuning or $JATTN_TUNING for
the options a call leaves open, never changing results; bad files fail naming the file."""

import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import _tuning
from jattn._chunked import plan as _plan
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


def test_a_table_applies_to_a_function_jitted_before_it(tmp_path):
  """The active table is part of jax.jit's cache key: a function traced outside a tuning block
  is traced again inside it (once per table, not once per call), so the table's blocks apply."""
  path = _table(tmp_path, dict(block_q=16, block_kv=8, schedule="serial", step_width=None))
  (tmp_path / "b").mkdir()
  other = _table(tmp_path / "b", dict(block_q=32, block_kv=16, schedule="serial", step_width=None))
  traced = []

  @jax.jit
  def f(q, k, v):
    traced.append(1)
    return jattn.dot_product_attention(q, k, v, implementation="chunked")

  steps = lambda: structure.loop_structure(f.lower(*ARGS).compile().as_text()).steps
  assert steps() <= 1
  with jattn.tuning(path):
    assert steps() == (T // 16) * (T // 8)
    assert steps() == (T // 16) * (T // 8)
  with jattn.tuning(other):
    assert steps() == (T // 32) * (T // 16)
  assert steps() <= 1
  assert len(traced) == 3  # outside, the first table, the second: each traced once


@pytest.mark.parametrize(
  "content,words",
  [
    ("not json", "not valid JSON"),
    (json.dumps({"entries": {}}), "format"),
    (
      json.dumps({"format": _tuning.FORMAT, "entries": {"cpu|float32|8|full": {}}}),
      "malformed entry",
    ),
    (
      json.dumps({"format": _tuning.FORMAT, "entries": {"cpu|float32|8|full|64": {"block_q": 0}}}),
      "block_q must be a positive int",
    ),
    (
      json.dumps(
        {"format": _tuning.FORMAT, "entries": {"cpu|float32|8|full|64": {"schedule": "fast"}}}
      ),
      "schedule",
    ),
    (
      json.dumps(
        {
          "format": _tuning.FORMAT,
          "entries": {"cpu|float32|8|full|64": {"implementation": "flash"}},
        }
      ),
      "implementation must be one of .*cudnn.*splash",
    ),
  ],
)
def test_bad_tables_are_errors_naming_the_file(tmp_path, content, words):
  path = tmp_path / "bad.json"
  path.write_text(content)
  with pytest.raises(ValueError, match=words) as info:
    jattn.load_tuning(path)
  assert str(path) in str(info.value)
  with pytest.raises(ValueError, match="cannot be read"):
    jattn.load_tuning(tmp_path / "missing.json")


def test_stale_or_foreign_tables_warn_naming_the_file(tmp_path):
  path = _table(
    tmp_path, dict(block_q=16, block_kv=8, schedule="serial", step_width=None), version="0.0.1"
  )
  with pytest.warns(UserWarning, match="written by jattn 0.0.1") as rec:
    table = jattn.load_tuning(path)
  assert str(path) in str(rec[0].message)
  with table:
    assert _steps() == (T // 16) * (T // 8)  # still used
  other = _table(
    tmp_path,
    dict(block_q=16, block_kv=8, schedule="serial", step_width=None),
    device="some other accelerator",
  )
  base = _steps()
  with jattn.tuning(other), pytest.warns(UserWarning, match="no entry for this device"):
    assert _steps() == base


def test_jattn_bench_tune_writes_a_table_that_is_used(tmp_path, capsys):
  out = tmp_path / "tuned.json"
  assert (
    bench_tune.main(
      [
        "--T",
        "64",
        "--heads",
        "2",
        "--head-dim",
        "8",
        "--mask",
        "full",
        "causal",
        "--blocks",
        "16x16",
        "--widths",
        "4",
        "--repeats",
        "1",
        "--out",
        str(out),
      ]
    )
    == 0
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    table = jattn.load_tuning(out)
  assert set(table.entries) == {f"{DEVICE}|float32|8|full|64", f"{DEVICE}|float32|8|causal|64"}
  best = table.entries[f"{DEVICE}|float32|8|full|64"]
  assert (best["block_q"], best["block_kv"]) == (16, 16)
  assert best["schedule"] in ("serial", "parallel")
  with jattn.tuning(out):
    steps = _steps()
  expect = {
    "serial": (T // best["block_q"]) * (T // best["block_kv"]),
    "parallel": T // best["block_kv"],
  }[best["schedule"]]
  assert steps == expect
  assert "wrote" in capsys.readouterr().out


def _lowered_for(platform, f, *args):
  return jax.export.export(jax.jit(f), platforms=[platform])(*args).mlir_module()


def test_a_table_preferring_the_fused_kernel_puts_it_first_on_its_platform():
  """implementation=None lowered for a TPU runs splash for a call it takes; an entry that says
  jattn's kernels won on that device keeps splash out, one that says splash keeps it in. On
  other platforms, for a call that asks for an implementation, and for decoding-shaped calls
  (another shape in the same length bucket, never measured) nothing changes."""
  T, H = _plan.DECODE_MIN_KEYS, 64  # one length bucket for both shapes
  q = jax.random.normal(jax.random.key(0), (1, T, 2, H))
  causal = lambda q: jattn.dot_product_attention(q, q, q, is_causal=True)
  decode = lambda q: jattn.dot_product_attention(q[:, :1], q, q)
  dense = lambda q: jattn.dot_product_attention(q, q, q, is_causal=True, implementation="dense")
  said = {}
  for name in ("splash", "chunked"):
    said[name] = jattn.TuningTable()
    for kind in ("causal", "full"):
      # The block sizes are the chunked kernels' (splash's must be multiples of 128): splash
      # keeps its own.
      said[name].add(DEVICE, "float32", H, kind, T, implementation=name, block_q=64, block_kv=64)
  # Fresh functions for each trace: a table is read when a call is traced.
  assert "tpu_custom_call" in _lowered_for("tpu", lambda q: causal(q), q)
  with jattn.tuning(said["chunked"]):
    assert "tpu_custom_call" not in _lowered_for("tpu", lambda q: causal(q), q)
  table = said["splash"]
  with jattn.tuning(table):
    assert "tpu_custom_call" in _lowered_for("tpu", lambda q: causal(q), q)
    assert "tpu_custom_call" not in _lowered_for("tpu", lambda q: decode(q), q)
    assert "tpu_custom_call" not in _lowered_for("tpu", lambda q: dense(q), q)
    assert "tpu_custom_call" not in _lowered_for("cuda", lambda q: causal(q), q)
    got = jax.jit(lambda q: causal(q))(q)  # this CPU: the rule's choice, same result
  np.testing.assert_array_equal(got, jax.jit(dense)(q))


def test_tune_entry_and_fused_kernel_choice():
  fast, slow = dict(block_q=256, block_kv=64), dict(block_q=64, block_kv=64)
  chunked = [(2.0, slow), (1.0, fast)]
  assert bench_tune.entry(chunked) == fast
  cudnn = lambda t: {(None, None): (t, "cudnn")}
  # A fused kernel timed and slower: the entry says jattn's kernels won (None then skips it).
  assert bench_tune.entry(chunked, cudnn(1.5)) == dict(fast, implementation="chunked")
  assert bench_tune.entry(chunked, cudnn(0.5)) == dict(fast, implementation="cudnn")
  # Splash takes an entry's block sizes that are multiples of 128 (else its default): it is
  # judged at the sizes the fastest chunked entry would give it.
  assert bench_tune.fused_blocks("splash", 256, 64) == (256, None)
  assert bench_tune.fused_blocks("cudnn", 256, 64) == (None, None)
  splash = {(256, None): (1.5, "splash"), (None, None): (0.5, "splash")}
  assert bench_tune.entry(chunked, splash) == dict(fast, implementation="chunked")
  splash[(256, None)] = (0.9, "splash")
  assert bench_tune.entry(chunked, splash) == dict(fast, implementation="splash")
  fk = bench_tune.fused_kernel
  assert fk("auto", "gpu", jnp.dtype("bfloat16")) == "cudnn"
  assert fk("auto", "gpu", jnp.dtype("float32")) is None  # cuDNN takes 16-bit inputs only
  assert fk("auto", "tpu", jnp.dtype("float32")) == "splash"
  assert fk("auto", "cpu", jnp.dtype("bfloat16")) is None
  assert fk("none", "tpu", jnp.dtype("float32")) is None
  assert fk("splash", "cpu", jnp.dtype("float32")) == "splash"


def test_jattn_bench_tune_times_the_fused_kernel_in_the_same_rounds(tmp_path, capsys):
  """--fused splash, here in Pallas's interpret mode: timed beside the chunked candidates; the
  entry names it exactly when its median is the fastest of the printed ones."""
  from jax.experimental.pallas import tpu as pltpu

  out = tmp_path / "tuned.json"
  with pltpu.force_tpu_interpret_mode():
    assert (
      bench_tune.main(
        [
          "--T",
          "128",
          "--heads",
          "1",
          "--head-dim",
          "8",
          "--mask",
          "causal",
          "--blocks",
          "64x64",
          "--schedules",
          "serial",
          "--pass",
          "forward",
          "--fused",
          "splash",
          "--repeats",
          "1",
          "--out",
          str(out),
        ]
      )
      == 0
    )
  printed = capsys.readouterr().out
  # 64 is no multiple of 128: splash runs (and is timed) with its default blocks.
  times = dict(re.findall(r"(64x64 serial|splash) ([0-9.e+-]+) s", printed))
  assert set(times) == {"64x64 serial", "splash"}, printed
  entry = jattn.load_tuning(out).entries[f"{DEVICE}|float32|8|causal|128"]
  splash_won = float(times["splash"]) < float(times["64x64 serial"])
  # Measured wins either way: the fused kernel, or jattn's kernels (then it is not tried first).
  assert entry["implementation"] == ("splash" if splash_won else "chunked")
  assert (entry["block_q"], entry["schedule"]) == (64, "serial")
