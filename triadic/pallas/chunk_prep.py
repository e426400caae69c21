"""The per-chunk forward preparation: cumulative decay, the masks M and M', the UT transform A.

Computed once per chunk and shared by every value block of the state-passing kernels
(docs/spec.md, the triadic op's chunked form):

  gc_te = sum_{s <= t} g_se                      chunk-local, <= 0 (``masks.chunk_cumsum``)
  M_ts  = sum_e k2_te k2_se exp(gc_te - gc_se)   s <= t (``masks.decay_masks``)
  M'_ts = sum_e q2_te k2_se exp(gc_te - gc_se)   s <= t
  A     = (I + StrictLower(beta_t (k_t . k_s) M_ts))^-1  (erase; zeros without)
  P     = Lower((q_t . k_s) M'_ts)                             the intra-chunk read

The E-dependent part is elementwise (the masks), done by XLA over all chunks at once
(``masks.decay_masks``); the kernel here is E-independent: one program per (batch*head, chunk)
forms K K^T and Q K^T on the matrix units and applies the masks. With ``Config.masks_in_prep``
(meant for small E, where a chunk's masks are a few elementwise C x C tiles) the kernel forms
M and M' itself, one slice's decay tile at a time, so they never pass through HBM. It writes the
strictly lower L = StrictLower(beta_t (k_t . k_s) M_ts) and P; A = (I + L)^-1 is then taken by
forward substitution (``Config.ut_kernel``, the GPU default: ``unit_lower_inverse_kernel``, one
program per chunk; else ``triadic.chunked.unit_lower_inverse`` in plain JAX, the TPU's and the
CPU's path), not by the all-matmul doubling product (I - L)(I + L^2)(I + L^4)...: that product
loses every digit in float32 once keys in a chunk are aligned (|L_ts| -> 1, e.g. a repeated
token).

The kernel form: the chunk's ``SUB`` x ``SUB`` diagonal blocks A_ii = (I + L_ii)^-1 by
substitution in registers (``_diagonal_block_inverses``), then the blocks below the diagonal by
block forward substitution, A_ij = -A_ii sum_{j <= m < i} L_im A_mj, as float32 products at
``Config.f32_precision``: the same arithmetic as ``unit_lower_inverse`` in another order, so as
accurate, with L read from HBM once and A written once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.chunked import unit_lower_inverse
from triadic.pallas import masks
from triadic.pallas.backward import decay_sums
from triadic.pallas.common import F32, call, check_heads, chunk_block, mm, token_block
from triadic.pallas.common import masks as causal_masks

SUB = 16  # rows per diagonal block of ``unit_lower_inverse_kernel``
UT_NUM_WARPS = 1  # one warp: each substitution step's reductions stay in the warp (no barrier)


def _products(q_ref, k_ref, beta_ref, mq, m, lower_ref, p_ref, *, c, erase, dtype):
  """P = Lower((Q K^T) * M') and L = StrictLower(beta (K K^T) * M) (zeros without erase) into
  ``p_ref`` and ``lower_ref``; ``mq()`` and ``m()`` give M' and M (C, C) where they are used."""
  causal, strict, _, _ = causal_masks(c)
  k = k_ref[...]
  p_ref[...] = jnp.where(causal, mm(q_ref[...], k, dtype, tb=True) * mq(), 0.0).astype(
      p_ref.dtype)
  if erase:
    kk = mm(k, k, dtype, tb=True)
    lower_ref[...] = jnp.where(strict, beta_ref[...].astype(F32) * kk * m(), 0.0)
  else:
    lower_ref[...] = jnp.zeros((c, c), F32)


def _prep_kernel(q_ref, k_ref, beta_ref, mq_ref, *rest, c, erase, dtype):
  """``_products`` with M' (``mq_ref``) and, with erase, M (``rest[0]``) read from HBM."""
  lower_ref, p_ref = rest[-2:]
  _products(q_ref, k_ref, beta_ref, lambda: mq_ref[...], lambda: rest[0][...], lower_ref, p_ref,
            c=c, erase=erase, dtype=dtype)


def _prep_masks_kernel(q_ref, k_ref, beta_ref, k2_col, k2_row, q2_col, gc_col, gc_row, lower_ref,
                       p_ref, *, c, e_dim, erase, dtype):
  """``_products`` with M' and M (erase) formed here from k2, q2 and gc
  (``backward.decay_sums``: one slice's decay tile at a time), live only until the products
  take them (``Config.masks_in_prep``)."""
  mq, m = decay_sums(k2_col, k2_row, q2_col, gc_col, gc_row, c=c, e_dim=e_dim, erase=erase)
  _products(q_ref, k_ref, beta_ref, lambda: mq, lambda: m, lower_ref, p_ref, c=c, erase=erase,
            dtype=dtype)


def masks_in_prep_supported(c: int, e: int, cfg) -> str | None:
  """Why the prep kernel cannot form the masks itself at chunk ``c`` and ``e`` slices under
  ``cfg`` (None: it can): its (C, 1) column loads and whole (C, E) blocks are the GPU
  structure's (Triton, or interpreted), not Mosaic TPU's (8, 128) tiles, and a Triton tensor's
  E must be a power of two (the op pads it)."""
  if cfg.chunk_grid:
    return "masks in the prep kernel: the GPU structure only (Config.masks_in_prep on TPU)"
  if not cfg.interpret and e & (e - 1):
    return f"masks in the prep kernel need E to be a power of two on the GPU (pad it), got {e}"
  return None


def _diagonal_block_inverses(column, nb):
  """(I + L_ii)^-1 of the ``nb`` SUB x SUB strictly lower diagonal blocks L_ii, by substitution:
  X = I, then for s = 0, 1, ..: row s of X is final, and every row t > s takes -L_ts X_s.
  ``column(i, s)`` gives column s of L_ii as a (SUB, 1) float32 column (a load from a ref, or a
  masked sum of a register block); row s of X, a register tensor Triton cannot slice, is picked by
  a masked sum. The blocks are independent chains, stepped together so that each step's work for
  every block is issued at once."""
  r = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  c = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  invs = [jnp.where(r == c, 1.0, 0.0).astype(F32)] * nb
  for s in range(SUB - 1):
    for i in range(nb):
      x_s = jnp.sum(jnp.where(r == s, invs[i], 0.0), axis=0, keepdims=True)    # (1, SUB): X_s
      invs[i] = invs[i] - column(i, s) * x_s
  return invs


def blocked_inverse(block, column, nb, precision):
  """{(i, j): A_ij, j <= i} of A = (I + L)^-1 for a strictly lower L of ``nb`` x ``nb`` SUB x SUB
  blocks: the diagonal blocks by ``_diagonal_block_inverses`` (``column`` as there), then the
  blocks below the diagonal by block forward substitution, A_ij = -A_ii sum_{j <= m < i} L_im A_mj,
  float32 products at ``precision``. ``block(i, m)`` gives L_im (SUB, SUB), m < i."""
  f32mm = lambda x, y: mm(x, y, F32, precision=precision)
  inv = {(i, i): x for i, x in enumerate(_diagonal_block_inverses(column, nb))}
  for i in range(1, nb):
    lower = {m: block(i, m) for m in range(i)}
    for j in range(i - 1, -1, -1):
      acc = f32mm(lower[j], inv[j, j])
      for m in range(j + 1, i):
        acc = acc + f32mm(lower[m], inv[m, j])
      inv[i, j] = -f32mm(inv[i, i], acc)
  return inv


def _inverse_kernel(lower_ref, a_ref, *low_ref, c, precision):
  nb = c // SUB
  blk = lambda i: pl.ds(i * SUB, SUB)
  inv = blocked_inverse(
      lambda i, m: lower_ref[blk(i), blk(m)],
      lambda i, s: lower_ref[blk(i), pl.ds(i * SUB + s, 1)].astype(F32), nb, precision)
  zero = jnp.zeros((SUB, SUB), F32)
  for i in range(nb):
    for j in range(nb):
      block = inv[i, j] if j <= i else zero
      a_ref[blk(i), blk(j)] = block
      for ref in low_ref:                 # A in the matmul operands' dtype, from the same values
        ref[blk(i), blk(j)] = block.astype(ref.dtype)


def ut_kernel_supported(c: int, cfg) -> str | None:
  """Why ``unit_lower_inverse_kernel`` cannot take chunk size ``c`` under ``cfg`` (None: it
  can): its 16 x 16 blocks and (16, 1) column loads are the GPU structure's (Triton, or
  interpreted), not Mosaic TPU's (8, 128) tiles."""
  if cfg.chunk_grid:
    return "the UT-inverse kernel has the GPU structure only (Config.ut_kernel on TPU)"
  if c % SUB:
    return f"the UT-inverse kernel needs the chunk size to be a multiple of {SUB}, got {c}"
  return None


def unit_lower_inverse_kernel(lower, *, cfg, num_warps=UT_NUM_WARPS, low_dtype=None):
  """(I + L)^-1 of every chunk's strictly lower L (BH, NC, C, C) float32, one program per chunk:
  ``triadic.chunked.unit_lower_inverse``'s values (the module docstring says how). ``num_warps``:
  the Triton program's warps (the substitution is a chain of small reductions: with one warp
  they are shuffles, with several each step also crosses warps through shared memory).
  ``low_dtype``: also return A cast to that dtype, written by the same kernel (A, A_low)."""
  bh, nc, c, _ = lower.shape
  reason = ut_kernel_supported(c, cfg)
  if reason:
    raise ValueError(reason)
  spec = chunk_block(c, c)
  kernel = functools.partial(_inverse_kernel, c=c, precision=cfg.f32_precision)
  out_shape = [jax.ShapeDtypeStruct(lower.shape, F32)]
  if low_dtype is not None:
    out_shape.append(jax.ShapeDtypeStruct(lower.shape, low_dtype))
  out = call(kernel, cfg=cfg, grid=(bh, nc), in_specs=[spec], out_specs=[spec] * len(out_shape),
             out_shape=out_shape, semantics=("parallel", "parallel"), name="triadic_ut_inverse",
             num_warps=num_warps)(lower)
  return tuple(out) if low_dtype is not None else out[0]


class Prep(NamedTuple):
  """``chunk_prep``'s results, each (BH, NC, ...)."""
  gc_col: jax.Array       # (C, E) float32: the chunk-local cumulative log decay gc
  gc_row: jax.Array       # (E, C) float32: gc transposed
  a: jax.Array            # (C, C) float32: the UT transform A (zeros without erase)
  p: jax.Array            # (C, C) in q's dtype: the intra-chunk read P
  a_operand: jax.Array    # (C, C) in q's dtype: A as the state passes' and A^T dU's operand
  mq: jax.Array | None = None   # (C, C) float32: M' where formed in plain JAX, else None
  m: jax.Array | None = None    # (C, C) float32: M likewise (None without erase)


def chunk_prep(q, k, k2_col, q2_col, g_col, beta_col, *, erase, cfg, heads=None,
               masks_in_kernel=False):
  """gc, its transpose, A and P for every chunk. Inputs in the kernels' (BH, NC, C, X) layout;
  with ``heads=H`` q and k are in the caller's (B, T, H, D) layout instead (T = NC * C), read in
  place by the kernel's blocks (program (i, n) reads tokens n*C.. of batch i // H, head i % H).
  ``masks_in_kernel``: the kernel forms the masks M, M' itself (``_prep_masks_kernel``; the plan's
  ``masks_in_prep``, ``Config.masks_in_prep``; a ValueError where ``masks_in_prep_supported``
  refuses) instead of reading those of ``masks.decay_masks``; the same values up to the order of
  float32 sums.

  Returns a ``Prep``: gc (BH, NC, C, E), gc transposed (BH, NC, E, C), float32, A (BH, NC, C, C)
  float32, P (BH, NC, C, C) in q's dtype and A again in q's dtype. P's every use (the state
  passes' P U and P^T dO) casts it to that dtype, so a float32 P would only be written and read
  at twice the bytes; A's float32 values are read by the backward's UT-transform gradient, its
  other uses (the state passes, A^T dU) cast it, so the inverse writes that copy too instead of a
  cast pass before each of them. Where the masks were formed in plain JAX (not
  ``masks_in_kernel``), also M' and M (erase), float32 (BH, NC, C, C), for a backward that
  reads them (``Plan.saves_masks``).
  """
  bh, nc, c, e_dim = g_col.shape
  d = q.shape[-1]
  if masks_in_kernel:
    reason = masks_in_prep_supported(c, e_dim, cfg)
    if reason:
      raise ValueError(reason)
  if heads is None:
    qk_spec = chunk_block(c, d)
  else:
    check_heads(heads, bh, nc, c, q=q, k=k)
    qk_spec = token_block(c, d, heads)
  gc_col = masks.chunk_cumsum(g_col)
  gc_row = jnp.swapaxes(gc_col, -1, -2)
  k2_row = jnp.swapaxes(k2_col, -1, -2).astype(F32)
  spec = chunk_block
  m = mq = None
  if masks_in_kernel:
    kernel = functools.partial(_prep_masks_kernel, c=c, e_dim=e_dim, erase=erase, dtype=q.dtype)
    operands = (k2_col, k2_row, q2_col, gc_col, gc_row)
    op_specs = [spec(c, e_dim), spec(e_dim, c), spec(c, e_dim), spec(c, e_dim), spec(e_dim, c)]
  else:
    m, mq = masks.decay_masks(k2_col, k2_row, q2_col, gc_col, gc_row, erase=erase)
    kernel = functools.partial(_prep_kernel, c=c, erase=erase, dtype=q.dtype)
    operands = (mq, m) if erase else (mq,)
    op_specs = [spec(c, c)] * len(operands)
  shape = jax.ShapeDtypeStruct((bh, nc, c, c), F32)
  lower, p = call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[qk_spec, qk_spec, spec(c, 1)] + op_specs,
      out_specs=[spec(c, c), spec(c, c)],
      out_shape=[shape, jax.ShapeDtypeStruct((bh, nc, c, c), q.dtype)],
      semantics=("parallel", "parallel"), name="triadic_chunk_prep",
      # with the masks inside, at least C^2 / 1024 warps: a C x C float32 tile at 32 registers a
      # thread (M' and M alone would fill 4 warps' registers at C = 128)
      num_warps=max(cfg.num_warps, c * c // 1024) if masks_in_kernel else None,
  )(q, k, beta_col, *operands)
  if not erase:
    return Prep(gc_col, gc_row, lower, p, lower.astype(q.dtype), mq=mq)
  if cfg.ut_kernel:
    a, a_operand = unit_lower_inverse_kernel(lower, cfg=cfg, low_dtype=q.dtype)
  else:
    a = unit_lower_inverse(lower)
    a_operand = a.astype(q.dtype)
  return Prep(gc_col, gc_row, a, p, a_operand, mq=mq, m=m)
