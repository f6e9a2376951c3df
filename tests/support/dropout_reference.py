"""jattn's dropout keep-mask written from its specification (docs/dropout.md), in NumPy.

Independent of jattn's code on purpose: a test whose reference calls the library's own hash
cannot see a bug in it (an index dropped from the hash, say).
"""

from __future__ import annotations

import jax
import numpy as np

_M32 = np.uint64(0xFFFFFFFF)


def _mul(x, c):
  return (x * np.uint64(c)) & _M32


def _mix(x):
  x = x ^ (x >> np.uint64(16))
  x = _mul(x, 0x7FEB352D)
  x = x ^ (x >> np.uint64(15))
  x = _mul(x, 0x846CA68B)
  return x ^ (x >> np.uint64(16))


def seed_words(dropout_rng):
  """(s0, s1): two uint32 words from the key, as the specification draws them."""
  words = np.asarray(jax.random.bits(dropout_rng, (2,), np.uint32)).astype(np.uint64)
  return words[0], words[1]


def keep(dropout_rng, rate, b, n, t, s):
  """True where the weight at global indices (b, n, t, s) is kept; the index arrays broadcast."""
  s0, s1 = seed_words(dropout_rng)
  u = lambda i: np.asarray(i, np.int64).astype(np.uint64) & _M32
  x = _mix(s0 ^ _mul(u(b), 0x9E3779B9))
  x = _mix(x ^ ((u(n) + s1) & _M32))
  x = _mix(x ^ _mul(u(t), 0x85EBCA6B))
  x = _mix(x ^ _mul(u(s), 0xC2B2AE35))
  threshold = min(int(round(rate * 2.0**32)), 2**32 - 1)  # noqa: RUF046
  return x >= np.uint64(threshold)


def keep_mask(dropout_rng, rate, B, N, T, S, broadcast=False):
  """The (B, N, T, S) keep-mask ((1, 1, T, S) when broadcast over examples and heads)."""
  b, n, t, s = np.ix_(
    np.arange(1 if broadcast else B), np.arange(1 if broadcast else N), np.arange(T), np.arange(S)
  )
  return keep(dropout_rng, rate, b, n, t, s)
