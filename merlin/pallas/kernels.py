"""The Triton Pallas kernels of multi-state linear attention's state work (docs/spec.md section 2).

Per (batch*head), chunk n of C tokens and segment state i, from the plain-JAX chunk prep
(``merlin.chunked.intra_chunk``): Qe_n, W_n, Kw_n (C, D), Uv_n (C, V), the chunk decay
gamma_n = exp(gc_C) and lam_n,i (C, 1). State i is zero before its segment's first chunk
n_i = i cps (cps = chunks per segment), is written during its cps chunks and only carried after:

    S_{n+1}^i = gamma_n S_n^i - Kw_n^T (W_n S_n^i) + [n in segment i] Kw_n^T Uv_n   (W = 0: no erase)
    o_n      += (lam_n,i Qe_n) S_n^i                                               (for every i <= s(n))

Every state carries through its own chain of chunks, independent of the others, so the state
passes put the segment index on the grid: program (bh, value block j, segment i) walks chunks
n_i .. NC-1 with the (D, block_v) float32 state S^i in registers (a finished erase-free state is
only rescaled, no matmul). The stack is never held by one program: the forward stores every
visible chunk-start state S_n^i (n >= n_i, in the input dtype) once, in a compact
(BH, VIS, D, V) array, VIS = sum_i (NC - n_i), at ``index(i, n)``; the readout is then parallel
over chunks, o_n = sum_{i <= s(n)} (lam_n,i Qe_n) S_n^i, the (C, (s(n)+1) D) x ((s(n)+1) D, V)
product over the stacked states walked state by state.

Backward (dS^i_{n+1}, the gradient of the state leaving chunk n, zero after the last chunk):

    dS_n^i  = gamma_n dS^i_{n+1} - W_n^T (Kw_n dS^i_{n+1}) + (lam_n,i Qe_n)^T dO_n
    dUv_n   = Kw_n dS^{s(n)}_{n+1}
    dQe_n   = sum_i lam_n,i (dO_n S_n^iT)          dlam_n,i = rowsum(dO_n * (Qe_n S_n^i))
    dKw_n   = Uv_n dS^{s(n)T}_{n+1} - sum_i (W_n S_n^i) dS^{iT}_{n+1}
    dW_n    = -sum_i (Kw_n dS^i_{n+1}) S_n^iT      dgamma_n = sum_i <dS^i_{n+1}, S_n^i>

The reverse state pass (same grid as the forward) stores dS^i_{n+1} at ``index(i, n)`` and dUv;
the chunk-gradients kernel, one program per (batch*head, chunk, gradient part), sums the stack's
terms over i and the value axis, so no two programs write one output (no atomics).

Layout: (BH, NC, C, X) for per-token operands, lam (BH, NS, NC, C, 1), gamma (BH, NC, 1, 1);
D, V padded to powers of two (Triton), NS = ceil(NC / cps) the segments the tokens occupy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.pallas.common import F32, call, mm, rowsum, total


def num_visible(nc: int, cps: int) -> int:
  """VIS: the number of (segment i, chunk n >= n_i) pairs, the stored states per batch*head."""
  return sum(nc - i * cps for i in range(-(-nc // cps)))


def index(i, n, nc: int, cps: int):
  """Where S_n^i lives in the compact stack: the pairs of segments j < i, then n - n_i."""
  return i * nc - cps * (i * (i - 1)) // 2 + n - i * cps


def _segment_bounds(nc, cps):
  """(first chunk, end of the write phase) of the program's segment, from its grid index."""
  start = pl.program_id(2) * cps
  return start, jnp.minimum(start + cps, nc)


def _state_kernel(*refs, nc, cps, erase, dtype):
  if erase:
    w_ref, kw_ref, uv_ref, gam_ref, states_ref = refs
  else:
    kw_ref, uv_ref, gam_ref, states_ref = refs
  i = pl.program_id(2)
  start, end = _segment_bounds(nc, cps)

  def chunk(n, s, write):
    states_ref[index(i, n, nc, cps)] = s.astype(states_ref.dtype)
    new = gam_ref[n] * s
    if erase or write:
      kw = kw_ref[n]
    if erase:
      new = new - mm(kw, mm(w_ref[n], s, dtype), dtype, ta=True)
    if write:
      new = new + mm(kw, uv_ref[n], dtype, ta=True)
    return new

  d, bv = states_ref.shape[-2:]
  s = jax.lax.fori_loop(start, end, lambda n, s: chunk(n, s, True), jnp.zeros((d, bv), F32))
  jax.lax.fori_loop(end, nc, lambda n, s: chunk(n, s, False), s)


def _readout_kernel(qe_ref, lam_ref, states_ref, o_ref, *, nc, cps, dtype):
  n = pl.program_id(1)
  qe = qe_ref[...].astype(F32)

  def state(i, acc):
    return acc + mm(lam_ref[i] * qe, states_ref[index(i, n, nc, cps)], dtype)

  o_ref[...] = jax.lax.fori_loop(0, n // cps + 1, state, jnp.zeros(o_ref.shape, F32))


def _reverse_kernel(*refs, nc, cps, erase, dtype):
  if erase:
    qe_ref, w_ref, kw_ref, lam_ref, gam_ref, do_ref, dstates_ref, duv_ref = refs
  else:
    qe_ref, kw_ref, lam_ref, gam_ref, do_ref, dstates_ref, duv_ref = refs
  i = pl.program_id(2)
  start, end = _segment_bounds(nc, cps)

  def chunk(n, ds, write):
    dstates_ref[index(i, n, nc, cps)] = ds.astype(dstates_ref.dtype)
    new = gam_ref[n] * ds + mm(lam_ref[n] * qe_ref[n].astype(F32), do_ref[n], dtype, ta=True)
    if erase or write:
      y = mm(kw_ref[n], ds, dtype)
    if write:
      duv_ref[n] = y
    if erase:
      new = new - mm(w_ref[n], y, dtype, ta=True)
    return new

  d, bv = dstates_ref.shape[-2:]
  ds = jax.lax.fori_loop(0, nc - end, lambda j, ds: chunk(nc - 1 - j, ds, False),
                         jnp.zeros((d, bv), F32))
  jax.lax.fori_loop(0, end - start, lambda j, ds: chunk(end - 1 - j, ds, True), ds)


def _gradients_kernel(*refs, nc, cps, vd, bv, erase, dtype):
  """Program (bh, chunk n, part): part 0 dQe and dlam (from dO and the states), part 1 dKw, dW and
  dgamma (from the states and their gradients), each summed over the visible states i <= s(n) and
  the value blocks. The parts need disjoint products (dO S^T, Qe S; W S, X dS^T, Kw dS, Y S^T), so
  splitting them costs one more read of the stored states and halves the float32 (C, D)
  accumulators a program holds."""
  if erase:
    (qe_ref, w_ref, kw_ref, uv_ref, lam_ref, do_ref, states_ref, dstates_ref,
     dqe_ref, dw_ref, dkw_ref, dgam_ref, dlam_ref) = refs
  else:
    (qe_ref, kw_ref, uv_ref, lam_ref, do_ref, states_ref, dstates_ref,
     dqe_ref, dkw_ref, dgam_ref, dlam_ref) = refs
  n, part = pl.program_id(1), pl.program_id(2)
  cur = n // cps
  c, d = qe_ref.shape
  blocks = [pl.ds(j * bv, bv) for j in range(vd // bv)] if vd > bv else [slice(None)]
  zero = jnp.zeros((c, d), F32)
  over_states = lambda body, init: jax.lax.fori_loop(0, cur + 1, body, init)

  @pl.when(part == 0)
  def _():
    qe = qe_ref[...]

    def state(i, dqe):
      at = index(i, n, nc, cps)
      dq, dlam = zero, jnp.zeros((c, 1), F32)
      for cols in blocks:
        s, do = states_ref[at, :, cols], do_ref[:, cols]
        dq = dq + mm(do, s, dtype, tb=True)
        dlam = dlam + rowsum(do.astype(F32) * mm(qe, s, dtype))
      dlam_ref[i] = dlam
      return dqe + lam_ref[i] * dq

    dqe_ref[...] = over_states(state, zero)

  @pl.when(part == 1)
  def _():
    w, kw = (w_ref[...], kw_ref[...]) if erase else (None, None)

    def state(i, carry):
      dkw, dw, dgam = carry
      at = index(i, n, nc, cps)
      for cols in blocks:
        s, ds = states_ref[at, :, cols], dstates_ref[at, :, cols]
        dgam = dgam + total(ds.astype(F32) * s.astype(F32))
        if erase:
          dkw = dkw - mm(mm(w, s, dtype), ds, dtype, tb=True)
          dw = dw - mm(mm(kw, ds, dtype), s, dtype, tb=True)
      return dkw, dw, dgam

    dkw, dw, dgam = over_states(state, (zero, zero, jnp.zeros((1, 1), F32)))
    at = index(cur, n, nc, cps)
    for cols in blocks:  # the write Kw^T Uv into the current state
      dkw = dkw + mm(uv_ref[:, cols], dstates_ref[at, :, cols], dtype, tb=True)
    dkw_ref[...] = dkw
    dgam_ref[...] = dgam
    if erase:
      dw_ref[...] = dw


def _whole(*shape):
  """A block spanning a (BH, *shape) operand's trailing dims, for grids led by BH."""
  return pl.BlockSpec((None, *shape), lambda b, *_: (b,) + (0,) * len(shape))


def state_pass(qe, w, kw, uv, gam, *, cps, erase, cfg):
  """Forward state pass: every visible chunk-start state, (BH, VIS, D, V) in qe's dtype.

  Grid (BH, V / block_v, NS); w is None without erase."""
  bh, nc, c, d = qe.shape
  vd = uv.shape[-1]
  bv = min(cfg.block_v, vd)
  ns = -(-nc // cps)
  vis = num_visible(nc, cps)
  ins = ([w] if erase else []) + [kw, uv, gam]
  in_specs = ([_whole(nc, c, d)] if erase else []) + [
      _whole(nc, c, d), pl.BlockSpec((None, nc, c, bv), lambda b, j, i: (b, 0, 0, j)),
      _whole(nc, 1, 1)]
  kernel = functools.partial(_state_kernel, nc=nc, cps=cps, erase=erase, dtype=qe.dtype)
  return call(kernel, cfg=cfg, grid=(bh, vd // bv, ns), in_specs=in_specs,
              out_specs=pl.BlockSpec((None, vis, d, bv), lambda b, j, i: (b, 0, 0, j)),
              out_shape=jax.ShapeDtypeStruct((bh, vis, d, vd), qe.dtype),
              semantics=None, name="merlin_state_pass")(*ins)


def readout(qe, lam, states, *, cps, cfg):
  """o_n = sum_{i <= s(n)} (lam_n,i Qe_n) S_n^i, (BH, NC, C, V) float32. Grid (BH, NC, V / bv)."""
  bh, nc, c, d = qe.shape
  vis, vd = states.shape[1], states.shape[-1]
  ns = lam.shape[1]
  bv = min(cfg.bwd_block_v, vd)
  kernel = functools.partial(_readout_kernel, nc=nc, cps=cps, dtype=qe.dtype)
  return call(kernel, cfg=cfg, grid=(bh, nc, vd // bv),
              in_specs=[pl.BlockSpec((None, None, c, d), lambda b, n, j: (b, n, 0, 0)),
                        pl.BlockSpec((None, ns, None, c, 1), lambda b, n, j: (b, 0, n, 0, 0)),
                        pl.BlockSpec((None, vis, d, bv), lambda b, n, j: (b, 0, 0, j))],
              out_specs=pl.BlockSpec((None, None, c, bv), lambda b, n, j: (b, n, 0, j)),
              out_shape=jax.ShapeDtypeStruct((bh, nc, c, vd), F32),
              semantics=None, name="merlin_readout")(qe, lam, states)


def reverse_state_pass(qe, w, kw, lam, gam, do, *, cps, erase, cfg):
  """Reverse state pass: dS^i_{n+1} at ``index(i, n)`` (BH, VIS, D, V) in qe's dtype, and dUv
  (BH, NC, C, V) float32. Grid (BH, V / block_v, NS); do (BH, NC, C, V) in qe's dtype."""
  bh, nc, c, d = qe.shape
  vd = do.shape[-1]
  bv = min(cfg.block_v, vd)
  ns = lam.shape[1]
  vis = num_visible(nc, cps)
  vblock = pl.BlockSpec((None, nc, c, bv), lambda b, j, i: (b, 0, 0, j))
  ins = [qe] + ([w] if erase else []) + [kw, lam, gam, do]
  in_specs = [_whole(nc, c, d)] * (3 if erase else 2) + [
      pl.BlockSpec((None, None, nc, c, 1), lambda b, j, i: (b, i, 0, 0, 0)),
      _whole(nc, 1, 1), vblock]
  kernel = functools.partial(_reverse_kernel, nc=nc, cps=cps, erase=erase, dtype=qe.dtype)
  return call(kernel, cfg=cfg, grid=(bh, vd // bv, ns), in_specs=in_specs,
              out_specs=[pl.BlockSpec((None, vis, d, bv), lambda b, j, i: (b, 0, 0, j)), vblock],
              out_shape=[jax.ShapeDtypeStruct((bh, vis, d, vd), qe.dtype),
                         jax.ShapeDtypeStruct((bh, nc, c, vd), F32)],
              semantics=None, name="merlin_reverse_state_pass")(*ins)


def chunk_gradients(qe, w, kw, uv, lam, do, states, dstates, *, cps, erase, cfg):
  """dQe, dW (None without erase), dKw (BH, NC, C, D), dgamma (BH, NC, 1, 1) and dlam
  (BH, NC, NS, C, 1; entries i > s(n) unwritten), float32. Grid (BH, NC, 2 parts)."""
  bh, nc, c, d = qe.shape
  vis, vd = states.shape[1], states.shape[-1]
  ns = lam.shape[1]
  chunk = lambda *s: pl.BlockSpec((None, None, *s), lambda b, n, p: (b, n) + (0,) * len(s))
  stack = pl.BlockSpec((None, vis, d, vd), lambda b, n, p: (b, 0, 0, 0))
  ins = [qe] + ([w] if erase else []) + [kw, uv, lam, do, states, dstates]
  in_specs = [chunk(c, d)] * (3 if erase else 2) + [
      chunk(c, vd), pl.BlockSpec((None, ns, None, c, 1), lambda b, n, p: (b, 0, n, 0, 0)),
      chunk(c, vd), stack, stack]
  n_mat = 3 if erase else 2
  shape = lambda *s: jax.ShapeDtypeStruct((bh, nc, *s), F32)
  kernel = functools.partial(_gradients_kernel, nc=nc, cps=cps, vd=vd,
                             bv=min(cfg.bwd_block_v, vd), erase=erase, dtype=qe.dtype)
  outs = call(kernel, cfg=cfg, grid=(bh, nc, 2), in_specs=in_specs,
              out_specs=[chunk(c, d)] * n_mat + [chunk(1, 1), chunk(ns, c, 1)],
              out_shape=[shape(c, d)] * n_mat + [shape(1, 1), shape(ns, c, 1)],
              semantics=None, name="merlin_chunk_gradients",
              num_warps=cfg.bwd_num_warps)(*ins)
  if erase:
    return tuple(outs)
  dqe, dkw, dgam, dlam = outs
  return dqe, None, dkw, dgam, dlam
