"""The decay masks M, M' and their gradients, in plain JAX over all chunks at once.

Every per-slice (E-dependent) piece of the chunk-local work is elementwise C x C work per slice e
around the decay mask D_ets = exp(gc_te - gc_se) (s <= t), which XLA fuses into its reductions
over all chunks; the Pallas kernels around these functions are then E-independent:

  forward   ``chunk_cumsum``: gc, the chunk-local inclusive cumsum of g;
            ``decay_masks``: M_ts = sum_e k2_te k2_se D_ets, M'_ts = sum_e q2_te k2_se D_ets,
            masked before exp (``common.decay_mask``): nothing overflows for any g <= 0.
  backward  ``mask_grads``: from dM' = dP * (Q K^T) and dM = dL * beta * (K K^T) (the tail
            kernel's outputs) and the slice kernel's row coefficients, dk2, dq2 and d gc.

Per slice e, with W'_ts = dM'_ts D_ets and W_ts = dM_ts D_ets (W only with erase), and
a = exp(gc), b = exp(gc_C - gc):

  dq2_t     = sum_s W'_ts k2_s + dqcoef_t a_t
  dk2 col_t = dkcoef_t b_t [+ sum_s W_ts k2_s + dcoef_t a_t]
  dk2 row_s = sum_t W'_ts q2_t [+ sum_t W_ts k2_t]
  dG_ts     = W'_ts q2_t k2_s [+ W_ts k2_t k2_s]                (through exp(gc_t - gc_s))
  dgc col_t = sum_s dG_ts + dqcoef_t q2_t a_t - dkcoef_t k2_t b_t [+ dcoef_t k2_t a_t]
              (+ at t = C-1: sum_t dkcoef_t k2_t b_t + dlam exp(gc_C))
  dgc row_s = -sum_t dG_ts

The four C x C reductions rq = sum_s W' k2_s, rk = sum_s W k2_s, cq = sum_t W' q2_t,
ck = sum_t W k2_t are the only ones taken: sum_s dG_ts = q2_t rq_t + k2_t rk_t and
sum_t dG_ts = k2_s (cq_s + ck_s) = k2_s dk2 row_s.

Layout: as the kernels, (BH, NC, C, E) columns and (BH, NC, E, C) rows. M and M' are an unrolled
sum over e of elementwise (BH, NC, C, C) terms (one loop fusion, no reduction); each per-slice sum
is over the minor axis of a (BH, NC, E, C, C) broadcast expression with its own decay mask, so
that each reduction fuses its exponentials instead of reading one materialised E x C x C mask.
"""

from __future__ import annotations

import jax.numpy as jnp


def _cols(x):
  """(BH, NC, C, E) -> (BH, NC, E, C, 1): slice e's per-token values along the second-minor axis."""
  return jnp.swapaxes(x, -1, -2)[..., :, :, None]


def _rows(x):
  """(BH, NC, E, C) -> (BH, NC, E, 1, C): slice e's per-token values along the minor axis."""
  return x[..., :, None, :]


def _lower(c):
  """(C, C) s <= t with t the row index (``common.masks``' causal)."""
  return jnp.arange(c)[None, :] <= jnp.arange(c)[:, None]


def decay(gc_col, gc_row, *, transpose=False):
  """D_ets = exp(gc_te - gc_se) where s <= t, else 0, as a (BH, NC, E, C_t, C_s) expression, or
  with ``transpose`` as (BH, NC, E, C_s, C_t) (same values: gc_t from gc_col, gc_s from gc_row, as
  ``chunk_local``). Masked before exp: nothing overflows for any g <= 0."""
  if transpose:
    causal = _lower(gc_col.shape[-2]).T
    diff = _rows(jnp.swapaxes(gc_col, -1, -2)) - gc_row[..., :, :, None]
  else:
    causal = _lower(gc_col.shape[-2])
    diff = _cols(gc_col) - _rows(gc_row)
  return jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)


def chunk_cumsum(g_col):
  """gc: the chunk-local inclusive cumsum of g (BH, NC, C, E) float32, non-increasing, <= 0."""
  return jnp.cumsum(g_col.astype(jnp.float32), axis=-2)


def decay_masks(k2_col, k2_row, q2_col, gc_col, gc_row, *, erase):
  """M and M' of every chunk, (BH, NC, C, C) float32 each (M is None without erase), as one
  elementwise sum over the slices each."""
  e_dim = gc_col.shape[-1]
  m = mq = 0.0
  for e in range(e_dim):
    dec = decay(gc_col[..., e:e + 1], gc_row[..., e:e + 1, :])[..., 0, :, :]
    k2s = k2_row[..., e:e + 1, :]
    mq = mq + q2_col[..., e:e + 1] * k2s * dec
    if erase:
      m = m + k2_col[..., e:e + 1] * k2s * dec
  return (m if erase else None), mq


def mask_grads(dmq, dm, dcoef, dqcoef, dkcoef, dlam, k2_col, k2_row, q2_col, gc_col, gc_row, *,
               erase):
  """The per-slice gradients of the masks (``backward.chunk_local``'s loop over e), for all
  chunks at once.

  dmq = dM' (BH, NC, C, C), dm = dM (None without erase); the slice kernel's row coefficients
  dcoef (unused without erase), dqcoef, dkcoef (BH, NC, C, E) and dlam (BH, NC, E); k2, q2, gc
  in the kernels' column (C, E) and row (E, C) layouts. Returns float32 dk2 column (C, E), dk2
  row (E, C), dq2 (C, E), d gc column (C, E) and d gc row (E, C) parts, each (BH, NC, ...)."""
  rows = lambda x: jnp.swapaxes(x, -1, -2)
  # Per-token factors along the minor axis: s of (E, C_t, C_s), t of the transposed (E, C_s, C_t).
  k2_minor, q2_minor = _rows(k2_row), _rows(rows(q2_col))
  # rq_et = sum_s W'_ts k2_s, cq_es = sum_t W'_ts q2_t
  rq = jnp.sum(dmq[:, :, None] * decay(gc_col, gc_row) * k2_minor, axis=-1)
  cq = jnp.sum(rows(dmq)[:, :, None] * decay(gc_col, gc_row, transpose=True) * q2_minor, axis=-1)
  dk2_col, dq2, dgc_col = _factor_grads(dcoef, dqcoef, dkcoef, dlam, k2_col, q2_col, gc_col,
                                        erase=erase)
  dq2 = dq2 + rows(rq)
  dk2_row = cq
  dgc_col = dgc_col + q2_col * rows(rq)                   # + sum_s dG_ts
  if erase:
    # rk_et = sum_s W_ts k2_s, ck_es = sum_t W_ts k2_t
    rk = jnp.sum(dm[:, :, None] * decay(gc_col, gc_row) * k2_minor, axis=-1)
    ck = jnp.sum(rows(dm)[:, :, None] * decay(gc_col, gc_row, transpose=True) * k2_minor, axis=-1)
    dk2_col = dk2_col + rows(rk)
    dk2_row = dk2_row + ck
    dgc_col = dgc_col + k2_col * rows(rk)
  dgc_row = -(k2_row * dk2_row)                                 # -sum_t dG_ts = -k2_s dk2 row_s
  return dk2_col, dk2_row, dq2, dgc_col, dgc_row


def _factor_grads(dcoef, dqcoef, dkcoef, dlam, k2_col, q2_col, gc_col, *, erase):
  """The terms of ``mask_grads`` that come from the slice kernel's row coefficients, not from M
  or M': (dk2, dq2, d gc) columns (C, E), d gc with the chunk-end decay's term in its last row."""
  c = gc_col.shape[-2]
  a = jnp.exp(gc_col)
  gl = gc_col[..., c - 1:, :]                             # (BH, NC, 1, E)
  b = jnp.exp(gl - gc_col)
  dk2 = dkcoef * b
  dq2 = dqcoef * a
  dgc = dqcoef * q2_col * a - dkcoef * k2_col * b
  if erase:
    dk2 = dk2 + dcoef * a
    dgc = dgc + dcoef * k2_col * a
  dgl = jnp.sum(dkcoef * k2_col * b, axis=-2) + dlam * jnp.exp(gl[..., 0, :])   # (BH, NC, E)
  return dk2, dq2, dgc.at[..., c - 1, :].add(dgl)

