"""GRPO on packed prefix trees: a small Flax nnx policy scores rollouts packed as trees of tokens.

Reinforcement-learning fine-tuning samples several responses per prompt and trains on their
per-token log-probabilities, weighted by each response's advantage over its group. Repeating the
prompt for every response repeats its attention work; packing a prompt and its responses as a
prefix tree (`jattn.masks.prefix_tree`: each response sees the prompt and itself, not its
siblings) does the prompt once. This example packs two rows of trees -- a GRPO group (a prompt
and four responses), and a forest of a second group beside a multi-turn tree (a prompt, an
assistant turn, a user turn, two branches after it, and a second first turn) -- and:

- computes every token's log-probability packed: RoPE at each token's position alone
  (``tree.positions``), the tree's mask, and each token predicted from the token before it on
  its path (``tree.previous``: a response's first token from its prompt's last);
- takes optax steps on a GRPO loss (PPO's clipped ratio against the log-probs before the step,
  advantages normalised within each prompt's group, a node shared by several responses given
  the mean advantage of the responses below it, one token-level mean over the batch);
- checks both against the same model run on every root-to-leaf path alone, one causal row each:
  the log-probs, and the parameters after one step from the same initialisation.

It prints the two differences and returns 1 if either is above float32's tolerance.

  python examples/rl_prefix_tree.py [--steps 5] [--implementation chunked] [--size 96]

Shapes: B packed rows, T tokens per row, M nodes per row, A paths, L longest path, V vocabulary,
D model width.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jattn
from jattn import masks

VOCAB, TARGET = 16, 1  # the toy verifier rewards a response's share of TARGET tokens

# Each row: its trees as (length, trained, children), prompts untrained. Row 1 holds a second
# group and a multi-turn tree: prompt -> assistant turn -> user turn -> two assistant branches,
# and a second assistant first turn.
ROWS = [
  [(21, False, [(9, True, []), (14, True, []), (6, True, []), (11, True, [])])],
  [
    (12, False, [(10, True, []), (7, True, []), (13, True, [])]),
    (9, False, [(6, True, [(4, False, [(5, True, []), (8, True, [])])]), (7, True, [])]),
  ],
]


@dataclasses.dataclass
class Rollouts:
  """A packed batch and its every root-to-leaf path alone.

  tokens (B, T); tree (`masks.PrefixTree`); advantage, weight (B, T) float32: each trained
  token's advantage and its weight in the loss (0 for prompts, user turns and padding).
  Alone: idx (A, L) the packed token of path a's i-th token in row row[a], lens (A,), owner
  (A, L): path a is the first through that token (the one counted in the loss)."""

  tokens: jax.Array
  tree: masks.PrefixTree
  advantage: jax.Array
  weight: jax.Array
  row: np.ndarray
  idx: np.ndarray
  lens: np.ndarray
  owner: np.ndarray

  def alone(self, x):
    """A (B, T, ...) array per path, (A, L, ...); padding reads token 0."""
    x = np.asarray(x)
    return jnp.asarray(np.stack([x[b][i] for b, i in zip(self.row, self.idx)]))

  def packed(self, x):
    """Per-path values (A, L) back in the packed rows, each token's from its owner."""
    out = np.zeros(self.tokens.shape, np.float32)
    for a, b in enumerate(self.row):
      out[b, self.idx[a][self.owner[a]]] = np.asarray(x)[a][self.owner[a]]
    return out


def _nodes(trees):
  """(parents, lengths, trained, group) of nested (length, trained, children) trees, numbered
  depth-first; a node's group is its root (its prompt)."""
  parents, lengths, trained, group = [], [], [], []

  def visit(node, parent, root):
    length, train, children = node
    m = len(parents)
    parents.append(parent)
    lengths.append(length)
    trained.append(train)
    group.append(m if root is None else root)
    for child in children:
      visit(child, m, group[m])

  for tree in trees:
    visit(tree, -1, None)
  return parents, lengths, trained, group


def _chain(parents, m):
  """Node m's path from its root, root first."""
  return (_chain(parents, parents[m]) if parents[m] >= 0 else []) + [m]


def _score_row(tokens, parents, lengths, trained, group, advantage, weight):
  """One row's rewards (a response's trained tokens' share of TARGET), advantages written into
  ``advantage`` and loss weights into ``weight`` (B's row, in place); returns each response's
  path as packed token indices."""
  start = np.concatenate([[0], np.cumsum(lengths)])
  span = [np.arange(start[m], start[m + 1]) for m in range(len(parents))]
  leaves = [m for m in range(len(parents)) if m not in parents]
  chain = {m: _chain(parents, m) for m in leaves}
  reward = {
    m: float(np.mean(tokens[np.concatenate([span[a] for a in chain[m] if trained[a]])] == TARGET))
    for m in leaves
  }
  adv = {}
  for g in set(group):
    members = [m for m in leaves if group[m] == g]
    r = np.array([reward[m] for m in members])
    adv.update(zip(members, (r - r.mean()) / (r.std() + 1e-6)))
  for m in range(len(parents)):
    if trained[m]:
      advantage[span[m]] = np.mean([adv[leaf] for leaf in leaves if m in chain[leaf]])
      weight[span[m]] = 1.0
  return [np.concatenate([span[a] for a in chain[m]]) for m in leaves]


def make_rollouts(seed: int, size: int) -> Rollouts:
  """The rows of ROWS packed in ``size`` tokens, random tokens (each node leaning to TARGET by
  a random amount), each response's reward (its trained tokens' share of TARGET), and the
  advantages: normalised within each prompt's group, a node's the mean over the responses
  below it."""
  rng = np.random.default_rng(seed)
  rows = [_nodes(trees) for trees in ROWS]
  M = max(len(r[0]) for r in rows)
  pad = lambda col, fill: np.array([list(r[col]) + [fill] * (M - len(r[col])) for r in rows])
  tree = masks.prefix_tree(
    pad(0, -1).astype(np.int32), lengths=pad(1, 0).astype(np.int32), size=size
  )
  node = np.asarray(tree.node_ids)
  lean = rng.random((len(rows), M))[np.arange(len(rows))[:, None], node]
  tokens = np.where(rng.random(node.shape) < lean, TARGET, rng.integers(0, VOCAB, node.shape))
  tokens = np.where(node >= 0, tokens, 0).astype(np.int32)
  advantage, weight = np.zeros(node.shape, np.float32), np.zeros(node.shape, np.float32)
  paths = []
  for b, row in enumerate(rows):
    paths += [(b, t) for t in _score_row(tokens[b], *row, advantage[b], weight[b])]
  weight /= weight.sum()  # one token-level mean over the batch
  L = max(len(t) for _, t in paths)
  idx, owner = np.zeros((len(paths), L), int), np.zeros((len(paths), L), bool)
  seen = np.zeros(node.shape, bool)
  for a, (b, t) in enumerate(paths):
    idx[a, : len(t)] = t
    owner[a, : len(t)] = ~seen[b, t]
    seen[b, t] = True
  return Rollouts(
    jnp.asarray(tokens),
    tree,
    jnp.asarray(advantage),
    jnp.asarray(weight),
    np.array([b for b, _ in paths]),
    idx,
    np.array([len(t) for _, t in paths], np.int32),
    owner,
  )


# ---- the policy ----------------------------------------------------------------------------


class Block(nnx.Module):
  """Pre-LayerNorm decoder block: causal jattn attention with RoPE, then a GELU MLP."""

  def __init__(self, d: int, implementation, *, rngs: nnx.Rngs):
    chunked = implementation == "chunked"
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = jattn.nnx.MultiHeadAttention(
      4,
      d,
      num_kv_heads=2,
      is_causal=True,
      rope=True,
      implementation=implementation,
      block_q=16 if chunked else None,  # small blocks: the rows' trees cross many of them
      block_kv=8 if chunked else None,
      rngs=rngs,
    )
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
    self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x, attend: dict):
    x = x + self.attn(self.ln1(x), **attend)
    return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class Policy(nnx.Module):
  """tokens (B, T) -> logits (B, T, V) float32."""

  def __init__(self, d: int, layers: int, implementation, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, implementation, rngs=rngs) for _ in range(layers)])
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, VOCAB, rngs=rngs)

  def __call__(self, tokens, attend: dict):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, attend)
    return self.head(self.ln(x)).astype(jnp.float32)


def token_logprobs(model, tokens, previous, attend: dict):
  """(B, T): log p(token t | its path before it), read at the logits of ``previous[t]`` (0
  where there is none: a path's first token, padding)."""
  logp = jax.nn.log_softmax(model(tokens, attend), axis=-1)
  before = jnp.take_along_axis(logp, jnp.maximum(previous, 0)[..., None], axis=1)
  lp = jnp.take_along_axis(before, tokens[..., None], axis=-1)[..., 0]
  return jnp.where(previous >= 0, lp, 0.0)


def grpo_loss(lp, old_lp, advantage, weight, clip: float = 0.2):
  """PPO's clipped surrogate of the ratio to the log-probs before the step, token-weighted."""
  ratio = jnp.exp(lp - old_lp)
  surrogate = jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - clip, 1 + clip) * advantage)
  return -jnp.sum(weight * surrogate)


def layouts(ro: Rollouts) -> dict:
  """The model's inputs packed and alone: (tokens, previous, attend, advantage, weight). Alone,
  a path's tokens are a causal row of their own, padded (hidden by lengths), each token's loss
  counted on the path that owns it."""
  A, L = ro.idx.shape
  lens = jnp.asarray(ro.lens)
  own = jnp.asarray(ro.owner, jnp.float32)
  return {
    "packed": (
      ro.tokens,
      ro.tree.previous,
      dict(mask=ro.tree.mask, positions=ro.tree.positions),
      ro.advantage,
      ro.weight,
    ),
    "alone": (
      ro.alone(ro.tokens),
      jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None] - 1, (A, L)),
      dict(query_seq_lengths=lens, key_value_seq_lengths=lens),
      ro.alone(ro.advantage) * own,
      ro.alone(ro.weight) * own,
    ),
  }


def make_model(implementation, seed: int = 0, d: int = 32, layers: int = 2):
  model = Policy(d, layers, implementation, rngs=nnx.Rngs(seed))
  # Adam's eps of 1e-6, not 1e-8: its first step is lr * g / (|g| + eps), which for a gradient
  # near 0 turns float32 rounding (packed against alone) into a whole step; eps bounds that.
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3, eps=1e-6))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def train_step(model, optimizer, inputs, old):
  """One optax step on the GRPO loss against ``old``, the log-probs of the policy that sampled
  the rollouts (GRPO takes several steps per batch of rollouts)."""
  tokens, previous, attend, advantage, weight = inputs

  def loss_fn(model):
    return grpo_loss(token_logprobs(model, tokens, previous, attend), old, advantage, weight)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  # optax's Adam bias correction relies on implicit promotion (the tests run "strict").
  with jax.numpy_dtype_promotion("standard"):
    optimizer.update(model, grads)
  return loss


def check(ro: Rollouts, implementation) -> dict:
  """Packed against alone: the log-probs of every token that has a predecessor, and every
  parameter after one step from the same initialisation (max absolute differences)."""
  io = layouts(ro)
  res, params = {}, {}
  for name, inputs in io.items():
    model, optimizer = make_model(implementation)
    lp = nnx.jit(token_logprobs)(model, *inputs[:3])
    res[name] = ro.packed(lp) if name == "alone" else np.asarray(lp)
    nnx.jit(train_step)(model, optimizer, inputs, lp)
    params[name] = jax.tree.leaves(nnx.state(model, nnx.Param))
  has = np.asarray(ro.tree.previous) >= 0
  return dict(
    logprobs=float(np.abs(res["packed"] - res["alone"])[has].max()),
    params=max(float(np.abs(a - b).max()) for a, b in zip(params["packed"], params["alone"])),
    mean_logprob=float(res["packed"][has].mean()),
  )


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--implementation", default=None, help="dense, chunked or None (jattn picks)")
  p.add_argument("--size", type=int, default=96, help="T, tokens per packed row")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  ro = make_rollouts(args.seed, args.size)
  res = check(ro, args.implementation)
  print(
    f"{len(ro.row)} paths in {ro.tokens.shape[0]} packed rows of {args.size}: packed against "
    f"alone, log-probs {res['logprobs']:.2e}, parameters after one step {res['params']:.2e}"
  )
  model, optimizer = make_model(args.implementation)
  step = nnx.jit(train_step)
  inputs = layouts(ro)["packed"]
  old = nnx.jit(token_logprobs)(model, *inputs[:3])
  for i in range(args.steps):
    # Before each step: the loss at ratio 1 is -sum(weight * advantage), then it falls.
    print(f"  step {i + 1}: GRPO loss {float(step(model, optimizer, inputs, old)):+.5f}")
  return int(not (res["logprobs"] < 1e-5 and res["params"] < 1e-5))


if __name__ == "__main__":
  sys.exit(main())
