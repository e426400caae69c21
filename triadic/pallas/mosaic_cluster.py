"""Hopper (Mosaic GPU) state passes with one thread block per slice: per (batch, head) a cluster
of E blocks, block e holding S_e (dS_e in the reverse pass) whole, D x V float32 in the
registers of two warpgroups, the blocks coupled each chunk through distributed shared memory
(DSMEM). Drop-ins for ``mosaic.state_pass`` and ``mosaic.reverse_state_pass`` (same operands and
outputs) where ``supported`` takes the sizes; ``Config.cluster_state_passes`` selects them.

Why this structure. The value-split kernels (``mosaic``) give each program all E slices of one
D x BV column block of the state, so the e-dependent products are E*BV wide and the sums over e
(of diag(f_e) K S_e, diag(f_e) Q S_e) and the expansion over e (of diag(fw_e) U) are register
work repeated in every value block; keeping dS on the chip in the backward needs a program that
owns a whole slice (benchmarks/RESULTS.md, "What bounds E = 8"). Here block e owns S_e and each
sum over e is a reduce-scatter through DSMEM. Per chunk of the forward (C = 64 tokens;
c = k2 a, fe = beta c, fq = q2 a, fw = k2 b, lam = exp(gc_C) as in ``mosaic``), with V split
into E column blocks of BW = V / E, block e's block of columns being ``own``:

  products    R_e = diag(c_e) K S_e (warpgroup 0),  Y_e = diag(fq_e) Q S_e (warpgroup 1)
  exchange 1  column block j of R_e and Y_e to block j (``plgpu.async_store_smem``: st.async into
              the peer's SMEM, completing on the peer's mbarrier), so block j holds every
              slice's part of its columns
  own columns X_own = V_own - sum_e R_e[:, own]; U_own = A (beta X_own);
              o_own = scale (sum_e Y_e[:, own] + P U_own)            (C x BW, wgmma N = BW)
  exchange 2  U_own to every block of the cluster (all-gather): U (C x V) in each block's SMEM
  update      S_e <- lam_e S_e + (diag(fw_e) K)^T U                  (warpgroup w: its 64 rows)

How, and why each choice:

* Two warpgroups, warpgroup w holding rows [64 w, 64 w + 64) of S_e (64 x V float32: V / 2
  registers a thread). The chunk starts with both writing their rows of S_e as the bf16 wgmma
  operand (``s_s``, two (64, V) pieces) and meeting; R (and Y) is then two wgmmas over the two
  pieces accumulating into one C x V accumulator. Warpgroup 0 rewrites its piece at the next
  chunk's start only after warpgroup 1's Y has read it (``y_read``, a one-way barrier);
  warpgroup 1 rewrites its own after U's exchange, which follows warpgroup 0's R.
* Warpgroup 0 forms R, sends it, reduces its column block, and forms rhs and U_own, which it
  sends to all; warpgroup 1 forms Y, sends it, reduces its column block and forms o_own once U
  has arrived. Both form their diag(fw_e) K piece (``w_s``) while the exchanges are in flight and
  issue their rows' update once U has arrived.
* DSMEM stores come from registers (st.async, each completing its bytes on the peer's barrier);
  a receiving barrier counts E sending warpgroups a round (a Pallas barrier counts warpgroups:
  in lane semantics it is made with 128 arrivals for each). Received
  buffers: the R parts once (float32, C x V in all), the Y parts in bf16 (they only form o, which
  is bf16) by chunk parity, U (bf16, the update's operand) once. A buffer is rewritten only after
  its reader has moved on: block e sends chunk n + 1's R parts after U of chunk n has arrived
  from every block, and block j sends its U part of chunk n after it has read chunk n's R parts;
  U of chunk n + 1 is sent after R of chunk n + 1 arrived from every block, which each block sends
  after its chunk-n update is complete. The Y parts are read by warpgroup 1, which may still be
  reading chunk n's when a peer sends chunk n + 1's: hence two buffers. Without erase nothing
  precedes U's exchange (U = beta V), so a block may send chunk n + 1's U while a peer's update
  still reads chunk n's: U and its barrier then go by chunk parity too (no block is two chunks
  ahead: chunk n + 2's U follows chunk n + 1's from every block). By the same chains no barrier
  sees a round's arrivals before its previous round completed. st.async writes through
  the generic proxy, so a warpgroup fences (``commit_smem``) after the barrier wait and before
  a wgmma reads what peers stored (U, G).
* Every barrier a peer arrives on is in the kernel's scratch, which Mosaic GPU initialises
  before a cluster-wide sync; each block waits for everything sent to it, so no block ends while
  a peer still writes into its SMEM. A peer may send its first chunk's parts while this block
  still loads its initial state through a scope that shares the start of the chunk loop's SMEM,
  so the buffers peers write come last in the loop's scratch, past that scope
  (``_check_received_last``).
* Inputs by TMA, each with its own barrier; K and the factor rows have two buffers (chunk
  parity), refilled for chunk n + 1 right after chunk n's first meeting (both warpgroups are done
  with chunk n - 1's); V and A are refilled by warpgroup 0 after their last read, Q and P by
  warpgroup 1. The factor rows are this slice's (fe, fq, fw, beta, lam repeated C times: as a
  row vector of 64 entries it scales a warpgroup's 64 state rows by lam_e; c).
* Swizzles: K, Q and the S_e pieces share the 128-byte swizzle of a 64-column bf16 row; the
  own-column operands (A, P, rhs, U, V, diag(fw_e) K) share the swizzle of a BW-wide row, so a
  column block of U is whole SMEM tiles (what a DSMEM store into U's column block needs).

Cluster size E <= 8 (the portable limit), V in (64, 128) with E * 16 <= V: E in (2, 4, 8) at
V = 128, (2, 4) at V = 64. D = 128 (two
64-row pieces), C = 64, bf16 inputs. Outputs as ``mosaic.state_pass``: o, U (warpgroup 0 stores
its own columns), X with ``save_x`` (E >= 4: at E = 2 the own-column buffers are 64 wide and
leave no SMEM for it), the chunk-start states (each warpgroup its rows, from the bf16 operand),
or with ``residuals=False`` o and the final state only; q, k, v, o in either layout (``heads``,
``pieces``). The reverse pass is described above ``reverse_state_pass``. The kernels run on a
GPU only: the CPU interpreter has no rule for DSMEM stores; the CUDA lowering is tested.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from triadic.pallas.common import du_dtype
from triadic.pallas.mosaic import (HALF, SMEM_ALIGN, _check_heads, _check_pieces, _chunk_box,
                                   _chunk_loop, _compiler_params, _Inputs, _load_rows, _Ops,
                                   _smem, _store_rows, _swizzle, _sync, _wait_stores)

F32, BF16 = jnp.float32, jnp.bfloat16
FE, FQ, FW, BETA, LAM, CA = range(6)  # rows of a slice's factors (CA: c = k2 a)


_N_BARRIERS = 10                      # q 0, k 1-2, v 3, a 4, p 5, f 6-7, state rows 8-9
_ROWS_BAR = 8


def supported(d: int, vd: int, c: int, e: int, dtype, save_x: bool = False) -> str | None:
  """Why the cluster passes cannot take these sizes (``save_x``: the forward saving X), or
  None."""
  if jnp.dtype(dtype) != jnp.dtype(BF16):
    return f"the cluster state pass takes bfloat16 inputs only, got {jnp.dtype(dtype).name}"
  if c != 64:
    return f"the cluster state pass needs chunk size 64, got {c}"
  if d != 2 * HALF:
    return f"the cluster state pass needs D = {2 * HALF}, got {d}"
  if e not in (2, 4, 8):
    return f"the cluster state pass takes E in (2, 4, 8) (one block a slice), got {e}"
  if vd not in (64, 128) or vd % (16 * e):
    return (f"the cluster state pass needs V in (64, 128) (its state pieces are rows of whole "
            f"128-byte swizzle tiles), a multiple of 16 * E = {16 * e}, got {vd}")
  if save_x and e < 4:
    return f"the cluster forward saves X at E >= 4 (its SMEM at E = {e} has no room for it)"
  return None


def slice_factors(gc_col, k2_col, q2_col, beta_col):
  """(BH, E, NC, 6, C) float32: per slice the rows fe = beta c, fq, fw, beta, lam (lam_e =
  exp(gc_C) repeated C times) and c = k2 a."""
  a = jnp.exp(gc_col)                                  # (BH, NC, C, E)
  gl = gc_col[:, :, -1:, :]
  beta = jnp.broadcast_to(beta_col.astype(F32), a.shape)
  c = k2_col * a
  rows = [beta * c, q2_col * a, k2_col * jnp.exp(gl - gc_col), beta,
          jnp.broadcast_to(jnp.exp(gl), a.shape), c]
  return jnp.transpose(jnp.stack(rows), (1, 4, 2, 0, 3))


def _bytes(ref) -> int:
  return -(-math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize // SMEM_ALIGN) * SMEM_ALIGN


def _check_received_last(scratch, first_received, rows_buf):
  """Peers may send their first chunk's parts while this block still loads its initial state
  through ``rows_buf``'s scope, which shares the chunk loop's SMEM from its start: the buffers
  peers write (``scratch[first_received:]``, allocated in list order) must lie past it."""
  if sum(map(_bytes, scratch[:first_received])) < _bytes(rows_buf):
    raise AssertionError("a buffer peers write would overlap the initial state's SMEM")


def _place(vd, e_dim):
  """(i, e, w, own, rows): this block's batch*head and slice, its warpgroup, its column block of
  V and the warpgroup's 64 state rows."""
  i, e, w = lax.axis_index("bh"), lax.axis_index("slice"), lax.axis_index("wg")
  bw = vd // e_dim
  return i, e, w, pl.ds(e * bw, bw), pl.ds(w * HALF, HALF)


def _mm_sum(pairs, m, n):
  """sum of a @ b over the (a_ref, b_ref) SMEM operand pairs, float32 accumulation."""
  def body(acc):
    for a_ref, b_ref in pairs:
      plgpu.wgmma(acc, a_ref, b_ref)
    return acc[...]
  return pl.run_scoped(body, plgpu.ACC((m, n), F32))


def _scatter(x, recv, bar, bw, e_dim):
  """Column block j of the (C, V) ``x`` to block j's ``recv`` (its slot for this block)."""
  for j in range(e_dim):
    plgpu.async_store_smem(x[:, j * bw:(j + 1) * bw], recv, bar, cluster_idx=j,
                           cluster_dim="slice")


def _received_sum(ops, recv, bar):
  """Once ``bar`` says every block's part has landed: the float32 sum of the E parts in
  ``recv`` (E, C, BW), this block's columns of a sum over slices."""
  plgpu.barrier_wait(bar)
  total = None
  for x in range(recv.shape[0]):
    part = ops.acc(recv.at[x][...].astype(F32))
    total = part if total is None else total + part
  return total


def _all_gather(x, dst, bar, e_dim):
  """This block's (C, BW) ``x`` into ``dst`` (this block's columns of a (C, V) buffer) of every
  block of the cluster, itself included."""
  for j in range(e_dim):
    plgpu.async_store_smem(x, dst, bar, cluster_idx=j, cluster_dim="slice")


def _kernel(q_g, k_g, v_g, a_g, p_g, f_g, h0_g, *outs_and_bars, scratch, rows_buf, nc, e_dim,
            scale, erase, residuals, save_x, heads, pieces):
  if not residuals:                     # o and the final state only
    (o_g, ht_g), x_g = outs_and_bars[:2], None
  elif save_x:
    o_g, u_g, x_g, st_g, ht_g = outs_and_bars[:5]
  else:
    (o_g, u_g, st_g, ht_g), x_g = outs_and_bars[:4], None
  bars, xbar, y_read, got_r, got_y, got_u = outs_and_bars[-6:]
  ops = _Ops(False)
  c, vd = f_g.shape[-1], v_g.shape[-1]
  bw = vd // e_dim
  i, e, w, own, rows = _place(vd, e_dim)
  at = _chunk_box(heads, i, c, pieces, nc)   # q, k, v, o: (BH, NC, C, X) or (B, T, H, X) boxes
  state0 = _load_rows(ops, h0_g.at[i, e, rows], rows_buf, bars.at[_ROWS_BAR + w], w, xbar)

  def copies(q_s, k_s, v_s, a_s, p_s, f_s):
    return _Inputs(bars, {
        "q": (lambda n: at(q_g, n), q_s, 0),
        "k": (lambda n: at(k_g, n), k_s, 1),
        "v": (lambda n: at(v_g, n, own), v_s, 3),
        "a": (lambda n: a_g.at[i, n], a_s, 4),
        "p": (lambda n: p_g.at[i, n], p_s, 5),
        "f": (lambda n: f_g.at[i, e, n], f_s, 6)}, order=lambda n: n, nc=nc,
        double=("k", "f"))

  first0 = ("k", "f", "v") + (("a",) if erase else ())

  def prologue(*refs):
    cp = copies(*refs[:6])
    pl.when(w == 0)(lambda: cp.start(first0, 0))
    pl.when(w == 1)(lambda: cp.start(("q", "p"), 0))

  def chunk(n, s, q_s, k_s, v_s, a_s, p_s, f_s, s_s, w_s, rhs_s, o_s, *rest, stage):
    x_s, rest = rest[:save_x], rest[save_x:]
    if erase:
      u_s, recv_r, recv_y = rest
      u_bar = got_u.at[0]
    else:                               # U by chunk parity (``state_pass``' no-erase note)
      u_bufs, recv_y = rest
      u_s, u_bar, recv_r = u_bufs.at[n % 2], got_u.at[n % 2], None
    cp = copies(q_s, k_s, v_s, a_s, p_s, f_s)
    k_n, f_n = cp.ref("k", n), cp.ref("f", n)
    stage("wait update")
    plgpu.wgmma_wait(0)                 # this warpgroup's previous update has read W, U
    _wait_stores()                      # o's store has read o_s
    stage("chunk start")
    # Warpgroup 1's product Y of chunk n - 1 has read the piece warpgroup 0 now rewrites
    # (warpgroup 0's R of chunk n - 1 preceded U's exchange, which warpgroup 1 has waited for).
    pl.when((w == 0) & (n > 0))(lambda: plgpu.barrier_wait(y_read))
    s_s.at[w][...] = s.astype(BF16)
    _sync(xbar)                         # S_e whole in SMEM; both are done with chunk n - 1
    if residuals:                       # the chunk-start state, this warpgroup's rows
      plgpu.copy_smem_to_gmem(s_s.at[w], st_g.at[i, n, e, rows])
    pl.when(w == 0)(lambda: cp.start_next(("k", "f"), n))
    cp.wait("k", n)
    cp.wait("f", n)
    state_pieces = [(k_n.at[:, pl.ds(x * HALF, HALF)], s_s.at[x]) for x in range(2)]

    stage("products")

    @pl.when(w == 0)
    def _():
      if erase:
        r = ops.rowvec(f_n, CA, vd) * _mm_sum(state_pieces, c, vd)
        _scatter(r, recv_r.at[e], got_r, bw, e_dim)

    @pl.when(w == 1)
    def _():
      cp.wait("q", n)
      q_pieces = [(q_s.at[:, pl.ds(x * HALF, HALF)], s_s.at[x]) for x in range(2)]
      y = ops.rowvec(f_n, FQ, vd) * _mm_sum(q_pieces, c, vd)
      plgpu.commit_smem()
      plgpu.barrier_arrive(y_read)
      cp.start_next(("q",), n)
      _scatter(y.astype(BF16), recv_y.at[n % 2, e], got_y.at[n % 2], bw, e_dim)

    stage("W")
    for x in range(2):                  # diag(fw_e) K, this warpgroup's 64 columns
      @pl.when(w == x)
      def _():
        kx = ops.acc(k_n[:, x * HALF:(x + 1) * HALF].astype(F32))
        w_s.at[x][...] = (ops.rowvec(f_n, FW, HALF) * kx).astype(BF16)

    stage("own columns")

    @pl.when(w == 0)
    def _():
      cp.wait("v", n)
      beta = ops.rowvec(f_n, BETA, bw)
      v = ops.acc(v_s[...].astype(F32))
      if erase:                         # X = V - sum_e c_e R_e, rhs = beta X
        x = v - _received_sum(ops, recv_r, got_r)
        rhs_s[...] = (beta * x).astype(BF16)
        if save_x:
          x_s[0][...] = x.astype(x_s[0].dtype)
        plgpu.commit_smem()
        cp.start_next(("v",), n)
        if save_x:
          plgpu.copy_smem_to_gmem(x_s[0], x_g.at[i, n, :, own])
        cp.wait("a", n)
        u = ops.mm(a_s, rhs_s)
        cp.start_next(("a",), n)
      else:
        u = beta * v
        plgpu.commit_smem()
        cp.start_next(("v",), n)
      u16 = u.astype(BF16)
      _all_gather(u16, u_s.at[:, own], u_bar, e_dim)
      if residuals:                     # rhs_s is free: the product U = A rhs is complete
        rhs_s[...] = u16
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(rhs_s, u_g.at[i, n, :, own])

    @pl.when(w == 1)
    def _():
      y_own = _received_sum(ops, recv_y.at[n % 2], got_y.at[n % 2])
      plgpu.barrier_wait(u_bar)
      plgpu.commit_smem()               # U, written by DSMEM stores, for the wgmma (async proxy)
      cp.wait("p", n)
      out = ops.mm(p_s, u_s.at[:, own]) + y_own
      o_s[...] = (scale * out).astype(o_s.dtype)
      plgpu.commit_smem()
      cp.start_next(("p",), n)
      plgpu.copy_smem_to_gmem(o_s, at(o_g, n, own))

    stage("update")
    pl.when(w == 0)(lambda: plgpu.barrier_wait(u_bar))
    plgpu.commit_smem()                 # this warpgroup's W piece and U, for its wgmma
    decayed = ops.rowvec(f_n, LAM, vd) * s
    wt = plgpu.transpose_ref(w_s.at[w], (1, 0))
    return ops.mm_add(decayed, [(wt, u_s)])

  state = _chunk_loop(chunk, nc, state0, scratch, prologue, xbar)
  _store_rows(state, ht_g.at[i, e, rows], rows_buf, w)


def state_pass(q, k, v, k2_col, q2_col, gc_col, beta_col, a, p, h0, *, scale, erase,
               residuals=True, save_x=False, heads=None, pieces=1):
  """The forward state pass, ``mosaic.state_pass``'s operands and outputs: o (BH, NC, C, V) in q's
  dtype, U (BH, NC, C, V) in q's dtype, [X = V - sum_e diag(k2_e exp(gc_e)) K S_e (BH, NC, C,
  V) in q's dtype with ``save_x`` (erase only),] the chunk-start states (BH, NC, E, D, V) in q's
  dtype and the final state (BH, E, D, V) float32, from q, k, v in the (BH, NC, C, X) kernel
  layout, the chunk-local gc, k2, q2, beta columns (BH, NC, C, E | 1), A, P (BH, NC, C, C) and
  h0 (BH, E, D, V). ``residuals=False``: o and the final state only (the op's primal).
  ``heads=H``: q, k, v and o in the caller's (B, T, H, X) layout, read and written in place by
  TMA; ``pieces`` P > 1 with it: every (BH, ...) operand and output is (BH * P, NC / P, ...)
  (``mosaic.state_pass``, ``pieces.py``)."""
  _check_pieces(heads, pieces)
  shape = q if heads is None else _check_heads(heads, pieces, k2_col, q, k=k, v=v)
  bh, nc, c, d = shape.shape
  vd, e_dim = v.shape[-1], k2_col.shape[-1]
  reason = supported(d, vd, c, e_dim, q.dtype, save_x=save_x and erase)
  if reason:
    raise ValueError(reason)
  save_x = bool(save_x and erase)
  if save_x and not residuals:
    raise ValueError("save_x needs residuals=True (X is a residual for the backward)")
  bw = vd // e_dim
  sw_own, sw_d = _swizzle(bw), _swizzle(HALF)
  f = slice_factors(gc_col, k2_col, q2_col, beta_col)
  scratch = [
      _smem((c, d), BF16, sw_d),                  # q
      _smem((2, c, d), BF16, sw_d),               # k (chunk parity)
      _smem((c, bw), BF16, sw_own),               # v, own columns
      _smem((c, c), BF16, sw_own),                # A
      _smem((c, c), BF16, sw_own),                # P
      _smem((2, f.shape[-2], c), F32),            # factor rows (chunk parity)
      _smem((2, HALF, vd), BF16, sw_d),           # S_e (bf16 operand), a 64-row piece each
      _smem((2, c, HALF), BF16, sw_own),          # diag(fw_e) K, a 64-column piece each
      _smem((c, bw), BF16, sw_own),               # rhs, then U's own columns (residuals)
      _smem((c, bw), q.dtype, sw_own),            # o, own columns
  ] + [_smem((c, bw), q.dtype, sw_own)] * save_x + ([     # X, own columns
      # written by the peers:
      _smem((c, vd), BF16, sw_own),               # U (all-gathered)
      _smem((e_dim, c, bw), F32, _swizzle(bw, F32)),       # R parts received, one per slice
  ] if erase else [
      _smem((2, c, vd), BF16, sw_own),            # U (all-gathered), by chunk parity
  ]) + [_smem((2, e_dim, c, bw), BF16, sw_own)]   # Y parts received (chunk parity)
  rows_buf = _smem((2, HALF, vd), F32, _swizzle(vd, F32))
  _check_received_last(scratch, -3 if erase else -2, rows_buf)
  kernel = functools.partial(_kernel, scratch=scratch, rows_buf=rows_buf, nc=nc, e_dim=e_dim,
                             scale=scale, erase=erase, residuals=bool(residuals), save_x=save_x,
                             heads=heads, pieces=pieces)
  arrivals = e_dim
  per_chunk = jax.ShapeDtypeStruct((bh, nc, c, vd), q.dtype)
  o_type = per_chunk if heads is None else jax.ShapeDtypeStruct((*q.shape[:3], vd), q.dtype)
  saved = ([per_chunk] * (1 + save_x) + [jax.ShapeDtypeStruct((bh, nc, e_dim, d, vd), q.dtype)]
           if residuals else [])
  out_type = [o_type, *saved, jax.ShapeDtypeStruct((bh, e_dim, d, vd), F32)]
  return plgpu.kernel(
      kernel, out_type=tuple(out_type),
      scratch_types=[plgpu.Barrier(num_barriers=_N_BARRIERS), plgpu.Barrier(num_arrivals=2),
                     plgpu.Barrier(),
                     plgpu.Barrier(num_arrivals=arrivals),
                     plgpu.Barrier(num_arrivals=arrivals, num_barriers=2),
                     plgpu.Barrier(num_arrivals=arrivals, num_barriers=2)],
      grid=(bh,), grid_names=("bh",), cluster=(e_dim,), cluster_names=("slice",),
      num_threads=2, thread_name="wg", compiler_params=_compiler_params(),
      kernel_name="triadic_forward_cluster",
  )(q, k, v, a.astype(BF16), p.astype(BF16), f, h0.astype(F32))


# ------------------------------------------------------------------------------------------------
# Reverse pass: block e holds dS_e whole. Per chunk, walked backwards:
#
#   product     Z_e = diag(fw_e) K dS_e                               (warpgroup 0)
#   exchange 1  column block j of Z_e to block j
#   own columns dU_own = scale P^T dO_own + sum_e Z_e[:, own];  G_own = A^T dU_own (erase)
#   exchange 2  G_own to every block (erase)
#   update      dS_e <- lam_e dS_e + (scale diag(fq_e) Q)^T dO - (diag(fe_e) K)^T G
#
# Warpgroup 0 forms Z, reduces its column block and forms dU (stored in ``du_dtype``), G from dU
# rounded as stored (as the value-split pass) and, with ``save_drhs``, the own columns of A^T dU
# and dV = beta A^T dU; both warpgroups form their 64 columns of scale diag(fq_e) Q and
# -diag(fe_e) K while the exchanges are in flight. Only warpgroup 0 reads the dS_e operand,
# before it sends Z; warpgroup 1 rewrites its piece after G's exchange (without erase, Z's).
# Without erase no exchange follows Z's, so a block may send step + 1's Z parts while a peer
# still reads step's: the Z parts and their barrier then go by step parity (as the forward's U).
# K and the factor rows have two buffers (chunk parity) as in the forward; Q and dO, read by
# both warpgroups, are refilled at the next chunk's first meeting; A and P by warpgroup 0 after
# their reads.

_N_BARRIERS_REV = 10                  # k 0-1, f 2-3, q 4, do 5, a 6, p 7, state rows 8-9


def _reverse_kernel(k_g, q_g, do_g, a_g, p_g, f_g, dht_g, *outs_and_bars, scratch, rows_buf, nc,
                    e_dim, scale, erase, save_drhs, heads, pieces):
  du_g, *rhs_g = outs_and_bars[:1 + 2 * save_drhs]   # save_drhs: A^T dU and dV = beta A^T dU
  dst_g, dh0_g, bars, xbar, got_z, got_g = outs_and_bars[1 + 2 * save_drhs:]
  ops = _Ops(False)
  c, vd = f_g.shape[-1], do_g.shape[-1]
  bw = vd // e_dim
  i, e, w, own, rows = _place(vd, e_dim)
  at = _chunk_box(heads, i, c, pieces, nc)   # k, q, dO, dV: (BH, NC, C, X) or (B, T, H, X)
  dstate0 = _load_rows(ops, dht_g.at[i, e, rows], rows_buf, bars.at[_ROWS_BAR + w], w, xbar)
  order = lambda step: nc - 1 - step

  def copies(k_s, q_s, do_s, a_s, p_s, f_s):
    return _Inputs(bars, {
        "k": (lambda n: at(k_g, n), k_s, 0),
        "f": (lambda n: f_g.at[i, e, n], f_s, 2),
        "q": (lambda n: at(q_g, n), q_s, 4),
        "do": (lambda n: at(do_g, n), do_s, 5),
        "a": (lambda n: a_g.at[i, n], a_s, 6),
        "p": (lambda n: p_g.at[i, n], p_s, 7)}, order=order, nc=nc, double=("k", "f"))

  first0 = ("k", "f", "q", "do", "p") + (("a",) if erase else ())

  def prologue(*refs):
    cp = copies(*refs[:6])
    pl.when(w == 0)(lambda: cp.start(first0, 0))

  def chunk(step, ds, k_s, q_s, do_s, a_s, p_s, f_s, ds_s, xq_s, du_s, *rest, stage):
    if erase:
      zk_s, *rhs_s, g_s, recv_z = rest
      z_bar = got_z.at[0]
    else:                               # Z parts by chunk parity (the no-erase note above)
      (recv_z,), rhs_s, z_bar = rest, (), got_z.at[step % 2]
      recv_z = recv_z.at[step % 2]
    cp = copies(k_s, q_s, do_s, a_s, p_s, f_s)
    n = order(step)
    k_n, f_n = cp.ref("k", step), cp.ref("f", step)
    stage("wait update")
    plgpu.wgmma_wait(0)                 # this warpgroup's previous update has read Q, K, dO, G
    _wait_stores()                      # its stores have read their buffers
    stage("chunk start")
    ds_s.at[w][...] = ds.astype(BF16)
    _sync(xbar)                         # dS_e whole in SMEM; both are done with step - 1
    plgpu.copy_smem_to_gmem(ds_s.at[w], dst_g.at[i, n, e, rows])
    pl.when((w == 0) & (step > 0))(lambda: cp.start(("q", "do"), step))
    pl.when(w == 0)(lambda: cp.start_next(("k", "f"), step))
    cp.wait("k", step)
    cp.wait("f", step)

    stage("product")

    @pl.when(w == 0)
    def _():
      pieces = [(k_n.at[:, pl.ds(x * HALF, HALF)], ds_s.at[x]) for x in range(2)]
      z = ops.rowvec(f_n, FW, vd) * _mm_sum(pieces, c, vd)
      _scatter(z, recv_z.at[e], z_bar, bw, e_dim)

    stage("operands")
    cp.wait("q", step)
    for x in range(2):                  # this warpgroup's 64 columns of the update's lhs
      @pl.when(w == x)
      def _():
        cols = slice(x * HALF, (x + 1) * HALF)
        qx = ops.acc(q_s[:, cols].astype(F32))
        xq_s.at[x][...] = (scale * ops.rowvec(f_n, FQ, HALF) * qx).astype(BF16)
        if erase:
          kx = ops.acc(k_n[:, cols].astype(F32))
          zk_s.at[x][...] = (-ops.rowvec(f_n, FE, HALF) * kx).astype(BF16)

    stage("own columns")

    @pl.when(w == 0)
    def _():
      cp.wait("p", step)
      cp.wait("do", step)
      pt = plgpu.transpose_ref(p_s, (1, 0))
      z_own = _received_sum(ops, recv_z, z_bar)
      du = scale * ops.mm(pt, do_s.at[:, own]) + z_own
      du_s[...] = du.astype(du_s.dtype)
      plgpu.commit_smem()
      cp.start_next(("p",), step)
      plgpu.copy_smem_to_gmem(du_s, du_g.at[i, n, :, own])
      if erase:
        cp.wait("a", step)
        drhs = ops.mm(plgpu.transpose_ref(a_s, (1, 0)), du_s)
        cp.start_next(("a",), step)
        g16 = drhs.astype(BF16)
        _all_gather(g16, g_s.at[:, own], got_g, e_dim)
        if save_drhs:
          drhs_s, dv_s = rhs_s
          drhs_s[...] = g16.astype(drhs_s.dtype)
          dv_s[...] = (ops.rowvec(f_n, BETA, bw) * drhs).astype(dv_s.dtype)
          plgpu.commit_smem()
          drhs_g, dv_g = rhs_g
          plgpu.copy_smem_to_gmem(drhs_s, drhs_g.at[i, n, :, own])
          plgpu.copy_smem_to_gmem(dv_s, at(dv_g, n, own))

    stage("update")
    pl.when(w == 1)(lambda: cp.wait("do", step))
    # G's exchange follows warpgroup 0's product Z, which read the dS_e piece warpgroup 1 rewrites
    # at the next chunk's start; without erase warpgroup 1 waits for Z's exchange instead.
    if erase:
      plgpu.barrier_wait(got_g)
    else:
      pl.when(w == 1)(lambda: plgpu.barrier_wait(z_bar))
    plgpu.commit_smem()                 # this warpgroup's operands and G, for its wgmma
    pairs = [(plgpu.transpose_ref(xq_s.at[w], (1, 0)), do_s)]
    if erase:
      pairs.append((plgpu.transpose_ref(zk_s.at[w], (1, 0)), g_s))
    return ops.mm_add(ops.rowvec(f_n, LAM, vd) * ds, pairs)

  dstate = _chunk_loop(chunk, nc, dstate0, scratch, prologue, xbar)
  _store_rows(dstate, dh0_g.at[i, e, rows], rows_buf, w)


def reverse_state_pass(q, k, do, k2_col, q2_col, gc_col, beta_col, a, p, dht, *, scale, erase,
                       save_drhs=False, heads=None, pieces=1):
  """The reverse state pass (``mosaic.reverse_state_pass``'s outputs): dU (BH, NC, C, V) in
  ``common.du_dtype``, [A^T dU and dV = beta A^T dU (BH, NC, C, V) in q's dtype with
  ``save_drhs`` (erase only),] the chunk-end state gradients (BH, NC, E, D, V) in q's dtype and
  the gradient of the initial state (BH, E, D, V) float32. Operands as ``state_pass``'s, dO
  (BH, NC, C, V) in place of v and dht (BH, E, D, V) in place of h0. ``heads``, ``pieces``: as
  ``state_pass``'s, for q, k, dO and dV (returned (B, T, H, V))."""
  _check_pieces(heads, pieces)
  shape = q if heads is None else _check_heads(heads, pieces, k2_col, q, k=k, do=do)
  bh, nc, c, d = shape.shape
  vd, e_dim = do.shape[-1], k2_col.shape[-1]
  reason = supported(d, vd, c, e_dim, q.dtype)
  if reason:
    raise ValueError(reason)
  save_drhs = bool(save_drhs and erase)
  bw = vd // e_dim
  sw_own, sw_d = _swizzle(bw), _swizzle(HALF)
  du_type = du_dtype(q.dtype, erase)
  f = slice_factors(gc_col, k2_col, q2_col, beta_col)
  scratch = [
      _smem((2, c, d), BF16, sw_d),               # k (chunk parity)
      _smem((c, d), BF16, sw_d),                  # q
      _smem((c, vd), BF16, sw_own),               # dO
      _smem((c, c), BF16, sw_own),                # A
      _smem((c, c), BF16, sw_own),                # P
      _smem((2, f.shape[-2], c), F32),            # factor rows (chunk parity)
      _smem((2, HALF, vd), BF16, sw_d),           # dS_e (bf16 operand), a 64-row piece each
      _smem((2, c, HALF), BF16, sw_own),          # scale diag(fq_e) Q, a 64-column piece each
      _smem((c, bw), du_type, _swizzle(bw, du_type)),   # dU, own columns
  ]
  if erase:
    scratch += [
        _smem((2, c, HALF), BF16, sw_own),        # -diag(fe_e) K, a 64-column piece each
    ] + [_smem((c, bw), q.dtype, sw_own) for _ in range(2 * save_drhs)] + [   # A^T dU, dV
        # written by the peers:
        _smem((c, vd), BF16, sw_own),             # G = A^T dU (all-gathered)
        _smem((e_dim, c, bw), F32, _swizzle(bw, F32)),  # Z parts received, one per slice
    ]
  else:                                           # Z parts received, by chunk parity
    scratch.append(_smem((2, e_dim, c, bw), F32, _swizzle(bw, F32)))
  rows_buf = _smem((2, HALF, vd), F32, _swizzle(vd, F32))
  _check_received_last(scratch, -2 if erase else -1, rows_buf)
  kernel = functools.partial(_reverse_kernel, scratch=scratch, rows_buf=rows_buf, nc=nc,
                             e_dim=e_dim, scale=scale, erase=erase, save_drhs=save_drhs,
                             heads=heads, pieces=pieces)
  per_chunk = jax.ShapeDtypeStruct((bh, nc, c, vd), q.dtype)
  dv = per_chunk if heads is None else jax.ShapeDtypeStruct((*q.shape[:3], vd), q.dtype)
  out_type = ([jax.ShapeDtypeStruct((bh, nc, c, vd), du_type)] + [per_chunk, dv] * save_drhs
              + [jax.ShapeDtypeStruct((bh, nc, e_dim, d, vd), q.dtype),
                 jax.ShapeDtypeStruct((bh, e_dim, d, vd), F32)])
  arrivals = e_dim
  return plgpu.kernel(
      kernel, out_type=tuple(out_type),
      scratch_types=[plgpu.Barrier(num_barriers=_N_BARRIERS_REV), plgpu.Barrier(num_arrivals=2),
                     plgpu.Barrier(num_arrivals=arrivals, num_barriers=2),
                     plgpu.Barrier(num_arrivals=arrivals)],
      grid=(bh,), grid_names=("bh",), cluster=(e_dim,), cluster_names=("slice",),
      num_threads=2, thread_name="wg", compiler_params=_compiler_params(),
      kernel_name="triadic_backward_states_cluster",
  )(k, q, do.astype(q.dtype), a.astype(BF16), p.astype(BF16), f, dht.astype(F32))
