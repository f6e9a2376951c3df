"""`implementation=`: one name, a sequence tried in order, None; the fused kernels' platforms.

A sequence falls through on NotImplementedError (a call the implementation cannot express);
an implementation that lowers for one platform only (splash: TPU, cudnn: GPU) is used where the
program is lowered for it and the rest of the sequence serves the others. Programs for TPU are
exported from this CPU (jax.export) and read; cuDNN needs a GPU, so its numerics run only there.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import jattn
from jattn import masks as M

B, T, S, N, K, H = 2, 40, 56, 4, 2, 16


def _inputs(dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(0), 3)
  return (
    jax.random.normal(ks[0], (B, T, N, H), dtype),
    jax.random.normal(ks[1], (B, S, K, H), dtype),
    jax.random.normal(ks[2], (B, S, K, H), dtype),
  )


def _tpu_module(f, *args):
  return jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()


def _has_gpu():
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False


def test_sequence_uses_each_implementation_where_it_lowers():
  q, k, v = _inputs()
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, is_causal=True, implementation=("splash", "chunked")
  )
  # On this CPU the program runs jattn's chunked kernels (splash lowers only for a TPU) ...
  vis = ref.visible_mask(B, N, T, S, causal="top_left")
  want, _, _ = ref.attention(q, k, v, visible=vis)
  np.testing.assert_allclose(f(q, k, v), want, rtol=2e-5, atol=2e-5)
  # ... and lowered for a TPU it is splash's kernel.
  assert _tpu_module(f, q, k, v).count("tpu_custom_call") == 1


def test_sequence_falls_through_what_an_implementation_cannot_do():
  q, k, v = _inputs()
  bias = jax.random.normal(jax.random.key(5), (1, N, T, S))
  f = lambda q, k, v, b: jattn.dot_product_attention(q, k, v, b, implementation=("splash", "dense"))
  # Splash takes no bias: skipped, with a warning that says why.
  with pytest.warns(UserWarning, match=r"\('splash', 'dense'\) fell through: .*splash.*bias"):
    assert "tpu_custom_call" not in _tpu_module(f, q, k, v, bias)
    got = f(q, k, v, bias)
  want = jattn.dot_product_attention(q, k, v, bias, implementation="dense")
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # None of them can: one error that gives each reason.
  with pytest.raises(NotImplementedError, match="splash.*bias.*cudnn"):
    jattn.dot_product_attention(q, k, v, bias, implementation=("splash", "cudnn"))
  # Asked for alone, an implementation that cannot take the call says why.
  with pytest.raises(NotImplementedError, match="splash.*bias"):
    jattn.dot_product_attention(q, k, v, bias, implementation="splash")


def test_a_sequence_of_platform_bound_kernels_serves_each_platform():
  # cuDNN cannot take the call here (no GPU: skipped, with a warning that says so): the TPU
  # program still gets splash.
  q, k, v = _inputs(jnp.bfloat16)
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, is_causal=True, implementation=("splash", "cudnn")
  )
  no_gpu = pytest.warns(UserWarning, match="cudnn.*needs an NVIDIA GPU")
  with contextlib.nullcontext() if _has_gpu() else no_gpu:
    assert _tpu_module(f, q, k, v).count("tpu_custom_call") == 1


@pytest.mark.parametrize("T", [1024, 4096])
def test_implementation_none_on_tpu_runs_splash_for_every_call_it_takes(T):
  # Lowered for a TPU from this one-device process (a program that cannot be partitioned),
  # implementation=None runs splash at every size it takes, forward ...
  causal = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True)
  args = (jax.ShapeDtypeStruct((1, T, 4, 64), jnp.bfloat16),) * 3
  assert _tpu_module(causal, *args).count("tpu_custom_call") == 1
  # ... and forward+backward, through splash's own backward kernels.
  grad = jax.grad(lambda q, k, v: causal(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  assert _tpu_module(grad, *args).count("tpu_custom_call") > 1
  # A call splash cannot take (a bias array) falls back to jattn's kernels: no custom call.
  bias = jax.ShapeDtypeStruct((1, 1, T, T), jnp.float32)
  with_bias = lambda q, k, v, b: jattn.dot_product_attention(q, k, v, b, is_causal=True)
  assert "tpu_custom_call" not in _tpu_module(with_bias, *args, bias)


def test_implementation_none_keeps_jattn_kernels_where_splash_should_not_run():
  big = (jax.ShapeDtypeStruct((8, 4096, 16, 64), jnp.bfloat16),) * 3
  # A mask splash would evaluate into a (T, S) array per head when traced (a chunked-local
  # one) is not tried: choosing never costs that, on any platform.
  local = lambda q, k, v: jattn.dot_product_attention(q, k, v, mask=jattn.masks.chunked_local(512))
  module = _tpu_module(local, *big)
  assert "tpu_custom_call" not in module and "stablehlo.while" in module
  # Decoding steps keep split-KV (splash would pad the one query row to a block of 128).
  causal = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True)
  step = (
    jax.ShapeDtypeStruct((8, 1, 16, 64), jnp.bfloat16),
    *(jax.ShapeDtypeStruct((8, 65536, 4, 64), jnp.bfloat16),) * 2,
  )
  assert "tpu_custom_call" not in _tpu_module(causal, *step)
  # Exported for cuda from this CPU, cuDNN cannot be traced (jax.nn checks for a GPU): the
  # program falls through to jattn's kernels.
  cuda = jax.export.export(jax.jit(causal), platforms=["cuda"])(*big).mlir_module()
  assert "cudnn" not in cuda and "tpu_custom_call" not in cuda


def _training_step(**kw):
  """jax.value_and_grad of a loss through dot_product_attention (query, key, value)."""
  loss = lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw).astype(jnp.float32).sum()
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _symbolic_batch(b, N=4, K=2):
  """bfloat16 query (b, 256, N, 128), key and value (b, 256, K, 128), for jax.export."""
  q = jax.ShapeDtypeStruct((b, 256, N, 128), jnp.bfloat16)
  return (q, *(jax.ShapeDtypeStruct((b, 256, K, 128), jnp.bfloat16),) * 2)


def test_a_symbolic_batch_keeps_splash_on_tpu():
  """Exported for tpu with a symbolic batch, a training step holds splash as with batch 8: its
  block masks do not depend on the example (lengths and segment ids are run-time ids), so
  the kernels are built once and run per example; the very kernels of batch 8 are reused."""
  from jattn._backends import splash as _splash

  (b,) = jax.export.symbolic_shape("b")
  step = _training_step(is_causal=True)
  # Forward (with its log-sum-exp), the forward splash's VJP recomputes, dq and dk/dv.
  assert _tpu_module(step, *_symbolic_batch(8)).count("tpu_custom_call") == 4
  built = set(_splash._KERNELS)
  assert _tpu_module(step, *_symbolic_batch(b)).count("tpu_custom_call") == 4
  assert set(_splash._KERNELS) == built  # the same kernels and masks as batch 8's
  step = _training_step(is_causal=True, implementation=("splash", "chunked"))
  assert _tpu_module(step, *_symbolic_batch(b)).count("tpu_custom_call") == 4

  # Per-example lengths and a window: still splash.
  def loss(q, k, v, kv_lengths):
    out = jattn.dot_product_attention(
      q, k, v, local_window_size=(100, 0), key_value_seq_lengths=kv_lengths
    )
    return out.astype(jnp.float32).sum()

  step = jax.value_and_grad(loss, argnums=(0, 1, 2))
  kv_lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  assert _tpu_module(step, *_symbolic_batch(b), kv_lengths).count("tpu_custom_call") == 4


def test_splash_skips_what_a_symbolic_batch_or_head_count_hides_and_says_why():
  """What splash cannot take symbolically -- a mask that reads the example index, a symbolic
  head count -- it refuses by name with the reason; ("splash", "chunked") falls through to
  jattn's kernels with a warning giving it; implementation=None keeps jattn's kernels."""
  from jattn._backends import splash as _splash

  (b,) = jax.export.symbolic_shape("b")
  by_example = jattn.masks.from_function(lambda b, h, q, k: k <= q + b)
  by_head = jattn.masks.from_function(lambda b, h, q, k: k <= q + h)
  f = lambda mask, impl: (
    lambda q, k, v: jattn.dot_product_attention(q, k, v, mask=mask, implementation=impl)
  )
  with pytest.raises(NotImplementedError, match="splash.*example index with a symbolic batch"):
    _tpu_module(f(by_example, "splash"), *_symbolic_batch(b))
  with pytest.warns(UserWarning, match="fell through: .*splash.*example index.*symbolic batch"):
    assert "tpu_custom_call" not in _tpu_module(
      f(by_example, ("splash", "chunked")), *_symbolic_batch(b)
    )
  # A mask of positions and heads alone is the same for every example: splash takes it, with
  # the masks (evaluated for an example at an unknown index) of batch 8.
  assert _tpu_module(f(by_head, "splash"), *_symbolic_batch(8)).count("tpu_custom_call") == 1
  built = set(_splash._KERNELS)
  assert _tpu_module(f(by_head, "splash"), *_symbolic_batch(b)).count("tpu_custom_call") == 1
  assert set(_splash._KERNELS) == built
  # A symbolic head count: its kernels are built for a known number of heads per group.
  (n,) = jax.export.symbolic_shape("n", scope=b.scope)
  heads = _symbolic_batch(b, N=n, K=n)
  with pytest.raises(NotImplementedError, match="splash.*symbolic head count"):
    _tpu_module(_training_step(is_causal=True, implementation="splash"), *heads)
  with pytest.warns(UserWarning, match="fell through: .*splash.*symbolic head count"):
    step = _training_step(is_causal=True, implementation=("splash", "chunked"))
    assert "tpu_custom_call" not in _tpu_module(step, *heads)
  assert "tpu_custom_call" not in _tpu_module(_training_step(is_causal=True), *heads)


def _order(q, k, v, bias=None, implementation=None, mask=None, **kw):
  """The implementations implementation=None tries per platform for this call (the decision)."""
  from jattn import _call, _dispatch

  options = dict(
    scale=None,
    is_causal=None,
    local_window_size=None,
    logits_soft_cap=None,
    dropout_rate=0.0,
    dropout_rng=None,
    dropout_broadcast=False,
    implementation=implementation,
    block_q=None,
    block_kv=None,
    schedule=None,
    step_width=None,
    return_residual=False,
    score_mod=None,
  )
  options.update(kw)
  opts, _ = _call.options(_call.Keywords(**options))
  seen = []

  def decide(q, k, v, bias, mask):
    call = _call.bind(_call.Given(q, k, v, bias, mask), opts)
    seen.append(_dispatch.order(call))
    return q

  jax.eval_shape(decide, q, k, v, bias, mask)
  return seen[0]


def test_none_runs_a_sparse_enough_selection_through_sparse_on_the_cpu():
  # A masks.selected_blocks selection naming at most SPARSE_MAX_KEYS of the keys in blocks of
  # at least SPARSE_MIN_BLOCK goes to "sparse" first on the CPU (measured there), then to
  # chunked for a call it refuses; not on GPU and TPU (not measured), nor where dense runs
  # (short calls), beyond the fraction, or for smaller blocks (DSA's tokens).
  from jattn import _dispatch

  spec = lambda T, h: jax.ShapeDtypeStruct((1, T, h, 64), jnp.float32)
  sel = lambda T, n, b: M.selected_blocks(jnp.zeros((1, T, 1, n), jnp.int32), b)
  call = lambda T, n, b=64: _order(
    spec(T, 4), spec(T, 1), spec(T, 1), mask=sel(T, n, b), is_causal=True
  )["cpu"]
  T, least = 4096, _dispatch.SPARSE_MIN_BLOCK
  n = int(_dispatch.SPARSE_MAX_KEYS * T) // 64
  order = _order(spec(T, 4), spec(T, 1), spec(T, 1), mask=sel(T, n, 64), is_causal=True)
  assert order["cpu"] == ("sparse", "chunked"), order
  assert all("sparse" not in names for p, names in order.items() if p != "cpu"), order
  assert call(T, n + 1) == ("chunked",)
  assert call(T, 4 * n, least) == ("sparse", "chunked")
  assert call(T, 8 * n, least // 2) == ("chunked",)
  assert call(512, 2) == ("dense",)


def test_gpu_and_tpu_choice_is_the_fused_kernel_first_for_calls_it_takes():
  bf16 = lambda T, S=None: (
    jax.ShapeDtypeStruct((2, T, 8, 64), jnp.bfloat16),
    *(jax.ShapeDtypeStruct((2, S or T, 4, 64), jnp.bfloat16),) * 2,
  )
  for T in (512, 1024, 4096, 16384):  # every size: dense's range and the chunked kernels'
    order = _order(*bf16(T), is_causal=True)
    assert order["cuda"][0] == "cudnn" and order["tpu"][0] == "splash", (T, order)
    assert order["cuda"][1:] == order["tpu"][1:] == order["default"], (T, order)
    assert order["cpu"] in (("dense",), ("chunked",))
  # What cuDNN cannot take leaves the GPU with jattn's kernels: float32, a soft cap,
  # bottom-right causality, a one-sided window; splash still goes first on a TPU where it takes
  # the call.
  f32 = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in bf16(2048))
  for args, kw in (
    (f32, dict(is_causal=True)),
    (bf16(2048), dict(is_causal=True, logits_soft_cap=30.0)),
    (bf16(2048), dict(is_causal="bottom_right")),
    (bf16(2048), dict(local_window_size=(256, None))),
  ):
    order = _order(*args, **kw)
    assert "cudnn" not in order.get("cuda", ()), (kw, order)
    assert order.get("cuda", order["default"]) == order["default"]
  # A bias array: cuDNN takes it, splash does not.
  bias = jax.ShapeDtypeStruct((1, 8, 2048, 2048), jnp.bfloat16)
  order = _order(*bf16(2048), bias)
  assert order["cuda"][0] == "cudnn" and "splash" not in order.get("tpu", ())
  # Decoding steps keep split-KV everywhere.
  order = _order(*bf16(1, 65536))
  assert all("cudnn" not in o and "splash" not in o for o in order.values())
  assert order["default"] == ("chunked",)


def test_a_tuning_table_overrides_the_fused_default_for_its_case(tmp_path):
  # Measured wins over reasoned: a table entry saying jattn's kernels were faster keeps the
  # fused kernel out for calls in its bucket; a fused name keeps it first.
  args = (jax.ShapeDtypeStruct((2, 4096, 8, 64), jnp.bfloat16),) * 3
  device = jax.devices()[0].device_kind
  for said, first in (("chunked", "chunked"), ("cudnn", "cudnn")):
    table = jattn.TuningTable()
    table.add(device, "bfloat16", 64, "causal", 4096, implementation=said)
    with table:
      order = _order(*args, is_causal=True)
    assert order["cuda"][0] == first, (said, order)
    assert ("cudnn" in order["cuda"]) == (said == "cudnn"), order
  # Another bucket keeps the default.
  with table:
    order = _order(*(jax.ShapeDtypeStruct((2, 1024, 8, 64), jnp.bfloat16),) * 3, is_causal=True)
  assert order["cuda"][0] == "cudnn"


@pytest.mark.parametrize(
  "value, error, words",
  [
    ([], ValueError, "empty"),
    (("dense", "flash"), ValueError, "flash"),
    (("dense", 3), TypeError, "implementation"),
  ],
)
def test_malformed_sequences_are_refused(value, error, words):
  q, k, v = _inputs()
  with pytest.raises(error, match=words):
    jattn.dot_product_attention(q, k, v, implementation=value)


@pytest.mark.parametrize(
  "kw, words",
  [
    (dict(sinks=jnp.zeros((N,))), "sinks"),
    (dict(logits_soft_cap=3.0), "logits_soft_cap"),
    (dict(is_causal="bottom_right"), "bottom_right"),
    (
      dict(q_segment_ids=jnp.zeros((B, T), jnp.int32), kv_segment_ids=jnp.zeros((B, S), jnp.int32)),
      "q_segment_ids",
    ),
    (dict(mask=jattn.masks.causal()), "mask objects"),
    (dict(local_window_size=(None, 0)), "local_window_size"),
  ],
)
def test_cudnn_refuses_what_jax_nn_cannot_express(kw, words):
  q, k, v = _inputs(jnp.bfloat16)
  with pytest.raises(NotImplementedError, match=words):
    jattn.dot_product_attention(q, k, v, implementation="cudnn", **kw)


@pytest.mark.skipif(_has_gpu(), reason="checks the error of a machine without a GPU")
def test_cudnn_without_a_gpu_says_so_and_a_sequence_falls_through():
  q, k, v = _inputs(jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
    jattn.dot_product_attention(q, k, v, implementation="cudnn")
  with pytest.raises(NotImplementedError, match="float32"):
    jattn.dot_product_attention(*_inputs(), implementation="cudnn")
  with pytest.warns(UserWarning, match="fell through: .*cudnn.*needs an NVIDIA GPU"):
    out = jattn.dot_product_attention(q, k, v, is_causal=True, implementation=("cudnn", "dense"))
  want = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="dense")
  np.testing.assert_array_equal(out, want)


@pytest.mark.skipif(not _has_gpu(), reason="cuDNN runs only on an NVIDIA GPU")
def test_cudnn_matches_reference_with_empty_rows():  # pragma: no cover - needs a GPU
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs())
  q_len, kv_len = jnp.array([T, 20]), jnp.array([0, 48])
  do = jax.random.normal(jax.random.key(9), (B, T, N, H), jnp.bfloat16)
  f = lambda q, k, v: jattn.dot_product_attention(
    q,
    k,
    v,
    is_causal=True,
    query_seq_lengths=q_len,
    key_value_seq_lengths=kv_len,
    implementation="cudnn",
  )
  out, pull = jax.vjp(f, q, k, v)
  vis = ref.visible_mask(B, N, T, S, causal="top_left", q_lengths=[T, 20], kv_lengths=[0, 48])
  want, _, cache = ref.attention(q, k, v, visible=vis)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2)
  for got, w in zip(pull(do), ref.grads(cache, np.asarray(do, np.float64))[:3]):
    np.testing.assert_allclose(np.asarray(got, np.float32), w, atol=5e-2)
  empty = ~vis.any(-1).transpose(0, 2, 1)
  assert np.all(np.asarray(out)[empty] == 0)


@pytest.mark.skipif(not _has_gpu(), reason="cuDNN runs only on an NVIDIA GPU")
def test_a_table_preferring_cudnn_makes_none_use_it():  # pragma: no cover - needs a GPU
  T = 1024
  q, k, v = (
    jax.random.normal(key, (2, T, 4, 64), jnp.bfloat16)
    for key in jax.random.split(jax.random.key(4), 3)
  )
  table = jattn.TuningTable()
  table.add(jax.devices()[0].device_kind, "bfloat16", 64, "causal", T, implementation="cudnn")
  f = lambda: jax.jit(lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True))
  assert "cudnn" not in f().lower(q, k, v).as_text()
  with jattn.tuning(table):
    lowered = f().lower(q, k, v)
    assert "cudnn" in lowered.as_text()
    out = lowered.compile()(q, k, v)
  want = jattn.dot_product_attention(q, k, v, is_causal=True, implementation="dense")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=3e-2)


def test_flax_callers_take_the_same_implementation_values():
  """linen's module and flax's attention_fn pass a sequence through: on this CPU
  ("splash", "dense") is dense, so both equal the dense module."""
  import flax.linen as nn

  x = jax.random.normal(jax.random.key(1), (B, T, 32))
  outs = []
  for impl in ("dense", ("splash", "dense")):
    mod = jattn.linen.MultiHeadAttention(num_heads=4, implementation=impl)
    params = mod.init(jax.random.key(0), x)
    outs.append(mod.apply(params, x))
    layer = nn.MultiHeadDotProductAttention(
      num_heads=4, attention_fn=jattn.make_attention_fn(implementation=impl)
    )
    outs.append(layer.apply(layer.init(jax.random.key(0), x), x))
  np.testing.assert_allclose(outs[2], outs[0], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(outs[3], outs[1], rtol=1e-6, atol=1e-6)


def test_diagnostics_reads_logits_with_jattn_kernels_only():
  q, k, _v = _inputs()
  with pytest.raises(NotImplementedError, match="fused kernels"):
    jattn.diagnostics.attention_stats(q, k, implementation="splash")
  got = jattn.diagnostics.attention_stats(
    q, k, is_causal=True, implementation=("splash", "chunked")
  )
  want = jattn.diagnostics.attention_stats(q, k, is_causal=True, implementation="chunked")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_a_sequence_with_splash_keeps_second_derivatives():
  # ("splash", "chunked") traces splash's branch (for a TPU) on every platform, and a gradient
  # of a gradient differentiates every branch: it must still work where chunked runs.
  q, k, v = (
    0.5 * jax.random.normal(key, (1, 1024, 2, 16)) for key in jax.random.split(jax.random.key(2), 3)
  )
  f = lambda impl: lambda q: (jattn.dot_product_attention(q, k, v, implementation=impl) ** 2).sum()
  gg = lambda impl: jax.jit(jax.grad(lambda q: (jax.grad(f(impl))(q) ** 2).sum()))(q)
  want = gg("dense")
  np.testing.assert_allclose(
    gg(("splash", "chunked")), want, rtol=1e-3, atol=1e-4 * float(jnp.abs(want).max())
  )
