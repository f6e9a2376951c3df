"""The feature matrix on one device: every implementation x every option (tests/support/matrix.py),
each in one of four modes -- float32, under x64 (float64 inputs, and float32 inputs in an x64
process), exported by `jax.export` with a symbolic batch -- and every mode taken by every
implementation and every option; forward and gradients against the float64 reference, or a
NotImplementedError naming the implementation where a platform-bound kernel (splash, cuDNN) cannot
take the call. jattn's own implementations (and None) must take every case.

Not the full product of implementations x options x modes: a covering design (`DESIGN`) that
runs every (implementation, option) pair and holds every pair of values of two factors:

- jattn's own implementations and None (they lower for every platform): each option once, the
  modes rotated over the implementations (a Latin square), so every option runs in every mode
  and every implementation in every mode, each on about a quarter of the options;
- splash, which a CPU runs in Pallas's TPU interpret mode: every option exported with a
  symbolic batch (traced with it, then refused by name when lowered for the CPU without the
  interpret mode), and in float32 every option it refuses (refused by name) and the rest run
  against the float64 reference -- except SPLASH_ELSEWHERE, the options
  tests/backends/test_splash.py runs against float64 on shapes padded to whole 128-blocks (two
  to three seconds each in interpret mode: not twice); not under x64 (float64 is refused);
- the kernels that only refuse on a CPU (cuDNN, the Pallas GPU kernel outside its interpret
  mode): each option once (the refusals an option causes) and the plain call in every mode (the
  refusals a dtype causes).

The same matrix under meshes (Auto and Explicit; batch-, head- and sequence-sharded) runs in
tests/parallel/test_matrix_sharded.py.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import matrix
import numpy as np
import pytest

IMPLS = matrix.implementations()
MODES = {
  # mode: (input dtype, x64 on, tolerance)
  "f32": (np.float32, False, 1e-4),
  "x64-f64": (np.float64, True, 1e-9),
  "x64-f32": (np.float32, True, 1e-4),
  "export-symbolic-batch": (np.float32, False, 1e-4),
}
EXPORT = "export-symbolic-batch"
# Splash runs in Pallas's TPU interpret mode (the float32 cases), whose time grows with examples
# x heads: on the first half of the heads, and of the examples where the option has no arrays.
# Examples and heads are independent, so the result is the full problem's for those: N = 4
# query heads on K = 2 key/value heads keeps GQA (G = 2) and more than one key/value head,
# B = 2 more than one example (splash loops over examples x key/value heads). All examples stay
# where an option has arrays: those per example hold the cases that need four (lengths, segment
# ids), and the gradient of one shared by the examples (the sinks) sums over all of them; all
# heads where it differentiates an array that has no head dimension.


def _splash_cut(option):
  """The part of the problem splash runs: {dimension letter: size}."""
  opt = matrix.OPTIONS[option]
  sizes = {} if opt.arrays else dict(B=matrix.B // 2)
  if all("N" in opt.arrays[d][1] for d in opt.diff):
    sizes.update(N=matrix.N // 2, K=matrix.K // 2)
  return sizes


# The options splash takes that tests/backends/test_splash.py's cases run against float64
# (causal and causal-window: top-left and bottom-right with a window; the lengths with empty
# rows; segment ids; mask objects; soft cap; sinks).
SPLASH_ELSEWHERE = frozenset(
  {"causal", "causal-window", "lengths", "segment-ids", "mask-object", "soft-cap", "sinks"}
)


def _design() -> list[tuple[str, str, str]]:
  """(implementation, option, mode) rows: see the module's docstring."""
  options, modes = list(matrix.OPTIONS), list(MODES)
  own = [i for i in IMPLS if matrix.platform_of(i) is None]
  refusing = [i for i in IMPLS if matrix.platform_of(i) is not None and i != "splash"]
  rows = matrix.rotation(options, own, modes)
  rows += [
    ("splash", option, mode)
    for option in options
    for mode in ("f32", EXPORT)
    if mode == EXPORT or option not in SPLASH_ELSEWHERE
  ]
  for i, impl in enumerate(refusing):
    mine = [(impl, option, modes[(i + o) % len(modes)]) for o, option in enumerate(options)]
    rows += mine + [(impl, "plain", m) for m in modes if (impl, "plain", m) not in mine]
  return rows


DESIGN = _design()


@functools.cache
def _reference(option):
  return matrix.reference(option)


def _context(impl, mode):
  stack = contextlib.ExitStack()
  if MODES[mode][1]:
    stack.enter_context(jax.enable_x64(True))
  if impl == "splash" and mode != EXPORT:
    # On a CPU splash runs in Pallas's TPU interpret mode; exported for the CPU without it, it
    # must refuse by name.
    from jax.experimental.pallas import tpu as pltpu

    stack.enter_context(pltpu.force_tpu_interpret_mode())
  return stack


def _symbolic(x, letters, b):
  shape = tuple(b if letter == "B" else d for d, letter in zip(x.shape, letters))
  return jax.ShapeDtypeStruct(shape, x.dtype)


def _cut(x, letters, sizes):
  """``x`` (dimension letters ``letters``) cut to the first ``sizes[letter]`` entries along each
  dimension named in ``sizes``."""
  return x[tuple(slice(sizes.get(letter)) for letter in letters)]


def _letters(option):
  return {name: spec[1] for name, spec in matrix.OPTIONS[option].arrays.items()}


def run(impl, option, mode):
  """(out, grads) of the case, or the NotImplementedError it raises."""
  dtype, _, _ = MODES[mode]
  q, k, v, do = matrix.inputs(dtype)
  arrays = matrix.option_arrays(option, dtype)
  letters = _letters(option)
  if impl == "splash":
    sizes = _splash_cut(option)
    layouts = ("BTNH", "BSKH", "BSKH", "BTNH")
    q, k, v, do = (_cut(x, lt, sizes) for x, lt in zip((q, k, v, do), layouts))
    arrays = {n: _cut(x, letters[n], sizes) for n, x in arrays.items()}
  f = matrix.loss_and_grads(IMPLS[impl], option)
  if mode != EXPORT:
    return jax.jit(f)(q, k, v, do, arrays)
  (b,) = jax.export.symbolic_shape("b")
  specs = [_symbolic(x, "BTNH", b) for x in (q, k, v, do)]
  specs.append({n: _symbolic(x, letters[n], b) for n, x in arrays.items()})
  exported = jax.export.export(jax.jit(f))(*specs)
  return exported.call(q, k, v, do, arrays)


def _splash_reference(option):
  """The float64 reference of the part of the problem splash runs."""
  out, grads = _reference(option)
  letters = {"dq": "BTNH", "dk": "BSKH", "dv": "BSKH", **_letters(option)}
  sizes = _splash_cut(option)
  return _cut(out, "BTNH", sizes), {g: _cut(x, letters[g], sizes) for g, x in grads.items()}


def test_the_design_holds_every_pair():
  rows = set(DESIGN)
  assert len(rows) == len(DESIGN)
  # Every implementation takes (or refuses) every option.
  assert {(i, o) for i, o, _ in rows} == {(i, o) for i in IMPLS for o in matrix.OPTIONS}
  # Every implementation runs in every mode it has (splash: not under x64).
  want = {(i, m) for i in IMPLS for m in MODES if not (i == "splash" and m.startswith("x64"))}
  assert {(i, m) for i, _, m in rows} == want
  # Every option runs in every mode on jattn's own kernels; splash takes each in float32 but
  # those test_splash.py runs against float64 (names of options that exist).
  own = {i for i in IMPLS if matrix.platform_of(i) is None}
  assert {(o, m) for i, o, m in rows if i in own} == {(o, m) for o in matrix.OPTIONS for m in MODES}
  assert SPLASH_ELSEWHERE < set(matrix.OPTIONS)
  splash_f32 = {o for i, o, m in rows if i == "splash" and m == "f32"}
  assert splash_f32 == set(matrix.OPTIONS) - SPLASH_ELSEWHERE


@pytest.mark.parametrize("impl,option,mode", DESIGN, ids=["-".join(r) for r in DESIGN])
def test_matrix(impl, option, mode):
  with _context(impl, mode):
    try:
      out, grads = run(impl, option, mode)
    except NotImplementedError as e:
      assert matrix.platform_of(impl) is not None, (
        f"{impl} must take every option; refused {option} ({mode}): {e}"
      )
      assert impl in str(e), f"the refusal does not name the implementation: {e}"
      return
  want = _splash_reference(option) if impl == "splash" else _reference(option)
  matrix.check(f"{impl} {option} {mode}", out, grads, want, MODES[mode][2])
