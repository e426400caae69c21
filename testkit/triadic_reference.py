"""Independent float64 NumPy oracles for the triadic op (docs/spec.md section 1), used by tests and benchmarks.

Written from the spec's per-token recurrence with explicit loops over e, not from the library code.
"""

from __future__ import annotations

import numpy as np


def triadic_reference(q, k, v, k2, q2, g, beta, *, scale=None, initial_state=None, erase=True):
  """Per-token float64 loop. Returns (o (B,T,H,V), final_state (B,H,E,D,V))."""
  q, k, v, k2, q2, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, k2, q2, g, beta))
  b, t, h, d = q.shape
  e, vdim = k2.shape[-1], v.shape[-1]
  scale = d ** -0.5 if scale is None else scale
  s = np.zeros((b, h, e, d, vdim)) if initial_state is None else np.array(initial_state, np.float64)
  o = np.zeros((b, t, h, vdim))
  for i in range(t):
    read = np.zeros((b, h, vdim))
    for j in range(e):
      s[:, :, j] *= np.exp(g[:, i, :, j])[..., None, None]
      read += k2[:, i, :, j, None] * np.einsum("bhd,bhdv->bhv", k[:, i], s[:, :, j])
    u = beta[:, i, :, None] * ((v[:, i] - read) if erase else v[:, i])
    for j in range(e):
      s[:, :, j] += k2[:, i, :, j, None, None] * k[:, i, :, :, None] * u[:, :, None, :]
    for j in range(e):
      o[:, i] += scale * q2[:, i, :, j, None] * np.einsum("bhd,bhdv->bhv", q[:, i], s[:, :, j])
  return o, s


def gated_deltanet_reference(q, k, v, g, beta, *, scale):
  """Gated DeltaNet with a D x V matrix state, written in its usual form: S <- a S (I - b k k^T) + b v k^T."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  b, t, h, d = q.shape
  s = np.zeros((b, h, v.shape[-1], d))  # V x D, as the GDN paper writes it
  o = np.zeros(v.shape)
  eye = np.eye(d)
  for i in range(t):
    kk = k[:, i, :, :, None] * k[:, i, :, None, :]
    s = np.exp(g[:, i])[..., None, None] * s @ (eye - beta[:, i, :, None, None] * kk)
    s = s + beta[:, i, :, None, None] * v[:, i, :, :, None] * k[:, i, :, None, :]
    o[:, i] = scale * np.einsum("bhvd,bhd->bhv", s, q[:, i])
  return o


def gated_linear_attention_reference(q, k, v, g, beta, *, scale):
  """Scalar-gate linear attention (Mamba-2's SSD core) in its quadratic 'attention' form:
  o_t = scale sum_{s<=t} exp(G_t - G_s) (q_t . k_s) beta_s v_s, with G the cumulative sum of g."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  gcum = np.cumsum(g, axis=1)  # (B, T, H)
  t = q.shape[1]
  scores = np.einsum("bthd,bshd->bhts", q, k)
  gh = np.transpose(gcum, (0, 2, 1))  # (B, H, T)
  causal = np.tril(np.ones((t, t), bool))
  decay = np.exp(np.where(causal, gh[..., :, None] - gh[..., None, :], -np.inf))
  weights = scores * decay * np.transpose(beta, (0, 2, 1))[..., None, :]
  return scale * np.einsum("bhts,bshv->bthv", weights, v)
