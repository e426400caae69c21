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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.chunked import unit_lower_inverse
from triadic.pallas import masks
from triadic.pallas.common import F32, call, mm
from triadic.pallas.common import masks as causal_masks


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


def chunk_prep(q, k, k2_col, q2_col, g_col, beta_col, *, erase, cfg):
  """gc, its transpose, A and P for every chunk. Inputs in the kernels' (BH, NC, C, X) layout.

  Returns gc (BH, NC, C, E), gc transposed (BH, NC, E, C), A and P (BH, NC, C, C), float32.
  """
  bh, nc, c, d = q.shape
  gc_col = masks.chunk_cumsum(g_col)
  gc_row = jnp.swapaxes(gc_col, -1, -2)
  k2_row = jnp.swapaxes(k2_col, -1, -2).astype(F32)
  m, mq = masks.decay_masks(k2_col, k2_row, q2_col, gc_col, gc_row, erase=erase)
  spec = lambda *s: pl.BlockSpec((None, None, *s), lambda i, j: (i, j, 0, 0))
  kernel = functools.partial(_prep_kernel, c=c, erase=erase, dtype=q.dtype)
  shape = jax.ShapeDtypeStruct((bh, nc, c, c), F32)
  mats = (mq, m) if erase else (mq,)
  lower, p = call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[spec(c, d), spec(c, d), spec(c, 1)] + [spec(c, c)] * len(mats),
      out_specs=[spec(c, c), spec(c, c)], out_shape=[shape, shape],
      semantics=("parallel", "parallel"), name="triadic_chunk_prep",
  )(q, k, beta_col, *mats)
  return gc_col, gc_row, (unit_lower_inverse(lower) if erase else lower), p
