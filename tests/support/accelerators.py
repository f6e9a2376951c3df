"""Lowering for an accelerator from this CPU: what the GPU tests (paged kernels, pallas_gpu) share."""

import contextlib

import jax


def abstract_gpu():
  """A context in which Triton's lowering finds a GPU to lower for (jax 0.12 asks which one,
  even from a CPU): an abstract mesh of one NVIDIA H200; nothing to set on jax 0.10."""
  if not hasattr(jax.sharding, "AbstractDevice"):  # jax 0.10: Triton's lowering asks nothing
    return contextlib.nullcontext()
  gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
  return jax.sharding.use_abstract_mesh(
    jax.sharding.AbstractMesh(
      (1,), ("x",), abstract_device=gpu, axis_types=(jax.sharding.AxisType.Auto,)
    )
  )
