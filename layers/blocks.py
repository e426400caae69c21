"""Small Flax Linen building blocks shared by the triadic, multi-state and LM layers.

Every parameter carries logical axis names (``nn.with_logical_partitioning``); the training code
maps them to mesh axes with the rules in the config. Names used here:
``embed`` (d_model), ``heads``, ``head_dim`` (D or V), ``expand`` (E), ``moment`` (d_r), ``conv``
(the convolution's width).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any


def check_sizes(layer, *names: str) -> None:
  """ValueError naming the first of the module fields ``names`` that is not a positive int
  (``value_dim`` may also be None)."""
  for name in names:
    value = getattr(layer, name)
    if name == "value_dim" and value is None:
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{type(layer).__name__}.{name} must be a positive int, got {value!r}")


def l2norm(x: jax.Array, axis: int = -1, eps: float = 1e-6) -> jax.Array:
  """``x / ||x||`` along ``axis``, computed in float32 and returned in x's dtype."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=axis, keepdims=True) + eps)).astype(x.dtype)


def softplus_inverse(y: jax.Array) -> jax.Array:
  """The inverse of softplus, ``y + log(1 - exp(-y))``, for y > 0."""
  return y + jnp.log(-jnp.expm1(-y))


def dense(features: Sequence[int] | int, names: Sequence[str], *, axis=-1, use_bias=False,
          dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32, name: str | None = None,
          kernel_init=None) -> nn.DenseGeneral:
  """``nn.DenseGeneral`` whose kernel is annotated with the logical axis ``names``."""
  if kernel_init is None:
    kernel_init = nn.initializers.lecun_normal()
  return nn.DenseGeneral(
      features=features, axis=axis, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
      kernel_init=nn.with_logical_partitioning(kernel_init, tuple(names)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), tuple(names[-_ndim(features):])),
      name=name)


def _ndim(features) -> int:
  return 1 if isinstance(features, int) else len(features)


class ShortConv(nn.Module):
  """Causal depthwise convolution over time: ``y_t = sum_w kernel[w] * x_{t - width + 1 + w}``.

  Input (B, T, *channels); the kernel is (width, *channels), one filter per channel, so a
  convolution over a concatenation of streams is the same as one convolution per stream.
  """

  width: int = 4
  names: Sequence[str] = ("heads", "head_dim")
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, cache: jax.Array | None = None, segment_ids=None):
    """``(y, new_cache)`` for x (B, T, *channels).

    Without ``cache`` (training) the input is causally zero-padded and new_cache is None. With
    ``cache`` (B, width - 1, *channels), the inputs before x, the convolution continues from there
    (zeros = a fresh start) and new_cache is x's last width - 1 inputs, for the next call.
    ``segment_ids`` (B, T) (packed documents, training only): an input of another document counts
    as the causal padding's zero, so no output reads the previous document.
    """
    channels = x.shape[2:]
    fan_in = self.width
    init = nn.initializers.uniform(scale=2.0 / math.sqrt(fan_in))
    kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(lambda k, s, d: init(k, s, d) - 1.0 / math.sqrt(fan_in),
                                     ("conv",) + tuple(self.names)),
        (self.width,) + tuple(channels), self.param_dtype)
    kernel = kernel.astype(self.dtype)
    x = x.astype(self.dtype)
    t = x.shape[1]
    if cache is None:
      padded = jnp.pad(x, [(0, 0), (self.width - 1, 0)] + [(0, 0)] * len(channels))
    elif segment_ids is not None:
      raise ValueError("segment_ids applies to the training forward; a cache continues one document")
    else:
      padded = jnp.concatenate([cache.astype(self.dtype), x], axis=1)
    if segment_ids is None:
      y = sum(padded[:, w:w + t] * kernel[w] for w in range(self.width))
    else:  # lag width - 1 - w reads token t - lag: zero unless it is in token t's document
      y = sum(padded[:, w:w + t] * kernel[w] * _same_document(segment_ids, self.width - 1 - w,
                                                              len(channels), self.dtype)
              for w in range(self.width))
    if cache is None:
      return y, None
    return y, padded[:, padded.shape[1] - (self.width - 1):].astype(cache.dtype)


def _same_document(segment_ids: jax.Array, lag: int, channel_dims: int, dtype) -> jax.Array:
  """(B, T, 1, ...) 1 where token t - lag exists and is in token t's document, else 0."""
  t = segment_ids.shape[1]
  same = segment_ids[:, :t - lag] == segment_ids[:, lag:] if lag else jnp.ones_like(segment_ids, bool)
  same = jnp.pad(same, ((0, 0), (min(lag, t), 0)))[:, :t]
  return same.astype(dtype).reshape(same.shape + (1,) * channel_dims)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis with a learned scale (computed in float32)."""

  eps: float = 1e-6
  names: Sequence[str] = ("embed",)
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(), tuple(self.names)),
                       (x.shape[-1],), self.param_dtype)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(self.dtype)
