"""examples/mla_decode.py: absorbed-MLA decoding from a paged latent cache (a Flax nnx module).

The example prefills prompts of different lengths into a latent pool (P, page_size, 1, Hc + Hr),
decodes greedily with ``paged_attention(..., value_head_dim=Hc)`` and returns 1 unless every
step's logits equal a float64 uncached forward of the non-absorbed model.
"""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "mla_decode.py")


def test_mla_decode_equals_the_non_absorbed_model(capsys):
  spec = importlib.util.spec_from_file_location("mla_decode", _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.main(["--steps", "4", "--page-size", "4"]) == 0
  assert "absorbed MLA equals the non-absorbed model" in capsys.readouterr().out
