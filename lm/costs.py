"""What a model costs, computed without allocating it: parameters (``jax.eval_shape``), training
FLOPs per token (for MFU) and the bytes of recurrent state one sequence carries at decode time.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm import mixers
from lm.model import LM, ModelConfig


def param_shapes(cfg: ModelConfig):
  """The model's parameter tree of ShapeDtypeStructs (nothing is allocated)."""
  variables = jax.eval_shape(LM(cfg).init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))
  return nn.unbox(variables["params"])


def count_params(cfg: ModelConfig) -> dict[str, int]:
  """``total`` and ``non_embedding`` (total minus the input embedding table) parameter counts."""
  params = param_shapes(cfg)
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  embedding = math.prod(params["embed"]["embedding"].shape)
  return {"total": total, "non_embedding": total - embedding}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward = 3x forward), an estimate for MFU.

  Matmuls: 6 x non-embedding parameters (the head included); each mixer adds its own term
  (``lm.mixers.Mixer.flops``: attention's scores, a recurrent state's reads and writes).
  """
  flops = 6.0 * count_params(cfg)["non_embedding"]
  return flops + sum(mixers.get(m).flops(cfg, seq_len) for m in cfg.layers())


def state_bytes(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
  """Decode-time memory per sequence: ``recurrent_state`` (fp32 states, conv caches and MERLIN's
  segment moments, independent of length) and ``kv_cache`` (attention layers at ``seq_len``,
  in the compute dtype)."""
  total = {"recurrent_state": 0, "kv_cache": 0}
  for mixer in cfg.layers():
    for key, value in mixers.get(mixer).state_bytes(cfg, seq_len).items():
      total[key] += int(value)
  return total


# Peak dense bf16 TFLOP/s per device, by the start of ``jax.Device.device_kind``.
PEAK_TFLOPS = {"NVIDIA H100": 989.0, "NVIDIA H200": 989.0, "NVIDIA H20": 148.0,
               "NVIDIA A100": 312.0, "NVIDIA B200": 2250.0, "TPU v4": 275.0, "TPU v5 lite": 197.0,
               "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v6 lite": 918.0, "TPU v6e": 918.0}


def peak_flops(device_kind: str, override_tflops: float = 0.0) -> float | None:
  """Peak FLOP/s of one device for MFU: ``override_tflops`` if > 0, else the ``PEAK_TFLOPS``
  entry whose name ``device_kind`` starts with (the longest), else None (unknown, e.g. a CPU)."""
  if override_tflops and override_tflops > 0:
    return override_tflops * 1e12
  match = [k for k in PEAK_TFLOPS if device_kind.startswith(k)]
  return PEAK_TFLOPS[max(match, key=len)] * 1e12 if match else None
