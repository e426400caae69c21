"""The decay masks M, M' and their gradients: in plain JAX over all chunks at once, and the same
two functions as Pallas kernels, one program per chunk.

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

The kernels (``decay_masks_kernel`` ``triadic_decay_masks``, ``mask_grads_kernel``
``triadic_mask_grads``; Triton on the GPU, interpret mode on the CPU, selected by the callers'
``mask_kernel`` keyword): grid (BH, NC), one chunk per program, running the fused tail's
per-slice loops (``backward.decay_sums``, ``backward.slice_mask_grads``). Each loads its chunk's
(C, E) columns and (E, C) rows and, for the gradients, dM' (and dM) once, then walks the slices
in a static loop, forming slice e's C x C decay tile D_e once (masked before exp, every exponent
<= 0) and taking from it M and M' (sums of elementwise terms), or all four reductions rq, cq,
rk, ck, so that each exponential is computed once per chunk and slice and each C x C float32
operand crosses HBM once; XLA's loop fusions instead recompute the decay for each reduction. Outputs,
shapes, dtypes and formulas are those of the plain-JAX functions; only the order of the float32
sums differs. Per program at C = 64 (4 warps, ``kernel_num_warps``): dM', dM live (32 registers
per thread each) plus D_e and the two products W', W of the current slice; the (C, E) outputs are
written a column (or row) per slice. The (C, 1) column loads are the GPU structure's, not Mosaic
TPU's (``kernel_supported``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.pallas.backward import decay_sums, slice_mask_grads
from triadic.pallas.common import F32, call, col


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
  c = gc_col.shape[-2]
  rows = lambda x: jnp.swapaxes(x, -1, -2)
  # Per-token factors along the minor axis: s of (E, C_t, C_s), t of the transposed (E, C_s, C_t).
  k2_minor, q2_minor = _rows(k2_row), _rows(rows(q2_col))
  # rq_et = sum_s W'_ts k2_s, cq_es = sum_t W'_ts q2_t
  rq = jnp.sum(dmq[:, :, None] * decay(gc_col, gc_row) * k2_minor, axis=-1)
  cq = jnp.sum(rows(dmq)[:, :, None] * decay(gc_col, gc_row, transpose=True) * q2_minor, axis=-1)
  a = jnp.exp(gc_col)
  gl = gc_col[..., c - 1:, :]                             # (BH, NC, 1, E)
  b = jnp.exp(gl - gc_col)
  dq2 = rows(rq) + dqcoef * a
  dk2_col = dkcoef * b
  dk2_row = cq
  dgm_row = q2_col * rows(rq)                             # sum_s dG_ts, (C, E)
  if erase:
    # rk_et = sum_s W_ts k2_s, ck_es = sum_t W_ts k2_t
    rk = jnp.sum(dm[:, :, None] * decay(gc_col, gc_row) * k2_minor, axis=-1)
    ck = jnp.sum(rows(dm)[:, :, None] * decay(gc_col, gc_row, transpose=True) * k2_minor, axis=-1)
    dk2_col = dk2_col + rows(rk) + dcoef * a
    dk2_row = dk2_row + ck
    dgm_row = dgm_row + k2_col * rows(rk)
  dgc_col = dgm_row + dqcoef * q2_col * a - dkcoef * k2_col * b
  if erase:
    dgc_col = dgc_col + dcoef * k2_col * a
  dgl = jnp.sum(dkcoef * k2_col * b, axis=-2) + dlam * jnp.exp(gl[..., 0, :])   # (BH, NC, E)
  dgc_col = dgc_col.at[..., c - 1, :].add(dgl)
  dgc_row = -(k2_row * dk2_row)                                 # -sum_t dG_ts = -k2_s dk2 row_s
  return dk2_col, dk2_row, dq2, dgc_col, dgc_row


# ------------------------------------------------------------------------------------------------
# The same two functions as Pallas kernels (Triton on the GPU, interpret mode on the CPU), one
# program per (batch*head, chunk).

def kernel_num_warps(c: int) -> int:
  """The mask kernels' default Triton warps at chunk size ``c``: C^2 / 1024, so that each C x C
  float32 tile is 32 registers per thread (1 warp up to C = 32, 4 at C = 64, 16 at C = 128)."""
  return max(1, min(16, c * c // 1024))


def kernel_supported(c: int, e: int, cfg) -> str | None:
  """Why the mask kernels cannot take chunk size ``c`` and ``e`` slices under ``cfg`` (None:
  they can). They have the GPU structure ((C, 1) column loads, one chunk per program), not
  Mosaic TPU's (8, 128) tiles; their C x C tiles are Triton tensors (a power of two, at most 128
  so that they stay in registers); on the GPU the (C, E) blocks are Triton tensors too (E a
  power of two, as the op pads it; interpret mode takes any E)."""
  if cfg.chunk_grid:
    return "the mask kernels have the GPU structure only (mask_kernel on TPU)"
  if c < 16 or c > 128 or c & (c - 1):
    return f"the mask kernels need the chunk size to be a power of two in [16, 128], got {c}"
  if not cfg.interpret and e & (e - 1):
    return f"the mask kernels need E to be a power of two on the GPU (pad it), got {e}"
  return None


def _check(c, e, cfg):
  reason = kernel_supported(c, e, cfg)
  if reason:
    raise ValueError(reason)


def _chunk_specs(c, e):
  """Per-chunk BlockSpecs of grid (BH, NC): a C x C matrix, a (C, E) column and (E, C) row
  layout, and a (1, E) row (dlam)."""
  spec = lambda *s: pl.BlockSpec((None, None, *s), lambda i, j: (i, j, 0, 0))
  return spec(c, c), spec(c, e), spec(e, c), spec(1, e)


def _decay_masks_kernel(k2_col, k2_row, q2_col, gc_col, gc_row, *outs, c, e_dim, erase):
  mq, m = decay_sums(k2_col, k2_row, q2_col, gc_col, gc_row, c=c, e_dim=e_dim, erase=erase)
  outs[0][...] = mq
  if erase:
    outs[1][...] = m


def decay_masks_kernel(k2_col, k2_row, q2_col, gc_col, gc_row, *, erase, cfg, num_warps=None):
  """``decay_masks`` as the Pallas kernel ``triadic_decay_masks``: grid (BH, NC), one chunk per
  program, the slices a static loop with one C x C decay tile live at a time (masked before exp,
  ``backward.decay_sums``, the fused tail's code). Same operands and outputs: M (None without
  erase) and M', (BH, NC, C, C) float32. ``cfg``: the platform (``Config``; its
  interpret / Triton parameters); ``num_warps``: Triton warps (None: ``kernel_num_warps``)."""
  bh, nc, c, e_dim = gc_col.shape
  _check(c, e_dim, cfg)
  mat, cols, rows, _ = _chunk_specs(c, e_dim)
  n_out = 2 if erase else 1
  kernel = functools.partial(_decay_masks_kernel, c=c, e_dim=e_dim, erase=erase)
  res = call(kernel, cfg=cfg, grid=(bh, nc), in_specs=[cols, rows, cols, cols, rows],
             out_specs=[mat] * n_out,
             out_shape=[jax.ShapeDtypeStruct((bh, nc, c, c), F32)] * n_out,
             semantics=("parallel", "parallel"), name="triadic_decay_masks",
             num_warps=num_warps or kernel_num_warps(c))(k2_col, k2_row, q2_col, gc_col, gc_row)
  return (res[1] if erase else None), res[0]


def _mask_grads_kernel(*refs, c, e_dim, erase):
  """One chunk of ``mask_grads``: ``backward.slice_mask_grads`` (the fused tail's per-slice loop)
  on the chunk's dM' (and dM), loaded once, and its per-slice coefficient columns."""
  if erase:
    (dmq_ref, dm_ref, dcoef_ref, dqcoef_ref, dkcoef_ref, dlam_ref, k2_col, k2_row, q2_col,
     gc_col, gc_row, *outs) = refs
  else:
    (dmq_ref, dqcoef_ref, dkcoef_ref, dlam_ref, k2_col, k2_row, q2_col, gc_col, gc_row,
     *outs) = refs
  cols = lambda ref: [col(ref, e) for e in range(e_dim)]
  slice_mask_grads(dmq_ref[...], dm_ref[...] if erase else None,
                   cols(dcoef_ref) if erase else None, cols(dqcoef_ref), cols(dkcoef_ref),
                   [dlam_ref[:, pl.ds(e, 1)].astype(F32) for e in range(e_dim)],
                   k2_col, k2_row, q2_col, gc_col, gc_row, outs, c=c, e_dim=e_dim, erase=erase)


def mask_grads_kernel(dmq, dm, dcoef, dqcoef, dkcoef, dlam, k2_col, k2_row, q2_col, gc_col,
                      gc_row, *, erase, cfg, num_warps=None):
  """``mask_grads`` as the Pallas kernel ``triadic_mask_grads``: grid (BH, NC), one chunk per
  program. It reads the chunk's dM' (and dM) once and keeps them live; per slice e (a static
  loop) it forms the decay tile D_e once, masked before exp, and takes all four reductions rq,
  cq (rk, ck) from it, so each exponential is computed once per chunk and slice. The same math,
  operands (dcoef and dm unused without erase), outputs, shapes and dtypes as ``mask_grads``.
  ``cfg``: the platform (``Config``); ``num_warps``: Triton warps (None: ``kernel_num_warps``)."""
  bh, nc, c, e_dim = gc_col.shape
  _check(c, e_dim, cfg)
  mat, cols, rows, one = _chunk_specs(c, e_dim)
  kernel = functools.partial(_mask_grads_kernel, c=c, e_dim=e_dim, erase=erase)
  if erase:
    ins = (dmq, dm, dcoef, dqcoef, dkcoef)
    specs = [mat, mat, cols, cols, cols]
  else:
    ins, specs = (dmq, dqcoef, dkcoef), [mat, cols, cols]
  shape = lambda *s: jax.ShapeDtypeStruct((bh, nc, *s), F32)
  return tuple(call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=specs + [one, cols, rows, cols, cols, rows],
      out_specs=[cols, rows, cols, cols, rows],
      out_shape=[shape(c, e_dim), shape(e_dim, c), shape(c, e_dim), shape(c, e_dim),
                 shape(e_dim, c)],
      semantics=("parallel", "parallel"), name="triadic_mask_grads",
      num_warps=num_warps or kernel_num_warps(c),
  )(*ins, dlam[:, :, None, :], k2_col, k2_row, q2_col, gc_col, gc_row))
