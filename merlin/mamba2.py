"""``Mamba2``: the single-state Mamba-2 mixer (its SSD core is ``triadic_gdn`` with E = 1, no erase).

``merlin.MultiStateMamba2`` subclasses it: the same parameters plus an aggregator.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from layers.blocks import RMSNorm, ShortConv, dense
from layers.gdn import a_log_init, dt_bias_init
from triadic.ops import triadic_gdn, triadic_gdn_step


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
  conv_impl: str = "auto"
  impl: str = "auto"
  chunk_size: int = 64
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def ssd_inputs(self, x, conv_cache=None, segment_ids=None):
    """(xs, z, b, c, dt, g): xs, z (B, T, H, P); b, c (B, T, state_dim); dt, g (B, T, H).

    Creates the shared parameters; call from the compact ``__call__``. Returns
    ``((xs, z, b, c, dt, g), new_conv_cache)``: with ``conv_cache`` ({"x", "b", "c"}: each
    convolution's last conv_width - 1 inputs) the convolutions continue from it (decoding);
    without it they start from zeros and new_conv_cache is None (training). ``segment_ids``
    (B, T) (training): packed documents; no convolution reads across a document start.
    """
    h, p, kw = self.num_heads, self.head_dim, dict(dtype=self.dtype, param_dtype=self.param_dtype)
    new_cache = None if conv_cache is None else {}

    def stream(features, names, name):
      z = dense(features, ("embed",) + names, name=f"{name}_proj", **kw)(x)
      y, cache = ShortConv(self.conv_width, names, name=f"{name}_conv", impl=self.conv_impl, **kw)(
          z, None if conv_cache is None else conv_cache[name], segment_ids=segment_ids)
      if conv_cache is not None:
        new_cache[name] = cache
      return jax.nn.silu(y)

    xs = stream((h, p), ("heads", "head_dim"), "x")
    b = stream(self.state_dim, ("state",), "b").astype(jnp.float32)
    c = stream(self.state_dim, ("state",), "c").astype(jnp.float32)
    z = dense((h, p), ("embed", "heads", "head_dim"), name="z_proj", **kw)(x)
    per_head = lambda name, init: self.param(name, nn.with_logical_partitioning(init, ("heads",)),
                                             (h,), self.param_dtype).astype(jnp.float32)
    dt = dense(h, ("embed", "heads"), name="dt_proj", **kw)(x).astype(jnp.float32)
    dt = jax.nn.softplus(dt + per_head("dt_bias", dt_bias_init))
    g = -jnp.exp(per_head("A_log", functools.partial(a_log_init, minval=1.0))) * dt  # A ~ U(1, 16)
    return (xs, z, b, c, dt, g), new_cache

  def conv_cache(self, batch: int) -> dict:
    """Zero inputs of the short convolutions (x, b, c) for a fresh decoding cache."""
    w, h, p, n = self.conv_width - 1, self.num_heads, self.head_dim, self.state_dim
    return {"x": jnp.zeros((batch, w, h, p), self.dtype), "b": jnp.zeros((batch, w, n), self.dtype),
            "c": jnp.zeros((batch, w, n), self.dtype)}

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
  def __call__(self, x: jax.Array, cache: dict | None = None, segment_ids=None):
    """``(y, new_cache)``, x and y (B, T, d_model): training without a cache (None back); with
    ``cache`` (``init_cache``) it continues the cached sequence: T > 1 by the parallel form from the
    cached state (prefill), T = 1 by the one-token recurrence (decode). ``segment_ids`` (B, T)
    (training): packed documents, each as if it were its own row."""
    (xs, z, b, c, dt, g), conv = self.ssd_inputs(x, None if cache is None else cache["conv"],
                                                 segment_ids)
    q, k, v = self.heads(b, c, xs, dt)
    ones = jnp.ones(g.shape + (1,), jnp.float32)
    ssd = dict(scale=1.0, erase=False)
    if cache is None:
      y, _ = triadic_gdn(q, k, v, ones, ones, g[..., None], jnp.ones_like(g), impl=self.impl,
                         chunk_size=self.chunk_size, segment_ids=segment_ids, **ssd)
      return self.ssd_output(y, xs, z, x), None
    if x.shape[1] == 1:
      y, state = triadic_gdn_step(cache["state"], *(a[:, 0] for a in (q, k, v, ones, ones)),
                                  g[:, 0, :, None], jnp.ones_like(g[:, 0]), **ssd)
      y = y[:, None]
    else:
      y, state = triadic_gdn(q, k, v, ones, ones, g[..., None], jnp.ones_like(g), impl=self.impl,
                             chunk_size=self.chunk_size, initial_state=cache["state"], **ssd)
    return self.ssd_output(y, xs, z, x), {"state": state, "conv": conv}

  def init_cache(self, batch: int, max_len: int | None = None) -> dict:
    """Empty decoding cache: the SSD state (B, H, 1, state_dim, head_dim) float32 and the short
    convolutions' inputs. ``max_len`` is unused (the cost is constant)."""
    del max_len
    state = jnp.zeros((batch, self.num_heads, 1, self.state_dim, self.head_dim), jnp.float32)
    return {"state": state, "conv": self.conv_cache(batch)}
