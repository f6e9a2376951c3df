"""A few steps of examples/train_recall.py: the loss falls, and dense and chunked attention train
identically (same seed, same data, same dropout masks)."""

import os

import _examples
import numpy as np

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
train_recall = _examples.load("train_recall")


def _config(**model):
  cfg = train_recall.load_config(os.path.join(_ROOT, "examples", "train_recall.toml"))
  cfg["train"].update(batch_size=32, eval_every=1000, eval_batch=64)
  cfg["model"].update(dict(num_layers=1), **model)  # one layer: the pipeline, compiled faster
  return cfg


def test_few_steps_dense_equals_chunked_and_loss_falls():
  cfg = _config()
  assert cfg["model"]["attention_dropout"] > 0  # dropout is part of the comparison
  quiet = lambda *a: None
  dense = train_recall.train(cfg, "dense", "float32", steps=12, log=quiet)
  chunked = train_recall.train(cfg, "chunked", "float32", steps=12, log=quiet)
  np.testing.assert_allclose(chunked["losses"], dense["losses"], rtol=2e-5, atol=0)
  first, last = dense["losses"][:3].mean(), dense["losses"][-3:].mean()
  assert last < first - 0.2, dense["losses"]
  # Dropout really acts: without it the very first loss (same initial weights) differs.
  no_drop = train_recall.train(
    _config(attention_dropout=0.0), "dense", "float32", steps=1, log=quiet
  )
  assert abs(no_drop["losses"][0] - dense["losses"][0]) > 1e-4
