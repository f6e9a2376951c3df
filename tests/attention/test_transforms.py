"""Every transform through chunked attention (and so through the default at every size): forward
mode (jvp, linearize, jacfwd) and reverse over reverse (grad of grad, Hessian-vector products),
against the float64 definition differentiated by JAX; forward mode at O(T + S) memory."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import visible_mask

import jattn

# The masking options of the issue, in two cases: one whose block map is known at trace time
# (causal with a window), one whose map is computed at run time (lengths and segment ids).
CASES = ("causal_window", "lengths_segments")


def _case(T, case, N=2, K=1, H=8, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 7)
  q = jax.random.normal(keys[0], (1, T, N, H))
  k = jax.random.normal(keys[1], (1, T, K, H))
  v = jax.random.normal(keys[2], (1, T, K, H))
  if case == "causal_window":
    window = T // 10
    kw = dict(is_causal=True, local_window_size=(window, 0))
    ref = dict(causal="top_left", window=(window, 0))
  else:
    lengths = [int(T * 0.7)], [int(T * 0.9)]
    # Four packed documents of uneven lengths.
    seg = np.zeros((1, T), np.int32)
    cuts = [0, T // 5, T // 2, T - T // 8, T]
    for n, (a, b) in enumerate(itertools.pairwise(cuts)):
      seg[0, a:b] = n
    kw = dict(
      query_seq_lengths=jnp.array(lengths[0]),
      key_value_seq_lengths=jnp.array(lengths[1]),
      q_segment_ids=jnp.asarray(seg),
      kv_segment_ids=jnp.asarray(seg),
    )
    ref = dict(q_lengths=lengths[0], kv_lengths=lengths[1], q_seg=seg, kv_seg=seg)
  tangents = tuple(jax.random.normal(kk, x.shape) for kk, x in zip(keys[3:6], (q, k, v)))
  cotangent = jax.random.normal(keys[6], (1, T, N, H))
  return (q, k, v), kw, visible_mask(1, N, T, T, **ref), tangents, cotangent


def _reference(q, k, v, visible):
  """softmax(q k^T / sqrt(H)) v in float64 over the visible keys (0 for a row that sees none),
  written plainly; JAX differentiates it."""
  G = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(q.shape[-1])
  s = jnp.where(visible, s, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(visible, s, -1e300), axis=-1, keepdims=True))
  e = jnp.where(visible, jnp.exp(s - m), 0.0)
  den = e.sum(-1, keepdims=True)
  p = e / jnp.where(den > 0, den, 1.0)
  return jnp.einsum("bnts,bsnh->btnh", p, vr)


def _f64(tree):
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), tree)


def _hvp(f, x, cotangent, u):
  """The Hessian-vector product of L(x) = <f(x), cotangent> by reverse over reverse:
  d/dx <dL/dx, u>, x = (q, k, v): grad of grad."""
  loss = lambda *x: jnp.vdot(f(*x), cotangent)
  inner = lambda *x: sum(jnp.vdot(g, w) for g, w in zip(jax.grad(loss, (0, 1, 2))(*x), u))
  return jax.grad(inner, (0, 1, 2))(*x)


def _errors(got, want):
  pairs = [(np.asarray(g, np.float64), np.asarray(w, np.float64)) for g, w in zip(got, want)]
  return [float(np.abs(g - w).max() / np.abs(w).max()) for g, w in pairs]


def _assert_close(got, want, rtol):
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float64), np.asarray(w)
    scale = np.abs(w).max()
    assert scale > 0
    np.testing.assert_allclose(g, w, atol=rtol * scale, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_reverse_over_reverse_matches_float64(case):
  # T = S = 1024: implementation=None takes the chunked kernels from 2^20 scores on (tested at
  # that boundary in test_guarantees), here with the default 512 x 256 blocks, 2 x 4 of them.
  # A longer sequence runs the same program over more blocks.
  T = 1024
  x, kw, visible, u, cot = _case(T, case)
  f = jax.jit(functools.partial(jattn.dot_product_attention, **kw))
  got = jax.jit(lambda *a: _hvp(f, a[:3], a[3], a[4:]))(*x, cot, *u)
  with jax.enable_x64(True):
    ref = functools.partial(_reference, visible=jnp.asarray(visible))
    want = jax.jit(lambda *a: _hvp(ref, a[:3], a[3], a[4:]))(*_f64((*x, cot, *u)))
  # float32 throughout; second derivatives sum over T keys and rows twice.
  # float32 throughout (measured: within 1e-6 of the largest entry); second derivatives sum
  # over T keys and rows twice.
  _assert_close(got, want, rtol=5e-6)


@pytest.mark.parametrize("case", CASES)
def test_jvp_of_chunked_matches_float64(case):
  # 2 x 4 of the default blocks; memory in forward mode: test_forward_mode_memory_grows_linearly.
  x, kw, visible, u, _ = _case(1024, case)
  f = functools.partial(jattn.dot_product_attention, implementation="chunked", **kw)
  out, tangent = jax.jit(lambda x, u: jax.jvp(f, x, u))(x, u)
  with jax.enable_x64(True):
    ref = functools.partial(_reference, visible=jnp.asarray(visible))
    want_out, want = jax.jit(lambda x, u: jax.jvp(ref, x, u))(_f64(x), _f64(u))
  _assert_close((out, tangent), (want_out, want), rtol=2e-6)


def test_bfloat16_jvp_within_a_factor_of_rounding_the_exact_tangent():
  # As for the gradients (test_precision16): the tangent's row sums in float32, its products
  # with the values rounded to the input dtype for the matmuls, as the backward rounds dS.
  x, kw, visible, u, _ = _case(1024, "causal_window", H=64)
  x, u = (tuple(a.astype(jnp.bfloat16) for a in t) for t in (x, u))
  f = functools.partial(jattn.dot_product_attention, implementation="chunked", **kw)
  _, tangent = jax.jit(lambda x, u: jax.jvp(f, x, u))(x, u)
  with jax.enable_x64(True):
    ref = functools.partial(_reference, visible=jnp.asarray(visible))
    _, want = jax.jit(lambda x, u: jax.jvp(ref, x, u))(_f64(x), _f64(u))
  want = np.asarray(want)
  rel = lambda a: np.linalg.norm(np.asarray(a, np.float64) - want) / np.linalg.norm(want)
  assert tangent.dtype == jnp.bfloat16
  assert rel(tangent) <= 1.75 * rel(want.astype(jnp.bfloat16)), (
    rel(tangent),
    rel(want.astype(jnp.bfloat16)),
  )


def test_forward_mode_memory_grows_linearly():
  # Compiled temporaries of a chunked JVP at T = S = 8192 and 16384: O(T + S), nothing of T x S
  # (which would quadruple them).
  def temp(T):
    x = [jax.ShapeDtypeStruct((1, T, 2, 64), jnp.float32)] * 3
    f = functools.partial(jattn.dot_product_attention, is_causal=True, implementation="chunked")
    jvp = jax.jit(lambda x, u: jax.jvp(f, x, u))
    return jvp.lower(x, x).compile().memory_analysis().temp_size_in_bytes

  small, large = temp(8192), temp(16384)
  assert large <= 2.2 * small, (small, large)


def test_linearize_jacfwd_and_hessian_through_chunked_equal_dense():
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  q, k, v = (jax.random.normal(kk, (1, 40, 2, 4)) for kk in keys[:3])
  w = jax.random.normal(keys[3], (4,))
  # Blocks of 16 rows and keys, so that the walks cross several blocks and skip some.
  chunked = dict(implementation="chunked", block_q=16, block_kv=16)

  def model(q, impl):
    out = jattn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(20, 0), **impl)
    return jnp.tanh(out @ w).sum()

  small = q[:, :12, :1]  # a Hessian of (1, 12, 1, 4)^2 entries, forward over reverse
  u = k[..., :1, :].repeat(2, 2)

  # Every transform of one implementation in one compiled program.
  def transforms(q, impl):
    f = functools.partial(model, impl=dict(impl))
    y, lin = jax.linearize(f, q)
    return dict(
      y=y,
      linearize=lin(v),
      jacfwd=jax.jacfwd(f)(q),
      hessian=jax.hessian(lambda s: f(q.at[:, :12, :1].set(s)))(small),
      # Reverse over reverse, forward over forward, reverse over forward.
      rr=jax.grad(lambda s: jax.grad(f)(s).sum())(q),
      ff=jax.jvp(lambda s: jax.jvp(f, (s,), (v,))[1], (q,), (u,))[1],
      rf=jax.grad(lambda s: jax.jvp(f, (s,), (v,))[1])(q),
    )

  transforms = jax.jit(transforms, static_argnames="impl")
  a = transforms(q, tuple(chunked.items()))
  b = transforms(q, (("implementation", "dense"),))
  np.testing.assert_allclose(a["y"], b["y"], rtol=1e-5)
  np.testing.assert_allclose(a["linearize"], b["linearize"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(a["jacfwd"], b["jacfwd"], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(a["hessian"], b["hessian"], rtol=1e-4, atol=1e-5)
  for name in ("rr", "ff", "rf"):
    np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_jvp_under_vmap_and_grad_under_vmap():
  keys = jax.random.split(jax.random.PRNGKey(2), 3)
  q, k, v = (jax.random.normal(kk, (3, 1, 40, 2, 4)) for kk in keys)
  impl = dict(implementation="chunked", block_q=16, block_kv=16)
  for f in (
    lambda impl: jax.vmap(lambda q, k, v: jax.jvp(lambda q: attn(q, k, v, impl), (q,), (v,))[1]),
    lambda impl: jax.vmap(jax.grad(lambda q, k, v: (attn(q, k, v, impl) ** 2).sum())),
    lambda impl: jax.grad(
      lambda q, k, v: (jax.vmap(lambda *a: attn(*a, impl))(q, k, v) ** 2).sum()
    ),
  ):
    np.testing.assert_allclose(
      jax.jit(f(impl))(q, k, v),
      jax.jit(f(dict(implementation="dense")))(q, k, v),
      rtol=1e-5,
      atol=1e-6,
    )


def attn(q, k, v, impl):
  return jattn.dot_product_attention(q, k, v, is_causal=True, **impl)


@pytest.mark.parametrize("wrap", ["checkpoint", "checkpoint_dots", "scan"])
def test_grad_and_jvp_under_remat_and_scan(wrap):
  # A model's layers: jax.checkpoint (with and without a policy) and lax.scan over the layer
  # partially evaluate the kernel's tangent primitive where JAX's own rules would not.
  x = [jax.random.normal(jax.random.PRNGKey(i), (1, 100, 2, 8)) for i in range(3)]
  impl = dict(implementation="chunked", block_q=32, block_kv=32)
  wrappers = {
    "checkpoint": jax.checkpoint,
    "checkpoint_dots": lambda g: jax.checkpoint(g, policy=jax.checkpoint_policies.dots_saveable),
    "scan": lambda g: (
      lambda q, k, v: jax.lax.scan(lambda c, _: (g(c, k, v), None), q, None, length=2)[0]
    ),
  }
  layer = lambda impl: wrappers[wrap](lambda q, k, v: attn(q, k, v, impl))
  loss = lambda impl: lambda *a: (layer(impl)(*a) ** 2).sum()
  dense = dict(implementation="dense")
  # Each implementation's gradient and jvp in one compiled program.
  both = lambda impl: jax.jit(
    lambda *x: (jax.grad(loss(impl), (0, 1, 2))(*x), jax.jvp(layer(impl), x, x)[1])
  )(*x)
  (got, got_t), (want, want_t) = both(impl), both(dense)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_t, want_t, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Forward mode with implementation=None: the fused kernels' branches of the platform switch
# (splash for a TPU, cuDNN or pallas_gpu for a GPU) are traced on every platform, so each must
# have a forward-mode rule (its plain-JAX definition's tangent), also where it is not lowered.
# --------------------------------------------------------------------------------------------

DEFAULT_CASES = {
  "plain": dict(),
  "causal": dict(is_causal=True),
  "soft_cap": dict(logits_soft_cap=3.0),
}


def _small(seed=3, T=24, N=4, K=2, H=8):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (1, T, N, H))
  k = jax.random.normal(ks[1], (1, T, K, H))
  v = jax.random.normal(ks[2], (1, T, K, H))
  return q, k, v, jax.random.normal(ks[3], q.shape)


def _default_and_dense(kw):
  return (
    functools.partial(jattn.dot_product_attention, **kw),
    functools.partial(jattn.dot_product_attention, implementation="dense", **kw),
  )


@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_forward_mode_with_the_default_implementation(case):
  """jacfwd, hessian (also in a traced scale), vmap of jvp and linearize then vmap, with
  implementation=None, equal the same transforms of dense (float32, tested against float64
  above)."""
  q, k, v, w = _small()

  # The transforms of one implementation, in one compiled program.
  def transforms(attend):
    loss = lambda q, scale: jnp.vdot(attend(q, k, v, scale=scale), w[:, : q.shape[1]])
    r = {}
    r["jacfwd"] = jax.jacfwd(lambda q: attend(q, k, v)[0, :3, 0])(q)
    r["hessian"] = jax.hessian(loss, argnums=(0, 1))(q[:, :6], jnp.float32(0.4))
    tangents = jnp.stack([q, w, -q])
    r["vmap_jvp"] = jax.vmap(lambda t: jax.jvp(lambda q: attend(q, k, v), (q,), (t,))[1])(tangents)
    out, lin = jax.linearize(lambda q: attend(q, k, v), q)
    r["linearize_vmap"] = jax.vmap(lin)(tangents)
    return out, r

  (out, got), (out_dense, want) = (
    jax.jit(functools.partial(transforms, f))() for f in _default_and_dense(DEFAULT_CASES[case])
  )
  assert out.shape == out_dense.shape == q.shape
  for name in want:
    for g, x in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name])):
      np.testing.assert_allclose(g, x, atol=2e-5, rtol=2e-5, err_msg=name)


def test_jacfwd_through_the_nnx_layer_with_the_default_implementation():
  x = jax.random.normal(jax.random.key(1), (1, 12, 16))
  from flax import nnx

  m = jattn.nnx.MultiHeadAttention(num_heads=2, in_features=16, is_causal=True, rngs=nnx.Rngs(0))
  # Compiled (the layer's parameters are constants of the programs).
  got = jax.jit(jax.jacfwd(lambda x: m(x)[0, -1]))(x)
  want = jax.jit(jax.jacrev(lambda x: m(x)[0, -1]))(x)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_forward_mode_exported_for_tpu_and_cuda(case):
  """The programs a TPU and a GPU get from this CPU: jacfwd and hessian with
  implementation=None lower for tpu (splash in them, its tangent the definition's) and for cuda
  (where cuDNN cannot be traced without a GPU, jattn's kernels). One program for several
  platforms at once cannot hold a Pallas TPU kernel (Pallas lowers it for every platform); the
  CPU's program is checked against dense above."""
  q, k, v, w = _small()
  default, _ = _default_and_dense(DEFAULT_CASES[case])
  fns = {
    "jacfwd": (lambda q: default(q, k, v)[0, :3, 0], q),
    "hessian": (jax.hessian(lambda q: jnp.vdot(default(q, k, v), w[:, :6])), q[:, :6]),
    "vmap_jvp": (
      lambda q: jax.vmap(lambda t: jax.jvp(lambda q: default(q, k, v), (q,), (t,))[1])(
        jnp.stack([q, w])
      ),
      q,
    ),
  }
  for name, (fn, x) in fns.items():
    fn = jax.jacfwd(fn) if name == "jacfwd" else fn
    tpu = jax.export.export(jax.jit(fn), platforms=["tpu"])(x)
    assert "tpu_custom_call" in tpu.mlir_module(), name  # splash's kernels
    cuda = jax.export.export(jax.jit(fn), platforms=["cuda"])(x)
    assert cuda.out_avals == tpu.out_avals, name


@pytest.mark.parametrize("kernel", ["splash", "pallas_gpu"])
def test_fused_kernels_forward_mode_and_hessian_in_interpret_mode(kernel):
  """The fused kernels as a TPU and a GPU run them (Pallas's interpret mode): jvp takes the
  definition's tangent, reverse mode the kernel's backward, a Hessian both (splash: its
  backward differentiated through the definition); each equals dense. pallas_gpu's backward has
  no derivative: a Hessian is refused naming it."""
  from jax.experimental.pallas import tpu as pltpu

  q, k, v, w = _small(T=20, H=16)  # Triton: head sizes of 16 or more
  kw = dict(is_causal=True, logits_soft_cap=4.0)
  ctx = pltpu.force_tpu_interpret_mode if kernel == "splash" else jattn._lowering.gpu_interpret_mode
  fused = functools.partial(jattn.dot_product_attention, implementation=kernel, **kw)
  dense = functools.partial(jattn.dot_product_attention, implementation="dense", **kw)
  with ctx():
    for name, run in (
      ("jvp", lambda f: jax.jvp(lambda q, k: f(q, k, v), (q, k), (w, -k))),
      ("grad", lambda f: jax.grad(lambda q, v: jnp.vdot(f(q, k, v), w), (0, 1))(q, v)),
    ):
      got, want = jax.jit(lambda: run(fused))(), jax.jit(lambda: run(dense))()
      for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, x, atol=2e-5, rtol=2e-5, err_msg=name)
    hessian = lambda f: jax.hessian(lambda q: jnp.vdot(f(q[None], k, v), w[:, :4]))(q[0, :4])
    if kernel == "pallas_gpu":
      with pytest.raises(NotImplementedError, match="implementation='pallas_gpu'"):
        jax.jit(lambda: hessian(fused))()
    else:
      np.testing.assert_allclose(
        jax.jit(lambda: hessian(fused))(), jax.jit(lambda: hessian(dense))(), atol=2e-5, rtol=2e-5
      )


@pytest.mark.parametrize("schedule", ["serial", "parallel"])
def test_jvp_of_chunked_with_sinks_bias_soft_cap_and_dropout_equals_dense(schedule):
  """Forward mode through every term of the chunked tangent walk: sinks (their tangent joins
  each row's log-sum-exp), a bias, a soft cap and dropout (kept weights over 1 - rate), in
  every operand's direction at once, against dense's jvp (JAX's own AD of the definition)."""
  q, k, v, _ = _small(T=40)
  ks = jax.random.split(jax.random.key(9), 4)
  bias = jax.random.normal(ks[0], (1, 4, 40, 40))
  sinks = jax.random.normal(ks[1], (4,))
  kw = dict(is_causal=True, logits_soft_cap=3.0, dropout_rate=0.3, dropout_rng=ks[2])

  def attend(impl, q, k, v, bias, sinks):
    blocks = dict(block_q=16, block_kv=8, schedule=schedule) if impl == "chunked" else {}
    return jattn.dot_product_attention(
      q, k, v, bias, sinks=sinks, implementation=impl, **blocks, **kw
    )

  primals = (q, k, v, bias, sinks)
  tangents = tuple(
    jax.random.normal(kk, x.shape) for kk, x in zip(jax.random.split(ks[3], 5), primals)
  )
  got = jax.jit(lambda p, t: jax.jvp(lambda *a: attend("chunked", *a), p, t))(primals, tangents)
  want = jax.jit(lambda p, t: jax.jvp(lambda *a: attend("dense", *a), p, t))(primals, tangents)
  for g, x in zip(got, want):
    np.testing.assert_allclose(g, x, atol=2e-5, rtol=2e-5)
