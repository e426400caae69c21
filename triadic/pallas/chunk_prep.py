"""The per-chunk kernel: cumulative decay, the masks M and M', the UT transform A.

One program per (batch*head, chunk), all independent. Computed once and shared by every value
block of the recurrent kernels (SPEC section 1, "The chunked form"):

  gc_te = sum_{s <= t} g_se                      chunk-local, <= 0, stored as (C, E) and (E, C)
  M_ts  = sum_e k2_te k2_se exp(gc_te - gc_se)   s <= t
  M'_ts = sum_e q2_te k2_se exp(gc_te - gc_se)   s <= t
  A     = (I + StrictLower(beta_t (k_t . k_s) M_ts))^-1  (erase; zeros without)
  P     = Lower((q_t . k_s) M'_ts)                             the intra-chunk read

The masks are elementwise C x C x E work (64 x 64 x 8 = 32k exponentials per chunk at E = 8), each
exponent gc_t - gc_s with s <= t, masked before ``exp``: nothing overflows for any g <= 0. The
cumulative sums are masked reductions (no cumsum lowering in Mosaic; a triangular matmul would be
TF32 on Triton). The kernel writes the strictly lower L = StrictLower(beta_t (k_t . k_s) M_ts);
A = (I + L)^-1 is then taken by forward substitution (``triadic.chunked.unit_lower_inverse``),
not by the all-matmul doubling product (I - L)(I + L^2)(I + L^4)...: that product loses every
digit in float32 once keys in a chunk are aligned (|L_ts| -> 1, e.g. a repeated token).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.chunked import unit_lower_inverse
from triadic.pallas.common import F32, call, col, colsum, masks, mm, row, rowsum


def decay_masks(gt, gs, causal):
  """exp(gc_t - gc_s) where s <= t, else 0: gt (C, 1), gs (1, C)."""
  return jnp.where(causal, jnp.exp(jnp.where(causal, gt - gs, 0.0)), 0.0)


def chunk_gc(g_c, g_r, e, c):
  """Slice e of the chunk-local inclusive cumsum of g as a (C, 1) column and a (1, C) row."""
  causal, _, t, s = masks(c)
  gt = rowsum(jnp.where(causal, row(g_r, e), 0.0))   # sum over s <= t
  gs = colsum(jnp.where(t <= s, col(g_c, e), 0.0))   # sum over t <= s
  return gt, gs


def _prep_kernel(q_ref, k_ref, k2c, k2r, q2c, gcin, grin, beta_ref,
                 gcc_ref, gcr_ref, a_ref, p_ref, *, c, e_dim, erase, dtype):
  causal, strict, _, _ = masks(c)
  m = jnp.zeros((c, c), F32)
  mq = jnp.zeros((c, c), F32)
  for e in range(e_dim):
    gt, gs = chunk_gc(gcin, grin, e, c)
    gcc_ref[:, pl.ds(e, 1)] = gt
    gcr_ref[pl.ds(e, 1), :] = gs
    dec = decay_masks(gt, gs, causal)
    k2s = row(k2r, e)
    if erase:
      m = m + col(k2c, e) * k2s * dec
    mq = mq + col(q2c, e) * k2s * dec
  k = k_ref[...]
  p_ref[...] = jnp.where(causal, mm(q_ref[...], k, dtype, tb=True) * mq, 0.0)
  if erase:
    kk = mm(k, k, dtype, tb=True)
    lower = jnp.where(strict, beta_ref[...].astype(F32) * kk * m, 0.0)
    a_ref[...] = lower
  else:
    a_ref[...] = jnp.zeros((c, c), F32)


def chunk_prep(q, k, k2c, k2r, q2c, g_c, g_r, beta_c, *, erase, cfg):
  """Run the per-chunk kernel. Inputs in (BH, NC, C, X) / (BH, NC, E, C) layout.

  Returns gc (BH, NC, C, E), gc transposed (BH, NC, E, C), A and P (BH, NC, C, C), float32.
  """
  bh, nc, c, d = q.shape
  e_dim = k2c.shape[-1]
  spec = lambda *s: pl.BlockSpec((None, None, *s), lambda i, j: (i, j, 0, 0))
  kernel = functools.partial(_prep_kernel, c=c, e_dim=e_dim, erase=erase, dtype=q.dtype)
  shape = lambda *s: jax.ShapeDtypeStruct((bh, nc, *s), F32)
  gcc, gcr, lower, p = call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[spec(c, d), spec(c, d), spec(c, e_dim), spec(e_dim, c), spec(c, e_dim),
                spec(c, e_dim), spec(e_dim, c), spec(c, 1)],
      out_specs=[spec(c, e_dim), spec(e_dim, c), spec(c, c), spec(c, c)],
      out_shape=[shape(c, e_dim), shape(e_dim, c), shape(c, c), shape(c, c)],
      semantics=("parallel", "parallel"), name="triadic_chunk_prep",
  )(q, k, k2c, k2r, q2c, g_c, g_r, beta_c)
  return gcc, gcr, (unit_lower_inverse(lower) if erase else lower), p
