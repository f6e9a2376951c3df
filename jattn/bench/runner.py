"""Running cases: guard, compile, check, warm up, then time every implementation interleaved.

Per case, each implementation is compiled ahead of time (``jax.jit(f).lower(*args).compile()``,
timed apart from running) and its compiled memory read from XLA's memory analysis. The first
call of each is checked against the reference implementation's output (max |difference| over
the output and, forward+backward, the three gradients). Then ``warmup`` untimed calls each, and
``repeats`` rounds in which every implementation runs once, in turn (A B A B ...), so that a
slow period of a shared machine hits all of them alike; cases that a ``[[compare]]`` puts side by
side run in the same rounds too. Each call ends in ``block_until_ready``, and each timed call
starts only once the process is idle again (`settle`). A failure (out of memory, unsupported,
any error) becomes the row's status and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn.bench import impls as _impls
from jattn.bench import masks as _masks
from jattn.bench import structure as _structure
from jattn.bench import torch_peer as _torch_peer
from jattn.bench.config import Case, Impl

GIB = 1024**3

# Every row carries every field (None where it does not apply), in this order (also the CSV's).
ROW_FIELDS = (
  "case_index",
  "pass",
  "dtype",
  "mask",
  "B",
  "N",
  "K",
  "H",
  "T",
  "S",
  "impl",
  "block_q",
  "block_kv",
  "status",
  "reason",
  "note",
  "compile_s",
  "time_median_s",
  "time_min_s",
  "time_max_s",
  "time_p25_s",
  "time_p75_s",
  "spread_pct",
  "repeats",
  "warmup",
  "times_s",
  "flops",
  "flops_per_s",
  "peak_fraction",
  "temp_bytes",
  "argument_bytes",
  "output_bytes",
  "memory_estimate_bytes",
  "baseline",
  "speedup_vs_baseline",
  "temp_vs_baseline",
  "max_abs_diff",
  "diff_reference",
  "platform",
  "loop_steps",
  "loops",
  "ops_per_step",
  "program_flops",
  "work_vs_ideal",
)
STATUSES = ("ok", "compiled", "skipped", "unsupported", "oom", "error")


def settle(
  max_wait_s: float = 3.0,
  interval_s: float = 0.02,
  busy_s: float = 0.002,
  *,
  cpu_time: Callable[[], float] = time.process_time,
  clock: Callable[[], float] = time.perf_counter,
  sleep: Callable[[float], None] = time.sleep,
) -> bool:
  """Wait until this process has stopped using CPU time; True once idle, False at the deadline.

  XLA hands a call's large buffers back to the system after ``block_until_ready`` has returned:
  measured here, jax.nn's 4 GiB of (T, S) scores at T = 8192 take about 0.3 s of munmap in a
  background thread. Without this wait that work lands in the time of whichever implementation
  runs next (in a round, the one after the baseline). It is then billed to no one, which favours
  the implementations that allocate most -- the conservative direction for jattn's ratios.

  Idle means: less than ``busy_s`` of CPU time over one ``interval_s`` sleep. ``cpu_time`` must
  count every thread of the process (``time.process_time``: the freeing runs in a background
  thread); ``cpu_time``, ``clock`` and ``sleep`` are parameters so tests can drive it with fakes.
  """
  deadline = clock() + max_wait_s
  last = cpu_time()
  while clock() < deadline:
    sleep(interval_s)
    now = cpu_time()
    if now - last < busy_s:
      return True
    last = now
  return False


@dataclasses.dataclass
class Context:
  """What every case of a sweep shares."""

  max_memory_bytes: int
  baseline: str
  seed: int
  backend: str
  peak_flops: dict[str, float]  # dtype -> measured matmul FLOP/s
  compile_only: bool = False
  # Lower for this platform ("cuda", "tpu") with jax.export and report its structure without
  # running it; None: this machine's backend.
  platform: str | None = None
  torch_peer: _torch_peer.TorchPeer | None = None
  progress: Callable[[str], None] = lambda text: None


def measure_matmul_peak(dtype: str, n: int, repeats: int = 5) -> dict[str, Any]:
  """FLOP/s of an (n, n) @ (n, n) matmul in ``dtype``: the machine's practical ceiling.

  Median of ``repeats`` calls after one warm-up; 2 n^3 FLOPs per call.
  """
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32)).astype(dtype)
  b = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32)).astype(dtype)
  compiled = jax.jit(jnp.matmul).lower(a, b).compile()
  jax.block_until_ready(compiled(a, b))
  samples = []
  for _ in range(repeats):
    settle()
    start = time.perf_counter()
    jax.block_until_ready(compiled(a, b))
    samples.append(time.perf_counter() - start)
  median = statistics.median(samples)
  return {"dtype": dtype, "n": n, "flops_per_s": 2.0 * n**3 / median, "times_s": samples}


def new_row(case: Case, index: int, impl: Impl, baseline: str) -> dict[str, Any]:
  row = dict.fromkeys(ROW_FIELDS)
  row.update(case.fields())
  row.update(
    case_index=index,
    impl=impl.label,
    repeats=case.repeats,
    warmup=case.warmup,
    flops=case.flops,
    baseline=baseline,
    note="",
  )
  if impl.block_q is not None:
    # The kernel clips blocks to the sequence: record what ran.
    assert impl.block_kv is not None  # config sets a chunked Impl's two block sizes together
    row.update(block_q=min(impl.block_q, case.T), block_kv=min(impl.block_kv, case.S))
  return row


def classify(error: BaseException) -> tuple[str, str]:
  """(status, reason) of a failed implementation."""
  text = " ".join(f"{type(error).__name__}: {error}".split())
  if len(text) > 500:
    text = text[:500] + " ..."
  if isinstance(error, (NotImplementedError, _impls.Unsupported)):
    return "unsupported", text
  if (
    isinstance(error, MemoryError)
    or getattr(error, "oom", False)
    or "RESOURCE_EXHAUSTED" in text
    or "out of memory" in text.lower()
  ):
    return "oom", text
  return "error", text


def compiled_memory(compiled) -> dict[str, int] | None:
  """XLA's memory analysis of a compiled function: temp_bytes (the intermediates), argument_bytes
  and output_bytes; None where the backend does not implement it."""
  try:
    stats = compiled.memory_analysis()
  except Exception:
    return None
  if stats is None:
    return None
  return {
    "temp_bytes": int(stats.temp_size_in_bytes),
    "argument_bytes": int(stats.argument_size_in_bytes),
    "output_bytes": int(stats.output_size_in_bytes),
  }


class _JaxRunner:
  def __init__(self, impl: Impl, case: Case, args: tuple, row: dict, platform: str | None = None):
    self.impl, self.case, self.args, self.row = impl, case, args, row
    self.platform = platform
    self.compiled: jax.stages.Compiled | None = None

  def prepare(self):
    attn, note = _impls.attention_fn(self.impl, self.case)
    self.row["note"] = note
    fn = _impls.pass_fn(attn, self.case.pass_)
    start = time.perf_counter()
    with _impls.trace_context(self.impl):
      if self.platform is None:
        self.compiled = jax.jit(fn).lower(*self.args).compile()
      else:
        # The program an accelerator would get, exported from here and compiled for this CPU
        # (jax.export): its loops are the accelerator program's; it is never timed.
        exp = jax.export.export(
          jax.jit(fn),
          platforms=[self.platform],
          disabled_checks=[jax.export.DisabledSafetyCheck.platform()],
        )(*self.args)
        self.compiled = jax.jit(exp.call).lower(*self.args).compile()
    self.row["compile_s"] = time.perf_counter() - start
    memory = compiled_memory(self.compiled)
    if memory is not None:
      self.row.update(memory)
    text = self.compiled.as_text()
    assert text is not None  # XLA's CPU, GPU and TPU executables all print their HLO
    st = _structure.loop_structure(text)
    # The work the program does (its matmuls, loop trip counts multiplied through) against the
    # case's FLOPs (visible pairs only): what masked or padding tiles cost it.
    program = _structure.matmul_flops(text)
    self.row.update(
      platform=self.platform or jax.default_backend(),
      loop_steps=st.steps,
      loops=st.loops,
      ops_per_step=st.ops_per_step,
      program_flops=program,
      work_vs_ideal=None if not program or not self.row["flops"] else program / self.row["flops"],
    )

  def measured_bytes(self) -> int | None:
    if self.row["temp_bytes"] is None:
      return None
    return self.row["temp_bytes"] + self.row["argument_bytes"] + self.row["output_bytes"]

  def call(self, keep: bool):
    assert self.compiled is not None, "call() after prepare() and before close()"
    start = time.perf_counter()
    out = jax.block_until_ready(self.compiled(*self.args))
    elapsed = time.perf_counter() - start
    return elapsed, (out if keep else None)

  def close(self):
    self.compiled = None


class _TorchRunner:
  def __init__(self, peer: _torch_peer.TorchPeer, case: Case, seed: int, backend: str, row):
    self.peer, self.case, self.seed, self.backend, self.row = peer, case, seed, backend, row

  def prepare(self):
    fields = self.case.fields()
    m = self.case.mask
    fields.update(
      causal=m.causal, window=None if m.window is None else list(m.window), segments=m.segments
    )
    self.row["note"] = self.peer.setup(fields, self.seed, self.backend)["note"]

  def measured_bytes(self):
    return None

  def call(self, keep: bool):
    return self.peer.run(), None

  def close(self):
    pass


def _max_abs_diff(a, b) -> float:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  diffs = [
    jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
    for x, y in zip(leaves_a, leaves_b, strict=True)
  ]
  return float(max(diffs))


def run_case(case: Case, index: int, ctx: Context) -> list[dict[str, Any]]:
  """All rows of one case (one per implementation), in the config's implementation order."""
  return run_group([case], [index], ctx)[0]


@dataclasses.dataclass
class _Entry:
  """One (case, implementation) pair of a group: its row, its runner, its timings."""

  case: Case
  impl: Impl
  row: dict
  runner: Any = None
  times: list = dataclasses.field(default_factory=list)


def run_group(cases: list[Case], indices: list[int], ctx: Context) -> list[list[dict[str, Any]]]:
  """Run cases together: every (case, implementation) pair is timed in the same rounds.

  A group is the cases a ``[[compare]]`` sets side by side (causal and full of one shape, say):
  interleaving them too keeps their ratio free of the load drift between cases. Returns each
  case's rows, in the config's implementation order.
  """
  entries = []  # in run order: per case, the baseline first (it is the output check's reference)
  for case, index in zip(cases, indices, strict=True):
    for impl in sorted(case.impls, key=lambda i: i.name != ctx.baseline):
      entries.append(_Entry(case, impl, new_row(case, index, impl, ctx.baseline)))
  inputs = {case: _impls.make_inputs(case, ctx.seed) for case in cases}

  ready = []
  for e in entries:
    if _prepare(e, inputs[e.case], ctx):
      ready.append(e)

  # The output check, per case: the first implementation to run is the reference.
  references: dict[Case, tuple[str, Any]] = {}  # case -> (label, output) of its reference
  empty_rows = {
    case: bool((_masks.visible_per_query(case.T, case.S, case.mask) == 0).any()) for case in cases
  }

  def checked_call(e, timed):
    elapsed, out = e.runner.call(keep=True)
    if out is not None and not empty_rows[e.case]:
      ref = references.setdefault(e.case, (e.impl.label, out))
      if ref[0] != e.impl.label:
        e.row.update(max_abs_diff=_max_abs_diff(out, ref[1]), diff_reference=ref[0])
    if timed:
      e.times.append(elapsed)

  def fail(e, error):
    e.row["status"], e.row["reason"] = classify(error)
    e.runner.close()

  active = []
  for e in ready:
    if e.case.warmup == 0:  # the first timed call is the checked one
      active.append(e)
      continue
    ctx.progress(f"warming up {e.impl.label}")
    try:
      checked_call(e, timed=False)
      for _ in range(e.case.warmup - 1):
        e.runner.call(keep=False)
      active.append(e)
    except Exception as error:
      fail(e, error)

  rounds = max((e.case.repeats for e in active), default=0)
  for rep in range(rounds):
    ctx.progress(f"timing round {rep + 1}/{rounds}")
    still = []
    for e in active:
      if rep >= e.case.repeats:
        still.append(e)
        continue
      try:
        settle()
        if rep == 0 and e.case.warmup == 0:
          checked_call(e, timed=True)
        else:
          e.times.append(e.runner.call(keep=False)[0])
        still.append(e)
      except Exception as error:
        fail(e, error)
    active = still
  for e in active:
    e.row.update(status="ok", **_stats(e.times))
    e.runner.close()
    if empty_rows[e.case]:
      e.row["note"] = "; ".join(
        filter(
          None,
          [
            e.row["note"],
            "no output check: some queries see no key (implementations differ there by design)",
          ],
        )
      )
    e.row["flops_per_s"] = e.row["flops"] / e.row["time_median_s"]
    peak = ctx.peak_flops.get(e.case.dtype)
    e.row["peak_fraction"] = None if not peak else e.row["flops_per_s"] / peak

  result = []
  for case in cases:
    rows = {e.impl: e.row for e in entries if e.case is case}
    # The baseline is named as in the config ("jattn-chunked"), rows by label
    # ("jattn-chunked-512x512"): match the implementation's name; the first such entry.
    base = next((row for impl, row in rows.items() if impl.name == ctx.baseline), None)
    _ratios(list(rows.values()), base)
    result.append([rows[impl] for impl in case.impls])
  return result


def _prepare(e: _Entry, args: tuple, ctx: Context) -> bool:
  """Guard and compile one entry; False (with the row's status set) when it will not run."""
  row, case, impl = e.row, e.case, e.impl
  if impl.dense_memory:
    row["memory_estimate_bytes"] = case.dense_memory_estimate
    if case.dense_memory_estimate > ctx.max_memory_bytes:
      row.update(
        status="skipped",
        reason=(
          f"dense score estimate {case.dense_memory_estimate / GIB:.2f} GiB > max-memory "
          f"{ctx.max_memory_bytes / GIB:.2f} GiB"
        ),
      )
      return False
  if impl.name == "torch":
    if ctx.torch_peer is None:  # the CLI makes one whenever a case has a torch implementation
      row["status"], row["reason"] = "error", "no torch peer: the Context has torch_peer=None"
      return False
    e.runner = _TorchRunner(ctx.torch_peer, case, ctx.seed, ctx.backend, row)
  else:
    e.runner = _JaxRunner(impl, case, args, row, ctx.platform)
  ctx.progress(f"compiling {impl.label}")
  try:
    e.runner.prepare()
  except Exception as error:
    row["status"], row["reason"] = classify(error)
    return False
  measured = e.runner.measured_bytes()
  if measured is not None and measured > ctx.max_memory_bytes:
    row.update(
      status="skipped",
      reason=(
        f"compiled memory {measured / GIB:.2f} GiB > max-memory "
        f"{ctx.max_memory_bytes / GIB:.2f} GiB"
      ),
    )
    e.runner.close()
    return False
  if ctx.compile_only:
    row["status"] = "compiled"
    e.runner.close()
    return False
  return True


def _stats(samples: list[float]) -> dict[str, Any]:
  median = statistics.median(samples)
  p25, p75 = np.percentile(samples, [25, 75])
  return {
    "time_median_s": median,
    "time_min_s": min(samples),
    "time_max_s": max(samples),
    "time_p25_s": float(p25),
    "time_p75_s": float(p75),
    "spread_pct": 100.0 * (max(samples) - min(samples)) / median,
    "times_s": samples,
  }


def _ratios(rows: list[dict], base: dict | None):
  """speedup_vs_baseline = baseline median / row median (> 1: faster than the baseline) and
  temp_vs_baseline = row temp / baseline temp, for the rows of one case; ``base`` is the
  baseline's row (None when the case has none)."""
  if base is None:
    return
  for r in rows:
    if r["status"] == "ok" and base["status"] == "ok":
      r["speedup_vs_baseline"] = base["time_median_s"] / r["time_median_s"]
    if r["temp_bytes"] is not None and base["temp_bytes"]:
      r["temp_vs_baseline"] = r["temp_bytes"] / base["temp_bytes"]
