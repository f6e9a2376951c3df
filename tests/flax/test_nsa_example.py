"""examples/nsa.py: Native Sparse Attention as a Flax nnx layer (compressed, selected and window
branches, gated).

Its selected branch -- top-n blocks chosen from the compressed branch's weights, attended through
masks.selected_blocks and implementation="sparse" -- equals float64 attention under the
equivalent boolean mask, outputs and the gradients of q, k and v; the gates and the pooling get
gradients; a few optax steps lower the loss."""

import _examples
import jax
import jax.numpy as jnp
import numpy as np
import reference as ref
from flax import nnx
from selections import by_hand

import jattn

nsa = _examples.load("nsa")


def test_selected_branch_equals_float64_under_the_equivalent_boolean_mask():
  T, D, N, H, block = 64, 16, 4, 8, 8
  model = nsa.NSA(D, N=N, K=2, H=H, block=block, n=3, window=8, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, T, D)), jnp.float32)
  q, k, v, idx, _ = model.branches(x)
  idx = np.asarray(idx)
  own = np.arange(T) // block
  # Each query's own block and block 0 are chosen, nothing after its own block.
  assert ((idx == own[None, :, None, None]).any(-1)).all() and ((idx == 0).any(-1)).all()
  assert (idx <= own[None, :, None, None]).all()
  visible = by_hand(idx, block, N, T, T) & ref.visible_mask(2, N, T, T, causal="top_left")
  do = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, mask=nsa.masks.selected_blocks(idx, block), is_causal=True, implementation="sparse"
  )
  out, pull = jax.vjp(f, q, k, v)
  want_out, _, want = ref.attention_vjp(q, k, v, do, visible=visible)
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
  for name, g in zip(("dq", "dk", "dv"), pull(do)):
    np.testing.assert_allclose(g, want[name], atol=5e-5, rtol=5e-5, err_msg=name)


def test_gates_and_pooling_learn_and_the_loss_falls():
  model = nsa.NSA(16, N=4, K=2, H=8, block=8, n=3, window=8, rngs=nnx.Rngs(0))
  x, y = nsa.batch(np.random.default_rng(0), 2, 64, 16)
  grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  for name in ("pool", "gate", "k"):
    leaves = jax.tree.leaves(getattr(grads, name))
    assert any(float(jnp.abs(g).max()) > 0 for g in leaves), name
    assert all(bool(jnp.isfinite(g).all()) for g in leaves), name
  losses = nsa.train(10, T=64, D=16)
  assert losses[-1] < 0.5 * losses[0], losses
