"""Every ```python block of README.md and docs/*.md, run as written, so the docs cannot rot.

Convention: the ```python blocks of one file run in order, in one namespace, as a reader would
paste them into one session: a block may use what an earlier block of the same file defined
(imports, inputs, a model), never what another file defines. A block that is not meant to run (a
signature listing, shell commands, program output) is fenced as plain ``` (or ```bash, ```toml)
instead. Each file runs in a fresh temporary working directory.

A failing block's traceback names the doc and the doc's own line numbers: each block is compiled
with the doc's path as its file name, padded with newlines to the line it starts on.

Files listed in HOST_DEVICES build meshes of several devices: their blocks run in a subprocess
(this file run as a script) with that many host CPU devices, since the device count is fixed when
JAX starts (``--xla_force_host_platform_device_count``) and the rest of the suite runs on one.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

# Docs whose examples need a mesh of several devices: the number of host CPU devices.
HOST_DEVICES = {"docs/ring.md": 8}


def blocks(doc):
  """(first line of the code in the doc, the code) of every ```python block of ``doc``."""
  text = (ROOT / doc).read_text()
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def run_blocks(doc):
  """Runs the ```python blocks of ``doc`` in order in one namespace; returns the namespace."""
  path = str(ROOT / doc)
  namespace = {"__name__": "__doc_example__"}
  for line, code in blocks(doc):
    # Padded with newlines so that the compiled block's line numbers are the doc's.
    exec(compile("\n" * (line - 1) + code, path, "exec"), namespace)
  return namespace


DOCS = [
  doc
  for doc in ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
  if blocks(doc)
]


def test_the_docs_keep_their_examples():
  # Guards the parametrization below: a renamed fence or a broken pattern must not make the
  # run vacuous.
  assert {"README.md", "docs/serving.md", "docs/ring.md", "docs/flax.md"} <= set(DOCS)
  assert "dot_product_attention" in blocks("README.md")[0][1]
  assert set(HOST_DEVICES) <= set(DOCS)
  # docs/serving.md: vLLM (float and fp8 pages), FlashAttention (kvcache and varlen), the
  # checks, the write, a draft tree's move and its NaN rule, a key selection.
  serving = blocks("docs/serving.md")
  assert len(serving) == 6
  code = "".join(c for _, c in serving)
  for needed in (
    "ref_ragged_paged_attention",
    "checkify",
    "return_residual",
    "dot_product_attention",
    "write_pages",
    "tree_mask",
    "key_selection",
  ):
    assert needed in code
  # tests/support/_ring_worker.py runs docs/ring.md's split-KV recipe by itself, found by this
  # marker.
  assert sum("def decode(" in c for _, c in blocks("docs/ring.md")) == 1


def _prepare(doc, cwd):
  """What a doc's examples take from the reader's setup that no ```python block makes."""
  if doc == "docs/implementations.md":
    # The table its ```bash block writes with `jattn-bench tune`: an empty one reads the same.
    import jattn

    jattn.TuningTable().save(cwd / "tuning.json")


@pytest.mark.parametrize(
  "doc",
  # A doc whose meshes need several devices runs in a process of its own: the slow lane.
  [pytest.param(d, marks=pytest.mark.slow) if d in HOST_DEVICES else d for d in DOCS],
)
def test_doc_examples_run(doc, tmp_path, monkeypatch):
  _prepare(doc, tmp_path)
  if doc not in HOST_DEVICES:
    monkeypatch.chdir(tmp_path)
    run_blocks(doc)
    return
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={HOST_DEVICES[doc]}"
  ).strip()
  proc = subprocess.run(
    [sys.executable, __file__, doc],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, f"{doc}'s examples failed:\n{proc.stdout}\n{proc.stderr[-8000:]}"


if __name__ == "__main__":
  # The subprocess of test_doc_examples_run: the suite's numerical environment
  # (tests/conftest.py), then the blocks; an error's traceback goes to stderr.
  import jax

  jax.config.update("jax_numpy_dtype_promotion", "strict")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  assert jax.device_count() == HOST_DEVICES[sys.argv[1]], jax.devices()
  run_blocks(sys.argv[1])
