"""The state-passing kernels: chunk loop forward, and the same loop reversed for the state gradient.

Per (batch*head, value block of ``block_v`` columns) the chunks are walked in order, all E slices
of the D x block_v state tile kept on chip as float32. Per chunk, with the chunk-start state S_e,
gc, A and P from ``chunk_prep`` (a = exp(gc), lam = exp(gc_C), b = exp(gc_C - gc), all exponents
<= 0):

  forward   rhs = beta V - sum_e diag(beta k2_e a_e) K S_e          (erase; beta V otherwise)
            U   = A rhs
            o   = scale [ sum_e diag(q2_e a_e) Q S_e + P U ]
            S_e <- lam_e S_e + (diag(k2_e b_e) K)^T U
  backward  dU  = scale P^T dO + sum_e diag(k2_e b_e) K dS_e      (dS_e: chunk-end state gradient)
            dS_e <- lam_e dS_e + scale (diag(q2_e a_e) Q)^T dO - (diag(beta k2_e a_e) K)^T A^T dU

The forward saves the chunk-start states and U in the input dtype (bf16 for bf16 inputs: every
use of U in the backward is a matmul operand in that dtype, so storing it wider only costs bytes);
the backward saves the chunk-end state gradients and dU (in the input dtype with erase, for the
same reason; ``common.du_dtype``). Everything else in the gradient is
parallel over chunks (``backward.py``). Cost per chunk and value block: 3E + 2 matmuls forward
(C x D x block_v, E of them for the read of S, E for the output, E for the write), 3E + 2 backward.

The per-chunk math (``_forward_chunk``, ``_backward_chunk``) is shared by two structures, chosen by
``Config.chunk_grid`` (i.e. the platform):

* loop (Triton on GPU; interpret on CPU): grid (BH, V / block_v); every block spans all NC chunks
  and the kernel walks them in a ``fori_loop``, the state in registers. A Triton block is only a
  pointer into HBM, so its size costs nothing, and one launch runs the whole sequence.
* grid (Mosaic TPU): grid (BH, V / block_v, NC), the chunk axis last and "arbitrary" (sequential
  on one core), every block one chunk, index map (i, j, n) -> (i, n, ...) forward and
  (i, NC - 1 - n, ...) in reverse. Mosaic copies each block into VMEM (double-buffered, so the
  next chunk's DMA overlaps this chunk's math), and a whole-sequence block would need
  O(T) VMEM (about 100 MiB for q alone at T = 65536, D = 128, bf16), over the 16-64 MiB a core has.
  The E x D x block_v float32 state lives in VMEM scratch across grid steps: loaded from h0 (or
  dS at the end) at n == 0, written to the final-state output at n == NC - 1, whose block index
  is constant in n (written back to HBM once per (i, j)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from triadic.pallas.common import F32, call, col, du_dtype, last, mm


def _at(lead):
  """Index of the current chunk in a ref: ``lead`` = (i,) when blocks hold every chunk (loop),
  () when they hold one (grid)."""
  return lead if lead else ...


def _forward_chunk(ins, outs, state, lead, *, c, e_dim, scale, erase, dtype):
  """One chunk of the forward: writes o, U and the chunk-start state, returns the chunk-end state
  (a tuple of E (D, block_v) float32 arrays)."""
  q_ref, k_ref, v_ref, k2_col, q2_col, gc_col, beta_ref, a_ref, p_ref = ins
  o_ref, u_ref, states_ref = outs
  at = _at(lead)
  q, k = q_ref[at].astype(F32), k_ref[at].astype(F32)
  beta = beta_ref[at].astype(F32)
  rhs = beta * v_ref[at].astype(F32)
  out = None
  for e in range(e_dim):
    states_ref[(*lead, e)] = state[e].astype(states_ref.dtype)
    a = jnp.exp(col(gc_col, e, *lead))
    s = state[e]
    if erase:
      rhs = rhs - mm((beta * col(k2_col, e, *lead) * a) * k, s, dtype)
    read = mm((col(q2_col, e, *lead) * a) * q, s, dtype)
    out = read if out is None else out + read
  u = mm(a_ref[at], rhs, dtype) if erase else rhs
  u_ref[at] = u.astype(u_ref.dtype)
  o_ref[at] = (scale * (out + mm(p_ref[at], u, dtype))).astype(o_ref.dtype)
  new = []
  for e in range(e_dim):
    gl = last(gc_col, e, c, *lead)
    write = (col(k2_col, e, *lead) * jnp.exp(gl - col(gc_col, e, *lead))) * k
    new.append(jnp.exp(gl) * state[e] + mm(write, u, dtype, ta=True))
  return tuple(new)


def _backward_chunk(ins, outs, dstate, lead, *, c, e_dim, scale, erase, dtype):
  """One chunk of the reverse pass: writes dU and the chunk-end state gradient, returns the
  chunk-start state gradient."""
  q_ref, k_ref, do_ref, k2_col, q2_col, gc_col, beta_ref, a_ref, p_ref = ins
  du_ref, dstates_ref = outs
  at = _at(lead)
  q, k = q_ref[at].astype(F32), k_ref[at].astype(F32)
  do = do_ref[at].astype(F32)
  du = scale * mm(p_ref[at], do, dtype, ta=True)
  for e in range(e_dim):
    dstates_ref[(*lead, e)] = dstate[e].astype(dstates_ref.dtype)
    gl = last(gc_col, e, c, *lead)
    write = (col(k2_col, e, *lead) * jnp.exp(gl - col(gc_col, e, *lead))) * k
    du = du + mm(write, dstate[e], dtype)
  du_ref[at] = du.astype(du_ref.dtype)
  if erase:
    drhs = mm(a_ref[at], du, dtype, ta=True)
    beta = beta_ref[at].astype(F32)
  new = []
  for e in range(e_dim):
    a = jnp.exp(col(gc_col, e, *lead))
    ds = jnp.exp(last(gc_col, e, c, *lead)) * dstate[e]
    ds = ds + scale * mm((col(q2_col, e, *lead) * a) * q, do, dtype, ta=True)
    if erase:
      ds = ds - mm((beta * col(k2_col, e, *lead) * a) * k, drhs, dtype, ta=True)
    new.append(ds)
  return tuple(new)


def _loop_kernel(*refs, chunk, n_out, nc, reverse, e_dim, **kw):
  """Loop structure: refs = 9 chunked inputs, the initial carry (h0 or dS), ``n_out`` chunked
  outputs, the final carry. Every block spans all NC chunks."""
  ins, init_ref, outs, final_ref = refs[:9], refs[9], refs[10:10 + n_out], refs[10 + n_out]

  def body(j, carry):
    i = nc - 1 - j if reverse else j
    return chunk(ins, outs, carry, (i,), e_dim=e_dim, **kw)

  carry = tuple(init_ref[e].astype(F32) for e in range(e_dim))
  carry = jax.lax.fori_loop(0, nc, body, carry)
  for e in range(e_dim):
    final_ref[e] = carry[e]


def _grid_kernel(*refs, chunk, n_out, nc, reverse, e_dim, **kw):
  """Grid structure: the same refs, each block one chunk (the index maps do the reversal), then
  the (E, D, block_v) float32 VMEM scratch that carries the state across the chunk axis."""
  ins, init_ref, outs = refs[:9], refs[9], refs[10:10 + n_out]
  final_ref, carry_ref = refs[10 + n_out:]
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    carry_ref[...] = init_ref[...].astype(F32)

  carry = chunk(ins, outs, tuple(carry_ref[e] for e in range(e_dim)), (), e_dim=e_dim, **kw)
  for e in range(e_dim):
    carry_ref[e] = carry[e]

  @pl.when(n == nc - 1)
  def _():
    final_ref[...] = carry_ref[...]


def _launch(chunk, ins, init, vd, out_chunk_shapes, *, cfg, reverse, name, **kw):
  """Run ``chunk`` over every chunk of every (batch*head, value block).

  ins: the nine (BH, NC, C, X) inputs (the third one V-wide, blocked by value columns); init: the
  (BH, E, D, V) float32 carry at the start of the walk. out_chunk_shapes: (per-chunk shape,
  dtype) of each chunked output, the last dim V. Returns the chunked outputs and the final carry.
  """
  bh, nc, c, d = ins[0].shape
  e_dim = init.shape[1]
  bv = min(cfg.block_v, vd)
  n_out = len(out_chunk_shapes)
  if cfg.chunk_grid:
    chunk_ix = (lambda n: nc - 1 - n) if reverse else (lambda n: n)
    chunked = lambda *s: pl.BlockSpec(
        (None, None, *s), lambda i, j, n: (i, chunk_ix(n)) + (0,) * len(s))
    vchunked = lambda *s: pl.BlockSpec(
        (None, None, *s, bv), lambda i, j, n: (i, chunk_ix(n)) + (0,) * len(s) + (j,))
    state = pl.BlockSpec((None, e_dim, d, bv), lambda i, j, n: (i, 0, 0, j))
    grid, semantics = (bh, vd // bv, nc), ("parallel", "parallel", "arbitrary")
    kernel, scratch = _grid_kernel, [pltpu.VMEM((e_dim, d, bv), F32)]
  else:
    chunked = lambda *s: pl.BlockSpec((None, nc, *s), lambda i, j: (i,) + (0,) * (len(s) + 1))
    vchunked = lambda *s: pl.BlockSpec((None, nc, *s, bv),
                                       lambda i, j: (i,) + (0,) * (len(s) + 1) + (j,))
    state = pl.BlockSpec((None, e_dim, d, bv), lambda i, j: (i, 0, 0, j))
    grid, semantics = (bh, vd // bv), ("parallel", "parallel")
    kernel, scratch = _loop_kernel, ()
  in_specs = [chunked(*x.shape[2:]) for x in ins]
  in_specs[2] = vchunked(c)
  kernel = functools.partial(kernel, chunk=chunk, n_out=n_out, nc=nc, reverse=reverse,
                             e_dim=e_dim, c=c, dtype=ins[0].dtype, **kw)
  return call(
      kernel, cfg=cfg, grid=grid, in_specs=in_specs + [state],
      out_specs=[vchunked(*s[:-1]) for s, _ in out_chunk_shapes] + [state],
      out_shape=[jax.ShapeDtypeStruct((bh, nc, *s), dt) for s, dt in out_chunk_shapes]
                + [jax.ShapeDtypeStruct((bh, e_dim, d, vd), F32)],
      semantics=semantics, name=name, scratch_shapes=scratch,
  )(*ins, init)


def state_pass(q, k, v, k2_col, q2_col, gc_col, beta_col, a, p, h0, *, scale, erase, cfg):
  """Chunk loop forward. Returns o (BH,NC,C,V) in q's dtype, U (BH,NC,C,V) in q's dtype,
  chunk-start states (BH,NC,E,D,V) in q's dtype, final state (BH,E,D,V) float32."""
  c, d = q.shape[2:]
  vd, e_dim = v.shape[-1], k2_col.shape[-1]
  return _launch(_forward_chunk, (q, k, v, k2_col, q2_col, gc_col, beta_col, a, p), h0, vd,
                 [((c, vd), q.dtype), ((c, vd), q.dtype), ((e_dim, d, vd), q.dtype)],
                 cfg=cfg, reverse=False, name="triadic_forward", scale=scale, erase=erase)


def reverse_state_pass(q, k, do, k2_col, q2_col, gc_col, beta_col, a, p, dht, *, scale, erase, cfg):
  """Reverse chunk loop. Returns dU (BH,NC,C,V) in ``common.du_dtype``, chunk-end state gradients
  (BH,NC,E,D,V) in q's dtype, gradient of the initial state (BH,E,D,V) float32."""
  c, d = q.shape[2:]
  vd, e_dim = do.shape[-1], k2_col.shape[-1]
  return _launch(_backward_chunk, (q, k, do, k2_col, q2_col, gc_col, beta_col, a, p), dht, vd,
                 [((c, vd), du_dtype(q.dtype, erase)), ((e_dim, d, vd), q.dtype)],
                 cfg=cfg, reverse=True, name="triadic_backward_states", scale=scale,
                 erase=erase)
