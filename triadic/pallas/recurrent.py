"""The state-passing kernels: chunk loop forward, and the same loop reversed for the state gradient.

One program per (batch*head, value block of ``block_v`` columns); it keeps all E slices of its
D x block_v state tile on chip as float32 and walks the chunks in a ``fori_loop``. Per chunk, with
the chunk-start state S_e, gc, A and P from ``chunk_prep`` (a = exp(gc), lam = exp(gc_C),
b = exp(gc_C - gc), all exponents <= 0):

  forward   rhs = beta V - sum_e diag(beta k2_e a_e) K S_e          (erase; beta V otherwise)
            U   = A rhs
            o   = scale [ sum_e diag(q2_e a_e) Q S_e + P U ]
            S_e <- lam_e S_e + (diag(k2_e b_e) K)^T U
  backward  dU  = scale P^T dO + sum_e diag(k2_e b_e) K dS_e      (dS_e: chunk-end state gradient)
            dS_e <- lam_e dS_e + scale (diag(q2_e a_e) Q)^T dO - (diag(beta k2_e a_e) K)^T A^T dU

The forward saves the chunk-start states (in the input dtype: bf16 for bf16 inputs) and U (float32);
the backward saves the chunk-end state gradients and dU. Everything else in the gradient is
parallel over chunks (``backward.py``). Cost per chunk and value block: 3E + 2 matmuls forward
(C x D x block_v, E of them for the read of S, E for the output, E for the write), 3E + 2 backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.pallas.common import F32, call, col, last, mm


def _forward_kernel(q_ref, k_ref, v_ref, k2c, q2c, gcc, beta_ref, a_ref, p_ref, h0_ref,
                    o_ref, u_ref, states_ref, ht_ref, *, nc, c, e_dim, scale, erase, dtype):
  def body(i, state):
    q, k = q_ref[i].astype(F32), k_ref[i].astype(F32)
    beta = beta_ref[i].astype(F32)
    rhs = beta * v_ref[i].astype(F32)
    out = None
    for e in range(e_dim):
      states_ref[i, e] = state[e].astype(states_ref.dtype)
      a = jnp.exp(col(gcc, e, i))
      s = state[e]
      if erase:
        rhs = rhs - mm((beta * col(k2c, e, i) * a) * k, s, dtype)
      read = mm((col(q2c, e, i) * a) * q, s, dtype)
      out = read if out is None else out + read
    u = mm(a_ref[i], rhs, dtype) if erase else rhs
    u_ref[i] = u
    o_ref[i] = (scale * (out + mm(p_ref[i], u, dtype))).astype(o_ref.dtype)
    new = []
    for e in range(e_dim):
      gl = last(gcc, e, c, i)
      write = (col(k2c, e, i) * jnp.exp(gl - col(gcc, e, i))) * k
      new.append(jnp.exp(gl) * state[e] + mm(write, u, dtype, ta=True))
    return tuple(new)

  state = tuple(h0_ref[e].astype(F32) for e in range(e_dim))
  state = jax.lax.fori_loop(0, nc, body, state)
  for e in range(e_dim):
    ht_ref[e] = state[e]


def _backward_kernel(q_ref, k_ref, do_ref, k2c, q2c, gcc, beta_ref, a_ref, p_ref, dht_ref,
                     du_ref, dstates_ref, dh0_ref, *, nc, c, e_dim, scale, erase, dtype):
  def body(j, dstate):
    i = nc - 1 - j
    q, k = q_ref[i].astype(F32), k_ref[i].astype(F32)
    do = do_ref[i].astype(F32)
    du = scale * mm(p_ref[i], do, dtype, ta=True)
    for e in range(e_dim):
      dstates_ref[i, e] = dstate[e].astype(dstates_ref.dtype)
      gl = last(gcc, e, c, i)
      write = (col(k2c, e, i) * jnp.exp(gl - col(gcc, e, i))) * k
      du = du + mm(write, dstate[e], dtype)
    du_ref[i] = du
    if erase:
      drhs = mm(a_ref[i], du, dtype, ta=True)
      beta = beta_ref[i].astype(F32)
    new = []
    for e in range(e_dim):
      a = jnp.exp(col(gcc, e, i))
      ds = jnp.exp(last(gcc, e, c, i)) * dstate[e]
      ds = ds + scale * mm((col(q2c, e, i) * a) * q, do, dtype, ta=True)
      if erase:
        ds = ds - mm((beta * col(k2c, e, i) * a) * k, drhs, dtype, ta=True)
      new.append(ds)
    return tuple(new)

  dstate = tuple(dht_ref[e].astype(F32) for e in range(e_dim))
  dstate = jax.lax.fori_loop(0, nc, body, dstate)
  for e in range(e_dim):
    dh0_ref[e] = dstate[e]


def _specs(bh, nc, c, d, e_dim, bv):
  whole = lambda *s: pl.BlockSpec((None, nc, *s), lambda i, j: (i,) + (0,) * (len(s) + 1))
  vblock = lambda *s: pl.BlockSpec((None, nc, *s, bv),
                                   lambda i, j: (i,) + (0,) * (len(s) + 1) + (j,))
  state = pl.BlockSpec((None, e_dim, d, bv), lambda i, j: (i, 0, 0, j))
  return whole, vblock, state


def forward(q, k, v, k2c, q2c, gcc, beta_c, a, p, h0, *, scale, erase, cfg):
  """Chunk loop forward. Returns o (BH,NC,C,V) in q's dtype, U (BH,NC,C,V) float32,
  chunk-start states (BH,NC,E,D,V) in q's dtype, final state (BH,E,D,V) float32."""
  bh, nc, c, d = q.shape
  vd, e_dim = v.shape[-1], k2c.shape[-1]
  bv = min(cfg.block_v, vd)
  whole, vblock, state = _specs(bh, nc, c, d, e_dim, bv)
  kernel = functools.partial(_forward_kernel, nc=nc, c=c, e_dim=e_dim, scale=scale, erase=erase,
                             dtype=q.dtype)
  return call(
      kernel, cfg=cfg, grid=(bh, vd // bv),
      in_specs=[whole(c, d), whole(c, d), vblock(c), whole(c, e_dim), whole(c, e_dim),
                whole(c, e_dim), whole(c, 1), whole(c, c), whole(c, c), state],
      out_specs=[vblock(c), vblock(c), vblock(e_dim, d), state],
      out_shape=[jax.ShapeDtypeStruct((bh, nc, c, vd), q.dtype),
                 jax.ShapeDtypeStruct((bh, nc, c, vd), F32),
                 jax.ShapeDtypeStruct((bh, nc, e_dim, d, vd), q.dtype),
                 jax.ShapeDtypeStruct((bh, e_dim, d, vd), F32)],
      semantics=("parallel", "parallel"), name="triadic_forward",
  )(q, k, v, k2c, q2c, gcc, beta_c, a, p, h0)


def backward(q, k, do, k2c, q2c, gcc, beta_c, a, p, dht, *, scale, erase, cfg):
  """Reverse chunk loop. Returns dU (BH,NC,C,V) float32, chunk-end state gradients
  (BH,NC,E,D,V) in q's dtype, gradient of the initial state (BH,E,D,V) float32."""
  bh, nc, c, d = q.shape
  vd, e_dim = do.shape[-1], k2c.shape[-1]
  bv = min(cfg.block_v, vd)
  whole, vblock, state = _specs(bh, nc, c, d, e_dim, bv)
  kernel = functools.partial(_backward_kernel, nc=nc, c=c, e_dim=e_dim, scale=scale, erase=erase,
                             dtype=q.dtype)
  return call(
      kernel, cfg=cfg, grid=(bh, vd // bv),
      in_specs=[whole(c, d), whole(c, d), vblock(c), whole(c, e_dim), whole(c, e_dim),
                whole(c, e_dim), whole(c, 1), whole(c, c), whole(c, c), state],
      out_specs=[vblock(c), vblock(e_dim, d), state],
      out_shape=[jax.ShapeDtypeStruct((bh, nc, c, vd), F32),
                 jax.ShapeDtypeStruct((bh, nc, e_dim, d, vd), q.dtype),
                 jax.ShapeDtypeStruct((bh, e_dim, d, vd), F32)],
      semantics=("parallel", "parallel"), name="triadic_backward_states",
  )(q, k, do, k2c, q2c, gcc, beta_c, a, p, dht)
