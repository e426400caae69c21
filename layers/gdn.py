"""The Gated-DeltaNet-style projections shared by the triadic and multi-state layers.

``gdn_inputs`` builds (q, k, v, k2, q2, g, beta) from the hidden state and ``gdn_output`` the gated,
normalised output projection, both inside the calling module's compact method so their parameters
(q_proj, q_conv, ..., decay, beta_proj, gate_proj, o_norm, out_proj) carry the same names in every
layer that uses them: ``triadic.TriadicGDN`` and ``merlin.MultiStateGDN`` load each other's
checkpoints by name. ``DecayGate`` is the per-slice log decay, also used by ``Mamba2``'s initialisers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from layers.blocks import RMSNorm, ShortConv, dense, l2norm, softplus_inverse


def a_log_init(key, shape, dtype=jnp.float32):
  """A_log = log U(1, 16) (Mamba-2 / GDN)."""
  return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def dt_bias_init(key, shape, dtype=jnp.float32, dt_min=1e-3, dt_max=1e-1):
  """dt_bias = softplus^-1(dt), dt ~ LogUniform(dt_min, dt_max)."""
  u = jax.random.uniform(key, shape, dtype)
  dt = jnp.exp(u * (np.log(dt_max) - np.log(dt_min)) + np.log(dt_min))
  return softplus_inverse(dt).astype(dtype)


class DecayGate(nn.Module):
  """Log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` with a, A_log, dt_bias of shape (.., H, E)."""

  num_heads: int
  expand_e: int = 1
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    shape = (self.num_heads, self.expand_e)
    names = ("heads", "expand")
    a = dense(shape, ("embed",) + names, dtype=self.dtype, param_dtype=self.param_dtype, name="a_proj")(x)
    a_log = self.param("A_log", nn.with_logical_partitioning(a_log_init, names), shape, self.param_dtype)
    dt_bias = self.param("dt_bias", nn.with_logical_partitioning(dt_bias_init, names), shape,
                         self.param_dtype)
    a = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    return -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a)


def gdn_cache(batch, num_heads, head_dim, value_dim=None, expand_e=1, conv_width=4,
              dtype=jnp.float32, state=True) -> dict:
  """Zero cache of ``gdn_inputs``'s short convolutions ({"conv": {stream: (B, W-1, H, .)}}) plus,
  if ``state``, the single recurrent state (B, H, E, D, V) float32 of ``TriadicGDN``."""
  h, d, e, vd = num_heads, head_dim, expand_e, value_dim or head_dim
  widths = {"q": d, "k": d, "v": vd}
  if e > 1:
    widths.update(k2=e, q2=e)
  conv = {name: jnp.zeros((batch, conv_width - 1, h, w), dtype) for name, w in widths.items()}
  cache = {"conv": conv}
  if state:
    cache["state"] = jnp.zeros((batch, h, e, d, vd), jnp.float32)
  return cache


def gdn_inputs(x, num_heads, head_dim, value_dim=None, expand_e=1, conv_width=4, *,
               dtype=jnp.float32, param_dtype=jnp.float32, conv_cache=None, segment_ids=None):
  """The input side of ``TriadicGDN``: (q, k, v, k2, q2, g, beta) from x (B, T, d_model).

  Call it inside a compact method: its parameters (q_proj, q_conv, ..., decay, beta_proj) belong to
  the calling module, under the same names in every layer that uses it, so checkpoints of the
  single-state layer load into the multi-state one (``merlin.MultiStateGDN``) by name.
  Returns ``(inputs, new_conv_cache)``. With ``conv_cache`` ({stream: last conv_width - 1 inputs},
  see ``gdn_cache``) the convolutions continue from it (decoding); without it (training) they start
  from zeros and new_conv_cache is None. ``segment_ids`` (B, T) (training): packed documents; no
  convolution reads across a document start.
  """
  h, d, e = num_heads, head_dim, expand_e
  vd = value_dim or head_dim
  kw = dict(dtype=dtype, param_dtype=param_dtype)
  new_cache = None if conv_cache is None else {}

  def stream(features, names, name):
    z = dense(features, ("embed",) + names, name=f"{name}_proj", **kw)(x)
    y, cache = ShortConv(conv_width, names, name=f"{name}_conv", **kw)(
        z, None if conv_cache is None else conv_cache[name], segment_ids=segment_ids)
    if conv_cache is not None:
      new_cache[name] = cache
    return y

  q = l2norm(jax.nn.silu(stream((h, d), ("heads", "head_dim"), "q")))
  k = l2norm(jax.nn.silu(stream((h, d), ("heads", "head_dim"), "k")))
  v = jax.nn.silu(stream((h, vd), ("heads", "head_dim"), "v"))
  b, t = x.shape[:2]
  if e > 1:
    k2 = l2norm(jax.nn.softplus(stream((h, e), ("heads", "expand"), "k2").astype(jnp.float32)))
    q2 = l2norm(jax.nn.softplus(stream((h, e), ("heads", "expand"), "q2").astype(jnp.float32)))
  else:
    k2 = q2 = jnp.ones((b, t, h, 1), jnp.float32)
  g = DecayGate(h, e, name="decay", **kw)(x)
  beta = jax.nn.sigmoid(dense((h,), ("embed", "heads"), name="beta_proj", **kw)(x).astype(jnp.float32))
  inputs = (q, k, v, k2.astype(q.dtype), q2.astype(q.dtype), g, beta)
  return inputs, new_cache


def gdn_output(o, x, *, dtype=jnp.float32, param_dtype=jnp.float32):
  """The output side of ``TriadicGDN``: out_proj(RMSNorm(o) * sigmoid(gate_proj(x))), o (B, T, H, V).

  Like ``gdn_inputs``, call it inside a compact method (parameters gate_proj, o_norm, out_proj).
  """
  kw = dict(dtype=dtype, param_dtype=param_dtype)
  gate = dense(o.shape[-2:], ("embed", "heads", "head_dim"), name="gate_proj", **kw)(x)
  o = RMSNorm(names=("head_dim",), name="o_norm", **kw)(o) * jax.nn.sigmoid(gate)
  return dense(x.shape[-1], ("heads", "head_dim", "embed"), axis=(-2, -1), name="out_proj", **kw)(o)
