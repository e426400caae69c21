"""Causal softmax attention with grouped-query heads (GQA) and rotary positions: the baseline mixer.

The attention itself is ``jax.nn.dot_product_attention`` (which picks cuDNN / XLA by backend and
handles GQA when ``num_kv_heads`` divides ``num_heads``); this module only adds projections, RoPE
and the output projection, with logical axis names on every kernel.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from triadic.nn import dense


def rotary(x: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotary position embedding over the last axis of x (B, T, H, D), positions 0..T-1."""
  t, d = x.shape[1], x.shape[-1]
  if d % 2:
    raise ValueError(f"rotary embedding needs an even head_dim, got {d}")
  inv_freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angle = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # (T, D/2)
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
  """Causal multi-head attention; ``num_kv_heads < num_heads`` shares each K/V head by a group.

  ``implementation`` is passed to ``jax.nn.dot_product_attention`` (None = let JAX choose,
  "xla" or "cudnn").
  """

  num_heads: int
  head_dim: int
  num_kv_heads: int | None = None
  implementation: str | None = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h, d = self.num_heads, self.head_dim
    kvh = self.num_kv_heads or h
    if h % kvh:
      raise ValueError(f"num_kv_heads ({kvh}) must divide num_heads ({h})")
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    q = dense((h, d), ("embed", "heads", "head_dim"), name="q_proj", **kw)(x)
    k = dense((kvh, d), ("embed", "kv_heads", "head_dim"), name="k_proj", **kw)(x)
    v = dense((kvh, d), ("embed", "kv_heads", "head_dim"), name="v_proj", **kw)(x)
    q, k = rotary(q), rotary(k)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.implementation)
    return dense(x.shape[-1], ("heads", "head_dim", "embed"), axis=(-2, -1), name="out_proj", **kw)(o)
