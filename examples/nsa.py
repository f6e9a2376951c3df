"""Native Sparse Attention (NSA) as a Flax nnx layer, trained a few optax steps.

NSA (DeepSeek, 2025) gives each query three branches over the keys, per KV head, and sums them
with learned gates:

- compressed: each block of ``block`` keys is pooled into one key and one value (a learned
  weighted mean here), and the query attends causally to the blocks that lie wholly before it;
- selected: the compressed branch's attention weights score the blocks (summed over the query
  heads of the group), and the query attends to the keys of its top ``n`` blocks -- its own
  block and the first always among them -- through ``jattn.masks.selected_blocks`` and
  ``implementation="sparse"`` (causal within them);
- window: the last ``window`` keys (``local_window_size``).

The block indices come from ``jax.lax.top_k`` and have no gradient; the gates, the pooling and
the projections get theirs through ordinary jax (the compressed branch's scores only steer the
choice). The example trains the layer on a toy task (each token's running mean of the inputs);
tests/flax/test_nsa_example.py checks the selected branch against float64 attention under the
equivalent boolean mask.

  python examples/nsa.py [--steps 20] [--T 256]

Shapes: B batch, T tokens, D model width, N query heads, K KV heads, G = N // K, H head size,
C = T // block compressed blocks, n selected blocks.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jattn
from jattn import masks


class NSA(nnx.Module):
  """Native Sparse Attention over (B, T, D) inputs: three branches, gated per head."""

  def __init__(self, D, N, K, H, *, block=16, n=4, window=32, rngs: nnx.Rngs):
    self.N, self.K, self.H, self.block, self.n, self.window = N, K, H, block, n, window
    self.q = nnx.Linear(D, N * H, rngs=rngs)
    self.k = nnx.Linear(D, K * H, rngs=rngs)
    self.v = nnx.Linear(D, K * H, rngs=rngs)
    self.pool = nnx.Param(jnp.zeros((block,)))  # a learned weighting within each block
    self.gate = nnx.Linear(D, 3 * N, rngs=rngs)
    self.out = nnx.Linear(N * H, D, rngs=rngs)

  def compress(self, x):
    """(B, T, K, H) -> (B, C, K, H): each block's keys pooled by the learned weights."""
    B, T, K, H = x.shape
    w = jax.nn.softmax(self.pool[...])
    return jnp.einsum("bcrkh,r->bckh", x.reshape(B, T // self.block, self.block, K, H), w)

  def selection(self, q, kc):
    """(B, T, K, n) blocks per query and KV head: the top n by the compressed branch's weights
    (summed over the group's query heads), the query's own block and block 0 forced in."""
    B, T, N, H = q.shape
    C, K = kc.shape[1], kc.shape[2]
    s = jnp.einsum("btkgh,bckh->btkgc", q.reshape(B, T, K, N // K, H), kc) / np.sqrt(H)
    own = jnp.arange(T) // self.block
    before = jnp.arange(C)[None, :] < own[:, None]  # blocks wholly before the query's
    p = jax.nn.softmax(jnp.where(before[None, :, None, None], s, -jnp.inf), axis=-1)
    score = jnp.nan_to_num(p).sum(3)  # (B, T, K, C); a first-block query has none
    forced = (jnp.arange(C)[None, :] == own[:, None]) | (jnp.arange(C)[None, :] == 0)
    score = jnp.where(
      forced[None, :, None, :], jnp.inf, jnp.where(before[None, :, None, :], score, -1.0)
    )
    score = jax.lax.stop_gradient(score)
    _, idx = jax.lax.top_k(score, self.n)
    # Blocks after the query's own (only there to fill the n slots early on) are dropped.
    return jnp.where(idx <= own[None, :, None, None], idx, -1).astype(jnp.int32)

  def branches(self, x):
    """(q, k, v, the selection, the three branches' outputs (B, T, N, H))."""
    B, T, _ = x.shape
    q = self.q(x).reshape(B, T, self.N, self.H)
    k = self.k(x).reshape(B, T, self.K, self.H)
    v = self.v(x).reshape(B, T, self.K, self.H)
    kc, vc = self.compress(k), self.compress(v)
    C = kc.shape[1]
    # Compressed block c is seen by the queries past its last key.
    seen = (jnp.arange(C)[None, :] + 1) * self.block - 1 < jnp.arange(T)[:, None]
    compressed = jattn.dot_product_attention(q, kc, vc, mask=seen)
    idx = self.selection(q, kc)
    selected = jattn.dot_product_attention(
      q, k, v, mask=masks.selected_blocks(idx, self.block), is_causal=True, implementation="sparse"
    )
    window = jattn.dot_product_attention(q, k, v, local_window_size=(self.window - 1, 0))
    return q, k, v, idx, (compressed, selected, window)

  def __call__(self, x):
    B, T, _ = x.shape
    *_, outs = self.branches(x)
    g = jax.nn.sigmoid(self.gate(x)).reshape(B, T, 3, self.N, 1)
    mixed = sum(g[:, :, i] * o for i, o in enumerate(outs))
    return self.out(mixed.reshape(B, T, self.N * self.H))


def batch(rng, B, T, D):
  """Inputs (B, T, D) and the target: the mean of each token's inputs so far (what attention
  with even weights over its past computes, once the projections have learnt it)."""
  x = rng.standard_normal((B, T, D)).astype(np.float32)
  y = np.cumsum(x, axis=1) / np.arange(1, T + 1, dtype=np.float32)[None, :, None]
  return jnp.asarray(x), jnp.asarray(y)


def train(steps, T=256, D=32, seed=0):
  """The losses of ``steps`` optax steps on fresh batches."""
  model = NSA(D, N=4, K=2, H=16, rngs=nnx.Rngs(seed))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    # optax's Adam bias correction relies on implicit promotion (the tests run "strict").
    with jax.numpy_dtype_promotion("standard"):
      opt.update(model, grads)
    return loss

  rng = np.random.default_rng(seed)
  return [float(step(model, opt, *batch(rng, 4, T, D))) for _ in range(steps)]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--T", type=int, default=256)
  a = p.parse_args(argv)
  losses = train(a.steps, a.T)
  for i, loss in enumerate(losses):
    print(f"step {i}: loss {loss:.4f}")
  return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
  sys.exit(main())
