"""Train a small decoder-only Transformer built from jattn.nnx.MultiHeadAttention, end to end.

Task (generated in code): associative recall. A sequence is ``k1 v1 ... kP vP ? kq``; the model
must predict the value paired with the query key ``kq``. Keys are distinct within a sequence and
values uniform, so only attention to the matching pair solves it (chance = 1 / num_values).

One invocation trains every run listed in the config (default: dense fp32, chunked fp32, dense
with bf16 compute and fp32 parameters) from the same seed, prints the final loss and accuracy of
each, how far the dense and chunked loss curves are apart (they coincide to float tolerance:
same initialisation, same batches, same dropout masks), and writes the curves as a PNG.

  python examples/train_recall.py [--config examples/train_recall.toml] [--steps N] [--out DIR]

Shapes: B batch, L sequence length (2P + 2), D model width, V vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jattn

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_recall.toml")


# ---- the task ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
  """Multi-query associative recall: P key-value pairs, then Q queries, each a key followed by
  its value. The model predicts each query's value at the query key's position."""

  num_pairs: int
  num_queries: int
  num_keys: int
  num_values: int

  def __post_init__(self):
    if self.num_pairs > self.num_keys:
      raise ValueError(
        f"num_pairs={self.num_pairs} distinct keys need num_keys >= num_pairs, "
        f"got num_keys={self.num_keys}"
      )

  @property
  def vocab(self) -> int:
    return self.num_keys + self.num_values

  @property
  def length(self) -> int:
    """L: the pairs and the queries, less the last answer (never an input)."""
    return 2 * self.num_pairs + 2 * self.num_queries - 1

  def batch(self, key, batch_size: int):
    """tokens int32 (B, L); targets int32 (B, Q) (answer token ids); target_pos int32 (Q,)."""
    P, Q = self.num_pairs, self.num_queries
    kk, kv, kq = jax.random.split(key, 3)
    keys = jax.vmap(lambda k: jax.random.permutation(k, self.num_keys)[:P])(
      jax.random.split(kk, batch_size)
    ).astype(jnp.int32)  # (B, P), distinct per row
    values = jax.random.randint(kv, (batch_size, P), 0, self.num_values, jnp.int32) + jnp.int32(
      self.num_keys
    )
    which = jax.random.randint(kq, (batch_size, Q), 0, P, jnp.int32)
    qkeys = jnp.take_along_axis(keys, which, axis=1)
    answers = jnp.take_along_axis(values, which, axis=1)
    pairs = jnp.stack([keys, values], axis=-1).reshape(batch_size, 2 * P)
    queries = jnp.stack([qkeys, answers], axis=-1).reshape(batch_size, 2 * Q)
    tokens = jnp.concatenate([pairs, queries], axis=1)[:, :-1]
    target_pos = 2 * P + 2 * jnp.arange(Q, dtype=jnp.int32)  # the query keys' positions
    return tokens, answers, target_pos


# ---- the model -----------------------------------------------------------------------------


class Block(nnx.Module):
  """Pre-LayerNorm decoder block: causal jattn attention with RoPE, then a GELU MLP."""

  def __init__(self, m: dict, implementation: str, dtype, *, rngs: nnx.Rngs):
    d = m["d_model"]
    self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
    self.attn = jattn.nnx.MultiHeadAttention(
      m["num_heads"],
      d,
      num_kv_heads=m["num_kv_heads"],
      dtype=dtype,
      is_causal=True,
      rope=True,
      dropout_rate=m["attention_dropout"],
      implementation=implementation,
      block_q=m["block_q"] if implementation == "chunked" else None,
      block_kv=m["block_kv"] if implementation == "chunked" else None,
      rngs=rngs,
    )
    self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
    self.fc1 = nnx.Linear(d, m["mlp_dim"], dtype=dtype, rngs=rngs)
    self.fc2 = nnx.Linear(m["mlp_dim"], d, dtype=dtype, rngs=rngs)

  def __call__(self, x, *, deterministic: bool, rngs):
    x = x + self.attn(self.ln1(x), deterministic=deterministic, rngs=rngs)
    return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class Transformer(nnx.Module):
  """tokens (B, L) -> logits (B, L, V) in float32."""

  def __init__(self, task: Task, m: dict, implementation: str, dtype, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(task.vocab, m["d_model"], dtype=dtype, rngs=rngs)
    self.blocks = nnx.List(
      [Block(m, implementation, dtype, rngs=rngs) for _ in range(m["num_layers"])]
    )
    self.ln = nnx.LayerNorm(m["d_model"], dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(m["d_model"], task.vocab, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, *, deterministic: bool = True, rngs=None):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, deterministic=deterministic, rngs=rngs)
    return self.head(self.ln(x)).astype(jnp.float32)


def _loss_and_accuracy(model, batch, *, deterministic, rngs=None):
  tokens, targets, target_pos = batch
  logits = model(tokens, deterministic=deterministic, rngs=rngs)[:, target_pos]  # (B, Q, V)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  acc = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32).mean()
  return loss, acc


# ---- training ------------------------------------------------------------------------------


def train(
  cfg: dict, implementation: str | None, dtype: str, *, steps: int | None = None, log=print
) -> dict:
  """Train one model; returns its per-step training losses, the eval history, the trained
  model and the task (examples/generate.py generates from them).

  Everything random (initialisation, batches, dropout) derives from ``cfg['train']['seed']``
  alone, so two runs that differ only in ``implementation`` see identical data and dropout.
  """
  task = Task(**cfg["task"])
  m, t = cfg["model"], cfg["train"]
  steps = t["steps"] if steps is None else steps
  compute_dtype = jnp.dtype(dtype)
  seed = jax.random.key(t["seed"])
  k_init, k_data, k_drop, k_eval = jax.random.split(seed, 4)

  model = Transformer(
    task, m, implementation, compute_dtype, rngs=nnx.Rngs(params=k_init, dropout=k_drop)
  )
  schedule = optax.warmup_cosine_decay_schedule(
    0.0, t["learning_rate"], min(t["warmup_steps"], max(steps - 1, 1)), max(steps, 2)
  )
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=t["weight_decay"])
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, step):
    batch = task.batch(jax.random.fold_in(k_data, step), t["batch_size"])
    drop_key = jax.random.fold_in(k_drop, step)

    def loss_fn(model):
      # Made inside the differentiated function: an Rngs counts its draws, state that may only
      # change in the trace that created it.
      drop = nnx.Rngs(dropout=drop_key)
      return _loss_and_accuracy(model, batch, deterministic=False, rngs=drop)

    (loss, acc), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    # optax's Adam bias correction (float ** int32 count) relies on implicit promotion; the
    # model itself runs under whatever promotion mode is set (the tests use "strict").
    with jax.numpy_dtype_promotion("standard"):
      optimizer.update(model, grads)
    return loss, acc

  eval_batch = task.batch(k_eval, t["eval_batch"])

  @nnx.jit
  def evaluate(model):
    return _loss_and_accuracy(model, eval_batch, deterministic=True)

  losses, evals = [], []
  start = time.perf_counter()
  for step in range(steps):
    loss, _ = train_step(model, optimizer, jnp.int32(step))
    losses.append(loss)
    if (step + 1) % t["eval_every"] == 0 or step + 1 == steps:
      el, ea = (float(v) for v in evaluate(model))
      evals.append((step + 1, el, ea))
      log(
        f"  step {step + 1:5d}  train loss {float(loss):.4f}  eval loss {el:.4f}  eval acc {ea:.3f}"
      )
  losses = np.asarray(jax.device_get(losses), np.float64)
  return dict(
    losses=losses,
    evals=evals,
    seconds=time.perf_counter() - start,
    chance=1.0 / task.num_values,
    model=model,
    task=task,
  )


def load_config(path: str) -> dict:
  with open(path, "rb") as f:
    return tomllib.load(f)


def _plot(results: dict, path: str):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  styles = ["-", "--", ":", "-."]
  for i, (name, r) in enumerate(results.items()):
    ax1.plot(np.arange(1, len(r["losses"]) + 1), r["losses"], styles[i % 4], label=name, lw=1)
    ev = np.array(r["evals"])
    ax2.plot(ev[:, 0], ev[:, 2], styles[i % 4] + "o", label=name, ms=3)
  chance = next(iter(results.values()))["chance"]
  ax2.axhline(chance, color="gray", lw=0.8, label="chance")
  ax1.set(
    xlabel="step",
    ylabel="training loss (cross-entropy)",
    yscale="log",
    title="associative recall: training loss",
  )
  ax2.set(xlabel="step", ylabel="eval accuracy", ylim=(0, 1.02), title="held-out accuracy")
  ax1.legend()
  ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--config",
    default=DEFAULT_CONFIG,
    help="TOML config (default: examples/train_recall.toml, beside this script)",
  )
  p.add_argument("--steps", type=int, default=None, help="override [train] steps")
  p.add_argument("--out", default="results/train_recall", help="folder for the PNG and JSON")
  args = p.parse_args(argv)
  cfg = load_config(args.config)
  os.makedirs(args.out, exist_ok=True)

  results = {}
  for run in cfg["run"]:
    print(
      f"{run['name']}: implementation={run['implementation']}, compute dtype={run['dtype']}, "
      f"params float32"
    )
    results[run["name"]] = train(cfg, run["implementation"], run["dtype"], steps=args.steps)

  print(
    f"\n{'run':16s} {'final train loss':>16s} {'eval loss':>10s} {'eval acc':>9s} {'seconds':>8s}"
  )
  for name, r in results.items():
    _, el, ea = r["evals"][-1]
    print(f"{name:16s} {r['losses'][-1]:16.4f} {el:10.4f} {ea:9.3f} {r['seconds']:8.1f}")
  print(f"chance accuracy: {next(iter(results.values()))['chance']:.3f}")

  summary = {
    name: dict(final_train_loss=float(r["losses"][-1]), evals=r["evals"], seconds=r["seconds"])
    for name, r in results.items()
  }
  by_impl = {}
  for run in cfg["run"]:
    by_impl.setdefault(run["dtype"], {})[run["implementation"]] = run["name"]
  for dtype, impls in by_impl.items():
    if "dense" in impls and "chunked" in impls:
      a, b = results[impls["dense"]]["losses"], results[impls["chunked"]]["losses"]
      diff = np.abs(a - b)
      rel = diff / np.abs(a)
      print(
        f"dense vs chunked ({dtype}): max |loss difference| over {len(a)} steps "
        f"{diff.max():.2e} (relative {rel.max():.2e}); first 100 steps {diff[:100].max():.2e}"
      )
      summary[f"dense_vs_chunked_{dtype}"] = dict(
        max_abs=float(diff.max()), max_rel=float(rel.max())
      )
  png = os.path.join(args.out, "train_recall.png")
  _plot(results, png)
  with open(os.path.join(args.out, "train_recall.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print(f"wrote {png}")


if __name__ == "__main__":
  main()
