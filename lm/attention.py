"""Causal softmax attention with grouped-query heads (GQA), optional QK-norm and rotary positions:
the baseline mixer.

The attention itself is ``jax.nn.dot_product_attention`` (which picks cuDNN / XLA by backend and
handles GQA when ``num_kv_heads`` divides ``num_heads``); this module only adds projections, the
QK-norm, RoPE and the output projection, with logical axis names on every kernel.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from layers.blocks import RMSNorm, dense
from layers.remat import saved_op
from triadic.ops import document_positions

ROPE_BASE = 10000.0


def rotary(x: jax.Array, base: float = ROPE_BASE, offset: jax.Array | int = 0,
           positions: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding over the last axis of x (B, T, H, D).

  The positions are ``positions`` (B, T) when given (e.g. counted from each packed document's
  start), else offset..offset+T-1 (``offset`` may be traced: decoding continues the positions of a
  KV cache). Channel i of the first half and channel i of the second half rotate together by
  position * base^(-2i/D).
  """
  t, d = x.shape[1], x.shape[-1]
  if d % 2:
    raise ValueError(f"rotary embedding needs an even head_dim, got {d}")
  inv_freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  if positions is not None:
    if positions.shape != x.shape[:2]:
      raise ValueError(f"positions must have shape (B, T) = {x.shape[:2]}, got {positions.shape}")
    pos = positions.astype(jnp.float32)  # (B, T)
  else:
    pos = jnp.arange(t, dtype=jnp.float32)[None]  # (1, T)
    if not (isinstance(offset, int) and offset == 0):  # keep the training forward's graph unchanged
      pos = pos + jnp.asarray(offset).astype(jnp.float32)
  angle = pos[:, :, None, None] * inv_freq  # (B | 1, T, 1, D/2)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
  """Causal multi-head attention; ``num_kv_heads < num_heads`` shares each K/V head by a group.

  ``qk_norm``: RMSNorm (learned scale per channel) over head_dim of every query and key head,
  before RoPE (the triadic authors' Transformer baseline). ``rope_base``: RoPE's base (the authors
  raise it from 10k to 2M for the 64k extension). ``rope_per_document``: with ``segment_ids``,
  RoPE positions restart at 0 at each document start, so a packed document sees the positions it
  would have as its own row (and as it has when decoded from a cache, which starts at 0);
  attention is relative, so this changes only rounding. ``implementation`` is passed to
  ``jax.nn.dot_product_attention`` (None = let JAX choose, "xla" or "cudnn").
  """

  num_heads: int
  head_dim: int
  num_kv_heads: int | None = None
  qk_norm: bool = False
  rope_base: float = ROPE_BASE
  rope_per_document: bool = True
  implementation: str | None = None
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, cache: dict | None = None, segment_ids=None):
    """``(y, new_cache)``, x and y (B, T, d_model): training without a cache (None back).
    ``segment_ids`` (B, T) (training only): packed documents; a token attends only to earlier
    tokens of its own document.

    With ``cache`` (``init_cache``: a preallocated KV cache and its length) the T tokens of x come
    after the cached ones: their keys and values are written at ``length``, they attend to every
    cached key and causally to each other. The caller keeps ``length + T <= max_len`` (the write
    position is traced, so it cannot be checked here).
    """
    h, d = self.num_heads, self.head_dim
    kvh = self.num_kv_heads or h
    if h % kvh:
      raise ValueError(f"num_kv_heads ({kvh}) must divide num_heads ({h})")
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    q = dense((h, d), ("embed", "heads", "head_dim"), name="q_proj", **kw)(x)
    k = dense((kvh, d), ("embed", "kv_heads", "head_dim"), name="k_proj", **kw)(x)
    v = dense((kvh, d), ("embed", "kv_heads", "head_dim"), name="v_proj", **kw)(x)
    if self.qk_norm:
      q = RMSNorm(names=("head_dim",), name="q_norm", **kw)(q)
      k = RMSNorm(names=("head_dim",), name="k_norm", **kw)(k)
    out_proj = lambda o: dense(x.shape[-1], ("heads", "head_dim", "embed"), axis=(-2, -1),
                               name="out_proj", **kw)(o)
    if cache is not None:
      o, cache = cached_attention(q, k, v, cache, rope_base=self.rope_base)
      return out_proj(o.astype(self.dtype)), cache
    positions = None
    if segment_ids is not None and self.rope_per_document:
      positions = document_positions(segment_ids)
    q, k = (rotary(z, self.rope_base, positions=positions) for z in (q, k))

    def attend(q, k, v, segment_ids):
      mask = None
      if segment_ids is not None:  # (B, 1, T, T), combined with the causal mask by the library
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
      return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                          implementation=self.implementation)

    return out_proj(saved_op(attend)(q, k, v, segment_ids)), None  # named for "save_mixer_op"

  def init_cache(self, batch: int, max_len: int) -> dict:
    """Empty KV cache: k, v (B, max_len, kv_heads, head_dim) in the compute dtype, length 0."""
    shape = (batch, max_len, self.num_kv_heads or self.num_heads, self.head_dim)
    return {"k": jnp.zeros(shape, self.dtype), "v": jnp.zeros(shape, self.dtype),
            "length": jnp.zeros((), jnp.int32)}


def cached_attention(q, k, v, cache, rope_base: float = ROPE_BASE):
  """Causal attention of new q, k, v (B, T, ., D) (QK-normed if the layer norms them, before RoPE)
  against a KV cache (see ``Attention.__call__``); returns o (B, T, H, D) float32 and the updated
  cache."""
  length = cache["length"]
  t, h, d = q.shape[1], q.shape[2], q.shape[3]
  q, k = rotary(q, rope_base, offset=length), rotary(k, rope_base, offset=length)
  start = (0, length, 0, 0)
  keys = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), start)
  values = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), start)
  b, s, kvh, _ = keys.shape
  qg = q.astype(jnp.float32).reshape(b, t, kvh, h // kvh, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys.astype(jnp.float32)) * d ** -0.5
  allowed = jnp.arange(s)[None, :] <= (length + jnp.arange(t))[:, None]  # (T, S)
  scores = jnp.where(allowed, scores, -jnp.inf)
  o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), values.astype(jnp.float32))
  return o.reshape(b, t, h, d), {"k": keys, "v": values, "length": length + t}
