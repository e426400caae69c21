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

from layers.blocks import check_sizes
from layers.gdn import A_MIN, gdn_cache, gdn_inputs, gdn_output
from layers.remat import saved_op
from merlin.aggregator_layers import make_aggregator
from merlin.decode import multistate_decode
from merlin.mamba2 import Mamba2
from merlin.memory import state_memory
from merlin.ops import multistate_attention

def _aggregator(layer, *, groups: int, **kw):
  """``layer``'s aggregator module (kw: impl, dtype, param_dtype, name, parent)."""
  return make_aggregator(layer.aggregator, layer.num_heads, layer.segment_len, layer.max_segments,
                         layer.d_r, groups=groups, **kw)


def _moments_and_length(cache):
  """The aggregator's cache and the token position from a layer's decoding cache (None, None in
  training)."""
  return (None, None) if cache is None else (cache["moments"], cache["length"])


def _check_capacity(layer, max_len) -> None:
  """ValueError if a decode cache for ``max_len`` tokens exceeds what ``layer`` holds: the cache
  has max_segments segment states, so tokens past segment_len * max_segments have none."""
  if max_len is None:
    return
  capacity = layer.segment_len * layer.max_segments
  if not isinstance(max_len, int) or max_len < 1:
    raise ValueError(f"max_len must be a positive int, got {max_len!r}")
  if max_len > capacity:
    raise ValueError(f"max_len = {max_len} exceeds what {type(layer).__name__} holds: segment_len "
                     f"* max_segments = {layer.segment_len} * {layer.max_segments} = {capacity}")


_GDN_SIZES = ("num_heads", "head_dim", "value_dim", "segment_len", "max_segments", "d_r",
              "conv_width", "chunk_size")
_MAMBA_SIZES = ("num_heads", "head_dim", "state_dim", "segment_len", "max_segments", "d_r",
                "conv_width", "chunk_size")


class MultiStateGDN(nn.Module):
  """Multi-state Gated DeltaNet (``erase=True``) or multi-state sGLA (``erase=False``) mixer.

  x (B, T, d_model) -> (B, T, d_model); T <= max_segments * segment_len. The chunk length is
  min(chunk_size, segment_len) and must divide segment_len. ``gate_rank``: the output gate's rank
  (as ``triadic.TriadicGDN``).
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
  conv_impl: str = "auto"
  gate_rank: int = 128
  a_min: float = A_MIN
  impl: str = "auto"
  chunk_size: int = 64
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, cache: dict | None = None, segment_ids=None):
    """``(y, new_cache)``, x and y (B, T, d_model). ``segment_ids`` (B, T) (training only): packed
    documents, each computed as if it were its own row (``multistate_attention``'s contract).

    Training passes no cache and gets None back. With ``cache`` (``init_cache``): T > 1 is a
    prefill, which must start the sequence (an empty cache; checked when the length is concrete):
    outputs by the chunk-parallel op, final segment states by ``multistate_prefill_states``; T = 1
    is one decoding step from the segment states and the running moments. Same parameters as
    training.
    """
    check_sizes(self, *_GDN_SIZES)
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    (q, k, v, _, _, g, beta), conv = gdn_inputs(
        x, self.num_heads, self.head_dim, self.value_dim, 1, self.conv_width, a_min=self.a_min,
        conv_cache=None if cache is None else cache["conv"], segment_ids=segment_ids,
        conv_impl=self.conv_impl, **kw)
    aggregator = _aggregator(self, groups=self.num_heads, impl=self.impl, name="aggregator", **kw)
    lam, moments = aggregator(x, *_moments_and_length(cache), segment_ids=segment_ids)
    if cache is None:
      op = lambda *z: multistate_attention(
          *z[:-1], segment_len=self.segment_len, erase=self.erase, impl=self.impl,
          chunk_size=min(self.chunk_size, self.segment_len), segment_ids=z[-1])
      o = saved_op(op)(q, k, v, g[..., 0], beta, lam, segment_ids)  # named for "save_mixer_op"
      return gdn_output(o, x, self.gate_rank, **kw), None
    o, cache = multistate_decode(self, q, k, v, g[..., 0], beta, lam, moments, cache,
                                 erase=self.erase, scale=self.head_dim ** -0.5)
    return gdn_output(o, x, self.gate_rank, **kw), {**cache, "conv": conv}

  def init_cache(self, batch: int, max_len: int | None = None) -> dict:
    """Empty decoding cache: N segment states (B, H, N, D, V) float32, the aggregator's running
    moments, the short convolutions' inputs and the length (0). ``max_len`` (the tokens to be
    decoded, prompt included) must be at most segment_len * max_segments (ValueError)."""
    check_sizes(self, *_GDN_SIZES)
    _check_capacity(self, max_len)
    vd = self.value_dim or self.head_dim
    conv = gdn_cache(batch, self.num_heads, self.head_dim, vd, 1, self.conv_width, self.dtype,
                     state=False)["conv"]
    return {"state": jnp.zeros((batch, self.num_heads, self.max_segments, self.head_dim, vd),
                               jnp.float32),
            "conv": conv, "moments": _aggregator(self, groups=self.num_heads, parent=None).init_cache(batch),
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
  def __call__(self, x: jax.Array, cache: dict | None = None, segment_ids=None):
    """``(y, new_cache)``, x and y (B, T, d_model): training without a cache (None back); with
    ``cache`` (``init_cache``) T > 1 is a prefill from the start of the sequence, T = 1 one decoding
    step (see ``MultiStateGDN``). ``segment_ids`` (B, T) (training): packed documents."""
    check_sizes(self, *_MAMBA_SIZES)
    (xs, z, b, c, dt, g), conv = self.ssd_inputs(x, None if cache is None else cache["conv"],
                                                 segment_ids)
    q, k, v = self.heads(b, c, xs, dt)
    aggregator = _aggregator(self, groups=1, impl=self.impl, name="aggregator", dtype=self.dtype,
                             param_dtype=self.param_dtype)
    lam, moments = aggregator(x, *_moments_and_length(cache), segment_ids=segment_ids)
    if cache is None:
      y = multistate_attention(q, k, v, g, jnp.ones_like(g), lam, segment_len=self.segment_len,
                               erase=False, scale=1.0, impl=self.impl,
                               chunk_size=min(self.chunk_size, self.segment_len),
                               segment_ids=segment_ids)
      return self.ssd_output(y, xs, z, x), None
    y, cache = multistate_decode(self, q, k, v, g, jnp.ones_like(g), lam, moments, cache,
                                 erase=False, scale=1.0)
    return self.ssd_output(y, xs, z, x), {**cache, "conv": conv}

  def init_cache(self, batch: int, max_len: int | None = None) -> dict:
    """Empty decoding cache: N segment states (B, H, N, state_dim, head_dim) float32, the
    aggregator's running moments, the short convolutions' inputs and the length (0). ``max_len``
    must be at most segment_len * max_segments (ValueError)."""
    check_sizes(self, *_MAMBA_SIZES)
    _check_capacity(self, max_len)
    moments = _aggregator(self, groups=1, parent=None).init_cache(batch)
    return {"state": jnp.zeros((batch, self.num_heads, self.max_segments, self.state_dim,
                                self.head_dim), jnp.float32),
            "conv": self.conv_cache(batch), "moments": moments, "length": jnp.zeros((), jnp.int32)}

  def state_memory(self, num_segments: int | None = None, bytes_per_value: int = 4):
    """``merlin.state_memory`` for this layer (``max_segments`` segments unless given)."""
    return state_memory(self.num_heads, self.state_dim, self.head_dim, self.d_r, moment_groups=1,
                        aggregator=self.aggregator, num_segments=num_segments or self.max_segments,
                        bytes_per_value=bytes_per_value)
