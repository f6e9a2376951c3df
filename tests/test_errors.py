"""Every malformed call fails at trace time with an error that names the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn

B, T, S, N, K, H = 2, 8, 12, 4, 2, 16
q = jnp.zeros((B, T, N, H))
k = jnp.zeros((B, S, K, H))
v = jnp.zeros((B, S, K, H))


def _call(*args, **kwargs):
  args = args or (q, k, v)
  return jattn.dot_product_attention(*args, **kwargs)


CASES = [
    # (what, args, kwargs, exception, words that must appear in the message)
    ("query rank", (jnp.zeros((T, H)), k, v), {}, ValueError, ["query", "(B, T, N, H)"]),
    ("key rank", (q, jnp.zeros((S, K, H)), v), {}, ValueError, ["key", "rank"]),
    ("head dim", (q, jnp.zeros((B, S, K, 8)), jnp.zeros((B, S, K, 8))), {}, ValueError,
     ["head dim", "key.shape"]),
    ("N % K", (q, jnp.zeros((B, S, 3, H)), jnp.zeros((B, S, 3, H))), {}, ValueError,
     ["multiple", "K=3"]),
    ("batch", (q, jnp.zeros((3, S, K, H)), jnp.zeros((3, S, K, H))), {}, ValueError, ["batch"]),
    ("kv length", (q, k, jnp.zeros((B, S + 1, K, H))), {}, ValueError, ["value", "key"]),
    ("kv batch", (q, k, jnp.zeros((1, S, K, H))), {}, ValueError, ["value", "key"]),
    ("int query", (q.astype(jnp.int32), k, v), {}, TypeError, ["query", "int32"]),
    ("mixed dtypes", (q.astype(jnp.bfloat16), k, v), {}, TypeError, ["dtype", "bfloat16"]),
    ("float mask", (), dict(mask=jnp.ones((B, N, T, S))), TypeError, ["mask", "bool"]),
    ("mask shape", (), dict(mask=jnp.ones((B, N, T, S + 1), bool)), ValueError,
     ["mask", "broadcastable", "(B, N, T, S)"]),
    ("mask heads", (), dict(mask=jnp.ones((B, 3, T, S), bool)), ValueError, ["mask"]),
    ("mask rank", (), dict(mask=jnp.ones((1, B, N, T, S), bool)), ValueError, ["mask", "rank"]),
    ("bias shape", (), dict(bias=jnp.ones((B, N, T + 1, S))), ValueError, ["bias"]),
    ("int bias", (), dict(bias=jnp.ones((B, N, T, S), jnp.int32)), TypeError, ["bias"]),
    ("q lengths shape", (), dict(query_seq_lengths=jnp.ones((B, 1), jnp.int32)), ValueError,
     ["query_seq_lengths", "(B,)"]),
    ("kv lengths dtype", (), dict(key_value_seq_lengths=jnp.ones((B,), jnp.float32)),
     TypeError, ["key_value_seq_lengths"]),
    ("segment shape", (), dict(q_segment_ids=jnp.zeros((B, T + 1), jnp.int32),
                               kv_segment_ids=jnp.zeros((B, S), jnp.int32)), ValueError,
     ["q_segment_ids", "(B, T)"]),
    ("kv segment shape", (), dict(q_segment_ids=jnp.zeros((B, T), jnp.int32),
                                  kv_segment_ids=jnp.zeros((B, T), jnp.int32)), ValueError,
     ["kv_segment_ids", "(B, S)"]),
    ("one segment array", (), dict(q_segment_ids=jnp.zeros((B, T), jnp.int32)), ValueError,
     ["kv_segment_ids", "together"]),
    ("float segments", (), dict(q_segment_ids=jnp.zeros((B, T)),
                                kv_segment_ids=jnp.zeros((B, S))), TypeError,
     ["q_segment_ids"]),
    ("negative window", (), dict(local_window_size=-1), ValueError, ["local_window_size"]),
    ("window triple", (), dict(local_window_size=(1, 2, 3)), ValueError, ["local_window_size"]),
    ("negative window side", (), dict(local_window_size=(3, -2)), ValueError,
     ["local_window_size"]),
    ("zero soft cap", (), dict(logits_soft_cap=0.0), ValueError, ["logits_soft_cap"]),
    ("negative soft cap", (), dict(logits_soft_cap=-1.0), ValueError, ["logits_soft_cap"]),
    ("dropout no rng", (), dict(dropout_rate=0.1), ValueError, ["dropout_rng"]),
    ("dropout rate 1", (), dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError,
     ["dropout_rate", "[0, 1)"]),
    ("dropout rate negative", (), dict(dropout_rate=-0.1, dropout_rng=jax.random.key(0)),
     ValueError, ["dropout_rate"]),
    ("implementation", (), dict(implementation="flash"), ValueError, ["implementation",
                                                                       "'flash'"]),
    ("block_q zero", (), dict(block_q=0), ValueError, ["block_q"]),
    ("block_kv negative", (), dict(block_kv=-4), ValueError, ["block_kv"]),
    ("block float", (), dict(block_q=16.0), TypeError, ["block_q"]),
    ("is_causal string", (), dict(is_causal="bottom"), ValueError, ["is_causal"]),
    ("sinks shape", (), dict(sinks=jnp.zeros((K,))), ValueError, ["sinks", "(N,)"]),
    ("scale string", (), dict(scale="0.1"), TypeError, ["scale"]),
]


@pytest.mark.parametrize("what,args,kwargs,exc,words", CASES, ids=[c[0] for c in CASES])
def test_clear_error(what, args, kwargs, exc, words):
  with pytest.raises(exc) as info:
    _call(*args, **kwargs)
  for w in words:
    assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize("what,args,kwargs,exc,words",
                         [c for c in CASES if c[0] in ("head dim", "mask shape", "q lengths shape",
                                                       "float mask", "N % K")],
                         ids=lambda c: c if isinstance(c, str) else "")
def test_clear_error_under_jit(what, args, kwargs, exc, words):
  args = args or (q, k, v)
  f = jax.jit(lambda *a: jattn.dot_product_attention(*a, **kwargs))
  with pytest.raises(exc):
    f(*args)


def test_cudnn_is_not_implemented():
  with pytest.raises(NotImplementedError, match="cudnn"):
    _call(implementation="cudnn")


def test_mask_truth_value_is_ambiguous():
  a, b = jattn.masks.causal(), jattn.masks.local_window(3)
  with pytest.raises(TypeError, match="ambiguous"):
    _ = a and b
  with pytest.raises(TypeError):
    _ = a & np.ones(3)
