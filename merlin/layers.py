"""Flax Linen mixers: the multi-state ``MultiStateGDN`` / ``MultiStateMamba2`` and their ``Aggregator``.

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

from layers.blocks import dense, l2norm, softplus_inverse
from layers.gdn import gdn_cache, gdn_inputs, gdn_output
from merlin.aggregators import (_softmax, merlin_weights, meanpool_weights, position_weights,
                                vanilla_weights)
from merlin.decode import moment_prefill, moment_step, multistate_decode, visible_now
from merlin.mamba2 import Mamba2
from merlin.memory import state_memory
from merlin.ops import multistate_attention

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
  def __call__(self, x: jax.Array, cache: dict | None = None, position=None):
    """lam (B, T, H, N) for x (B, T, d_model): the training forward.

    Decoding (``cache`` from ``init_cache``): T > 1 is a prefill from the start of the sequence
    (lam as in training, and the segment moment sums of its keys); T = 1 is the token at
    ``position`` (traced int), whose weights come from the running sums alone. Returns
    ``(lam, new_cache)``.
    """
    h, n, r = self.num_heads, self.max_segments, self.d_r
    b, t = x.shape[:2]
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    step = cache is not None and t == 1
    if self.kind == "vanilla":
      lam = vanilla_weights(b, t, h, n)
      return lam if cache is None else (lam, cache)
    if self.kind == "position":
      logical = nn.with_logical_partitioning
      p = nn.DenseGeneral(
          (h, n), use_bias=True, name="pos_proj",
          kernel_init=logical(nn.initializers.lecun_normal(), ("embed", "heads", None)),
          bias_init=logical(nn.initializers.constant(softplus_inverse(1.0)), ("heads", None)), **kw)(x)
      if cache is None:
        return position_weights(p, segment_len=self.segment_len)
      if not step:
        return position_weights(p, segment_len=self.segment_len), cache
      distance = jnp.clip(position // self.segment_len - jnp.arange(n), 0, n - 1)
      lam = jax.nn.softplus(jnp.take(p.astype(jnp.float32), distance, axis=-1))
      return jnp.where(visible_now(position, n, self.segment_len), lam, 0.0), cache

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
    if step:
      (r_mu, r_sigma), (sums, squares) = moment_step(cache["sum"], cache["sq"], qr[:, 0], kr[:, 0],
                                                     position, segment_len=self.segment_len)
      cache = {"sum": sums, "sq": squares}
      mask = visible_now(position, n, self.segment_len)[None]  # (T = 1, N)
      lam = _softmax(r_mu[:, None], tau_mu, mask)
    elif cache is not None:
      sums, squares = moment_prefill(kr, segment_len=self.segment_len, num_segments=n)
      cache = {"sum": sums, "sq": squares}
    if self.kind == "meanpool":
      if not step:
        lam = meanpool_weights(qr, kr, tau_mu, **common)
      return lam if cache is None else (lam, cache)
    gamma = jax.nn.sigmoid(dense(h, ("embed", "heads"), use_bias=True, name="gamma_proj", **kw)(x)
                           .astype(jnp.float32))
    tau_sigma = temperature("tau_sigma", float(r))
    if not step:
      lam = merlin_weights(qr, kr, gamma, tau_mu, tau_sigma, **common)
      return lam if cache is None else (lam, cache)
    gamma = gamma[..., None]
    lam = gamma * lam + (1.0 - gamma) * _softmax(r_sigma[:, None], tau_sigma, mask)
    return lam, cache

  def init_cache(self, batch: int) -> dict:
    """The empty running moments: per segment, the sum of k' (B, G, N, R) and of k' k'^T
    (B, G, N, R, R) for meanpool / merlin; nothing for vanilla / position."""
    if self.kind in ("vanilla", "position"):
      return {}
    shape = (batch, self.groups, self.max_segments, self.d_r)
    return {"sum": jnp.zeros(shape, jnp.float32), "sq": jnp.zeros(shape + (self.d_r,), jnp.float32)}


def _aggregator_cache(layer, *, groups: int, batch: int) -> dict:
  """The empty running moments of ``layer``'s aggregator (a detached module: no parameters)."""
  return Aggregator(layer.aggregator, layer.num_heads, layer.segment_len, layer.max_segments,
                    layer.d_r, groups=groups, parent=None).init_cache(batch)


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
  def __call__(self, x: jax.Array, cache: dict | None = None):
    """x (B, T, d_model) -> (B, T, d_model), the training forward.

    With ``cache`` (``init_cache``) the result is ``(y, new_cache)``: T > 1 is a prefill, which
    must start the sequence (an empty cache; checked when the length is concrete): outputs by the
    chunk-parallel op, final segment states by ``multistate_prefill_states``; T = 1 is one decoding
    step from the segment states and the running moments. Same parameters as training.
    """
    _check_aggregator(self.aggregator)
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    inputs = gdn_inputs(x, self.num_heads, self.head_dim, self.value_dim, 1, self.conv_width,
                        conv_cache=None if cache is None else cache["conv"], **kw)
    (q, k, v, _, _, g, beta), conv = inputs if cache is not None else (inputs, None)
    aggregator = Aggregator(self.aggregator, self.num_heads, self.segment_len, self.max_segments,
                            self.d_r, groups=self.num_heads, impl=self.impl, name="aggregator", **kw)
    if cache is None:
      lam = aggregator(x)
      o = multistate_attention(q, k, v, g[..., 0], beta, lam, segment_len=self.segment_len,
                               erase=self.erase, impl=self.impl,
                               chunk_size=min(self.chunk_size, self.segment_len))
      return gdn_output(o, x, **kw)
    o, cache = multistate_decode(self, q, k, v, g[..., 0], beta,
                                  aggregator(x, cache["moments"], cache["length"]), cache,
                                  erase=self.erase, scale=self.head_dim ** -0.5)
    return gdn_output(o, x, **kw), {**cache, "conv": conv}

  def init_cache(self, batch: int, max_len: int | None = None) -> dict:
    """Empty decoding cache: N segment states (B, H, N, D, V) float32, the aggregator's running
    moments, the short convolutions' inputs and the length (0). ``max_len`` is unused."""
    del max_len
    vd = self.value_dim or self.head_dim
    conv = gdn_cache(batch, self.num_heads, self.head_dim, vd, 1, self.conv_width, self.dtype,
                     state=False)["conv"]
    return {"state": jnp.zeros((batch, self.num_heads, self.max_segments, self.head_dim, vd),
                               jnp.float32),
            "conv": conv, "moments": _aggregator_cache(self, groups=self.num_heads, batch=batch),
            "length": jnp.zeros((), jnp.int32)}

  def state_memory(self, num_segments: int | None = None, bytes_per_value: int = 4):
    """``merlin.state_memory`` for this layer (``max_segments`` segments unless given)."""
    return state_memory(self.num_heads, self.head_dim, self.value_dim or self.head_dim, self.d_r,
                        aggregator=self.aggregator, num_segments=num_segments or self.max_segments,
                        bytes_per_value=bytes_per_value)


class MultiStateMamba2(Mamba2):
  """Multi-state Mamba-2: ``Mamba2``'s parameters plus an aggregator whose k', q' are one group
  of d_r shared by all heads. T <= max_segments * segment_len."""

  aggregator: str = "merlin"
  segment_len: int = 256
  max_segments: int = 64
  d_r: int = 128

  @nn.compact
  def __call__(self, x: jax.Array, cache: dict | None = None):
    """x (B, T, d_model) -> (B, T, d_model); with ``cache`` (``init_cache``), ``(y, new_cache)``:
    T > 1 is a prefill from the start of the sequence, T = 1 one decoding step (see
    ``MultiStateGDN``)."""
    _check_aggregator(self.aggregator)
    if cache is None:
      xs, z, b, c, dt, g = self.ssd_inputs(x)
    else:
      (xs, z, b, c, dt, g), conv = self.ssd_inputs(x, cache["conv"])
    q, k, v = self.heads(b, c, xs, dt)
    aggregator = Aggregator(self.aggregator, self.num_heads, self.segment_len, self.max_segments,
                            self.d_r, groups=1, impl=self.impl, name="aggregator", dtype=self.dtype,
                            param_dtype=self.param_dtype)
    if cache is None:
      lam = aggregator(x)
      y = multistate_attention(q, k, v, g, jnp.ones_like(g), lam, segment_len=self.segment_len,
                               erase=False, scale=1.0, impl=self.impl,
                               chunk_size=min(self.chunk_size, self.segment_len))
      return self.ssd_output(y, xs, z, x)
    y, cache = multistate_decode(self, q, k, v, g, jnp.ones_like(g), aggregator(
        x, cache["moments"], cache["length"]), cache, erase=False, scale=1.0)
    return self.ssd_output(y, xs, z, x), {**cache, "conv": conv}

  def init_cache(self, batch: int, max_len: int | None = None) -> dict:
    """Empty decoding cache: N segment states (B, H, N, state_dim, head_dim) float32, the
    aggregator's running moments, the short convolutions' inputs and the length (0)."""
    del max_len
    moments = _aggregator_cache(self, groups=1, batch=batch)
    return {"state": jnp.zeros((batch, self.num_heads, self.max_segments, self.state_dim,
                                self.head_dim), jnp.float32),
            "conv": self.conv_cache(batch), "moments": moments, "length": jnp.zeros((), jnp.int32)}

  def state_memory(self, num_segments: int | None = None, bytes_per_value: int = 4):
    """``merlin.state_memory`` for this layer (``max_segments`` segments unless given)."""
    return state_memory(self.num_heads, self.state_dim, self.head_dim, self.d_r, moment_groups=1,
                        aggregator=self.aggregator, num_segments=num_segments or self.max_segments,
                        bytes_per_value=bytes_per_value)
