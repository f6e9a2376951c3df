"""A strict numerical environment: no implicit dtype promotion, no implicit rank broadcasting."""

import os

# Tests run on the CPU; a few need float64 for the references computed with jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
