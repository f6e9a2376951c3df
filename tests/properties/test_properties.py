"""Property tests: random shapes, block sizes and every feature at once, both implementations
against the float64 reference (forward, lse and the gradients of every differentiable input).

Seeded (`derandomize=True`), so a failure reproduces; the `@example`s pin the degenerate edges
(one query, one key, blocks of one).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from dropout_reference import keep_mask
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import jattn


# Score functions with closed-over arrays (their gradients are compared too). Defined once at
# module level: a new function object per example would only cost recompiles.
def _alibi(slopes):
  return lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki).astype(s.dtype)


def _square(w):
  return lambda s, b, h, qi, ki: s + w[h] * s * s / 8.0


SCORE_MODS = {None: None, "alibi": _alibi, "square": _square}


@st.composite
def problems(draw):
  B = draw(st.integers(1, 2))
  K = draw(st.sampled_from([1, 2]))
  G = draw(st.sampled_from([1, 2, 3]))
  T = draw(st.integers(1, 40))
  S = draw(st.integers(1, 40))
  return dict(
    B=B,
    K=K,
    G=G,
    T=T,
    S=S,
    H=draw(st.sampled_from([4, 8])),
    causal=draw(st.sampled_from([None, "top_left", "bottom_right"])),
    window=draw(st.one_of(st.none(), st.tuples(st.integers(0, 12), st.integers(0, 12)))),
    q_lengths=draw(st.one_of(st.none(), st.lists(st.integers(0, T), min_size=B, max_size=B))),
    kv_lengths=draw(st.one_of(st.none(), st.lists(st.integers(0, S), min_size=B, max_size=B))),
    use_segments=draw(st.booleans()),
    bias=draw(st.sampled_from([None, "full", "heads"])),
    bool_mask=draw(st.booleans()),
    sinks=draw(st.booleans()),
    dropout=draw(st.sampled_from([0.0, 0.3])),
    score_mod=draw(st.sampled_from(list(SCORE_MODS))),
    soft_cap=draw(st.sampled_from([None, 1.5])),
    block_q=draw(st.integers(1, 24)),
    block_kv=draw(st.integers(1, 24)),
    # The chunked kernels' schedule (one per example: both are covered across examples).
    schedule=draw(st.sampled_from(["serial", "parallel"])),
    # Lanes per step of the parallel schedule (None: all of them).
    step_width=draw(st.sampled_from([None, 1, 2, 3])),
    seed=draw(st.integers(0, 2**16)),
  )


_ONE = dict(
  B=1,
  K=1,
  G=1,
  T=1,
  S=1,
  H=4,
  causal=None,
  window=None,
  q_lengths=None,
  kv_lengths=None,
  use_segments=False,
  bias=None,
  bool_mask=False,
  sinks=False,
  dropout=0.0,
  score_mod=None,
  soft_cap=None,
  block_q=1,
  block_kv=1,
  seed=0,
)


@pytest.mark.long
@settings(
  # Three drawn problems beside the four pinned below, which hold every option's every value
  # (causal both ways and none, a window, both lengths with zeros, segments, a mask, both bias
  # shapes, sinks, dropout, both score functions, the soft cap, both schedules, GQA groups of
  # 1, 2 and 3, both head sizes, one block and several with ragged last ones).
  max_examples=3,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.too_slow],
)
@given(problems())
@example(_ONE)
@example(
  dict(
    _ONE,
    B=2,
    K=2,
    G=2,
    S=9,
    causal="bottom_right",
    sinks=True,
    bias="full",
    score_mod="square",
    dropout=0.3,
    kv_lengths=[0, 5],
    block_kv=2,
    schedule="parallel",
  )
)
@example(
  dict(
    _ONE,
    B=2,
    T=11,
    S=1,
    use_segments=True,
    bool_mask=True,
    bias="heads",
    score_mod="alibi",
    q_lengths=[4, 11],
    soft_cap=1.5,
    block_q=3,
  )
)
@example(
  dict(
    _ONE,
    B=2,
    K=1,
    G=3,
    T=29,
    S=35,
    H=8,
    causal="top_left",
    window=(7, 2),
    q_lengths=[0, 23],
    kv_lengths=[30, 35],
    bias="full",
    dropout=0.3,
    block_q=8,
    block_kv=6,
    schedule="parallel",
    step_width=3,
  )
)
def test_random_problems_match_reference(p):
  B, K, G, T, S, H = p["B"], p["K"], p["G"], p["T"], p["S"], p["H"]
  N = K * G
  rng = np.random.default_rng(p["seed"])
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k = rng.normal(size=(B, S, K, H)).astype(np.float32)
  v = rng.normal(size=(B, S, K, H)).astype(np.float32)
  do = rng.normal(size=(B, T, N, H)).astype(np.float32)
  bias = {None: None, "full": (B, N, T, S), "heads": (1, N, 1, S)}[p["bias"]]
  bias = None if bias is None else rng.normal(size=bias).astype(np.float32)
  mask = rng.random((B, 1, T, S)) > 0.3 if p["bool_mask"] else None
  sinks = rng.normal(size=(N,)).astype(np.float32) if p["sinks"] else None
  q_seg = np.sort(rng.integers(0, 3, (B, T)), axis=1) if p["use_segments"] else None
  kv_seg = np.sort(rng.integers(0, 3, (B, S)), axis=1) if p["use_segments"] else None
  make_mod = SCORE_MODS[p["score_mod"]]
  mod_args = jnp.asarray(rng.uniform(0.1, 0.5, (N,)), jnp.float32)
  kw = dict(
    is_causal=p["causal"] or False, local_window_size=p["window"], logits_soft_cap=p["soft_cap"]
  )
  if p["q_lengths"] is not None:
    kw["query_seq_lengths"] = jnp.asarray(p["q_lengths"], jnp.int32)
  if p["kv_lengths"] is not None:
    kw["key_value_seq_lengths"] = jnp.asarray(p["kv_lengths"], jnp.int32)
  if q_seg is not None:
    kw["q_segment_ids"] = jnp.asarray(q_seg, jnp.int32)
    kw["kv_segment_ids"] = jnp.asarray(kv_seg, jnp.int32)
  keep = None
  if p["dropout"] > 0:
    rng_key = jax.random.key(p["seed"])
    kw.update(dropout_rate=p["dropout"], dropout_rng=rng_key)
    keep = keep_mask(rng_key, p["dropout"], B, N, T, S)

  vis = ref.visible_mask(
    B,
    N,
    T,
    S,
    mask=mask,
    causal=p["causal"],
    window=p["window"],
    q_lengths=p["q_lengths"],
    kv_lengths=p["kv_lengths"],
    q_seg=q_seg,
    kv_seg=kv_seg,
  )
  common = dict(
    visible=vis,
    bias=bias,
    soft_cap=p["soft_cap"],
    sinks=sinks,
    keep=keep,
    dropout_rate=p["dropout"],
  )
  if (
    make_mod is None
  ):  # the hand-written NumPy backward: much cheaper than tracing the autodiff one
    want, want_lse, cache = ref.attention(q, k, v, **common)
    g = dict(
      zip(
        ("dq", "dk", "dv", "dbias", "dsinks"),
        ref.grads(cache, do, None if bias is None else bias.shape),
      )
    )
  else:
    want, want_lse, g = ref.attention_vjp(
      q, k, v, do, **common, make_score_mod=make_mod, score_args=mod_args
    )
  rows = np.isfinite(want_lse)

  for impl in (
    {"implementation": "dense"},
    {
      "implementation": "chunked",
      "block_q": p["block_q"],
      "block_kv": p["block_kv"],
      "schedule": p.get("schedule", "serial"),
      "step_width": p.get("step_width"),
    },
  ):

    def f(q, k, v, bias, sinks, mod_args):
      extra = {} if make_mod is None else {"score_mod": make_mod(mod_args)}
      return jattn.dot_product_attention(
        q,
        k,
        v,
        bias,
        None if mask is None else jnp.asarray(mask),
        sinks=sinks,
        return_residual=True,
        **kw,
        **extra,
        **impl,
      )

    def out_and_grads(arrays, do):  # forward and backward: one compiled program
      (out, lse), pull = jax.vjp(f, *arrays)
      return out, lse, pull((do, jnp.zeros_like(lse)))

    arrays = (q, k, v, bias, sinks, mod_args)
    out, lse, (dq, dk, dv, dbias, dsinks, dargs) = jax.jit(out_and_grads)(arrays, do)
    msg = f"{impl} {p}"
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5, err_msg=msg)
    np.testing.assert_allclose(
      np.asarray(lse)[rows], want_lse[rows], rtol=2e-5, atol=2e-5, err_msg=msg
    )
    assert np.all(np.asarray(lse)[~rows] < -1e30), msg
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias), ("dsinks", dsinks)):
      if g[name] is not None:
        np.testing.assert_allclose(got, g[name], rtol=2e-4, atol=1e-4, err_msg=f"{name} {msg}")
    if make_mod is not None:
      np.testing.assert_allclose(dargs, g["dargs"], rtol=2e-4, atol=1e-4, err_msg=f"dargs {msg}")
