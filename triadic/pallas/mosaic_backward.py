"""Hopper (Mosaic GPU) chunk-parallel backward: a drop-in for ``backward.chunk_gradients`` (same
operands and outputs, minus ``cfg``, plus the forward's X), for bf16 inputs.

Two kernels can do the E-dependent work; ``chunk_gradients`` runs one of them, then the tail:

* the slice kernel (``slices_pass``, the default up to E = ``SLICE_KERNEL_MAX_E``): one
  program per chunk streams the state slices S_e, dS_e in pieces of 64 rows, each a wgmma operand
  straight from its TMA copy, and contracts over V: dX S_e^T, dO S_e^T, U dS_e^T give the dq / dk
  columns and the row sums at once (3 products per slice where the value kernel takes 6), and
  the diagonal of S_e dS_e^T gives dlam. It needs X = V - sum_e diag(c_e) K S_e, which the Mosaic
  forward saves (``mosaic.state_pass(save_x=True)``; ``x_from_states`` in plain JAX otherwise).
  Above that E its live registers spill and the value kernel is faster (benchmarks/RESULTS.md).
* the value kernel (``value_pass``), described below, which also forms X.

The value kernel's E-dependent work is a few wide wgmmas per value block, with the E slices of
the D x BV state tile side by side as ONE D x (E*BV) bf16 SMEM operand, "S_cat" (column block
e = S_e[:, value block]), and dS_cat likewise (the idiom of ``mosaic.py``). With c_e = k2_e a_e,
fq_e = q2_e a_e, fw_e = k2_e b_e (a = exp(gc), b = exp(gc_C - gc)), drhs = A^T dU and
dX = beta drhs, per value block:

  R = K S_cat       X = V - sum_e diag(c_e) R_e          dcoef_e  -= rowsum(R_e * dX)   (erase)
  Y = Q S_cat                                            dqcoef_e += scale rowsum(Y_e * dO)
  Z = K dS_cat                                           dkcoef_e += rowsum(Z_e * U)
  dk += [-diag(c_e) dX]_e S_cat^T + [diag(fw_e) U]_e dS_cat^T      (C x E*BV)(E*BV x D)
  dq += [scale diag(fq_e) dO]_e S_cat^T
  dlam_e += <dS_e, S_e>

(rowsum(k * (dx S_e^T)) equals rowsum((K S_e) * dx), etc.). R, Y, Z are wgmmas with N = a
"piece" of the E*BV columns (64 at D = 128, up to 128 at D = 64, whole slices), so the live
C x piece accumulator stays small next to the dq, dk accumulators; the dq / dk products are
single wgmmas with K = E*BV. What runs where:

* plain JAX before (E-independent, O(T V C)): drhs = A^T dU (bf16 operands, f32 accumulation, as
  the Triton kernel), dv = beta drhs, the per-row factor rows [c, fq, fw, beta] (O(T E)).
* the Mosaic GPU kernel ``triadic_chunk_backward_mgpu`` (grid (B*H, NC), one warpgroup, loop over
  value blocks): everything above that touches S or dS. Outputs: dq and dk partials (C x D f32),
  X (C x V f32, erase only), the row-sum coefficients as one (C, 32) f32 matrix (columns
  [dcoef_e, dqcoef_e, dkcoef_e]), and dlam as per-row partial sums (D, 8) (summed over D in JAX).
  It runs once per group of ``value_slices`` slices (``default_value_slices``): every output is a
  sum over slices or a per-slice column, so the groups' results add up (X = V - sum_e ...: one V
  per extra group is taken back). Groups keep each pass within SMEM with two staging buffers
  (at D = 128, E = 8 one pass fits only one), at the price of re-reading K, Q, V, dO, U, drhs.
* the E-independent Pallas (Triton on GPU, interpret on CPU) tail kernel
  ``triadic_chunk_backward_tail_ut`` (grid (B*H, NC)): dbeta's X part rowsum(drhs X),
  dA = dU (beta X)^T, dP = scale dO U^T (accumulated over blocks of value columns), then
  ``backward.ut_before`` / ``ut_after`` (dL = -A^T dA A^T with ``f32_precision``, TF32x3 on GPU;
  dq, dk from M and M', written in the inputs' dtype), writing dM' = dP * (Q K^T) and
  dM = dL * beta * (K K^T) (float32 C x C each).
* plain JAX around the tail (``masks.py``): M and M' before, and the per-slice elementwise
  gradients (dk2, dq2, d gc through exp(gc_t - gc_s)) after, over all chunks at once, which XLA
  fuses into its reductions. Costs four C x C float32 matrices per chunk through HBM (M, M' in,
  dM', dM out).

How the Mosaic kernel is built (idioms from ``mosaic.py``, imported: ``_smem``, ``_swizzle``,
``_Ops``, ``_interpret_params``):

* Every wgmma operand is SMEM bf16 with one swizzle for all of them, that of a BV-wide bf16 row
  ("swizzle V": 32 / 64 / 128 B for BV = 16 / 32 / 64), so that S_cat, dS_cat and the
  [.]_e operands W1 = [-c dX], W2 = [fw U], W3 = [scale fq dO] are written from registers one
  BV-wide column block (a whole column of SMEM tiles) at a time.
* The states arrive per value block by E TMAs (one (D, BV) box per slice: a single (E, D, BV)
  box would need more than the 5 strided dimensions a TMA allows) of ``states`` (resp.
  ``dstates``) into an (E, D, BV) staging buffer and are copied to their S_cat column blocks through
  registers (a TMA cannot write a column block of a tiled buffer; the states stay in the forward's
  (BH, NC, E, D, V) layout, so no state-sized transposes happen in HBM).
* Load pipeline (the kernel is latency-bound: one CTA per SM, nothing else resident to hide a
  TMA's latency; the bf16 state slices are only ~0.7 GB at the benchmark shape, E = 4). Every
  per-value-block copy is started one step ahead of its use, into the buffer that has just been
  consumed, so that each wait finds its data (mostly) landed. Per value block j:

    wait V/dO/U/drhs_j, S_j; S_j -> S_cat; V/dO/U/drhs_j -> registers; write W1..W3
    commit_smem                     (every thread is done with V/dO/U/drhs_j and staging S)
    start V/dO/U/drhs_{j+1}; stages == 2: start S_{j+1} -> staging S;
                             stages == 1: start dS_j -> the (one) staging buffer
    R, Y products, dq += W3 S_cat^T, dk += W1 S_cat^T
    wait dS_j; dS_j -> dS_cat; dlam
    commit_smem                     (every thread is done with staging dS)
    stages == 2: start dS_{j+1} -> staging dS;  stages == 1: start S_{j+1} -> staging
    Z products, dk += W2 dS_cat^T

  (block 0's copies, and with two stages its dS too, start in the prologue with q, k and the
  factors; the "next" copies are under ``pl.when(j + 1 < nv)``, so no copy is in flight when the
  loop's SMEM scope ends). With two staging buffers ("stages = 2": one for S, one for dS; the
  role, not the block parity, picks the buffer, which is the same thing here as each is used once
  per block) every state copy has a whole value block of compute to land; with one (S, then dS,
  in it: the original layout), dS_j overlaps the S-side products and S_{j+1} the dS-side ones.
  The V / dO / U / drhs blocks are single-buffered but still a block ahead: they are read into
  registers right at the top of the block. ``default_stages`` takes 2 wherever it fits.
  Why this and not 2 CTAs per SM: at D = 128 K, Q (32 KiB) and the output scope (dq, dk f32,
  76 KiB) alone leave little of a 113 KiB half-SM; only E = 1 at BV = 32 (111 KiB with two
  stages) and E = 2 at BV = 16 (96 KiB) would fit two CTAs, with N = E*BV = 32. That is a
  ``block_v`` choice away (no code change) for whoever wants to time it against the defaults.
* The transposed operands S_cat^T, dS_cat^T (B of the dq / dk products, the K-major "transposed B"
  of every attention kernel): on hardware ``plgpu.transpose_ref`` of S_cat; the interpreter cannot
  apply a transposed ref, so in interpret mode the same register copy also writes explicit
  (E*BV, D) transposes (extra SMEM that exists in interpret mode only). The hardware path of these
  two operands is therefore checked only by the CUDA lowering test, not numerically on CPU.
* dq, dk accumulate across the value loop in two scoped ``plgpu.ACC`` (C x D f32) accumulators;
  the row sums are accumulated as a (C, 32) matrix (column picked by an iota one-hot, ``where``),
  dlam as a (D, 8) matrix: no 1-D loop carries, no cross-warp reductions (row sums only).
* Ordering (one warpgroup, as ``mosaic.py``): ``commit_smem`` after every register -> SMEM store
  that a wgmma or TMA reads; every register read of a TMA'd input buffer (staging S / dS, V, dO,
  U, drhs) happens before a ``commit_smem`` (a warpgroup barrier) that precedes the (prefetch)
  TMA which overwrites it (see the pipeline above); each barrier has at most one copy in flight
  and is waited in issue order (q, k, f: 0..2; blocks 3..6; S slices 7..; dS slices 7 + E..);
  ``wait_smem_to_gmem(0, wait_read_only=True)`` before X's output buffer is rewritten;
  ``wgmma_wait(0)`` before W1..W3 are rewritten (the previous block's last wgmma, dk += W2
  dS_cat^T, is otherwise not waited for before that point; with synchronous loads the TMA wait
  hid this, with prefetched loads it would not). S_cat and dS_cat are rewritten only after an
  accumulator read (``ops.mm``), which waits for every wgmma in flight. Outputs dq, dk, coef,
  dlam leave from a second SMEM scope after the loop's scope is released.
* Budgets (hardware buffers, ``smem_bytes``): at D = 128, E = 8, BV = 16: K, Q 32 KiB, staging
  32 per stage, S_cat + dS_cat 64, W1..W3 48, V/dO/U/drhs/X blocks 16, factors 6: ~198 KiB with
  one stage, ~230 KiB with two (over the 227 KiB limit). ``default_block_v`` takes the widest BV
  in (64, 32, 16) dividing V with E*BV <= 256 whose SMEM with two staging buffers fits 220 KiB,
  else the widest that fits with one. KiB per (D, E), estimate (the CUDA lowering's allocation,
  which adds barriers and alignment, or the output scope's 76 KiB at D = 128 where larger), with
  the default marked *:

    D = 128  E=1: BV64 2st 185.0 (187.1)*   BV64 1st 169.0 (171.1)   BV32 2st 109.0 (111.1)
             E=2: BV32 2st 153.8 (156.1)*   BV64 2st 273.8 (over)    BV32 1st 137.8 (140.1)
             E=4: BV16 2st 139.2 (142.1)*   BV32 2st 243.2 (over)    BV32 1st 211.2 (214.1)
             E=8: one pass BV16 1st 198.2 (201.2), 2st 230.2 (233.2 over); the default is two
                  passes of 4 slices, each as E=4*
    D = 64   E=1: BV64 2st 137.0 (139.1)*   E=2: BV64 2st 193.8 (196.1)*
             E=4: BV32 2st 163.2 (166.1)*   E=8: BV16 2st 150.2 (153.2)*

  Registers per thread (f32): dq + dk 2*D*C/128 (128 at D = 128) + one C x piece accumulator (32 at
  D = 128, <= 64 at D = 64) + coef (16) + dlam (8) + value-block temps (~40): under 255 without
  the carried state the state kernels hold.
* float32 inputs are not supported (wgmma on float32 would be TF32; use the Triton path).

What the interpreter cannot check: the transpose_ref operands (above), swizzle / tiling
correctness of the register <-> SMEM copies, register pressure (spills), the real SMEM limit
(``smem_bytes`` is an estimate; the CUDA lowering test checks the allocation), and races that
the ordering rules above are meant to exclude: ``benchmarks/triadic_kernels.py --check`` checks
the kernels on a GPU against the chunked form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from triadic.pallas import masks
from triadic.pallas.backward import chunk_local, ut_after, ut_before
from triadic.pallas.common import F32, Config, call, col, mm, rowsum
from triadic.pallas.mosaic import (MAX_N, _Ops, _interpret_params, _load, _smem, _swizzle, _wait,
                                   sizes_reason)

BF16 = jnp.bfloat16
BLOCK_VS = (64, 32, 16)

SMEM_LIMIT = 220 * 1024       # of the 227 KiB a block may have (reduction scratch etc.)
COEF_W = 32                   # columns of the row-sum matrix: [dcoef, dqcoef, dkcoef] (3E <= 32)
LAM_W = 8                     # columns of the dlam matrix (E <= 8)
MAX_E = 8


def piece_width(d: int, e: int, bv: int) -> int:
  """Columns of S_cat per R / Y / Z wgmma: whole slices, at most 64 (D = 128) or 128 (D = 64)."""
  cap = 64 if d > 64 else 128
  g = max(x for x in range(1, e + 1) if e % x == 0 and x * bv <= max(cap, bv))
  return g * bv


def smem_bytes(d: int, vd: int, c: int, e: int, bv: int, erase: bool = True,
               stages: int = 2) -> int:
  """SMEM of the kernel's value-loop scope on hardware (the output scope is smaller).
  ``stages``: state staging buffers (2: one for S, one for dS, each prefetched a value block
  ahead; 1: S and dS share one)."""
  n = e * bv
  return (2 * c * d * 2                 # K, Q
          + stages * e * d * bv * 2     # staging (E, D, BV), one or two
          + 2 * d * n * 2               # S_cat, dS_cat
          + (3 if erase else 2) * c * n * 2   # W1, W2, W3
          + c * bv * (2 + 2 + 4 + 4 + 4)      # V, dO, U, drhs, X blocks
          + (3 * e + 1) * c * 4)        # factor rows


def fits(d: int, vd: int, c: int, e: int, bv: int, stages: int) -> bool:
  return smem_bytes(d, vd, c, e, bv, stages=stages) <= SMEM_LIMIT


def default_block_v(d: int, vd: int, c: int, e: int) -> int | None:
  """The widest BV in (64, 32, 16) dividing V with E*BV <= 256 that fits with two staging
  buffers, else the widest that fits with one (see ``default_stages``)."""
  ok = [bv for bv in BLOCK_VS if vd % bv == 0 and e * bv <= MAX_N]
  for stages in (2, 1):
    for bv in ok:
      if fits(d, vd, c, e, bv, stages):
        return bv
  return None


def default_stages(d: int, vd: int, c: int, e: int, bv: int) -> int:
  """2 (separate S and dS staging buffers) where that fits SMEM_LIMIT, else 1."""
  return 2 if fits(d, vd, c, e, bv, 2) else 1


def supported(d: int, vd: int, c: int, e: int, dtype, block_v: int | None = None,
              stages: int | None = None, value_slices: int | None = None) -> str | None:
  """Why this kernel cannot take these sizes, or None if it can. ``value_slices`` (default
  ``default_value_slices``) slices per pass of the value kernel: the SMEM and wgmma limits apply
  to one pass."""
  size = value_slices or default_value_slices(d, vd, c, e)
  if size > MAX_E or e % size:
    return f"value_slices must divide E = {e} and be <= {MAX_E}, got {size}"
  bv = block_v or default_block_v(d, vd, c, size)
  reason = sizes_reason(d, vd, c, size, dtype, bv, BLOCK_VS, "the Mosaic GPU backward")
  if reason:
    return reason
  if stages not in (None, 1, 2):
    return f"stages must be 1 or 2, got {stages}"
  st = stages or 1
  if smem_bytes(d, vd, c, size, bv, stages=st) > SMEM_LIMIT:
    return (f"SMEM {smem_bytes(d, vd, c, size, bv, stages=st)} B > {SMEM_LIMIT} B at D={d}, "
            f"{size} slices per pass, block_v={bv}, stages={st}")
  return None


# ------------------------------------------------------------------------------------------------
# Plain-JAX preparation (E-independent or O(T E)).


def factor_rows(gc_col, k2_col, q2_col, beta_col):
  """(BH, NC, 3E + 1, C) float32 rows [c = k2 a (E), fq = q2 a (E), fw = k2 b (E), beta]."""
  a = jnp.exp(gc_col)
  b = jnp.exp(gc_col[:, :, -1:, :] - gc_col)
  rows = jnp.concatenate([k2_col * a, q2_col * a, k2_col * b, beta_col.astype(F32)], axis=-1)
  return jnp.swapaxes(rows, -1, -2)


def rhs_gradient(a, du, erase):
  """A^T dU with bf16 operands and float32 accumulation (as the Triton kernel's ``mm``)."""
  if not erase:
    return du.astype(F32)
  return jnp.einsum("...st,...sv->...tv", a.astype(BF16), du.astype(BF16),
                    preferred_element_type=F32)


# ------------------------------------------------------------------------------------------------
# The Mosaic GPU kernel: everything that touches S or dS.


def _onehot_add(ops, acc, vec, column):
  """acc + vec placed in column ``column`` (acc (rows, W) WGMMA layout, vec a row sum)."""
  rows, width = acc.shape
  idx = ops.acc(lax.broadcasted_iota(jnp.int32, (rows, width), 1))
  return acc + jnp.where(idx == column, lax.broadcast_in_dim(vec, (rows, width), [0]), 0.0)



def _value_kernel(q_g, k_g, v_g, do_g, u_g, dr_g, s_g, ds_g, f_g, *rest, scratch, outs, c, d,
                  e_dim, e_offset, bv, nv, piece, stages, scale, erase, interpret):
  if erase:
    x_g, dq_g, dk_g, coef_g, lam_g, bars = rest
  else:
    x_g = None
    dq_g, dk_g, coef_g, lam_g, bars = rest
  ops = _Ops(interpret)
  i, n = lax.axis_index("bh"), lax.axis_index("n")
  erase_rows, read_rows, write_rows, beta_row = 0, e_dim, 2 * e_dim, 3 * e_dim
  n_cat = e_dim * bv
  per_piece = piece // bv
  # Barriers: 0..2 q, k, factors; 3..6 the V, dO, U, drhs blocks; BAR_S.. the E S slices;
  # BAR_DS.. the E dS slices (each barrier: one copy in flight at a time, waited in issue order).
  bar_s, bar_ds = 7, 7 + e_dim

  onehot_add = functools.partial(_onehot_add, ops)

  def main(dq_acc, dk_acc, q_s, k_s, f_s, stg_s, s_cat, ds_cat, w2, w3, v_s, do_s, u_s, dr_s,
           *extra):
    extra = list(extra)
    stg_ds = extra.pop(0) if stages == 2 else stg_s
    w1 = extra.pop(0) if erase else None
    x_s = extra.pop(0) if erase else None
    if interpret:
      st_s, dst_s = extra
      s_t, ds_t = st_s, dst_s
    else:
      s_t, ds_t = plgpu.transpose_ref(s_cat, (1, 0)), plgpu.transpose_ref(ds_cat, (1, 0))
    rowf = lambda idx: ops.rowvec(f_s, idx, bv)

    # The per-value-block copies, started one step ahead of their use (see the docstring).
    def load_blocks(j):
      cols = pl.ds(j * bv, bv)
      _load([(v_g.at[i, n, :, cols], v_s), (do_g.at[i, n, :, cols], do_s),
             (u_g.at[i, n, :, cols], u_s), (dr_g.at[i, n, :, cols], dr_s)], bars, first=3)

    def load_state(src, stg, first, j):
      # One TMA per slice (a (E, D, BV) box would need more than 5 strided dimensions).
      cols = pl.ds(j * bv, bv)
      _load([(src.at[i, n, e_offset + e, :, cols], stg.at[e]) for e in range(e_dim)], bars,
            first=first)

    _load([(q_g.at[i, n], q_s), (k_g.at[i, n], k_s), (f_g.at[i, n], f_s)], bars)
    load_blocks(0)
    load_state(s_g, stg_s, bar_s, 0)
    if stages == 2:
      load_state(ds_g, stg_ds, bar_ds, 0)
    _wait(3, bars)

    def to_cat(stg, cat, cat_t):
      """The staged (E, D, BV) slices into their column blocks of ``cat`` (and of its explicit
      transpose ``cat_t`` in interpret mode); returns the float32 slices."""
      slices = []
      for e in range(e_dim):
        blk = slice(e * bv, (e + 1) * bv)
        x = ops.acc(stg[e].astype(F32))
        cat[:, blk] = x.astype(BF16)
        if interpret:
          cat_t[blk, :] = x.T.astype(BF16)
        slices.append(x)
      return slices

    def per_slice(lhs, cat):
      """(e, (lhs @ cat)[:, column block e]) for every e, the product taken ``piece`` columns at
      a time so that only a C x piece accumulator is live."""
      for h in range(n_cat // piece):
        prod = ops.mm(lhs, cat.at[:, h * piece:(h + 1) * piece])
        for g in range(per_piece):
          yield h * per_piece + g, prod[:, g * bv:(g + 1) * bv]

    def vblock(j, carry):
      coef, lam = carry
      cols = pl.ds(j * bv, bv)
      has_next = j + 1 < nv
      _wait(4, bars, first=3)
      _wait(e_dim, bars, first=bar_s)
      to_cat(stg_s, s_cat, s_t)
      do = ops.acc(do_s[...].astype(F32))
      u = ops.acc(u_s[...])
      dr = ops.acc(dr_s[...])
      dx = rowf(beta_row) * dr
      x = ops.acc(v_s[...].astype(F32)) if erase else None
      # The previous block's last wgmma (dk += W2 dS_cat^T) may still read W2: wait before the
      # W buffers are rewritten (the other wgmmas were waited by a later accumulator read).
      plgpu.wgmma_wait(0)
      for e in range(e_dim):
        blk = slice(e * bv, (e + 1) * bv)
        w3[:, blk] = (scale * rowf(read_rows + e) * do).astype(BF16)
        w2[:, blk] = (rowf(write_rows + e) * u).astype(BF16)
        if erase:
          w1[:, blk] = (-rowf(erase_rows + e) * dx).astype(BF16)
      plgpu.commit_smem()
      # Every thread has read the S staging buffer and the V, dO, U, drhs blocks (commit_smem is
      # a warpgroup barrier): the next block's copies go into them while this block computes.
      # With one staging buffer, this block's dS goes into it now and the next S after dS has
      # been read.
      if stages == 1:
        load_state(ds_g, stg_ds, bar_ds, j)

      @pl.when(has_next)
      def _():
        load_blocks(j + 1)
        if stages == 2:
          load_state(s_g, stg_s, bar_s, j + 1)

      if erase:
        for e, re in per_slice(k_s, s_cat):
          x = x - rowf(erase_rows + e) * re
          coef = onehot_add(coef, -jnp.sum(re * dx, axis=1), e)
      for e, ye in per_slice(q_s, s_cat):
        coef = onehot_add(coef, scale * jnp.sum(ye * do, axis=1), e_dim + e)
      plgpu.wgmma(dq_acc, w3, s_t)
      if erase:
        plgpu.wgmma(dk_acc, w1, s_t)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous block's X store
        x_s[...] = x
      _wait(e_dim, bars, first=bar_ds)
      for e, dse in enumerate(to_cat(stg_ds, ds_cat, ds_t)):
        se = ops.acc(s_cat[:, e * bv:(e + 1) * bv].astype(F32))
        lam = onehot_add(lam, jnp.sum(dse * se, axis=1), e)
      plgpu.commit_smem()
      # Every thread has read the dS staging buffer.
      @pl.when(has_next)
      def _():
        if stages == 2:
          load_state(ds_g, stg_ds, bar_ds, j + 1)
        else:
          load_state(s_g, stg_s, bar_s, j + 1)

      if erase:
        plgpu.copy_smem_to_gmem(x_s, x_g.at[i, n, :, cols])
      for e, ze in per_slice(k_s, ds_cat):
        coef = onehot_add(coef, jnp.sum(ze * u, axis=1), 2 * e_dim + e)
      plgpu.wgmma(dk_acc, w2, ds_t)
      return coef, lam

    init = (ops.acc(jnp.zeros((c, COEF_W), F32)), ops.acc(jnp.zeros((d, LAM_W), F32)))
    out = lax.fori_loop(0, nv, vblock, init)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    return out

  def with_accs(dq_acc, dk_acc):
    coef, lam = pl.run_scoped(functools.partial(main, dq_acc, dk_acc), *scratch)
    return dq_acc[...], dk_acc[...], coef, lam

  dq, dk, coef, lam = pl.run_scoped(with_accs, plgpu.ACC((c, d), F32), plgpu.ACC((c, d), F32))

  def store(dq_s, dk_s, coef_s, lam_s):
    dq_s[...] = dq
    dk_s[...] = dk
    coef_s[...] = coef
    lam_s[...] = lam
    plgpu.commit_smem()
    for src, dst in ((dq_s, dq_g), (dk_s, dk_g), (coef_s, coef_g), (lam_s, lam_g)):
      plgpu.copy_smem_to_gmem(src, dst.at[i, n])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(store, *outs)


def value_pass(q, k, v, do, u, drhs, states, dstates, f, *, scale, erase, block_v, stages=None,
               e_offset=0, interpret=False):
  """The Mosaic GPU kernel over the slices e_offset .. e_offset + G - 1 of ``states`` and
  ``dstates`` (BH, NC, E, D, V), G given by the factor rows ``f`` (BH, NC, 3G + 1, C) of those
  slices. Returns X_G = V - sum over those slices (erase only, else None), dq and dk partials
  (BH,NC,C,D), the row-sum matrix (BH,NC,C,32; columns [dcoef, dqcoef, dkcoef] of the G slices)
  and the dlam row partials (BH,NC,D,8), all float32. ``stages``: state staging buffers (1 or 2;
  None: ``default_stages``)."""
  bh, nc, c, d = q.shape
  vd, e_dim = v.shape[-1], (f.shape[2] - 1) // 3
  bv = block_v
  stages = stages or default_stages(d, vd, c, e_dim, bv)
  n_cat = e_dim * bv
  sw = _swizzle(bv)
  scratch = [
      _smem((c, d), BF16, sw),                      # q
      _smem((c, d), BF16, sw),                      # k
      _smem((3 * e_dim + 1, c), F32),               # factor rows
      _smem((e_dim, d, bv), BF16, sw),              # staging: S (and dS if stages == 1)
      _smem((d, n_cat), BF16, sw),                  # S_cat
      _smem((d, n_cat), BF16, sw),                  # dS_cat
      _smem((c, n_cat), BF16, sw),                  # W2 = [fw U]_e
      _smem((c, n_cat), BF16, sw),                  # W3 = [scale fq dO]_e
      _smem((c, bv), BF16, sw),                     # V block
      _smem((c, bv), BF16, sw),                     # dO block
      _smem((c, bv), F32, _swizzle(bv, F32)),       # U block
      _smem((c, bv), F32, _swizzle(bv, F32)),       # drhs block
  ]
  if stages == 2:
    scratch += [_smem((e_dim, d, bv), BF16, sw)]    # staging: dS
  if erase:
    scratch += [_smem((c, n_cat), BF16, sw),        # W1 = [-c dX]_e
                _smem((c, bv), F32, _swizzle(bv, F32))]   # X block
  if interpret:                                     # explicit S_cat^T, dS_cat^T (interpreter)
    scratch += [_smem((n_cat, d), BF16, sw), _smem((n_cat, d), BF16, sw)]
  outs = [_smem((c, d), F32, _swizzle(d, F32)), _smem((c, d), F32, _swizzle(d, F32)),
          _smem((c, COEF_W), F32, _swizzle(COEF_W, F32)),
          _smem((d, LAM_W), F32, _swizzle(LAM_W, F32))]
  out_type = ([jax.ShapeDtypeStruct((bh, nc, c, vd), F32)] if erase else []) + [
      jax.ShapeDtypeStruct((bh, nc, c, d), F32), jax.ShapeDtypeStruct((bh, nc, c, d), F32),
      jax.ShapeDtypeStruct((bh, nc, c, COEF_W), F32),
      jax.ShapeDtypeStruct((bh, nc, d, LAM_W), F32)]
  kernel = functools.partial(
      _value_kernel, scratch=scratch, outs=outs, c=c, d=d, e_dim=e_dim, e_offset=e_offset, bv=bv,
      nv=vd // bv,
      piece=piece_width(d, e_dim, bv), stages=stages, scale=scale, erase=erase,
      interpret=bool(interpret))
  res = plgpu.kernel(
      kernel, out_type=out_type, scratch_types=[plgpu.Barrier(num_barriers=7 + 2 * e_dim)],
      grid=(bh, nc), grid_names=("bh", "n"), compiler_params=plgpu.CompilerParams(),
      interpret=_interpret_params(interpret), kernel_name="triadic_chunk_backward_mgpu",
  )(q, k, v, do, u, drhs, states, dstates, f)
  return (res[0] if erase else None), *res[-4:]


# ------------------------------------------------------------------------------------------------
# The slice kernel: the same outputs as the value kernel's passes (minus X), one slice at a time.

PIECE = 64                    # state rows (D) per stream item: the C x PIECE accumulators


def slice_kernel_smem(d: int, vd: int, c: int, e: int, erase: bool = True) -> int:
  """SMEM of the slice kernel's main scope on hardware (the row sums leave from a smaller one)."""
  return (2 * c * d * 2                           # K, Q
          + (3 if erase else 2) * c * vd * 2      # dX, dO, U
          + 2 * 2 * PIECE * vd * 2                # two slots of (S_e, dS_e) row pieces
          + 2 * c * d * 4                         # dq, dk (float32)
          + (3 * e + 1) * c * 4)                  # factor rows


# The slice kernel is the default up to this E; above it the value kernel (measured at D = V = 128:
# benchmarks/RESULTS.md).
SLICE_KERNEL_MAX_E = 4


def slice_kernel_reason(requested: bool | None, d: int, vd: int, c: int, e: int, dtype
                        ) -> str | None:
  """Why the chunk-parallel backward does not take the slice kernel, or None if it does, for
  ``Config.slice_kernel`` = ``requested``: None takes it where it runs
  (``slice_kernel_supported``) and E <= SLICE_KERNEL_MAX_E, True wherever it runs."""
  if requested is not None and not requested:
    return "Config.slice_kernel off"
  if requested is None and e > SLICE_KERNEL_MAX_E:
    return f"E > {SLICE_KERNEL_MAX_E}, where the value kernel is faster"
  return slice_kernel_supported(d, vd, c, e, dtype)


def default_slice_kernel(d: int, vd: int, c: int, e: int, dtype) -> bool:
  """Whether the chunk-parallel backward takes the slice kernel by default
  (``slice_kernel_reason`` with ``Config.slice_kernel`` None)."""
  return slice_kernel_reason(None, d, vd, c, e, dtype) is None


def slice_kernel_supported(d: int, vd: int, c: int, e: int, dtype, erase: bool = True
                           ) -> str | None:
  """Why ``slices_pass`` cannot take these sizes, or None if it can."""
  what = "the Mosaic GPU slice kernel"
  if jnp.dtype(dtype) != jnp.dtype(BF16):
    return f"{what} takes bfloat16 inputs only, got {jnp.dtype(dtype).name}"
  if c != 64:
    return f"{what} needs chunk size 64, got {c}"
  if d not in (64, 128):
    return f"{what} needs D in (64, 128), got {d}"
  if e > MAX_E:
    return f"{what} takes E <= {MAX_E}, got {e}"
  if vd not in (32, 64, 128):
    return f"{what} needs V in (32, 64, 128), got {vd}"
  need = slice_kernel_smem(d, vd, c, e, erase)
  if need > SMEM_LIMIT:
    return f"{what} needs {need} B of SMEM > {SMEM_LIMIT} B"
  return None


def _slice_kernel(q_g, k_g, dx_g, do_g, u_g, s_g, ds_g, f_g, dq_g, dk_g, coef_g, lam_g, bars,
                  done, *, scratch, outs, c, d, e_dim, scale, erase, wgs, interpret):
  ops = _Ops(interpret)
  i, n = lax.axis_index("bh"), lax.axis_index("n")
  erase_rows, read_rows, write_rows = 0, e_dim, 2 * e_dim
  n_pieces = d // PIECE
  # The pieces (64-row blocks of the state, 64-column blocks of dq, dk, K, Q) a warpgroup owns:
  # all of them with one warpgroup, piece w for warpgroup w with two.
  w = lax.axis_index("wg") if wgs == 2 else 0
  pieces = [w] if wgs == 2 else list(range(n_pieces))
  # The stream of a warpgroup: item j = rows of piece pieces[j // E] of S_e and dS_e, e = j % E,
  # piece-major, so that only that piece's dq, dk columns are live; slot = j % 2. Up to
  # SLICE_KERNEL_MAX_E slices the items are unrolled; above it they are a loop per piece, which
  # keeps the compiler from holding several items' values (registers) at once.
  n_items = len(pieces) * e_dim
  loop = e_dim > SLICE_KERNEL_MAX_E
  # Barriers: 0 .. 2P + 3 the P pieces of q and of k, the factors, dO, U, dX (copied by
  # warpgroup 0, waited by all); then per warpgroup 2 slot: S rows, 2 slot + 1: dS rows.
  firsts = 2 * n_pieces + 4
  bar_s = firsts + 4 * w

  def piece_of(j):
    return w if wgs == 2 else j // e_dim

  onehot_add = functools.partial(_onehot_add, ops)

  def main(q_s, k_s, f_s, dx_s, do_s, u_s, s_s, ds_s, *interp):
    s_s, ds_s = s_s.at[w], ds_s.at[w]           # this warpgroup's two slots
    interp = [x.at[w] for x in interp]

    def load_item(j):
      h, e, slot = piece_of(j), j % e_dim, j % 2
      rows = pl.ds(h * PIECE, PIECE)
      plgpu.copy_gmem_to_smem(s_g.at[i, n, e, rows, :], s_s.at[slot], bars.at[bar_s + 2 * slot])
      plgpu.copy_gmem_to_smem(ds_g.at[i, n, e, rows, :], ds_s.at[slot],
                              bars.at[bar_s + 2 * slot + 1])

    def load_firsts():
      cols = lambda h: pl.ds(h * PIECE, PIECE)
      pairs = ([(q_g.at[i, n, :, cols(h)], q_s.at[h]) for h in range(n_pieces)]
               + [(k_g.at[i, n, :, cols(h)], k_s.at[h]) for h in range(n_pieces)]
               + [(f_g.at[i, n], f_s), (do_g.at[i, n], do_s), (u_g.at[i, n], u_s)]
               + ([(dx_g.at[i, n], dx_s)] if erase else []))
      _load(pairs, bars)

    if wgs == 2:
      pl.when(w == 0)(load_firsts)
    else:
      load_firsts()
    for j in range(min(2, n_items)):
      load_item(j)
    _wait(firsts - (0 if erase else 1), bars)

    def transposed(ref, slot):
      """ref[slot]^T (V x PIECE) as a wgmma B operand."""
      if interpret:
        return interp[0 if ref is s_s else 1]
      return plgpu.transpose_ref(ref.at[slot], (1, 0))

    rows_iota = lambda dim: ops.acc(lax.broadcasted_iota(jnp.int32, (PIECE, PIECE), dim))

    def item(h, e, carry):
      """Item (h, e): rows h * PIECE.. of S_e and dS_e. ``e`` is a Python int (unrolled) or
      traced (``lax.fori_loop``), ``h`` an int or the warpgroup's index."""
      dq, dk, coef, lam = carry
      j = (h if wgs == 1 else 0) * e_dim + e
      slot = j % 2
      plgpu.barrier_wait(bars.at[bar_s + 2 * slot])
      if interpret:                     # explicit transposes (the interpreter has no transpose_ref)
        interp[0][...] = s_s[slot].T
      if erase:
        p1 = ops.mm(dx_s, transposed(s_s, slot))             # dX S_e[rows]^T
        kh = ops.acc(k_s[h].astype(F32))
        coef = onehot_add(coef, -jnp.sum(kh * p1, axis=1), e)
        dk = dk - ops.rowvec(f_s, erase_rows + e, PIECE) * p1
      p2 = ops.mm(do_s, transposed(s_s, slot))               # dO S_e[rows]^T
      qh = ops.acc(q_s[h].astype(F32))
      coef = onehot_add(coef, scale * jnp.sum(qh * p2, axis=1), e_dim + e)
      dq = dq + (scale * ops.rowvec(f_s, read_rows + e, PIECE)) * p2
      plgpu.barrier_wait(bars.at[bar_s + 2 * slot + 1])
      if interpret:
        interp[1][...] = ds_s[slot].T
      p3 = ops.mm(u_s, transposed(ds_s, slot))               # U dS_e[rows]^T
      kh = ops.acc(k_s[h].astype(F32))
      coef = onehot_add(coef, jnp.sum(kh * p3, axis=1), 2 * e_dim + e)
      dk = dk + ops.rowvec(f_s, write_rows + e, PIECE) * p3
      # <dS_e, S_e> over these rows: the diagonal of S_e[rows] dS_e[rows]^T.
      g = ops.mm(s_s.at[slot], transposed(ds_s, slot))
      lam = onehot_add(lam, jnp.sum(jnp.where(rows_iota(0) == rows_iota(1), g, 0.0), axis=1), e)

      def next_copy():
        plgpu.commit_smem()             # every wgmma and register read of this slot is done
        load_item(j + 2)

      if isinstance(j, int):
        if j + 2 < n_items:
          next_copy()
      else:
        pl.when(j + 2 < n_items)(next_copy)
      return dq, dk, coef, lam

    coef = ops.acc(jnp.zeros((c, COEF_W), F32))
    lam = ops.acc(jnp.zeros((PIECE, LAM_W), F32))
    dqs, dks = [], []
    for h in pieces:
      carry = (ops.acc(jnp.zeros((c, PIECE), F32)), ops.acc(jnp.zeros((c, PIECE), F32)), coef,
               lam)
      if loop:
        carry = lax.fori_loop(0, e_dim, functools.partial(item, h), carry)
      else:
        for e in range(e_dim):
          carry = item(h, e, carry)
      dq, dk, coef, lam = carry
      dqs.append(dq)
      dks.append(dk)
    if wgs == 2:                        # both warpgroups are done with the scope's buffers
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
    return dqs, dks, coef, lam

  dqs, dks, coef, lam = pl.run_scoped(main, *scratch, collective_axes=("wg",) * (wgs == 2))

  def store(dq_s, dk_s, coef_s, lam_s):
    for h, dq, dk in zip(pieces, dqs, dks):
      dq_s[h] = dq
      dk_s[h] = dk
    coef_s.at[w][...] = coef
    lam_s.at[w][...] = lam
    plgpu.commit_smem()
    for h in pieces:
      cols = pl.ds(h * PIECE, PIECE)
      plgpu.copy_smem_to_gmem(dq_s.at[h], dq_g.at[i, n, :, cols])
      plgpu.copy_smem_to_gmem(dk_s.at[h], dk_g.at[i, n, :, cols])
    plgpu.copy_smem_to_gmem(coef_s.at[w], coef_g.at[i, n, w])
    plgpu.copy_smem_to_gmem(lam_s.at[w], lam_g.at[i, n, w])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(store, *outs, collective_axes=("wg",) * (wgs == 2))


def slice_warpgroups_supported(d: int) -> str | None:
  """None if the slice kernel takes two warpgroups (one per 64-row piece) at this D, else why
  not."""
  return None if d == 2 * PIECE else f"two warpgroups need D = {2 * PIECE}, got {d}"


def slice_warpgroups(requested: int, d: int) -> int:
  """The slice kernel's warpgroups for ``Config.slice_warpgroups``: 2 where asked and
  ``slice_warpgroups_supported``, else 1."""
  return 2 if requested == 2 and slice_warpgroups_supported(d) is None else 1


def slices_pass(q, k, dx, do, u, states, dstates, f, *, scale, erase, warpgroups=1,
                interpret=False):
  """The Mosaic GPU slice kernel ``triadic_chunk_backward_slices`` (grid (B*H, NC)). Per chunk it
  streams the state slices in pieces of 64 rows (item (h, e): rows h*64.. of S_e and dS_e, two
  slots, the next item's copies in flight while one is used, piece-major so that only that
  piece's dq, dk columns are live), and per item takes the products over V

    P1 = dX S_e[rows]^T (erase), P2 = dO S_e[rows]^T, P3 = U dS_e[rows]^T      (C x V)(V x 64)

  which give the dq / dk columns (dk -= diag(c_e) P1, dq += scale diag(fq_e) P2,
  dk += diag(fw_e) P3, summed in registers) and the row sums at once (dcoef_e -= rowsum(K * P1),
  dqcoef_e += scale rowsum(Q * P2), dkcoef_e += rowsum(K * P3), K and Q the piece's columns);
  dlam_e += the trace of S_e[rows] dS_e[rows]^T (its diagonal, summed over the item's rows). The
  states are wgmma operands straight from their copies (no register pass), each byte read once;
  X is not formed here (the forward saves it). ``warpgroups``: 1, or 2 at D = 128, each owning
  one piece with its own stream and slots (``slice_warpgroups_supported``).
  Operands: q, k (BH,NC,C,D), dX = beta A^T dU, dO, U (BH,NC,C,V), all bf16; the states
  (BH,NC,E,D,V) bf16; the factor rows f (BH,NC,3E+1,C) float32 (``factor_rows``). Returns dq, dk
  partials (BH,NC,C,D), the row-sum matrix (BH,NC,C,32) and dlam partials (BH,NC,64,8), float32."""
  bh, nc, c, d = q.shape
  vd, e_dim = do.shape[-1], (f.shape[2] - 1) // 3
  if warpgroups not in (1, 2) or (warpgroups == 2 and slice_warpgroups_supported(d)):
    raise ValueError(f"warpgroups must be 1, or 2 at D = {2 * PIECE}; got {warpgroups} at D={d}")
  n_pieces = d // PIECE
  sw = _swizzle(min(vd, 64))
  sk = _swizzle(min(d, 64))
  scratch = [
      _smem((n_pieces, c, PIECE), BF16, sk),        # q, by 64-column pieces
      _smem((n_pieces, c, PIECE), BF16, sk),        # k
      _smem((3 * e_dim + 1, c), F32),               # factor rows
      _smem((c, vd), BF16, sw),                     # dX
      _smem((c, vd), BF16, sw),                     # dO
      _smem((c, vd), BF16, sw),                     # U
      _smem((warpgroups, 2, PIECE, vd), BF16, sw),  # S_e row pieces, two slots per warpgroup
      _smem((warpgroups, 2, PIECE, vd), BF16, sw),  # dS_e row pieces
  ]
  if interpret:                                     # explicit S^T, dS^T (interpreter)
    scratch += [_smem((warpgroups, vd, PIECE), BF16, sw)] * 2
  outs = [_smem((n_pieces, c, PIECE), F32, _swizzle(PIECE, F32)),     # dq
          _smem((n_pieces, c, PIECE), F32, _swizzle(PIECE, F32)),     # dk
          _smem((warpgroups, c, COEF_W), F32, _swizzle(COEF_W, F32)),
          _smem((warpgroups, PIECE, LAM_W), F32, _swizzle(LAM_W, F32))]
  out_type = [jax.ShapeDtypeStruct((bh, nc, c, d), F32), jax.ShapeDtypeStruct((bh, nc, c, d), F32),
              jax.ShapeDtypeStruct((bh, nc, warpgroups, c, COEF_W), F32),
              jax.ShapeDtypeStruct((bh, nc, warpgroups, PIECE, LAM_W), F32)]
  kernel = functools.partial(_slice_kernel, scratch=scratch, outs=outs, c=c, d=d, e_dim=e_dim,
                             scale=scale, erase=erase, wgs=warpgroups, interpret=bool(interpret))
  threads = dict(num_threads=2, thread_name="wg") if warpgroups == 2 else {}
  dqp, dkp, coef, lam = plgpu.kernel(
      kernel, out_type=out_type,
      scratch_types=[plgpu.Barrier(num_barriers=2 * n_pieces + 4 + 4 * warpgroups),
                     plgpu.Barrier(num_arrivals=warpgroups)],
      grid=(bh, nc), grid_names=("bh", "n"), compiler_params=plgpu.CompilerParams(),
      interpret=_interpret_params(interpret), kernel_name="triadic_chunk_backward_slices",
      **threads,
  )(q, k, dx, do, u, states, dstates, f)
  return dqp, dkp, jnp.sum(coef, axis=2), jnp.sum(lam, axis=2)


def x_from_states(k, v, states, k2_col, gc_col):
  """X = V - sum_e diag(k2_e exp(gc_e)) K S_e (BH,NC,C,V) float32 in plain JAX: the slice
  kernel's X when the forward did not save it (its state passes not the Mosaic ones)."""
  ks = jnp.einsum("bncd,bnedv->bnecv", k, states.astype(k.dtype), preferred_element_type=F32)
  coef = k2_col * jnp.exp(gc_col)
  return v.astype(F32) - jnp.einsum("bnce,bnecv->bncv", coef, ks)


# ------------------------------------------------------------------------------------------------
# The tail: E-independent products over the whole V, the UT-transform gradient and dM', dM; the
# masks M, M' come in from plain JAX (``masks.decay_masks``) and dM', dM go out to plain JAX
# (``masks.mask_grads``), which turns them into dk2, dq2 and d gc.


def _value_products(x_ref, do_ref, u_ref, du_ref, dr_ref, beta, *, c, vd, bv, scale, erase,
                    dtype):
  """The tail's products over V, accumulated over blocks of ``bv`` value columns (a loop Triton
  pipelines, so no C x V operand is held whole): dbeta's X part rowsum(drhs X) (C, 1),
  dP = scale dO U^T and (erase) dA = dU (beta X)^T (C, C; zeros without erase)."""

  def vblock(cols, carry):
    dbeta, dp, da = carry
    x = x_ref[:, cols].astype(F32)
    dbeta = dbeta + rowsum(dr_ref[:, cols] * x)
    dp = dp + scale * mm(do_ref[:, cols], u_ref[:, cols], dtype, tb=True)
    if erase:
      da = da + mm(du_ref[:, cols], beta * x, dtype, tb=True)
    return dbeta, dp, da

  carry = (jnp.zeros((c, 1), F32), jnp.zeros((c, c), F32), jnp.zeros((c, c), F32))
  if bv == vd:
    return vblock(slice(None), carry)
  return jax.lax.fori_loop(0, vd // bv, lambda j, cr: vblock(pl.ds(j * bv, bv), cr), carry)


def _tail_ut_kernel(q_ref, k_ref, x_ref, do_ref, u_ref, du_ref, dr_ref, dqp_ref, dkp_ref, mq_ref,
                    *rest, c, vd, bv, scale, erase, dtype, precision):
  if erase:
    m_ref, beta_ref, a_ref, dq_ref, dk_ref, dbeta_ref, dmq_ref, dm_ref = rest
  else:
    beta_ref, a_ref, dq_ref, dk_ref, dbeta_ref, dmq_ref = rest
  q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
  beta = beta_ref[...].astype(F32)
  dbeta, dp, da = _value_products(x_ref, do_ref, u_ref, du_ref, dr_ref, beta, c=c, vd=vd, bv=bv,
                                  scale=scale, erase=erase, dtype=dtype)
  dp, dmq, dl, dlkk, dm = ut_before(q, k, dp, da if erase else None, beta, a_ref[...], c=c,
                                    erase=erase, dtype=dtype, precision=precision)
  dq, dk, dbeta = ut_after(q, k, dqp_ref[...], dkp_ref[...], dbeta, dp, dl, dlkk, mq_ref[...],
                           m_ref[...] if erase else None, beta, erase=erase, dtype=dtype)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dbeta_ref[...] = dbeta
  dmq_ref[...] = dmq
  if erase:
    dm_ref[...] = dm


def _fused_tail_kernel(q_ref, k_ref, x_ref, do_ref, u_ref, du_ref, dr_ref, dqp_ref, dkp_ref,
                       dcoef_ref, dqcoef_ref, dkcoef_ref, dlam_ref, k2_col, k2_row, q2_col, gc_col,
                       gc_row, beta_ref, a_ref, *outs, c, vd, bv, e_dim, scale, erase, dtype,
                       precision):
  q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
  beta = beta_ref[...].astype(F32)
  dbeta, dp, da = _value_products(x_ref, do_ref, u_ref, du_ref, dr_ref, beta, c=c, vd=vd, bv=bv,
                                  scale=scale, erase=erase, dtype=dtype)
  coefs = [[col(r, e) for e in range(e_dim)] for r in (dcoef_ref, dqcoef_ref, dkcoef_ref)]
  dlam = [dlam_ref[:, pl.ds(e, 1)] for e in range(e_dim)]
  chunk_local(q, k, lambda: (dqp_ref[...], dkp_ref[...]), dp, da if erase else None, dbeta,
              *coefs, dlam, k2_col, k2_row, q2_col, gc_col, gc_row, beta, a_ref[...], outs, c=c,
              e_dim=e_dim, erase=erase, dtype=dtype, precision=precision)


def _tail_blocks(bh, nc, vd, cfg):
  """The tails' value block (``cfg.bwd_block_v``, checked to divide V), per-chunk BlockSpec and
  (BH, NC, ...) output shape makers."""
  bv = min(cfg.bwd_block_v, vd)
  if vd % bv:
    raise ValueError(f"the tail's bwd_block_v must divide V = {vd}, got {bv}")
  spec = lambda *s: pl.BlockSpec((None, None, *s), lambda i, j: (i, j) + (0,) * len(s))
  shape = lambda *s, dt=F32: jax.ShapeDtypeStruct((bh, nc, *s), dt)
  return bv, spec, shape


def tail_kernel(q, k, x, do, u, du, drhs, dqp, dkp, mq, m, beta_col, a, *, scale, erase, cfg):
  """The E-independent tail kernel ``triadic_chunk_backward_tail_ut``: the products over V
  (dbeta's X part, dA, dP) accumulated over blocks of ``cfg.bwd_block_v`` value columns (the
  loop Triton pipelines, so that no C x V operand is held whole), then ``backward.ut_before`` /
  ``ut_after`` with M' and M (None without erase) given.
  Returns dq, dk (BH,NC,C,D) in q's dtype (the op's gradients are cast to it next), float32
  dbeta (C,1), dM' (C,C) and dM (C,C; erase only, else None)."""
  bh, nc, c, d = q.shape
  vd = x.shape[-1]
  bv, spec, shape = _tail_blocks(bh, nc, vd, cfg)
  kernel = functools.partial(_tail_ut_kernel, c=c, vd=vd, bv=bv, scale=scale, erase=erase,
                             dtype=q.dtype, precision=cfg.f32_precision)
  n_mm = 2 if erase else 1
  res = call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[spec(c, d), spec(c, d), spec(c, vd), spec(c, vd), spec(c, vd), spec(c, vd),
                spec(c, vd), spec(c, d), spec(c, d)] + [spec(c, c)] * n_mm
               + [spec(c, 1), spec(c, c)],
      out_specs=[spec(c, d), spec(c, d), spec(c, 1)] + [spec(c, c)] * n_mm,
      out_shape=[shape(c, d, dt=q.dtype), shape(c, d, dt=q.dtype), shape(c, 1)]
                + [shape(c, c)] * n_mm,
      semantics=("parallel", "parallel"), name="triadic_chunk_backward_tail_ut",
      num_warps=cfg.bwd_num_warps,
  )(q, k, x, do, u, du, drhs, dqp, dkp, mq, *((m,) if erase else ()), beta_col, a)
  return (*res, None) if not erase else tuple(res)


def fused_tail_kernel(q, k, x, do, u, du, drhs, dqp, dkp, dcoef, dqcoef, dkcoef, dlam, k2_col,
                      k2_row, q2_col, gc_col, gc_row, beta_col, a, *, scale, erase, cfg):
  """Everything after the value kernel in one Pallas kernel ``triadic_chunk_backward_tail_fused``
  (grid (B*H, NC)): ``_value_products``, then ``backward.chunk_local``, which builds M, M' and
  the per-slice mask gradients in the kernel, one slice's C x C decay mask live at a time. Same
  operands and outputs as ``tail``; for small E, where those per-slice C x C terms fit in
  registers, it saves ``tail``'s four C x C float32 matrices per chunk through HBM and the plain
  JAX around it."""
  bh, nc, c, d = q.shape
  vd, e_dim = x.shape[-1], k2_col.shape[-1]
  bv, spec, shape = _tail_blocks(bh, nc, vd, cfg)
  kernel = functools.partial(_fused_tail_kernel, c=c, vd=vd, bv=bv, e_dim=e_dim, scale=scale,
                             erase=erase, dtype=q.dtype, precision=cfg.f32_precision)
  cols, rows = spec(c, e_dim), spec(e_dim, c)
  return call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[spec(c, d), spec(c, d)] + [spec(c, vd)] * 5 + [spec(c, d), spec(c, d)]
               + [cols] * 3 + [spec(1, e_dim), cols, rows, cols, cols, rows, spec(c, 1),
                               spec(c, c)],
      out_specs=[spec(c, d), spec(c, d), cols, rows, cols, cols, rows, spec(c, 1)],
      out_shape=[shape(c, d, dt=q.dtype), shape(c, d, dt=q.dtype), shape(c, e_dim),
                 shape(e_dim, c), shape(c, e_dim), shape(c, e_dim), shape(e_dim, c),
                 shape(c, 1)],
      semantics=("parallel", "parallel"), name="triadic_chunk_backward_tail_fused",
      num_warps=cfg.bwd_num_warps,
  )(q, k, x, do, u, du, drhs, dqp, dkp, dcoef, dqcoef, dkcoef, dlam[:, :, None, :], k2_col,
    k2_row, q2_col, gc_col, gc_row, beta_col, a)


# The tail's Triton tiles, fused (True) and split (False); measured, benchmarks/RESULTS.md.
TAIL_TILES = {True: {"bwd_block_v": 64, "bwd_num_warps": 4, "num_stages": 2},
              False: {"bwd_block_v": 64, "bwd_num_warps": 8, "num_stages": 2}}


def tail_config(interpret: bool, fused: bool = False, **tiles) -> Config:
  """The tail kernel's Pallas config: Triton on the GPU with ``TAIL_TILES[fused]`` (overridden by
  ``tiles``), interpret mode on the CPU."""
  if interpret:
    return Config("cpu", block_v=16, bwd_block_v=tiles.get("bwd_block_v", 16))
  return Config("gpu", block_v=32, **{**TAIL_TILES[fused], **tiles})


FUSED_TAIL_MAX_E = 2


def default_fused_tail(e: int) -> bool:
  """Whether the tail runs as one kernel (``fused_tail_kernel``: E <= FUSED_TAIL_MAX_E, where its
  per-slice C x C terms fit in registers; measured, benchmarks/RESULTS.md) or as the
  E-independent ``tail_kernel`` between the plain-JAX masks and mask gradients."""
  return e <= FUSED_TAIL_MAX_E


def tail(q, k, x, do, u, du, drhs, dqp, dkp, dcoef, dqcoef, dkcoef, dlam, k2_col, k2_row, q2_col,
         gc_col, gc_row, beta_col, a, *, scale, erase, cfg, fused):
  """Everything after the value kernel. ``fused``: ``fused_tail_kernel``; else the masks M, M'
  (plain JAX), the E-independent tail kernel, and the per-slice mask gradients (plain JAX).
  ``dcoef``, ``dqcoef``, ``dkcoef`` (BH,NC,C,E) and ``dlam`` (BH,NC,E) are the value kernel's row
  sums. Returns dq, dk (BH,NC,C,D) in q's dtype and, float32, dk2 column (C,E) and row (E,C)
  parts, dq2 (C,E), d gc column and row parts and dbeta (C,1)."""
  if fused:
    return tuple(fused_tail_kernel(q, k, x, do, u, du, drhs, dqp, dkp, dcoef, dqcoef, dkcoef,
                                   dlam, k2_col, k2_row, q2_col, gc_col, gc_row, beta_col, a,
                                   scale=scale, erase=erase, cfg=cfg))
  m, mq = masks.decay_masks(k2_col, k2_row, q2_col, gc_col, gc_row, erase=erase)
  dq, dk, dbeta, dmq, dm = tail_kernel(q, k, x, do, u, du, drhs, dqp, dkp, mq, m, beta_col, a,
                                       scale=scale, erase=erase, cfg=cfg)
  dk2_col, dk2_row, dq2_col, dgc_col, dgc_row = masks.mask_grads(
      dmq, dm, dcoef, dqcoef, dkcoef, dlam, k2_col, k2_row, q2_col, gc_col, gc_row, erase=erase)
  return dq, dk, dk2_col, dk2_row, dq2_col, dgc_col, dgc_row, dbeta


def default_value_slices(d: int, vd: int, c: int, e: int) -> int:
  """Slices per value-kernel pass: the largest divisor G of E (G <= MAX_E) at which some block_v
  fits two staging buffers (``default_stages``), else the largest divisor that fits at all. Each
  pass re-reads the E-independent inputs (K, Q, V, dO, U, drhs), so fewer passes are better
  unless a pass would lose its load pipeline."""
  divisors = [g for g in range(min(e, MAX_E), 0, -1) if e % g == 0]
  for need_two in (True, False):
    for g in divisors:
      bv = default_block_v(d, vd, c, g)
      if bv and (not need_two or default_stages(d, vd, c, g, bv) == 2):
        return g
  return 1


def chunk_gradients(q, k, v, do, u, du, states, dstates, k2_col, k2_row, q2_col, gc_col, gc_row,
                    beta_col, a, x=None, *, scale, erase, slice_kernel=None, slice_warpgroups=1,
                    block_v=None, stages=None, value_slices=None, fused_tail=None,
                    interpret=False):
  """``backward.chunk_gradients`` on Hopper: same operands (layout (BH, NC, ...)), same outputs
  (dq, dk (BH,NC,C,D) in q's dtype, the rest float32): dv (BH,NC,C,V), dk2 column and row parts
  ((C,E), (E,C)), dq2 (C,E), d gc column and row parts, dbeta (C,1).

  The E-dependent part runs as the slice kernel (``slices_pass``; ``slice_kernel`` None:
  ``default_slice_kernel``) or as the value kernel, once per group of
  ``value_slices`` slices (default ``default_value_slices``; its outputs are sums or per-slice
  columns, so the groups' results add up: X = V - sum_e ..., one V per extra group taken back).
  ``x`` (erase only): X = V - sum_e diag(c_e) K S_e as the forward saved it, which the slice
  kernel needs (without it, ``x_from_states`` forms it in plain JAX); the value kernel forms X
  itself. ``slice_warpgroups``: the slice kernel's warpgroups (``slices_pass``).
  ``fused_tail``: the tail as one kernel (None: ``default_fused_tail``).
  ``interpret=True``: Mosaic GPU interpret mode for the value kernel and Pallas interpret mode
  for the tail (CPU tests)."""
  bh, nc, c, d = q.shape
  vd, e_dim = v.shape[-1], k2_col.shape[-1]
  if slice_kernel is None:
    slice_kernel = default_slice_kernel(d, vd, c, e_dim, q.dtype)
  reason = (slice_kernel_supported(d, vd, c, e_dim, q.dtype, erase) if slice_kernel else
            supported(d, vd, c, e_dim, q.dtype, block_v, stages, value_slices))
  if reason:
    raise ValueError(reason)
  beta = beta_col.astype(F32)
  drhs = rhs_gradient(a, du, erase)
  dv = beta * drhs
  low = lambda y: y.astype(q.dtype)
  if slice_kernel:
    f = factor_rows(gc_col, k2_col, q2_col, beta_col)
    dqp, dkp, coef, lam = slices_pass(q, k, low(dv), low(do), low(u), low(states), low(dstates),
                                      f, scale=scale, erase=erase,
                                      warpgroups=slice_warpgroups, interpret=interpret)
    if not erase:
      x = v
    elif x is None:
      x = x_from_states(k, v, states, k2_col, gc_col)
    dcoef, dqcoef, dkcoef = (coef[..., j * e_dim:(j + 1) * e_dim] for j in range(3))
    dlam = jnp.sum(lam, axis=2)[..., :e_dim]          # (BH, NC, E): the sum over the rows
  else:
    x, dqp, dkp, dcoef, dqcoef, dkcoef, dlam = _value_passes(
        q, k, v, do, u, drhs, states, dstates, k2_col, q2_col, gc_col, beta_col, scale=scale,
        erase=erase, block_v=block_v, stages=stages, value_slices=value_slices,
        interpret=interpret)
  # The tail kernel's products over V take bf16 operands anyway (``mm``), so its C x V inputs
  # travel in the inputs' dtype (half the kernel's traffic; dbeta's rowsum(drhs X) then sees
  # bf16-rounded factors, summed in float32).
  fused = default_fused_tail(e_dim) if fused_tail is None else fused_tail
  dq, dk, dk2_col, dk2_row, dq2_col, dgc_col, dgc_row, dbeta = tail(
      q, k, low(x), do, low(u), low(du), low(drhs), dqp, dkp, dcoef, dqcoef, dkcoef, dlam,
      k2_col, k2_row, q2_col, gc_col, gc_row, beta_col, a, scale=scale, erase=erase,
      cfg=tail_config(interpret, fused), fused=fused)
  return dq, dk, dv, dk2_col, dk2_row, dq2_col, dgc_col, dgc_row, dbeta


def _value_passes(q, k, v, do, u, drhs, states, dstates, k2_col, q2_col, gc_col, beta_col, *,
                  scale, erase, block_v, stages, value_slices, interpret):
  """The value kernel over groups of slices: X (float32), dq and dk partials, the row sums
  dcoef, dqcoef, dkcoef (BH,NC,C,E) and dlam (BH,NC,E)."""
  d, vd, c, e_dim = q.shape[-1], v.shape[-1], q.shape[2], k2_col.shape[-1]
  size = value_slices or default_value_slices(d, vd, c, e_dim)
  bv = block_v or default_block_v(d, vd, c, size)
  v16, do16, u32 = v.astype(q.dtype), do.astype(q.dtype), u.astype(F32)
  s16, ds16 = states.astype(q.dtype), dstates.astype(q.dtype)
  xs, dqps, dkps, coefs, lams = [], [], [], [], []
  for e0 in range(0, e_dim, size):
    group = slice(e0, e0 + size)
    f = factor_rows(gc_col[..., group], k2_col[..., group], q2_col[..., group], beta_col)
    x, dqp, dkp, coef, lam = value_pass(
        q, k, v16, do16, u32, drhs, s16, ds16, f, scale=scale, erase=erase, block_v=bv,
        stages=stages, e_offset=e0, interpret=interpret)
    xs.append(x)
    dqps.append(dqp)
    dkps.append(dkp)
    coefs.append(coef)
    lams.append(jnp.sum(lam, axis=2)[..., :size])    # (BH, NC, G): the sum over the D rows
  x = v.astype(F32) if not erase else sum(xs) - (len(xs) - 1) * v.astype(F32)
  dcoef, dqcoef, dkcoef = (jnp.concatenate([cf[..., j * size:(j + 1) * size] for cf in coefs],
                                           axis=-1) for j in range(3))
  return x, sum(dqps), sum(dkps), dcoef, dqcoef, dkcoef, jnp.concatenate(lams, axis=-1)
