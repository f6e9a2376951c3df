"""Argument checks, and the one error policy of jattn.

Every malformed call fails at trace time, before any kernel runs, with an error that names the
argument, shows what was passed (its type and value, or an array's dtype and shape) and says what
was expected. The exception type says what kind of mistake it is:

  TypeError            the argument has the wrong type or dtype: a float or a str where an int is
                       needed, an int array where a floating one is, a non-callable where a
                       function is, a non-bool flag. Bools are never ints or numbers here; NumPy
                       integer and real scalars are accepted wherever Python ones are.
  ValueError           the type is right but the value or shape is not: a negative or zero size,
                       a rate outside its range, an unknown option string, an array of the wrong
                       shape or rank, arrays that disagree with each other.
  NotImplementedError  a valid request that jattn does not support (``implementation='splash'``
                       with a bias array, a bias array in ring attention, ...).

When arrays disagree, the argument named is the one that is wrong: query is the reference, key is
checked against query (rank, dtype, batch, head dim, heads), value against key, and masks,
lengths, segment ids, bias and sinks against the (B, N, T, S) that query and key imply.

Checks use the named checkers below (`integer`, `positive_int`, `non_negative_int`, `real`,
`flag`, `one_of`, `function`, `instance`, `hashable`, `axis`, `float_array`, `int_array`,
`bool_array`) rather than open-coded ``isinstance`` tests, so the policy and its messages stay
one. The option checks (`scale`, `causal`, `window`, `soft_cap`, `dropout`, `implementation`,
`block`) return the normalised value. Nothing here runs inside the custom-VJP kernels.
"""

from __future__ import annotations

import inspect
import numbers
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _registry, _types

IMPLEMENTATIONS = ("dense", "chunked")
CAUSAL_ALIGNMENTS = typing.get_args(_types.CausalAlignment)  # ("top_left", "bottom_right")
RING_ORDERS = typing.get_args(_types.RingOrder)  # ("contiguous", "zigzag")
SCHEDULES = typing.get_args(_types.Schedule)  # ("serial", "parallel")


# ---- the named checkers --------------------------------------------------------------------


def concrete(*dims) -> bool:
  """Whether every dimension is a known integer (jax.export's symbolic dimensions are not)."""
  return all(isinstance(d, (int, np.integer)) for d in dims)


def describe(value) -> str:
  """What was passed, for a message: ``str '3'``, ``float 2.5``, ``Array of dtype float32 and
  shape (2, 3)``."""
  kind = "jax.Array" if isinstance(value, jax.Array) else type(value).__name__
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is not None and dtype is not None and getattr(value, "ndim", 0) != 0:
    return f"{kind} of dtype {dtype} and shape {tuple(shape)}"
  text = repr(value)
  if len(text) > 80:
    text = text[:77] + "..."
  return f"{kind} {text}"


def is_int(value) -> bool:
  """A Python or NumPy integer scalar, not a bool."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
  """A Python or NumPy real scalar (ints included), not a bool."""
  return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _or_none(optional):
  return " or None" if optional else ""


def _int_text(minimum):
  if minimum is None:
    return "an int"
  if minimum == 1:
    return "a positive int"
  if minimum == 0:
    return "a non-negative int"
  return f"an int >= {minimum}"


def integer(name: str, value, *, minimum: int | None = None, optional: bool = False):
  """An int (``>= minimum`` if given) as a Python int; ``optional``: None passes as None.

  TypeError for a non-int (a bool, float or str included), ValueError below ``minimum``.
  """
  if value is None and optional:
    return None
  if not is_int(value):
    raise TypeError(
      f"{name} must be {_int_text(minimum)}{_or_none(optional)}, got {describe(value)}"
    )
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be {_int_text(minimum)}{_or_none(optional)}, got {int(value)}")
  return int(value)


def positive_int(name: str, value, *, optional: bool = False):
  """An int >= 1 (see `integer`)."""
  return integer(name, value, minimum=1, optional=optional)


def non_negative_int(name: str, value, *, optional: bool = False):
  """An int >= 0 (see `integer`)."""
  return integer(name, value, minimum=0, optional=optional)


def _range_text(above, at_least, below, at_most):
  lo = f"({above}" if above is not None else f"[{at_least}" if at_least is not None else None
  hi = f"{below})" if below is not None else f"{at_most}]" if at_most is not None else None
  if lo is not None and hi is not None:
    return f" in {lo}, {hi}"
  if lo is not None:
    return f" > {above}" if above is not None else f" >= {at_least}"
  if hi is not None:
    return f" < {below}" if below is not None else f" <= {at_most}"
  return ""


def real(
  name: str,
  value,
  *,
  optional: bool = False,
  finite: bool = True,
  above=None,
  at_least=None,
  below=None,
  at_most=None,
):
  """A real number (Python or NumPy, ints included, bools not) as a Python float.

  ``above`` / ``at_least`` / ``below`` / ``at_most`` bound it (exclusive / inclusive; a positive
  number is ``above=0``); ``finite`` refuses inf and NaN (NaN fails every bound too).
  ``optional``: None passes as None. TypeError for a non-number, ValueError out of range.
  """
  if value is None and optional:
    return None
  bounds = f"{_range_text(above, at_least, below, at_most)}{_or_none(optional)}"
  if not is_real(value):
    raise TypeError(f"{name} must be a real number{bounds}, got {describe(value)}")
  expected = f"a {'finite ' if finite else ''}real number{bounds}"
  x = float(value)
  ok = not (finite and not np.isfinite(x))
  ok = ok and (above is None or x > above) and (at_least is None or x >= at_least)
  ok = ok and (below is None or x < below) and (at_most is None or x <= at_most)
  if not ok:
    raise ValueError(f"{name} must be {expected}, got {value!r}")
  return x


def flag(name: str, value, *, optional: bool = False):
  """A Python or NumPy bool as a Python bool (ints are not bools); ``optional``: None passes."""
  if value is None and optional:
    return None
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool{_or_none(optional)}, got {describe(value)}")
  return bool(value)


def one_of(name: str, value, choices, *, expected: str | None = None):
  """One of ``choices`` (strings, or None). TypeError when ``value`` does not even have the
  choices' type, ValueError for a value of the right type that is not among them. ``expected``
  overrides the "one of ..." text of the message."""
  kinds = tuple({type(c) for c in choices if c is not None})
  if value is None and None in choices:
    return None
  expected = expected or f"one of {', '.join(repr(c) for c in choices)}"
  if not isinstance(value, kinds):
    raise TypeError(f"{name} must be {expected}, got {describe(value)}")
  if value not in choices:
    raise ValueError(f"{name} must be {expected}, got {value!r}")
  return value


def function(name: str, value, *, optional: bool = False):
  """A callable (``optional``: or None), else TypeError."""
  if value is None and optional:
    return None
  if not callable(value):
    raise TypeError(f"{name} must be callable{_or_none(optional)}, got {describe(value)}")
  return value


def callable_or_none(name: str, value):
  return function(name, value, optional=True)


def score_function(name: str, value):
  """A score_mod: None, or a function that takes (score, batch, head, q_index, kv_index); else
  a TypeError naming it and that signature (Python's own says only how many arguments it
  got, from deep inside a trace)."""
  fn = callable_or_none(name, value)
  if fn is None:
    return None
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin without a signature: let the call tell
    return fn
  try:
    signature.bind(*range(5))
  except TypeError as e:
    raise TypeError(
      f"{name} must take five positional arguments, f(score, batch, head, q_index, kv_index) "
      f"-> score, got {getattr(fn, '__name__', type(fn).__name__)}{signature} ({e})"
    ) from None
  return fn


def instance(name: str, value, types, expected: str):
  """``isinstance(value, types)``, else TypeError ("{name} must be {expected}, got ...")."""
  if not isinstance(value, types):
    raise TypeError(f"{name} must be {expected}, got {describe(value)}")
  return value


def hashable(name: str, value, expected: str = "hashable"):
  """A hashable value (a mesh axis name, a static option), else TypeError."""
  try:
    hash(value)
  except TypeError:
    raise TypeError(f"{name} must be {expected}, got {describe(value)}") from None
  return value


def axis(name: str, value, shape) -> int:
  """An axis index into an array of ``shape`` (negative counts from the end), normalised to
  0 .. ndim-1. TypeError for a non-int, ValueError out of range."""
  ndim = len(shape)
  value = integer(name, value)
  if not -ndim <= value < ndim:
    raise ValueError(
      f"{name}={value} is out of range for an array of rank {ndim} (shape {tuple(shape)})"
    )
  return value % ndim


def as_array(name, x, expected):
  """``x`` as an array (arrays and tracers as they are); TypeError naming ``name`` and what was
  ``expected`` for anything else."""
  if hasattr(x, "dtype") and hasattr(x, "shape"):
    return x
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be {expected}, got {describe(x)}") from None


def float_array(name: str, x):
  """An array (or array-like) with a floating dtype, else TypeError. A NumPy array becomes a
  jax array as ``jax.jit`` would make it (float64 is float32 unless x64 is on): NumPy's default
  float64 must not set the dtype of a call that is not jitted at its entry."""
  if isinstance(x, np.ndarray):
    x = jnp.asarray(x)
  x = as_array(name, x, "a floating array")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {name}.dtype={x.dtype}")
  return x


def int_array(name: str, x, *, optional: bool = False):
  """An array (or array-like) with an integer dtype (bool is not one), else TypeError;
  ``optional``: None passes. Shapes are the caller's to check (ValueError)."""
  if x is None and optional:
    return None
  x = as_array(name, x, "an integer array")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
  return jnp.asarray(x)


def bool_array(name: str, x, expected: str = "a boolean array"):
  """An array (or array-like) of dtype bool, else TypeError ("{name} must be {expected}")."""
  x = as_array(name, x, expected)
  if x.dtype != jnp.bool_:
    raise TypeError(f"{name} must be {expected}, got dtype {x.dtype}")
  return jnp.asarray(x)


# ---- static options ------------------------------------------------------------------------


def scale(value):
  return real("scale", value, optional=True)


def scale_operand(value):
  """``scale`` of the public function: (static float or None, jax scalar operand or None).

  Python and NumPy numbers are static (part of the jit cache key, applied to the float32
  logits); a jax array, concrete or traced, is an operand (jax.nn accepts both).
  """
  if isinstance(value, jax.Array):  # tracers are jax.Arrays too
    if value.shape != ():
      raise ValueError(f"scale must be a scalar, got an array of shape {value.shape}")
    if not (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
      raise TypeError(f"scale must be a real number, got dtype {value.dtype}")
    return 1.0, value
  if isinstance(value, np.ndarray) and value.shape == ():
    value = value[()]
  return scale(value), None


def causal(value):
  """``is_causal``: False/None -> None, True -> "top_left", or an alignment string."""
  if isinstance(value, (bool, np.bool_)):
    return "top_left" if value else None
  if value is None:
    return None
  return one_of(
    "is_causal", value, CAUSAL_ALIGNMENTS, expected="a bool, 'top_left' or 'bottom_right'"
  )


def window(value):
  """``local_window_size``: ``w`` means ``(w, w)`` as in jax.nn; ``None`` on a side: unbounded."""
  name = "local_window_size"
  if value is None:
    return None
  if is_int(value):
    w = non_negative_int(name, value)
    return (w, w)
  if not isinstance(value, (tuple, list)):
    raise TypeError(
      f"{name} must be None, an int or a (left, right) pair of ints (None on a "
      f"side: unbounded), got {describe(value)}"
    )
  if len(value) != 2:
    raise ValueError(
      f"{name} must be an int or a (left, right) pair, got {len(value)} values {tuple(value)!r}"
    )
  left, right = (
    non_negative_int(f"{name}[{i}] ({side})", v, optional=True)
    for i, (side, v) in enumerate(zip(("left", "right"), value))
  )
  return None if (left, right) == (None, None) else (left, right)


def soft_cap(value):
  return real("logits_soft_cap", value, optional=True, above=0)


def dropout(rate, rng):
  rate = real("dropout_rate", rate, at_least=0, below=1)
  if rate > 0 and rng is None:
    raise ValueError(f"dropout_rate={rate} needs dropout_rng (a PRNG key), got None")
  if rate > 0:
    _prng_key("dropout_rng", rng)
  return rate


def _prng_key(name, key):
  """One PRNG key: a typed key of shape (), or a raw uint32 key (jax.random.PRNGKey) of rank 1."""
  shape, dtype = getattr(key, "shape", None), getattr(key, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if shape != ():
      raise ValueError(
        f"{name} must be a single PRNG key, got a key array of shape {shape} "
        f"(split keys are for several calls)"
      )
    return
  if dtype != jnp.uint32 or shape is None or len(shape) != 1:
    raise TypeError(
      f"{name} must be a PRNG key (jax.random.key(...), or a raw uint32 "
      f"jax.random.PRNGKey(...)), got "
      f"{type(key).__name__ if dtype is None or shape is None else f'{dtype}{tuple(shape)}'}"
    )


def implementation(value):
  """None (automatic), one name, or a sequence of names tried in order (tokamax's rule): returns
  None, the name, or a tuple of two or more names, each a name of `jattn._registry` ("xla" is
  jax.nn's name for "dense")."""
  if value is None:
    return None
  listed = ", ".join(
    repr(n) + "".join(f" (or {a!r})" for a in b.aliases) for n, b in _registry.REGISTRY.items()
  )
  expected = f"None, {listed}, or a sequence of these tried in order"
  names = _registry.names()
  if isinstance(value, (list, tuple)):
    if not value:
      raise ValueError(f"implementation: expected {expected}, got an empty {type(value).__name__}")
    seq = tuple(one_of("implementation", v, names, expected=expected) for v in value)
  else:
    seq = (one_of("implementation", value, names, expected=expected),)
  seq = tuple(dict.fromkeys(_registry.canonical(v) for v in seq))  # order kept, once each
  return seq[0] if len(seq) == 1 else seq


def implementation_names(implementation) -> tuple[str, ...]:
  """A validated ``implementation`` (None, a name or a tuple of names) as a tuple (None: ())."""
  return (implementation,) if isinstance(implementation, str) else implementation or ()


def block(name, value):
  return positive_int(name, value, optional=True)


# ---- arrays --------------------------------------------------------------------------------


_float_array = float_array  # the older private name


def broadcastable(name, x, shape, letters):
  """Rank <= 4, each dim either 1 or the full size (no silent broadcasting of other sizes)."""
  if x.ndim > 4:
    raise ValueError(
      f"{name} must have rank <= 4, broadcastable to {letters}={shape}, got shape {tuple(x.shape)}"
    )
  x4 = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
  for got, want in zip(x4.shape, shape):
    if got not in (1, want):
      raise ValueError(
        f"{name} of shape {tuple(x.shape)} is not broadcastable to {letters}={shape}: each "
        f"dimension must be 1 or the full size"
      )
  return x4


def mask_array(x, shape):
  """The ``mask`` argument given as an array: boolean, of rank <= 4, broadcastable to the
  (B, N, T, S) ``shape`` (returned as rank 4)."""
  x = as_array("mask", x, "a boolean array or a jattn.masks object")
  if x.dtype != jnp.bool_:
    raise TypeError(
      f"mask must be a boolean array (True = attend) or a jattn.masks object, "
      f"got dtype {x.dtype}; pass additive masks as bias"
    )
  return broadcastable("mask", jnp.asarray(x), shape, "(B, N, T, S)")


def known_lengths(name: str, x) -> None:
  """Lengths known now (not traced) must not be negative: ValueError naming the argument, the
  first bad entry and its value. A length above the sequence means the whole sequence, as in
  jax.nn (it only hides positions at and past it)."""
  if x is None or isinstance(x, jax.core.Tracer):
    return
  try:
    values = np.asarray(x)
  except (TypeError, ValueError):
    return  # not an array: the dtype and shape checks name it
  if values.dtype.kind not in "iu" or values.ndim != 1:
    return
  bad = np.flatnonzero(values < 0)
  if bad.size:
    i = int(bad[0])
    raise ValueError(
      f"{name} must be >= 0 (a valid length per example), got {name}[{i}]={int(values[i])}"
    )


def int_vector(name, x, B, *, checked=False):
  """An int (B,) array as int32. ``checked``: only check (mask objects keep their own arrays);
  None passes."""
  if x is None:
    return None
  x = as_array(name, x, f"an integer array of shape (B,)=({B},)")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array of shape (B,)=({B},), got dtype {x.dtype}")
  x = jnp.asarray(x)
  if x.shape != (B,):
    raise ValueError(f"{name} must have shape (B,)=({B},), got {x.shape}")
  return x if checked else x.astype(jnp.int32)


def segment_ids(name, x, B, L, letter, *, checked=False):
  x = as_array(name, x, f"an integer array of shape (B, {letter})=({B}, {L})")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(
      f"{name} must be an integer array of shape (B, {letter})=({B}, {L}), got dtype {x.dtype}"
    )
  x = jnp.asarray(x)
  if x.ndim == 1 and B == 1 and not checked:
    x = x[None]
  if x.shape != (B, L):
    raise ValueError(f"{name} must have shape (B, {letter})=({B}, {L}), got {x.shape}")
  return x if checked else x.astype(jnp.int32)
