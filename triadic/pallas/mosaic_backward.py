"""Hopper (Mosaic GPU) chunk-parallel backward: a drop-in for ``backward.chunk_gradients`` (same
operands and outputs, minus ``cfg``, plus the forward's X), for bf16 inputs.

With c_e = k2_e a_e, fq_e = q2_e a_e, fw_e = k2_e b_e (a = exp(gc), b = exp(gc_C - gc)),
drhs = A^T dU, dX = beta drhs and X = V - sum_e diag(c_e) K S_e, the E-dependent part of the
chunk's gradients is, per slice e,

  dk += -diag(c_e) dX S_e^T + diag(fw_e) U dS_e^T        dcoef_e  -= rowsum(K * (dX S_e^T))
  dq += scale diag(fq_e) dO S_e^T                         dqcoef_e += scale rowsum(Q * (dO S_e^T))
  dlam_e += <dS_e, S_e>                                   dkcoef_e += rowsum(K * (U dS_e^T))

(the row sums equal rowsum((K S_e) * dX) etc.: contracting over V gives the dq / dk columns and
the row sums from the same three C x D products). What runs where:

* plain JAX before (E-independent, O(T V C)): drhs = A^T dU (bf16 operands, f32 accumulation, as
  the Triton kernel), dv = beta drhs, the per-row factor rows [c, fq, fw, beta] (O(T E)).
* the slice kernel ``triadic_chunk_backward_slices`` (``slices_pass``, grid (B*H, NC)):
  everything above, one state slice at a time. X comes from the Mosaic forward, which forms it
  anyway (``mosaic.state_pass(save_x=True)``, ``Plan.saves_x``), or from ``x_from_states`` in
  plain JAX.
* the E-independent Pallas (Triton on GPU, interpret on CPU) tail kernel
  ``triadic_chunk_backward_tail_ut`` (grid (B*H, NC)): dbeta's X part rowsum(drhs X),
  dA = dU (beta X)^T, dP = scale dO U^T (accumulated over blocks of value columns), then
  ``backward.ut_before`` / ``ut_after`` (dL = -A^T dA A^T with ``f32_precision``, TF32x3 on GPU;
  dq, dk from M and M', written in the inputs' dtype), writing dM' = dP * (Q K^T) and
  dM = dL * beta * (K K^T) (float32 C x C each); at small E (``default_fused_tail``) one kernel
  ``triadic_chunk_backward_tail_fused`` that also does the mask work below.
* around the tail (``masks.py``): M and M' before (plain JAX), and the per-slice gradients
  (dk2, dq2, d gc through exp(gc_t - gc_s)) after, by the kernel ``triadic_mask_grads``
  (``masks.mask_grads_kernel``, ``mask_grads_kernel=True``) or in plain JAX over all chunks at
  once, which XLA fuses into its reductions.

Layout: every operand is in the kernel layout (BH, NC, C, X) of ``ops.kernel_layout``, or, with
``heads=H`` (``chunk_gradients``, ``slices_pass``, ``tail`` and the tail kernels), q, k, v, dO
are in the caller's (B, T, H, X) (T = NC * C) and dq, dk, dv are returned in it, which saves the
op's relayout copies of those seven arrays (but V's without erase, below). Program (i, n) then
reads rows n*C.. of head i % H of batch i // H: the slice kernel as strided TMA boxes (q, k in
64-column pieces, dO whole), the tail kernels through block index maps with the head dim
squeezed (dq, dk written the same way); dv = beta drhs is written token-major by XLA from the
product (the slice kernel reads its bf16 kernel-layout copy as dX). X, U, dU, the states and
the per-slice rows keep the kernel layout; X is formed from the token-major k, v where the
forward did not save it (``x_from_states``), and without erase X = V is relayouted in plain JAX
(``head_major``).

How the slice kernel is built (idioms from ``mosaic.py``, imported: ``_smem``, ``_swizzle``,
``_Ops``, ``_interpret_params``, ``_chunk_box``):

* The stream. Per chunk the kernel reads K, Q (in 64-column pieces), dX, dO, U and the factor
  rows once, then streams the states in items of 64 state rows ("pieces", ``PIECE``): item
  (h, e) is rows h*64.. of S_e and of dS_e, one TMA each, into one of two slots, so the next
  item's copies are in flight while this one is used (``commit_smem`` after an item's last
  reader, then the copy two items ahead into its slot). Items are piece-major: only one piece's
  dq, dk columns (two C x 64 float32 accumulators) are live at a time, and they leave through
  SMEM when the piece is done. Up to ``UNROLL_MAX_E`` slices the items are unrolled; above it
  they run as a loop per piece, so that the compiler cannot hold several items' values in
  registers at once.
* Per item, three wgmmas over V, (C x V)(V x 64), with the state rows as the transposed B operand
  straight from their copy: P1 = dX S_e[rows]^T (erase only), P2 = dO S_e[rows]^T,
  P3 = U dS_e[rows]^T; the row sums are rowsum(K[:, rows] * P) (a sum over the pieces), placed in
  column e of a (C, 32) matrix by an iota one-hot (no 1-D carries, no cross-warp reductions);
  dlam_e gets the diagonal of S_e[rows] dS_e[rows]^T, a fourth 64 x 64 wgmma. Each state byte
  is read once.
* Two warpgroups at D = 128 (``slice_warpgroups``; one elsewhere): warpgroup w owns piece w, with
  its own stream and slots; K, Q, dX, dO, U and the factors are copied once by warpgroup 0 and
  waited by both, and each warpgroup writes its own row-sum and dlam partials (summed in plain
  JAX). Each then holds one piece's accumulators and products, which keeps every E within the
  registers (one warpgroup at D = 128 and large E spills).
* The transposed operands S_e[rows]^T, dS_e[rows]^T: on hardware ``plgpu.transpose_ref`` of the
  slot; the interpreter cannot apply a transposed ref, so in interpret mode each item also writes
  explicit transposes (SMEM that exists in interpret mode only). The hardware path of these
  operands is therefore checked only by the CUDA lowering test, not numerically on CPU.
* Ordering: ``commit_smem`` (fence + warpgroup barrier) after every register -> SMEM store that a
  wgmma or TMA reads and between a slot's last reader and the copy that refills it; each barrier
  has at most one copy in flight and is waited in issue order; no copy is in flight when the
  loop's SMEM scope ends (the copies two items ahead exist only while items remain); with two
  warpgroups a shared barrier marks both done before the scope's buffers are released. Outputs
  dq, dk, the row sums and dlam leave from a second SMEM scope.
* SMEM (``slice_kernel_smem``): K, Q 32 KiB, dX, dO, U 48, per warpgroup two slots of S, dS
  row pieces (64 KiB at V = 128) and the factor rows (growing with E): 214 KiB with two
  warpgroups at D = V = 128, E = 8. dq, dk (64 KiB) and the row sums leave from a second scope.
* float32 inputs are not supported (wgmma on float32 would be TF32; use the Triton path).

What the interpreter cannot check: the transpose_ref operands (above), swizzle / tiling
correctness of the register <-> SMEM copies, register pressure (spills), the real SMEM limit
(``slice_kernel_smem`` is an estimate; the CUDA lowering test checks the allocation), and races
that the ordering rules above are meant to exclude (the interpreter's race detector,
``InterpretGPUParams(detect_races=True)``, orders the warpgroups' reads and writes, but its TMA
copies complete at once, so a store's read of a buffer that a copy then refills is not
checked): ``benchmarks/triadic_kernels.py --check`` checks the kernels on a GPU against the
chunked form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from triadic.pallas import masks
from triadic.pallas.backward import chunk_local, coef_columns, ut_after, ut_before
from triadic.pallas.common import (F32, Config, call, check_heads, chunk_block, col_plus_row,
                                   head_major, mm, over_value_blocks, rowsum, token_block,
                                   token_major)
from triadic.pallas.mosaic import (SMEM_LIMIT, _chunk_box, _compiler_params, _Ops,
                                   _interpret_params, _load, _smem, _swizzle, _wait)

BF16 = jnp.bfloat16

COEF_W = 32                   # columns of the row-sum matrix: [dcoef, dqcoef, dkcoef] (3E <= 32)
LAM_W = 8                     # columns of the dlam matrix (E <= 8)
MAX_E = 8


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
# The slice kernel: everything that touches S or dS, one state slice at a time.

PIECE = 64                    # state rows (D) per stream item: the C x PIECE accumulators
# Up to this E the slice kernel's items are unrolled; above it they are a loop per piece (unrolled,
# the compiler holds several items' values at once and spills: 876 bytes a thread at E = 4).
UNROLL_MAX_E = 2


def _onehot_add(ops, acc, vec, column):
  """acc + vec placed in column ``column`` (acc (rows, W) WGMMA layout, vec a row sum)."""
  rows, width = acc.shape
  idx = ops.acc(lax.broadcasted_iota(jnp.int32, (rows, width), 1))
  return acc + jnp.where(idx == column, lax.broadcast_in_dim(vec, (rows, width), [0]), 0.0)


def slice_kernel_smem(d: int, vd: int, c: int, e: int, erase: bool = True,
                      warpgroups: int = 1) -> int:
  """SMEM of the slice kernel on hardware: the larger of its main scope and the output scope."""
  main = (2 * c * d * 2                                   # K, Q
          + (3 if erase else 2) * c * vd * 2              # dX, dO, U
          + warpgroups * 2 * 2 * PIECE * vd * 2           # two slots of (S_e, dS_e) row pieces
          + (3 * e + 1) * c * 4)                          # factor rows
  out = 2 * c * d * 4 + warpgroups * (c * COEF_W + PIECE * LAM_W) * 4   # dq, dk, row sums
  return max(main, out)


def supported(d: int, vd: int, c: int, e: int, dtype, erase: bool = True,
              warpgroups: int = 1) -> str | None:
  """Why ``chunk_gradients`` (its slice kernel) cannot take these sizes, or None if it can."""
  what = "the Mosaic GPU chunk backward"
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
  need = slice_kernel_smem(d, vd, c, e, erase, warpgroups)
  if need > SMEM_LIMIT:
    return f"{what} needs {need} B of SMEM > {SMEM_LIMIT} B"
  return None


def _stream_item(ops, ins, bars, bar_s, interp, *, slot, h, e, e_dim, scale, erase, carry):
  """One item of a warpgroup's stream: rows h * PIECE.. of S_e and dS_e in ``slot`` (their
  copies waited for here). Takes P1 = dX S_e[rows]^T (erase), P2 = dO S_e[rows]^T,
  P3 = U dS_e[rows]^T and S_e[rows] dS_e[rows]^T and adds to ``carry`` = (dq, dk, coef, lam) the
  dq, dk columns, the dcoef, dqcoef, dkcoef row sums (columns e, E + e, 2E + e of coef) and
  dlam's (the diagonal, column e of lam). ``ins`` = the SMEM refs (k, q, f, dX, dO, U, S slots,
  dS slots); ``interp``: the explicit S^T, dS^T of interpret mode (the interpreter has no
  transpose_ref), else empty. ``e`` is a Python int (unrolled) or traced (``lax.fori_loop``),
  ``h`` an int or the warpgroup's index."""
  k_s, q_s, f_s, dx_s, do_s, u_s, s_s, ds_s = ins
  dq, dk, coef, lam = carry
  column = lambda kind: kind * e_dim + e    # f's c, fq, fw rows; coef's dcoef, dqcoef, dkcoef
  factor = lambda kind: ops.rowvec(f_s, column(kind), PIECE)
  iota = lambda dim: ops.acc(lax.broadcasted_iota(jnp.int32, (PIECE, PIECE), dim))

  def transposed(ref, which):
    """ref[slot]^T (V x PIECE) as a wgmma B operand."""
    if ops.interpret:
      return interp[which]
    return plgpu.transpose_ref(ref.at[slot], (1, 0))

  plgpu.barrier_wait(bars.at[bar_s + 2 * slot])
  if ops.interpret:
    interp[0][...] = s_s[slot].T
  if erase:
    p1 = ops.mm(dx_s, transposed(s_s, 0))                   # dX S_e[rows]^T
    kh = ops.acc(k_s[h].astype(F32))
    coef = _onehot_add(ops, coef, -jnp.sum(kh * p1, axis=1), column(0))
    dk = dk - factor(0) * p1
  p2 = ops.mm(do_s, transposed(s_s, 0))                     # dO S_e[rows]^T
  qh = ops.acc(q_s[h].astype(F32))
  coef = _onehot_add(ops, coef, scale * jnp.sum(qh * p2, axis=1), column(1))
  dq = dq + (scale * factor(1)) * p2
  plgpu.barrier_wait(bars.at[bar_s + 2 * slot + 1])
  if ops.interpret:
    interp[1][...] = ds_s[slot].T
  p3 = ops.mm(u_s, transposed(ds_s, 1))                     # U dS_e[rows]^T
  kh = ops.acc(k_s[h].astype(F32))
  coef = _onehot_add(ops, coef, jnp.sum(kh * p3, axis=1), column(2))
  dk = dk + factor(2) * p3
  # <dS_e, S_e> over these rows: the diagonal of S_e[rows] dS_e[rows]^T.
  g = ops.mm(s_s.at[slot], transposed(ds_s, 1))
  lam = _onehot_add(ops, lam, jnp.sum(jnp.where(iota(0) == iota(1), g, 0.0), axis=1), e)
  return dq, dk, coef, lam


def _launch(kernel, operands, out_type, *, grid, n_pieces, warpgroups, interpret):
  """``plgpu.kernel`` for the slice kernel: grid (B*H, NC), the barriers (the first copies' and
  each warpgroup's four slot barriers, ``_slice_kernel``'s layout, and one of ``warpgroups``
  arrivals where they meet), one thread per warpgroup."""
  threads = dict(num_threads=2, thread_name="wg") if warpgroups == 2 else {}
  return plgpu.kernel(
      kernel, out_type=out_type,
      scratch_types=[plgpu.Barrier(num_barriers=2 * n_pieces + 4 + 4 * warpgroups),
                     plgpu.Barrier(num_arrivals=warpgroups)],
      grid=grid, grid_names=("bh", "n"), compiler_params=_compiler_params(regions=False),
      interpret=_interpret_params(interpret), kernel_name="triadic_chunk_backward_slices",
      **threads,
  )(*operands)


def _slice_kernel(q_g, k_g, dx_g, do_g, u_g, s_g, ds_g, f_g, dq_g, dk_g, coef_g, lam_g, bars,
                  done, *, scratch, outs, c, d, e_dim, scale, erase, wgs, interpret, unroll,
                  heads=None):
  ops = _Ops(interpret)
  i, n = lax.axis_index("bh"), lax.axis_index("n")
  # q, k, dO, dX: chunk n of row i, or with heads the strided box of the (B, T, H, X) arrays.
  at = _chunk_box(heads, i, c)
  tok_at = lambda x_g, cols: at(x_g, n, cols)
  n_pieces = d // PIECE
  # The pieces (64-row blocks of the state, 64-column blocks of dq, dk, K, Q) a warpgroup owns:
  # all of them with one warpgroup, piece w for warpgroup w with two.
  w = lax.axis_index("wg") if wgs == 2 else 0
  pieces = [w] if wgs == 2 else list(range(n_pieces))
  # The stream of a warpgroup: item j = rows of piece pieces[j // E] of S_e and dS_e, e = j % E,
  # piece-major, so that only that piece's dq, dk columns are live; slot = j % 2. Unrolled
  # (``unroll``, ``unrolls_items``) or a loop per piece, which keeps the compiler from holding
  # several items' values (registers) at once.
  n_items = len(pieces) * e_dim
  # Barriers: 0 .. 2P + 3 the P pieces of q and of k, the factors, dO, U, dX (copied by
  # warpgroup 0, waited by all); then per warpgroup 2 slot: S rows, 2 slot + 1: dS rows.
  firsts = 2 * n_pieces + 4
  bar_s = firsts + 4 * w

  def piece_of(j):
    return w if wgs == 2 else j // e_dim

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
      pairs = ([(tok_at(q_g, cols(h)), q_s.at[h]) for h in range(n_pieces)]
               + [(tok_at(k_g, cols(h)), k_s.at[h]) for h in range(n_pieces)]
               + [(f_g.at[i, n], f_s), (tok_at(do_g, slice(None)), do_s), (u_g.at[i, n], u_s)]
               + ([(tok_at(dx_g, slice(None)), dx_s)] if erase else []))
      _load(pairs, bars)

    if wgs == 2:
      pl.when(w == 0)(load_firsts)
    else:
      load_firsts()
    for j in range(min(2, n_items)):
      load_item(j)
    _wait(firsts - (0 if erase else 1), bars)

    ins = (k_s, q_s, f_s, dx_s, do_s, u_s, s_s, ds_s)

    def item(h, e, carry):
      """Item (h, e) (``_stream_item``), then the copy two items ahead into its slot."""
      j = (h if wgs == 1 else 0) * e_dim + e
      carry = _stream_item(ops, ins, bars, bar_s, interp, slot=j % 2, h=h, e=e, e_dim=e_dim,
                           scale=scale, erase=erase, carry=carry)

      def next_copy():
        plgpu.commit_smem()             # every wgmma and register read of this slot is done
        load_item(j + 2)

      if isinstance(j, int):
        if j + 2 < n_items:
          next_copy()
      else:
        pl.when(j + 2 < n_items)(next_copy)
      return carry

    coef = ops.acc(jnp.zeros((c, COEF_W), F32))
    lam = ops.acc(jnp.zeros((PIECE, LAM_W), F32))
    dqs, dks = [], []
    for h in pieces:
      carry = (ops.acc(jnp.zeros((c, PIECE), F32)), ops.acc(jnp.zeros((c, PIECE), F32)), coef,
               lam)
      if unroll:
        for e in range(e_dim):
          carry = item(h, e, carry)
      else:
        carry = lax.fori_loop(0, e_dim, functools.partial(item, h), carry)
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
      dq_s[h] = dq.astype(dq_s.dtype)
      dk_s[h] = dk.astype(dk_s.dtype)
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


def slice_warpgroups(requested: int | None, d: int) -> int:
  """The slice kernel's warpgroups for ``Config.slice_warpgroups``: 2 where asked (None: asked)
  and ``slice_warpgroups_supported``, else 1."""
  return 2 if requested in (None, 2) and slice_warpgroups_supported(d) is None else 1


def unrolls_items(requested: int | None, e: int) -> bool:
  """Whether the slice kernel unrolls its items at ``e`` slices: up to ``requested``
  (``Config.slice_unroll_max_e``; None: ``UNROLL_MAX_E``), else a loop per piece."""
  return e <= (UNROLL_MAX_E if requested is None else requested)


def slices_pass(q, k, dx, do, u, states, dstates, f, *, scale, erase, warpgroups=1, heads=None,
                partials_in_bf16=False, unroll_max_e=None, interpret=False):
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
  one piece with its own stream and slots (``slice_warpgroups_supported``). ``unroll_max_e``:
  up to this E the items are unrolled, above it a loop per piece (``unrolls_items``).
  Operands: q, k (BH,NC,C,D), dX = beta A^T dU, dO, U (BH,NC,C,V), all bf16; the states
  (BH,NC,E,D,V) bf16; the factor rows f (BH,NC,3E+1,C) float32 (``factor_rows``). Returns dq, dk
  partials (BH,NC,C,D), summed in float32 and stored in bf16 with ``partials_in_bf16``
  (``Config.partials_in_bf16``), else float32, and, float32, the row-sum matrix (BH,NC,C,32) and
  dlam partials (BH,NC,64,8).

  ``heads=H``: q, k (B,T,H,D), dX and dO (B,T,H,V) in the caller's layout, T = NC * C, read in
  place (program (i, n) copies the strided boxes of rows n*C.. of head i % H of batch i // H, q
  and k in 64-column pieces), so that they need no relayout copy; every other operand and the
  outputs keep their (BH, NC, ...) layout (``common.check_heads``)."""
  bh, nc, c = f.shape[0], f.shape[1], f.shape[-1]
  d, vd, e_dim = q.shape[-1], do.shape[-1], (f.shape[2] - 1) // 3
  if heads is not None:
    check_heads(heads, bh, nc, c, q=q, k=k, do=do, **({"dx": dx} if erase else {}))
  if warpgroups not in (1, 2) or (warpgroups == 2 and slice_warpgroups_supported(d)):
    raise ValueError(f"warpgroups must be 1, or 2 at D = {2 * PIECE}; got {warpgroups} at D={d}")
  partials_dtype = BF16 if partials_in_bf16 else F32
  n_pieces = d // PIECE
  sw = _swizzle(min(vd, 64))
  sk = _swizzle(min(d, 64))
  sp = _swizzle(PIECE, partials_dtype)
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
  outs = [_smem((n_pieces, c, PIECE), partials_dtype, sp),           # dq
          _smem((n_pieces, c, PIECE), partials_dtype, sp),           # dk
          _smem((warpgroups, c, COEF_W), F32, _swizzle(COEF_W, F32)),
          _smem((warpgroups, PIECE, LAM_W), F32, _swizzle(LAM_W, F32))]
  partial = jax.ShapeDtypeStruct((bh, nc, c, d), partials_dtype)
  out_type = [partial, partial,
              jax.ShapeDtypeStruct((bh, nc, warpgroups, c, COEF_W), F32),
              jax.ShapeDtypeStruct((bh, nc, warpgroups, PIECE, LAM_W), F32)]
  kernel = functools.partial(_slice_kernel, scratch=scratch, outs=outs, c=c, d=d, e_dim=e_dim,
                             scale=scale, erase=erase, wgs=warpgroups, interpret=bool(interpret),
                             heads=heads, unroll=unrolls_items(unroll_max_e, e_dim))
  dqp, dkp, coef, lam = _launch(kernel, (q, k, dx, do, u, states, dstates, f), out_type,
                                grid=(bh, nc), n_pieces=n_pieces, warpgroups=warpgroups,
                                interpret=interpret)
  return dqp, dkp, jnp.sum(coef, axis=2), jnp.sum(lam, axis=2)


def x_from_states(k, v, states, k2_col, gc_col, heads=None):
  """X = V - sum_e diag(k2_e exp(gc_e)) K S_e (BH,NC,C,V) float32 in plain JAX: the tail's X
  when the forward did not save it (its state passes not the Mosaic ones). ``heads=H``: k, v in
  the caller's (B, T, H, X) layout, read as (B, NC, C, H, X) views (no relayout copy of k; V's
  relayout is part of the subtraction's output), X still in the kernel layout."""
  if heads is None:
    ks = jnp.einsum("bncd,bnedv->bnecv", k, states.astype(k.dtype), preferred_element_type=F32)
    coef = k2_col * jnp.exp(gc_col)
    return v.astype(F32) - jnp.einsum("bnce,bnecv->bncv", coef, ks)
  bh, nc, c = k2_col.shape[:3]
  check_heads(heads, bh, nc, c, k=k, v=v)
  chunks = lambda y: y.reshape(bh // heads, nc, c, heads, y.shape[-1])     # (B, NC, C, H, X)
  per_head = lambda y: y.reshape(bh // heads, heads, *y.shape[1:])          # (B, H, ...)
  ks = jnp.einsum("bnchd,bhnedv->bhnecv", chunks(k), per_head(states).astype(k.dtype),
                  preferred_element_type=F32)
  coef = per_head(k2_col * jnp.exp(gc_col))
  x = (jnp.einsum("bnchv->bhncv", chunks(v)).astype(F32)
       - jnp.einsum("bhnce,bhnecv->bhncv", coef, ks))
  return x.reshape(bh, nc, c, -1)


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
  return over_value_blocks(vd, bv, vblock, carry)


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
  # Stored before ut_after, so that they are dead before dq and dk exist (registers: ptxas'
  # spills, ``benchmarks/triton_registers.py``).
  dmq_ref[...] = dmq
  if erase:
    dm_ref[...] = dm
  partials = (dqp_ref[...].astype(F32), dkp_ref[...].astype(F32))    # float32 or bf16 in HBM
  dq, dk, dbeta = ut_after(q, k, *partials, dbeta, dp, dl, dlkk, mq_ref[...],
                           m_ref[...] if erase else None, beta, erase=erase, dtype=dtype)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dbeta_ref[...] = dbeta


def _fused_tail_kernel(q_ref, k_ref, x_ref, do_ref, u_ref, du_ref, dr_ref, dqp_ref, dkp_ref,
                       dcoef_ref, dqcoef_ref, dkcoef_ref, dlam_ref, k2_col, k2_row, q2_col, gc_col,
                       gc_row, beta_ref, a_ref, *outs, c, vd, bv, e_dim, scale, erase, dtype,
                       precision):
  q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
  beta = beta_ref[...].astype(F32)
  dbeta, dp, da = _value_products(x_ref, do_ref, u_ref, du_ref, dr_ref, beta, c=c, vd=vd, bv=bv,
                                  scale=scale, erase=erase, dtype=dtype)
  coefs = coef_columns(dcoef_ref, dqcoef_ref, dkcoef_ref, dlam_ref)
  partials = lambda: (dqp_ref[...].astype(F32), dkp_ref[...].astype(F32))  # f32 or bf16 in HBM
  chunk_local(q, k, partials, dp, da if erase else None, dbeta, coefs, k2_col, k2_row, q2_col,
              gc_col, gc_row, beta, a_ref[...], outs, c=c, e_dim=e_dim, erase=erase, dtype=dtype,
              precision=precision, loop=True)


def _tail_blocks(bh, nc, vd, cfg):
  """The tails' value block (``cfg.bwd_block_v``, checked to divide V), per-chunk BlockSpec and
  (BH, NC, ...) output shape makers."""
  bv = min(cfg.bwd_block_v, vd)
  if vd % bv:
    raise ValueError(f"the tail's bwd_block_v must divide V = {vd}, got {bv}")
  shape = lambda *s, dt=F32: jax.ShapeDtypeStruct((bh, nc, *s), dt)
  return bv, chunk_block, shape


def _token_blocks(bh, nc, c, heads, spec, shape):
  """BlockSpec and output shape makers (of the last dim X) of the tails' per-token arrays (q, k,
  dO in, dq, dk out): the chunk's (C, X) block of (BH, NC, C, X) or, with ``heads``, of the
  caller's (B, T, H, X), the head dim squeezed (program (i, j): rows j*C.. of head i % H of
  batch i // H), so that those arrays need no relayout copy."""
  if heads is None:
    return (lambda x: spec(c, x)), (lambda x, dt: shape(c, x, dt=dt))
  return ((lambda x: token_block(c, x, heads)),
          (lambda x, dt: jax.ShapeDtypeStruct((bh // heads, nc * c, heads, x), dt)))


def tail_kernel(q, k, x, do, u, du, drhs, dqp, dkp, mq, m, beta_col, a, *, scale, erase, cfg,
                heads=None):
  """The E-independent tail kernel ``triadic_chunk_backward_tail_ut``: the products over V
  (dbeta's X part, dA, dP) accumulated over blocks of ``cfg.bwd_block_v`` value columns (the
  loop Triton pipelines, so that no C x V operand is held whole), then ``backward.ut_before`` /
  ``ut_after`` with M' and M (None without erase) given.
  Returns dq, dk (BH,NC,C,D) in q's dtype (the op's gradients are cast to it next), float32
  dbeta (C,1), dM' (C,C) and dM (C,C; erase only, else None). ``heads=H``: q, k, dO are read
  and dq, dk written in the caller's (B, T, H, X) layout (``_token_blocks``); the rest keeps
  (BH, NC, ...)."""
  bh, nc, c, d = dqp.shape
  vd = x.shape[-1]
  if heads is not None:
    check_heads(heads, bh, nc, c, q=q, k=k, do=do)
  bv, spec, shape = _tail_blocks(bh, nc, vd, cfg)
  tspec, tshape = _token_blocks(bh, nc, c, heads, spec, shape)
  kernel = functools.partial(_tail_ut_kernel, c=c, vd=vd, bv=bv, scale=scale, erase=erase,
                             dtype=q.dtype, precision=cfg.f32_precision)
  n_mm = 2 if erase else 1
  res = call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[tspec(d), tspec(d), spec(c, vd), tspec(vd), spec(c, vd), spec(c, vd),
                spec(c, vd), spec(c, d), spec(c, d)] + [spec(c, c)] * n_mm
               + [spec(c, 1), spec(c, c)],
      out_specs=[tspec(d), tspec(d), spec(c, 1)] + [spec(c, c)] * n_mm,
      out_shape=[tshape(d, q.dtype), tshape(d, q.dtype), shape(c, 1)] + [shape(c, c)] * n_mm,
      semantics=("parallel", "parallel"), name="triadic_chunk_backward_tail_ut",
      num_warps=cfg.bwd_num_warps,
  )(q, k, x, do, u, du, drhs, dqp, dkp, mq, *((m,) if erase else ()), beta_col, a)
  return (*res, None) if not erase else tuple(res)


def fused_tail_kernel(q, k, x, do, u, du, drhs, dqp, dkp, dcoef, dqcoef, dkcoef, dlam, k2_col,
                      k2_row, q2_col, gc_col, gc_row, beta_col, a, *, scale, erase, cfg,
                      heads=None):
  """Everything after the slice kernel in one Pallas kernel ``triadic_chunk_backward_tail_fused``
  (grid (B*H, NC)): ``_value_products``, then ``backward.chunk_local``, which builds M, M' and
  the per-slice mask gradients in the kernel, one slice's C x C decay mask live at a time. Same
  operands and outputs as ``tail``; for small E, where those per-slice C x C terms fit in
  registers, it saves ``tail``'s four C x C float32 matrices per chunk through HBM and the plain
  JAX around it. ``heads=H``: q, k, dO in and dq, dk out in the caller's (B, T, H, X) layout, as
  in ``tail_kernel``."""
  bh, nc, c, d = dqp.shape
  vd, e_dim = x.shape[-1], k2_col.shape[-1]
  if heads is not None:
    check_heads(heads, bh, nc, c, q=q, k=k, do=do)
  bv, spec, shape = _tail_blocks(bh, nc, vd, cfg)
  tspec, tshape = _token_blocks(bh, nc, c, heads, spec, shape)
  kernel = functools.partial(_fused_tail_kernel, c=c, vd=vd, bv=bv, e_dim=e_dim, scale=scale,
                             erase=erase, dtype=q.dtype, precision=cfg.f32_precision)
  cols, rows = spec(c, e_dim), spec(e_dim, c)
  return call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[tspec(d), tspec(d), spec(c, vd), tspec(vd)] + [spec(c, vd)] * 3
               + [spec(c, d), spec(c, d)] + [cols] * 3
               + [spec(1, e_dim), cols, rows, cols, cols, rows, spec(c, 1), spec(c, c)],
      out_specs=[tspec(d), tspec(d), cols, rows, cols, cols, rows, spec(c, 1)],
      out_shape=[tshape(d, q.dtype), tshape(d, q.dtype), shape(c, e_dim),
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


def tail(q, k, x, do, u, du, drhs, dqp, dkp, coef, dlam, k2_col, k2_row, q2_col, gc_col, gc_row,
         beta_col, a, *, scale, erase, cfg, fused, mask_grads_kernel=False, heads=None, mq=None,
         m=None):
  """Everything after the slice kernel. ``fused``: ``fused_tail_kernel``; else the masks M, M'
  (plain JAX), the E-independent tail kernel, and the per-slice mask gradients (``masks.py``: the
  kernel ``mask_grads_kernel`` where ``mask_grads_kernel``, else plain JAX).
  ``coef`` (BH,NC,C,W) holds the slice kernel's row sums dcoef, dqcoef, dkcoef in columns
  [0, E), [E, 2E), [2E, 3E), ``dlam`` (BH,NC,E) its traces. Returns dq, dk (BH,NC,C,D) in q's
  dtype and, float32, dk2, dq2 and d gc (C,E) and dbeta (C,1). ``heads=H``: q, k, dO in and
  dq, dk out in the caller's (B, T, H, X) layout (the tail kernels' ``heads``); x and the rest
  keep the kernel layout. ``mq``, ``m``: M' and M (erase) as the forward formed them, for the
  split tail (else formed here)."""
  e_dim = k2_col.shape[-1]
  dcoef, dqcoef, dkcoef = (coef[..., j * e_dim:(j + 1) * e_dim] for j in range(3))
  if fused:
    dq, dk, dk2_col, dk2_row, dq2, dgc_col, dgc_row, dbeta = fused_tail_kernel(
        q, k, x, do, u, du, drhs, dqp, dkp, dcoef, dqcoef, dkcoef, dlam, k2_col, k2_row, q2_col,
        gc_col, gc_row, beta_col, a, scale=scale, erase=erase, cfg=cfg, heads=heads)
    return dq, dk, col_plus_row(dk2_col, dk2_row), dq2, col_plus_row(dgc_col, dgc_row), dbeta
  if mq is None:
    m, mq = masks.decay_masks(k2_col, k2_row, q2_col, gc_col, gc_row, erase=erase)
  dq, dk, dbeta, dmq, dm = tail_kernel(q, k, x, do, u, du, drhs, dqp, dkp, mq, m, beta_col, a,
                                       scale=scale, erase=erase, cfg=cfg, heads=heads)
  if mask_grads_kernel:
    dk2, dq2, dgc = masks.mask_grads_kernel(dmq, dm, coef, dlam, k2_col, q2_col, gc_col,
                                            erase=erase, cfg=cfg)
  else:
    dk2, dq2, dgc = masks.mask_grads(dmq, dm, dcoef, dqcoef, dkcoef, dlam, k2_col, k2_row,
                                     q2_col, gc_col, gc_row, erase=erase)
  return dq, dk, dk2, dq2, dgc, dbeta


def chunk_gradients(q, k, v, do, u, du, states, dstates, k2_col, k2_row, q2_col, gc_col, gc_row,
                    beta_col, a, x=None, *, scale, erase, slice_warpgroups=1, fused_tail=None,
                    heads=None, a_operand=None, mq=None, m=None, drhs=None, dv=None,
                    partials_in_bf16=False, slice_unroll_max_e=None, mask_grads_kernel=False,
                    interpret=False):
  """``backward.chunk_gradients`` on Hopper: same operands (layout (BH, NC, ...)), same outputs
  but in q's dtype for dq, dk and dv (BH,NC,C,V), the rest float32: dk2, dq2 and d gc (C,E),
  dbeta (C,1).

  ``heads=H``: q, k, v, dO in the caller's (B, T, H, X) layout (T = NC * C, B * H = BH;
  ``common.check_heads``) and dq, dk, dv returned in it; the rest as above. The slice and tail
  kernels read q, k, dO in place and the tail writes dq, dk so; dv = beta A^T dU, which the
  slice kernel reads as dX, is token-major too (written so by the reverse pass or by XLA); X,
  formed from the token-major k, v where not given (``x_from_states``) or V relayouted without
  erase (``head_major``), is read in the kernel layout, as is a given ``x`` (the Mosaic forward
  saves it so with ``heads`` too).

  ``a_operand``: A in q's dtype as the prep wrote it (``chunk_prep.Prep``), for A^T dU (else A
  is cast here). ``x`` (erase only): X = V - sum_e diag(c_e) K S_e as the forward saved it
  (without it, ``x_from_states`` forms it in plain JAX). ``mq``, ``m`` (m with erase): M' and M
  as the forward's prep formed them (``Plan.saves_masks``), read by the split tail instead of
  forming them again. ``drhs``, ``dv`` (erase only): A^T dU and dV = beta A^T dU in q's dtype
  as the reverse state pass wrote them (``Plan.saves_drhs``; dv in q's layout), else formed
  here. ``slice_warpgroups``, ``partials_in_bf16``, ``slice_unroll_max_e``: the slice kernel's
  warpgroups, the dtype of the dq, dk partials it hands the tail and up to which E its items are
  unrolled (``slices_pass``). ``fused_tail``: the tail as one kernel (None:
  ``default_fused_tail``). ``mask_grads_kernel``: the split tail's mask gradients by
  ``masks.mask_grads_kernel`` (``Config.mask_grads_kernel``). ``interpret=True``: Mosaic GPU
  interpret mode for the slice kernel and Pallas interpret mode for the tail (CPU tests)."""
  bh, nc, c = k2_col.shape[:3]
  d, vd, e_dim = q.shape[-1], v.shape[-1], k2_col.shape[-1]
  if heads is not None:
    check_heads(heads, bh, nc, c, q=q, k=k, v=v, do=do)
  reason = supported(d, vd, c, e_dim, q.dtype, erase, slice_warpgroups)
  if reason:
    raise ValueError(reason)
  given = lambda y: "set" if y is not None else None
  if (m is not None) != (mq is not None and erase):
    raise ValueError("m (the mask M) must be given exactly when mq (M') is and erase is on, got "
                     f"mq {given(mq)}, m {given(m)}, erase={erase}")
  if (drhs is None) != (dv is None) or (drhs is not None and not erase):
    raise ValueError("drhs and dv (A^T dU and beta A^T dU) come together and only with erase, got "
                     f"drhs {given(drhs)}, dv {given(dv)}, erase={erase}")
  low = lambda y: y.astype(q.dtype)
  if drhs is None:
    drhs = rhs_gradient(a if a_operand is None else a_operand, du, erase)
    dv = low(beta_col.astype(F32) * drhs)
    if heads is not None:                 # in the caller's layout, as the slice kernel reads it
      dv = token_major(dv, bh // heads, heads)
  f = factor_rows(gc_col, k2_col, q2_col, beta_col)
  dqp, dkp, coef, lam = slices_pass(q, k, dv, low(do), low(u), low(states), low(dstates), f,
                                    scale=scale, erase=erase, warpgroups=slice_warpgroups,
                                    heads=heads, partials_in_bf16=partials_in_bf16,
                                    unroll_max_e=slice_unroll_max_e, interpret=interpret)
  if not erase:
    x = v if heads is None else head_major(v, c)
  elif x is None:
    x = x_from_states(k, v, states, k2_col, gc_col, heads=heads)
  dlam = jnp.sum(lam, axis=2)[..., :e_dim]            # (BH, NC, E): the sum over the rows
  # The tail kernel's products over V take bf16 operands anyway (``mm``), so its C x V inputs
  # travel in the inputs' dtype (half the kernel's traffic; dbeta's rowsum(drhs X) then sees
  # bf16-rounded factors, summed in float32).
  fused = default_fused_tail(e_dim) if fused_tail is None else fused_tail
  dq, dk, dk2, dq2, dgc, dbeta = tail(
      q, k, low(x), do, low(u), low(du), low(drhs), dqp, dkp, coef, dlam, k2_col, k2_row,
      q2_col, gc_col, gc_row, beta_col, a, scale=scale, erase=erase,
      cfg=tail_config(interpret, fused), fused=fused, mask_grads_kernel=mask_grads_kernel,
      heads=heads, mq=mq, m=m)
  return dq, dk, dv, dk2, dq2, dgc, dbeta
