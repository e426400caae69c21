"""The mixer registry: a mixer name from the config -> the Flax module that mixes along time.

Every mixer is called as ``mixer(x)`` with x (B, T, d_model) -> (B, T, d_model); the mixers in
``DECODABLE`` also take ``mixer(x, cache) -> (y, new_cache)`` for prefill and decoding. The
modules of the multi-state paper live in ``merlin`` and are imported only when a config asks for
them.
"""

from __future__ import annotations

import importlib
from typing import Callable

import flax.linen as nn

from lm.attention import Attention
from triadic import TriadicGDN

MIXERS = ("attention", "gdn", "triadic_gdn", "triadic_sgla", "mamba2", "multistate_gdn",
          "multistate_mamba2")
MULTISTATE = ("multistate_gdn", "multistate_mamba2")
DECODABLE = MIXERS  # mixers with a decoding cache (init_cache, mixer(x, cache)); all of them now


def check_decodable(kind: str) -> None:
  """NotImplementedError naming ``kind`` if that mixer has no recurrent / KV-cache decoding yet."""
  if kind not in DECODABLE:
    raise NotImplementedError(f"decoding with a cache is not implemented for mixer {kind!r} yet; "
                              f"mixers that decode: {DECODABLE}")


def mixer_cache(kind: str, cfg, batch: int, max_len: int, dtype) -> dict:
  """The empty decoding cache of one ``kind`` layer (the mixer's ``init_cache``)."""
  check_decodable(kind)
  # parent=None: a detached module (callable from inside another module's method, e.g. LM.init_cache)
  return make_mixer(kind, cfg, dtype=dtype, parent=None).init_cache(batch, max_len)


def _merlin(name: str):
  try:
    return getattr(importlib.import_module("merlin"), name)
  except (ImportError, AttributeError) as err:
    raise ValueError(f"model.mixer needs merlin.{name}, which is not available: {err}") from err


def _triadic(expand_e: int, erase: bool) -> Callable:
  def build(cfg, **kw):
    return TriadicGDN(cfg.num_heads, cfg.head_dim, expand_e=expand_e, erase=erase,
                      conv_width=cfg.conv_width, impl=cfg.impl, chunk_size=cfg.chunk_size, **kw)
  return build


def _multistate(cfg) -> dict:
  return dict(aggregator=cfg.aggregator, segment_len=cfg.segment_len,
              max_segments=cfg.max_segments, d_r=cfg.d_r)


def make_mixer(kind: str, cfg, **kw) -> nn.Module:
  """Build mixer ``kind`` from a ``ModelConfig`` (kw: dtype, param_dtype, module name)."""
  ops = dict(conv_width=cfg.conv_width, impl=cfg.impl, chunk_size=cfg.chunk_size)
  if kind == "attention":
    return Attention(cfg.num_heads, cfg.head_dim, num_kv_heads=cfg.num_kv_heads,
                     implementation=cfg.attention_impl, **kw)
  if kind == "gdn":
    return _triadic(1, True)(cfg, **kw)
  if kind == "triadic_gdn":
    return _triadic(cfg.expand_e, True)(cfg, **kw)
  if kind == "triadic_sgla":
    return _triadic(cfg.expand_e, False)(cfg, **kw)
  if kind == "mamba2":
    return _merlin("Mamba2")(cfg.num_heads, cfg.head_dim, state_dim=cfg.state_dim, **ops, **kw)
  if kind == "multistate_gdn":
    return _merlin("MultiStateGDN")(cfg.num_heads, cfg.head_dim, **_multistate(cfg), **ops, **kw)
  if kind == "multistate_mamba2":
    return _merlin("MultiStateMamba2")(cfg.num_heads, cfg.head_dim, state_dim=cfg.state_dim,
                                      **_multistate(cfg), **ops, **kw)
  raise ValueError(f"model.mixer must be one of {MIXERS}, got {kind!r}")
