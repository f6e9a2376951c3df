"""Generate text token by token from a jattn.nnx Transformer with a KV cache.

Trains the associative-recall model of examples/train_recall.py briefly (same task, same
config), then continues held-out prompts ``k1 v1 ... kP vP kq`` -- whose next token is the value
paired with kq -- greedily and by sampling, one token per step:

- the prompt fills each attention layer's KV cache in one call (prefill, T = prompt length);
- every further token is one call with T = 1 against the cache (`jattn.nnx.MultiHeadAttention`
  with ``decode=True``: the new key/value written at each example's fill level, causality and
  RoPE positions from it), through one jit-compiled step reused for the whole generation.

It prints tokens/s and the recall accuracy of the first generated token, and checks that the
cached generation equals recomputing: the logits of every generated position, from one uncached
forward pass over the finished sequence, equal the step's logits (the run fails otherwise).

  python examples/generate.py [--steps 600] [--new-tokens 12] [--implementation chunked]
                             [--max-length 4096]

Shapes: B batch, L prompt length, V vocabulary.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_recall


def attention_layers(model):
  return [block.attn for block in model.blocks]


def generate(
  model, prompt, new_tokens: int, key=None, temperature: float = 1.0, max_length: int | None = None
):
  """Continue ``prompt`` (B, L) int32 by ``new_tokens`` tokens: greedy when ``key`` is None,
  else sampled at ``temperature``, with caches of ``max_length`` positions (default: just
  enough). Returns (tokens (B, new_tokens), step logits (B, new_tokens, V) float32, seconds spent
  in the T = 1 steps, the number of programs the step compiled)."""
  B, L = prompt.shape
  for attn in attention_layers(model):
    attn.init_cache(B, max_length or L + new_tokens)
    attn.decode = True
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, tokens, key):
    """tokens (B, T) -> the next token (B,), its logits (B, V), the state with the cache."""
    m = nnx.merge(graphdef, state)
    logits = m(tokens, deterministic=True)[:, -1]
    if key is None:
      nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
      nxt = jax.random.categorical(key, logits / temperature).astype(jnp.int32)
    return nxt, logits, nnx.state(m)

  keys = [None] * new_tokens if key is None else list(jax.random.split(key, new_tokens))
  nxt, logits, state = step(state, prompt, keys[0])  # prefill: the whole prompt in one call
  out, all_logits = [nxt], [logits]
  jax.block_until_ready(nxt)
  seconds = 0.0
  for i in range(1, new_tokens):
    start = time.perf_counter()
    nxt, logits, state = step(state, nxt[:, None], keys[i])
    jax.block_until_ready(nxt)
    if i > 1:  # the first T = 1 call compiles the step
      seconds += time.perf_counter() - start
    out.append(nxt)
    all_logits.append(logits)
  nnx.update(model, state)
  for attn in attention_layers(model):
    attn.decode = False
  return (jnp.stack(out, axis=1), jnp.stack(all_logits, axis=1), seconds, step._cache_size())


def check_against_recomputing(model, prompt, tokens, step_logits, atol: float):
  """The logits of each generated position from one uncached forward pass over the finished
  sequence (causal: position t sees only tokens <= t, exactly what the cached step saw)."""
  full = jnp.concatenate([prompt, tokens[:, :-1]], axis=1)
  logits = model(full, deterministic=True)[:, prompt.shape[1] - 1 :]
  diff = float(jnp.abs(logits - step_logits).max())
  same_argmax = bool((jnp.argmax(logits, -1) == jnp.argmax(step_logits, -1)).all())
  if diff > atol:
    raise AssertionError(
      f"cached generation differs from recomputing: max |logit difference| {diff:.2e} > {atol}"
    )
  return diff, same_argmax


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default=train_recall.DEFAULT_CONFIG)
  p.add_argument(
    "--steps",
    type=int,
    default=None,
    help="training steps before generating (default: the config's)",
  )
  p.add_argument("--new-tokens", type=int, default=12, help="tokens generated per prompt")
  p.add_argument("--batch", type=int, default=64, help="prompts generated side by side")
  p.add_argument(
    "--implementation",
    default=None,
    help="jattn implementation of the model's attention (default: automatic)",
  )
  p.add_argument("--dtype", default="float32", help="compute dtype")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument(
    "--max-length", type=int, default=None, help="KV cache positions (default: prompt + new tokens)"
  )
  a = p.parse_args(argv)
  if a.new_tokens < 2:
    p.error(f"--new-tokens must be >= 2 (a prefill and a cached step), got {a.new_tokens}")
  cfg = train_recall.load_config(a.config)
  steps = cfg["train"]["steps"] if a.steps is None else a.steps
  print(f"training {steps} steps (implementation={a.implementation}, {a.dtype}) ...")
  run = train_recall.train(cfg, a.implementation, a.dtype, steps=steps, log=lambda s: None)
  model, task = run["model"], run["task"]
  print(
    f"  final training loss {run['losses'][-1]:.4f}, eval accuracy {run['evals'][-1][2]:.3f}"
    f" (chance {run['chance']:.3f})"
  )

  tokens, answers, _ = task.batch(jax.random.key(12345), a.batch)
  prompt = tokens[:, : 2 * task.num_pairs + 1]  # the pairs and the first query key
  atol = 1e-4 if a.dtype == "float32" else 5e-2
  for name, key in (("greedy", None), ("sampled", jax.random.key(7))):
    out, logits, seconds, compiled = generate(
      model, prompt, a.new_tokens, key, a.temperature, a.max_length
    )
    diff, same = check_against_recomputing(model, prompt, out, logits, atol)
    acc = float((out[:, 0] == answers[:, 0]).mean())
    steps = a.new_tokens - 2
    rate = a.batch * steps / seconds if seconds > 0 else float("nan")
    print(
      f"{name:8s}: {a.batch} prompts x {a.new_tokens} tokens; recall accuracy of the first "
      f"token {acc:.3f}; {rate:,.0f} tokens/s over {steps} cached steps "
      f"({seconds / max(steps, 1) * 1e3:.2f} ms per step, {compiled} compiled programs: "
      f"prefill and step)"
    )
    print(
      f"          cached = recomputed: max |logit difference| {diff:.1e}, "
      f"same argmax everywhere: {same}"
    )
    print(
      "          first prompt:", np.asarray(prompt[0]).tolist(), "->", np.asarray(out[0]).tolist()
    )


if __name__ == "__main__":
  main()
