"""Under jax_enable_x64 (many users turn it on to check against float64), with float32 inputs and
int32 metadata, every public function gives what it gives without it (float32 out, the same
numbers), and every kernel that lowers on a CPU host (splash and the paged kernel for a TPU,
pallas_gpu and the paged kernel for a GPU) lowers, forward and gradient. x64 is switched on for
one block at a time (`jax.enable_x64`), in this process: no subprocess to start."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

f32 = jnp.float32
B, T, N, K, H = 2, 24, 4, 2, 16


def _qkv(T=T, H=H):
  # Drawn by NumPy: jax.random would compile a program for every shape (and x64 setting).
  rng = np.random.default_rng(0)
  return tuple(jnp.asarray(rng.standard_normal((B, T, n, H)), f32) for n in (N, K, K))


def _pages():
  P, PS = 8, 4
  rng = np.random.default_rng(0)
  kp, vp = (rng.normal(size=(P, PS, K, H)).astype(np.float32) for _ in "kv")
  table = np.array([[0, 1, 2], [3, 4, 5]], np.int32)
  return kp, vp, table, np.array([9, 5], np.int32)


def _public_calls():
  q, k, v = _qkv()
  lengths = np.array([20, 13], np.int32)
  seg = jnp.asarray(np.repeat(np.array([[0, 1], [0, 0]], np.int32), T // 2, axis=1))
  kp, vp, table, lens = _pages()
  new = jnp.ones((B, 1, K, H), f32)
  dpa = jattn.dot_product_attention
  from flax import nnx

  layer = jattn.nnx.MultiHeadAttention(num_heads=N, in_features=H, is_causal=True, rngs=nnx.Rngs(0))
  x = q[..., 0, :]
  return {
    "dense": lambda: dpa(q, k, v, is_causal=True, implementation="dense"),
    "chunked": lambda: dpa(
      q, k, v, key_value_seq_lengths=lengths, implementation="chunked", block_q=8, block_kv=8
    ),
    "chunked_parallel": lambda: dpa(
      q, k, v, q_segment_ids=seg, kv_segment_ids=seg, schedule="parallel", block_q=8, block_kv=8
    ),
    "default": lambda: dpa(q, k, v, local_window_size=5, logits_soft_cap=3.0),
    "grad": lambda: jax.grad(lambda q: dpa(q, k, v, is_causal=True, block_q=8).sum())(q),
    "jvp": lambda: jax.jvp(lambda q: dpa(q, k, v, is_causal=True, block_q=8), (q,), (q,))[1],
    "masks": lambda: dpa(q, k, v, mask=jattn.masks.causal() & jattn.masks.lengths(None, lengths)),
    "merge": lambda: jattn.merge_attention(
      *zip(*(dpa(q, x, x, return_residual=True) for x in (k, v)))
    ),
    "received": lambda: jattn.attention_received(q, k, is_causal=True),
    "stats": lambda: jattn.diagnostics.attention_stats(q, k, is_causal=True).entropy,
    "make_attention_fn": lambda: jattn.make_attention_fn(is_causal=True)(q, k, v),
    "nnx": lambda: layer(x),
    "zigzag": lambda: jattn.zigzag_unpermute(jattn.zigzag_permute(q, 2), 2),
    "paged": lambda: jattn.paged_attention(q[:, :1], kp, vp, table, lens),
    "paged_ragged": lambda: jattn.paged_attention(
      q[0, :3], kp, vp, table, lens, query_start=np.array([0, 2, 3], np.int32)
    ),
    "write_pages": lambda: jattn.write_pages(kp, vp, table, lens, new, new).key_pages,
  }


@pytest.mark.parametrize("name", list(_public_calls()))
def test_public_functions_under_x64_equal_their_float32_selves(name):
  call = _public_calls()[name]
  want = jax.tree.leaves(call())
  # As users run it: x64 with jax's standard promotion (the suite's strict promotion would
  # refuse int32 and int64 meeting before the program could).
  with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
    got = jax.tree.leaves(call())
  for g, w in zip(got, want):
    assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
    np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6, err_msg=name)


def _abstract_gpu():
  """jax 0.12's Triton lowering from a CPU wants the GPU named (jax 0.10's asks nothing)."""
  if not hasattr(jax.sharding, "AbstractDevice"):
    return contextlib.nullcontext()
  gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
  return jax.sharding.use_abstract_mesh(
    jax.sharding.AbstractMesh(
      (1,), ("x",), abstract_device=gpu, axis_types=(jax.sharding.AxisType.Auto,)
    )
  )


def _lower(fn, args, platform):
  if platform == "tpu":
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
  with _abstract_gpu():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
  "kernel,platform",
  [("splash", "tpu"), ("pallas_gpu", "cuda"), ("paged", "tpu"), ("paged", "cuda")],
)
def test_kernels_lower_under_x64(kernel, platform):
  """Mosaic (TPU) takes no 64-bit integers, which x64 makes of Python's in index arithmetic:
  each kernel lowers, forward and gradient, with x64 on as with it off."""
  if kernel == "paged":
    kp, _, table, lens = _pages()
    q = jnp.ones((B, 1, N, H), f32)
    fns = {
      "forward": lambda q, kp: jattn.paged_attention(
        q, kp, kp + 1, table, lens, implementation="pallas"
      )
    }
    args = (q, jnp.asarray(kp))
  else:
    q, k, v = _qkv(T=128, H=128 if kernel == "splash" else 64)
    attend = lambda q: jattn.dot_product_attention(
      q, k, v, implementation=kernel, is_causal=True, logits_soft_cap=5.0
    )
    fns = {"forward": attend, "grad": jax.grad(lambda q: attend(q).sum())}
    args = (q,)
  marker = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
  for name, fn in fns.items():
    with jax.enable_x64(True):
      text = _lower(fn, args, platform)
    assert marker in text, (kernel, name)
