"""The package's shape, read from its source (no JAX): no import cycle among jattn's modules, no
library function whose body is over 80 lines of code (docstrings, comments and blank lines not
counted; jattn/bench/, the demo with it, aside), no module outside jattn/masks/ that branches on a
private mask class (masks answer for themselves: see docs/architecture.md), no new function over
8 parameters outside the public signatures, every planted mutation still finds its line,
docs/architecture.md has one row per module, no module over 600 lines and at most 15 private
modules at the top of the package (issue #53: the rest lives in wings)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "jattn"
TESTS = PACKAGE.parent / "tests"
LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if "bench" not in p.relative_to(PACKAGE).parts)


def _name(path: pathlib.Path) -> str:
  """jattn/_parallel/ring.py -> "jattn._parallel.ring"; a package is its __init__."""
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p) for p in LIBRARY}


def _imports(path: pathlib.Path) -> set[str]:
  """The jattn modules ``path`` imports, anywhere in it (lazy imports too)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jattn":
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        found.add(sub if sub in MODULES else node.module)
    elif isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name in MODULES}
  return found


def test_no_import_cycle():
  # The package's __init__ imports the public names; a module importing "jattn" itself (for
  # its version) is not a cycle of the library's layers.
  graph = {_name(p): _imports(p) - {"jattn"} for p in LIBRARY if _name(p) != "jattn"}
  done, path = set(), []

  def visit(m):
    if m in path:
      pytest.fail("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
    if m in done:
      return
    path.append(m)
    for d in sorted(graph.get(m, ())):
      visit(d)
    path.pop()
    done.add(m)

  for m in sorted(graph):
    visit(m)


def _code_lines(node, src) -> int:
  body = node.body
  doc = set()
  if (
    body
    and isinstance(body[0], ast.Expr)
    and isinstance(body[0].value, ast.Constant)
    and isinstance(body[0].value.value, str)
  ):
    doc = set(range(body[0].lineno, body[0].end_lineno + 1))
  # From the body: the formatter writes a long signature one parameter per line, and a public
  # signature spells out every keyword the user may pass; the limit is on what a function does.
  return sum(
    1
    for i in range(body[0].lineno, node.end_lineno + 1)
    if i not in doc and src[i - 1].strip() and not src[i - 1].strip().startswith("#")
  )


def test_modules_stay_small_and_the_top_level_few():
  long = {
    str(p.relative_to(PACKAGE.parent)): n
    for p in PACKAGE.rglob("*.py")
    if (n := len(p.read_text().splitlines())) > 600
  }
  assert not long, f"modules over 600 lines (cut them along a seam): {long}"
  top = sorted(p.name for p in PACKAGE.glob("_*.py") if p.name != "__init__.py")
  assert len(top) <= 15, f"{len(top)} private modules at jattn/'s top level (a wing?): {top}"


def test_no_function_over_80_lines():
  long = []
  for path in LIBRARY:
    text = path.read_text()
    src = text.splitlines()
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = _code_lines(node, src)
        if n > 80:
          long.append(f"{path.name}:{node.name} ({n} lines)")
  assert not long, long


def test_private_mask_classes_stay_in_masks():
  private = re.compile(r"masks\._[A-Z]\w*")
  uses = [
    f"{p.name}: {m.group(0)}"
    for p in LIBRARY
    if PACKAGE / "masks" not in p.parents
    for m in private.finditer(p.read_text())
  ]
  assert not uses, uses


def test_every_planted_mutation_still_finds_its_line():
  """tests/tooling/_mutations.py plants bugs by exact text; a reformatted or moved line would
  make a mutation silently impossible (its runner asserts the same, but only when someone runs
  it). The test files it runs against each must exist too (a moved test file would make the
  runner's pytest fail on every mutation, and report them all caught)."""
  src = (TESTS / "tooling" / "_mutations.py").read_text()
  namespace = {"__file__": str(TESTS / "tooling" / "_mutations.py")}
  exec(src.split("only = sys.argv")[0], namespace)
  for name, path, old, new, tests in namespace["MUTATIONS"]:
    for file, line, _ in namespace["edits"](path, old, new):
      assert (PACKAGE.parent / file).read_text().count(line) == 1, name
    for test in tests:
      assert (PACKAGE.parent / test.split("::")[0]).is_file(), (name, test)


# Test files by concept; what they share is in support/ (conftest puts it on sys.path).
TEST_FOLDERS = {"attention", "paged", "parallel", "backends", "flax", "properties", "tooling"}
_IMPORTS_A_TEST = re.compile(r"^\s*(?:import|from)\s+(test_\w+)", re.M)


def test_tests_are_in_their_folders():
  """tests/ holds conftest.py and the folders; every test file is in one of the concept folders,
  support/ holds no test file."""
  assert {p.name for p in TESTS.glob("*.py")} == {"conftest.py"}
  assert {p.parent.name for p in TESTS.rglob("test_*.py")} <= TEST_FOLDERS
  assert not list((TESTS / "support").glob("test_*.py"))


def test_no_test_file_imports_a_test_file():
  """A test file (or a helper, or a worker's source in a string) imports helpers from support/,
  never a test_*.py file, itself included: what two files share is a support module."""
  found = [
    f"{p.relative_to(TESTS)} imports {m}"
    for p in sorted(TESTS.rglob("*.py"))
    if ".hypothesis" not in p.parts
    for m in _IMPORTS_A_TEST.findall(p.read_text())
  ]
  assert not found, found


def test_architecture_has_a_row_per_module():
  """docs/architecture.md's parts table names every module of jattn (bench/ included) once, and
  no module that does not exist (a moved or deleted module must move its row)."""
  rows = [
    name
    for line in (PACKAGE.parent / "docs" / "architecture.md").read_text().splitlines()
    if line.startswith("| `")
    for name in re.findall(r"`([^`]+)`", line.split("|")[1])
  ]
  modules = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
  assert sorted(set(rows)) == sorted(rows), "a module with two rows"
  assert sorted(rows) == modules, (set(modules) - set(rows), set(rows) - set(modules))


# Signatures users call with every keyword spelled out (jax.nn's, flax's, the modules').
PUBLIC_SIGNATURES = {
  "_attention.py:dot_product_attention",
  "_attention.py:attention_weights",
  "_paged/attention.py:paged_attention",
  "_paged/write.py:write_pages",
  "_parallel/ring.py:ring_attention",
  "_parallel/ring.py:ring_attention_sharded",
  "diagnostics.py:attention_stats",
  "_attention.py:attention_received",
  "_flax/attention_fn.py:attention_fn",
  "linen.py:__call__",
  "nnx.py:__init__",
  "nnx.py:__call__",
  # Pallas passes a kernel its scalar-prefetch operands and references by position.
  "_paged/pallas_gpu.py:_kernel",
  "_paged/pallas_tpu.py:_kernel",
  "_backends/pallas_gpu_kernels.py:_backward_kv_kernel",
  "_backends/pallas_gpu_kernels.py:_backward_q_kernel",
}


def test_no_new_function_over_8_parameters():
  over = set()
  for path in LIBRARY:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
        n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
        n -= bool(names) and names[0] in ("self", "cls")
        if n > 8:
          over.add(f"{path.relative_to(PACKAGE).as_posix()}:{node.name}")
  # Arrays and options travel as named bundles (issue #41): only the public signatures, which
  # users need spelled out, and Pallas kernel bodies take more.
  assert not over - PUBLIC_SIGNATURES, f"functions over 8 parameters: {over - PUBLIC_SIGNATURES}"
