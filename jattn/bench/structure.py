"""The loop structure of a compiled program: how many sequential steps it runs, and how much
each step does, read from the optimized HLO (not from a formula).

On an accelerator every sequential loop step costs at least a few kernel launches, whatever its
tile holds, so the number of steps and the HLO ops per step say how a schedule will fare there
before it is ever run. `lowered_for` lowers a function for another platform (``"cuda"``,
``"tpu"``) with `jax.export` from this machine, and compiles the exported program for the CPU:
the loops are the ones the accelerator's program has (XLA keeps `while` loops and their known
trip counts), so they can be counted here.

Counting rules:
  * a ``while`` with a known trip count n runs n steps of its body; nested loops multiply
    (a q-block loop of 16 around a kv-block loop of 32 is 512 steps of the inner body);
  * loops one after another add up; a ``conditional`` counts its most expensive branch;
  * a ``while`` without a known trip count (bounds computed at run time) makes the total
    unknown (None);
  * a ``while`` that XLA made out of one scatter, gather or sort (its metadata names that op)
    is not a loop of the program: XLA's CPU backend expands those into loops where a GPU or TPU
    has one kernel (with ``--xla_cpu_use_fusion_emitters=false`` it does so for every
    scatter), so it counts as one op;
  * ops per step: the instructions of the innermost loop body, a fusion counting as one (each is
    about one kernel launch on a GPU), parameters, constants, tuples and get-tuple-element not
    counted.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([\w\-]+)\(")
_TRIP = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')
_BODY = re.compile(r"body=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CALLS = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")
# The last component of a while's op_name metadata when XLA expanded one op into a loop.
_EXPANDED = re.compile(r'op_name="(?:[^"]*/)?(?:scatter|gather|sort)[\w\-]*"')
_FREE = {
  "parameter",
  "constant",
  "tuple",
  "get-tuple-element",
  "bitcast",
  "copy-start",
  "copy-done",
  "opt-barrier",
}


@dataclasses.dataclass(frozen=True)
class LoopStructure:
  """steps: sequential loop steps of one call (None if a trip count is only known at run time);
  loops: number of while loops; ops_per_step: instructions of the innermost loop body;
  ops: instructions of the whole program (outside fusions)."""

  steps: int | None
  loops: int
  ops_per_step: int
  ops: int


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  comps: dict[str, list[str]] = {}
  entry, name = None, None
  for line in hlo.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      name = m.group(1)
      comps[name] = []
      if line.lstrip().startswith("ENTRY"):
        entry = name
      continue
    if line.strip() == "}":
      name = None
      continue
    if name is not None and "=" in line:
      comps[name].append(line)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry


def _opcode(line: str) -> str | None:
  m = _INSTRUCTION.match(line)
  return m.group(1) if m else None


def _runs_computations(line: str):
  """The computations an instruction runs as such: ("while", [body], trip count or None),
  ("conditional", branches, None), ("call", [callee], None); None for any other instruction."""
  op = _opcode(line)
  if op == "while":
    if _EXPANDED.search(line):
      return None
    trip = _TRIP.search(line)
    body = _BODY.search(line)
    assert body is not None, line  # HLO prints every while with its body=
    return op, [body.group(1)], None if trip is None else int(trip.group(1))
  if op == "conditional":
    m = _BRANCHES.search(line)
    return op, [c.strip().lstrip("%") for c in m.group(1).split(",")] if m else [], None
  if op in ("call", "async-start"):
    m = _CALLS.search(line)
    return "call", [m.group(1)] if m else [], None
  return None


def loop_structure(hlo: str) -> LoopStructure:
  """The `LoopStructure` of optimized HLO text (``jax.jit(f).lower(...).compile().as_text()``)."""
  comps, entry = _computations(hlo)
  loops = 0
  memo: dict[str, tuple[int | None, int]] = {}

  def walk(name: str) -> tuple[int | None, int]:
    """(steps, ops of the innermost body) of computation ``name``; steps 0 without loops."""
    if name in memo:
      return memo[name]
    nonlocal loops
    total: int | None = 0
    inner_ops = 0
    for line in comps.get(name, ()):
      called = _runs_computations(line)
      if called is None:
        continue
      op, callees, trip = called
      results = [walk(c) for c in callees]
      if op == "while":
        loops += 1
        ((steps, ops),) = results
        body_ops = ops if steps else _count_ops(comps.get(callees[0], ()))
        if trip is None or steps is None or total is None:
          total = None
        else:
          total += trip * max(steps, 1)
        inner_ops = max(inner_ops, body_ops)
        continue
      # A conditional counts its most expensive branch; a call its callee.
      branch_steps = [r[0] for r in results if r[0] is not None]
      if len(branch_steps) < len(results):
        total = None
      elif total is not None and branch_steps:
        total += max(branch_steps)
      inner_ops = max([inner_ops] + [r[1] for r in results])
    memo[name] = (total, inner_ops)
    return memo[name]

  steps, ops_per_step = walk(entry)
  # The program's own instructions: the entry and every computation it runs as such (loop
  # bodies, branches, calls), not fusion bodies or reducers (parts of one instruction).
  return LoopStructure(
    steps=steps,
    loops=loops,
    ops_per_step=ops_per_step,
    ops=sum(_count_ops(comps.get(n, ())) for n in memo),
  )


def _count_ops(lines) -> int:
  return sum(1 for line in lines if (_opcode(line) or "parameter") not in _FREE)


def lowered_for(fn, args, platform: str | None = None):
  """Compiled text of ``jax.jit(fn)`` on ``args`` (arrays or ShapeDtypeStructs), lowered for
  ``platform`` (None: this machine; ``"cuda"``/``"tpu"``: exported with `jax.export` for that
  platform, then compiled here with the platform check disabled)."""
  import jax
  from jax import export

  if platform is None:
    return jax.jit(fn).lower(*args).compile().as_text()
  exp = export.export(
    jax.jit(fn), platforms=[platform], disabled_checks=[export.DisabledSafetyCheck.platform()]
  )(*args)
  return jax.jit(exp.call).lower(*args).compile().as_text()


# One collective of a compiled SPMD program: "%x = f32[2,1024,2,32]{...} all-gather(...)", or a
# tuple of shapes (several arrays combined into one op, or an async "-start" pair).
_COLLECTIVE = re.compile(
  r"=\s*(.+?)\s(all-gather|all-reduce|reduce-scatter|all-to-all|"
  r"collective-permute)(-start)?\("
)
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_ITEMSIZE = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op of a partitioned program: its kind, the per-device shapes it produces
  (several for a combined op), their bytes, and how many times one call runs it (the product of
  its enclosing loops' trip counts; None when one of them is only known at run time)."""

  kind: str
  shapes: tuple[tuple[int, ...], ...]
  bytes: int
  runs: int | None = 1

  @property
  def bytes_per_call(self) -> int | None:
    return None if self.runs is None else self.bytes * self.runs


def _runs_per_computation(comps, entry) -> dict[str, int | None]:
  """How many times one call runs each computation reachable from the entry (loop bodies and
  conditions times their trip counts, branches and calls as often as their caller)."""
  runs: dict[str, int | None] = {entry: 1}
  todo = [entry]
  while todo:
    name = todo.pop()
    for line in comps.get(name, ()):
      called = _runs_computations(line)
      if called is None:
        continue
      op, callees, trip = called
      mult = runs[name]
      if op == "while":
        mult = None if trip is None or mult is None else mult * trip
      for callee in callees:
        if callee not in runs:
          runs[callee] = mult
          todo.append(callee)
  return runs


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[a-z]+\d*\[([\d,]*)\]")
_DOT = re.compile(r"\sdot\(%?([\w.\-]+),")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_FUSION_CALLS = re.compile(r"\scalls=%?([\w.\-]+)")


def matmul_flops(hlo: str) -> int | None:
  """The floating-point operations of every matmul (``dot``) one call of the program runs:
  2 x output elements x contracted length per dot, times how often its computation runs (loop
  trip counts multiplied through, fusion bodies as often as the fusion). None when a dot sits
  under a loop whose trip count is only known at run time.

  The work a schedule does, read from the program it compiles to: a tile computed fully masked
  (a lane's padding step) costs its matmuls like any other, so this is the number to compare
  with a mask's ideal (its non-empty tiles' matmuls)."""
  comps, entry = _computations(hlo)
  runs = _runs_per_computation(comps, entry)
  # Fusion bodies run as often as the instruction that calls them.
  todo = [n for n in runs]
  while todo:
    name = todo.pop()
    for line in comps.get(name, ()):
      if _opcode(line) == "fusion":
        m = _FUSION_CALLS.search(line)
        if m and m.group(1) not in runs:
          runs[m.group(1)] = runs[name]
          todo.append(m.group(1))
  total = 0
  for name, lines in comps.items():
    if name not in runs:
      continue
    shapes = {}
    for line in lines:
      d = _DEF.match(line)
      if d:
        shapes[d.group(1)] = tuple(int(x) for x in d.group(2).split(",") if x)
    for line in lines:
      m = _DOT.search(line)
      if not m or _opcode(line) != "dot":
        continue
      out_def = _DEF.match(line)
      dims = _LHS_CONTRACTING.search(line)
      # A dot defines one array and HLO prints its lhs_contracting_dims (even when empty).
      assert out_def is not None and dims is not None, line
      out = shapes[out_def.group(1)]
      lhs = shapes[m.group(1)]
      contracting = [int(x) for x in dims.group(1).split(",") if x]
      times = runs[name]
      if times is None:
        return None
      total += (
        2
        * int(np.prod(out, dtype=np.int64))
        * int(np.prod([lhs[a] for a in contracting], dtype=np.int64))
        * times
      )
  return total


def collectives(hlo: str) -> list[Collective]:
  """The collectives of a compiled (partitioned) HLO text, with per-device shapes and how many
  times one call runs each (a collective inside a loop body runs once per step)."""
  comps, entry = _computations(hlo)
  runs = _runs_per_computation(comps, entry)
  size = lambda dtype, shape: _ITEMSIZE.get(dtype, 4) * int(np.prod(shape, dtype=np.int64))
  found = []
  for name, lines in comps.items():
    if name not in runs:
      continue  # fusion bodies, reducers: parts of one instruction, not run on their own
    for line in lines:
      m = _COLLECTIVE.search(line)
      if not m:
        continue
      parts = [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _SHAPE.findall(m.group(1))
      ]
      if m.group(3):
        # An async "-start" returns (operand, result[, scratch]): the result is what moved.
        parts = parts[1:2]
      found.append(
        Collective(
          m.group(2),
          tuple(shape for _, shape in parts),
          sum(size(d, sh) for d, sh in parts),
          runs[name],
        )
      )
  return found


def query_sized(colls, B: int, T: int, N: int, H: int) -> list[Collective]:
  """The collectives that move a whole query- or output-sized array of a (B, T, N, H) call (or
  its (B, T, N) softmax statistics), in any layout: as many elements, one dimension the whole
  length T or a multiple of it (T merged with heads, as in (B, K, G * T)). A sequence-sharded
  call with such a collective gathered its query or reduced its output: every device did the
  whole call's work. (Ambiguous when K = N: a gathered K or V is as large
  as the query; use GQA inputs to tell them apart.)"""
  sizes = {B * T * N * H, B * T * N}
  return [
    c
    for c in colls
    if any(
      int(np.prod(s, dtype=np.int64)) in sizes and any(d % T == 0 for d in s if d) for s in c.shapes
    )
  ]
