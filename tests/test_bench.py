"""The benchmark CLI: tiny sweeps end to end, FLOP counts against hand counts, the memory guard."""

import csv
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cli, config, flops, masks, runner, torch_peer

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
  assert {(r["pass"], r["T"]) for r in rows} == {("forward", 64), ("forward", 128),
                                                 ("forward+backward", 64)}
  for r in rows:
    assert tuple(r) == runner.ROW_FIELDS
    assert r["status"] == "ok", r
    assert r["impl"] in _JAX_IMPLS | {"torch"}
    assert isinstance(r["compile_s"], float) and r["compile_s"] > 0 or r["impl"] == "torch"
    times = r["times_s"]
    assert len(times) == r["repeats"] == 2 and all(t > 0 for t in times)
    assert r["time_min_s"] <= r["time_p25_s"] <= r["time_median_s"] <= r["time_p75_s"] \
        <= r["time_max_s"]
    assert r["time_median_s"] == pytest.approx(float(np.median(times)))
    assert r["flops"] == pytest.approx(flops.attention_flops(
        1, 4, r["T"], r["T"], 16, masks.parse("causal"), r["pass"]))
    assert r["flops_per_s"] == pytest.approx(r["flops"] / r["time_median_s"])
    assert r["peak_fraction"] == pytest.approx(
        r["flops_per_s"] / result["peak"]["float32"]["flops_per_s"])
    assert r["speedup_vs_baseline"] > 0 and r["baseline"] == "jax-nn"
    if r["impl"] in _JAX_IMPLS:
      for key in ("temp_bytes", "argument_bytes", "output_bytes"):
        assert isinstance(r[key], int) and r[key] >= 0
      assert r["argument_bytes"] > 0
    if r["impl"] in ("jax-nn", "torch"):
      assert r["max_abs_diff"] is None  # jax-nn is the reference; torch outputs stay in its process
    else:
      assert r["diff_reference"] == "jax-nn"
      assert 0 <= r["max_abs_diff"] < 1e-5, r
  for r in rows:
    if r["impl"] == "jax-nn":
      assert r["speedup_vs_baseline"] == 1.0
    if r["impl"] == "flax":
      assert "repeated 2x" in r["note"]  # GQA (N=4, K=2): flax needs k/v heads repeated


def test_quick_result_describes_the_machine(quick):
  result, _, _ = quick
  m = result["machine"]
  for key in ("jax", "jaxlib", "backend", "devices", "cpu_count", "platform", "timestamp_utc",
              "env", "python"):
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
  ctx = runner.Context(max_memory_bytes=2 ** 30, baseline="jax-nn", seed=0, backend="cpu",
                       peak_flops={}, torch_peer=peer)
  try:
    (row,) = runner.run_case(case, 0, ctx)
  finally:
    peer.close()
  assert row["status"] == "error" and "import torch failed" in row["reason"], row
  assert row["time_median_s"] is None


def test_settle_waits_for_background_cpu_work():
  import threading
  import time

  def burn(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
      pass

  start = time.perf_counter()
  runner.settle()
  assert time.perf_counter() - start < 1.0  # an idle process returns at once

  worker = threading.Thread(target=burn, args=(0.5,))
  worker.start()
  start = time.perf_counter()
  runner.settle(max_wait_s=5.0)
  waited = time.perf_counter() - start
  worker.join()
  assert waited >= 0.4, waited  # not timed until the background work is done


def test_quick_writes_csv_markdown_and_plots(quick):
  result, out, plots = quick
  (csv_path,) = out.glob("*.csv")
  with open(csv_path, newline="") as f:
    reader = csv.DictReader(f)
    assert tuple(reader.fieldnames) == runner.ROW_FIELDS
    table = list(reader)
  assert len(table) == len(result["rows"])
  assert [float(x) for x in table[0]["times_s"].split(";")] == pytest.approx(
      result["rows"][0]["times_s"], rel=1e-5)
  (md,) = out.glob("*.md")
  assert md.read_text().count("\n| forward") == len(result["rows"])
  pngs = sorted(plots.glob("*.png"))
  assert len(pngs) == 2  # one figure per (pass, dtype, mask, shape) group
  assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


# ------------------------------------------------- masks through every implementation, compared

def test_masks_reach_every_implementation_alike(tmp_path):
  # T != S, bottom-right causal, an asymmetric window, packed segments and MQA: the forms that go
  # to jax.nn and flax as boolean arrays; a symmetric window goes to jax.nn natively.
  combined = "causal:bottom_right+window:8,4+segments:2"
  path = _write_config(tmp_path, f"""
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
""")
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
  path = _write_config(tmp_path, """
repeats = 1
peak_matmul_size = 64
implementations = ["jattn-dense", "jax-nn", "jattn-chunked"]
block_sizes = [[64, 64]]
passes = ["forward"]
heads = [1]
head_dim = [8]
T = [256, 4096]
""")
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

@pytest.mark.parametrize("T,S,spec,pairs", [
    (8, 8, "full", 64),
    (8, 8, "causal", 36),                            # 1 + 2 + ... + 8
    (4, 6, "causal", 10),                            # top-left: rows see 1, 2, 3, 4
    (6, 4, "causal", 4 * 6 - 6),                     # rows see 1, 2, 3, 4, 4, 4
    (4, 6, "causal:bottom_right", 18),               # rows see 3, 4, 5, 6
    (6, 4, "causal:bottom_right", 10),               # rows 0, 1 see nothing; then 1, 2, 3, 4
    (6, 6, "causal+window:2", 15),                   # rows see 1, 2, 3, 3, 3, 3
    (5, 5, "window:1", 13),                          # rows see 2, 3, 3, 3, 2
    (6, 6, "window:2,0", 15),                        # the same as causal+window:2
    (4, 4, "segments:2", 8),                         # two 2 x 2 blocks
    (4, 4, "causal+segments:2", 6),                  # two 2 x 2 lower triangles
    (4, 8, "segments:2", 16),                        # 2 queries x 4 keys, twice
])
def test_visible_pairs_hand_counts(T, S, spec, pairs):
  assert masks.visible_pairs(T, S, masks.parse(spec)) == pairs


@pytest.mark.parametrize("T,S,spec", [
    (37, 53, "causal+window:5,3"), (53, 37, "causal:bottom_right+window:4"),
    (40, 40, "segments:3+window:6"), (29, 64, "causal:bottom_right+segments:5"),
])
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
  assert flops.attention_flops(B, N, T, S, H, masks.parse("full"), "forward+backward") \
      == 3.5 * full  # seven matmuls with the recomputed P
  causal = flops.attention_flops(B, N, 16, 16, H, masks.parse("causal"), "forward")
  assert causal == 4 * B * N * H * (16 * 17 // 2)
  assert flops.dense_memory_estimate(B, N, T, S, "forward+backward") == B * N * T * S * 4 * 4
  with pytest.raises(ValueError, match="pass must be one of"):
    flops.attention_flops(B, N, T, S, H, masks.parse("full"), "backward")


# ------------------------------------------------------------------------- configs and arguments

@pytest.mark.parametrize("text,message", [
    ("T = [8]\nrepeat = 3", "unknown key"),
    ("T = [8]\nmasks = ['causal+windw:4']", "unknown part 'windw:4'"),
    ("T = [8]\nheads = [4]\nkv_heads = [3]", "kv_heads=3 does not divide heads=4"),
    ("T = [8]\nimplementations = ['jattn']", "unknown 'jattn'"),
    ("T = [8]\nblock_sizes = [[0, 8]]", "block_sizes"),
    ("masks = ['full']", "'T'"),
    ("T = 8", "must be a list"),
])
def test_bad_configs_name_the_key(tmp_path, text, message):
  with pytest.raises(config.ConfigError, match=message):
    config.load(_write_config(tmp_path, text))


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
  assert math.isclose(float(lines[0].split(": ")[1].split()[0]),
                      flops.attention_flops(1, 4, 64, 64, 16, masks.parse("causal"),
                                            "forward") / 1e9, rel_tol=1e-3)


def test_compared_cases_are_grouped_to_run_together():
  cfg = config.parse({"T": [8, 16], "masks": ["full", "causal"], "passes": ["forward"],
                      "compare": [{"field": "mask", "values": ["causal", "full"]}]})
  groups = cli._groups(list(cfg.cases), cfg.compare)
  assert [[(c.T, c.mask.name) for _, c in g] for g in groups] == [
      [(8, "full"), (8, "causal")], [(16, "full"), (16, "causal")]]
  assert [len(g) for g in cli._groups(list(cfg.cases), ())] == [1, 1, 1, 1]
