"""The per-chunk forward preparation: cumulative decay, the masks M and M', the UT transform A.

Computed once per chunk and shared by every value block of the state-passing kernels
(docs/spec.md, the triadic op's chunked form):

  gc_te = sum_{s <= t} g_se                      chunk-local, <= 0 (``masks.chunk_cumsum``)
  M_ts  = sum_e k2_te k2_se exp(gc_te - gc_se)   s <= t (``masks.decay_masks``, plain JAX)
  M'_ts = sum_e q2_te k2_se exp(gc_te - gc_se)   s <= t
  A     = (I + StrictLower(beta_t (k_t . k_s) M_ts))^-1  (erase; zeros without)
  P     = Lower((q_t . k_s) M'_ts)                             the intra-chunk read

The E-dependent part is elementwise (the masks), done by XLA over all chunks at once; the kernel
here is E-independent: one program per (batch*head, chunk) forms K K^T and Q K^T on the matrix
units and applies the masks. It writes the strictly lower L = StrictLower(beta_t (k_t . k_s) M_ts);
A = (I + L)^-1 is then taken by forward substitution (``triadic.chunked.unit_lower_inverse``),
not by the all-matmul doubling product (I - L)(I + L^2)(I + L^4)...: that product loses every
digit in float32 once keys in a chunk are aligned (|L_ts| -> 1, e.g. a repeated token).

``fused=True`` (``Config.fused_prep``, through the plan) selects the one-kernel form instead
(``_fused_prep_kernel``): the masks and the inverse inside the kernel, so M, M' and L never
leave it. A is built by blocks of
``SUB`` = 16 rows, the same substitution as ``unit_lower_inverse``: each diagonal block
A_ii = (I + L_ii)^-1 by substitution over its rows, then A_ij = -A_ii sum_{j <= k < i} L_ik A_kj
(block forward substitution, float32 products at ``Config.f32_precision``). The blocks of L are
formed from 16-row loads of K, k2 and gc (every exponent <= 0 as before).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.chunked import unit_lower_inverse
from triadic.pallas import masks
from triadic.pallas.common import F32, call, col, decay_mask, mm, row
from triadic.pallas.common import masks as causal_masks

SUB = 16  # rows per block of the in-kernel inverse (``_fused_prep_kernel``)


def _prep_kernel(q_ref, k_ref, beta_ref, mq_ref, *rest, c, erase, dtype):
  lower_ref, p_ref = rest[-2:]
  causal, strict, _, _ = causal_masks(c)
  k = k_ref[...]
  p_ref[...] = jnp.where(causal, mm(q_ref[...], k, dtype, tb=True) * mq_ref[...], 0.0)
  if erase:
    kk = mm(k, k, dtype, tb=True)
    lower_ref[...] = jnp.where(strict, beta_ref[...].astype(F32) * kk * rest[0][...], 0.0)
  else:
    lower_ref[...] = jnp.zeros((c, c), F32)


def _mask_block(k2_col, k2_row, gc_col, gc_row, rows, cols, *, diagonal, e_dim, transpose=False):
  """The block M[rows, cols] = sum_e k2_te k2_se exp(gc_te - gc_se) (strictly lower where
  ``diagonal``; rows after cols otherwise, so every exponent is <= 0), or with ``transpose`` the
  block M^T[rows, cols] = M[cols, rows] (strictly upper where ``diagonal``)."""
  n = SUB
  t_idx = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
  s_idx = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
  keep = (s_idx > t_idx if transpose else s_idx < t_idx) if diagonal else jnp.ones((n, n), bool)
  m = jnp.zeros((n, n), F32)
  for e in range(e_dim):
    if transpose:  # entry (a, b) = M[b, a]: t = b from the row layouts, s = a from the columns
      gt, gs = gc_row[pl.ds(e, 1), cols], gc_col[rows, pl.ds(e, 1)]
      kt, ks = k2_row[pl.ds(e, 1), cols], k2_col[rows, pl.ds(e, 1)]
    else:
      gt, gs = gc_col[rows, pl.ds(e, 1)], gc_row[pl.ds(e, 1), cols]
      kt, ks = k2_col[rows, pl.ds(e, 1)], k2_row[pl.ds(e, 1), cols]
    m = m + kt * ks * decay_mask(gt, gs, keep)
  return m


def _unit_lower_inverse_block(lower_t):
  """(I + L)^-1 of one SUB x SUB block from L^T (strictly upper), by substitution over the rows:
  row t of A = e_t - sum_{s < t} L_ts A_s, whose rows s < t are final (column t of L^T is row t
  of L, along the axis that meets A's rows)."""
  n = SUB
  r = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
  c = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
  c_row = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
  inv = jnp.where(r == c, 1.0, 0.0).astype(F32)
  for t in range(1, n):
    l_t = jnp.sum(jnp.where(c == t, lower_t, 0.0), axis=1, keepdims=True)   # (n, 1): L_t,s
    new = jnp.where(c_row == t, 1.0, 0.0) - jnp.sum(l_t * inv, axis=0, keepdims=True)
    inv = jnp.where(r == t, new, inv)
  return inv


def _fused_prep_kernel(q_ref, k_ref, k2_col, k2_row, q2_col, gc_col, gc_row, beta_ref, beta_row,
                       a_ref, p_ref, *, c, e_dim, erase, dtype, precision):
  causal, _, _, _ = causal_masks(c)
  mq = jnp.zeros((c, c), F32)
  for e in range(e_dim):
    mq = mq + col(q2_col, e) * row(k2_row, e) * decay_mask(col(gc_col, e), row(gc_row, e), causal)
  k = k_ref[...]
  p_ref[...] = jnp.where(causal, mm(q_ref[...], k, dtype, tb=True) * mq, 0.0)
  if not erase:
    a_ref[...] = jnp.zeros((c, c), F32)
    return
  nb = c // SUB
  blk = lambda i: pl.ds(i * SUB, SUB)
  kk = lambda i, j: mm(k_ref[blk(i), :], k_ref[blk(j), :], dtype, tb=True)
  mask = functools.partial(_mask_block, k2_col, k2_row, gc_col, gc_row, e_dim=e_dim)
  f32mm = lambda x, y: mm(x, y, F32, precision=precision)
  inv = {}
  for i in range(nb):
    # L_ii^T (K K^T is symmetric; beta_t scales column t of L^T).
    lower_t = beta_row[:, blk(i)].astype(F32) * kk(i, i) * mask(blk(i), blk(i), diagonal=True,
                                                              transpose=True)
    inv[i, i] = _unit_lower_inverse_block(lower_t)
    lower = {j: beta_ref[blk(i), :].astype(F32) * kk(i, j) * mask(blk(i), blk(j), diagonal=False)
             for j in range(i)}
    for j in range(i - 1, -1, -1):
      acc = sum(f32mm(lower[m], inv[m, j]) for m in range(j, i))
      inv[i, j] = -f32mm(inv[i, i], acc)
  zero = jnp.zeros((SUB, SUB), F32)
  for i in range(nb):
    for j in range(nb):
      a_ref[blk(i), blk(j)] = inv[i, j] if j <= i else zero


def fused_prep_supported(c: int) -> str | None:
  """Why the one-kernel prep cannot take chunk size ``c`` (None: it can)."""
  if c % SUB or c < SUB:
    return f"fused prep needs the chunk size to be a multiple of {SUB}, got {c}"
  return None


def chunk_prep(q, k, k2_col, q2_col, g_col, beta_col, *, erase, cfg, fused=False):
  """gc, its transpose, A and P for every chunk. Inputs in the kernels' (BH, NC, C, X) layout.
  ``fused``: the one-kernel form (``_fused_prep_kernel``, GPU and interpret structure; chunk
  sizes that ``fused_prep_supported`` takes), as the plan's prep stage says.

  Returns gc (BH, NC, C, E), gc transposed (BH, NC, E, C), A and P (BH, NC, C, C), float32.
  """
  bh, nc, c, d = q.shape
  gc_col = masks.chunk_cumsum(g_col)
  gc_row = jnp.swapaxes(gc_col, -1, -2)
  k2_row = jnp.swapaxes(k2_col, -1, -2).astype(F32)
  spec = lambda *s: pl.BlockSpec((None, None, *s), lambda i, j: (i, j, 0, 0))
  shape = jax.ShapeDtypeStruct((bh, nc, c, c), F32)
  if fused:
    reason = fused_prep_supported(c)
    if reason:
      raise ValueError(reason)
    e_dim = k2_col.shape[-1]
    kernel = functools.partial(_fused_prep_kernel, c=c, e_dim=e_dim, erase=erase, dtype=q.dtype,
                               precision=cfg.f32_precision)
    cols, rows = spec(c, e_dim), spec(e_dim, c)
    a, p = call(
        kernel, cfg=cfg, grid=(bh, nc),
        in_specs=[spec(c, d), spec(c, d), cols, rows, cols, cols, rows, spec(c, 1), spec(1, c)],
        out_specs=[spec(c, c), spec(c, c)], out_shape=[shape, shape],
        semantics=("parallel", "parallel"), name="triadic_chunk_prep_fused",
    )(q, k, k2_col.astype(F32), k2_row, q2_col.astype(F32), gc_col, gc_row, beta_col,
      jnp.swapaxes(beta_col, -1, -2))
    return gc_col, gc_row, a, p
  m, mq = masks.decay_masks(k2_col, k2_row, q2_col, gc_col, gc_row, erase=erase)
  kernel = functools.partial(_prep_kernel, c=c, erase=erase, dtype=q.dtype)
  mats = (mq, m) if erase else (mq,)
  lower, p = call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[spec(c, d), spec(c, d), spec(c, 1)] + [spec(c, c)] * len(mats),
      out_specs=[spec(c, c), spec(c, c)], out_shape=[shape, shape],
      semantics=("parallel", "parallel"), name="triadic_chunk_prep",
  )(q, k, beta_col, *mats)
  return gc_col, gc_row, (unit_lower_inverse(lower) if erase else lower), p
