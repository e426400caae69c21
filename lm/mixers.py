"""The mixer registry: a mixer name from the config -> how to build it and what it costs.

Each entry of ``MIXERS`` is a ``Mixer``: its builder (a ``ModelConfig`` -> the Flax module that mixes
along time), the ``ModelConfig`` fields it reads, and its costs per layer (training FLOPs per token,
decode-time bytes per sequence, the longest sequence it accepts). Adding a mixer is one entry here.

Every mixer is called as ``mixer(x, cache=None) -> (y, cache)`` with x (B, T, d_model) -> y
(B, T, d_model): training passes no cache and gets None back; decoding passes
``mixer.init_cache(batch, max_len)`` (prefill a prompt, then one token at a time).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm.attention import Attention
from merlin import Mamba2, MultiStateGDN, MultiStateMamba2
from triadic import TriadicGDN

# The fields every recurrent mixer reads besides num_heads and head_dim (GDN-style ones also gate_rank).
_OPS = ("conv_width", "conv_impl", "impl", "chunk_size")
_GDN = ("gate_rank", "a_min")  # the GDN-style mixers' output gate and decay initialisation
_MULTISTATE = ("aggregator", "segment_len", "max_segments", "d_r")


@dataclasses.dataclass(frozen=True)
class Mixer:
  """One registered mixer.

  build: (cfg, **kw) -> module; kw are dtype, param_dtype, name, parent.
  fields: the ModelConfig fields the mixer reads besides num_heads and head_dim.
  flops: (cfg, seq_len) -> training FLOPs per token of one layer beyond its matmuls (which
    ``lm.costs`` counts from the parameters).
  state_bytes: (cfg, seq_len) -> {"recurrent_state", "kv_cache"} bytes of one layer's decoding
    cache for one sequence.
  max_len: cfg -> the longest sequence the mixer accepts (None: any).
  """

  build: Callable[..., nn.Module]
  fields: tuple[str, ...]
  flops: Callable[..., float]
  state_bytes: Callable[..., dict]
  max_len: Callable[..., int | None] = lambda cfg: None


def _attention_flops(cfg, seq_len):
  return 6.0 * seq_len * cfg.num_heads * cfg.head_dim  # the causal half of QK^T and AV


def _cache_bytes(build, cfg, seq_len, max_len) -> int:
  """Bytes of one layer's decoding cache for one sequence of ``seq_len`` tokens (at most
  ``max_len``): its floating leaves, by ``jax.eval_shape`` (nothing allocated; the int32 length
  counter is not counted). The accounting is the cache itself, so the two never disagree."""
  module = build(cfg, dtype=cfg.compute_dtype, parent=None)
  length = seq_len if max_len is None else min(seq_len, max_len)
  cache = jax.eval_shape(lambda: module.init_cache(1, length))
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache)
             if jnp.issubdtype(x.dtype, jnp.floating))


def _attention_bytes(cfg, seq_len):
  return {"recurrent_state": 0, "kv_cache": _cache_bytes(MIXERS["attention"].build, cfg, seq_len, None)}


def _recurrent(build, fields, *, state_shape, state_heads=lambda cfg: cfg.num_heads,
               multistate=False) -> Mixer:
  """A linear-attention mixer's entry.

  state_shape: cfg -> (E, key dim, value dim) of one head's state; state_heads: cfg -> the number
  of such states; multistate: one state per segment, T <= max_segments * segment_len.
  """

  def flops(cfg, seq_len):
    """Per head: reading and writing the E x D x V state (2 x 2 E D V), the intra-chunk products
    (2 C (D + V + E)); multi-state mixers also read on average T / (2 L) segment states."""
    e, d, v = state_shape(cfg)
    per_head = 4.0 * e * d * v + 2.0 * min(cfg.chunk_size, seq_len) * (d + v + e)
    if multistate:
      per_head += 2.0 * d * v * max(1.0, seq_len / (2 * cfg.segment_len))
    return 3.0 * state_heads(cfg) * per_head

  max_len = (lambda cfg: cfg.max_segments * cfg.segment_len) if multistate else (lambda cfg: None)

  def state_bytes(cfg, seq_len):
    """float32 states, short-convolution inputs and (multi-state) the aggregator's segment
    moments (``merlin.memory.MOMENT_SIZES``): the layer's decoding cache, independent of length."""
    return {"recurrent_state": _cache_bytes(build, cfg, seq_len, max_len(cfg)), "kv_cache": 0}

  return Mixer(build, fields, flops, state_bytes, max_len)


def _ops(cfg) -> dict:
  return dict(conv_width=cfg.conv_width, conv_impl=cfg.conv_impl, impl=cfg.impl,
              chunk_size=cfg.chunk_size)


def _multistate(cfg) -> dict:
  return dict(aggregator=cfg.aggregator, segment_len=cfg.segment_len,
              max_segments=cfg.max_segments, d_r=cfg.d_r)


_VALUES = ("value_dim", "num_v_heads")  # TriadicGDN's value width and grouped value heads


def _triadic(expand_e: Callable, erase: bool, fields: tuple[str, ...]) -> Mixer:
  """TriadicGDN with E = expand_e(cfg); value_dim / num_v_heads 0 are the layer's defaults."""
  return _recurrent(
      lambda cfg, **kw: TriadicGDN(cfg.num_heads, cfg.head_dim, value_dim=cfg.value_dim or None,
                                   num_v_heads=cfg.num_v_heads or None, expand_e=expand_e(cfg),
                                   erase=erase, gate_rank=cfg.gate_rank, a_min=cfg.a_min,
                                   **_ops(cfg), **kw),
      fields + _VALUES,
      state_shape=lambda cfg: (expand_e(cfg), cfg.head_dim, cfg.value_dim or cfg.head_dim),
      state_heads=lambda cfg: cfg.num_v_heads or cfg.num_heads)


MIXERS: dict[str, Mixer] = {
    "attention": Mixer(
        lambda cfg, **kw: Attention(cfg.num_heads, cfg.head_dim, num_kv_heads=cfg.num_kv_heads,
                                    qk_norm=cfg.qk_norm, rope_base=cfg.rope_base,
                                    rope_per_document=cfg.rope_per_document,
                                    implementation=cfg.attention_impl, **kw),
        ("num_kv_heads", "qk_norm", "rope_base", "rope_per_document", "attention_impl"),
        _attention_flops, _attention_bytes),
    "gdn": _triadic(lambda cfg: 1, True, _GDN + _OPS),
    "triadic_gdn": _triadic(lambda cfg: cfg.expand_e, True, ("expand_e",) + _GDN + _OPS),
    "triadic_sgla": _triadic(lambda cfg: cfg.expand_e, False, ("expand_e",) + _GDN + _OPS),
    "mamba2": _recurrent(
        lambda cfg, **kw: Mamba2(cfg.num_heads, cfg.head_dim, state_dim=cfg.state_dim, **_ops(cfg),
                                 **kw),
        ("state_dim",) + _OPS, state_shape=lambda cfg: (1, cfg.state_dim, cfg.head_dim)),
    "multistate_gdn": _recurrent(
        lambda cfg, **kw: MultiStateGDN(cfg.num_heads, cfg.head_dim, **_multistate(cfg),
                                        gate_rank=cfg.gate_rank, a_min=cfg.a_min, **_ops(cfg),
                                        **kw),
        _MULTISTATE + _GDN + _OPS, state_shape=lambda cfg: (1, cfg.head_dim, cfg.head_dim),
        multistate=True),
    "multistate_mamba2": _recurrent(
        lambda cfg, **kw: MultiStateMamba2(cfg.num_heads, cfg.head_dim, state_dim=cfg.state_dim,
                                           **_multistate(cfg), **_ops(cfg), **kw),
        ("state_dim",) + _MULTISTATE + _OPS, state_shape=lambda cfg: (1, cfg.state_dim, cfg.head_dim),
        multistate=True),
}


def get(kind: str) -> Mixer:
  """The registry entry of mixer ``kind``; ValueError naming the known ones otherwise."""
  if kind not in MIXERS:
    raise ValueError(f"unknown mixer {kind!r}; known mixers: {tuple(MIXERS)}")
  return MIXERS[kind]


def make_mixer(kind: str, cfg, **kw) -> nn.Module:
  """Build mixer ``kind`` from a ``ModelConfig`` (kw: dtype, param_dtype, module name, parent)."""
  return get(kind).build(cfg, **kw)


def mixer_cache(kind: str, cfg, batch: int, max_len: int, dtype) -> dict:
  """The empty decoding cache of one ``kind`` layer (the mixer's ``init_cache``)."""
  # parent=None: a detached module (callable from inside another module's method, e.g. LM.init_cache)
  return make_mixer(kind, cfg, dtype=dtype, parent=None).init_cache(batch, max_len)
