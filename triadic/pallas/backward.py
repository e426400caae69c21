"""The chunk-parallel backward kernel: every input gradient of a chunk, given both state passes.

One program per (batch*head, chunk). From the forward it reads the chunk-start states S_e, U and A;
from ``recurrent.reverse_state_pass`` the chunk-end state gradients dS_e and dU. It recomputes M,
M', K K^T and Q K^T (C x C, cheap) instead of storing them. With c_e = k2_e a_e,
X = V - sum_e diag(c_e) K S_e (so rhs = beta X and U = A rhs), the chain rule per chunk is:

  drhs = A^T dU,  dV = beta drhs,  dbeta += rowsum(drhs X),  dA = dU rhs^T,  dP = scale dO U^T
  per e:  d(c_e K) = -dV S_e^T      d(q2_e a_e Q) = scale dO S_e^T
          d(k2_e b_e K) = U dS_e^T   dlam_e = <dS_e, S_e>
  dL   = -A^T dA A^T (strictly lower),  L = beta (K K^T) * M,  P = (Q K^T) * M'
  M, M' -> dk2, dq2 and d gc through exp(gc_t - gc_s); a, b, lam -> d gc;  dg = reverse cumsum(d gc)

The value axis is walked in blocks of ``bwd_block_v`` columns (everything that contracts over V is
accumulated: dQ, dK, dA, dP and the per-slice row sums). Row-side (1, C) gradients of k2 and gc
come out transposed and are added, and gc's reverse cumulative sum taken, in ``ops.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.pallas.common import (F32, call, chunk_block, col, col_plus_row, colsum, decay_mask,
                                   last, masks, mm, over_value_blocks, row, rowsum, total)


SLICE_GROUP = 4     # decay_sums(loop=True): slices unrolled per loop step (ptxas, RESULTS.md)


def decays(gc_col, e, c):
  """Slice e's a = exp(gc_e) (C, 1), its chunk-end gc_Ce (1, 1) and b = exp(gc_Ce - gc_e) (C, 1);
  e a Python int or traced."""
  gl = last(gc_col, e, c)
  return jnp.exp(col(gc_col, e)), gl, jnp.exp(gl - col(gc_col, e))


def _chunk_backward_kernel(q_ref, k_ref, v_ref, do_ref, u_ref, du_ref, s_ref, ds_ref,
                           k2_col, k2_row, q2_col, gc_col, gc_row, beta_ref, a_ref,
                           dq_ref, dk_ref, dv_ref, dk2_col_ref, dk2_row_ref, dq2_col_ref,
                           dgc_col_ref, dgc_row_ref, dbeta_ref, *, c, e_dim, vd, bv, scale, erase,
                           dtype, precision, loop):
  outs = (dq_ref, dk_ref, dk2_col_ref, dk2_row_ref, dq2_col_ref, dgc_col_ref, dgc_row_ref,
          dbeta_ref)
  q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
  beta = beta_ref[...].astype(F32)
  amat = a_ref[...]

  def slice_terms(e, carry, *, cols, do, u, dx):
    """Slice e's terms over the value columns ``cols``: X's update (erase), dq, dk and the row
    coefficients dcoef, dqcoef, dkcoef (C, E) and dlam (1, E), added in column e."""
    x, dq, dk, dcoef, dqcoef, dkcoef, dlam = carry
    column_e = jax.lax.broadcasted_iota(jnp.int32, (1, e_dim), 1) == e
    add = lambda m, y: m + jnp.where(column_e, y, 0.0)          # y into column e of m
    a, _, b = decays(gc_col, e, c)
    s = s_ref[e, :, cols].astype(F32)
    ds = ds_ref[e, :, cols].astype(F32)
    if erase:
      x = x - mm(col(k2_col, e) * a * k, s, dtype)
      g1 = mm(dx, s, dtype, tb=True)
      dk = dk - (col(k2_col, e) * a) * g1
      dcoef = add(dcoef, -rowsum(k * g1))
    g2 = mm(do, s, dtype, tb=True)
    dq = dq + scale * (col(q2_col, e) * a) * g2
    dqcoef = add(dqcoef, scale * rowsum(q * g2))
    g3 = mm(u, ds, dtype, tb=True)
    dk = dk + (col(k2_col, e) * b) * g3
    dkcoef = add(dkcoef, rowsum(k * g3))
    dlam = add(dlam, total(ds * s))
    return x, dq, dk, dcoef, dqcoef, dkcoef, dlam

  def vblock(cols, carry):
    dq, dk, da, dp, dbeta, dcoef, dqcoef, dkcoef, dlam = carry
    do = do_ref[:, cols].astype(F32)
    u, du = u_ref[:, cols], du_ref[:, cols]
    x = v_ref[:, cols].astype(F32)
    drhs = mm(amat, du, dtype, ta=True) if erase else du
    dx = beta * drhs
    dv_ref[:, cols] = dx
    per_slice = (x, dq, dk, dcoef, dqcoef, dkcoef, dlam)
    terms = functools.partial(slice_terms, cols=cols, do=do, u=u, dx=dx)
    if loop:
      per_slice = jax.lax.fori_loop(0, e_dim, terms, per_slice)
    else:
      for e in range(e_dim):
        per_slice = terms(e, per_slice)
    x, dq, dk, dcoef, dqcoef, dkcoef, dlam = per_slice
    dbeta = dbeta + rowsum(drhs * x)
    if erase:
      da = da + mm(du, beta * x, dtype, tb=True)
    dp = dp + scale * mm(do, u, dtype, tb=True)
    return dq, dk, da, dp, dbeta, dcoef, dqcoef, dkcoef, dlam

  zeros = lambda *s: jnp.zeros(s, F32)
  carry = (zeros(c, q.shape[1]), zeros(c, k.shape[1]), zeros(c, c), zeros(c, c), zeros(c, 1),
           zeros(c, e_dim), zeros(c, e_dim), zeros(c, e_dim), zeros(1, e_dim))
  dq, dk, da, dp, dbeta, dcoef, dqcoef, dkcoef, dlam = over_value_blocks(vd, bv, vblock, carry)

  def coefs(e):
    """Slice e's columns of the row coefficients (a masked sum: exact, and e may be traced)."""
    pick = lambda m: rowsum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, m.shape, 1) == e, m,
                                      0.0))
    return pick(dcoef), pick(dqcoef), pick(dkcoef), pick(dlam)

  chunk_local(q, k, lambda: (dq, dk), dp, da if erase else None, dbeta, coefs, k2_col, k2_row,
              q2_col, gc_col, gc_row, beta, amat, outs, c=c, e_dim=e_dim, erase=erase,
              dtype=dtype, precision=precision, loop=loop)


def ut_before(q, k, dp, da, beta, amat, *, c, erase, dtype, precision):
  """The E-independent products the per-slice mask gradients need: dM' = dP * (Q K^T) with dP
  causal, and (erase) the UT transform's dL = -A^T dA A^T (strictly lower, ``precision``),
  dL * (K K^T) and dM = dL * beta * (K K^T). Returns (dp, dmq, dl, dlkk, dm); the last three None
  without erase."""
  causal, strict, _, _ = masks(c)
  dp = jnp.where(causal, dp, 0.0)
  dmq = dp * mm(q, k, dtype, tb=True)
  if not erase:
    return dp, dmq, None, None, None
  kk = mm(k, k, dtype, tb=True)
  da = jnp.where(causal, da, 0.0)
  dl = jnp.where(strict, -mm(mm(amat, da, F32, ta=True, precision=precision), amat, F32, tb=True,
                                  precision=precision), 0.0)
  dlkk = dl * kk
  return dp, dmq, dl, dlkk, dlkk * beta


def ut_after(q, k, dq, dk, dbeta, dp, dl, dlkk, mq, m, beta, *, erase, dtype):
  """dq, dk and dbeta given the whole M' (mq) and M (m): the read P = (Q K^T) * M' and the UT
  transform's L = beta (K K^T) * M, through dP and dL (``ut_before``)."""
  dqk = dp * mq
  dq = dq + mm(dqk, k, dtype)
  dk = dk + mm(dqk, q, dtype, ta=True)
  if erase:
    dkk = dl * beta * m
    dbeta = dbeta + rowsum(dlkk * m)
    dk = dk + mm(dkk, k, dtype) + mm(dkk, k, dtype, ta=True)
  return dq, dk, dbeta


def decay_sums(k2_col, k2_row, q2_col, gc_col, gc_row, *, c, e_dim, erase, loop=False):
  """M' and M (None without erase) of one chunk, (C, C) float32, one slice's decay mask live at a
  time: M'_ts = sum_e q2_te k2_se exp(gc_te - gc_se), M_ts = sum_e k2_te k2_se exp(...).
  ``loop``: above ``SLICE_GROUP`` slices, a ``lax.fori_loop`` over groups of that many (unrolled
  inside), so that the compiler does not hold every slice's decay tile at once (registers)."""
  causal, _, _, _ = masks(c)

  def add_slice(e, sums):
    mq, m = sums
    k2s = row(k2_row, e)
    dec = decay_mask(col(gc_col, e), row(gc_row, e), causal)
    mq = mq + col(q2_col, e) * k2s * dec
    if erase:
      m = m + col(k2_col, e) * k2s * dec
    return mq, m

  def add_group(first, size, sums):
    for j in range(size):
      sums = add_slice(first + j, sums)
    return sums

  zeros = jnp.zeros((c, c), F32)
  sums = (zeros, zeros if erase else None)
  if loop and e_dim > SLICE_GROUP and e_dim % SLICE_GROUP == 0:
    return jax.lax.fori_loop(0, e_dim // SLICE_GROUP,
                             lambda g, sums: add_group(g * SLICE_GROUP, SLICE_GROUP, sums), sums)
  return add_group(0, e_dim, sums)


def coef_columns(dcoef_ref, dqcoef_ref, dkcoef_ref, dlam_ref):
  """``coefs`` for ``slice_mask_grads`` from refs of the row coefficients, (C, E) each, and
  dlam (1, E): e -> slice e's dcoef, dqcoef, dkcoef (C, 1) columns and dlam (1, 1); e may be
  traced."""
  return lambda e: (col(dcoef_ref, e), col(dqcoef_ref, e), col(dkcoef_ref, e),
                    dlam_ref[:, pl.ds(e, 1)])


def slice_mask_grads(dmq, dm, coefs, k2_col, k2_row, q2_col, gc_col, gc_row, outs, *, c, e_dim,
                     erase, loop=False):
  """The per-slice gradients of the masks, one loop over e (``masks.mask_grads``' formulas, its
  four reductions): from dM' = dmq and dM = dm (C, C; dm None without erase) and the row
  coefficients (``coefs(e)``: slice e's dcoef, dqcoef, dkcoef (C, 1) columns and dlam (1, 1)),
  write ``outs`` = (dk2 column, dk2 row, dq2, d gc column, d gc row) refs. Slice e's decay mask
  exp(gc_t - gc_s) is built, used and dropped in its iteration, so one C x C mask is live at a
  time (register pressure); from it W' = dM' D_e (and W = dM D_e) give rq = sum_s W' k2_s,
  cq = sum_t W' q2_t (rk, ck with k2_t), and the gradient through exp(gc_t - gc_s) needs no
  reduction of its own: sum_s dG_ts = q2_t rq_t + k2_t rk_t, sum_t dG_ts = k2_s dk2 row_s.
  ``loop``: the slices as a ``lax.fori_loop`` (e traced, which ``coefs`` must take), which
  keeps the compiler from interleaving their iterations, and them with the code after, and so
  holding several C x C tiles at once (registers); else unrolled (e a Python int)."""
  dk2_col_ref, dk2_row_ref, dq2_col_ref, dgc_col_ref, dgc_row_ref = outs
  causal, _, _, _ = masks(c)
  is_last = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1

  def grads_of_slice(e, carry):
    dcoef, dqcoef, dkcoef, dlam = coefs(e)
    a, gl, b = decays(gc_col, e, c)
    k2t, k2s, q2t = col(k2_col, e), row(k2_row, e), col(q2_col, e)
    dec = decay_mask(col(gc_col, e), row(gc_row, e), causal)
    wq = dmq * dec                         # d M'_ts / d(q2_t k2_s), times dM'
    rq = rowsum(wq * k2s)
    dq2 = rq + dqcoef * a
    dk2_row = colsum(wq * q2t)
    dgm = q2t * rq                         # sum_s of the gradient through exp(gc_t - gc_s)
    dk2_col = dkcoef * b
    if erase:
      wk = dm * dec
      rk = rowsum(wk * k2s)
      dk2_col = dk2_col + rk + dcoef * a
      dk2_row = dk2_row + colsum(wk * k2t)
      dgm = dgm + k2t * rk
    dg_col = dgm + dqcoef * q2t * a - dkcoef * k2t * b
    if erase:
      dg_col = dg_col + dcoef * k2t * a
    dgl = total(dkcoef * k2t * b) + dlam * jnp.exp(gl)
    dg_col = dg_col + jnp.where(is_last, dgl, 0.0)
    dq2_col_ref[:, pl.ds(e, 1)] = dq2
    dk2_col_ref[:, pl.ds(e, 1)] = dk2_col
    dk2_row_ref[pl.ds(e, 1), :] = dk2_row
    dgc_col_ref[:, pl.ds(e, 1)] = dg_col
    dgc_row_ref[pl.ds(e, 1), :] = -(k2s * dk2_row)
    return carry

  if loop:
    jax.lax.fori_loop(0, e_dim, grads_of_slice, 0)
  else:
    for e in range(e_dim):
      grads_of_slice(e, 0)


def chunk_local(q, k, partials, dp, da, dbeta, coefs, k2_col, k2_row, q2_col, gc_col, gc_row, beta,
                amat, outs, *, c, e_dim, erase, dtype, precision, loop=False):
  """The chunk-local part of the backward, after the value axis: the masks M, M' and the UT
  transform, then the outputs. Takes the value-contracted partials (``partials()`` gives dq, dk
  (C, D), called where they are needed, so a kernel may load them late; dp, da (C, C),
  da None without erase; dbeta (C, 1); ``coefs(e)`` slice e's row coefficients dcoef, dqcoef,
  dkcoef (C, 1) and dlam (1, 1)) and writes ``outs`` = (dq, dk, dk2 column, dk2 row, dq2,
  d gc column, d gc row, dbeta) refs. ``ut_before`` / ``ut_after``, ``decay_sums`` and
  ``slice_mask_grads`` are shared with the Hopper path's tail kernels (``mosaic_backward.py``).
  ``loop``: the per-slice work as loops (``slice_mask_grads``, whose ``coefs`` must then take a
  traced e: read refs, or pick a column by a mask; ``decay_sums`` by groups of slices).

  Order (register pressure): ``ut_before`` (dM', dM), then the per-slice mask gradients
  (``slice_mask_grads``), which consume dM' and dM, then M and M' (``decay_sums``) and what
  needs them (``ut_after``: dq, dk). Each slice's decay mask is built twice, once per loop,
  instead of keeping M and M' live through the gradients, and dM', dM are dead before dq and dk
  exist, which ptxas' spills show (``benchmarks/triton_registers.py``, RESULTS.md).
  """
  dq_ref, dk_ref, dbeta_ref = outs[0], outs[1], outs[-1]
  dp, dmq, dl, dlkk, dm = ut_before(q, k, dp, da, beta, amat, c=c, erase=erase, dtype=dtype,
                                    precision=precision)
  slice_mask_grads(dmq, dm, coefs, k2_col, k2_row, q2_col, gc_col, gc_row, outs[2:-1], c=c,
                   e_dim=e_dim, erase=erase, loop=loop)
  mq, m = decay_sums(k2_col, k2_row, q2_col, gc_col, gc_row, c=c, e_dim=e_dim, erase=erase,
                     loop=loop)
  dq, dk, dbeta = ut_after(q, k, *partials(), dbeta, dp, dl, dlkk, mq, m, beta, erase=erase,
                           dtype=dtype)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dbeta_ref[...] = dbeta


def chunk_gradients(q, k, v, do, u, du, states, dstates, k2_col, k2_row, q2_col, gc_col, gc_row,
                    beta_col, a, *, scale, erase, cfg):
  """Run the chunk-parallel backward. Layout (BH, NC, ...) as the forward kernels.

  Returns float32 dq, dk (BH,NC,C,D), dv (BH,NC,C,V), dk2, dq2 and d gc (C,E), dbeta (C,1)
  (the kernel writes dk2 and d gc as column (C,E) and row (E,C) parts, summed here).
  """
  bh, nc, c, d = q.shape
  vd, e_dim = v.shape[-1], k2_col.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  spec = chunk_block
  shape = lambda *s: jax.ShapeDtypeStruct((bh, nc, *s), F32)
  kernel = functools.partial(_chunk_backward_kernel, c=c, e_dim=e_dim, vd=vd, bv=bv, scale=scale,
                             erase=erase, dtype=q.dtype, precision=cfg.f32_precision,
                             # Slices as loops on the GPU structure (registers); Mosaic TPU would
                             # need dynamic lane slices for a traced slice index.
                             loop=not cfg.chunk_grid)
  dq, dk, dv, dk2_col, dk2_row, dq2, dgc_col, dgc_row, dbeta = call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[spec(c, d), spec(c, d), spec(c, vd), spec(c, vd), spec(c, vd), spec(c, vd),
                spec(e_dim, d, vd), spec(e_dim, d, vd), spec(c, e_dim), spec(e_dim, c),
                spec(c, e_dim), spec(c, e_dim), spec(e_dim, c), spec(c, 1), spec(c, c)],
      out_specs=[spec(c, d), spec(c, d), spec(c, vd), spec(c, e_dim), spec(e_dim, c),
                 spec(c, e_dim), spec(c, e_dim), spec(e_dim, c), spec(c, 1)],
      out_shape=[shape(c, d), shape(c, d), shape(c, vd), shape(c, e_dim), shape(e_dim, c),
                 shape(c, e_dim), shape(c, e_dim), shape(e_dim, c), shape(c, 1)],
      semantics=("parallel", "parallel"), name="triadic_chunk_backward",
      num_warps=cfg.bwd_num_warps,
  )(q, k, v, do, u, du, states, dstates, k2_col, k2_row, q2_col, gc_col, gc_row, beta_col, a)
  return dq, dk, dv, col_plus_row(dk2_col, dk2_row), dq2, col_plus_row(dgc_col, dgc_row), dbeta
