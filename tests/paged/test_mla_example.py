"""examples/mla_decode.py: absorbed-MLA decoding from a paged latent cache (a Flax nnx module).

The example prefills prompts of different lengths into a latent pool (P, page_size, 1, Hc + Hr),
decodes greedily with ``paged_attention(..., value_head_dim=Hc)`` and returns 1 unless every
step's logits equal a float64 uncached forward of the non-absorbed model.
"""

import _examples


def test_mla_decode_equals_the_non_absorbed_model(capsys):
  module = _examples.load("mla_decode")
  assert module.main(["--steps", "4", "--page-size", "4"]) == 0
  assert "absorbed MLA equals the non-absorbed model" in capsys.readouterr().out
