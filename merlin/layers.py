"""Flax Linen mixers: single-state ``Mamba2`` and the multi-state ``MultiStateGDN`` / ``MultiStateMamba2``.

The multi-state layers share every parameter name and shape with their single-state versions
(``triadic.TriadicGDN(expand_e=1)``, ``Mamba2``), so a trained single-state checkpoint loads by name;
only the ``aggregator`` subtree is new. With ``aggregator="vanilla"`` they compute exactly the
single-state layer (lam = 1 sums the segment states back into the one state).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from merlin.aggregators import merlin_weights, meanpool_weights, position_weights, vanilla_weights
from merlin.memory import state_memory
from merlin.ops import multistate_attention
from triadic.layer import a_log_init, dt_bias_init, gdn_inputs, gdn_output
from triadic.nn import RMSNorm, ShortConv, dense, l2norm, softplus_inverse
from triadic.ops import triadic_gdn

AGGREGATORS = ("vanilla", "position", "meanpool", "merlin")


class Aggregator(nn.Module):
  """lam (B, T, H, N) from the hidden state x (B, T, d_model).

  k', q' = l2norm(own projections of x) with ``groups`` groups of d_r (H per head, or 1 shared):
  unit vectors keep r_mu in [-1, 1] and r_sigma in [0, 1], and the temperatures set the scale.
  tau = exp(log_tau) per head (parameters log_tau_mu, log_tau_sigma), initialised to sqrt(d_r)
  (mean) and d_r (variance): a random unit query aligns with a unit key at about d_r^-1/2, with
  variance about 1/d_r, so both logits start at O(1). gamma = sigmoid(w^T x + b) per head. Position: p = W x + b, with b chosen so
  that lam = softplus(p) = 1 (vanilla) when W x = 0.
  """

  kind: str
  num_heads: int
  segment_len: int
  max_segments: int
  d_r: int
  groups: int
  impl: str = "auto"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h, n, r = self.num_heads, self.max_segments, self.d_r
    b, t = x.shape[:2]
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    if self.kind == "vanilla":
      return vanilla_weights(b, t, h, n)
    if self.kind == "position":
      logical = nn.with_logical_partitioning
      p = nn.DenseGeneral(
          (h, n), use_bias=True, name="pos_proj",
          kernel_init=logical(nn.initializers.lecun_normal(), ("embed", "heads", None)),
          bias_init=logical(nn.initializers.constant(softplus_inverse(1.0)), ("heads", None)), **kw)(x)
      return position_weights(p, segment_len=self.segment_len)

    def small(name):
      if self.groups == 1:
        z = dense(r, ("embed", "moment"), name=name, **kw)(x)[:, :, None]
      else:
        z = dense((h, r), ("embed", "heads", "moment"), name=name, **kw)(x)
      return l2norm(z.astype(jnp.float32))

    def temperature(name, init):
      init = nn.with_logical_partitioning(nn.initializers.constant(np.log(init)), ("heads",))
      log_tau = self.param(f"log_{name}", init, (h,), self.param_dtype)
      return jnp.exp(log_tau.astype(jnp.float32))

    qr, kr = small("qr_proj"), small("kr_proj")
    common = dict(segment_len=self.segment_len, max_segments=n,
                  impl="scan" if self.impl == "scan" else "auto")
    tau_mu = temperature("tau_mu", r ** 0.5)
    if self.kind == "meanpool":
      return meanpool_weights(qr, kr, tau_mu, **common)
    gamma = jax.nn.sigmoid(dense(h, ("embed", "heads"), use_bias=True, name="gamma_proj", **kw)(x)
                           .astype(jnp.float32))
    return merlin_weights(qr, kr, gamma, tau_mu, temperature("tau_sigma", float(r)), **common)


def _check_aggregator(aggregator):
  if aggregator not in AGGREGATORS:
    raise ValueError(f"aggregator must be one of {AGGREGATORS}, got {aggregator!r}")


class MultiStateGDN(nn.Module):
  """Multi-state Gated DeltaNet (``erase=True``) or multi-state sGLA (``erase=False``) mixer.

  x (B, T, d_model) -> (B, T, d_model); T <= max_segments * segment_len. The chunk length is
  min(chunk_size, segment_len) and must divide segment_len.
  """

  num_heads: int
  head_dim: int
  value_dim: int | None = None
  aggregator: str = "merlin"
  segment_len: int = 256
  max_segments: int = 64
  d_r: int = 128
  erase: bool = True
  conv_width: int = 4
  impl: str = "auto"
  chunk_size: int = 64
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    _check_aggregator(self.aggregator)
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    q, k, v, _, _, g, beta = gdn_inputs(x, self.num_heads, self.head_dim, self.value_dim, 1,
                                        self.conv_width, **kw)
    lam = Aggregator(self.aggregator, self.num_heads, self.segment_len, self.max_segments, self.d_r,
                     groups=self.num_heads, impl=self.impl, name="aggregator", **kw)(x)
    o = multistate_attention(q, k, v, g[..., 0], beta, lam, segment_len=self.segment_len,
                             erase=self.erase, impl=self.impl,
                             chunk_size=min(self.chunk_size, self.segment_len))
    return gdn_output(o, x, **kw)

  def state_memory(self, num_segments: int | None = None, bytes_per_value: int = 4):
    """``merlin.state_memory`` for this layer (``max_segments`` segments unless given)."""
    return state_memory(self.num_heads, self.head_dim, self.value_dim or self.head_dim, self.d_r,
                        aggregator=self.aggregator, num_segments=num_segments or self.max_segments,
                        bytes_per_value=bytes_per_value)


class Mamba2(nn.Module):
  """Single-state Mamba-2 mixer with one group of B, C (the SSD core is ``triadic_gdn`` with E = 1).

  x -> x_proj (H x P), z_proj (H x P), b_proj, c_proj (state_dim), dt_proj (H); causal depthwise
  conv + SiLU on x, B, C; dt = softplus(dt_proj + dt_bias); the SSD recurrence
  h_t = exp(-exp(A_log) dt_t) h + B_t (dt_t x_t)^T, y_t = h_t^T C_t; y + D x;
  RMSNorm(y * silu(z)) per head; out_proj. Input and output (B, T, d_model).
  """

  num_heads: int
  head_dim: int
  state_dim: int = 64
  conv_width: int = 4
  impl: str = "auto"
  chunk_size: int = 64
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def ssd_inputs(self, x):
    """(xs, z, b, c, dt, g): xs, z (B, T, H, P); b, c (B, T, state_dim); dt, g (B, T, H).

    Creates the shared parameters; call from the compact ``__call__``.
    """
    h, p, kw = self.num_heads, self.head_dim, dict(dtype=self.dtype, param_dtype=self.param_dtype)

    def stream(features, names, name):
      z = dense(features, ("embed",) + names, name=f"{name}_proj", **kw)(x)
      return jax.nn.silu(ShortConv(self.conv_width, names, name=f"{name}_conv", **kw)(z))

    xs = stream((h, p), ("heads", "head_dim"), "x")
    b = stream(self.state_dim, ("state",), "b").astype(jnp.float32)
    c = stream(self.state_dim, ("state",), "c").astype(jnp.float32)
    z = dense((h, p), ("embed", "heads", "head_dim"), name="z_proj", **kw)(x)
    per_head = lambda name, init: self.param(name, nn.with_logical_partitioning(init, ("heads",)),
                                             (h,), self.param_dtype).astype(jnp.float32)
    dt = dense(h, ("embed", "heads"), name="dt_proj", **kw)(x).astype(jnp.float32)
    dt = jax.nn.softplus(dt + per_head("dt_bias", dt_bias_init))
    g = -jnp.exp(per_head("A_log", a_log_init)) * dt
    return xs, z, b, c, dt, g

  def ssd_output(self, y, xs, z, x):
    """out_proj(RMSNorm((y + D xs) * silu(z))), y (B, T, H, P) -> (B, T, d_model)."""
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    skip = self.param("D", nn.with_logical_partitioning(nn.initializers.ones_init(), ("heads",)),
                      (self.num_heads,), self.param_dtype)
    y = (y.astype(jnp.float32) + skip.astype(jnp.float32)[:, None] * xs) * jax.nn.silu(z)
    y = RMSNorm(names=("head_dim",), name="norm", **kw)(y)
    return dense(x.shape[-1], ("heads", "head_dim", "embed"), axis=(-2, -1), name="out_proj", **kw)(y)

  @staticmethod
  def heads(b, c, xs, dt):
    """SSD operands per head: q = C and k = B broadcast over heads, v = dt x."""
    h = xs.shape[2]
    per_head = lambda z: jnp.broadcast_to(z[:, :, None], z.shape[:2] + (h, z.shape[-1]))
    return per_head(c), per_head(b), xs.astype(jnp.float32) * dt[..., None]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    xs, z, b, c, dt, g = self.ssd_inputs(x)
    q, k, v = self.heads(b, c, xs, dt)
    ones = jnp.ones(g.shape + (1,), jnp.float32)
    y, _ = triadic_gdn(q, k, v, ones, ones, g[..., None], jnp.ones_like(g), scale=1.0, erase=False,
                       impl=self.impl, chunk_size=self.chunk_size)
    return self.ssd_output(y, xs, z, x)


class MultiStateMamba2(Mamba2):
  """Multi-state Mamba-2: ``Mamba2``'s parameters plus an aggregator whose k', q' are one group
  of d_r shared by all heads. T <= max_segments * segment_len."""

  aggregator: str = "merlin"
  segment_len: int = 256
  max_segments: int = 64
  d_r: int = 128

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    _check_aggregator(self.aggregator)
    xs, z, b, c, dt, g = self.ssd_inputs(x)
    q, k, v = self.heads(b, c, xs, dt)
    lam = Aggregator(self.aggregator, self.num_heads, self.segment_len, self.max_segments, self.d_r,
                     groups=1, impl=self.impl, name="aggregator", dtype=self.dtype,
                     param_dtype=self.param_dtype)(x)
    y = multistate_attention(q, k, v, g, jnp.ones_like(g), lam, segment_len=self.segment_len,
                             erase=False, scale=1.0, impl=self.impl,
                             chunk_size=min(self.chunk_size, self.segment_len))
    return self.ssd_output(y, xs, z, x)

  def state_memory(self, num_segments: int | None = None, bytes_per_value: int = 4):
    """``merlin.state_memory`` for this layer (``max_segments`` segments unless given)."""
    return state_memory(self.num_heads, self.state_dim, self.head_dim, self.d_r, moment_groups=1,
                        aggregator=self.aggregator, num_segments=num_segments or self.max_segments,
                        bytes_per_value=bytes_per_value)
