"""implementation="sparse": each query's selected key blocks only (masks.selected_blocks).

It equals the float64 reference under the equivalent boolean mask (outputs, the returned lse and
the gradients of q, k, v and sinks, the lse's own cotangent included), with causal, lengths,
segments, a soft cap and sinks, GQA, token and block granularity, and its max logits
(`return_max_logits`: a statistic, no derivative) against float64; its gradients are bitwise the
same run to run and for an example alone as in a batch; the program it lowers for cuda scatters
only over unique indices; its work grows with T x n x block, not T x S; what it does not take is
refused by name."""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from max_logits_reference import reference_max
from programs import equations
from selections import by_hand, f64_attention, indices

import jattn
from jattn import masks as M
from jattn._backends import sparse

B, N, H = 2, 4, 8


def _problem(seed, T, S, K, n, block, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)
  q, k, v, do = x(B, T, N, H), x(B, S, K, H), x(B, S, K, H), x(B, T, N, H)
  dlse = jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32)
  sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
  return q, k, v, do, dlse, sinks, indices(rng, B, T, K, n, S, block)


@pytest.mark.parametrize(
  "K, Ks, n, block, dtype",
  [
    (2, 2, 3, 4, jnp.float32),  # NSA: blocks per KV head
    (2, 1, 5, 1, jnp.float32),  # DSA: tokens, one selection for every head
    (1, 1, 4, 8, jnp.bfloat16),
  ],
)
def test_equals_float64_under_the_equivalent_boolean_mask(K, Ks, n, block, dtype):
  T, S = 29, 37
  q, k, v, do, dlse, sinks, idx = _problem(K + n, T, S, Ks, n, block, dtype)
  kv_len = np.array([S, 25])
  seg = np.stack([np.zeros(S, np.int32), (np.arange(S) >= 12).astype(np.int32)])

  def f(q, k, v, sinks):
    return jattn.dot_product_attention(
      q,
      k,
      v,
      mask=M.selected_blocks(idx, block),
      is_causal="bottom_right",
      key_value_seq_lengths=jnp.asarray(kv_len),
      q_segment_ids=jnp.asarray(seg[:, S - T :]),
      kv_segment_ids=jnp.asarray(seg),
      logits_soft_cap=4.0,
      sinks=sinks,
      return_residual=True,
      implementation="sparse",
    )

  (out, lse), pull = jax.vjp(f, q, k, v, sinks)
  got = dict(zip(("dq", "dk", "dv", "dsinks"), pull((do, dlse.astype(lse.dtype)))))
  visible = ref.visible_mask(
    B,
    N,
    T,
    S,
    mask=by_hand(idx, block, N, T, S),
    causal="bottom_right",
    kv_lengths=kv_len,
    q_seg=seg[:, S - T :],
    kv_seg=seg,
  )
  want_out, want_lse, want = ref.attention_vjp(
    q, k, v, do, visible=visible, soft_cap=4.0, sinks=sinks, dlse=dlse
  )
  got["out"], want["out"] = out, want_out
  np.testing.assert_allclose(lse, want_lse, atol=1e-5 if dtype == jnp.float32 else 2e-2)
  for name, g in got.items():
    if dtype == jnp.float32:
      np.testing.assert_allclose(g, want[name], atol=5e-5, rtol=5e-5, err_msg=name)
      continue
    # test_selection.py's 16-bit rule: 1.5x rounding for the output, 3x for gradients.
    rounding = ref.rel_error(ref.round_to_dtype(want[name], dtype), want[name])
    factor = 1.5 if name == "out" else 3.0
    assert ref.rel_error(g, want[name]) <= factor * rounding, name


def test_forward_mode_and_its_gradient_equal_float64():
  # jax.jvp in q, k and v at once (JAX's tangent of the sparse forward: its loops carry the
  # tangents), and reverse over forward (a gradient of the tangent), against float64.
  T = S = 24
  K, block = 2, 4
  rng = np.random.default_rng(9)
  x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  args = (x(B, T, N, H), x(B, S, K, H), x(B, S, K, H))
  tangents = tuple(x(*a.shape) for a in args)
  idx = indices(rng, B, T, K, 3, S, block)
  kv_len = np.array([S, 17])
  visible = by_hand(idx, block, N, T, S) & ref.visible_mask(
    B, N, T, S, causal="top_left", kv_lengths=kv_len
  )
  f = lambda q, k, v: jattn.dot_product_attention(
    q,
    k,
    v,
    mask=M.selected_blocks(idx, block),
    is_causal=True,
    key_value_seq_lengths=jnp.asarray(kv_len),
    implementation="sparse",
  )
  out, tangent = jax.jvp(f, args, tangents)
  hvp = jax.grad(lambda q: (jax.jvp(f, (q, *args[1:]), tangents)[1] ** 2).sum())(args[0])
  with jax.enable_x64(True):
    f64 = lambda t: tuple(jnp.asarray(np.asarray(a, np.float64)) for a in t)
    g = lambda q, k, v: f64_attention(q, k, v, 0.0, jnp.asarray(visible))
    want_out, want_tangent = jax.jvp(g, f64(args), f64(tangents))
    a64, t64 = f64(args), f64(tangents)
    want_hvp = jax.grad(lambda q: (jax.jvp(g, (q, *a64[1:]), t64)[1] ** 2).sum())(a64[0])
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(tangent, want_tangent, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(hvp, want_hvp, atol=1e-3, rtol=1e-3)


def test_max_logits_equal_float64_and_carry_no_derivative():
  # Each row's max logit over the keys it sees (selected, causal, within the lengths), after the
  # soft cap; -inf for a row that sees none (row 3 selects nothing); a sink is not a key.
  T, S, K, block = 29, 37, 2, 4
  q, k, v, do, _, sinks, idx = _problem(5, T, S, K, 3, block)
  idx[:, 3] = -1
  sinks = sinks.at[1].set(30.0)  # above every logit
  kv_len = np.array([S, 25])
  kw = dict(
    mask=M.selected_blocks(idx, block),
    is_causal="bottom_right",
    key_value_seq_lengths=jnp.asarray(kv_len),
    logits_soft_cap=4.0,
    sinks=sinks,
    implementation="sparse",
  )
  out, mx = jattn.dot_product_attention(q, k, v, return_max_logits=True, **kw)
  visible = ref.visible_mask(
    B, N, T, S, mask=by_hand(idx, block, N, T, S), causal="bottom_right", kv_lengths=kv_len
  )
  want = reference_max(q, k, scale=1 / np.sqrt(H), cap=4.0, visible=visible)
  assert mx.shape == (B, T, N) and mx.dtype == jnp.float32
  assert np.isneginf(want[:, 3]).all() and np.isfinite(want).any()
  np.testing.assert_array_equal(np.isneginf(mx), np.isneginf(want))
  np.testing.assert_allclose(mx, want, rtol=2e-6, atol=2e-6)
  np.testing.assert_array_equal(out, jattn.dot_product_attention(q, k, v, **kw))

  # The output's gradient is the one without the max logits; none flows through them, in
  # either mode.
  def loss(q, with_max):
    if not with_max:
      return (jattn.dot_product_attention(q, k, v, **kw) * do).sum()
    o, m = jattn.dot_product_attention(q, k, v, return_max_logits=True, **kw)
    return (o * do).sum() + 0.0 * jnp.where(jnp.isfinite(m), m, 0.0).sum()

  np.testing.assert_allclose(jax.grad(loss)(q, True), jax.grad(loss)(q, False), rtol=1e-6)

  def only_max(q):
    m = jattn.dot_product_attention(q, k, v, return_max_logits=True, **kw)[1]
    return jnp.where(jnp.isfinite(m), m, 0.0)

  assert not np.asarray(jax.grad(lambda q: only_max(q).sum())(q)).any()
  assert not np.asarray(jax.jvp(only_max, (q,), (q,))[1]).any()


def test_implementation_none_takes_the_sparse_path_and_falls_through_where_it_refuses():
  # T x S past dense's range, a selection of 1/8 of the keys: None's program is "sparse"'s, bit
  # for bit; with a bias (which "sparse" refuses) None runs chunked and still means the same.
  T = S = 1024
  q, k, v, _, _, _, idx = _problem(11, T, S, 2, 2, 64)
  bias = jnp.asarray(np.random.default_rng(12).standard_normal((1, N, T, S)), jnp.float32)
  f = lambda impl, *b: jattn.dot_product_attention(
    q, k, v, *b, mask=M.selected_blocks(idx, 64), is_causal=True, implementation=impl
  )
  np.testing.assert_array_equal(f(None), f("sparse"))
  np.testing.assert_allclose(f(None, bias), f("dense", bias), atol=2e-6, rtol=2e-6)


def test_a_block_chosen_by_more_pairs_than_a_large_chunk_holds():
  # 900 queries choosing 3 of 4 blocks: each block's run of pairs fills a chunk of 512 and
  # leaves a rest for chunks of 128, and its dK and dV add the two sizes' sums (float64).
  T, S, block = 900, 256, 64
  rng = np.random.default_rng(21)
  x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v, do = x(1, T, 2, H), x(1, S, 1, H), x(1, S, 1, H), x(1, T, 2, H)
  idx = np.stack([rng.permutation(4)[:3] for _ in range(T)]).reshape(1, T, 1, 3).astype(np.int32)
  assert (np.bincount(idx.ravel(), minlength=4) > 512).all()
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, mask=M.selected_blocks(idx, block), implementation="sparse"
  )
  out, pull = jax.vjp(f, q, k, v)
  got = dict(zip(("dq", "dk", "dv"), pull(do)), out=out)
  visible = by_hand(idx, block, 2, T, S)
  want_out, _, want = ref.attention_vjp(q, k, v, do, visible=visible)
  want["out"] = want_out
  for name, g in got.items():
    np.testing.assert_allclose(g, want[name], atol=5e-5, rtol=5e-5, err_msg=name)


# The suite's jax 0.10 line compiles with the CPU's older fusion emitters for speed
# (tests/conftest.py); the bitwise claims are for the programs users get: compile with the
# default emitters there.
_AS_USERS = (
  {"xla_cpu_use_fusion_emitters": True}
  if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
  else {}
)


def _grads(q, k, v, idx, block=4):
  f = lambda q, k, v: jattn.dot_product_attention(
    q, k, v, mask=M.selected_blocks(idx, block), is_causal=True, implementation="sparse"
  )
  g = jax.jit(jax.grad(lambda *a: (f(*a) ** 2).sum(), argnums=(0, 1, 2)))
  return g.lower(q, k, v).compile(compiler_options=_AS_USERS)(q, k, v)


def test_gradients_are_bitwise_reproducible_and_an_example_alone_equals_it_in_a_batch(
  monkeypatch,
):
  T = S = 64
  q, k, v, _, _, _, idx = _problem(3, T, S, 2, 6, 4)
  first, again = _grads(q, k, v, idx), _grads(q, k, v, idx)
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  # The inverse selection sorted by a stable argsort (keys too long to pack into int32): the
  # same order, the same bits.
  monkeypatch.setattr(sparse, "PACKED_SORT_MAX", 0)
  for a, b in zip(_grads(q, k, v, idx), first):
    np.testing.assert_array_equal(a, b)
  monkeypatch.undo()
  for i in range(B):
    alone = _grads(q[i : i + 1], k[i : i + 1], v[i : i + 1], idx[i : i + 1])
    for a, b in zip(alone, first):
      np.testing.assert_array_equal(a[0], b[i])


@pytest.mark.parametrize(
  "T, S, n, every_slot_used, options",
  [
    (64, 64, 6, False, dict(is_causal="bottom_right", key_value_seq_lengths=jnp.array([64, 55]))),
    # Every row choosing the one block: 520 pairs, one chunk of 512, as many as the loop's bound
    # (an odd count).
    (520, 4, 1, True, {}),
  ],
  ids=["bottom_right-lengths", "bound-reached"],
)
def test_two_chunks_a_step_give_the_bits_of_one(monkeypatch, T, S, n, every_slot_used, options):
  """Long loops take two chunks a step (`sparse.CHUNKS_A_STEP`), merged in chunk order: out,
  lse, the gradients and the tangent are bitwise those of one chunk a step, whatever the
  parity of the chunks in use (every loop taken two a step here, the short ones included)."""
  q, k, v, do, _, _, idx = _problem(7, T, S, 2, n, 4)
  rng = np.random.default_rng(8)
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, k, v))
  attend = lambda q, k, v: jattn.dot_product_attention(
    q,
    k,
    v,
    mask=M.selected_blocks(np.maximum(idx, 0) if every_slot_used else idx, 4),
    return_residual=True,
    implementation="sparse",
    **options,
  )

  def run(paired_from):
    monkeypatch.setattr(sparse, "PAIRED_FROM", paired_from)
    jax.clear_caches()  # the constant is read while tracing

    def f(q, k, v):
      (out, lse), pull = jax.vjp(attend, q, k, v)
      _, (tout, _) = jax.jvp(attend, (q, k, v), tangents)
      return out, lse, tout, *pull((do, jnp.zeros_like(lse)))

    lowered = jax.jit(f).lower(q, k, v)
    return lowered.as_text(), lowered.compile(compiler_options=_AS_USERS)(q, k, v)

  (one_text, one), (two_text, two) = run(10**9), run(1)
  assert one_text != two_text
  for name, a, b in zip(("out", "lse", "tangent", "dq", "dk", "dv"), one, two, strict=True):
    np.testing.assert_array_equal(a, b, err_msg=name)


def test_the_program_for_cuda_scatters_only_over_uniqueindices():
  # dK and dV sum each key block's pairs in a fixed order and write the block once: no
  # floating-point scatter over repeated indices (atomics on a GPU) in the gradient.
  T, n = 256, 4
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((1, T, 2, n), jnp.int32)
  f = lambda q, k, v, i: jattn.dot_product_attention(
    q, k, v, mask=M.selected_blocks(i, 16), is_causal=True, implementation="sparse"
  )
  g = jax.grad(lambda q, k, v, i: f(q, k, v, i).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  mod = jax.export.export(jax.jit(g), platforms=["cuda"])(
    spec(1, T, 4, 64), spec(1, T, 2, 64), spec(1, T, 2, 64), idx
  ).mlir_module()
  scatters = re.findall(r'"?stablehlo\.scatter"?.*', mod)
  assert not [op for op in scatters if "unique_indices = true" not in op], scatters[:3]


def _dot_flops(jaxpr):
  """The multiply-adds of every dot_general in ``jaxpr`` (x2), a scan's body counted once per
  step: the program's matmul work, read from the program."""
  total = 0
  for eqn, runs in equations(jaxpr):
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      k = math.prod(eqn.invars[0].aval.shape[d] for d in contract)
      total += runs * 2 * math.prod(eqn.outvars[0].aval.shape) * k
  return total


def _flops(T, n, block=64):
  f = lambda q, k, v, i: jattn.dot_product_attention(
    q, k, v, mask=M.selected_blocks(i, block), implementation="sparse"
  )
  g = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))
  args = (
    jax.ShapeDtypeStruct((1, T, 2, 32), jnp.float32),
    jax.ShapeDtypeStruct((1, T, 1, 32), jnp.float32),
    jax.ShapeDtypeStruct((1, T, 1, 32), jnp.float32),
    jax.ShapeDtypeStruct((1, T, 1, n), jnp.int32),
  )
  return _dot_flops(jax.make_jaxpr(g)(*args).jaxpr)


def test_work_grows_with_the_selection_not_with_t_squared():
  # Forward and backward, read from the program (nothing compiled): the loops' static bounds
  # (a chunk past those in use is skipped at run time) hold 7 matmuls (forward: QK, PV;
  # backward: QK again, dP, dQ, dK, dV) of G x P rows against one block per chunk, chunks of 512
  # pairs for at most every pair and chunks of 128 for at most 4 per key block (the runs left
  # shorter than 512): O(T x n x block), nothing of T x S. Doubling T and S (n fixed) doubles
  # it; doubling n adds at most as much again; here 1.5x the T x n pairs' own work.
  base = _flops(4096, 16)
  assert 1.9 <= _flops(8192, 16) / base <= 2.1
  assert 1.5 <= _flops(4096, 32) / base <= 2.0
  ideal = 2 * 4096 * 2 * 16 * 64 * 32  # 2 flops x T x N x n x block x H, per matmul
  assert base <= 7 * 1.5 * ideal * 1.01, base / ideal


@pytest.mark.parametrize(
  "kwargs, words",
  [
    (dict(bias=True), "bias: not taken by implementation='sparse'"),
    (dict(dropout_rate=0.1), "dropout_rate: not taken"),
    (dict(score_mod=lambda s, b, h, q, k: s), "score_mod: not taken"),
    (dict(no_selection=True), "needs a masks.selected_blocks mask"),
  ],
)
def test_what_it_does_not_take_is_refused_by_name(kwargs, words):
  T = 16
  q, k, v, _, _, _, idx = _problem(0, T, T, 2, 2, 4)
  kw = dict(kwargs)
  mask = None if kw.pop("no_selection", False) else M.selected_blocks(idx, 4)
  if kw.pop("bias", False):
    kw["bias"] = jnp.zeros((B, N, T, T))
  if "dropout_rate" in kw:
    kw["dropout_rng"] = jax.random.key(0)
  with pytest.raises(NotImplementedError, match=re.escape(words)):
    jattn.dot_product_attention(q, k, v, mask=mask, implementation="sparse", **kw)


def test_traced_repeats_and_out_of_range_indices_mean_what_the_mask_path_says():
  # Under jit the indices are not checked: a repeat counts once, -1 and entries outside the
  # blocks select nothing -- as masks.selected_blocks evaluates on the chunked path.
  T = 24
  q, k, v, do, _, _, idx = _problem(5, T, T, 2, 4, 4)
  idx = np.array(idx)
  idx[0, :, 0, 1] = idx[0, :, 0, 0]  # a repeat in every row of example 0, head 0
  idx[1, ::2, 1, 2] = 99  # out of range
  idx[1, 1::2, 1, 3] = -5
  run = lambda impl: jax.jit(
    lambda i: jax.vjp(
      lambda q, k, v: jattn.dot_product_attention(
        q, k, v, mask=M.selected_blocks(i, 4), is_causal=True, implementation=impl
      ),
      q,
      k,
      v,
    )[1](do)
  )(jnp.asarray(idx))
  for a, b in zip(run("sparse"), run("chunked")):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
