"""Hopper (Mosaic GPU) state passes with the E slices split between warpgroups and the chunk's
other work on warpgroups of their own: drop-ins for ``mosaic.state_pass`` and
``mosaic.reverse_state_pass`` (same operands and outputs) at D = 128, V a multiple of 32, even E,
bf16. The forward is described here, the reverse pass above its kernel.

Why this structure. ``mosaic.state_pass`` runs a chunk's whole chain on one warpgroup (two at
most, splitting the state's D rows, so that every product over D leaves partial sums to
exchange): the state update, the products with the state, U, and the output, one after another.
Here, as in the triadic paper's authors' Hopper kernels, one program (grid (B*H, V / 32)) runs four
warpgroups, each with one role:

  warpgroups 0, 1  ("state") each hold E / 2 whole slices S_e (D x 32 float32, one array each).
                   Per chunk they write them to SMEM in bf16 (the snapshot, which is also the
                   TMA source of the chunk-start states), then decay them and add K^T W_e. Their
                   only products are their own slices' updates; nothing is exchanged between them.
  warpgroup 2      ("values") forms rhs = beta V - sum_e diag(fe_e) K S_e from the snapshot (E
                   wgmmas of N = 32), U = A rhs and W_e = diag(fw_e) U for every slice.
  warpgroup 3      ("output") forms o = scale (sum_e diag(fq_e) Q S_e + P U), off the chain.

A chunk's chain is snapshot -> products -> U -> W -> update; the output overlaps it. The value
block is 32 columns (``BLOCK_V``): at B = 2, H = 16, V = 128 that is 128 programs, one wave on
132 multiprocessors, where the one-warpgroup pass at E = 8 runs 16 columns in two waves.
``plgpu.set_max_registers`` gives the state warpgroups ``STATE_REGISTERS`` a thread (their slices
take 32 each: 128 at E = 8) and the others ``OTHER_REGISTERS``.

Hand-offs (barriers with one arrival a warpgroup; each waiter waits every phase once, in order,
and no barrier can run two phases ahead of a waiter, as the comments in the roles say):
  ``h_ready`` (2 arrivals: the state warpgroups) the chunk's snapshot is in SMEM;
  ``h_free``  (2: values, output) both are done reading it: the next one may be written;
  ``w_ready`` (1: values) W and U are in SMEM;
  ``u_free``  (1: output) the output has read U: the next one may be written.
W is rewritten only after the next ``h_ready``, which the state warpgroups arrive at after their
update (which read W) has completed. Each input is copied by the warpgroup that reads it (K by
the values warpgroup, which shares it with the state warpgroups' K^T: two buffers by the chunk's
parity, chunk n + 1's copied once ``h_ready`` of chunk n shows chunk n - 1's updates complete).
Interpret mode on a CPU runs the roles as simulated threads, whose barrier waits need XLA's CPU
thread pool larger than the warpgroups that can block at once (tests/conftest.py sets
``NPROC``); there K^T is an explicit transpose (``_Ops.transposed``) and register counts are not
set.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from triadic.pallas.common import du_dtype
from triadic.pallas.mosaic import (BARRIER_BYTES, BF16, F32, SMEM_ALIGN, _check_heads,
                                   _check_pieces, _chunk_box, _compiler_params, _factors,
                                   _interpret_params, _Ops, _partial, _rhs_boxes, _rhs_buffers,
                                   _rhs_gradients, _smem, _swizzle, _t, _wait_stores,
                                   sizes_reason)

BLOCK_V = 32
WARPGROUPS = 4
STATE_REGISTERS = 168      # 128 threads x (2 x 168 + 2 x 88) = 65,536, the register file
OTHER_REGISTERS = 88
SMEM_MAX = 227 * 1024      # what a block may have on Hopper
# TMA barrier slots: K by parity (2), V, A, the row factors, Q, P, fq, lam and h0 staging per
# state warpgroup (2 each).
_K, _V, _A, _F, _Q, _P, _FQ, _LAM, _STAGE = 0, 2, 3, 4, 5, 6, 7, 8, 10
_N_BARRIERS = 12


def smem_bytes(d: int, c: int, e: int, save_x: bool, interpret: bool = False) -> int:
  """SMEM of the kernel on hardware: every buffer rounded up to SMEM_ALIGN, then the barriers."""
  bv = BLOCK_V
  bufs = [2 * c * d * 2, c * d * 2,          # K (two buffers), Q
          c * bv * 2, c * c * 2, c * c * 2,  # V block, A, P
          (4 * e + 1) * c * 4, e * c * 4,    # row factors (with save_x's rows), fq rows
          e * bv * 4,                        # lam, per slice and column
          e * d * bv * 2,                    # snapshot (2, E / 2, D, 32) bf16
          e * c * bv * 2,                    # W (2, E / 2, C, 32) bf16
          2 * d * bv * 4,                    # h0 / final state staging, a slice per state wg
          c * bv * 2, c * bv * 2, c * bv * 2,   # rhs, U, o
          c * bv * 2 * save_x]               # X
  bufs += [2 * d * c * 2] * interpret        # K^T per state warpgroup (interpret mode)
  return (sum(-(-b // SMEM_ALIGN) * SMEM_ALIGN for b in bufs)
          + (_N_BARRIERS + 4) * BARRIER_BYTES)


def supported(d: int, vd: int, c: int, e: int, dtype, save_x: bool = True) -> str | None:
  """Why the slice-split forward cannot take these sizes, or None if it can."""
  reason = sizes_reason(d, vd, c, e, dtype, BLOCK_V, (BLOCK_V,), "the slice-split forward")
  if reason:
    return reason
  if d != 128:
    return f"the slice-split forward needs D = 128, got {d}"
  if e % 2:
    return f"the slice-split forward needs an even E (E / 2 slices a state warpgroup), got {e}"
  need = smem_bytes(d, c, e, save_x)
  if need > SMEM_MAX:
    return f"the slice-split forward at E={e} needs {need} B of SMEM > {SMEM_MAX} B"
  return None


def state_pass(q, k, v, k2_col, q2_col, gc_col, beta_col, a, p, h0, *, scale, erase,
               save_x=False, heads=None, pieces=1, residuals=True, interpret=False):
  """``mosaic.state_pass`` (same operands, outputs and ``heads`` / ``pieces`` layouts) by the
  slice-split kernel; raises ValueError where ``supported`` refuses the sizes."""
  vd = v.shape[-1]
  bh, nc, c, d, e_dim = _sizes(q, k2_col, heads, pieces, k=k, v=v)
  save_x = bool(save_x and erase)
  if save_x and not residuals:
    raise ValueError("save_x needs residuals=True (X is a residual for the backward)")
  reason = supported(d, vd, c, e_dim, q.dtype, save_x)
  if reason:
    raise ValueError(reason)
  residuals = bool(residuals)
  f, lam = _slice_factors(gc_col, k2_col, q2_col, beta_col)
  if save_x:
    f = jnp.concatenate([f, _t(k2_col * jnp.exp(gc_col))], axis=2)   # rows [.., beta, c (E)]
  sw = _swizzle(BLOCK_V)
  scratch = [
      _smem((2, c, d), BF16, sw),                    # K, by the chunk's parity
      _smem((c, d), BF16, sw),                       # Q
      _smem((c, BLOCK_V), BF16, sw),                 # V block
      _smem((c, c), BF16, sw),                       # A
      _smem((c, c), BF16, sw),                       # P
      _smem((f.shape[2], c), F32),                   # row factors: fe, fq, fw, beta [, c]
      _smem((e_dim, c), F32),                        # fq rows (the output's copy)
      _smem((2, e_dim // 2, BLOCK_V), F32),          # lam per state warpgroup, slice, column
      _smem((e_dim, d, BLOCK_V), BF16, sw),          # the snapshot, slice by slice
      _smem((e_dim, c, BLOCK_V), BF16, sw),          # W_e = diag(fw_e) U
      _smem((2, d, BLOCK_V), F32, _swizzle(BLOCK_V, F32)),   # h0 / final state staging
      _smem((c, BLOCK_V), BF16, sw),                 # rhs (bf16 operand)
      _smem((c, BLOCK_V), BF16, sw),                 # U (bf16 operand)
      _smem((c, BLOCK_V), q.dtype, sw),              # o
  ] + ([_smem((c, BLOCK_V), q.dtype, sw)] if save_x else []) + (      # X
      [_smem((2, d, c), BF16, sw)] if interpret else [])              # K^T (interpret mode)
  kernel = functools.partial(_kernel, scratch=scratch, nc=nc, e_dim=e_dim, scale=scale,
                             erase=erase, save_x=save_x, interpret=bool(interpret), heads=heads,
                             pieces=pieces, residuals=residuals)
  per_chunk = jax.ShapeDtypeStruct((bh, nc, c, vd), q.dtype)
  o_type = per_chunk if heads is None else jax.ShapeDtypeStruct((*q.shape[:3], vd), q.dtype)
  saved = ([per_chunk] + [per_chunk] * save_x
           + [jax.ShapeDtypeStruct((bh, nc, e_dim, d, vd), q.dtype)]) if residuals else []
  return tuple(plgpu.kernel(
      kernel, out_type=[o_type, *saved, jax.ShapeDtypeStruct((bh, e_dim, d, vd), F32)],
      scratch_types=[plgpu.Barrier(num_barriers=_N_BARRIERS), plgpu.Barrier(num_arrivals=2),
                     plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=1),
                     plgpu.Barrier(num_arrivals=1)],
      grid=(bh, vd // BLOCK_V), grid_names=("bh", "v"), num_threads=WARPGROUPS,
      thread_name="wg", compiler_params=_compiler_params(regions=False),
      interpret=_interpret_params(interpret), kernel_name="triadic_forward_mgpu_split",
  )(q, k, v, a.astype(BF16), p.astype(BF16), f, lam, h0.astype(F32)))


def _sizes(q, k2_col, heads, pieces, **per_token):
  """(BH, NC, C, D, E) of a pass's operands, after ``mosaic.state_pass``'s layout checks (the
  other ``per_token`` operands of the (B, T, H, X) layout by name)."""
  _check_pieces(heads, pieces)
  shape = q if heads is None else _check_heads(heads, pieces, k2_col, q, **per_token)
  return (*shape.shape, k2_col.shape[-1])


def _slice_factors(gc_col, k2_col, q2_col, beta_col):
  """The row factors (``mosaic._factors``) and each chunk's decay lam repeated over a slice's 32
  columns, (BH, NC, E, 32): the state warpgroups' column vectors."""
  f, lam = _factors(gc_col, k2_col, q2_col, beta_col)
  return f, jnp.repeat(lam[..., None], BLOCK_V, axis=-1)


def _write_snapshot(states, snap_s, first, dst_at):
  """A state warpgroup's slices into the bf16 snapshot (slices first, first + 1, ...) once its
  stores have read the previous one, then each stored from there to ``dst_at(e)`` by TMA (None:
  not stored)."""
  _wait_stores()
  for e, state in enumerate(states):
    snap_s.at[first + e][...] = state.astype(BF16)
  plgpu.commit_smem()
  if dst_at is not None:
    for e in range(len(states)):
      plgpu.copy_smem_to_gmem(snap_s.at[first + e], dst_at(e))


def _decayed(ops, lam_s, states):
  """Each slice times its decay (``lam_s`` (slices, 32)), after which every thread has read lam
  (a ``commit_smem``): its next copy may start."""
  out = [ops.colvec(lam_s.at[e], state.shape[0]) * state for e, state in enumerate(states)]
  plgpu.commit_smem()
  return out


def _copies(bars, nc):
  """(copy, wait, copy_next) on the TMA barrier slots ``bars``: ``copy(src, dst, slot)``,
  ``wait(slot)``, and ``copy_next(n, pairs)``, the copies ``pairs(n + 1)`` ((src, dst, slot)
  triples) of loop step n + 1, none after the last of the ``nc`` steps."""
  def copy(src, dst, slot):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[slot])

  def wait(slot):
    plgpu.barrier_wait(bars.at[slot])

  def copy_next(n, pairs):
    @pl.when(n + 1 < nc)
    def _():
      for src, dst, slot in pairs(n + 1):
        copy(src, dst, slot)

  return copy, wait, copy_next


def _load_slices(ops, src_at, stage, slot, count, copy, wait):
  """``count`` float32 (D, 32) slices ``src_at(e)`` from gmem into registers (WGMMA layout), one
  at a time through the SMEM ``stage`` and barrier ``slot``."""
  states = []
  for e in range(count):
    copy(src_at(e), stage, slot)
    wait(slot)
    states.append(ops.acc(stage[...]))
    plgpu.commit_smem()                   # every thread has read it before the next copy
  return states


def _store_slices(states, stage, dst_at):
  """The slices ``states`` to gmem ``dst_at(e)``, one at a time through the SMEM ``stage``, once
  the last wgmmas that formed them and this warpgroup's stores are complete."""
  plgpu.wgmma_wait(0)
  _wait_stores()
  for e, state in enumerate(states):
    stage[...] = state
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, dst_at(e))
    plgpu.wait_smem_to_gmem(0)


def _kernel(q_g, k_g, v_g, a_g, p_g, f_g, lam_g, h0_g, *outs_and_bars, scratch, nc, e_dim, scale,
            erase, save_x, interpret, heads, pieces, residuals):
  *outs, bars, h_ready, h_free, w_ready, u_free = outs_and_bars
  if not residuals:                   # o and the final state only
    (o_g, ht_g), u_g, x_g, st_g = outs, None, None, None
  elif save_x:
    o_g, u_g, x_g, st_g, ht_g = outs
  else:
    (o_g, u_g, st_g, ht_g), x_g = outs, None
  ops = _Ops(interpret)
  i, j, w = lax.axis_index("bh"), lax.axis_index("v"), lax.axis_index("wg")
  bv, half = BLOCK_V, e_dim // 2
  cols = pl.ds(j * bv, bv)
  c = f_g.shape[-1]
  at = _chunk_box(heads, i, c, pieces, nc)    # chunk n of q, k, v, o
  # Row factors: fe (erase: rhs = beta V - sum fe_e R_e) or, with save_x, c (X = V - sum c_e R_e,
  # rhs = beta X); fq; fw; beta.
  r_rows = 3 * e_dim + 1 if save_x else 0
  fw_rows, beta_row = 2 * e_dim, 3 * e_dim

  copy, wait, copy_next = _copies(bars, nc)

  def body(k_s, q_s, v_s, a_s, p_s, f_s, fq_s, lam_s, snap_s, w_s, stage_s, rhs_s, u16_s, o_s,
           *extra):
    x_s = extra[0] if save_x else None
    interp = extra[save_x:]               # K^T per state warpgroup (interpret mode)
    k_at = lambda n: (at(k_g, n), k_s.at[n % 2], _K + n % 2)

    @pl.when(w < 2)
    def _state():
      if not interpret:
        plgpu.set_max_registers(STATE_REGISTERS, action="increase")
      first = w * half                    # this warpgroup's slices: first, ..., first + half - 1
      lam_at = lambda n: (lam_g.at[i, n, pl.ds(first, half)], lam_s.at[w], _LAM + w)
      copy(*lam_at(0))
      states = _load_slices(ops, lambda e: h0_g.at[i, first + e, :, cols], stage_s.at[w],
                            _STAGE + w, half, copy, wait)

      def chunk(n, states):
        plgpu.wgmma_wait(0)               # the updates of chunk n - 1 are complete
        # The values and output warpgroups are done with snapshot n - 1. (They arrive at h_free
        # before waiting for anything of chunk n: its phases stay in step with this wait.)
        pl.when(n > 0)(lambda: plgpu.barrier_wait(h_free))
        _write_snapshot(states, snap_s, first, (lambda e: st_g.at[i, n, first + e, :, cols])
                        if residuals else None)   # with the chunk-start states
        plgpu.barrier_arrive(h_ready)
        wait(_LAM + w)
        decayed = _decayed(ops, lam_s.at[w], states)
        copy_next(n, lambda m: [lam_at(m)])
        # W and K of chunk n. (w_ready's next phase needs this chunk's h_ready of both state
        # warpgroups, after their updates: its phases stay in step with this wait.)
        plgpu.barrier_wait(w_ready)
        wait(_K + n % 2)
        kt = ops.transposed(k_s.at[n % 2], interp[0].at[w] if interp else None)
        # (W's block by a traced index: a static one inside the update's run_state does not lower)
        return tuple(ops.mm_add(decayed[e], [(kt, w_s.at[first + e])]) for e in range(half))

      states = lax.fori_loop(0, nc, chunk, tuple(states))
      plgpu.barrier_wait(h_free)          # the last chunk's phase (every phase is waited for)
      _store_slices(states, stage_s.at[w], lambda e: ht_g.at[i, first + e, :, cols])

    @pl.when(w == 2)
    def _values():
      if not interpret:
        plgpu.set_max_registers(OTHER_REGISTERS, action="decrease")
      v_at = lambda n: (at(v_g, n, cols), v_s, _V)
      a_at = lambda n: (a_g.at[i, n], a_s, _A)
      f_at = lambda n: (f_g.at[i, n], f_s, _F)
      for pair in (k_at(0), v_at(0), f_at(0)) + ((a_at(0),) if erase else ()):
        copy(*pair)

      def chunk(n, carry):
        _wait_stores()                    # U's and X's stores of chunk n - 1 have read them
        wait(_F)
        wait(_V)
        wait(_K + n % 2)
        plgpu.barrier_wait(h_ready)       # snapshot n (h_ready's next phase needs this
        # warpgroup's h_free below: its phases stay in step with this wait)
        # K of chunk n + 1 into the other buffer, whose chunk n - 1 the state warpgroups' updates
        # have read (they wrote snapshot n after them).
        copy_next(n, lambda m: [k_at(m)])
        beta = ops.rowvec(f_s, beta_row, bv)
        v = ops.acc(v_s[...].astype(F32))
        if erase:
          r = _partial(ops, k_s.at[n % 2], snap_s, f_s, r_rows, bv)
        plgpu.barrier_arrive(h_free)      # done with snapshot n
        if erase:
          if save_x:
            x = v - r
            x_s[...] = x.astype(x_s.dtype)
            rhs = beta * x
          else:
            rhs = beta * v - r
          rhs_s[...] = rhs.astype(BF16)
          plgpu.commit_smem()             # every thread has read V
          copy_next(n, lambda m: [v_at(m)])
          if save_x:
            plgpu.copy_smem_to_gmem(x_s, x_g.at[i, n, :, cols])
          wait(_A)
          u = ops.mm(a_s, rhs_s)
          copy_next(n, lambda m: [a_at(m)])
        else:
          u = beta * v
        # U of chunk n - 1 has been read by the output. (u_free's next phase needs this chunk's
        # w_ready: its phases stay in step with this wait.)
        pl.when(n > 0)(lambda: plgpu.barrier_wait(u_free))
        u16_s[...] = u.astype(BF16)
        for e in range(e_dim):
          w_s.at[e][...] = (ops.rowvec(f_s, fw_rows + e, bv) * u).astype(BF16)
        plgpu.commit_smem()               # also: every thread has read V (no erase) and f
        plgpu.barrier_arrive(w_ready)
        copy_next(n, lambda m: [f_at(m)] + ([] if erase else [v_at(m)]))
        if residuals:
          plgpu.copy_smem_to_gmem(u16_s, u_g.at[i, n, :, cols])
        return carry

      lax.fori_loop(0, nc, chunk, None)
      plgpu.barrier_wait(u_free)          # the last chunk's phase (every phase is waited for)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(w == 3)
    def _output():
      if not interpret:
        plgpu.set_max_registers(OTHER_REGISTERS, action="decrease")
      q_at = lambda n: (at(q_g, n), q_s, _Q)
      p_at = lambda n: (p_g.at[i, n], p_s, _P)
      fq_at = lambda n: (f_g.at[i, n, pl.ds(e_dim, e_dim)], fq_s, _FQ)
      for pair in (q_at(0), p_at(0), fq_at(0)):
        copy(*pair)

      def chunk(n, carry):
        _wait_stores()                    # o of chunk n - 1 has been stored
        wait(_Q)
        wait(_FQ)
        plgpu.barrier_wait(h_ready)
        y = _partial(ops, q_s, snap_s, fq_s, 0, bv)
        plgpu.barrier_arrive(h_free)
        plgpu.commit_smem()               # every thread has read fq
        copy_next(n, lambda m: [q_at(m), fq_at(m)])
        wait(_P)
        plgpu.barrier_wait(w_ready)
        out = ops.mm(p_s, u16_s) + y
        plgpu.barrier_arrive(u_free)
        copy_next(n, lambda m: [p_at(m)])
        o_s[...] = (scale * out).astype(o_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, at(o_g, n, cols))
        return carry

      lax.fori_loop(0, nc, chunk, None)
      plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(body, *scratch, collective_axes=("wg",))


# ------------------------------------------------------------------------------------------------
# The reverse pass, split the same way: warpgroups 0 and 1 hold E / 2 slices of dS each, warpgroup
# 2 forms dU = scale P^T dO + sum_e diag(fw_e) K dS_e from their bf16 snapshot, X_e = scale
# diag(fq_e) dO and Z_e = -diag(fe_e) A^T dU; the state warpgroups then add Q^T X_e + K^T Z_e to
# their decayed slices. Three warpgroups share the register file evenly (no reallocation).
# Hand-offs as in the forward: ``h_ready`` (2 arrivals), ``h_free`` (1: the values warpgroup),
# ``xz_ready`` (1). The values warpgroup copies the inputs; once ``h_ready`` of step s shows the
# updates of step s - 1 complete, K of step s + 1 (two buffers by the step's parity) and Q of
# step s (one buffer: the state warpgroups read it last, in their update).

# TMA barrier slots: K by parity (2), Q, dO, A, P, the row factors, lam and dht staging per state
# warpgroup (2 each).
_RK, _RQ, _RDO, _RA, _RP, _RF, _RLAM, _RSTAGE = 0, 2, 3, 4, 5, 6, 7, 9
_R_BARRIERS = 11


def reverse_smem_bytes(d: int, c: int, e: int, save_drhs: bool, interpret: bool = False) -> int:
  """SMEM of the split reverse pass on hardware, as ``smem_bytes``."""
  bv = BLOCK_V
  bufs = [2 * c * d * 2, c * d * 2,          # K (two buffers), Q
          c * bv * 2, c * c * 2, c * c * 2,  # dO block, A, P
          (3 * e + 1) * c * 4, e * bv * 4,   # row factors, lam
          e * d * bv * 2,                    # snapshot
          max(e * c * bv * 2, 2 * d * bv * 4),   # X_e, or (before and after the loop) staging
          e * c * bv * 2,                    # Z_e
          c * bv * 4]                        # dU (at most float32)
  bufs += [c * bv * 2] * (2 * save_drhs)     # A^T dU, dV
  bufs += [2 * d * c * 2 * 2, 2 * c * c * 2] * interpret   # K^T, Q^T a state wg, A^T, P^T
  return (sum(-(-b // SMEM_ALIGN) * SMEM_ALIGN for b in bufs)
          + (_R_BARRIERS + 3) * BARRIER_BYTES)


def reverse_supported(d: int, vd: int, c: int, e: int, dtype, save_drhs: bool = True
                      ) -> str | None:
  """Why the split reverse pass cannot take these sizes, or None if it can."""
  reason = supported(d, vd, c, e, dtype, save_x=False)
  if reason:
    return reason.replace("slice-split forward", "split reverse pass")
  need = reverse_smem_bytes(d, c, e, save_drhs)
  if need > SMEM_MAX:
    return f"the split reverse pass at E={e} needs {need} B of SMEM > {SMEM_MAX} B"
  return None


def reverse_state_pass(q, k, do, k2_col, q2_col, gc_col, beta_col, a, p, dht, *, scale, erase,
                       heads=None, pieces=1, save_drhs=False, interpret=False):
  """``mosaic.reverse_state_pass`` (same operands, outputs and layouts) by the split kernel;
  raises ValueError where ``reverse_supported`` refuses the sizes."""
  vd = do.shape[-1]
  bh, nc, c, d, e_dim = _sizes(q, k2_col, heads, pieces, k=k, do=do)
  save_drhs = bool(save_drhs and erase)
  reason = reverse_supported(d, vd, c, e_dim, q.dtype, save_drhs)
  if reason:
    raise ValueError(reason)
  f, lam = _slice_factors(gc_col, k2_col, q2_col, beta_col)
  sw = _swizzle(BLOCK_V)
  du_type = du_dtype(q.dtype, erase)
  x_and_stage = (_smem((e_dim, c, BLOCK_V), BF16, sw),
                 _smem((2, d, BLOCK_V), F32, _swizzle(BLOCK_V, F32)))
  scratch = [
      _smem((2, c, d), BF16, sw),                    # K, by the step's parity
      _smem((c, d), BF16, sw),                       # Q
      _smem((c, BLOCK_V), BF16, sw),                 # dO block
      _smem((c, c), BF16, sw),                       # A
      _smem((c, c), BF16, sw),                       # P
      _smem((f.shape[2], c), F32),                   # row factors: fe, fq, fw, beta
      _smem((2, e_dim // 2, BLOCK_V), F32),          # lam per state warpgroup, slice, column
      _smem((e_dim, d, BLOCK_V), BF16, sw),          # the snapshot of dS, slice by slice
      # X_e = scale diag(fq_e) dO in the loop; before and after it the dht / dh0 staging (one
      # SMEM region on hardware; two in interpret mode, whose copies take no aliased refs)
      (x_and_stage if interpret else plgpu.RefUnion(*x_and_stage)),
      _smem((e_dim, c, BLOCK_V), BF16, sw),          # Z_e = -diag(fe_e) A^T dU
      _smem((c, BLOCK_V), du_type, _swizzle(BLOCK_V, du_type)),   # dU
  ] + _rhs_buffers(c, BLOCK_V, q.dtype, save_drhs) + (
      [_smem((2, 2, d, c), BF16, sw), _smem((2, c, c), BF16, sw)]   # K^T, Q^T; A^T, P^T
      if interpret else [])                                           # (interpret mode)
  kernel = functools.partial(_reverse_kernel, scratch=scratch, nc=nc, e_dim=e_dim, scale=scale,
                             erase=erase, save_drhs=save_drhs, interpret=bool(interpret),
                             heads=heads, pieces=pieces)
  per_chunk = jax.ShapeDtypeStruct((bh, nc, c, vd), q.dtype)
  dv = per_chunk if heads is None else jax.ShapeDtypeStruct((*q.shape[:3], vd), q.dtype)
  out_type = ([jax.ShapeDtypeStruct((bh, nc, c, vd), du_type)] + [per_chunk, dv] * save_drhs
              + [jax.ShapeDtypeStruct((bh, nc, e_dim, d, vd), q.dtype),
                 jax.ShapeDtypeStruct((bh, e_dim, d, vd), F32)])
  return tuple(plgpu.kernel(
      kernel, out_type=out_type,
      scratch_types=[plgpu.Barrier(num_barriers=_R_BARRIERS), plgpu.Barrier(num_arrivals=2),
                     plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1)],
      grid=(bh, vd // BLOCK_V), grid_names=("bh", "v"), num_threads=3, thread_name="wg",
      compiler_params=_compiler_params(regions=False),
      interpret=_interpret_params(interpret), kernel_name="triadic_backward_states_mgpu_split",
  )(k, q, do.astype(q.dtype), a.astype(BF16), p.astype(BF16), f, lam, dht.astype(F32)))


def _reverse_kernel(k_g, q_g, do_g, a_g, p_g, f_g, lam_g, dht_g, du_g, *outs_and_bars, scratch,
                    nc, e_dim, scale, erase, save_drhs, interpret, heads, pieces):
  rhs_g = outs_and_bars[:2 * save_drhs]        # save_drhs: A^T dU and dV = beta A^T dU
  dst_g, dh0_g, bars, h_ready, h_free, xz_ready = outs_and_bars[2 * save_drhs:]
  ops = _Ops(interpret)
  i, j, w = lax.axis_index("bh"), lax.axis_index("v"), lax.axis_index("wg")
  bv, half = BLOCK_V, e_dim // 2
  cols = pl.ds(j * bv, bv)
  c = f_g.shape[-1]
  at = _chunk_box(heads, i, c, pieces, nc)    # chunk n of k, q, dO (and dV)
  rhs_at = _rhs_boxes(rhs_g, at, i, cols)
  erase_rows, read_rows, write_rows, beta_row = 0, e_dim, 2 * e_dim, 3 * e_dim
  chunk_of = lambda step: nc - 1 - step

  copy, wait, copy_next = _copies(bars, nc)

  def body(k_s, q_s, do_s, a_s, p_s, f_s, lam_s, snap_s, union, z_s, du_s, *extra):
    # X and the staging share their SMEM: the values warpgroup writes X first after the first
    # h_ready, which the state warpgroups arrive at once they have read dht; they stage dh0 after
    # their last update, X's last reader.
    x_s, stage_s = union
    rhs_s, interp = extra[:2 * save_drhs], extra[2 * save_drhs:]
    k_at = lambda st: (at(k_g, chunk_of(st)), k_s.at[st % 2], _RK + st % 2)
    q_at = lambda st: (at(q_g, chunk_of(st)), q_s, _RQ)

    @pl.when(w < 2)
    def _state():
      first = w * half
      lam_at = lambda st: (lam_g.at[i, chunk_of(st), pl.ds(first, half)], lam_s.at[w],
                           _RLAM + w)
      copy(*lam_at(0))
      states = _load_slices(ops, lambda e: dht_g.at[i, first + e, :, cols], stage_s.at[w],
                            _RSTAGE + w, half, copy, wait)

      def step_fn(step, states):
        n = chunk_of(step)
        plgpu.wgmma_wait(0)               # the updates of step - 1 are complete
        pl.when(step > 0)(lambda: plgpu.barrier_wait(h_free))
        _write_snapshot(states, snap_s, first,    # with the chunk-end state gradients
                        lambda e: dst_g.at[i, n, first + e, :, cols])
        plgpu.barrier_arrive(h_ready)
        wait(_RLAM + w)
        decayed = _decayed(ops, lam_s.at[w], states)
        copy_next(step, lambda st: [lam_at(st)])
        plgpu.barrier_wait(xz_ready)
        wait(_RQ)
        wait(_RK + step % 2)
        slot = interp[0].at[w] if interp else None
        qt = ops.transposed(q_s, None if slot is None else slot.at[0])
        kt = ops.transposed(k_s.at[step % 2], None if slot is None else slot.at[1])
        # (X's and Z's blocks by a traced index: a static one inside run_state does not lower)
        return tuple(ops.mm_add(decayed[e], [(qt, x_s.at[first + e])]
                                + ([(kt, z_s.at[first + e])] if erase else []))
                     for e in range(half))

      states = lax.fori_loop(0, nc, step_fn, tuple(states))
      plgpu.barrier_wait(h_free)          # the last step's phase (every phase is waited for)
      _store_slices(states, stage_s.at[w], lambda e: dh0_g.at[i, first + e, :, cols])

    @pl.when(w == 2)
    def _values():
      do_at = lambda st: (at(do_g, chunk_of(st), cols), do_s, _RDO)
      a_at = lambda st: (a_g.at[i, chunk_of(st)], a_s, _RA)
      p_at = lambda st: (p_g.at[i, chunk_of(st)], p_s, _RP)
      f_at = lambda st: (f_g.at[i, chunk_of(st)], f_s, _RF)
      for pair in (k_at(0), q_at(0), do_at(0), p_at(0), f_at(0)) + ((a_at(0),) if erase else ()):
        copy(*pair)
      tr = lambda ref, at_: ops.transposed(ref, interp[1].at[at_] if interp else None)

      def step_fn(step, carry):
        n = chunk_of(step)
        _wait_stores()                    # dU's (and A^T dU's, dV's) stores of step - 1
        wait(_RK + step % 2)
        wait(_RP)
        wait(_RDO)
        wait(_RF)
        plgpu.barrier_wait(h_ready)
        # The state warpgroups' updates of step - 1 are complete (they wrote this step's snapshot
        # after them): K of step + 1 into the buffer they read, and Q of this step into its one.
        copy_next(step, lambda st: [k_at(st)])
        pl.when(step > 0)(lambda: copy(*q_at(step)))
        r = _partial(ops, k_s.at[step % 2], snap_s, f_s, write_rows, bv)
        plgpu.barrier_arrive(h_free)
        du = scale * ops.mm(tr(p_s, 1), do_s) + r
        du_s[...] = du.astype(du_s.dtype)
        do = ops.acc(do_s[...].astype(F32))
        for e in range(e_dim):
          x_s.at[e][...] = (scale * ops.rowvec(f_s, read_rows + e, bv) * do).astype(BF16)
        if erase:
          plgpu.commit_smem()             # dU is A^T dU's operand
          wait(_RA)
          drhs = ops.mm(tr(a_s, 0), du_s)
          for e in range(e_dim):
            z_s.at[e][...] = (-ops.rowvec(f_s, erase_rows + e, bv) * drhs).astype(BF16)
          if save_drhs:
            _rhs_gradients(ops, rhs_s, drhs, f_s, beta_row, bv)
        plgpu.commit_smem()               # also: every thread has read dO, P, A and f
        plgpu.barrier_arrive(xz_ready)
        copy_next(step, lambda st: [do_at(st), p_at(st), f_at(st)]
                  + ([a_at(st)] if erase else []))
        plgpu.copy_smem_to_gmem(du_s, du_g.at[i, n, :, cols])
        for out_s, out_at in zip(rhs_s, rhs_at):
          plgpu.copy_smem_to_gmem(out_s, out_at(n))
        return carry

      lax.fori_loop(0, nc, step_fn, None)
      plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(body, *scratch, collective_axes=("wg",))
