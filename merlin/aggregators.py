"""Segment weights lam (B, T, H, N) for multi-state linear attention (docs/spec.md section 2).

    vanilla:   lam_ti = 1
    position:  lam_ti = softplus(p_t[s(t) - i])
    meanpool:  lam_ti = softmax_{i <= s(t)}(tau_mu r_mu)
    merlin:    lam_ti = gamma_t softmax_{i <= s(t)}(tau_mu r_mu) + (1 - gamma_t) softmax_{i <= s(t)}(tau_sigma r_sigma)

Every weight is zero for i > s(t) (segments not yet started). ``impl`` picks how the segment
moments are computed: "scan" (running sums), "parallel" or "auto" (= "parallel").

``segment_ids`` (B, T) (packed rows, as ``merlin.multistate_attention`` takes them): s(t) and the
segments i are counted from the start of the token's document, and only its own document's
segments are visible, as if each document were its own row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from merlin.moments import IMPLS, moment_scores
from merlin.segments import (check_segments, document_segments, document_visible, segment_ids,
                             visible)
from triadic.ops import check_array


def _segments(t, segment_len, n, doc_ids):
  """(s(t) (T,) or (B, T), visible (T, N) or (B, T, N)) for rows or packed rows."""
  if doc_ids is None:
    return segment_ids(t, segment_len), visible(t, segment_len, n)
  seg = document_segments(doc_ids, segment_len)[0]
  return seg, document_visible(seg, n)


def _check_moment_inputs(qr, kr, segment_len, max_segments, impl):
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  check_array("qr", qr, 4, "(B, T, H, R)")
  check_array("kr", kr, 4, "(B, T, H, R)")
  if kr.shape != qr.shape:
    raise ValueError(f"kr must have the shape of qr (B, T, H, R) = {qr.shape}, got {kr.shape}")
  check_segments(qr.shape[1], segment_len, max_segments, "max_segments")


def _check_per_head(name, x, want):
  check_array(name, x, len(want), str(want))
  if x.shape != want:
    raise ValueError(f"{name} must have shape {want}, got {x.shape}")


def _heads(qr, tau_mu):
  """H from the temperatures; qr may have H groups or 1 shared group (Mamba-2)."""
  check_array("tau_mu", tau_mu, 1, "(H,)")
  if tau_mu.ndim != 1:
    raise ValueError(f"tau_mu must have shape (H,), got {tau_mu.shape}")
  h = tau_mu.shape[0]
  if qr.shape[2] not in (1, h):
    raise ValueError(f"qr, kr must have H = {h} heads (or 1 shared group) on axis 2, H from tau_mu "
                     f"{tau_mu.shape}; got qr {qr.shape}")
  return h


def _softmax(scores, tau, mask):
  """softmax over the visible segments of tau_h * scores; zero elsewhere. (B,T,G,N), (H,) -> (B,T,H,N).
  mask: (T, N), or (B, T, N) for packed rows."""
  mask = mask[:, None, :] if mask.ndim == 2 else mask[:, :, None, :]
  return jax.nn.softmax(tau.astype(jnp.float32)[:, None] * scores, axis=-1, where=mask)


def meanpool_weights(qr, kr, tau_mu, *, segment_len: int, max_segments: int, impl: str = "auto",
                     segment_ids=None):
  """Meanpool lam: softmax over visible segments of tau_mu * (mean key . query).

  qr, kr: (B, T, H, R) (or (B, T, 1, R), one group shared by all heads); tau_mu: (H,) positive.
  Returns (B, T, H, N = max_segments) float32.
  """
  _check_moment_inputs(qr, kr, segment_len, max_segments, impl)
  _heads(qr, tau_mu)
  r_mu, _ = moment_scores(qr, kr, segment_len=segment_len, num_segments=max_segments, impl=impl,
                          doc_ids=segment_ids)
  return _softmax(r_mu, tau_mu, _segments(qr.shape[1], segment_len, max_segments, segment_ids)[1])


def merlin_weights(qr, kr, gamma, tau_mu, tau_sigma, *, segment_len: int, max_segments: int,
                   impl: str = "auto", segment_ids=None):
  """MERLIN lam: a gamma-gated mix of the softmaxes of the mean alignment and of its variance.

  qr, kr: (B, T, H, R) (or (B, T, 1, R), shared); gamma: (B, T, H) in (0, 1); tau_mu,
  tau_sigma: (H,) positive. Returns (B, T, H, N = max_segments) float32.
  """
  _check_moment_inputs(qr, kr, segment_len, max_segments, impl)
  h = _heads(qr, tau_mu)
  _check_per_head("tau_sigma", tau_sigma, (h,))
  _check_per_head("gamma", gamma, qr.shape[:2] + (h,))
  r_mu, r_sigma = moment_scores(qr, kr, segment_len=segment_len, num_segments=max_segments,
                                impl=impl, doc_ids=segment_ids)
  mask = _segments(qr.shape[1], segment_len, max_segments, segment_ids)[1]
  gamma = gamma.astype(jnp.float32)[..., None]
  return gamma * _softmax(r_mu, tau_mu, mask) + (1.0 - gamma) * _softmax(r_sigma, tau_sigma, mask)


def position_weights(p, *, segment_len: int, segment_ids=None):
  """Position lam_ti = softplus(p_t[s(t) - i]) for i <= s(t): a weight per distance in segments.

  p: (B, T, H, N). Returns (B, T, H, N) float32.
  """
  check_array("p", p, 4, "(B, T, H, N)")
  t, n = p.shape[1], p.shape[-1]
  check_segments(t, segment_len, n, "p.shape[-1] (N, the number of segments)")
  seg, vis = _segments(t, segment_len, n, segment_ids)
  distance = jnp.clip(seg[..., None] - jnp.arange(n), 0, n - 1)  # (T, N) or (B, T, N)
  distance = distance[None] if distance.ndim == 2 else distance
  lam = jax.nn.softplus(jnp.take_along_axis(p.astype(jnp.float32), distance[:, :, None, :], -1))
  vis = vis[None] if vis.ndim == 2 else vis
  return jnp.where(vis[:, :, None, :], lam, 0.0)


def vanilla_weights(b: int, t: int, h: int, n: int):
  """Vanilla lam = 1 everywhere: the sum of the states, i.e. the single-state model."""
  for name, value in (("b", b), ("t", t), ("h", h), ("n", n)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  return jnp.ones((b, t, h, n), jnp.float32)
