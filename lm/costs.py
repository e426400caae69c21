"""What a model costs, computed without allocating it: parameters (``jax.eval_shape``), training
FLOPs per token (for MFU) and the bytes of recurrent state one sequence carries at decode time.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.model import LM, ModelConfig
from lm.mixers import MULTISTATE


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


def _mixer_dims(cfg: ModelConfig, mixer: str) -> tuple[int, int, int]:
  """(E, key dim, value dim) of one head's state matrix."""
  if mixer in ("mamba2", "multistate_mamba2"):
    return 1, cfg.state_dim, cfg.head_dim
  e = cfg.expand_e if mixer in ("triadic_gdn", "triadic_sgla") else 1
  return e, cfg.head_dim, cfg.head_dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward = 3x forward), an estimate for MFU.

  Matmuls: 6 x non-embedding parameters (the head included). Attention: 6 T H D per layer (the
  causal half of QK^T and AV). Recurrent mixers, per head: reading and writing the E x D x V state
  (2 x 2 E D V) plus the intra-chunk products (2 C (D + V + E)); multi-state mixers also read on
  average T / (2 L) segment states.
  """
  flops = 6.0 * count_params(cfg)["non_embedding"]
  for mixer in cfg.layers():
    if mixer == "attention":
      flops += 6.0 * seq_len * cfg.num_heads * cfg.head_dim
      continue
    e, d, v = _mixer_dims(cfg, mixer)
    per_head = 4.0 * e * d * v + 2.0 * min(cfg.chunk_size, seq_len) * (d + v + e)
    if mixer in MULTISTATE:
      per_head += 2.0 * d * v * max(1.0, seq_len / (2 * cfg.segment_len))
    flops += 3.0 * cfg.num_heads * per_head
  return flops


def state_bytes(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
  """Decode-time memory per sequence: ``recurrent_state`` (fp32 states, conv caches and MERLIN's
  segment moments, independent of length) and ``kv_cache`` (attention layers at ``seq_len``,
  in the compute dtype)."""
  recurrent, kv = 0, 0
  h = cfg.num_heads
  for mixer in cfg.layers():
    if mixer == "attention":
      kv += 2 * seq_len * (cfg.num_kv_heads or h) * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
      continue
    e, d, v = _mixer_dims(cfg, mixer)
    mamba = mixer in ("mamba2", "multistate_mamba2")
    channels = h * v + (2 * d if mamba else h * 2 * d) + (2 * h * e if e > 1 else 0)
    conv = (cfg.conv_width - 1) * channels
    n = cfg.max_segments if mixer in MULTISTATE else 1
    moments = n * (1 if mamba else h) * (cfg.d_r + cfg.d_r ** 2) if mixer in MULTISTATE else 0
    recurrent += 4 * (n * h * e * d * v + conv + moments)
  return {"recurrent_state": int(recurrent), "kv_cache": int(kv)}
