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

``mask_grads_kernel`` computes the same gradients as one Pallas kernel (``triadic_mask_grads``,
grid (BH, NC), Triton on the GPU, interpret mode on the CPU; ``Config.mask_grads_kernel``), laid
out so that no reduction crosses threads: the program's (C, E) tile holds one (token, slice) pair
per element, and a loop over the chunk's tokens j adds, to row t's sums, the terms of pair
(t, s = j) (rq, rk) and of pair (s = t, t = j) (cq, ck). Either pair's decay is exp(gc_t - gc_s)
for its own orientation, one exponential per element and step, which all four sums share; the
weights dM'_tj, dM'_jt (and dM's) are (C, 1) column loads, masked to their causal half. It
returns the summed dk2, dq2 and d gc, with the row-coefficient terms, so XLA only takes the
chunk-wise cumulative sum of d gc afterwards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.pallas.common import F32, call, chunk_block, col_plus_row


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
  in the kernels' column (C, E) and row (E, C) layouts. Returns float32 dk2, dq2 and d gc, each
  (BH, NC, C, E), as ``mask_grads_kernel`` does (the column and row parts summed)."""
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
  return col_plus_row(dk2_col, dk2_row), dq2, col_plus_row(dgc_col, dgc_row)


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


def mask_grads_kernel(dmq, dm, coef, dlam, k2_col, q2_col, gc_col, *, erase, cfg,
                      num_warps=None):
  """``mask_grads`` as one kernel (module docstring), with its results: dk2, dq2 and d gc, each
  (BH, NC, C, E) float32 (d gc before the chunk-wise cumulative sum that turns it into dg).

  dmq, dm (BH, NC, C, C) float32 as ``mask_grads`` takes them (dm None without erase); ``coef``
  the slice kernel's row sums (BH, NC, C, W): dcoef, dqcoef, dkcoef in columns [0, E), [E, 2E),
  [2E, 3E); dlam (BH, NC, E); k2, q2, gc in the column layout (BH, NC, C, E). ``cfg``: the
  platform's ``Config`` (Triton on the GPU, interpret mode on the CPU). ``num_warps`` None: 8 up
  to E = 4, where a program's tile is small, else 4 (measured: benchmarks/RESULTS.md)."""
  bh, nc, c, e_dim = gc_col.shape
  num_warps = num_warps or (8 if e_dim <= 4 else 4)
  if coef.shape[:3] != (bh, nc, c) or coef.shape[-1] < 3 * e_dim:
    raise ValueError(f"coef must be (BH, NC, C, >= 3E) = ({bh}, {nc}, {c}, >= {3 * e_dim}), got "
                     f"{coef.shape}")
  if (dm is not None) != erase:
    raise ValueError(f"dm must be given exactly with erase, got dm {dm is not None}, "
                     f"erase={erase}")
  kernel = functools.partial(_mask_grads_kernel, c=c, e_dim=e_dim, erase=erase)
  masks_in = (dmq, dm) if erase else (dmq,)
  out = jax.ShapeDtypeStruct((bh, nc, c, e_dim), F32)
  return call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[chunk_block(c, c)] * len(masks_in)
               + [chunk_block(c, coef.shape[-1]), chunk_block(1, e_dim)]
               + [chunk_block(c, e_dim)] * 3,
      out_specs=[chunk_block(c, e_dim)] * 3, out_shape=[out] * 3,
      semantics=("parallel", "parallel"), name="triadic_mask_grads", num_warps=num_warps,
  )(*masks_in, coef, dlam[:, :, None, :], k2_col, q2_col, gc_col)


LOG2E = 1.4426950408889634   # exp(x) = exp2(x log2 e): the hardware's exponential is base 2


def _mask_grads_kernel(dmq_ref, *refs, c, e_dim, erase):
  """One chunk of ``mask_grads_kernel``: the loop over tokens j (module docstring), then the
  row-coefficient terms (``_factor_grads``)."""
  if erase:
    dm_ref, coef_ref, dlam_ref, k2_ref, q2_ref, gc_ref, dk2_ref, dq2_ref, dgc_ref = refs
  else:
    dm_ref = None
    coef_ref, dlam_ref, k2_ref, q2_ref, gc_ref, dk2_ref, dq2_ref, dgc_ref = refs
  t = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)      # this element's token
  gc = gc_ref[...]

  def weights(ref, j):
    """dX_tj (s = j <= t) and dX_jt (t = j >= s) for every t, as (C, 1) columns."""
    return (jnp.where(j <= t, ref[:, pl.ds(j, 1)], 0.0),
            jnp.where(j >= t, ref[j, t], 0.0))

  def step(j, sums):
    gj, kj, qj = (ref[pl.ds(j, 1), :] for ref in (gc_ref, k2_ref, q2_ref))   # (1, E)
    # exp(gc_t - gc_s) of whichever pair is causal, (t, j) or (j, t); the signed factor folds
    # the orientation into the base change (libdevice's expf takes several more instructions)
    dec = jnp.exp2((gc - gj) * jnp.where(j <= t, LOG2E, -LOG2E))
    dec_k = dec * kj
    mq_ts, mq_st = weights(dmq_ref, j)
    rq, cq = sums[0] + mq_ts * dec_k, sums[1] + mq_st * (dec * qj)
    if not erase:
      return rq, cq
    m_ts, m_st = weights(dm_ref, j)
    return rq, cq, sums[2] + m_ts * dec_k, sums[3] + m_st * dec_k

  zeros = jnp.zeros((c, e_dim), F32)
  sums = jax.lax.fori_loop(0, c, step, (zeros,) * (4 if erase else 2))
  rq, cq = sums[:2]
  k2, q2 = k2_ref[...], q2_ref[...]
  dqcoef, dkcoef = (coef_ref[:, pl.ds(i * e_dim, e_dim)] for i in (1, 2))
  a = jnp.exp(gc)
  gl = gc_ref[pl.ds(c - 1, 1), :]                          # (1, E)
  b = jnp.exp(gl - gc)
  dq2 = dqcoef * a + rq
  dk2 = dkcoef * b + cq
  dgc = dqcoef * q2 * a - dkcoef * k2 * b + q2 * rq - k2 * cq
  if erase:
    rk, ck = sums[2:]
    dcoef = coef_ref[:, pl.ds(0, e_dim)]
    dk2 = dk2 + dcoef * a + rk + ck
    dgc = dgc + dcoef * k2 * a + k2 * rk - k2 * ck
  dgl = jnp.sum(dkcoef * k2 * b, axis=0, keepdims=True) + dlam_ref[...] * jnp.exp(gl)
  dq2_ref[...] = dq2
  dk2_ref[...] = dk2
  dgc_ref[...] = dgc + jnp.where(t == c - 1, dgl, 0.0)
