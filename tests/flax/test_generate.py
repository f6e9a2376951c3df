"""examples/generate.py: token-by-token generation from jattn.nnx modules with a KV cache.

A briefly trained one-layer model of examples/train_recall.py generates greedily and by
sampling; every step's logits equal those of one uncached forward pass over the finished
sequence, the T = 1 step compiles once for the whole generation, and dense and chunked attention
generate the same tokens. With a 640-position float32 cache the steps are decoding-shaped, so
implementation=None runs them through the chunked kernels on this CPU (with a cache just long
enough, through dense): which kernel each generation traced is recorded and checked.
"""

import functools
import os

import _examples
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


_load = _examples.load


generate = _load("generate")
train_recall = generate.train_recall  # the module generate.py itself trains and generates with


@functools.cache
def _trained():
  cfg = train_recall.load_config(os.path.join(_ROOT, "examples", "train_recall.toml"))
  cfg["train"].update(batch_size=16, eval_every=1000, eval_batch=16)
  cfg["model"].update(num_layers=1)
  run = train_recall.train(cfg, "dense", "float32", steps=3, log=lambda *a: None)
  return cfg, run["model"], run["task"]


def _model(implementation):
  """The trained weights in a model whose attention runs ``implementation``."""
  cfg, trained, task = _trained()
  shell = train_recall.Transformer(
    task, cfg["model"], implementation, jnp.float32, rngs=nnx.Rngs(0)
  )
  graphdef, _ = nnx.split(shell)
  return nnx.merge(graphdef, nnx.state(trained)), task


def test_cached_generation_equals_recomputing(monkeypatch):
  # Also: check_against_recomputing catches a wrong cache (on the chunked model's generation,
  # which it has just passed; a test of its own generated and compiled another model for it).
  tokens = {}
  # Which kernels each model's programs trace (jit traces every new shape once).
  traced = []
  for name, module in (("chunked", jattn._chunked.entry), ("dense", jattn._backends.dense)):
    fn = {"chunked": "chunked_attention", "dense": "dense_attention"}[name]
    original = getattr(module, fn)
    monkeypatch.setattr(
      module, fn, lambda *a, _f=original, _n=name, **k: (traced.append(_n), _f(*a, **k))[1]
    )
  # implementation=None with a 640-position cache: decoding-shaped steps, the chunked kernels;
  # with a cache just long enough (33 positions) dense.
  for implementation, max_length, kernel in (
    ("dense", None, "dense"),
    ("chunked", None, "chunked"),
    (None, 640, "chunked"),
    (None, None, "dense"),
  ):
    model, task = _model(implementation)
    seqs, _, _ = task.batch(jax.random.key(3), 4)
    prompt = seqs[:, : 2 * task.num_pairs + 1]
    # Sampling differs from greedy decoding only in how a token is drawn: one model is enough.
    modes = (("greedy", None),) + ((("sampled", jax.random.key(1)),) if max_length == 640 else ())
    for name, key in modes:
      traced.clear()
      out, logits, _, compiled = generate.generate(model, prompt, 5, key, max_length=max_length)
      if name == "greedy":  # sampling retraces only the step around the same attention calls
        assert traced and set(traced) == {kernel}, (implementation, max_length, traced)
      assert compiled == 2, compiled  # the prefill and one T = 1 step for every token
      diff, same = generate.check_against_recomputing(model, prompt, out, logits, atol=1e-4)
      assert same and diff < 1e-4, (implementation, name, diff)
      if implementation == "chunked":
        # The check catches a wrong cache: one step's logits off by 1e-2 fail it.
        with pytest.raises(AssertionError, match="differs from recomputing"):
          generate.check_against_recomputing(
            model, prompt, out, logits.at[:, 2].add(1e-2), atol=1e-4
          )
      tokens[implementation, max_length, name] = np.asarray(out)
  for other in (("chunked", None), (None, 640), (None, None)):
    np.testing.assert_array_equal(tokens[other + ("greedy",)], tokens["dense", None, "greedy"])
