"""The aggregators as Flax Linen modules: one class per kind, built by ``make_aggregator``.

Each maps the hidden state x (B, T, d_model) to segment weights lam (B, T, H, N) and is called as
``aggregator(x, cache=None, position=None, segment_ids=None) -> (lam, cache)`` (segment_ids
(B, T), training only: packed documents, segments counted from each document's start):

- training (``cache=None``): lam for every token; the returned cache is None;
- prefill (``cache`` from ``init_cache``, T > 1, from the start of the sequence): lam as in
  training, and the cache holding what a decoding step needs (for meanpool / merlin the segment
  moment sums of the prompt's keys);
- decoding step (``cache``, T = 1): the token at ``position`` (traced int), whose weights come from
  the cache alone, so a step costs the same however long the context is.

k', q' = l2norm(own projections of x) with ``groups`` groups of d_r (H per head, or 1 shared):
unit vectors keep r_mu in [-1, 1] and r_sigma in [0, 1], and the temperatures set the scale.
tau = exp(log_tau) per head (parameters log_tau_mu, log_tau_sigma), initialised to sqrt(d_r)
(mean) and d_r (variance): a random unit query aligns with a unit key at about d_r^-1/2, with
variance about 1/d_r, so both logits start at O(1). gamma = sigmoid(w^T x + b) per head.
Position: p = W x + b, with b chosen so that lam = softplus(p) = 1 (vanilla) when W x = 0.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from layers.blocks import dense, l2norm, softplus_inverse
from merlin.aggregators import (_softmax, meanpool_weights, merlin_weights, position_weights,
                                vanilla_weights)
from merlin.decode import moment_prefill, moment_step, visible_now


class _AggregatorBase(nn.Module):
  """The fields every aggregator takes (``groups``: H groups of k', q', or 1 shared)."""

  num_heads: int
  segment_len: int
  max_segments: int
  d_r: int
  groups: int
  impl: str = "auto"
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  def init_cache(self, batch: int) -> dict:
    """The empty decoding cache: nothing (the weights need no running state)."""
    del batch
    return {}


class VanillaAggregator(_AggregatorBase):
  """lam = 1: the sum of the segment states, i.e. the single-state layer."""

  @nn.compact
  def __call__(self, x: jax.Array, cache: dict | None = None, position=None, segment_ids=None):
    del position
    b, t = x.shape[:2]
    return vanilla_weights(b, t, self.num_heads, self.max_segments), cache


class PositionAggregator(_AggregatorBase):
  """lam_ti = softplus(p_t[s(t) - i]): a weight per distance in segments, p = W x + b."""

  @nn.compact
  def __call__(self, x: jax.Array, cache: dict | None = None, position=None, segment_ids=None):
    h, n = self.num_heads, self.max_segments
    logical = nn.with_logical_partitioning
    p = nn.DenseGeneral(
        (h, n), use_bias=True, name="pos_proj",
        kernel_init=logical(nn.initializers.lecun_normal(), ("embed", "heads", None)),
        bias_init=logical(nn.initializers.constant(softplus_inverse(1.0)), ("heads", None)),
        dtype=self.dtype, param_dtype=self.param_dtype)(x)
    if cache is None or x.shape[1] > 1:
      return position_weights(p, segment_len=self.segment_len, segment_ids=segment_ids), cache
    distance = jnp.clip(position // self.segment_len - jnp.arange(n), 0, n - 1)
    lam = jax.nn.softplus(jnp.take(p.astype(jnp.float32), distance, axis=-1))
    return jnp.where(visible_now(position, n, self.segment_len), lam, 0.0), cache


class _MomentAggregator(_AggregatorBase):
  """What meanpool and merlin share: the small keys / queries, the temperatures and the running
  segment moments of the keys (their decoding cache). ``SECOND_MOMENT``: whether the weights read
  r_sigma, so the cache keeps the k' k'^T sums (``merlin.memory.MOMENT_SIZES`` counts them)."""

  SECOND_MOMENT = True

  def init_cache(self, batch: int) -> dict:
    """The empty running moments: per segment, the sum of k' (B, G, N, R) and, with
    ``SECOND_MOMENT``, of k' k'^T (B, G, N, R, R)."""
    shape = (batch, self.groups, self.max_segments, self.d_r)
    cache = {"sum": jnp.zeros(shape, jnp.float32)}
    if self.SECOND_MOMENT:
      cache["sq"] = jnp.zeros(shape + (self.d_r,), jnp.float32)
    return cache

  def _pack(self, sums, squares) -> dict:
    return {"sum": sums, **({"sq": squares} if self.SECOND_MOMENT else {})}

  def small_keys(self, x):
    """q', k' (B, T, G, R) float32 unit vectors (parameters qr_proj, kr_proj)."""
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)

    def small(name):
      if self.groups == 1:
        z = dense(self.d_r, ("embed", "moment"), name=name, **kw)(x)[:, :, None]
      else:
        z = dense((self.num_heads, self.d_r), ("embed", "heads", "moment"), name=name, **kw)(x)
      return l2norm(z.astype(jnp.float32))

    return small("qr_proj"), small("kr_proj")

  def temperature(self, name: str, init: float):
    """A learned positive per-head temperature exp(log_<name>) (H,), initialised to ``init``."""
    init_fn = nn.with_logical_partitioning(nn.initializers.constant(np.log(init)), ("heads",))
    log_tau = self.param(f"log_{name}", init_fn, (self.num_heads,), self.param_dtype)
    return jnp.exp(log_tau.astype(jnp.float32))

  def moments(self, qr, kr, cache, position):
    """The decoding side of the moments: ``(scores, cache)``. On a decoding step (T = 1) scores
    are the (r_mu, r_sigma) (B, G, N) the token reads after adding its key to the cache; otherwise
    scores is None and the cache (if any) is the prompt's segment sums."""
    if cache is None:
      return None, None
    if qr.shape[1] > 1:
      return None, self._pack(*moment_prefill(kr, segment_len=self.segment_len,
                                              num_segments=self.max_segments,
                                              squares=self.SECOND_MOMENT))
    scores, moments = moment_step(cache["sum"], cache.get("sq"), qr[:, 0], kr[:, 0], position,
                                  segment_len=self.segment_len)
    return scores, self._pack(*moments)

  def segment_kwargs(self) -> dict:
    return dict(segment_len=self.segment_len, max_segments=self.max_segments,
                impl="scan" if self.impl == "scan" else "auto")

  def visible(self, position):
    """(T = 1, N) bool: the segments a decoding step at ``position`` reads."""
    return visible_now(position, self.max_segments, self.segment_len)[None]


class MeanpoolAggregator(_MomentAggregator):
  """lam_ti = softmax_{i <= s(t)}(tau_mu r_mu): the segments whose mean key the query aligns with."""

  SECOND_MOMENT = False  # reads only the mean: no k' k'^T sums in its cache

  @nn.compact
  def __call__(self, x: jax.Array, cache: dict | None = None, position=None, segment_ids=None):
    qr, kr = self.small_keys(x)
    tau_mu = self.temperature("tau_mu", self.d_r ** 0.5)
    scores, cache = self.moments(qr, kr, cache, position)
    if scores is None:
      return meanpool_weights(qr, kr, tau_mu, segment_ids=segment_ids,
                              **self.segment_kwargs()), cache
    r_mu, _ = scores
    return _softmax(r_mu[:, None], tau_mu, self.visible(position)), cache


class MerlinAggregator(_MomentAggregator):
  """lam = gamma softmax(tau_mu r_mu) + (1 - gamma) softmax(tau_sigma r_sigma) over i <= s(t)."""

  @nn.compact
  def __call__(self, x: jax.Array, cache: dict | None = None, position=None, segment_ids=None):
    qr, kr = self.small_keys(x)
    tau_mu = self.temperature("tau_mu", self.d_r ** 0.5)
    scores, cache = self.moments(qr, kr, cache, position)
    gamma = jax.nn.sigmoid(dense(self.num_heads, ("embed", "heads"), use_bias=True,
                                 name="gamma_proj", dtype=self.dtype,
                                 param_dtype=self.param_dtype)(x).astype(jnp.float32))
    tau_sigma = self.temperature("tau_sigma", float(self.d_r))
    if scores is None:
      return merlin_weights(qr, kr, gamma, tau_mu, tau_sigma, segment_ids=segment_ids,
                            **self.segment_kwargs()), cache
    r_mu, r_sigma = scores
    mask = self.visible(position)
    gamma = gamma[..., None]
    lam = (gamma * _softmax(r_mu[:, None], tau_mu, mask)
           + (1.0 - gamma) * _softmax(r_sigma[:, None], tau_sigma, mask))
    return lam, cache


AGGREGATORS = {"vanilla": VanillaAggregator, "position": PositionAggregator,
               "meanpool": MeanpoolAggregator, "merlin": MerlinAggregator}


def make_aggregator(kind: str, num_heads: int, segment_len: int, max_segments: int, d_r: int, *,
                    groups: int, **kw) -> _AggregatorBase:
  """The aggregator module of ``kind`` (a key of ``AGGREGATORS``); kw: impl, dtype, param_dtype,
  name, parent."""
  if kind not in AGGREGATORS:
    raise ValueError(f"aggregator must be one of {tuple(AGGREGATORS)}, got {kind!r}")
  return AGGREGATORS[kind](num_heads, segment_len, max_segments, d_r, groups, **kw)
