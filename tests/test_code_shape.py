"""The package's shape, read from its source (no JAX): no import cycle among jattn's modules, no
library function over 80 lines of code (docstrings, comments and blank lines not counted;
jattn/bench/ and jattn/demo.py aside), and no module outside jattn/masks.py that branches on a
private mask class (masks answer for themselves: see docs/architecture.md)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jattn"
LIBRARY = sorted(p for p in PACKAGE.glob("*.py") if p.name != "demo.py")


def _imports(path: pathlib.Path) -> set[str]:
  """The jattn modules ``path`` imports, anywhere in it (lazy imports too)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jattn":
      parts = node.module.split(".")
      found |= {a.name for a in node.names} if len(parts) == 1 else {parts[1]}
    elif isinstance(node, ast.Import):
      found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("jattn.")}
  return found


def test_no_import_cycle():
  graph = {p.stem: _imports(p) & {q.stem for q in LIBRARY} for p in LIBRARY
           if p.stem != "__init__"}
  graph = {m: deps - {"__init__"} for m, deps in graph.items()}
  done, path = set(), []

  def visit(m):
    if m in path:
      pytest.fail("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
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
  if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)):
    doc = set(range(body[0].lineno, body[0].end_lineno + 1))
  return sum(1 for i in range(node.lineno, node.end_lineno + 1)
             if i not in doc and src[i - 1].strip() and not src[i - 1].strip().startswith("#"))


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
  uses = [f"{p.name}: {m.group(0)}" for p in LIBRARY if p.name != "masks.py"
          for m in private.finditer(p.read_text())]
  assert not uses, uses
