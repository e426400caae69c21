"""What the benchmark scripts share: the machine line every table starts with, and op inputs."""

from __future__ import annotations

import os
import platform

import jax
import jax.numpy as jnp


def machine() -> str:
  """Host, accelerator kind and count, CPU count and jax version, for the table header."""
  dev = jax.devices()[0]
  return (f"{platform.node()} | {dev.platform} {dev.device_kind} x{jax.device_count()} | "
          f"{os.cpu_count()} CPUs | jax {jax.__version__}")


def triadic_inputs(key, b, t, h, d, vdim, e, dtype):
  """Layer-like inputs of ``triadic_gdn``: unit q, k; non-negative unit k2, q2; weak decay g <= 0;
  beta in (0, 1). q, k, v, k2, q2 in ``dtype``; g and beta float32."""
  ks = jax.random.split(key, 7)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t, h, d)))
  k = unit(jax.random.normal(ks[1], (b, t, h, d)))
  v = jax.random.normal(ks[2], (b, t, h, vdim))
  k2 = unit(jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, e))))
  q2 = unit(jax.nn.softplus(jax.random.normal(ks[4], (b, t, h, e))))
  g = -0.1 * jax.nn.softplus(jax.random.normal(ks[5], (b, t, h, e)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[6], (b, t, h)))
  return [x.astype(dtype) for x in (q, k, v, k2, q2)] + [g, beta]
