"""The benchmark CLI: tiny sweeps end to end, FLOP counts against hand counts, the memory guard."""

import csv
import inspect
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.bench import (
  cli,
  config,
  decode_bench,
  flops,
  masks,
  report,
  ring_bench,
  runner,
  sharding_bench,
  torch_peer,
)

_JAX_IMPLS = {"jattn-dense", "jattn-chunked-32x32", "jax-nn", "flax"}


def _run(tmp_path, *argv):
  out = tmp_path / "out"
  assert cli.main([*argv, "--out", str(out), "--quiet"]) == 0
  (path,) = out.glob("*.json")
  return json.loads(path.read_text()), out


def _write_config(tmp_path, text):
  path = tmp_path / "bench.toml"
  path.write_text(text)
  return str(path)


# ------------------------------------------------------------------------------ the quick sweep


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("quick")
  result, out = _run(tmp, "quick", "--plot", str(tmp / "plots"))
  return result, out, tmp / "plots"


def test_quick_rows_have_every_field_with_sane_values(quick):
  result, _, _ = quick
  rows = result["rows"]
  # configs/quick.toml: forward T = 64, 128 and forward+backward T = 64, four JAX implementations
  # on the CPU (cuDNN needs a GPU; torch is dropped when it is not importable).
  assert {(r["pass"], r["T"]) for r in rows} == {
    ("forward", 64),
    ("forward", 128),
    ("forward+backward", 64),
  }
  for r in rows:
    assert tuple(r) == runner.ROW_FIELDS
    assert r["status"] == "ok", r
    assert r["impl"] in _JAX_IMPLS | {"torch"}
    assert (isinstance(r["compile_s"], float) and r["compile_s"] > 0) or r["impl"] == "torch"
    times = r["times_s"]
    assert len(times) == r["repeats"] == 2 and all(t > 0 for t in times)
    assert (
      r["time_min_s"] <= r["time_p25_s"] <= r["time_median_s"] <= r["time_p75_s"] <= r["time_max_s"]
    )
    assert r["time_median_s"] == pytest.approx(float(np.median(times)))
    # Hand count: B=1, N=4 query heads (not K=2), H=16, causal T=S: T(T+1)/2 pairs, 2 matmuls of
    # 2 FLOPs per multiply-add forward; 3.5x that forward+backward.
    pairs = r["T"] * (r["T"] + 1) // 2
    forward = 4 * 1 * 4 * 16 * pairs
    assert r["flops"] == (forward if r["pass"] == "forward" else 3.5 * forward)
    assert r["flops_per_s"] == pytest.approx(r["flops"] / r["time_median_s"])
    assert r["peak_fraction"] == pytest.approx(
      r["flops_per_s"] / result["peak"]["float32"]["flops_per_s"]
    )
    assert r["speedup_vs_baseline"] > 0 and r["baseline"] == "jax-nn"
    if r["impl"] in _JAX_IMPLS:
      for key in ("temp_bytes", "argument_bytes", "output_bytes"):
        assert isinstance(r[key], int) and r[key] >= 0
      # float32 q (T, 4, 16) + k, v (T, 2, 16) [+ dout (T, 4, 16)]; out [+ dq, dk, dv].
      T, f32 = r["T"], 4
      fwd = r["pass"] == "forward"
      assert r["argument_bytes"] == T * (64 + 32 + 32 + (0 if fwd else 64)) * f32, r
      # (out, dq, dk, dv) is a tuple: XLA counts its table of 4 pointers with the outputs.
      tuple_table = 0 if fwd else 4 * 8
      assert r["output_bytes"] == T * (64 if fwd else 64 + 64 + 32 + 32) * f32 + tuple_table, r
    if r["impl"] in ("jax-nn", "torch"):
      assert r["max_abs_diff"] is None  # jax-nn is the reference; torch outputs stay in its process
    else:
      assert r["diff_reference"] == "jax-nn"
      assert 0 <= r["max_abs_diff"] < 1e-5, r
  base = {(r["pass"], r["T"]): r for r in rows if r["impl"] == "jax-nn"}
  for r in rows:
    b = base[r["pass"], r["T"]]
    # docs/benchmarks.md: vs_jax-nn = jax-nn's median / this row's median (2.00x = twice as fast).
    assert r["speedup_vs_baseline"] == pytest.approx(b["time_median_s"] / r["time_median_s"])
    if r["temp_bytes"] is not None:
      assert r["temp_vs_baseline"] == pytest.approx(r["temp_bytes"] / b["temp_bytes"])
    if r["impl"] == "jax-nn":
      assert r["speedup_vs_baseline"] == 1.0
      # jax.nn's XLA path materialises the fp32 (B, N, T, S) scores.
      assert r["temp_bytes"] >= 1 * 4 * r["T"] * r["T"] * 4, r
    if r["impl"] == "flax":
      assert "repeated 2x" in r["note"]  # GQA (N=4, K=2): flax needs k/v heads repeated


def test_quick_result_describes_the_machine(quick):
  result, _, _ = quick
  m = result["machine"]
  for key in (
    "jax",
    "jaxlib",
    "backend",
    "devices",
    "cpu_count",
    "platform",
    "timestamp_utc",
    "env",
    "python",
  ):
    assert m[key], key
  assert m["backend"] == "cpu" and isinstance(m["env"], dict)
  assert result["peak"]["float32"]["flops_per_s"] > 0
  assert "visible" in result["flop_convention"]
  assert result["config"]["name"] == "quick" and result["interrupted"] is False
  if not torch_peer.available():
    assert any("torch is not importable" in n for n in result["notes"])


@pytest.mark.skipif(torch_peer.available(), reason="checks how a missing torch is recorded")
def test_torch_peer_that_cannot_start_is_recorded():
  # Forced past the CLI's check: the worker process reports its failed import over the protocol.
  (case,) = config.parse({"T": [8], "implementations": ["torch"], "passes": ["forward"]}).cases
  peer = torch_peer.TorchPeer(threads=1)
  ctx = runner.Context(
    max_memory_bytes=2**30, baseline="jax-nn", seed=0, backend="cpu", peak_flops={}, torch_peer=peer
  )
  try:
    (row,) = runner.run_case(case, 0, ctx)
  finally:
    peer.close()
  assert row["status"] == "error" and "import torch failed" in row["reason"], row
  assert row["time_median_s"] is None


class _FakeProcess:
  """A clock, a CPU-time reader and a sleep for runner.settle: each sleep advances the clock by
  its argument and the process's CPU time by the next entry of ``busy`` (then by 0: idle)."""

  def __init__(self, busy=()):
    self.busy = list(busy)
    self.now = 100.0
    self.cpu = 5.0
    self.sleeps = 0

  def clock(self):
    return self.now

  def cpu_time(self):
    return self.cpu

  def sleep(self, seconds):
    self.sleeps += 1
    self.now += seconds
    self.cpu += self.busy.pop(0) if self.busy else 0.0

  def settle(self, **kw):
    return runner.settle(cpu_time=self.cpu_time, clock=self.clock, sleep=self.sleep, **kw)


def test_settle_waits_for_background_cpu_work():
  # Driven by a fake clock and CPU-time reader: no wall-clock bound, nothing machine load can move.
  idle = _FakeProcess()
  assert idle.settle() is True and idle.sleeps == 1  # an idle process returns after one interval

  # Background work (XLA freeing buffers in another thread) uses CPU for 5 intervals: settle
  # returns at the first interval without it, and only then.
  busy = _FakeProcess(busy=[0.01] * 5)
  assert busy.settle(interval_s=0.02, busy_s=0.002) is True
  assert busy.sleeps == 6 and busy.busy == []

  # CPU time under busy_s per interval is idle (the sampling loop's own cost).
  light = _FakeProcess(busy=[0.001] * 5)
  assert light.settle(interval_s=0.02, busy_s=0.002) is True and light.sleeps == 1

  # A process that never goes idle: settle gives up at max_wait_s of the (fake) clock.
  never = _FakeProcess(busy=[0.01] * 1000)
  assert never.settle(max_wait_s=1.0, interval_s=0.25) is False
  assert never.sleeps == 4 and never.now == 101.0

  # The real readers: process-wide CPU time (the freeing runs in a background thread, which
  # time.thread_time would not see) against a monotonic clock.
  params = inspect.signature(runner.settle).parameters
  assert params["cpu_time"].default is time.process_time
  assert params["clock"].default is time.perf_counter
  assert params["sleep"].default is time.sleep


def test_quick_writes_csv_markdown_and_plots(quick):
  result, out, plots = quick
  (csv_path,) = out.glob("*.csv")
  with open(csv_path, newline="") as f:
    reader = csv.DictReader(f)
    assert tuple(reader.fieldnames) == runner.ROW_FIELDS
    table = list(reader)
  assert len(table) == len(result["rows"])
  assert [float(x) for x in table[0]["times_s"].split(";")] == pytest.approx(
    result["rows"][0]["times_s"], rel=1e-5
  )
  (md,) = out.glob("*.md")
  assert md.read_text().count("\n| forward") == len(result["rows"])
  pngs = sorted(plots.glob("*.png"))
  assert len(pngs) == 2  # one figure per (pass, dtype, mask, shape) group
  assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


# The report's table columns and the JSON row field each shows (with the rounding it prints).
_MD_CASE_COLUMNS = ["pass", "mask", "dtype", "B", "N", "K", "H", "T", "S"]
_TABLE_COLUMNS = [
  "impl",
  "compile_s",
  "median_s",
  "min..max_s",
  "temp_MiB",
  "GFLOP/s",
  "%peak",
  "vs jax-nn",
  "max abs diff",
  "steps",
  "ops/step",
  "work",
  "status",
]


def _check_cell(column, cell, row):
  def number(value, rel=0.0, abs_=0.0):
    if value is None:
      assert cell == "-", (column, cell, row)
    else:
      assert float(cell) == pytest.approx(value, rel=rel, abs=abs_), (column, cell, row)

  if column in _MD_CASE_COLUMNS or column == "impl":
    assert cell == str(row[column]), (column, cell)
  elif column == "compile_s":
    number(row["compile_s"], rel=6e-3)  # .3g
  elif column == "median_s":
    number(row["time_median_s"], rel=6e-3)
  elif column == "min..max_s":
    lo, hi = cell.split("..")
    assert float(lo) == pytest.approx(row["time_min_s"], rel=6e-3), (cell, row)
    assert float(hi) == pytest.approx(row["time_max_s"], rel=6e-3), (cell, row)
  elif column == "temp_MiB":
    number(None if row["temp_bytes"] is None else row["temp_bytes"] / 2**20, rel=6e-4)  # .4g
  elif column == "GFLOP/s":
    number(row["flops_per_s"] / 1e9, rel=6e-3)
  elif column == "%peak":
    number(100 * row["peak_fraction"], abs_=0.51)  # .0f
  elif column in ("vs jax-nn", "vs_jax-nn"):
    assert cell.endswith("x"), cell
    assert float(cell[:-1]) == pytest.approx(row["speedup_vs_baseline"], abs=0.0051), (cell, row)
  elif column in ("max abs diff", "max|diff|"):
    number(row["max_abs_diff"], rel=0.051)  # .1e
  elif column == "steps":
    want = (
      "-"
      if row["loops"] is None
      else "run-time"
      if row["loop_steps"] is None
      else str(row["loop_steps"])
    )
    assert cell == want, (cell, row)
  elif column == "ops/step":
    assert cell == ("-" if not row["loops"] else str(row["ops_per_step"])), (cell, row)
  elif column == "work":
    number(row["work_vs_ideal"], abs_=0.0051)  # .2f
  elif column == "status":
    assert cell == row["status"], (cell, row)
  else:
    raise AssertionError(f"unexpected column {column!r}")


def test_quick_markdown_cells_match_the_json_rows(quick):
  result, out, _ = quick
  (md,) = out.glob("*.md")
  lines = md.read_text().splitlines()
  assert lines[0].startswith("<!-- jattn-bench quick")
  header = [c.strip() for c in lines[1].strip("|").split("|")]
  assert header == _MD_CASE_COLUMNS + _TABLE_COLUMNS
  assert set(lines[2]) == {"|", "-"}
  body = lines[3:]
  assert len(body) == len(result["rows"])
  for line, row in zip(body, result["rows"], strict=True):
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert len(cells) == len(header), line
    for column, cell in zip(header, cells):
      _check_cell(column, cell, row)


def test_quick_terminal_table_matches_the_json_rows(quick):
  result, _, _ = quick
  rows = [r for r in result["rows"] if r["pass"] == "forward" and r["T"] == 128]
  text = report.format_case(rows, "jax-nn").splitlines()
  assert text[0] == report.case_header(rows[0])
  assert "T=128 S=128" in text[0] and f"({rows[0]['flops'] / 1e9:.4g} GFLOP per call)" in text[0]
  header = text[1].split()
  assert header == [
    "impl",
    "compile_s",
    "median_s",
    "min..max_s",
    "temp_MiB",
    "GFLOP/s",
    "%peak",
    "vs_jax-nn",
    "max|diff|",
    "steps",
    "ops/step",
    "work",
    "status",
  ]
  for line, row in zip(text[2:], rows, strict=True):
    cells = line.split()
    assert len(cells) == len(header), line
    for column, cell in zip(header, cells):
      _check_cell(column, cell, row)


def test_quick_csv_matches_the_json_rows(quick):
  result, out, _ = quick
  (csv_path,) = out.glob("*.csv")
  with open(csv_path, newline="") as f:
    table = list(csv.DictReader(f))
  assert len(table) == len(result["rows"])
  for line, row in zip(table, result["rows"], strict=True):
    for key in runner.ROW_FIELDS:
      value, cell = row[key], line[key]
      if value is None:
        assert cell == "", (key, cell)
      elif key == "times_s":
        assert [float(x) for x in cell.split(";")] == pytest.approx(value, rel=1e-5)
      elif isinstance(value, float):
        assert float(cell) == value, key  # repr round-trips
      else:
        assert cell == str(value), key


# ------------------------------------------------------------ speed-up and temp ratios, synthetic


def _row(impl, status="ok", time_s=None, temp=None):
  row = dict.fromkeys(runner.ROW_FIELDS)
  row.update(
    impl=impl,
    status=status,
    time_median_s=time_s,
    time_min_s=time_s,
    time_max_s=time_s,
    temp_bytes=temp,
    baseline="jax-nn",
  )
  return row


def test_speedup_is_baseline_time_over_row_time():
  # docs/benchmarks.md: "jax-nn's median / this row's median: 2.00x = twice as fast as jax.nn".
  base = _row("jax-nn", time_s=2.0, temp=4096)
  fast = _row("jattn-chunked-32x32", time_s=1.0, temp=1024)
  slow = _row("jattn-dense", time_s=4.0, temp=8192)
  failed = _row("flax", status="error", temp=None)
  runner._ratios([base, fast, slow, failed], base)
  assert fast["speedup_vs_baseline"] == 2.0 and slow["speedup_vs_baseline"] == 0.5
  assert base["speedup_vs_baseline"] == 1.0 and failed["speedup_vs_baseline"] is None
  assert fast["temp_vs_baseline"] == 0.25 and slow["temp_vs_baseline"] == 2.0
  assert base["temp_vs_baseline"] == 1.0 and failed["temp_vs_baseline"] is None
  column = report._COLUMNS.index("vs_base")
  assert report._cells(fast)[column] == "2.00x" and report._cells(slow)[column] == "0.50x"
  # No baseline row (or a baseline that did not run): no ratios, not a made-up one.
  lone = _row("jattn-dense", time_s=1.0, temp=10)
  runner._ratios([lone], None)
  assert lone["speedup_vs_baseline"] is None and lone["temp_vs_baseline"] is None
  skipped, ran = _row("jax-nn", status="skipped"), _row("jattn-dense", time_s=1.0, temp=10)
  runner._ratios([skipped, ran], skipped)
  assert ran["speedup_vs_baseline"] is None and ran["temp_vs_baseline"] is None


def test_a_chunked_baseline_is_found_by_name():
  # Rows are labelled "jattn-chunked-8x8"; a config's baseline names "jattn-chunked".
  (case,) = config.parse(
    {
      "T": [16],
      "heads": [1],
      "head_dim": [8],
      "passes": ["forward"],
      "implementations": ["jattn-dense", "jattn-chunked"],
      "block_sizes": [[8, 8]],
      "repeats": 1,
      "warmup": 0,
      "baseline": "jattn-chunked",
    }
  ).cases
  ctx = runner.Context(
    max_memory_bytes=2**30, baseline="jattn-chunked", seed=0, backend="cpu", peak_flops={}
  )
  dense, chunked = runner.run_case(case, 0, ctx)
  assert dense["status"] == chunked["status"] == "ok"
  assert chunked["impl"] == "jattn-chunked-8x8" and chunked["speedup_vs_baseline"] == 1.0
  assert dense["speedup_vs_baseline"] == pytest.approx(
    chunked["time_median_s"] / dense["time_median_s"]
  )
  assert dense["diff_reference"] == "jattn-chunked-8x8"  # the baseline runs first: the reference


# ------------------------------------------------------------------------------ compiled memory


def test_compiled_memory_reads_temp_of_a_known_program():
  # Sorting a (n, n) outer product needs all of it at once: n*n float32 temporaries that XLA
  # cannot elide, from an argument of n floats and an output of n / 4.
  n = 512

  def f(x):
    return jnp.sort(jnp.outer(x, x).ravel())[:: 4 * n]

  x = jnp.ones((n,), jnp.float32)
  memory = runner.compiled_memory(jax.jit(f).lower(x).compile())
  assert set(memory) == {"temp_bytes", "argument_bytes", "output_bytes"}
  assert n * n * 4 <= memory["temp_bytes"] <= 4 * n * n * 4, memory
  assert memory["argument_bytes"] == n * 4 and memory["output_bytes"] == n // 4 * 4, memory

  class NoAnalysis:
    def memory_analysis(self):
      raise NotImplementedError

  assert runner.compiled_memory(NoAnalysis()) is None


# ------------------------------------------------------------------------------ --compile-only


def _forbid_runs(monkeypatch, flag):
  """Make any call of a compiled function fail the test: ``flag`` promises to run nothing."""

  def no_call(self, keep):
    raise AssertionError(f"{flag} called a compiled function")

  monkeypatch.setattr(runner._JaxRunner, "call", no_call)


def test_compile_only_records_compile_time_and_memory_and_runs_nothing(tmp_path, monkeypatch):
  _forbid_runs(monkeypatch, "--compile-only")
  path = _write_config(
    tmp_path,
    """
repeats = 3
peak_matmul_size = 64
implementations = ["jattn-dense", "jattn-chunked", "jax-nn"]
block_sizes = [[16, 16]]
passes = ["forward"]
heads = [2]
head_dim = [8]
T = [32]
masks = ["causal"]
""",
  )
  result, out = _run(tmp_path, path, "--compile-only")
  assert result["compile_only"] is True and "--compile-only" in result["argv"]
  rows = result["rows"]
  assert [r["impl"] for r in rows] == ["jattn-dense", "jattn-chunked-16x16", "jax-nn"]
  base = rows[2]
  for r in rows:
    assert r["status"] == "compiled" and r["reason"] is None, r
    assert isinstance(r["compile_s"], float) and r["compile_s"] > 0
    assert r["argument_bytes"] == 32 * 2 * 8 * 4 * 3 and r["output_bytes"] == 32 * 2 * 8 * 4
    assert isinstance(r["temp_bytes"], int) and r["temp_bytes"] >= 0
    assert r["temp_vs_baseline"] == pytest.approx(r["temp_bytes"] / base["temp_bytes"])
    assert r["flops"] == 4 * 2 * 8 * (32 * 33 // 2)  # the case's, whether it runs or not
    for key in (
      "time_median_s",
      "time_min_s",
      "time_max_s",
      "time_p25_s",
      "time_p75_s",
      "spread_pct",
      "times_s",
      "flops_per_s",
      "peak_fraction",
      "speedup_vs_baseline",
      "max_abs_diff",
      "diff_reference",
    ):
      assert r[key] is None, (key, r)
  (md,) = out.glob("*.md")
  body = md.read_text().splitlines()[3:]
  assert len(body) == 3
  for line, row in zip(body, rows, strict=True):
    cells = [c.strip() for c in line.strip("|").split("|")]
    for column, cell in zip(_MD_CASE_COLUMNS + _TABLE_COLUMNS, cells):
      if column in ("median_s", "min..max_s", "GFLOP/s", "%peak", "vs jax-nn", "max abs diff"):
        assert cell == "-", (column, line)
      else:
        _check_cell(column, cell, row)


def test_platform_reports_the_accelerator_programs_structure(tmp_path, monkeypatch):
  # --platform cuda lowers each JAX implementation for the GPU with jax.export, compiles it here,
  # reads its loops from the compiled HLO and runs nothing. T = 64 in 16 x 16 blocks: the GPU's
  # default (parallel) schedule takes one step per key block, 4 forward and 4 + 4 + 4 forward+
  # backward; the serial one walks the 4 x 4 = 16 tiles; dense and jax.nn have no loop.
  _forbid_runs(monkeypatch, "--platform")
  path = _write_config(
    tmp_path,
    """
peak_matmul_size = 64
implementations = ["jattn-dense", "jattn-chunked", "jattn-serial", "jax-nn"]
block_sizes = [[16, 16]]
passes = ["forward", "forward+backward"]
heads = [2]
head_dim = [8]
T = [64]
masks = ["full"]
""",
  )
  result, _out = _run(tmp_path, path, "--platform", "cuda")
  assert result["platform"] == "cuda" and result["compile_only"] is True
  rows = {(r["pass"], r["impl"]): r for r in result["rows"]}
  for r in rows.values():
    assert r["status"] == "compiled" and r["platform"] == "cuda", r
  assert rows["forward", "jattn-chunked-16x16"]["loop_steps"] == 4
  assert rows["forward+backward", "jattn-chunked-16x16"]["loop_steps"] == 12
  assert rows["forward", "jattn-serial-16x16"]["loop_steps"] == 16
  assert rows["forward+backward", "jattn-serial-16x16"]["loop_steps"] == 32
  assert rows["forward", "jattn-chunked-16x16"]["ops_per_step"] > 0
  for impl in ("jattn-dense", "jax-nn"):
    assert rows["forward", impl]["loop_steps"] == 0 and rows["forward", impl]["loops"] == 0
  # Unmasked, every program computes exactly the case's matmuls forward; forward+backward the
  # chunked kernels' two-pass backward recomputes P once more (9 matmuls for 7).
  for impl in ("jattn-dense", "jattn-chunked-16x16", "jattn-serial-16x16", "jax-nn"):
    assert rows["forward", impl]["work_vs_ideal"] == pytest.approx(1.0), impl
  assert rows["forward+backward", "jattn-chunked-16x16"]["work_vs_ideal"] == pytest.approx(9 / 7)


# ------------------------------------------------------------------------------ the ring benchmark


@pytest.mark.slow
def test_ring_bench_runs_on_four_host_devices(tmp_path, capsys):
  # T = 64 over P = 4 devices: shards of Ts = 16; block 16 is one block per contiguous shard and
  # is clipped to a zigzag chunk (8). GQA (N=2, K=1) so the step bytes count K, the FLOPs N.
  path = _write_config(
    tmp_path,
    """
name = "tiny-ring"
description = "a test"
devices = 4
repeats = 1
warmup = 0
batch = 1
heads = 2
kv_heads = 1
head_dim = 8
T = [64]
block = 16
layouts = ["contiguous", "zigzag"]
masks = ["causal"]
passes = ["forward", "forward+backward"]
""",
  )
  assert cli._is_ring_config(path)  # `jattn-bench <ring config>` hands it to ring_bench
  out = tmp_path / "ring.json"
  assert ring_bench.main([path, "--json", str(out)]) == 0
  printed = capsys.readouterr().out
  result = json.loads(out.read_text())
  assert result["config"]["devices"] == 4
  rows = result["rows"]
  assert [(r["layout"], r["passes"]) for r in rows] == [
    ("contiguous", "forward"),
    ("zigzag", "forward"),
    ("contiguous", "forward+backward"),
    ("zigzag", "forward+backward"),
  ]
  # Tiles per device (causal, by hand): contiguous, one 16-block per shard: device d computes
  # d full tiles and its diagonal one. Zigzag, 8-blocks: the 8 x 8 global grid's 36 lower
  # tiles, 9 per device.
  tiles = {"contiguous": (16, 4, 1), "zigzag": (8, 9, 9)}
  for r in rows:
    assert r["case"] == "T=64 B=1 N=2 K=1 H=8 float32 causal" and r["devices"] == 4
    assert (r["block"], r["tiles_max"], r["tiles_min"]) == tiles[r["layout"]], r
    for key in ("one_s", "ring_s", "compile_one_s", "compile_ring_s"):
      assert isinstance(r[key], float) and 0 < r[key] < 120, (key, r)
    assert r["ratio"] == pytest.approx(r["ring_s"] / r["one_s"])
    assert r["step_bytes"] == 2 * 1 * 16 * 1 * 8 * 4  # K and V shards, float32
    assert r["step_flops"] == 4 * 1 * 2 * 16 * 16 * 8  # one (query, key) shard pair, forward
  table = [ln for ln in printed.splitlines() if ln.startswith("T=64")]
  assert len(table) == 4 and "tiny-ring: a test" in printed
  for line, r in zip(table, rows, strict=True):
    assert line.split()[7:10] == [r["layout"], r["passes"], f"{r['one_s']:.3f}"]


@pytest.mark.slow
def test_sharding_bench_reads_collectives_of_each_sharding(tmp_path, capsys):
  # `jattn-bench sharding` on 4 host devices (its own child process), dense and ring only: batch
  # and head sharding move nothing; a sequence-sharded dense call gathers K and V (GQA: N = 8,
  # K = 4, so their gathers are not query-sized) and keeps the query's sharding; ring attention
  # only permutes K/V shards.
  out = tmp_path / "sharding.json"
  argv = [
    "sharding",
    "--T",
    "64",
    "--batch",
    "4",
    "--heads",
    "8",
    "--kv-heads",
    "4",
    "--head-dim",
    "8",
    "--impls",
    "dense",
    "ring",
    "--json",
    str(out),
  ]
  assert cli.main(argv) == 0
  printed = capsys.readouterr().out
  rows = json.loads(out.read_text())["rows"]
  key = lambda r: (r["mesh"], r["sharding"], r["impl"], r["passes"])
  assert sorted(map(key, rows)) == sorted(
    [
      (m, w, "dense", p)
      for m in ("Auto", "Explicit")
      for w in sharding_bench.SHARDINGS
      for p in sharding_bench.PASSES
    ]
    + [(m, "sequence", "ring", p) for m in ("Auto", "Explicit") for p in sharding_bench.PASSES]
  )
  for r in rows:
    assert "error" not in r, r
    assert not r["query_sized"], r
    assert r["out_spec"].startswith(
      {"batch": "('x'", "heads": "(None, None, 'x'", "sequence": "(None, 'x'", "keys": "("}[
        r["sharding"]
      ]
    ), r
    kinds = sorted({c["kind"] for c in r["collectives"]})
    if r["sharding"] == "keys":
      # One query row against K and V sharded along S. Under an Auto mesh the partitioner
      # splits dense's contractions over S: K and V stay put, one-row partial results are
      # all-reduced. Under an Explicit mesh dense gathers K and V.
      sizes = {c["kind"]: c["bytes"] for c in r["collectives"]}
      if r["mesh"] == "Auto":
        assert kinds == ["all-reduce"] and max(sizes.values()) <= 4 * 8 * 9 * 4, r
      else:
        assert "all-gather" in kinds, r
    elif r["sharding"] != "sequence":
      assert kinds == [], r
    elif r["impl"] == "ring":
      # K and V shards (and, backward, their dK, dV) pass on once per ring step: P = 4 runs.
      assert kinds == ["collective-permute"], r
      assert {c["runs"] for c in r["collectives"]} == {4}, r
      assert all(c["bytes_per_call"] == 4 * c["bytes"] for c in r["collectives"]), r
    else:
      gathers = [c for c in r["collectives"] if c["kind"] == "all-gather"]
      # K and V, each whole on every device: (B, K, S, H) float32 in the dense kernel's layout.
      assert [c["bytes"] for c in gathers] == [4 * 4 * 64 * 8 * 4] * 2, r
      assert [c["runs"] for c in gathers] == [1, 1], r
      assert kinds == (
        ["all-gather"] if r["passes"] == "forward" else ["all-gather", "all-reduce"]
      ), r
    assert r["temp_mib"] is not None and r["temp_mib"] >= 0
  assert printed.count("\n") == len(rows) + 2
  # Malformed: T not divisible by the devices is refused before any child runs.
  with pytest.raises(SystemExit):
    cli.main(["sharding", "--T", "66"])


# ------------------------------------------------- masks through every implementation, compared


def test_masks_reach_every_implementation_alike(tmp_path):
  # T != S, bottom-right causal, an asymmetric window, packed segments and MQA: the forms that go
  # to jax.nn and flax as boolean arrays; a symmetric window goes to jax.nn natively.
  combined = "causal:bottom_right+window:8,4+segments:2"
  path = _write_config(
    tmp_path,
    f"""
repeats = 1
peak_matmul_size = 64
implementations = ["jattn-dense", "jattn-chunked", "jax-nn", "flax"]
block_sizes = [[16, 16]]
passes = ["forward"]
heads = [4]
kv_heads = [1]
head_dim = [8]
T = [48]
S = [64]
masks = ["window:6", "{combined}"]

[[compare]]
field = "mask"
values = ["window:6", "{combined}"]
""",
  )
  result, _ = _run(tmp_path, path)
  rows = result["rows"]
  assert len(rows) == 8
  for r in rows:
    assert r["status"] == "ok", r
    if r["impl"] != "jax-nn":
      assert r["max_abs_diff"] < 1e-5, r
  jax_nn = {r["mask"]: r["note"] for r in rows if r["impl"] == "jax-nn"}
  assert jax_nn == {"window:6": "", combined: "mask passed as a boolean array"}
  comps = result["comparisons"]
  assert len(comps) == 4 and {c["impl"] for c in comps} == {r["impl"] for r in rows}
  for c in comps:
    assert c["time_ratio"] == pytest.approx(c["time_a_s"] / c["time_b_s"])


# ------------------------------------------------------------------------------ the memory guard


def test_max_memory_guard_records_skips_and_goes_on(tmp_path):
  # Dense estimate at T = 256: 256 * 256 * 4 bytes * 3 copies = 786432 bytes > 0.0005 GiB (~537
  # kB); chunked fits at T = 256 (~80 kB compiled) and not at T = 4096 (~690 kB: inputs alone
  # are 393 kB), which only its compiled memory can tell.
  path = _write_config(
    tmp_path,
    """
repeats = 1
peak_matmul_size = 64
implementations = ["jattn-dense", "jax-nn", "jattn-chunked"]
block_sizes = [[64, 64]]
passes = ["forward"]
heads = [1]
head_dim = [8]
T = [256, 4096]
""",
  )
  result, _ = _run(tmp_path, path, "--max-memory", "0.0005")
  by = {(r["impl"], r["T"]): r for r in result["rows"]}
  for impl in ("jattn-dense", "jax-nn"):
    for T in (256, 4096):
      r = by[impl, T]
      assert r["status"] == "skipped" and "dense score estimate" in r["reason"]
      assert r["memory_estimate_bytes"] == T * T * 4 * 3
      assert r["compile_s"] is None and r["time_median_s"] is None
  assert by["jattn-chunked-64x64", 256]["status"] == "ok"
  assert by["jattn-chunked-64x64", 256]["speedup_vs_baseline"] is None  # jax-nn did not run
  big = by["jattn-chunked-64x64", 4096]
  assert big["status"] == "skipped" and "compiled memory" in big["reason"]
  assert big["memory_estimate_bytes"] is None and big["temp_bytes"] > 0


# --------------------------------------------------------------------------------- FLOP counting


@pytest.mark.parametrize(
  "T,S,spec,pairs",
  [
    (8, 8, "full", 64),
    (8, 8, "causal", 36),  # 1 + 2 + ... + 8
    (4, 6, "causal", 10),  # top-left: rows see 1, 2, 3, 4
    (6, 4, "causal", 4 * 6 - 6),  # rows see 1, 2, 3, 4, 4, 4
    (4, 6, "causal:bottom_right", 18),  # rows see 3, 4, 5, 6
    (6, 4, "causal:bottom_right", 10),  # rows 0, 1 see nothing; then 1, 2, 3, 4
    (6, 6, "causal+window:2", 15),  # rows see 1, 2, 3, 3, 3, 3
    (5, 5, "window:1", 13),  # rows see 2, 3, 3, 3, 2
    (6, 6, "window:2,0", 15),  # the same as causal+window:2
    (4, 4, "segments:2", 8),  # two 2 x 2 blocks
    (4, 4, "causal+segments:2", 6),  # two 2 x 2 lower triangles
    (4, 8, "segments:2", 16),  # 2 queries x 4 keys, twice
  ],
)
def test_visible_pairs_hand_counts(T, S, spec, pairs):
  assert masks.visible_pairs(T, S, masks.parse(spec)) == pairs


@pytest.mark.parametrize(
  "T,S,spec",
  [
    (37, 53, "causal+window:5,3"),
    (53, 37, "causal:bottom_right+window:4"),
    (40, 40, "segments:3+window:6"),
    (29, 64, "causal:bottom_right+segments:5"),
  ],
)
def test_visible_pairs_equal_the_mask_array(T, S, spec):
  m = masks.parse(spec)
  q_seg = jnp.asarray(masks.segment_ids(T, m.segments or 1))[None]
  kv_seg = jnp.asarray(masks.segment_ids(S, m.segments or 1))[None]
  dense = np.asarray(masks.mask_array(m, T, S, q_seg, kv_seg))[0, 0]
  assert masks.visible_pairs(T, S, m) == int(dense.sum())
  np.testing.assert_array_equal(masks.visible_per_query(T, S, m), dense.sum(axis=1))


def test_attention_flops_convention():
  B, N, T, S, H = 2, 3, 16, 24, 8
  full = flops.attention_flops(B, N, T, S, H, masks.parse("full"), "forward")
  assert full == 4 * B * N * T * S * H  # two matmuls, 2 FLOPs per multiply-add
  assert (
    flops.attention_flops(B, N, T, S, H, masks.parse("full"), "forward+backward") == 3.5 * full
  )  # seven matmuls with the recomputed P
  causal = flops.attention_flops(B, N, 16, 16, H, masks.parse("causal"), "forward")
  assert causal == 4 * B * N * H * (16 * 17 // 2)
  assert (
    flops.attention_flops(B, N, 16, 16, H, masks.parse("causal"), "forward+backward")
    == 3.5 * causal
  )
  # T != S: top-left, query i sees keys 0..i; bottom-right, keys 0..i + S - T.
  assert flops.attention_flops(B, N, 4, 6, H, masks.parse("causal"), "forward") == 4 * B * N * H * (
    1 + 2 + 3 + 4
  )
  assert flops.attention_flops(B, N, 6, 4, H, masks.parse("causal"), "forward") == 4 * B * N * H * (
    1 + 2 + 3 + 4 + 4 + 4
  )
  assert flops.attention_flops(
    B, N, 4, 6, H, masks.parse("causal:bottom_right"), "forward"
  ) == 4 * B * N * H * (3 + 4 + 5 + 6)
  assert flops.attention_flops(
    B, N, 6, 4, H, masks.parse("causal:bottom_right"), "forward"
  ) == 4 * B * N * H * (0 + 0 + 1 + 2 + 3 + 4)
  # A causal window of 3 (the query and 3 keys back): rows see 1, 2, 3, then 4 keys.
  assert flops.attention_flops(
    B, N, 16, 16, H, masks.parse("causal+window:3"), "forward"
  ) == 4 * B * N * H * (1 + 2 + 3 + 4 * 13)
  # value head dim Hv != H: Q K^T costs 2 H, P V costs 2 Hv per pair.
  assert flops.attention_flops(
    B, N, T, S, H, masks.parse("full"), "forward", Hv=4
  ) == 2 * B * N * T * S * (H + 4)
  # GQA: the query heads N count, not the key/value heads K (keys are shared, not arithmetic).
  gqa = config.parse(
    {
      "T": [16],
      "heads": [8],
      "kv_heads": [2],
      "head_dim": [8],
      "masks": ["causal"],
      "passes": ["forward"],
    }
  ).cases[0]
  assert gqa.flops == 4 * 1 * 8 * 8 * (16 * 17 // 2)
  assert flops.dense_memory_estimate(B, N, T, S, "forward+backward") == B * N * T * S * 4 * 4
  with pytest.raises(ValueError, match="pass must be one of"):
    flops.attention_flops(B, N, T, S, H, masks.parse("full"), "backward")


# ------------------------------------------------------------------------- configs and arguments


@pytest.mark.parametrize(
  "text,message",
  [
    ("T = [8]\nrepeat = 3", "unknown key"),
    ("T = [8]\nmasks = ['causal+windw:4']", "unknown part 'windw:4'"),
    ("T = [8]\nheads = [4]\nkv_heads = [3]", "kv_heads=3 does not divide heads=4"),
    ("T = [8]\nimplementations = ['jattn']", "unknown 'jattn'"),
    ("T = [8]\nblock_sizes = [[0, 8]]", "block_sizes"),
    ("masks = ['full']", "'T'"),
    ("T = 8", "must be a list"),
    ("T = [8]\nwarmup = 'two'", "'warmup' must be an int"),
    ("T = [8]\nwarmup = -1", "'warmup' must be an int"),
  ],
)
def test_bad_configs_name_the_key(tmp_path, text, message):
  with pytest.raises(config.ConfigError, match=message) as info:
    config.load(_write_config(tmp_path, text))
  # The error policy: a value of the wrong type is also a TypeError, a bad value is not.
  wrong_type = text.endswith(("T = 8", "'two'"))
  assert isinstance(info.value, TypeError) == wrong_type, (text, type(info.value))


def test_every_shipped_config_parses():
  for name in ("default", "quick", "long_context", "causal", "window"):
    cfg = config.load(config.resolve_path(name))
    assert cfg.cases and cfg.name == name


def test_cli_errors_and_dry_run(tmp_path, capsys):
  assert cli.main(["no-such-config"]) == 2
  assert "no such file" in capsys.readouterr().err
  assert cli.main(["quick", "--repeats", "0"]) == 2
  assert cli.main(["quick", "--dry-run", "--impl", "jattn-chunked"]) == 0
  lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[")]
  assert len(lines) == 3 and all(ln.endswith("jattn-chunked-32x32") for ln in lines)
  assert math.isclose(
    float(lines[0].split(": ")[1].split()[0]),
    flops.attention_flops(1, 4, 64, 64, 16, masks.parse("causal"), "forward") / 1e9,
    rel_tol=1e-3,
  )


def test_compared_cases_are_grouped_to_run_together():
  cfg = config.parse(
    {
      "T": [8, 16],
      "masks": ["full", "causal"],
      "passes": ["forward"],
      "compare": [{"field": "mask", "values": ["causal", "full"]}],
    }
  )
  groups = cli._groups(list(cfg.cases), cfg.compare)
  assert [[(c.T, c.mask.name) for _, c in g] for g in groups] == [
    [(8, "full"), (8, "causal")],
    [(16, "full"), (16, "causal")],
  ]
  assert [len(g) for g in cli._groups(list(cfg.cases), ())] == [1, 1, 1, 1]


# ---------------------------------------------------------------------------- the decode benchmark


def test_decode_bench_times_a_step_against_the_floor(tmp_path, capsys):
  # `jattn-bench decode` on a tiny cache: every implementation agrees with jattn dense, ratios
  # are computed from the medians, and a case that needs more than max_memory_gib is skipped
  # with the reason; a bad config is an error naming the problem.
  path = _write_config(
    tmp_path,
    """
name = "tiny-decode"
repeats = 2
warmup = 0
batch = 2
heads = 4
kv_heads = 2
head_dim = 16
T = 1
S = [600, 1000000000]
dtypes = ["float32"]
max_memory_gib = 1.0
""",
  )
  out = tmp_path / "decode.json"
  assert cli.main(["decode", path, "--json", str(out)]) == 0
  printed = capsys.readouterr().out
  rows = json.loads(out.read_text())["rows"]
  ok, skipped = rows
  assert ok["status"] == "ok" and skipped["status"] == "skipped" and "GiB" in skipped["reason"]
  assert set(ok["ms"]) == set(decode_bench.IMPLS)
  assert max(ok["max_abs_diff"].values()) < 1e-5
  assert ok["vs_floor"]["jattn"] == pytest.approx(ok["ms"]["jattn"] / ok["ms"]["floor"])
  assert ok["jattn_speedup_vs_jax_nn"] == pytest.approx(ok["ms"]["jax.nn"] / ok["ms"]["jattn"])
  lines = [ln for ln in printed.splitlines() if ln.startswith("| float32")]
  assert len(lines) == 2 and lines[0].split("|")[2].strip() == "600"
  assert decode_bench.main([str(tmp_path / "missing.toml")]) == 2
  bad = _write_config(tmp_path, 'S = [4]\nT = 8\n')
  assert decode_bench.main([bad]) == 2 and "every S must be" in capsys.readouterr().err


def test_decode_bench_times_the_paged_call_against_its_floor(tmp_path, capsys):
  # With page_sizes, `jattn-bench decode` times jattn.paged_attention for each page dtype
  # against the floor of reading its pool once; its output equals jattn's chunked kernels on
  # the same (dequantised) cache laid out contiguously, and the ratios come from the medians.
  path = _write_config(
    tmp_path,
    """
name = "tiny-paged"
repeats = 2
warmup = 0
batch = 2
heads = 4
kv_heads = 2
head_dim = 16
T = 1
S = [300]
dtypes = ["float32"]
page_sizes = [16]
page_dtypes = ["float32", "int8", "float8_e5m2"]
max_memory_gib = 1.0
""",
  )
  out = tmp_path / "paged.json"
  assert cli.main(["decode", path, "--paged-only", "--json", str(out)]) == 0
  printed = capsys.readouterr().out
  rows = {(r["page_dtype"], r["layout"]): r for r in json.loads(out.read_text())["rows"]}
  assert set(rows) == {
    (d, layout) for d in ("float32", "int8", "float8_e5m2") for layout in ("NHD", "HND")
  }
  for (_dtype, layout), r in rows.items():
    assert r["status"] == "ok" and r["max_abs_diff"] < 1e-5, r
    assert r["ms"]["floor"] == min(r["ms"]["floor-sum"], r["ms"]["floor-max"])
    assert r["vs_floor"] == pytest.approx(r["ms"]["paged"] / r["ms"]["floor"])
    f32 = rows["float32", layout]["ms"]["paged"]
    assert r["vs_float32"] == pytest.approx(r["ms"]["paged"] / f32)
  assert (
    sum(
      ln.startswith("| int8 | HND | chunked (XLA walk) | 16 | 300") for ln in printed.splitlines()
    )
    == 1
  )
  assert {r["implementation"] for r in rows.values()} == {"chunked (XLA walk)"}  # on a CPU
  bad = _write_config(tmp_path, 'page_dtypes = ["int4"]\n')
  assert decode_bench.main([bad]) == 2 and "page_dtypes" in capsys.readouterr().err
  bad = _write_config(tmp_path, 'page_layouts = ["NDH"]\n')
  assert decode_bench.main([bad]) == 2 and "page_layouts" in capsys.readouterr().err


def test_decode_bench_times_a_shared_prefix_plain_and_as_a_cascade(tmp_path, capsys):
  # With shared_prefix, `jattn-bench decode` times R requests over one prefix stored once: the
  # plain paged call over each request's whole page table and the cascade (the prefix once,
  # each request's own pages, merged by log-sum-exp) agree, and the ratio comes from the
  # medians; a prefix that is not whole pages is an error naming it.
  path = _write_config(
    tmp_path,
    """
name = "tiny-shared-prefix"
repeats = 2
warmup = 0
heads = 4
kv_heads = 2
head_dim = 16
T = 2
S = [64]
shared_prefix = 48
shared_requests = 3
shared_own = 20
shared_page_size = 16
""",
  )
  out = tmp_path / "shared.json"
  argv = ["decode", path, "--shared-prefix-only", "--shared-requests", "5", "--json", str(out)]
  assert cli.main(argv) == 0
  printed = capsys.readouterr().out
  rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
  assert set(rows) == {"NHD", "HND"}
  for r in rows.values():
    assert r["kind"] == "shared_prefix" and r["status"] == "ok" and r["B"] == 5, r
    assert r["max_abs_diff"] < 1e-5, r
    assert r["plain_vs_cascade"] == pytest.approx(r["ms"]["plain"] / r["ms"]["cascade"])
    assert r["read_mib"]["plain"] > r["read_mib"]["cascade"]
  assert sum(ln.startswith("| 48 | 5 | 20 | HND | 16 |") for ln in printed.splitlines()) == 1
  bad = _write_config(tmp_path, "shared_prefix = 40\nshared_page_size = 16\n")
  assert decode_bench.main([bad]) == 2 and "whole pages" in capsys.readouterr().err
