"""A strict numerical environment: no implicit dtype promotion, no implicit rank broadcasting."""

import os

# Tests run on the CPU; a few need float64 for the references computed with jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles a thousand small programs and runs each a few times: compiling dominates.
# This lowers only LLVM's code generation effort (XLA's backend optimization level 0); the HLO
# passes -- fusion, loop analysis, buffer assignment, everything the structure and memory tests
# read -- are the ones users get. Subprocess tests inherit it through the environment.
# JATTN_TEST_FULL_OPT=1 runs the suite with full code generation instead.
if os.environ.get("JATTN_TEST_FULL_OPT", "") not in ("", "0"):
  os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
else:
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
