"""Every malformed call fails at trace time with an error that names the argument.

The policy (`jattn._validation`): TypeError for a wrong type or dtype, ValueError for a wrong
value or shape, NotImplementedError for a valid but unsupported request. Each table row is
(what, call, exception type, words that must appear in the message).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import masks as M

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
  (
    "head dim",
    (q, jnp.zeros((B, S, K, 8)), jnp.zeros((B, S, K, 8))),
    {},
    ValueError,
    ["head dim", "key.shape"],
  ),
  (
    "N % K",
    (q, jnp.zeros((B, S, 3, H)), jnp.zeros((B, S, 3, H))),
    {},
    ValueError,
    ["multiple", "K=3"],
  ),
  ("batch", (q, jnp.zeros((3, S, K, H)), jnp.zeros((3, S, K, H))), {}, ValueError, ["batch"]),
  ("kv length", (q, k, jnp.zeros((B, S + 1, K, H))), {}, ValueError, ["value", "key"]),
  ("kv batch", (q, k, jnp.zeros((1, S, K, H))), {}, ValueError, ["value", "key"]),
  ("int query", (q.astype(jnp.int32), k, v), {}, TypeError, ["query", "int32"]),
  ("mixed dtypes", (q.astype(jnp.bfloat16), k, v), {}, TypeError, ["dtype", "bfloat16"]),
  ("float mask", (), dict(mask=jnp.ones((B, N, T, S))), TypeError, ["mask", "bool"]),
  (
    "mask shape",
    (),
    dict(mask=jnp.ones((B, N, T, S + 1), bool)),
    ValueError,
    ["mask", "broadcastable", "(B, N, T, S)"],
  ),
  ("mask heads", (), dict(mask=jnp.ones((B, 3, T, S), bool)), ValueError, ["mask"]),
  ("mask rank", (), dict(mask=jnp.ones((1, B, N, T, S), bool)), ValueError, ["mask", "rank"]),
  ("bias shape", (), dict(bias=jnp.ones((B, N, T + 1, S))), ValueError, ["bias"]),
  ("int bias", (), dict(bias=jnp.ones((B, N, T, S), jnp.int32)), TypeError, ["bias"]),
  (
    "q lengths shape",
    (),
    dict(query_seq_lengths=jnp.ones((B, 1), jnp.int32)),
    ValueError,
    ["query_seq_lengths", "(B,)"],
  ),
  (
    "kv lengths dtype",
    (),
    dict(key_value_seq_lengths=jnp.ones((B,), jnp.float32)),
    TypeError,
    ["key_value_seq_lengths"],
  ),
  (
    "segment shape",
    (),
    dict(
      q_segment_ids=jnp.zeros((B, T + 1), jnp.int32), kv_segment_ids=jnp.zeros((B, S), jnp.int32)
    ),
    ValueError,
    ["q_segment_ids", "(B, T)"],
  ),
  (
    "kv segment shape",
    (),
    dict(q_segment_ids=jnp.zeros((B, T), jnp.int32), kv_segment_ids=jnp.zeros((B, T), jnp.int32)),
    ValueError,
    ["kv_segment_ids", "(B, S)"],
  ),
  (
    "one segment array",
    (),
    dict(q_segment_ids=jnp.zeros((B, T), jnp.int32)),
    ValueError,
    ["kv_segment_ids", "together"],
  ),
  (
    "float segments",
    (),
    dict(q_segment_ids=jnp.zeros((B, T)), kv_segment_ids=jnp.zeros((B, S))),
    TypeError,
    ["q_segment_ids"],
  ),
  ("negative window", (), dict(local_window_size=-1), ValueError, ["local_window_size"]),
  ("window triple", (), dict(local_window_size=(1, 2, 3)), ValueError, ["local_window_size"]),
  ("negative window side", (), dict(local_window_size=(3, -2)), ValueError, ["local_window_size"]),
  ("zero soft cap", (), dict(logits_soft_cap=0.0), ValueError, ["logits_soft_cap"]),
  ("negative soft cap", (), dict(logits_soft_cap=-1.0), ValueError, ["logits_soft_cap"]),
  ("dropout no rng", (), dict(dropout_rate=0.1), ValueError, ["dropout_rng"]),
  (
    "dropout rate 1",
    (),
    dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)),
    ValueError,
    ["dropout_rate", "[0, 1)"],
  ),
  (
    "dropout rate negative",
    (),
    dict(dropout_rate=-0.1, dropout_rng=jax.random.key(0)),
    ValueError,
    ["dropout_rate"],
  ),
  ("implementation", (), dict(implementation="flash"), ValueError, ["implementation", "'flash'"]),
  ("block_q zero", (), dict(block_q=0), ValueError, ["block_q"]),
  ("block_kv negative", (), dict(block_kv=-4), ValueError, ["block_kv"]),
  ("block float", (), dict(block_q=16.0), TypeError, ["block_q"]),
  ("schedule unknown", (), dict(schedule="fast"), ValueError, ["schedule", "'fast'"]),
  ("schedule int", (), dict(schedule=1), TypeError, ["schedule", "int"]),
  ("step_width zero", (), dict(step_width=0), ValueError, ["step_width", "0"]),
  ("step_width float", (), dict(step_width=2.0), TypeError, ["step_width", "float"]),
  ("is_causal string", (), dict(is_causal="bottom"), ValueError, ["is_causal"]),
  ("sinks shape", (), dict(sinks=jnp.zeros((K,))), ValueError, ["sinks", "(N,)"]),
  ("scale string", (), dict(scale="0.1"), TypeError, ["scale"]),
  # The argument that is wrong is the one named: key against query, value against key.
  (
    "key head dim, value right",
    (q, jnp.zeros((B, S, K, 8)), v),
    {},
    ValueError,
    ["key must have the head dim H of query", "H=16", "H=8"],
  ),
  # A value head size of its own is valid (tests/attention/test_value_head.py); its length is not.
  (
    "value length",
    (q, k, jnp.zeros((B, S + 1, K, 8))),
    {},
    ValueError,
    ["value must have key's (B, S, K)", "key.shape=(2, 12, 2, 16)"],
  ),
  (
    "key batch, value right",
    (q, jnp.zeros((3, S, K, H)), v),
    {},
    ValueError,
    ["key must have the batch size B of query", "B=3"],
  ),
  ("value heads", (q, k, jnp.zeros((B, S, 1, H))), {}, ValueError, ["value", "key"]),
  (
    "key dtype",
    (q, k.astype(jnp.bfloat16), v),
    {},
    TypeError,
    ["key must have the dtype of query", "bfloat16"],
  ),
  (
    "value dtype",
    (q, k, v.astype(jnp.bfloat16)),
    {},
    TypeError,
    ["value must have the dtype of key", "bfloat16"],
  ),
  ("value rank", (q, k, jnp.zeros((S, K, H))), {}, ValueError, ["value", "rank"]),
  ("int key", (q, k.astype(jnp.int32), v), {}, TypeError, ["key", "int32"]),
  ("string query", ("q", k, v), {}, TypeError, ["query", "str"]),
  ("float window", (), dict(local_window_size=2.5), TypeError, ["local_window_size", "float"]),
  (
    "bool window side",
    (),
    dict(local_window_size=(True, 2)),
    TypeError,
    ["local_window_size[0]", "bool"],
  ),
  ("is_causal int", (), dict(is_causal=1), TypeError, ["is_causal", "int 1"]),
  ("implementation int", (), dict(implementation=1), TypeError, ["implementation", "int"]),
  ("block bool", (), dict(block_kv=True), TypeError, ["block_kv", "bool"]),
  ("soft cap string", (), dict(logits_soft_cap="30"), TypeError, ["logits_soft_cap", "str"]),
  ("soft cap inf", (), dict(logits_soft_cap=np.inf), ValueError, ["logits_soft_cap", "inf"]),
  ("scale nan", (), dict(scale=float("nan")), ValueError, ["scale", "finite"]),
  (
    "dropout rate string",
    (),
    dict(dropout_rate="0.1", dropout_rng=jax.random.key(0)),
    TypeError,
    ["dropout_rate", "str"],
  ),
  ("flag int", (), dict(return_residual=1), TypeError, ["return_residual", "bool", "int 1"]),
  ("score_mod not callable", (), dict(score_mod=3), TypeError, ["score_mod", "callable"]),
]


@pytest.mark.parametrize("what,args,kwargs,exc,words", CASES, ids=[c[0] for c in CASES])
def test_clear_error(what, args, kwargs, exc, words):
  with pytest.raises(exc) as info:
    _call(*args, **kwargs)
  for w in words:
    assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize(
  "what,args,kwargs,exc,words",
  [
    c for c in CASES if c[0] in ("head dim", "mask shape", "q lengths shape", "float mask", "N % K")
  ],
  ids=lambda c: c if isinstance(c, str) else "",
)
def test_clear_error_under_jit(what, args, kwargs, exc, words):
  args = args or (q, k, v)
  f = jax.jit(lambda *a: jattn.dot_product_attention(*a, **kwargs))
  with pytest.raises(exc):
    f(*args)


# The argument named first is the one that is wrong (query is the reference).
BLAME = [
  ("key", (q, jnp.zeros((B, S, K, 8)), v)),  # query H=16, key H=8, value H=16
  ("key", (q, jnp.zeros((B, S, K, 8)), jnp.zeros((B, S, K, 8)))),
  ("value", (q, k, jnp.zeros((B, S, 1, 8)))),  # a head size of its own is fine; K is not
  ("key", (q, k.astype(jnp.bfloat16), v)),
  ("value", (q, k, v.astype(jnp.bfloat16))),
  ("key", (q, jnp.zeros((1, S, K, H)), v)),
  ("value", (q, k, jnp.zeros((1, S, K, H)))),
  ("value", (q, k, jnp.zeros((B, S + 1, K, H)))),
  ("key", (q, jnp.zeros((S, K, H)), v)),
  ("value", (q, k, jnp.zeros((S, K, H)))),
]


@pytest.mark.parametrize("name,args", BLAME, ids=[f"{i}-{c[0]}" for i, c in enumerate(BLAME)])
def test_the_wrong_array_is_named_first(name, args):
  with pytest.raises((TypeError, ValueError)) as info:
    _call(*args)
  assert str(info.value).startswith(f"{name} "), str(info.value)


def test_cudnn_is_not_implemented():
  with pytest.raises(NotImplementedError, match="cudnn"):
    _call(implementation="cudnn")


def test_mask_truth_value_is_ambiguous():
  a, b = jattn.masks.causal(), jattn.masks.local_window(3)
  with pytest.raises(TypeError, match="ambiguous"):
    _ = a and b
  with pytest.raises(TypeError):
    _ = a & np.ones(3)


def _check(call, exc, words):
  with pytest.raises(exc) as info:
    call()
  for w in words:
    assert w in str(info.value), (w, str(info.value))


# --------------------------------------------------------------------------------------------
# Mask factories: checked where the mask is built.
# --------------------------------------------------------------------------------------------

MASK_CASES = [
  (
    "causal offset float array",
    lambda: M.causal(offset=jnp.zeros((B,))),
    TypeError,
    ["masks.causal: offset", "integer", "float32"],
  ),
  (
    "causal offset float",
    lambda: M.causal(offset=2.5),
    TypeError,
    ["masks.causal: offset", "float 2.5"],
  ),
  (
    "causal offset bool",
    lambda: M.causal(offset=True),
    TypeError,
    ["masks.causal: offset", "bool"],
  ),
  (
    "causal offset rank 2",
    lambda: M.causal(offset=jnp.zeros((B, 1), jnp.int32)),
    ValueError,
    ["masks.causal: offset", "shape () or (B,)", "(2, 1)"],
  ),
  (
    "causal alignment",
    lambda: M.causal((T, S), alignment="bottom"),
    ValueError,
    ["masks.causal: alignment", "'bottom_right'", "'bottom'"],
  ),
  (
    "causal alignment type",
    lambda: M.causal(alignment=True),
    TypeError,
    ["masks.causal: alignment", "bool"],
  ),
  (
    "causal bottom_right without shape",
    lambda: M.causal(alignment="bottom_right"),
    ValueError,
    ["masks.causal", "needs shape", "shape=None"],
  ),
  (
    "causal shape rank 3",
    lambda: M.causal((1, T, S), alignment="bottom_right"),
    ValueError,
    ["masks.causal: shape", "(T, S)", "(1, 8, 12)"],
  ),
  (
    "causal shape floats",
    lambda: M.causal((8.0, 12.0), alignment="bottom_right"),
    TypeError,
    ["masks.causal: shape", "tuple of ints"],
  ),
  (
    "local_window negative",
    lambda: M.local_window(-1),
    ValueError,
    ["masks.local_window: left", "non-negative", "-1"],
  ),
  (
    "local_window right negative",
    lambda: M.local_window(2, -3),
    ValueError,
    ["masks.local_window: right", "-3"],
  ),
  (
    "local_window str",
    lambda: M.local_window("3"),
    TypeError,
    ["masks.local_window: left", "str '3'"],
  ),
  (
    "local_window float",
    lambda: M.local_window(2, 2.5),
    TypeError,
    ["masks.local_window: right", "float 2.5"],
  ),
  (
    "local_window bool",
    lambda: M.local_window(True),
    TypeError,
    ["masks.local_window: left", "bool True"],
  ),
  (
    "local_window offset float",
    lambda: M.local_window(2, offset=1.5),
    TypeError,
    ["masks.local_window: offset", "int"],
  ),
  (
    "chunked_local zero",
    lambda: M.chunked_local(0),
    ValueError,
    ["masks.chunked_local: chunk_size", "positive int", "0"],
  ),
  (
    "chunked_local float",
    lambda: M.chunked_local(2.5),
    TypeError,
    ["masks.chunked_local: chunk_size", "float 2.5"],
  ),
  (
    "chunked_local bool",
    lambda: M.chunked_local(True),
    TypeError,
    ["masks.chunked_local: chunk_size", "bool"],
  ),
  (
    "prefix_lm negative",
    lambda: M.prefix_lm(-1),
    ValueError,
    ["masks.prefix_lm: prefix_length", "non-negative", "-1"],
  ),
  (
    "prefix_lm float",
    lambda: M.prefix_lm(3.0),
    TypeError,
    ["masks.prefix_lm: prefix_length", "float"],
  ),
  (
    "prefix_lm offset str",
    lambda: M.prefix_lm(3, offset="1"),
    TypeError,
    ["masks.prefix_lm: offset", "str"],
  ),
  (
    "lengths float",
    lambda: M.lengths(jnp.ones((B,))),
    TypeError,
    ["masks.lengths: q_lengths", "integer", "float32"],
  ),
  (
    "lengths bool",
    lambda: M.lengths(None, jnp.ones((B,), bool)),
    TypeError,
    ["masks.lengths: kv_lengths", "bool"],
  ),
  (
    "segments float",
    lambda: M.segments(jnp.zeros((B, T))),
    TypeError,
    ["masks.segments: q_segment_ids", "integer", "float32"],
  ),
  (
    "segments kv float",
    lambda: M.segments(jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S))),
    TypeError,
    ["masks.segments: kv_segment_ids", "float32"],
  ),
  (
    "from_array float",
    lambda: M.from_array(jnp.ones((T, S))),
    TypeError,
    ["masks.from_array: mask", "boolean", "float32"],
  ),
  (
    "from_array rank 5",
    lambda: M.from_array(jnp.ones((1, B, N, T, S), bool)),
    ValueError,
    ["masks.from_array: mask", "rank <= 4", "(1, 2, 4, 8, 12)"],
  ),
  (
    "from_function not callable",
    lambda: M.from_function(3),
    TypeError,
    ["masks.from_function: mask_fn", "callable", "int 3"],
  ),
  ("m1 and m2", lambda: M.causal() and M.local_window(3), TypeError, ["ambiguous", "m1 & m2"]),
  ("mask & 3", lambda: M.causal() & 3, TypeError, ["mask &", "jattn mask", "int"]),
  ("mask | array", lambda: M.causal() | np.ones(3, bool), TypeError, ["mask |", "ndarray"]),
]


@pytest.mark.parametrize("what,call,exc,words", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_mask_factory_errors(what, call, exc, words):
  _check(call, exc, words)


# Mask objects whose arrays do not fit the call: checked against (B, N, T, S) at trace time.
MASK_CALL_CASES = [
  (
    "lengths (B+1,)",
    lambda: M.lengths(jnp.ones((B + 1,), jnp.int32)),
    ValueError,
    ["masks.lengths: q_lengths", "(B,)=(2,)", "(3,)"],
  ),
  (
    "kv lengths (B, 1)",
    lambda: M.lengths(None, jnp.ones((B, 1), jnp.int32)),
    ValueError,
    ["masks.lengths: kv_lengths", "(B,)=(2,)", "(2, 1)"],
  ),
  (
    "segments (B, T+1)",
    lambda: M.segments(jnp.zeros((B, T + 1), jnp.int32), jnp.zeros((B, S), jnp.int32)),
    ValueError,
    ["masks.segments: q_segment_ids", "(B, T)=(2, 8)", "(2, 9)"],
  ),
  (
    "segments kv (B, S+1)",
    lambda: M.segments(jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S + 1), jnp.int32)),
    ValueError,
    ["masks.segments: kv_segment_ids", "(B, S)=(2, 12)"],
  ),
  (
    "segments shared with T != S",
    lambda: M.segments(jnp.zeros((B, T), jnp.int32)),
    ValueError,
    ["masks.segments: kv_segment_ids", "(B, S)=(2, 12)", "(2, 8)"],
  ),
  (
    "from_array not broadcastable",
    lambda: M.from_array(jnp.ones((T, S + 1), bool)),
    ValueError,
    ["masks.from_array: mask", "not broadcastable", "(B, N, T, S)=(2, 4, 8, 12)"],
  ),
  (
    "from_array heads",
    lambda: M.from_array(jnp.ones((1, 3, T, S), bool)),
    ValueError,
    ["masks.from_array: mask", "(1, 3, 8, 12)"],
  ),
  (
    "causal offset (B+1,)",
    lambda: M.causal(offset=jnp.zeros((B + 1,), jnp.int32)),
    ValueError,
    ["masks.causal: offset", "(B,)=(2,)", "(3,)"],
  ),
  (
    "inside a combination",
    lambda: M.causal() & ~M.lengths(None, jnp.ones((3,), jnp.int32)),
    ValueError,
    ["masks.lengths: kv_lengths", "(B,)=(2,)"],
  ),
]


@pytest.mark.parametrize("impl", ["dense", "chunked"])
@pytest.mark.parametrize(
  "what,make,exc,words", MASK_CALL_CASES, ids=[c[0] for c in MASK_CALL_CASES]
)
def test_mask_object_errors_at_call(what, make, exc, words, impl):
  _check(lambda: _call(mask=make(), implementation=impl), exc, words)


# --------------------------------------------------------------------------------------------
# Flax modules and make_attention_fn.
# --------------------------------------------------------------------------------------------

D = N * H  # module features


def _linen(**kw):
  """Initialise jattn.linen.MultiHeadAttention (errors surface at init, on the first call)."""
  call_kw = kw.pop("call", {})
  mod = jattn.linen.MultiHeadAttention(**{"num_heads": N, **kw})
  return mod.init(jax.random.key(0), jnp.zeros((B, T, D)), **call_kw)


def _nnx(*args, **kw):
  from flax import nnx

  return jattn.nnx.MultiHeadAttention(*(args or (N, D)), **kw, rngs=nnx.Rngs(0))


def _nnx_call(**call_kw):
  return _nnx()(jnp.zeros((B, T, D)), **call_kw)


BAD_MASK = jnp.ones((B, N, T, T + 1), bool)

MODULE_CASES = [
  (
    "linen num_heads not dividing features",
    lambda: _linen(num_heads=3),
    ValueError,
    ["qkv_features=64", "num_heads=3", "divisible"],
  ),
  (
    "linen num_kv_heads not dividing num_heads",
    lambda: _linen(num_kv_heads=3),
    ValueError,
    ["num_kv_heads=3", "num_heads=4"],
  ),
  (
    "linen float num_heads",
    lambda: _linen(num_heads=4.0),
    TypeError,
    ["num_heads", "positive int", "float 4.0"],
  ),
  (
    "linen zero num_kv_heads",
    lambda: _linen(num_kv_heads=0),
    ValueError,
    ["num_kv_heads", "positive int", "0"],
  ),
  (
    "linen zero qkv_features",
    lambda: _linen(qkv_features=0),
    ValueError,
    ["qkv_features", "positive int"],
  ),
  (
    "linen dropout rate",
    lambda: _linen(dropout_rate=1.5),
    ValueError,
    ["dropout_rate", "[0, 1)", "1.5"],
  ),
  (
    "linen dropout rate str",
    lambda: _linen(dropout_rate="0.1"),
    TypeError,
    ["dropout_rate", "str '0.1'"],
  ),
  (
    "linen implementation",
    lambda: _linen(implementation="flash"),
    ValueError,
    ["implementation", "'flash'"],
  ),
  ("linen cudnn", lambda: _linen(implementation="cudnn"), NotImplementedError, ["cudnn"]),
  ("linen rope_base", lambda: _linen(rope=True, rope_base=1.0), ValueError, ["rope_base", "> 1"]),
  ("linen decode flag", lambda: _linen(decode=1), TypeError, ["decode", "bool", "int 1"]),
  (
    "linen wrong-shape mask",
    lambda: _linen(call=dict(mask=BAD_MASK)),
    ValueError,
    ["mask of shape (2, 4, 8, 9)", "not broadcastable", "(B, N, T, S)=(2, 4, 8, 8)"],
  ),
  (
    "linen float lengths",
    lambda: _linen(call=dict(query_seq_lengths=jnp.ones((B,)))),
    TypeError,
    ["query_seq_lengths", "float32"],
  ),
  (
    "nnx num_heads not dividing features",
    lambda: _nnx(3, D),
    ValueError,
    ["qkv_features=64", "num_heads=3"],
  ),
  (
    "nnx num_kv_heads not dividing num_heads",
    lambda: _nnx(num_kv_heads=3),
    ValueError,
    ["num_kv_heads=3", "num_heads=4"],
  ),
  ("nnx float num_heads", lambda: _nnx(4.0, D), TypeError, ["num_heads", "float 4.0"]),
  ("nnx bool num_heads", lambda: _nnx(True, D), TypeError, ["num_heads", "bool"]),
  ("nnx in_features str", lambda: _nnx(N, "64"), TypeError, ["in_features", "str '64'"]),
  ("nnx dropout rate", lambda: _nnx(dropout_rate=-0.1), ValueError, ["dropout_rate", "[0, 1)"]),
  (
    "nnx implementation",
    lambda: _nnx(implementation="flash"),
    ValueError,
    ["implementation", "'flash'"],
  ),
  (
    "nnx window",
    lambda: _nnx(local_window_size=(4, -1)),
    ValueError,
    ["local_window_size[1]", "-1"],
  ),
  ("nnx is_causal", lambda: _nnx(is_causal="causal"), ValueError, ["is_causal", "'causal'"]),
  (
    "nnx rngs",
    lambda: jattn.nnx.MultiHeadAttention(N, D, rngs=0),
    TypeError,
    ["rngs", "nnx.Rngs", "int"],
  ),
  (
    "nnx wrong-shape mask",
    lambda: _nnx_call(mask=BAD_MASK),
    ValueError,
    ["mask of shape (2, 4, 8, 9)", "not broadcastable"],
  ),
  (
    "nnx deterministic flag",
    lambda: _nnx_call(deterministic="yes"),
    TypeError,
    ["deterministic", "bool", "str"],
  ),
  ("nnx init_cache", lambda: _nnx().init_cache(0, 8), ValueError, ["batch_size", "positive int"]),
]


@pytest.mark.parametrize("what,call,exc,words", MODULE_CASES, ids=[c[0] for c in MODULE_CASES])
def test_module_errors(what, call, exc, words):
  _check(call, exc, words)


_fn = jattn.make_attention_fn

ATTENTION_FN_CASES = [
  ("implementation", lambda: _fn(implementation="fast"), ValueError, ["implementation", "'fast'"]),
  ("implementation int", lambda: _fn(implementation=2), TypeError, ["implementation", "int"]),
  ("block_q zero", lambda: _fn(block_q=0), ValueError, ["block_q", "positive int"]),
  ("block_kv float", lambda: _fn(block_kv=8.0), TypeError, ["block_kv", "float 8.0"]),
  ("is_causal string", lambda: _fn(is_causal="bottom"), ValueError, ["is_causal", "'bottom'"]),
  ("is_causal int", lambda: _fn(is_causal=1), TypeError, ["is_causal", "int"]),
  ("window negative", lambda: _fn(local_window_size=-1), ValueError, ["local_window_size"]),
  ("window float", lambda: _fn(local_window_size=2.5), TypeError, ["local_window_size"]),
  ("soft cap zero", lambda: _fn(logits_soft_cap=0), ValueError, ["logits_soft_cap"]),
  ("scale string", lambda: _fn(scale="x"), TypeError, ["scale", "str 'x'"]),
  ("score_mod", lambda: _fn(score_mod=3), TypeError, ["score_mod", "callable"]),
  (
    "call: dropout rate",
    lambda: _fn()(q, k, v, dropout_rate=1.0),
    ValueError,
    ["dropout_rate", "[0, 1)"],
  ),
  (
    "call: key head dim",
    lambda: _fn()(q, jnp.zeros((B, S, K, 8)), v),
    ValueError,
    ["key must have the head dim", "H=8"],
  ),
  ("call: rank", lambda: _fn()(q, k[0], v[0]), ValueError, ["equal rank"]),
  (
    "call: mask shape",
    lambda: _fn()(q, k, v, mask=jnp.ones((B, N, T, S + 1), bool)),
    ValueError,
    ["mask", "not broadcastable"],
  ),
  ("call: precision", lambda: _fn()(q, k, v, precision=3), TypeError, ["precision", "int"]),
  (
    "call: einsum",
    lambda: _fn()(q, k, v, einsum_dot_general=jax.lax.dot_general),
    NotImplementedError,
    ["einsum_dot_general"],
  ),
]


@pytest.mark.parametrize(
  "what,call,exc,words", ATTENTION_FN_CASES, ids=[c[0] for c in ATTENTION_FN_CASES]
)
def test_make_attention_fn_errors(what, call, exc, words):
  _check(call, exc, words)


# --------------------------------------------------------------------------------------------
# Ring attention, on one device (a 1-device mesh needs no multi-device setup).
# --------------------------------------------------------------------------------------------

rq, rk, rv = jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8, 1, 4)), jnp.zeros((1, 8, 1, 4))


def _sharded(*args, **kw):
  mesh = kw.pop("mesh", None) or jax.make_mesh((1,), ("s",))
  return jattn.ring_attention_sharded(*(args or (rq, rk, rv)), mesh=mesh, **{"seq_axis": "s", **kw})


RING_CASES = [
  (
    "ring_attention outside shard_map",
    lambda: jattn.ring_attention(rq, rk, rv, axis_name="s"),
    ValueError,
    ["axis_name='s'", "not a bound mesh axis", "shard_map"],
  ),
  (
    "ring_attention unhashable axis_name",
    lambda: jattn.ring_attention(rq, rk, rv, axis_name=["s"]),
    TypeError,
    ["axis_name", "hashable"],
  ),
  (
    "ring_attention layout",
    lambda: jattn.ring_attention(rq, rk, rv, axis_name="s", layout="striped"),
    ValueError,
    ["layout", "'striped'"],
  ),
  (
    "ring_attention layout int",
    lambda: jattn.ring_attention(rq, rk, rv, axis_name="s", layout=1),
    TypeError,
    ["layout", "int"],
  ),
  (
    "ring_attention boolean mask array",
    lambda: jattn.ring_attention(rq, rk, rv, mask=jnp.ones((8, 8), bool), axis_name="s"),
    NotImplementedError,
    ["boolean mask array", "all-gathered"],
  ),
  (
    "ring_attention mask str",
    lambda: jattn.ring_attention(rq, rk, rv, mask="causal", axis_name="s"),
    TypeError,
    ["mask", "jattn.masks", "str"],
  ),
  (
    "sharded unhashable axis",
    lambda: _sharded(batch_axis=["s"]),
    TypeError,
    ["batch_axis", "mesh axis name"],
  ),
  (
    "ring_attention bias",
    lambda: jattn.ring_attention(rq, rk, rv, jnp.zeros((8, 8)), axis_name="s"),
    NotImplementedError,
    ["does not support bias"],
  ),
  (
    "zigzag num_devices 0",
    lambda: jattn.zigzag_permute(jnp.zeros((1, 8)), 0),
    ValueError,
    ["num_devices", "positive int", "0"],
  ),
  (
    "zigzag num_devices float",
    lambda: jattn.zigzag_permute(jnp.zeros((1, 8)), 2.0),
    TypeError,
    ["num_devices", "float 2.0"],
  ),
  (
    "zigzag num_devices bool",
    lambda: jattn.zigzag_permute(jnp.zeros((1, 8)), True),
    TypeError,
    ["num_devices", "bool"],
  ),
  (
    "zigzag odd length",
    lambda: jattn.zigzag_permute(jnp.zeros((1, 7)), 1),
    ValueError,
    ["2 * num_devices = 2", "x.shape[1] = 7", "multiple of 2"],
  ),
  (
    "zigzag axis float",
    lambda: jattn.zigzag_unpermute(jnp.zeros((1, 8)), 2, axis=1.0),
    TypeError,
    ["axis", "float"],
  ),
  (
    "zigzag axis out of range",
    lambda: jattn.zigzag_permute(jnp.zeros((1, 8)), 2, axis=2),
    ValueError,
    ["axis=2", "out of range"],
  ),
  (
    "sharded non-Mesh mesh",
    lambda: _sharded(mesh="s"),
    TypeError,
    ["mesh", "jax.sharding.Mesh", "str"],
  ),
  (
    "sharded unknown axis",
    lambda: _sharded(seq_axis="sp"),
    ValueError,
    ["seq_axis='sp'", "not an axis of the mesh"],
  ),
  ("sharded same axis twice", lambda: _sharded(batch_axis="s"), ValueError, ["distinct"]),
  ("sharded bad layout", lambda: _sharded(layout="striped"), ValueError, ["layout", "'striped'"]),
  (
    "sharded rank",
    lambda: _sharded(rq[0], rk[0], rv[0]),
    ValueError,
    ["query", "(B, T|S, N|K, H)"],
  ),
  ("sharded axis_name", lambda: _sharded(axis_name="s"), TypeError, ["seq_axis=", "axis_name"]),
  (
    "sharded key head dim",
    lambda: _sharded(rq, rk[..., :3], rv),
    ValueError,
    ["key must have the head dim H of query", "H=4", "H=3"],
  ),
  (
    "sharded float lengths",
    lambda: _sharded(query_seq_lengths=jnp.ones((1,))),
    TypeError,
    ["query_seq_lengths", "float32"],
  ),
  (
    "sharded return_residual int",
    lambda: _sharded(return_residual=1),
    TypeError,
    ["return_residual", "bool"],
  ),
  (
    "merge_attention int outs",
    lambda: jattn.merge_attention([jnp.zeros((2, 3), jnp.int32)], [jnp.zeros((2,))]),
    TypeError,
    ["outs", "floating"],
  ),
  (
    "merge_attention shapes",
    lambda: jattn.merge_attention([jnp.zeros((2, 3))], [jnp.zeros((3,))]),
    ValueError,
    ["lses", "outs.shape"],
  ),
  (
    "merge_attention mixed dtypes",
    lambda: jattn.merge_attention(
      [jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.bfloat16)], [jnp.zeros((2,))] * 2
    ),
    TypeError,
    ["outs", "dtype"],
  ),
  (
    "merge_attention mixed shapes",
    lambda: jattn.merge_attention([jnp.zeros((2, 3)), jnp.zeros((1, 3))], [jnp.zeros((2,))] * 2),
    ValueError,
    ["outs", "shape"],
  ),
]


@pytest.mark.parametrize(
  "what,call,exc,words", RING_CASES, ids=[getattr(c, "values", c)[0] for c in RING_CASES]
)
def test_ring_errors(what, call, exc, words):
  _check(call, exc, words)


def test_auto_partitioning_takes_a_bool():
  with pytest.raises(TypeError, match="auto_partitioning: enabled must be a bool, got str"):
    with jattn.auto_partitioning("no"):
      pass
  # On one device the setting changes nothing: the same result either way.
  q = jnp.ones((1, 8, 2, 4))
  with jattn.auto_partitioning(False):
    off = jattn.dot_product_attention(q, q, q, implementation="chunked")
  np.testing.assert_array_equal(off, jattn.dot_product_attention(q, q, q, implementation="chunked"))


@pytest.mark.parametrize(
  "keyword, value, name",
  [
    ("mask", "causal", "mask"),
    ("mask", object(), "mask"),
    ("bias", "additive", "bias"),
    ("query_seq_lengths", "8", "query_seq_lengths"),
    ("kv_segment_ids", {"doc": 1}, "kv_segment_ids"),
  ],
)
def test_an_argument_of_the_wrong_python_type_is_named(keyword, value, name):
  # Not left to jit, whose error while flattening names only a path (given.mask).
  q = jnp.ones((1, 8, 2, 8))
  extra = {"q_segment_ids": jnp.zeros((1, 8), jnp.int32)} if keyword == "kv_segment_ids" else {}
  for f in (
    jattn.dot_product_attention,
    lambda q, k, v, **kw: jattn.diagnostics.attention_stats(q, k, **kw),
  ):
    with pytest.raises(TypeError, match=f"^{name} must be"):
      f(q, q, q, **{keyword: value}, **extra)


def test_a_numpy_float64_query_is_a_float32_call_as_under_jit():
  """NumPy's default dtype is float64: paged_attention (not jitted at its entry) takes it as
  jax.jit takes it, float32 without x64, like dot_product_attention."""
  kp = jnp.ones((4, 4, 2, 8), jnp.float32)
  q = np.random.default_rng(0).normal(size=(1, 1, 4, 8))
  out = jattn.paged_attention(q, kp, kp + 1, np.array([[0, 1]]), np.array([3]))
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, 2.0, rtol=1e-6)
  with pytest.raises(
    TypeError, match=r"query and key_pages must have one dtype .*query.dtype=bfloat16"
  ):
    jattn.paged_attention(q.astype(jnp.bfloat16), kp, kp + 1, np.array([[0, 1]]), np.array([3]))


@pytest.mark.parametrize(
  "call",
  [
    lambda x, n: jattn.dot_product_attention(x, x, x, key_value_seq_lengths=n),
    lambda x, n: jattn.dot_product_attention(x, x, x, query_seq_lengths=n),
    lambda x, n: jattn.dot_product_attention(x, x, x, mask=jattn.masks.lengths(kv_lengths=n)),
    lambda x, n: jattn.attention_received(x, x, key_value_seq_lengths=n),
  ],
  ids=["kv", "q", "mask", "received"],
)
def test_a_known_negative_length_is_refused(call):
  x = jnp.ones((2, 4, 2, 8))
  with pytest.raises(ValueError, match=r"lengths.* must be >= 0 .*\[1\]=-2"):
    call(x, np.array([3, -2], np.int32))
  # Above the sequence: all of it, as jax.nn reads it.
  np.testing.assert_allclose(
    jattn.dot_product_attention(x, x, x, key_value_seq_lengths=np.array([9, 4], np.int32)),
    jax.nn.dot_product_attention(x, x, x, key_value_seq_lengths=np.array([9, 4], np.int32)),
    rtol=1e-6,
  )


@pytest.mark.parametrize("jit", [False, True])
def test_a_score_mod_of_the_wrong_arity_is_named(jit):
  x = jnp.ones((1, 4, 2, 8))
  call = lambda x: jattn.dot_product_attention(x, x, x, score_mod=lambda s, b: s)
  with pytest.raises(TypeError, match=r"score_mod must take five positional arguments"):
    (jax.jit(call) if jit else call)(x)
  with pytest.raises(TypeError, match=r"score_mod must take five"):
    jattn.make_attention_fn(score_mod=lambda s, b, h: s)
  # Defaults and *args are fine.
  ok = lambda s, *idx: s
  np.testing.assert_array_equal(
    jattn.dot_product_attention(x, x, x, score_mod=ok), jattn.dot_product_attention(x, x, x)
  )
