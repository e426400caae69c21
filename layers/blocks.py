"""Small Flax Linen building blocks shared by the triadic, multi-state and LM layers.

Every parameter carries logical axis names (``nn.with_logical_partitioning``); the training code
maps them to mesh axes with the rules in the config. Names used here:
``embed`` (d_model), ``heads``, ``head_dim`` (D or V), ``expand`` (E), ``moment`` (d_r), ``conv``
(the convolution's width), ``gate_rank`` (the output gate's rank).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from layers import conv_kernel

Dtype = Any


def check_sizes(layer, *names: str) -> None:
  """ValueError naming the first of the module fields ``names`` that is not a positive int
  (``value_dim`` and ``num_v_heads`` may also be None)."""
  for name in names:
    value = getattr(layer, name)
    if name in ("value_dim", "num_v_heads") and value is None:
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


def dense_kernel_init(kernel_init=None, in_axes: int = 1):
  """The initialiser of ``dense``'s kernel as a plain function of (key, shape, dtype).

  ``nn.DenseGeneral`` initialises its kernel as the 2-D matrix (inputs, outputs), ``in_axes``
  leading axes flattened into the rows, then reshapes it: the fan-in is the input features only.
  With the same key this gives exactly the kernel ``dense`` would create.
  """
  kernel_init = kernel_init or nn.initializers.lecun_normal()

  def init(key, shape, dtype=jnp.float32):
    flat = (math.prod(shape[:in_axes]), math.prod(shape[in_axes:]))
    return jnp.reshape(kernel_init(key, flat, dtype), shape)

  return init


class Param(nn.Module):
  """One parameter, ``param_name`` (default ``kernel``), of the given shape, initialiser and logical
  axis ``names``, returned by calling the module.

  Used where several projections (or convolutions) run as one fused operation: each keeps its own
  module name and parameter (e.g. ``q_proj/kernel``, same shape and initialiser as ``dense``
  creates with ``dense_kernel_init``), and the caller concatenates them at call time.
  """

  shape: tuple[int, ...]
  initializer: Any
  names: Sequence[str]
  param_dtype: Dtype = jnp.float32
  param_name: str = "kernel"

  @nn.compact
  def __call__(self) -> jax.Array:
    init = nn.with_logical_partitioning(self.initializer, tuple(self.names))
    return self.param(self.param_name, init, tuple(self.shape), self.param_dtype)


def _ndim(features) -> int:
  return 1 if isinstance(features, int) else len(features)


def short_conv_init(width: int):
  """``ShortConv``'s kernel initialiser: U(-1/sqrt(width), 1/sqrt(width)) (fan-in = the width)."""
  bound = 1.0 / math.sqrt(width)
  uniform = nn.initializers.uniform(scale=2.0 * bound)  # U(0, 2 bound)
  return lambda key, shape, dtype=jnp.float32: uniform(key, shape, dtype) - bound


def causal_conv(x: jax.Array, kernel: jax.Array, cache: jax.Array | None = None,
                segment_ids: jax.Array | None = None, impl: str = "auto"):
  """Causal depthwise convolution over time, ``y_t = sum_w kernel[w] * x_{t - width + 1 + w}``.

  x (B, T, *channels), kernel (width, *channels): one filter per channel, so the convolution of a
  concatenation of streams along the channels is the concatenation of their convolutions. Returns
  ``(y, new_cache)``, y in x's dtype: without ``cache`` the input is causally zero-padded and
  new_cache is None; with ``cache`` (B, width - 1, *channels), the inputs before x, the convolution
  continues from there (zeros = a fresh start) and new_cache is x's last width - 1 inputs.
  ``segment_ids`` (B, T) (packed documents, training only): an input of another document counts
  as the causal padding's zero, so no output reads the previous document.

  ``impl``: "xla" shifted slices computed in x's dtype (the kernel rounded to it; the
  reference), "pallas" the kernels of ``layers.conv_kernel`` (float32 inside, y rounded once;
  Triton on a GPU, interpret mode elsewhere), "auto" the kernels on a GPU without a cache, else
  XLA. A cache always runs XLA. ``layers.conv_kernel.choose_impl`` decides, with the reason.
  """
  choice, _ = conv_kernel.choose_impl(impl, cache=cache is not None, dtype=x.dtype)
  if cache is not None and segment_ids is not None:
    raise ValueError("segment_ids applies to the training forward; a cache continues one document")
  if choice == "pallas":
    flat = lambda a, lead: a.reshape(a.shape[:lead] + (-1,))
    y = conv_kernel.causal_conv_pallas(flat(x, 2), flat(kernel, 1), segment_ids)
    return y.reshape(x.shape), None
  width, t, channel_dims = kernel.shape[0], x.shape[1], x.ndim - 2
  kernel = kernel.astype(x.dtype)
  if cache is None:
    padded = jnp.pad(x, [(0, 0), (width - 1, 0)] + [(0, 0)] * channel_dims)
  else:
    padded = jnp.concatenate([cache.astype(x.dtype), x], axis=1)
  if segment_ids is None:
    y = sum(padded[:, w:w + t] * kernel[w] for w in range(width))
  else:  # lag width - 1 - w reads token t - lag: zero unless it is in token t's document
    y = sum(padded[:, w:w + t] * kernel[w] * _same_document(segment_ids, width - 1 - w,
                                                            channel_dims, x.dtype)
            for w in range(width))
  if cache is None:
    return y, None
  return y, padded[:, padded.shape[1] - (width - 1):].astype(cache.dtype)


class ShortConv(nn.Module):
  """``causal_conv`` with its kernel (width, *channels) as the parameter ``kernel``.

  Input (B, T, *channels); one filter per channel, so a convolution over a concatenation of
  streams is the same as one convolution per stream. ``impl``: ``causal_conv``'s ("auto", "xla",
  "pallas"); it changes no parameter.
  """

  width: int = 4
  names: Sequence[str] = ("heads", "head_dim")
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  impl: str = "auto"

  @nn.compact
  def __call__(self, x: jax.Array, cache: jax.Array | None = None, segment_ids=None):
    """``(y, new_cache)`` for x (B, T, *channels); ``cache`` and ``segment_ids`` as in
    ``causal_conv``."""
    kernel = self.param("kernel", nn.with_logical_partitioning(short_conv_init(self.width),
                                                               ("conv",) + tuple(self.names)),
                        (self.width,) + tuple(x.shape[2:]), self.param_dtype)
    return causal_conv(x.astype(self.dtype), kernel, cache, segment_ids, self.impl)


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
