"""The Gated-DeltaNet-style projections shared by the triadic and multi-state layers.

``gdn_inputs`` builds (q, k, v, k2, q2, g, beta) from the hidden state and ``gdn_output`` the gated,
normalised output projection, both inside the calling module's compact method so their parameters
(q_proj, q_conv, ..., decay, beta_proj, gate_down, gate_up, o_norm, out_proj) carry the same names in every
layer that uses them: ``triadic.TriadicGDN`` and ``merlin.MultiStateGDN`` load each other's
checkpoints by name. ``DecayGate`` is the per-slice log decay, also used by ``Mamba2``'s initialisers.
"""

from __future__ import annotations

import functools

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from layers.blocks import (Param, RMSNorm, causal_conv, dense, dense_kernel_init, l2norm,
                           short_conv_init, softplus_inverse)


A_MIN = 1e-6  # the lower end of U(0, 16) for A_log: keeps log(A) finite


def a_log_init(key, shape, dtype=jnp.float32, minval=A_MIN, maxval=16.0):
  """A_log = log A, A ~ U(minval, maxval).

  The default is the authors' and FLA's Gated DeltaNet initialisation, A ~ U(0, 16), with the lower
  end at ``A_MIN`` = 1e-6 instead of 0: a draw of exactly 0 would give A_log = -inf (and a NaN at
  the first weight-decay update); A below 1e-6 is no decay at any length anyway. Mamba-2 draws
  A ~ U(1, 16) (``merlin.Mamba2`` passes minval=1).
  """
  return jnp.log(jax.random.uniform(key, shape, dtype, minval, maxval))


def dt_bias_init(key, shape, dtype=jnp.float32, dt_min=1e-3, dt_max=1e-1):
  """dt_bias = softplus^-1(dt), dt ~ LogUniform(dt_min, dt_max)."""
  u = jax.random.uniform(key, shape, dtype)
  dt = jnp.exp(u * (np.log(dt_max) - np.log(dt_min)) + np.log(dt_min))
  return softplus_inverse(dt).astype(dtype)


class DecayGate(nn.Module):
  """Log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` with a, A_log, dt_bias of shape (.., H, E)."""

  num_heads: int
  expand_e: int = 1
  a_min: float = A_MIN  # A ~ U(a_min, 16) at init (``a_log_init``)
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    shape = (self.num_heads, self.expand_e)
    names = ("heads", "expand")
    a = dense(shape, ("embed",) + names, dtype=self.dtype, param_dtype=self.param_dtype, name="a_proj")(x)
    init = functools.partial(a_log_init, minval=self.a_min)
    a_log = self.param("A_log", nn.with_logical_partitioning(init, names), shape, self.param_dtype)
    dt_bias = self.param("dt_bias", nn.with_logical_partitioning(dt_bias_init, names), shape,
                         self.param_dtype)
    a = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    return -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a)


def gdn_cache(batch, num_heads, head_dim, value_dim=None, expand_e=1, conv_width=4,
              dtype=jnp.float32, state=True, *, num_v_heads=None) -> dict:
  """Zero cache of ``gdn_inputs``'s short convolutions ({"conv": {stream: (B, W-1, heads, .)}},
  q, k, k2, q2 with H heads, v with ``num_v_heads``) plus, if ``state``, the single recurrent
  state (B, num_v_heads, E, D, V) float32 of ``TriadicGDN``."""
  streams = _streams(num_heads, head_dim, value_dim, expand_e, num_v_heads)
  conv = {name: jnp.zeros((batch, conv_width - 1) + shape, dtype) for name, shape, _ in streams}
  cache = {"conv": conv}
  if state:
    hv, vd = num_v_heads or num_heads, value_dim or head_dim
    cache["state"] = jnp.zeros((batch, hv, expand_e, head_dim, vd), jnp.float32)
  return cache


def _streams(num_heads, head_dim, value_dim, expand_e, num_v_heads=None):
  """(name, per-token shape, logical names) of each stream of the fused projection, in order."""
  h, d, vd, e = num_heads, head_dim, value_dim or head_dim, expand_e
  streams = [("q", (h, d), ("heads", "head_dim")), ("k", (h, d), ("heads", "head_dim")),
             ("v", (num_v_heads or h, vd), ("heads", "head_dim"))]
  if e > 1:
    streams += [("k2", (h, e), ("heads", "expand")), ("q2", (h, e), ("heads", "expand"))]
  return streams


def check_value_heads(num_heads: int, num_v_heads: int | None) -> int:
  """The number of value heads (``num_v_heads``, None: ``num_heads``); ValueError unless it is a
  positive multiple of ``num_heads``."""
  if num_v_heads is None:
    return num_heads
  if not isinstance(num_v_heads, int) or isinstance(num_v_heads, bool) or num_v_heads < 1 \
      or num_v_heads % num_heads:
    raise ValueError(f"num_v_heads must be a positive multiple of num_heads ({num_heads}), got "
                     f"{num_v_heads!r}")
  return num_v_heads


def gdn_inputs(x, num_heads, head_dim, value_dim=None, expand_e=1, conv_width=4, *,
               a_min=A_MIN, dtype=jnp.float32, param_dtype=jnp.float32, conv_cache=None,
               segment_ids=None, num_v_heads=None, conv_impl="auto"):
  """The input side of ``TriadicGDN``: (q, k, v, k2, q2, g, beta) from x (B, T, d_model).

  Call it inside a compact method: its parameters (q_proj, q_conv, ..., decay, beta_proj) belong to
  the calling module, under the same names in every layer that uses it, so checkpoints of the
  single-state layer load into the multi-state one (``merlin.MultiStateGDN``) by name.

  Each stream (q, k, v and, for E > 1, k2, q2) has its own projection kernel ``{s}_proj/kernel``
  (d_model, H, .) and convolution kernel ``{s}_conv/kernel`` (width, H, .), so an E = 1 checkpoint
  maps onto an E = 8 model by name; the call concatenates them along the channels and runs one
  matmul and one depthwise convolution over all streams (the authors' fused form: one pass over x
  and over the projected activations), then splits the channels into (B, T, H, .) views (no
  transposes) for the activations and norms. Identical to a projection and a convolution per stream.

  Returns ``(inputs, new_conv_cache)``. With ``conv_cache`` ({stream: last conv_width - 1 inputs},
  see ``gdn_cache``) the convolutions continue from it (decoding); without it (training) they start
  from zeros and new_conv_cache is None. ``segment_ids`` (B, T) (training): packed documents; no
  convolution reads across a document start. ``conv_impl``: the convolution's implementation
  (``causal_conv``'s impl: "auto" the Pallas kernels on a GPU without a cache, else XLA).

  ``num_v_heads`` (None: ``num_heads``): grouped value heads (FLA's GVA), a multiple G of
  ``num_heads``. v, the decay and beta have ``num_v_heads`` heads; q, k (and k2, q2) are
  projected for ``num_heads`` heads and key head i serves value heads i G .. i G + G - 1, so every
  returned stream has ``num_v_heads`` heads.
  """
  h, e = num_heads, expand_e
  hv = check_value_heads(num_heads, num_v_heads)
  streams = _streams(num_heads, head_dim, value_dim, expand_e, num_v_heads)
  d_model = x.shape[-1]
  proj_init, conv_init = dense_kernel_init(), short_conv_init(conv_width)
  proj = [Param((d_model,) + shape, proj_init, ("embed",) + names, param_dtype, name=f"{s}_proj")()
          for s, shape, names in streams]
  conv = [Param((conv_width,) + shape, conv_init, ("conv",) + names, param_dtype, name=f"{s}_conv")()
          for s, shape, names in streams]
  sizes = [math.prod(shape) for _, shape, _ in streams]
  flat = lambda z, lead: z.reshape(z.shape[:lead] + (-1,))
  w_in = jnp.concatenate([flat(w, 1) for w in proj], axis=-1).astype(dtype)  # (d_model, C)
  z = jax.lax.dot_general(x.astype(dtype), w_in, (((x.ndim - 1,), (0,)), ((), ())))  # (B, T, C)
  w_conv = jnp.concatenate([flat(w, 1) for w in conv], axis=-1)  # (width, C)
  cache_in = None
  if conv_cache is not None:
    cache_in = jnp.concatenate([flat(conv_cache[s], 2) for s, _, _ in streams], axis=-1)
  y, cache_out = causal_conv(z, w_conv, cache_in, segment_ids, conv_impl)
  split = lambda z: {s: part.reshape(z.shape[:-1] + shape) for (s, shape, _), part in
                     zip(streams, jnp.split(z, np.cumsum(sizes)[:-1], axis=-1))}
  y = split(y)
  new_cache = None if cache_out is None else split(cache_out)

  q = l2norm(jax.nn.silu(y["q"]))
  k = l2norm(jax.nn.silu(y["k"]))
  v = jax.nn.silu(y["v"])
  b, t = x.shape[:2]
  if e > 1:
    k2 = l2norm(jax.nn.softplus(y["k2"].astype(jnp.float32)))
    q2 = l2norm(jax.nn.softplus(y["q2"].astype(jnp.float32)))
  else:
    k2 = q2 = jnp.ones((b, t, h, 1), jnp.float32)
  kw = dict(dtype=dtype, param_dtype=param_dtype)
  g = DecayGate(hv, e, a_min=a_min, name="decay", **kw)(x)
  beta = jax.nn.sigmoid(dense((hv,), ("embed", "heads"), name="beta_proj", **kw)(x).astype(jnp.float32))
  if hv != h:  # each key head's q, k, k2, q2 shared by its group of value heads
    q, k, k2, q2 = (jnp.repeat(z, hv // h, axis=-2) for z in (q, k, k2, q2))
  inputs = (q, k, v, k2.astype(q.dtype), q2.astype(q.dtype), g, beta)
  return inputs, new_cache


def gdn_output(o, x, gate_rank: int = 128, *, dtype=jnp.float32, param_dtype=jnp.float32):
  """The output side of ``TriadicGDN``: out_proj(RMSNorm(o) * sigmoid(gate)), o (B, T, H, V).

  The gate is the authors' rank-``gate_rank`` projection of x, gate_up(gate_down(x)): x -> rank
  (no bias) -> H x V (with bias). ``gate_rank=0`` is a full-rank gate, gate_proj(x) (d_model ->
  H x V, no bias). Like ``gdn_inputs``, call it inside a compact method (parameters gate_down and
  gate_up, or gate_proj; o_norm, out_proj).
  """
  if not isinstance(gate_rank, int) or gate_rank < 0:
    raise ValueError(f"gate_rank must be a non-negative int (0: a full-rank gate), got {gate_rank!r}")
  kw = dict(dtype=dtype, param_dtype=param_dtype)
  heads = o.shape[-2:]
  if gate_rank:
    gate = dense(gate_rank, ("embed", "gate_rank"), name="gate_down", **kw)(x)
    gate = dense(heads, ("gate_rank", "heads", "head_dim"), use_bias=True, name="gate_up", **kw)(gate)
  else:
    gate = dense(heads, ("embed", "heads", "head_dim"), name="gate_proj", **kw)(x)
  o = RMSNorm(names=("head_dim",), name="o_norm", **kw)(o) * jax.nn.sigmoid(gate)
  return dense(x.shape[-1], ("heads", "head_dim", "embed"), axis=(-2, -1), name="out_proj", **kw)(o)
