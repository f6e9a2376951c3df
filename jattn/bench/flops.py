"""FLOP counts and dense-memory estimates of an attention case.

FLOP convention (the one FlashAttention's benchmarks use, so numbers compare across projects):
only visible (query, key) pairs count, and each counts the multiply-adds of the matmuls an
attention with recomputation performs on it, 2 FLOPs per multiply-add:

  forward:            Q K^T and P V                             -> 2 matmuls: 2*H + 2*Hv per pair
  forward+backward:   forward, then Q K^T again (recompute P), dV = P^T dO, dP = dO V^T,
                      dQ = dS K, dK = dS^T Q                    -> 7 matmuls: 3.5 x forward

The count is a property of the case, not of the implementation: a dense kernel that computes the
whole (T, S) matrix and masks it afterwards, or a backward that keeps P instead of recomputing it,
is credited the same FLOPs, so FLOP/s ratios between rows are exactly speed ratios. Softmax,
scaling and masking (O(T*S) elementwise work) are not counted.
"""

from __future__ import annotations

from jattn.bench import masks as _masks

FORWARD = "forward"
FORWARD_BACKWARD = "forward+backward"
PASSES = (FORWARD, FORWARD_BACKWARD)

# Matmuls per visible pair, relative to the forward pass's two (see the module docstring).
PASS_FACTOR = {FORWARD: 1.0, FORWARD_BACKWARD: 3.5}

# Dense temporaries in units of one fp32 (B, N, T, S) score matrix: the largest of XLA's compiled
# temp memory on CPU (jax 0.10, T = 1024-8192, N = 8): forward 2 for jax.nn and flax, 3 for
# jattn dense with a mask; forward+backward 4.0-4.1 for all three. An estimate must not be low.
DENSE_SCORE_COPIES = {FORWARD: 3, FORWARD_BACKWARD: 4}


def attention_flops(
  B: int, N: int, T: int, S: int, H: int, spec: _masks.MaskSpec, pass_: str, Hv: int | None = None
) -> float:
  """FLOPs of one call: query (B, T, N, H), key (B, S, K, H), value (B, S, K, Hv), mask ``spec``.

  K (the key/value heads) does not enter: GQA shares keys, not arithmetic.
  """
  if pass_ not in PASS_FACTOR:
    raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
  Hv = H if Hv is None else Hv
  pairs = _masks.visible_pairs(T, S, spec)
  forward = 2.0 * B * N * pairs * (H + Hv)
  return forward * PASS_FACTOR[pass_]


def dense_memory_estimate(B: int, N: int, T: int, S: int, pass_: str) -> int:
  """Bytes a dense implementation's temporaries need: fp32 (B, N, T, S) scores times a factor.

  Used before compiling, to skip cases that would not fit instead of letting them take the
  machine down. Chunked kernels are not estimated this way: their memory is O(T), and their
  compiled memory is checked after compiling instead.
  """
  if pass_ not in DENSE_SCORE_COPIES:
    raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
  return B * N * T * S * 4 * DENSE_SCORE_COPIES[pass_]
