"""The platform a Pallas kernel is built for, from the default backend: one answer for every op's
kernels (the triadic op, the multi-state op, the short convolution)."""

from __future__ import annotations

import jax


def default_platform() -> str:
  """"gpu" where the default backend is a GPU (Triton or Mosaic GPU kernels), "tpu" on a TPU
  (Mosaic), else "cpu" (the kernels run in interpret mode)."""
  backend = jax.default_backend()
  return "gpu" if backend in ("gpu", "cuda", "rocm") else ("tpu" if backend == "tpu" else "cpu")
