"""examples/serve.py: continuous batching with a paged KV cache on a tiny config.

Requests of different prompt lengths arrive over time; each engine step is one ragged
`jattn.paged_attention` call per layer mixing prefill chunks and decode tokens, pages allocated
as sequences grow and freed when they end. The example checks every request's tokens against an
uncached greedy run of that request alone and returns 1 if any differs.
"""

import _examples
import pytest


def _serve():
  return _examples.load("serve")


@pytest.mark.parametrize(
  "args", [[], ["--slots", "3", "--budget", "6", "--chunk", "4", "--requests", "8", "--seed", "1"]]
)
def test_serve_tokens_equal_uncached_greedy_runs(args, capsys):
  assert _serve().main(["--tiny"] + args) == 0
  out = capsys.readouterr().out
  assert "every request's tokens equal its uncached greedy run" in out and "tokens/s" in out
