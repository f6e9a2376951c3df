"""docs/serving.md's ```python blocks, each run as written, so the porting guide cannot rot.

Each block is self-contained (its own imports, inputs and asserts) and runs in a namespace of its
own. Line numbers in a failure's traceback are the guide's own.
"""

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "serving.md"
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
  """(first line of the code in the guide, the code) of every ```python block."""
  text = DOC.read_text()
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _FENCE.finditer(text)]


BLOCKS = _blocks()


def test_the_guide_has_its_examples():
  # vLLM (float and fp8 pages), FlashAttention (kvcache and varlen), the checks.
  assert len(BLOCKS) == 3
  code = "".join(c for _, c in BLOCKS)
  for needed in (
    "ref_ragged_paged_attention",
    "checkify",
    "return_residual",
    "dot_product_attention",
  ):
    assert needed in code


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_block_runs(line, code):
  # Padded with newlines so the compiled block's line numbers are the guide's.
  program = compile("\n" * (line - 1) + code, str(DOC), "exec")
  exec(program, {"__name__": f"serving_md_line{line}"})
