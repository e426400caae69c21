"""Hopper (Mosaic GPU) state-passing kernels: drop-in replacements for ``recurrent.state_pass`` and
``recurrent.reverse_state_pass`` (same operands, same outputs), for bf16 inputs.

Why this structure. The Triton kernel keeps E separate D x BV float32 state tiles and does 3E
small matmuls (N = BV = 16..32) per chunk, so its cost grows with E. Here one program
(grid (B*H, V / BV), one warpgroup) holds all E slices of its D x BV state tile side by side as
ONE D x (E*BV) float32 array in the WGMMA register layout, "S_cat" (column block e = S_e[:, value
block]). Every E-dependent matmul is then one wgmma with N = E*BV (128 or 256 at E = 8), and
E = 1 vs E = 8 differ mostly in the width of those wgmmas. At D = 128 the program can instead
run two warpgroups, each holding 64 rows of S_cat ("Two warpgroups" below), which fits
E*BV = 256 in registers. Per chunk (C = 64 tokens), with the
per-row factors fe = beta k2 a, fq = q2 a, fw = k2 b (a = exp(gc), b = exp(gc_C - gc)) and
lam = exp(gc_C) precomputed in plain JAX (O(T E), ``_factors``):

  forward   R = K S_cat,  Y = Q S_cat                            (C x D) @ (D x E*BV)
            rhs = beta V - sum_e diag(fe_e) R[:, e]              (beta V without erase)
            U = A rhs;  o = scale (sum_e diag(fq_e) Y[:, e] + P U)
            S_cat <- lam_cat * S_cat + K^T [diag(fw_e) U]_e      (D x C) @ (C x E*BV)
  backward  dU = scale P^T dO + sum_e diag(fw_e) (K dS_cat)[:, e]
            dS_cat <- lam_cat * dS_cat + Q^T [scale diag(fq_e) dO]_e - K^T [diag(fe_e) A^T dU]_e

How the pieces are done, and why (what the CPU interpreter and the Mosaic GPU lowering accept):

* Every wgmma operand is in SMEM (the interpreter takes no register operand), bf16, f32
  accumulation, the accumulator a scoped ``plgpu.ACC``. Both operands of one wgmma must share a
  swizzle (a lowering rule). Every bf16 operand uses the swizzle of a BV-wide row ("swizzle V"):
  the [.]_e operands W, X, Z are written one BV-wide column block at a time, each block a whole
  column of SMEM tiles (the lowering refuses a store into a column block narrower than the
  swizzle's tile), and K, Q and S_cat share their swizzle (below).
* The transposed operands (the forward's K^T; the reverse's K^T, Q^T, A^T, P^T) are
  ``plgpu.transpose_ref`` views of the SMEM copies of K, Q, A, P (A, P cast to bf16 in plain JAX,
  as ``recurrent.mm`` casts them), which the lowering takes as the wgmma lhs (MN-major) at any
  swizzle that equals the rhs's: their rhs W, X, Z have swizzle V, so K, Q take it, and with
  them S_cat (K S_cat, Q S_cat: one swizzle per wgmma). No transposed copy of an input is made
  (an XLA transpose over the whole input and a second read of it per value block). The
  forward's K is also read by the state update at the chunk's end, after the next chunk's copy
  of K has started, so K has two buffers (the loop step's parity); the reverse starts its
  copies at each chunk's top, after the previous state update is complete, so one buffer each
  serves. The interpreter cannot apply a transposed ref: in interpret mode the kernels write
  explicit transposes into SMEM that exists in interpret mode only (``_Ops.transposed``), so the
  views themselves are checked by the CUDA lowering, not numerically on CPU.
* The e-reduction (sum over column blocks) is done in registers: static column slices of the
  WGMMA-layout accumulator (BV a multiple of 8), each scaled by a row vector (layout WGMMA row,
  i.e. ``Layout.WGMMA.reduce(1)``) broadcast along the columns. lam is a per-column vector
  (``Layout.WGMMA.reduce(0)``) repeated BV times per block.
* The state update: on hardware, ``pl.run_state`` with ``plgpu.ACC.init(lam * S)`` accumulates
  K^T W into the carried state's own registers. The interpreter runs no ``run_state`` and no store
  into an accumulator, so interpret mode computes K^T W in a fresh accumulator and adds it (same
  values). Likewise ``plgpu.layout_cast`` is skipped in interpret mode (it has no CPU rule).
* One warpgroup (``warpgroups=1``). Each chunk input has its own SMEM buffer and barrier
  (``_Inputs``), and every input is waited for where it is first read, not all at the chunk's
  top. The forward pass
  starts its copies one chunk ahead: chunk n + 1's copy of an input starts as soon as every warp
  is done with chunk n's (after the ``commit_smem`` that follows its last reader: K after R, A
  after U, Q and P after the output, V after rhs, lam after the decay), so each wait finds its
  data landed; without erase K is read only by the state update at the chunk's end (as K^T),
  so its copy starts at the chunk's top; the row factors are read until the chunk's end and
  needed again at its start, so they have two buffers (the loop step's parity); without erase
  A is not loaded. The reverse pass starts its copies at each chunk's top (Q, read only by its
  final state update, after the others), which measured as fast or faster than starting them a
  chunk ahead (benchmarks/RESULTS.md).
  No warp specialisation. Outputs leave by TMA smem -> gmem. Ordering rules kept by hand (the
  interpreter does not check them): ``commit_smem`` (fence + warpgroup barrier) after every
  register -> SMEM store that a wgmma or TMA reads, and between a buffer's last reader and the
  copy that refills it; ``wgmma_wait(0)`` before the copies that refill
  what the previous state update read; ``wait_smem_to_gmem(0, wait_read_only=True)`` (also a
  warpgroup barrier) before the per-chunk output buffers are rewritten; no copy is in flight
  when the loop's SMEM scope ends (the next-chunk copies are under ``pl.when``).
* Two warpgroups (``warpgroups=2``, D = 128 only: ``warpgroups_supported``). One kernel of two
  threads (``num_threads=2, thread_name="wg"``), every SMEM scope shared by both
  (``collective_axes=("wg",)``). Warpgroup w owns state rows [64 w, 64 w + 64): its 64 x E*BV
  float32 piece of S_cat in registers, its bf16 operand copy as E separate (64, BV) SMEM blocks
  (which are also the TMA sources of its rows of the chunk-start states: no separate state output
  buffer, which would not fit beside them at E*BV = 256), and its own 64-column pieces of K and Q,
  which it copies and waits for alone (its K^T, Q^T are views of them; the forward's K pieces
  have two buffers, as above). The products that contract over D are split over D: each
  warpgroup forms its part of the e-reduced C x BV results, sum_e diag(f_e) (K_w S_w,e) (and
  with Q), ``_partial``, one N = BV wgmma per slice on the (64, BV) blocks, so only C x BV
  accumulators are live (2E small wgmmas per chunk in the forward, each waited, scaled and
  summed in turn); warpgroup 1 writes its parts to SMEM (float32) and warpgroup 0 adds them.
  Warpgroup 0 alone does the C x BV work (rhs, U
  = A rhs, o; dU, X and Z in the backward; V, A, P or dO, A^T, P^T are its copies) and writes the
  whole W (X, Z) that both state updates read; each warpgroup's update is its rows, K^T_w W (M = 64,
  N = E*BV). The factor rows and lam are copied once, by warpgroup 0, and waited for by both. Per
  chunk the warpgroups meet twice at a two-arrival barrier (``_sync``: ``commit_smem``, arrive,
  wait): once the parts are in SMEM (both have read lam), and once warpgroup 0 has written W (X, Z)
  and read the parts (it has read the factors). A shared buffer is rewritten only after a meeting
  that follows its last reader in the other warpgroup: the parts and W (X, Z) one meeting on, lam
  and the factors refilled by warpgroup 0 after the first and the second meeting. In the backward,
  warpgroup 1's part goes through dU's output buffer, so warpgroup 0 waits for dU's store to have
  read it before the second meeting. Barrier phases are tracked per thread, so a barrier that both
  warpgroups wait for (a shared copy's, the meeting's) is waited once per phase by each.
* SMEM scopes: the chunk loop's buffers live in one ``run_scoped``; the (D, E*BV) float32 buffer
  for the initial / final state in separate scopes before and after it (together they exceed the
  227 KiB at D = 64, E*BV = 256). With two warpgroups that buffer is (2, 64, E*BV), a row piece
  each, and both warpgroups meet before a scope they share ends.
* Registers: with one warpgroup the state is D * E * BV / 128 float32 registers per thread, plus
  a C x E*BV accumulator while R or Y is reduced. ``default_block_v`` keeps (D + C) * E * BV <=
  192 * 128 (BV = 32 below E = 4 at D = 64...), and ``supported`` refuses D * E * BV > 128 * 128.
  With two warpgroups each thread holds 64 * E * BV / 128 state floats (128 at E * BV = 256)
  and C x BV accumulators and temporaries (16 registers each at BV = 32), so D = 128 takes
  E * BV = 256: ``default_block_v(..., warpgroups=2)`` is the widest BV in (32, 16) with E * BV
  <= 256, a multiple of 32, within SMEM_LIMIT (``smem_bytes_2wg``; BV = 32 at E = 8).
* The initial / final state is moved once per program in the "cat" layout (BH, V/BV, D, E*BV),
  rearranged in plain JAX (state-sized, once); the per-chunk states are written directly in
  recurrent.py's (BH, NC, E, D, V) layout from an (E, D, BV) SMEM buffer.
* q, k, v, o and dO are in the (BH, NC, C, X) layout of ``ops.kernel_layout`` (T padded to
  NC * C, H moved before T). Every kernel (forward and reverse, one or two warpgroups) also
  takes them in the user's (B, T, H, X) layout (``heads=H`` of ``state_pass`` and
  ``reverse_state_pass``, T = NC * C; ``_chunk_box``): program i reads chunk n of head h = i % H
  of batch b = i // H as the strided TMA box ``x.at[b, pl.ds(n * C, C), h, cols]`` (row stride
  H * X; cols: the value block of v and dO, a warpgroup's 64 columns of q and k with two
  warpgroups, else all) and the forward writes o the same way (the reverse pass dV, with
  ``save_drhs``), so the relayout copies of q, k, v, o, dO and dV are not made. Every other
  operand and output (the row factors, A, P, U, X, dU, A^T dU, the states) keeps its (BH, ...)
  layout.
* Without residuals (``state_pass(..., residuals=False)``: a forward that no backward follows,
  the op's primal) the forward kernels write o and the final state only: no U, no
  chunk-start states (and no X), since XLA cannot drop a custom call's unread outputs. The
  one-warpgroup kernel then has no (E, D, BV) state output buffer (E * D * BV * 2 bytes of
  SMEM); the two-warpgroup one stores the states from its operand blocks, so only its stores go.
  The ordering rules above hold unchanged for what remains: every ``commit_smem`` stays (each
  also publishes a register -> SMEM store that a wgmma reads, or separates a buffer's last
  reader from its refill), and the ``wait_smem_to_gmem`` at a chunk's top waits for o's store.
* float32 inputs are not supported (use the Triton path): wgmma on float32 would be TF32.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from triadic.pallas.common import check_heads, du_dtype

F32 = jnp.float32
BF16 = jnp.bfloat16
BLOCK_VS = (16, 32, 64)
MAX_N = 256                 # wgmma N limit: E * BV
REG_BUDGET = 192 * 128      # (D + C) * E * BV: default block_v choice (state + one C x E*BV acc)
STATE_BUDGET = 128 * 128    # D * E * BV: hard limit, the state alone at 128 registers a thread
CAT_BARRIER = 9             # barriers 0..8: the chunk inputs (the factors take two); 9: h0 / dht
HALF = 64                   # two warpgroups: state rows (D) per warpgroup
SMEM_LIMIT = 220 * 1024     # of the 227 KiB a block may have (reduction scratch etc.)
SMEM_ALIGN = 1024           # Mosaic GPU starts every SMEM scratch buffer at a multiple of this
BARRIER_BYTES = 8           # SMEM of one mbarrier


def _interpret_params(interpret):
  """``interpret=True`` means Mosaic GPU interpret mode (simulated SMEM, TMA, barriers)."""
  if interpret is True:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
  return interpret


def interpret_available() -> bool:
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: F401
  except ImportError:
    return False
  return True


def sizes_reason(d: int, vd: int, c: int, e: int, dtype, bv: int | None, block_vs,
                 what: str) -> str | None:
  """The checks every Mosaic GPU kernel here shares (dtype, chunk, D, value block, wgmma N), or
  None. ``what`` names the kernel in the message."""
  if jnp.dtype(dtype) != jnp.dtype(BF16):
    return (f"{what} take bfloat16 inputs only (wgmma on float32 would be TF32; use the Triton "
            f"path), got {jnp.dtype(dtype).name}")
  if c != 64:
    return f"{what} need chunk size 64, got {c}"
  if d not in (64, 128):
    return f"{what} need D in (64, 128), got {d}"
  if bv is None:
    return f"{what}: no value block in {block_vs} divides V={vd} and fits on chip at D={d}, E={e}"
  if bv not in block_vs or vd % bv:
    return f"V={vd} must be a multiple of block_v={bv} in {block_vs}"
  if e * bv > MAX_N:
    return f"E * block_v must be <= {MAX_N}, got {e} * {bv}"
  return None


def supported(d: int, vd: int, c: int, e: int, dtype, block_v: int | None = None,
              warpgroups: int = 1) -> str | None:
  """Why these kernels cannot take these sizes, or None if they can. ``warpgroups``: 1, or 2
  (``warpgroups_supported``)."""
  if warpgroups == 2:
    bv = block_v or default_block_v(d, vd, c, e, warpgroups=2)
    return (sizes_reason(d, vd, c, e, dtype, bv, BLOCK_VS, "the Mosaic GPU state kernels")
            or warpgroups_supported(d, vd, c, e, bv))
  if warpgroups != 1:
    return f"warpgroups must be 1 or 2, got {warpgroups}"
  bv = block_v or default_block_v(d, vd, c, e)
  reason = sizes_reason(d, vd, c, e, dtype, bv, BLOCK_VS, "the Mosaic GPU state kernels")
  if reason:
    return reason
  if (e * bv) % 32:
    return f"E * block_v must be a multiple of 32 (a warpgroup-wide load of lam), got {e} * {bv}"
  if d * e * bv > STATE_BUDGET:
    return (f"D * E * block_v = {d * e * bv} > {STATE_BUDGET}: the state would not fit one "
            "warpgroup's registers (at D = 128 use warpgroups=2)")
  return None


def default_block_v(d: int, vd: int, c: int, e: int, warpgroups: int = 1) -> int | None:
  """The widest BV in (32, 16) dividing V with E * BV <= 256, a multiple of 32, and the state plus
  one C x E*BV accumulator within REG_BUDGET floats (the rest of the register file for temps).
  ``warpgroups=2`` (D = 128): the widest such BV whose two-warpgroup kernels fit SMEM_LIMIT (each
  warpgroup holds 64 x E*BV state floats and only C x BV accumulators: E * BV = 256 fits)."""
  if warpgroups == 2:
    for bv in (32, 16):
      if (vd % bv == 0 and e * bv <= MAX_N and (e * bv) % 32 == 0
          and max(smem_bytes_2wg(d, c, e, bv, backward) for backward in (False, True))
          <= SMEM_LIMIT):
        return bv
    return None
  for bv in (32, 16):
    if (vd % bv == 0 and e * bv <= MAX_N and (e * bv) % 32 == 0
        and (d + c) * e * bv <= REG_BUDGET):
      return bv
  return None


def default_state_tiles(d: int, vd: int, c: int, e: int, block_v: int | None = None
                        ) -> tuple[int | None, int, int]:
  """(block_v, forward warpgroups, reverse warpgroups) where ``Config`` leaves the warpgroups open.

  block_v: the one given, else ``default_block_v`` for one warpgroup, else (sizes where no
  one-warpgroup block fits, e.g. E = 5 at D = 128) the two-warpgroup one. A pass runs two
  warpgroups where ``warpgroups_supported`` takes them and one warpgroup's state would fill its
  128 registers a thread (D * E * BV >= STATE_BUDGET: E * BV = 128 at D = 128, where the
  one-warpgroup kernels spill). The forward takes them only at BV >= 32: its products over D,
  split over the warpgroups, are E wgmmas of N = BV each, which at BV = 16 (E = 8) made the
  two-warpgroup forward slower than one warpgroup's (benchmarks/RESULTS.md)."""
  bv = block_v or default_block_v(d, vd, c, e)
  if bv is None:
    bv = default_block_v(d, vd, c, e, warpgroups=2)
    wgs = 2 if bv is not None and warpgroups_supported(d, vd, c, e, bv) is None else 1
    return bv, wgs, wgs
  if d * e * bv < STATE_BUDGET or warpgroups_supported(d, vd, c, e, bv) is not None:
    return bv, 1, 1
  return bv, (2 if bv >= 32 else 1), 2


def smem_bytes_2wg(d: int, c: int, e: int, bv: int, backward: bool) -> int:
  """SMEM of a two-warpgroup kernel's chunk loop on hardware (erase, and the forward with save_x,
  the reverse with save_drhs: the most), as the lowering allocates it: each scratch buffer
  rounded up to SMEM_ALIGN, then the barriers (``_N_BARRIERS_2WG`` and the meeting's)."""
  n = e * bv
  bufs = [c * c * 2, c * c * 2,               # A, P
          n * 4,                              # lam_cat
          d * n * 2,                          # S_cat pieces (2, E, 64, BV)
          c * bv * 2]                         # v / dO block
  if backward:
    bufs += [c * d * 2, c * d * 2,            # k, q (2, C, 64) each
             (3 * e + 1) * c * 4,             # factor rows
             c * n * 2, c * n * 2,            # X, Z
             c * bv * 2, c * bv * 4,          # dU bf16, dU f32 (also the partial's buffer)
             c * bv * 2, c * bv * 2]          # A^T dU and dV (``save_drhs``)
  else:
    bufs += [c * d * 2, 2 * c * d * 2,        # q, k (two chunks' buffers)
             (4 * e + 1) * c * 4,             # factor rows (with save_x's c rows)
             c * n * 2,                       # W
             c * bv * 2, c * bv * 2, c * bv * 2, c * bv * 2,   # rhs, U, o, X
             c * bv * 4, c * bv * 4]          # the second warpgroup's R and Y partials
  return (sum(-(-b // SMEM_ALIGN) * SMEM_ALIGN for b in bufs)
          + (_N_BARRIERS_2WG + 1) * BARRIER_BYTES)


def warpgroups_supported(d: int, vd: int, c: int, e: int, block_v: int | None = None
                         ) -> str | None:
  """None if the state kernels take ``warpgroups=2`` at these sizes (bf16 assumed; ``supported``
  checks the dtype), else why not: D must be 128 (one 64-row piece of the state per warpgroup),
  C = 64, E * block_v <= 256 and a multiple of 32, within SMEM_LIMIT."""
  if d != 2 * HALF:
    return f"two warpgroups need D = {2 * HALF} (one {HALF}-row piece each), got {d}"
  bv = block_v or default_block_v(d, vd, c, e, warpgroups=2)
  reason = sizes_reason(d, vd, c, e, BF16, bv, BLOCK_VS, "the two-warpgroup Mosaic GPU state "
                        "kernels")
  if reason:
    return reason
  if (e * bv) % 32:
    return f"E * block_v must be a multiple of 32 (a warpgroup-wide load of lam), got {e} * {bv}"
  need = max(smem_bytes_2wg(d, c, e, bv, backward) for backward in (False, True))
  if need > SMEM_LIMIT:
    return f"two warpgroups at E={e}, block_v={bv} need {need} B of SMEM > {SMEM_LIMIT} B"
  return None


# ------------------------------------------------------------------------------------------------
# Plain-JAX preparation (O(T E) work, plus bf16 copies of A, P).


def _factors(gc_col, k2_col, q2_col, beta_col):
  """Per-row factors as (BH, NC, 3E + 1, C) float32 rows [fe (E), fq (E), fw (E), beta] and the
  per-chunk decay lam (BH, NC, E)."""
  a = jnp.exp(gc_col)
  gl = gc_col[:, :, -1:, :]
  b = jnp.exp(gl - gc_col)
  beta = beta_col.astype(F32)
  fe = beta * k2_col * a
  fq = q2_col * a
  fw = k2_col * b
  rows = jnp.concatenate([fe, fq, fw, beta], axis=-1)          # (BH, NC, C, 3E + 1)
  return jnp.swapaxes(rows, -1, -2), jnp.exp(gl[:, :, 0, :])


def _lam_cat(lam, bv):
  """(BH, NC, E) -> (BH, NC, E * BV): lam_e repeated over its column block."""
  return jnp.repeat(lam, bv, axis=-1)


def _to_cat(x, bv):
  """(BH, E, D, V) -> (BH, V / BV, D, E * BV): column block e of value block j is x[:, e, :, j]."""
  bh, e, d, vd = x.shape
  x = x.reshape(bh, e, d, vd // bv, bv)
  return jnp.transpose(x, (0, 3, 2, 1, 4)).reshape(bh, vd // bv, d, e * bv)


def _from_cat(x, e):
  bh, nv, d, n = x.shape
  bv = n // e
  x = x.reshape(bh, nv, d, e, bv)
  return jnp.transpose(x, (0, 3, 2, 1, 4)).reshape(bh, e, d, nv * bv)


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def _forward_inputs(q, k, v, a, p, f, lam_cat, h0, *, bv):
  """The forward kernels' gmem inputs: q, k, v, A and P in bf16, the factor rows, lam_cat and h0
  in the cat layout."""
  return (q, k, v, a.astype(BF16), p.astype(BF16), f, lam_cat, _to_cat(h0.astype(F32), bv))


def _reverse_inputs(q, k, do, a, p, f, lam_cat, dht, *, bv):
  """The reverse kernels' gmem inputs: k, q, dO, A and P in bf16 (the transposes Q^T, A^T, P^T
  are views in SMEM), the factor rows, lam_cat and dht in the cat layout."""
  return (k, q, do.astype(q.dtype), a.astype(BF16), p.astype(BF16), f, lam_cat,
          _to_cat(dht.astype(F32), bv))


def _prologue(q, vd, k2_col, q2_col, gc_col, beta_col, block_v, warpgroups=1):
  """Shapes, the checked value block and the row factors: (bh, nc, c, d, e, bv, f, lam_cat)."""
  bh, nc, c, d = q.shape
  e_dim = k2_col.shape[-1]
  if warpgroups not in (1, 2):
    raise ValueError(f"warpgroups must be 1 or 2, got {warpgroups}")
  bv = block_v or default_block_v(d, vd, c, e_dim, warpgroups=warpgroups)
  reason = supported(d, vd, c, e_dim, q.dtype, bv, warpgroups=warpgroups)
  if reason:
    raise ValueError(reason)
  f, lam = _factors(gc_col, k2_col, q2_col, beta_col)
  return bh, nc, c, d, e_dim, bv, f, _lam_cat(lam, bv)


# ------------------------------------------------------------------------------------------------
# Kernel helpers.


def _smem(shape, dtype, swizzle=None):
  if swizzle is None:
    return plgpu.SMEM(shape, dtype)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)),
                                              plgpu.SwizzleTransform(swizzle)))


def _swizzle(cols, dtype=BF16):
  return plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)


class _Ops:
  """Layout casts, matmuls and row / column broadcasts, with the interpret-mode substitutes."""

  def __init__(self, interpret):
    self.interpret = bool(interpret)

  def cast(self, x, layout):
    return x if self.interpret else plgpu.layout_cast(x, layout)

  def acc(self, x):
    return self.cast(x, plgpu.Layout.WGMMA)

  def rowvec(self, ref, idx, cols):
    """Row factor ref[idx] (length M) broadcast to (M, cols) in the WGMMA layout."""
    vec = self.cast(ref[idx], plgpu.Layout.WGMMA.reduce(1))
    return lax.broadcast_in_dim(vec, (vec.shape[0], cols), [0])

  def colvec(self, ref, rows):
    """Column factor ref[...] (length N) broadcast to (rows, N) in the WGMMA layout."""
    vec = self.cast(ref[...], plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(vec, (rows, vec.shape[0]), [1])

  def transposed(self, ref, interp_s):
    """ref^T as a wgmma operand: on hardware a transposed view of ref's SMEM
    (``plgpu.transpose_ref``, no copy); the interpreter cannot apply a transposed ref, so in
    interpret mode an explicit transpose written into ``interp_s`` (SMEM of interpret mode
    only, None on hardware)."""
    if self.interpret:
      interp_s[...] = ref[...].T
      return interp_s
    return plgpu.transpose_ref(ref, (1, 0))

  @jax.named_scope("product")      # a region of its own (``trace_regions``), as below
  def mm(self, a_ref, b_ref):
    """a @ b, float32 accumulation, both operands SMEM refs."""
    m, n = a_ref.shape[0], b_ref.shape[1]

    def body(acc):
      plgpu.wgmma(acc, a_ref, b_ref)
      return acc[...]

    return pl.run_scoped(body, plgpu.ACC((m, n), F32))

  def mm_add(self, init, pairs):
    """init + sum of a @ b over (a_ref, b_ref) pairs. On hardware the wgmmas accumulate into
    init's registers (``run_state`` with ``ACC.init``); the interpreter has neither, so there a
    fresh accumulator is added."""
    if self.interpret:
      m, n = init.shape

      def body(acc):
        for a_ref, b_ref in pairs:
          plgpu.wgmma(acc, a_ref, b_ref)
        return acc[...]

      return init + pl.run_scoped(body, plgpu.ACC((m, n), F32))

    def body(acc):
      for a_ref, b_ref in pairs:
        plgpu.wgmma(acc, a_ref, b_ref)

    return pl.run_state(body)(plgpu.ACC.init(self.acc(init)))


def _load(pairs, bars, first=0):
  """Start the TMA copies (src gmem ref, dst smem ref), one barrier each from slot ``first``."""
  for slot, (src, dst) in enumerate(pairs, first):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[slot])


def _wait(n, bars, first=0):
  for slot in range(first, first + n):
    plgpu.barrier_wait(bars.at[slot])


@jax.named_scope("state to SMEM")
def _store_blocks(x, ref, e_dim, bv, dtype):
  """ref[e] = x[:, e-th column block] for each e (ref (E, rows, BV))."""
  for e in range(e_dim):
    ref[e] = x[:, e * bv:(e + 1) * bv].astype(dtype)


@jax.named_scope("sum over e")
def _e_reduce(ops, x, f_s, first_row, bv):
  """sum_e diag(f[first_row + e]) x[:, e-th column block]: an (M, E*BV) product reduced over e
  to (M, BV) in registers (static column slices, each scaled by its row factor)."""
  out = None
  for e in range(x.shape[1] // bv):
    term = ops.rowvec(f_s, first_row + e, bv) * x[:, e * bv:(e + 1) * bv]
    out = term if out is None else out + term
  return out


def _e_reduced_product(ops, lhs_s, cat_s, f_s, first_row, bv):
  """sum_e diag(f[first_row + e]) (lhs @ S_cat)[:, e-th column block], from S_cat's bf16 operand
  ``cat_s`` (D, E*BV)."""
  return _e_reduce(ops, ops.mm(lhs_s, cat_s), f_s, first_row, bv)


@jax.named_scope("expand over e")
def _e_expand(ops, dst_s, y, f_s, first_row, bv, coef=1.0):
  """[coef diag(f[first_row + e]) y]_e: the (M, BV) ``y`` scaled by each slice's row factor into
  column block e of the bf16 (M, E*BV) ``dst_s`` (the wgmma operand the [.]_e products read): the
  reverse of ``_e_reduce``."""
  for e in range(dst_s.shape[1] // bv):
    f = ops.rowvec(f_s, first_row + e, bv)
    dst_s[:, e * bv:(e + 1) * bv] = ((f if coef == 1.0 else coef * f) * y).astype(BF16)


def _rhs_gradients(ops, rhs_s, drhs, f_s, beta_row, bv):
  """Into the (C, BV) buffers ``rhs_s``: A^T dU (``drhs``, float32) and dV = beta A^T dU, each
  rounded once to its buffer's dtype (the reverse passes' ``save_drhs``)."""
  drhs_s, dv_s = rhs_s
  drhs_s[...] = drhs.astype(drhs_s.dtype)
  dv_s[...] = (ops.rowvec(f_s, beta_row, bv) * drhs).astype(dv_s.dtype)


class _Inputs:
  """A state pass's per-chunk inputs: each a TMA copy gmem -> its own SMEM buffer, with its own
  barrier, so that each is waited for where it is first read. ``start`` begins a loop step's
  copies, ``start_next`` the next step's (the forward pass: into the buffer its last reader has
  just released). ``copies`` maps a name to (chunk -> gmem ref, smem ref, barrier slot); a name in
  ``double`` has two SMEM buffers and two barriers (slots b, b + 1), picked by the parity of the
  loop step, for inputs that are read until the chunk's end and needed again at its start.

  ``order(step)`` is the chunk that loop step ``step`` works on (reversed in the backward pass).
  Each barrier has at most one copy in flight and is waited once per copy, in issue order."""

  def __init__(self, bars, copies, *, order, nc, double=()):
    self.bars, self.copies, self.double, self.order, self.nc = bars, copies, double, order, nc

  @classmethod
  def of(cls, bars, inputs, *, row, cols, value, srcs=None, **kw):
    """From (name, gmem ref, smem ref) triples, barrier slots in their order (two for a ``double``
    one): every input is copied whole per chunk of its (BH, NC, ...) ref at ``row``, except
    ``value``, whose value block ``cols`` is copied, and those named in ``srcs`` (name -> chunk ->
    gmem ref: inputs in another layout)."""
    copies, slot = {}, 0
    for name, gmem, smem in inputs:
      if srcs and name in srcs:
        src = srcs[name]
      elif name == value:
        src = lambda n, g=gmem: g.at[row, n, :, cols]
      else:
        src = lambda n, g=gmem: g.at[row, n]
      copies[name] = (src, smem, slot)
      slot += 2 if name in kw.get("double", ()) else 1
    return cls(bars, copies, **kw)

  def _slot(self, name, step):
    src, dst, bar = self.copies[name]
    if name in self.double:
      parity = step % 2
      return src, dst.at[parity], bar + parity
    return src, dst, bar

  def ref(self, name, step):
    return self._slot(name, step)[1]

  def start(self, names, step):
    for name in names:
      src, dst, bar = self._slot(name, step)
      plgpu.copy_gmem_to_smem(src(self.order(step)), dst, self.bars.at[bar])

  def start_next(self, names, step):
    """Start step + 1's copies of ``names`` (none after the last step). Every thread must be done
    with the buffers (a ``commit_smem``, i.e. a warpgroup barrier, after their last reads)."""
    @pl.when(step + 1 < self.nc)
    def _():
      self.start(names, step + 1)

  def wait(self, name, step):
    with jax.named_scope(f"wait {name}"):       # a region of its own (``trace_regions``)
      plgpu.barrier_wait(self.bars.at[self._slot(name, step)[2]])


def _chunk_box(heads, i, c, pieces=1, nc=0):
  """``at(g, n, cols)``: program i's chunk n of a per-token gmem ref ``g``, columns ``cols`` of
  its last dim (all by default). Without ``heads`` g is (BH, NC, C, X) and the box is
  ``g.at[i, n, :, cols]``; with ``heads=H`` g is the caller's (B, T, H, X) and the box is the
  strided ``g.at[b, pl.ds(n * C, C), h, cols]`` (row stride H * X), b = i // H, h = i % H.
  With ``pieces`` P > 1 (the pass over P pieces of NC = ``nc`` chunks each, ``pieces.py``) row i
  is piece i % P of (b, h) = divmod(i // P, H), whose chunk n is the caller's chunk
  (i % P) * NC + n."""
  if heads is None:
    return lambda g, n, cols=slice(None): g.at[i, n, :, cols]
  if pieces == 1:
    b, h = i // heads, i % heads
    return lambda g, n, cols=slice(None): g.at[b, pl.ds(n * c, c), h, cols]
  row, first = i // pieces, (i % pieces) * nc
  b, h = row // heads, row % heads
  return lambda g, n, cols=slice(None): g.at[b, pl.ds((first + n) * c, c), h, cols]


def _begin_chunk(carry, carry_s, out_s):
  """Write the carried (D, E*BV) state as the chunk's bf16 wgmma operand (``carry_s``) and into
  the per-chunk output buffer ``out_s`` (E, D, BV), which ``_publish_chunk`` stores after the next
  ``commit_smem`` (None: the forward without residuals, which stores no chunk-start state). The
  previous chunk's TMA stores must have read the output buffers (waited here, o's too), and its
  last wgmma (the state update, which read ``carry_s``) must be complete: the caller's
  ``plgpu.wgmma_wait(0)``, which also frees the buffers that update read."""
  _wait_stores()
  with jax.named_scope("state to SMEM"):
    carry_s[...] = carry.astype(BF16)
    if out_s is not None:
      e_dim, _, bv = out_s.shape
      _store_blocks(carry, out_s, e_dim, bv, out_s.dtype)


@jax.named_scope("wait stores")
def _wait_stores():
  """Wait for this warpgroup's TMA stores to have read their SMEM buffers."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _publish_chunk(out_s, out_at):
  """Start the TMA stores of the per-chunk state output (after a ``commit_smem``)."""
  for e in range(out_s.shape[0]):
    plgpu.copy_smem_to_gmem(out_s.at[e], out_at(e))


def _load_cat(ops, src, cat, barrier):
  """The carried (D, E*BV) float32 state from gmem, through a scoped SMEM buffer."""
  def body(cat_s):
    plgpu.copy_gmem_to_smem(src, cat_s, barrier)
    plgpu.barrier_wait(barrier)
    return ops.acc(cat_s[...])
  return pl.run_scoped(body, cat)


def _store_cat(x, dst, cat):
  def body(cat_s):
    cat_s[...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(cat_s, dst)
    plgpu.wait_smem_to_gmem(0)
  pl.run_scoped(body, cat)


@contextlib.contextmanager
def _stages():
  """Consecutive named regions of one chunk's code: ``stage(name)`` ends the current region and
  begins ``name`` (a ``jax.named_scope``, so a region nests the ones opened inside it, e.g. an
  input's wait); the last ends with the ``with``. Mosaic GPU's profiler records them under
  ``trace_regions``; otherwise they only name the code."""
  scopes = contextlib.ExitStack()

  def stage(name):
    scopes.close()
    scopes.enter_context(jax.named_scope(name))

  with scopes:
    yield stage


def _chunk_loop(chunk, nc, init, scratch, prologue, xbar=None):
  """fori_loop over the chunks inside one SMEM scope (``scratch``), after ``prologue(*refs)`` (the
  first chunk's copies); the scope is released before the final state's buffer is allocated (the
  two do not fit together at D * E * BV = 64 * 256). With ``xbar`` (two warpgroups) the scope is
  shared by both, who meet at it before the scope ends. ``chunk(n, carry, *refs, stage=...)``
  marks its stages with ``stage`` (``_stages``)."""
  def step(n, carry, refs):
    with _stages() as stage:
      return chunk(n, carry, *refs, stage=stage)

  def body(*refs):
    prologue(*refs)
    out = lax.fori_loop(0, nc, lambda n, s: step(n, s, refs), init)
    _wait_stores()
    if xbar is not None:
      _sync(xbar)
    return out
  return pl.run_scoped(body, *scratch, collective_axes=("wg",) * (xbar is not None))


_TRACE = contextvars.ContextVar("triadic_mosaic_trace", default=None)


@contextlib.contextmanager
def trace_regions(directory: str, regions: int):
  """A diagnostic: the kernels of this module built inside record the named regions of their
  chunk loops (the stages of ``_stages`` and, nested in them, each input's wait and the
  helpers' parts: products, sums and expansions over e, the state's SMEM stores, the waits for
  TMA stores) with Mosaic GPU's profiler (``plgpu.CompilerParams.profile_space``). Each run of a
  kernel writes a Perfetto trace into ``directory``: per warpgroup, the SM clock at every
  region's start and end (``benchmarks/common.kernel_regions`` sums them). ``regions`` bounds the
  regions one warpgroup records in a run; each costs 16 bytes of its block's shared memory, so a
  kernel whose SMEM is near the limit needs fewer chunks (T). Recording is two shared-memory
  stores a region, by one thread of each warpgroup. JAX's caches are cleared on entry and exit,
  so that no program compiled outside is reused inside or the other way round."""
  if not isinstance(regions, int) or regions < 1:
    raise ValueError(f"regions must be a positive int, got {regions!r}")
  jax.clear_caches()
  token = _TRACE.set((str(directory), regions))
  try:
    yield
  finally:
    _TRACE.reset(token)
    jax.clear_caches()


def _compiler_params(*, regions: bool = True):
  """The kernels' compiler parameters: the regions recording inside ``trace_regions`` (where
  ``regions``), and the lowering semantics named rather than left to JAX's default, which is
  Lane up to jax 0.10 and Warpgroup from 0.11, so that the CPU's CUDA lowering tests (jax 0.10)
  lower the kernels the way the GPU's JAX does."""
  semantics = plgpu.LoweringSemantics.Warpgroup
  trace = _TRACE.get()
  if trace is None or not regions:
    return plgpu.CompilerParams(lowering_semantics=semantics)
  directory, n = trace
  return plgpu.CompilerParams(profile_space=n, profile_dir=directory, lowering_semantics=semantics)


# ------------------------------------------------------------------------------------------------
# Forward.


def _forward_kernel(q_g, k_g, v_g, a_g, p_g, f_g, lam_g, h0_g, *outs_and_bars, scratch, cat, nc,
                    e_dim, bv, scale, erase, save_x, interpret, heads=None, pieces=1,
                    residuals=True):
  if not residuals:                   # o and the final state only
    o_g, ht_g, bars = outs_and_bars
  elif save_x:
    o_g, u_g, x_g, st_g, ht_g, bars = outs_and_bars
  else:
    o_g, u_g, st_g, ht_g, bars = outs_and_bars
  ops = _Ops(interpret)
  i, j = lax.axis_index("bh"), lax.axis_index("v")
  cols = pl.ds(j * bv, bv)
  if heads is None:
    srcs, o_at = None, lambda n: o_g.at[i, n, :, cols]
  else:
    # q, k, v and o in (B, T, H, X): chunk n of head h is a strided (C, X) box of TMA.
    at = _chunk_box(heads, i, f_g.shape[-1], pieces, nc)
    srcs = {"q": lambda n: at(q_g, n), "k": lambda n: at(k_g, n), "v": lambda n: at(v_g, n, cols)}
    o_at = lambda n: at(o_g, n, cols)
  erase_rows, read_rows, write_rows, beta_row = 0, e_dim, 2 * e_dim, 3 * e_dim
  x_rows = 3 * e_dim + 1              # save_x: c = k2 a (E rows) after beta
  state0 = _load_cat(ops, h0_g.at[i, j], cat, bars.at[CAT_BARRIER])

  def copies(q_s, k_s, v_s, a_s, p_s, f_s, lam_s):
    return _Inputs.of(bars, [("q", q_g, q_s), ("k", k_g, k_s), ("v", v_g, v_s), ("a", a_g, a_s),
                             ("p", p_g, p_s), ("lam", lam_g, lam_s), ("f", f_g, f_s)],
                      row=i, cols=cols, value="v", srcs=srcs, double=("f", "k"),
                      order=lambda n: n, nc=nc)

  # A only enters through the erase term, K through it and as the state update's K^T.
  first = ("q", "k", "v", "a", "p", "lam", "f") if erase else ("q", "v", "p", "lam", "f")
  # Without erase K is read only by the state update at the chunk's end: its copy starts at the
  # chunk's top.
  at_end = () if erase else ("k",)

  def prologue(*refs):
    copies(*refs[:7]).start(first, 0)

  def chunk(n, s, q_s, k_bufs, v_s, a_s, p_s, f_bufs, lam_s, state_bf16_s, w_s, rhs_bf16_s,
            u_bf16_s, o_s, *extra, stage):
    ins = copies(q_s, k_bufs, v_s, a_s, p_s, f_bufs, lam_s)
    st_s = extra[0] if residuals else None              # the chunk-start state's buffer
    extra = extra[residuals:]
    x_out, interp = extra[:save_x], extra[save_x:]      # interp: K^T, interpret mode only
    f_s, k_s = ins.ref("f", n), ins.ref("k", n)
    d = q_s.shape[1]
    stage("wait update")
    plgpu.wgmma_wait(0)                   # the previous state update has read S_cat, K^T
    stage("chunk start")
    _begin_chunk(s, state_bf16_s, st_s)
    ins.wait("lam", n)
    decayed = ops.colvec(lam_s, d) * s
    plgpu.commit_smem()
    if residuals:
      _publish_chunk(st_s, lambda e: st_g.at[i, n, e, :, cols])
    ins.start_next(("lam",), n)
    ins.start(at_end, n)

    stage("rhs")
    ins.wait("f", n)
    ins.wait("v", n)
    beta = ops.rowvec(f_s, beta_row, bv)
    if erase:
      ins.wait("k", n)
      if save_x:
        # X = V - sum_e diag(c_e) R_e, which the chunk-parallel backward reads; rhs = beta X.
        x = ops.acc(v_s[...].astype(F32)) - _e_reduced_product(
            ops, k_s, state_bf16_s, f_s, x_rows, bv)
        x_out[0][...] = x.astype(x_out[0].dtype)
        rhs = beta * x
      else:
        rhs = beta * ops.acc(v_s[...].astype(F32)) - _e_reduced_product(
            ops, k_s, state_bf16_s, f_s, erase_rows, bv)
      rhs_bf16_s[...] = rhs.astype(BF16)
      plgpu.commit_smem()
      ins.start_next(("k", "v"), n)
      if save_x:
        plgpu.copy_smem_to_gmem(x_out[0], x_g.at[i, n, :, cols])
      stage("U")
      ins.wait("a", n)
      u = ops.mm(a_s, rhs_bf16_s)
    else:
      stage("U")
      u = beta * ops.acc(v_s[...].astype(F32))
    u_bf16_s[...] = u.astype(BF16)
    _e_expand(ops, w_s, u, f_s, write_rows, bv)
    plgpu.commit_smem()
    ins.start_next(("a",) if erase else ("v",), n)
    if residuals:
      plgpu.copy_smem_to_gmem(u_bf16_s, u_g.at[i, n, :, cols])

    stage("output")
    ins.wait("q", n)
    y = _e_reduced_product(ops, q_s, state_bf16_s, f_s, read_rows, bv)
    ins.wait("p", n)
    out = ops.mm(p_s, u_bf16_s) + y
    o_s[...] = (scale * out).astype(o_s.dtype)
    plgpu.commit_smem()
    ins.start_next(("q", "p", "f"), n)
    plgpu.copy_smem_to_gmem(o_s, o_at(n))

    stage("update")
    for name in at_end:
      ins.wait(name, n)
    return ops.mm_add(decayed, [(ops.transposed(k_s, *interp or [None]), w_s)])

  state = _chunk_loop(chunk, nc, state0, scratch, prologue)
  _store_cat(state, ht_g.at[i, j], cat)


def _check_pieces(heads, pieces):
  """``pieces`` is for the caller's layout: (BH, NC, ...) operands are cut by a reshape alone."""
  if pieces != 1 and heads is None:
    raise ValueError(f"pieces={pieces!r} needs heads (the (B, T, H, X) layout); cut (BH, NC, ...) "
                     "operands into pieces by reshaping them")


def _check_heads(heads, pieces, k2_col, q, **arrays):
  """The (B, T, H, X) layout's checks (a state pass with ``heads``, ``common.check_heads``): q and
  every one of ``arrays`` is (B, T, H, X) with B * H and T = NC * C matching the (BH, NC, C, E)
  operands, which with ``pieces`` P are (BH * P, NC / P, C, E). Returns q's shape in the
  (BH * P, NC / P, C, D) layout, which ``_prologue`` reads."""
  if not isinstance(pieces, int) or pieces < 1 or k2_col.shape[0] % pieces:
    raise ValueError(f"pieces must be a positive int dividing the operands' leading dim "
                     f"{k2_col.shape[0]}, got {pieces!r}")
  rows, nc, c = k2_col.shape[:3]
  check_heads(heads, rows // pieces, nc * pieces, c, q=q, **arrays)
  return jax.ShapeDtypeStruct((*k2_col.shape[:3], q.shape[-1]), q.dtype)


def state_pass(q, k, v, k2_col, q2_col, gc_col, beta_col, a, p, h0, *, scale, erase, block_v=None,
               save_x=False, warpgroups=1, heads=None, pieces=1, residuals=True, interpret=False):
  """Chunk loop forward (``recurrent.state_pass`` without ``cfg``). Returns o (BH,NC,C,V) in q's
  dtype, U (BH,NC,C,V) in q's dtype, chunk-start states (BH,NC,E,D,V) in q's dtype, final state
  (BH,E,D,V) float32. ``save_x`` (erase only): also X = V - sum_e diag(k2_e exp(gc_e)) K S_e
  (BH,NC,C,V) in q's dtype, after U: the chunk-parallel backward's ``x``. ``warpgroups``: 1, or 2
  at D = 128 (``warpgroups_supported``; block_v default ``default_block_v(.., warpgroups=2)``).
  ``residuals=False``: o and the final state only, for a forward that no backward follows
  (the op's primal): the kernel neither stores U nor the chunk-start states (a custom
  call's outputs cannot be dropped by XLA, so unread outputs would still be written) and the one
  warpgroup kernel allocates no (E, D, BV) buffer for them; ``save_x`` needs residuals.

  ``heads=H`` (either warpgroup count): q, k, v are in the user's (B, T, H, X) layout with
  T = NC * C and o is returned (B, T, H, V); the kernel reads and writes them in place by TMA,
  which saves the relayout copies of q, k, v and o (``ops.kernel_layout``). Every other operand
  and output keeps its (BH, ...) layout, BH = B * H with b = i // H, h = i % H. With ``heads``,
  ``pieces`` P > 1 runs the pass over P pieces of the sequence (``pieces.py``): every (BH, ...)
  operand and output is (BH * P, NC / P, ...) (row (b * H + h) * P + piece), q, k, v and o stay
  whole."""
  vd = v.shape[-1]
  _check_pieces(heads, pieces)
  shape = q if heads is None else _check_heads(heads, pieces, k2_col, q, k=k, v=v)
  bh, nc, c, d, e_dim, bv, f, lam_cat = _prologue(shape, vd, k2_col, q2_col, gc_col, beta_col,
                                                  block_v, warpgroups)
  save_x = bool(save_x and erase)
  if save_x and not residuals:
    raise ValueError("save_x needs residuals=True (X is a residual for the backward)")
  residuals = bool(residuals)
  if save_x:
    f = jnp.concatenate([f, _t(k2_col * jnp.exp(gc_col))], axis=2)   # rows [.., beta, c (E)]
  if warpgroups == 2:
    return _forward_2wg(q, k, v, a, p, f, lam_cat, h0, e_dim=e_dim, bv=bv, scale=scale,
                        erase=erase, save_x=save_x, heads=heads, pieces=pieces,
                        residuals=residuals, interpret=interpret)
  n_rows = f.shape[2]
  n_cat = e_dim * bv
  ins = _forward_inputs(q, k, v, a, p, f, lam_cat, h0, bv=bv)
  sw_v = _swizzle(bv)
  scratch = [
      _smem((c, d), BF16, sw_v),          # q
      _smem((2, c, d), BF16, sw_v),       # k, two chunks' (chunk n's K^T read after n + 1's copy)
      _smem((c, bv), BF16, sw_v),         # v block
      _smem((c, c), BF16, sw_v),          # A
      _smem((c, c), BF16, sw_v),          # P
      _smem((2, n_rows, c), F32),         # row factors (two chunks' buffers)
      _smem((n_cat,), F32),               # lam_cat
      _smem((d, n_cat), BF16, sw_v),      # S_cat (bf16 operand)
      _smem((c, n_cat), BF16, sw_v),      # W = [diag(fw_e) U]_e
      _smem((c, bv), BF16, sw_v),         # rhs (bf16 operand)
      _smem((c, bv), BF16, sw_v),         # U (bf16 operand)
      _smem((c, bv), q.dtype, sw_v),      # o
  ] + ([_smem((e_dim, d, bv), q.dtype, sw_v)] if residuals else []) + (   # chunk-start state
      [_smem((c, bv), q.dtype, sw_v)] if save_x else []) + (               # X
      [_smem((d, c), BF16, sw_v)] if interpret else [])             # K^T (interpret mode)
  cat = _smem((d, n_cat), F32, _swizzle(n_cat, F32))     # initial / final state (cat layout)
  kernel = functools.partial(_forward_kernel, scratch=scratch, cat=cat, nc=nc, e_dim=e_dim,
                             bv=bv, scale=scale, erase=erase, save_x=save_x,
                             interpret=bool(interpret), heads=heads, pieces=pieces,
                             residuals=residuals)
  *outs, ht = plgpu.kernel(
      kernel,
      out_type=_forward_out_types(q, bh, nc, c, d, vd, e_dim, bv, save_x, heads, residuals),
      scratch_types=[plgpu.Barrier(num_barriers=CAT_BARRIER + 1)], grid=(bh, vd // bv),
      grid_names=("bh", "v"),
      compiler_params=_compiler_params(),
      interpret=_interpret_params(interpret), kernel_name="triadic_forward_mgpu",
  )(*ins)
  return (*outs, _from_cat(ht, e_dim))


def _forward_out_types(q, bh, nc, c, d, vd, e_dim, bv, save_x, heads, residuals):
  """The forward passes' outputs: o (the caller's (B, T, H, V) with heads), [U, [X (save_x),]
  the chunk-start states (residuals),] the final state in the cat layout."""
  per_chunk = jax.ShapeDtypeStruct((bh, nc, c, vd), q.dtype)
  o_type = per_chunk if heads is None else jax.ShapeDtypeStruct((*q.shape[:3], vd), q.dtype)
  saved = ([per_chunk] + [per_chunk] * save_x
           + [jax.ShapeDtypeStruct((bh, nc, e_dim, d, vd), q.dtype)]) if residuals else []
  return [o_type, *saved, jax.ShapeDtypeStruct((bh, vd // bv, d, e_dim * bv), F32)]


# ------------------------------------------------------------------------------------------------
# Backward state pass.


def _backward_kernel(k_g, q_g, do_g, a_g, p_g, f_g, lam_g, dht_g, du_g, *outs_and_bars, scratch,
                     cat, nc, e_dim, bv, scale, erase, save_drhs, interpret, heads=None,
                     pieces=1):
  rhs_g = outs_and_bars[:2 * save_drhs]        # save_drhs: A^T dU and dV = beta A^T dU
  dst_g, dh0_g, bars = outs_and_bars[2 * save_drhs:]
  ops = _Ops(interpret)
  i, j = lax.axis_index("bh"), lax.axis_index("v")
  cols = pl.ds(j * bv, bv)
  # k, q, dO (and dV): chunk n of row i, or with heads a strided (C, X) box of (B, T, H, X).
  at = _chunk_box(heads, i, f_g.shape[-1], pieces, nc)
  rhs_at = _rhs_boxes(rhs_g, at, i, cols)
  srcs = None
  if heads is not None:
    srcs = {"k": lambda n: at(k_g, n), "q": lambda n: at(q_g, n),
            "do": lambda n: at(do_g, n, cols)}
  erase_rows, read_rows, write_rows, beta_row = 0, e_dim, 2 * e_dim, 3 * e_dim
  dstate0 = _load_cat(ops, dht_g.at[i, j], cat, bars.at[CAT_BARRIER])

  def copies(k_s, q_s, do_s, a_s, p_s, f_s, lam_s):
    return _Inputs.of(bars, [("k", k_g, k_s), ("q", q_g, q_s), ("do", do_g, do_s),
                             ("a", a_g, a_s), ("p", p_g, p_s), ("lam", lam_g, lam_s),
                             ("f", f_g, f_s)],
                      row=i, cols=cols, value="do", srcs=srcs, order=lambda step: nc - 1 - step,
                      nc=nc)

  first = ("k", "do", "p", "lam", "f") + (("a",) if erase else ())
  at_end = ("q",)                       # read only by the state update at the end, as Q^T

  def chunk(step, ds, k_s, q_s, do_s, a_s, p_s, f_s, lam_s, state_bf16_s, x_s, z_s, du_s, st_s,
            *extra, stage):
    rhs_s, interp = extra[:2 * save_drhs], extra[2 * save_drhs:]  # interp: interpret mode only
    ins = copies(k_s, q_s, do_s, a_s, p_s, f_s, lam_s)
    # The operands K^T, Q^T, A^T, P^T: views of the copies of K, Q, A, P (interp: their explicit
    # transposes in interpret mode).
    tr = lambda ref, at: ops.transposed(ref, interp[at] if interp else None)
    n = nc - 1 - step
    d = k_s.shape[1]
    stage("wait update")
    plgpu.wgmma_wait(0)                   # the previous state update has read dS_cat, K, Q
    stage("chunk start")
    plgpu.commit_smem()
    ins.start(first, step)
    _begin_chunk(ds, state_bf16_s, st_s)
    ins.wait("lam", step)
    decayed = ops.colvec(lam_s, d) * ds
    plgpu.commit_smem()
    _publish_chunk(st_s, lambda e: dst_g.at[i, n, e, :, cols])
    ins.start(at_end, step)

    stage("dU")
    ins.wait("k", step)
    r = ops.mm(k_s, state_bf16_s)
    ins.wait("p", step)
    ins.wait("do", step)
    du = scale * ops.mm(tr(p_s, 3), do_s)
    ins.wait("f", step)
    du = du + _e_reduce(ops, r, f_s, write_rows, bv)
    du_s[...] = du.astype(du_s.dtype)       # the output, and with erase A^T dU's operand
    stage("X, Z")
    do = ops.acc(do_s[...].astype(F32))
    _e_expand(ops, x_s, do, f_s, read_rows, bv, scale)
    if erase:
      plgpu.commit_smem()
      ins.wait("a", step)
      drhs = ops.mm(tr(a_s, 2), du_s)
      _e_expand(ops, z_s, drhs, f_s, erase_rows, bv, -1.0)
      if save_drhs:
        _rhs_gradients(ops, rhs_s, drhs, f_s, beta_row, bv)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(du_s, du_g.at[i, n, :, cols])
    for out_s, out_at in zip(rhs_s, rhs_at):
      plgpu.copy_smem_to_gmem(out_s, out_at(n))
    stage("update")
    for name in at_end:
      ins.wait(name, step)
    pairs = [(tr(q_s, 1), x_s)]
    if erase:
      pairs.append((tr(k_s, 0), z_s))
    return ops.mm_add(decayed, pairs)

  dstate = _chunk_loop(chunk, nc, dstate0, scratch, lambda *refs: None)
  _store_cat(dstate, dh0_g.at[i, j], cat)


def reverse_state_pass(q, k, do, k2_col, q2_col, gc_col, beta_col, a, p, dht, *, scale, erase,
                       block_v=None, warpgroups=1, heads=None, pieces=1, save_drhs=False,
                       interpret=False):
  """Reverse chunk loop (``recurrent.reverse_state_pass`` without ``cfg``). Returns dU (BH,NC,C,V)
  in ``common.du_dtype``, chunk-end state gradients (BH,NC,E,D,V) in q's dtype, gradient of the
  initial state (BH,E,D,V) float32. ``warpgroups``: as ``state_pass``. ``save_drhs`` (erase
  only): also, after dU, A^T dU, which the pass forms for the state gradient anyway, and
  dV = beta A^T dU (BH,NC,C,V; dV in the caller's (B,T,H,V) with ``heads``) in q's dtype, each
  rounded once from float32: what the chunk-parallel backward reads
  (``mosaic_backward.chunk_gradients``' ``drhs``, ``dv``).

  ``heads=H``: q, k (B, T, H, D) and do (B, T, H, V) are in the user's layout with T = NC * C,
  read in place by TMA as in ``state_pass``; every output keeps its layout. ``pieces``: as in
  ``state_pass``."""
  vd = do.shape[-1]
  _check_pieces(heads, pieces)
  shape = q if heads is None else _check_heads(heads, pieces, k2_col, q, k=k, do=do)
  bh, nc, c, d, e_dim, bv, f, lam_cat = _prologue(shape, vd, k2_col, q2_col, gc_col, beta_col,
                                                  block_v, warpgroups)
  save_drhs = bool(save_drhs and erase)
  if warpgroups == 2:
    return _backward_2wg(q, k, do, a, p, f, lam_cat, dht, e_dim=e_dim, bv=bv, scale=scale,
                         erase=erase, save_drhs=save_drhs, heads=heads, pieces=pieces,
                         interpret=interpret)
  n_cat = e_dim * bv
  ins = _reverse_inputs(q, k, do, a, p, f, lam_cat, dht, bv=bv)
  sw_v = _swizzle(bv)
  du_type = du_dtype(q.dtype, erase)
  scratch = [
      _smem((c, d), BF16, sw_v),          # k
      _smem((c, d), BF16, sw_v),          # q
      _smem((c, bv), BF16, sw_v),         # dO block
      _smem((c, c), BF16, sw_v),          # A
      _smem((c, c), BF16, sw_v),          # P
      _smem((3 * e_dim + 1, c), F32),     # row factors
      _smem((n_cat,), F32),               # lam_cat
      _smem((d, n_cat), BF16, sw_v),      # dS_cat (bf16 operand)
      _smem((c, n_cat), BF16, sw_v),      # X = [scale diag(fq_e) dO]_e
      _smem((c, n_cat), BF16, sw_v),      # Z = [-diag(fe_e) A^T dU]_e
      _smem((c, bv), du_type, _swizzle(bv, du_type)),     # dU (``du_dtype``)
      _smem((e_dim, d, bv), q.dtype, sw_v),               # chunk-end state gradient
  ] + _rhs_buffers(c, bv, q.dtype, save_drhs) + (
      [_smem((d, c), BF16, sw_v), _smem((d, c), BF16, sw_v),    # K^T, Q^T, A^T, P^T
       _smem((c, c), BF16, sw_v), _smem((c, c), BF16, sw_v)]    # (interpret mode)
      if interpret else [])
  cat = _smem((d, n_cat), F32, _swizzle(n_cat, F32))     # dht / dh0 (cat layout)
  kernel = functools.partial(_backward_kernel, scratch=scratch, cat=cat, nc=nc, e_dim=e_dim,
                             bv=bv, scale=scale, erase=erase, save_drhs=save_drhs,
                             interpret=bool(interpret), heads=heads, pieces=pieces)
  du, *outs, dh0 = plgpu.kernel(
      kernel,
      out_type=_reverse_out_types(bh, nc, c, d, vd, e_dim, bv, q.dtype, erase, save_drhs,
                                  None if heads is None else q.shape[:3]),
      scratch_types=[plgpu.Barrier(num_barriers=CAT_BARRIER + 1)], grid=(bh, vd // bv),
      grid_names=("bh", "v"),
      compiler_params=_compiler_params(),
      interpret=_interpret_params(interpret), kernel_name="triadic_backward_states_mgpu",
  )(*ins)
  return (du, *outs, _from_cat(dh0, e_dim))


def _rhs_boxes(rhs_g, at, i, cols):
  """``save_drhs``' stores: chunk n -> the gmem box of program i's value block ``cols`` of A^T dU
  (BH, NC, C, V) and of dV by ``at`` (``_chunk_box``: the caller's (B, T, H, V) with heads)."""
  if not rhs_g:
    return ()
  drhs_g, dv_g = rhs_g
  return (lambda n: drhs_g.at[i, n, :, cols]), (lambda n: at(dv_g, n, cols))


def _rhs_buffers(c, bv, dtype, save_drhs):
  """The SMEM buffers of ``save_drhs``' per-chunk outputs A^T dU and dV, (C, BV) each."""
  return [_smem((c, bv), dtype, _swizzle(bv)) for _ in range(2 * save_drhs)]


def _reverse_out_types(bh, nc, c, d, vd, e_dim, bv, dtype, erase, save_drhs, token_shape=None):
  """The reverse passes' outputs: dU, [A^T dU, dV (save_drhs; dV of ``token_shape`` (B, T, H)
  with heads),] the chunk-end state gradients and dh0 in the cat layout."""
  per_chunk = jax.ShapeDtypeStruct((bh, nc, c, vd), dtype)
  dv = per_chunk if token_shape is None else jax.ShapeDtypeStruct((*token_shape, vd), dtype)
  return ([jax.ShapeDtypeStruct((bh, nc, c, vd), du_dtype(dtype, erase))]
          + [per_chunk, dv] * save_drhs
          + [jax.ShapeDtypeStruct((bh, nc, e_dim, d, vd), dtype),
             jax.ShapeDtypeStruct((bh, vd // bv, d, e_dim * bv), F32)])


# ------------------------------------------------------------------------------------------------
# Two warpgroups (D = 128): warpgroup w owns state rows [64 w, 64 w + 64) of S_cat.
#
# Barrier slots: 3 w .. 3 w + 2 warpgroup w's own copies (its 64 columns of Q and K, the forward's
# K in two buffers; issued and waited by it alone); 6, 7 the factor rows and lam (issued by
# warpgroup 0, waited by both); 8 .. 10 warpgroup 0's own inputs; 11 + w the carried state's
# rows. ``xbar`` (two arrivals) is the barrier both warpgroups meet at (``_sync``).

_FACTORS, _LAM, _ROWS = 6, 7, 11
_N_BARRIERS_2WG = 13


def _sync(xbar):
  """Both warpgroups meet: every register -> SMEM store before it (fenced for the async proxy
  by ``commit_smem``) is visible after it to the other warpgroup's reads and wgmmas."""
  plgpu.commit_smem()
  plgpu.barrier_arrive(xbar)
  plgpu.barrier_wait(xbar)


def _load_rows(ops, src, cat, barrier, w, xbar):
  """Warpgroup w's (64, E*BV) float32 rows of the carried state from gmem, through a shared
  scoped (2, 64, E*BV) SMEM buffer; both warpgroups have read it before the scope ends."""
  def body(cat_s):
    plgpu.copy_gmem_to_smem(src, cat_s.at[w], barrier)
    plgpu.barrier_wait(barrier)
    x = ops.acc(cat_s.at[w][...])
    _sync(xbar)
    return x
  return pl.run_scoped(body, cat, collective_axes=("wg",))


def _store_rows(x, dst, cat, w):
  def body(cat_s):
    cat_s.at[w][...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(cat_s.at[w], dst)
    plgpu.wait_smem_to_gmem(0)
  pl.run_scoped(body, cat, collective_axes=("wg",))


def _partial(ops, lhs, rhs, f_s, first_row, bv):
  """sum_e diag(f[first_row + e]) (lhs @ S_e): this warpgroup's part (its 64 of the D contracted)
  of an e-reduced C x BV product. ``rhs`` is the warpgroup's bf16 state operand, E (64, BV)
  blocks: E wgmmas of N = BV, one C x BV accumulator at a time."""
  out = None
  for e in range(rhs.shape[0]):
    term = ops.rowvec(f_s, first_row + e, bv) * ops.mm(lhs, rhs.at[e])
    out = term if out is None else out + term
  return out


def _forward_kernel_2wg(q_g, k_g, v_g, a_g, p_g, f_g, lam_g, h0_g, *outs_and_bars, scratch, cat,
                        nc, e_dim, bv, scale, erase, save_x, interpret, heads=None, pieces=1,
                        residuals=True):
  if not residuals:                   # o and the final state only
    o_g, ht_g, bars, xbar = outs_and_bars
  elif save_x:
    o_g, u_g, x_g, st_g, ht_g, bars, xbar = outs_and_bars
  else:
    o_g, u_g, st_g, ht_g, bars, xbar = outs_and_bars
  ops = _Ops(interpret)
  i, j, w = lax.axis_index("bh"), lax.axis_index("v"), lax.axis_index("wg")
  cols, rows = pl.ds(j * bv, bv), pl.ds(w * HALF, HALF)
  # q, k, v, o: (BH, NC, C, X) boxes, or with heads strided boxes of (B, T, H, X).
  at = _chunk_box(heads, i, f_g.shape[-1], pieces, nc)
  read_rows, write_rows, beta_row = e_dim, 2 * e_dim, 3 * e_dim
  # R's row factor: c = k2 a with save_x (X = V - sum_e c_e R_e, rhs = beta X), else fe = beta c.
  r_rows = 3 * e_dim + 1 if save_x else 0
  state0 = _load_rows(ops, h0_g.at[i, j, rows], cat, bars.at[_ROWS + w], w, xbar)

  def copies(q_s, k_s, v_s, a_s, p_s, f_s, lam_s):
    # K is the state update's K^T too: two buffers (slots 3 w + 1, 3 w + 2), chunk n's read by
    # its state update after chunk n + 1's copy has started.
    return _Inputs(bars, {
        "q": (lambda n: at(q_g, n, rows), q_s.at[w], 3 * w),
        "k": (lambda n: at(k_g, n, rows), k_s.at[w], 3 * w + 1),
        "f": (lambda n: f_g.at[i, n], f_s, _FACTORS),
        "lam": (lambda n: lam_g.at[i, n], lam_s, _LAM),
        "v": (lambda n: at(v_g, n, cols), v_s, 8),
        "a": (lambda n: a_g.at[i, n], a_s, 9),
        "p": (lambda n: p_g.at[i, n], p_s, 10)}, order=lambda n: n, nc=nc, double=("k",))

  own = ("q", "k") if erase else ("q",)
  first0 = ("f", "lam", "v", "p") + (("a",) if erase else ())
  # Without erase K is read only by the state update at the chunk's end: its copy starts at the
  # chunk's top.
  at_end = () if erase else ("k",)

  def prologue(*refs):
    cp = copies(*refs[:7])
    cp.start(own, 0)
    pl.when(w == 0)(lambda: cp.start(first0, 0))

  def chunk(n, s, q_s, k_bufs, v_s, a_s, p_s, f_s, lam_s, s_s, w_s, rhs_s, u16_s, o_s, red_r,
            red_y, *extra, stage):
    cp = copies(q_s, k_bufs, v_s, a_s, p_s, f_s, lam_s)
    x_out = extra[:save_x]
    interp = extra[save_x:]               # K^T rows, interpret mode only
    k_w = cp.ref("k", n)                  # (C, 64): this warpgroup's columns of K
    mine = s_s.at[w]                      # (E, 64, BV): this warpgroup's rows, slice by slice
    stage("wait update")
    plgpu.wgmma_wait(0)                   # its previous state update has read K, W
    _wait_stores()                        # its stores have read their buffers
    stage("chunk start")
    _store_blocks(s, mine, e_dim, bv, BF16)
    cp.wait("lam", n)
    decayed = ops.colvec(lam_s, HALF) * s
    plgpu.commit_smem()
    for e in range(e_dim * residuals):    # the chunk-start state, straight from the operand
      plgpu.copy_smem_to_gmem(mine.at[e], st_g.at[i, n, e, rows, cols])
    cp.start(at_end, n)
    stage("partials")
    cp.wait("f", n)
    part_r = None
    if erase:
      cp.wait("k", n)
      part_r = _partial(ops, k_w, mine, f_s, r_rows, bv)
    cp.wait("q", n)
    part_y = _partial(ops, q_s.at[w], mine, f_s, read_rows, bv)

    stage("exchange")

    @pl.when(w == 1)
    def _():
      if erase:
        red_r[...] = part_r
      red_y[...] = part_y

    _sync(xbar)       # the partials are in SMEM; both warpgroups are done with lam
    cp.start_next(own, n)
    stage("U, output")

    @pl.when(w == 0)
    def _():
      cp.start_next(("lam",), n)
      cp.wait("v", n)
      beta = ops.rowvec(f_s, beta_row, bv)
      v = ops.acc(v_s[...].astype(F32))
      if erase:
        r = part_r + ops.acc(red_r[...])
        if save_x:
          x = v - r
          x_out[0][...] = x.astype(x_out[0].dtype)
          rhs = beta * x
        else:
          rhs = beta * v - r
        rhs_s[...] = rhs.astype(BF16)
        plgpu.commit_smem()
        cp.start_next(("v",), n)
        if save_x:
          plgpu.copy_smem_to_gmem(x_out[0], x_g.at[i, n, :, cols])
        cp.wait("a", n)
        u = ops.mm(a_s, rhs_s)
      else:
        u = beta * v
      u16_s[...] = u.astype(BF16)
      _e_expand(ops, w_s, u, f_s, write_rows, bv)
      plgpu.commit_smem()
      cp.start_next(("a",) if erase else ("v",), n)
      if residuals:
        plgpu.copy_smem_to_gmem(u16_s, u_g.at[i, n, :, cols])
      cp.wait("p", n)
      out = ops.mm(p_s, u16_s) + part_y + ops.acc(red_y[...])
      o_s[...] = (scale * out).astype(o_s.dtype)
      plgpu.commit_smem()
      cp.start_next(("p",), n)
      plgpu.copy_smem_to_gmem(o_s, at(o_g, n, cols))

    stage("meet")
    _sync(xbar)       # W is in SMEM; warpgroup 0 has read the partials; both are done with f
    pl.when(w == 0)(lambda: cp.start_next(("f",), n))
    stage("update")
    for name in at_end:
      cp.wait(name, n)
    kt = ops.transposed(k_w, interp[0].at[w] if interp else None)
    return ops.mm_add(decayed, [(kt, w_s)])

  state = _chunk_loop(chunk, nc, state0, scratch, prologue, xbar)
  _store_rows(state, ht_g.at[i, j, rows], cat, w)


def _kernel_2wg(kernel, ins, out_type, grid, name, interpret):
  return plgpu.kernel(
      kernel, out_type=out_type,
      scratch_types=[plgpu.Barrier(num_barriers=_N_BARRIERS_2WG), plgpu.Barrier(num_arrivals=2)],
      grid=grid, grid_names=("bh", "v"), num_threads=2, thread_name="wg",
      compiler_params=_compiler_params(), interpret=_interpret_params(interpret),
      kernel_name=name)(*ins)


def _forward_2wg(q, k, v, a, p, f, lam_cat, h0, *, e_dim, bv, scale, erase, save_x, heads,
                 pieces, residuals, interpret):
  """``state_pass`` with two warpgroups. The sizes come from the row factors f (BH, NC, rows, C)
  and q's last dim, since q, k, v (and o) are (BH, NC, C, X), or (B, T, H, X) with ``heads``."""
  bh, nc, _, c = f.shape
  d = q.shape[-1]
  vd = v.shape[-1]
  n_cat = e_dim * bv
  sw_v, sw_f = _swizzle(bv), _swizzle(bv, F32)
  scratch = [
      _smem((2, c, HALF), BF16, sw_v),            # q, a 64-column piece per warpgroup
      # k, two chunks' buffers per warpgroup (chunk n's K^T is read after n + 1's copy started)
      _smem((2, 2, c, HALF), BF16, sw_v),
      _smem((c, bv), BF16, sw_v),                 # v block
      _smem((c, c), BF16, sw_v),                  # A
      _smem((c, c), BF16, sw_v),                  # P
      _smem((f.shape[2], c), F32),                # row factors
      _smem((n_cat,), F32),                       # lam_cat
      _smem((2, e_dim, HALF, bv), BF16, sw_v),    # S_cat (bf16), per warpgroup and slice
      _smem((c, n_cat), BF16, sw_v),              # W = [diag(fw_e) U]_e
      _smem((c, bv), BF16, sw_v),                 # rhs (bf16 operand)
      _smem((c, bv), BF16, sw_v),                 # U (bf16 operand)
      _smem((c, bv), q.dtype, sw_v),              # o
      _smem((c, bv), F32, sw_f),                  # warpgroup 1's part of sum_e f_e R_e
      _smem((c, bv), F32, sw_f),                  # warpgroup 1's part of sum_e fq_e Y_e
  ] + ([_smem((c, bv), q.dtype, sw_v)] if save_x else []) + (   # X
      [_smem((2, HALF, c), BF16, sw_v)] if interpret else [])     # K^T (interpret mode)
  cat = _smem((2, HALF, n_cat), F32, _swizzle(n_cat, F32))  # initial / final state rows
  kernel = functools.partial(_forward_kernel_2wg, scratch=scratch, cat=cat, nc=nc, e_dim=e_dim,
                             bv=bv, scale=scale, erase=erase, save_x=save_x,
                             interpret=bool(interpret), heads=heads, pieces=pieces,
                             residuals=residuals)
  ins = _forward_inputs(q, k, v, a, p, f, lam_cat, h0, bv=bv)
  *outs, ht = _kernel_2wg(
      kernel, ins,
      _forward_out_types(q, bh, nc, c, d, vd, e_dim, bv, save_x, heads, residuals),
      (bh, vd // bv), "triadic_forward_mgpu_wg2", interpret)
  return (*outs, _from_cat(ht, e_dim))


def _backward_kernel_2wg(k_g, q_g, do_g, a_g, p_g, f_g, lam_g, dht_g, du_g, *outs_and_bars,
                         scratch, cat, nc, e_dim, bv, scale, erase, save_drhs, interpret,
                         heads=None, pieces=1):
  rhs_g = outs_and_bars[:2 * save_drhs]        # save_drhs: A^T dU and dV = beta A^T dU
  dst_g, dh0_g, bars, xbar = outs_and_bars[2 * save_drhs:]
  ops = _Ops(interpret)
  i, j, w = lax.axis_index("bh"), lax.axis_index("v"), lax.axis_index("wg")
  cols, rows = pl.ds(j * bv, bv), pl.ds(w * HALF, HALF)
  # k, q, dO (and dV): (BH, NC, C, X) boxes, or with heads strided boxes of (B, T, H, X).
  at = _chunk_box(heads, i, f_g.shape[-1], pieces, nc)
  rhs_at = _rhs_boxes(rhs_g, at, i, cols)
  erase_rows, read_rows, write_rows, beta_row = 0, e_dim, 2 * e_dim, 3 * e_dim
  dstate0 = _load_rows(ops, dht_g.at[i, j, rows], cat, bars.at[_ROWS + w], w, xbar)

  def copies(k_s, q_s, do_s, a_s, p_s, f_s, lam_s):
    return _Inputs(bars, {
        "k": (lambda n: at(k_g, n, rows), k_s.at[w], 3 * w),
        "q": (lambda n: at(q_g, n, rows), q_s.at[w], 3 * w + 2),
        "f": (lambda n: f_g.at[i, n], f_s, _FACTORS),
        "lam": (lambda n: lam_g.at[i, n], lam_s, _LAM),
        "do": (lambda n: at(do_g, n, cols), do_s, 8),
        "a": (lambda n: a_g.at[i, n], a_s, 9),
        "p": (lambda n: p_g.at[i, n], p_s, 10)}, order=lambda step: nc - 1 - step, nc=nc)

  first0 = ("f", "lam", "do", "p") + (("a",) if erase else ())
  at_end = ("q",)                       # read only by the state update at the end, as Q^T

  def chunk(step, ds, k_s, q_s, do_s, a_s, p_s, f_s, lam_s, s_s, x_s, z_s, u16_s, u_s, *extra,
            stage):
    rhs_s, interp = extra[:2 * save_drhs], extra[2 * save_drhs:]  # interp: interpret mode only
    cp = copies(k_s, q_s, do_s, a_s, p_s, f_s, lam_s)
    if interp:                            # this warpgroup's rows of K^T, Q^T
      interp = [interp[0].at[w], interp[1].at[w], *interp[2:]]
    # The operands K^T, Q^T, A^T, P^T: views of the copies of K, Q, A, P (interp: their explicit
    # transposes in interpret mode).
    tr = lambda ref, at: ops.transposed(ref, interp[at] if interp else None)
    n = nc - 1 - step
    mine = s_s.at[w]
    stage("wait update")
    plgpu.wgmma_wait(0)                   # its previous state update has read K, Q, X, Z
    stage("chunk start")
    plgpu.commit_smem()
    cp.start(("k",), step)
    pl.when(w == 0)(lambda: cp.start(first0, step))
    _wait_stores()
    _store_blocks(ds, mine, e_dim, bv, BF16)
    cp.wait("lam", step)
    decayed = ops.colvec(lam_s, HALF) * ds
    plgpu.commit_smem()
    for e in range(e_dim):
      plgpu.copy_smem_to_gmem(mine.at[e], dst_g.at[i, n, e, rows, cols])
    cp.start(at_end, step)
    stage("partial")
    cp.wait("k", step)
    cp.wait("f", step)
    part = _partial(ops, k_s.at[w], mine, f_s, write_rows, bv)

    stage("exchange")

    @pl.when(w == 1)
    def _():
      u_s[...] = part

    _sync(xbar)       # warpgroup 1's part of sum_e fw_e (K dS_cat)_e is in u_s

    stage("dU, X, Z")

    # Warpgroup 1 forms X = [scale diag(fq_e) dO]_e, which both state updates read (and both
    # have read by the first meeting), while warpgroup 0 forms dU, A^T dU and Z.
    @pl.when(w == 1)
    def _():
      cp.wait("do", step)
      _e_expand(ops, x_s, ops.acc(do_s[...].astype(F32)), f_s, read_rows, bv, scale)

    @pl.when(w == 0)
    def _():
      cp.wait("p", step)
      cp.wait("do", step)
      du = scale * ops.mm(tr(p_s, 3), do_s) + part + ops.acc(u_s[...])
      # dU leaves in bf16 with erase (its every later use is a bf16 operand), else in float32.
      du_out_s = u16_s if erase else u_s
      du_out_s[...] = du.astype(du_out_s.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(du_out_s, du_g.at[i, n, :, cols])
      if erase:
        cp.wait("a", step)
        drhs = ops.mm(tr(a_s, 2), u16_s)
        _e_expand(ops, z_s, drhs, f_s, erase_rows, bv, -1.0)
        if save_drhs:
          _rhs_gradients(ops, rhs_s, drhs, f_s, beta_row, bv)
          plgpu.commit_smem()
          for out_s, out_at in zip(rhs_s, rhs_at):
            plgpu.copy_smem_to_gmem(out_s, out_at(n))
      # u_s is warpgroup 1's next partial buffer: dU's store must have read it.
      _wait_stores()

    stage("meet")
    _sync(xbar)       # X, Z are in SMEM; warpgroup 0 has read the partial
    stage("update")
    for name in at_end:
      cp.wait(name, step)
    pairs = [(tr(q_s.at[w], 1), x_s)]
    if erase:
      pairs.append((tr(k_s.at[w], 0), z_s))
    return ops.mm_add(decayed, pairs)

  dstate = _chunk_loop(chunk, nc, dstate0, scratch, lambda *refs: None, xbar)
  _store_rows(dstate, dh0_g.at[i, j, rows], cat, w)


def _backward_2wg(q, k, do, a, p, f, lam_cat, dht, *, e_dim, bv, scale, erase, save_drhs, heads,
                  pieces, interpret):
  """``reverse_state_pass`` with two warpgroups; sizes and layouts as ``_forward_2wg``'s."""
  bh, nc, _, c = f.shape
  d = q.shape[-1]
  vd = do.shape[-1]
  n_cat = e_dim * bv
  sw_v = _swizzle(bv)
  scratch = [
      _smem((2, c, HALF), BF16, sw_v),            # k, a 64-column piece per warpgroup
      _smem((2, c, HALF), BF16, sw_v),            # q, a 64-column piece per warpgroup
      _smem((c, bv), BF16, sw_v),                 # dO block
      _smem((c, c), BF16, sw_v),                  # A
      _smem((c, c), BF16, sw_v),                  # P
      _smem((f.shape[2], c), F32),                # row factors
      _smem((n_cat,), F32),                       # lam_cat
      _smem((2, e_dim, HALF, bv), BF16, sw_v),    # dS_cat (bf16), per warpgroup and slice
      _smem((c, n_cat), BF16, sw_v),              # X = [scale diag(fq_e) dO]_e
      _smem((c, n_cat), BF16, sw_v),              # Z = [-diag(fe_e) A^T dU]_e
      _smem((c, bv), BF16, sw_v),                 # dU (bf16 operand; the output with erase)
      # warpgroup 1's partial, then dU without erase
      _smem((c, bv), F32, _swizzle(bv, F32)),
  ] + _rhs_buffers(c, bv, q.dtype, save_drhs) + (
      [_smem((2, HALF, c), BF16, sw_v), _smem((2, HALF, c), BF16, sw_v),   # K^T, Q^T, A^T, P^T
       _smem((c, c), BF16, sw_v), _smem((c, c), BF16, sw_v)]              # (interpret mode)
      if interpret else [])
  cat = _smem((2, HALF, n_cat), F32, _swizzle(n_cat, F32))  # dht / dh0 rows
  kernel = functools.partial(_backward_kernel_2wg, scratch=scratch, cat=cat, nc=nc, e_dim=e_dim,
                             bv=bv, scale=scale, erase=erase, save_drhs=save_drhs,
                             interpret=bool(interpret), heads=heads, pieces=pieces)
  ins = _reverse_inputs(q, k, do, a, p, f, lam_cat, dht, bv=bv)
  du, *outs, dh0 = _kernel_2wg(
      kernel, ins, _reverse_out_types(bh, nc, c, d, vd, e_dim, bv, q.dtype, erase, save_drhs,
                                      None if heads is None else q.shape[:3]),
      (bh, vd // bv), "triadic_backward_states_mgpu_wg2", interpret)
  return (du, *outs, _from_cat(dh0, e_dim))
