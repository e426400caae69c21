"""``multistate_pallas``: multi-state linear attention with its state work in Pallas kernels.

The E-independent, state-free part of each chunk (gc, the UT transform A, Uv, W, Qe, Kw, the
intra-chunk output P Uv and the chunk decay: ``merlin.chunked.intra_chunk``) stays in plain JAX,
batched over all chunks, float32, differentiated by JAX. Everything whose cost grows with the
number of segment states N is in ``kernels.py``, behind one ``jax.custom_vjp``:

  forward   state pass (every visible chunk-start state, grid over segments) -> readout
  backward  reverse state pass (state gradients, dUv) -> chunk gradients (dQe, dW, dKw, dgamma,
            dlam)

The custom_vjp saves its inputs and the stacked chunk-start states (in the input dtype). Kernel
operands are the input dtype (bf16 inputs: bf16 tensor-core operands, float32 accumulation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from merlin.chunked import intra_chunk
from merlin.pallas import kernels
from merlin.segments import segment_ids
from triadic.chunked import to_chunks
from triadic.pallas.common import F32, Config


def _pow2(n: int) -> int:
  return max(16, 1 << (n - 1).bit_length())


def _merge(x):
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _pad_last(x, width):
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _visible(nc, cps, ns):
  """(NC, NS) bool: chunk n reads segment i iff i <= n // cps."""
  return jnp.arange(ns)[None, :] <= (jnp.arange(nc) // cps)[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _stack_read(qe, w, kw, uv, gam, lam, cps, erase, cfg):
  """sum_{i <= s(n)} (lam_n,i Qe_n) S_n^i for every chunk n: (BH, NC, C, V) float32."""
  return _stack_read_fwd(qe, w, kw, uv, gam, lam, cps, erase, cfg)[0]


def _stack_read_fwd(qe, w, kw, uv, gam, lam, cps, erase, cfg):
  states = kernels.state_pass(qe, w, kw, uv, gam, cps=cps, erase=erase, cfg=cfg)
  o = kernels.readout(qe, lam, states, cps=cps, cfg=cfg)
  return o, (qe, w, kw, uv, lam, gam, states)


def _stack_read_bwd(cps, erase, cfg, saved, do):
  qe, w, kw, uv, lam, gam, states = saved
  do = do.astype(qe.dtype)
  dstates, duv = kernels.reverse_state_pass(qe, w, kw, lam, gam, do, cps=cps, erase=erase,
                                            cfg=cfg)
  dqe, dw, dkw, dgam, dlam = kernels.chunk_gradients(qe, w, kw, uv, lam, do, states, dstates,
                                                     cps=cps, erase=erase, cfg=cfg)
  nc, ns = qe.shape[1], lam.shape[1]
  dlam = jnp.moveaxis(dlam, 2, 1)  # (BH, NS, NC, C, 1)
  dlam = jnp.where(_visible(nc, cps, ns).T[None, :, :, None, None], dlam, 0.0)
  cast = lambda x, like: None if x is None else x.astype(like.dtype)
  return (cast(dqe, qe), cast(dw, w), cast(dkw, kw), cast(duv, uv), dgam, dlam)


_stack_read.defvjp(_stack_read_fwd, _stack_read_bwd)


def multistate_pallas(q, k, v, g, beta, lam, *, segment_len: int, scale: float, erase: bool,
                      chunk_size: int, config: Config):
  """Chunk-parallel multi-state recurrence with the state stack in Pallas kernels; shapes as
  ``merlin.multistate_attention``. ``lam`` must already be zero for i > s(t), ``g`` clamped
  (``triadic.ops.clamp_log_decay``); ``chunk_size`` must divide ``segment_len`` and be one of
  ``plan.CHUNK_SIZES``. Returns o (B, T, H, V) float32."""
  b, t, h, d = q.shape
  vd = v.shape[-1]
  c = chunk_size
  nc = -(-t // c)
  cps = segment_len // c
  ns = -(-nc // cps)
  dtype = q.dtype
  # Padded tokens have q = k = v = beta = lam = 0 and g = 0: no write, no erase, no decay.
  qc, kc, vc, lamc = (to_chunks(x, nc, c) for x in (q, k, v, lam[..., :ns]))
  gc, betac = to_chunks(g, nc, c), to_chunks(beta, nc, c)
  uv, w, qe, kw, gam, intra, _, _ = intra_chunk(qc, kc, vc, gc, betac, erase)
  owner = jax.nn.one_hot(segment_ids(nc, cps), ns, dtype=F32)  # (NC, NS)
  o_intra = jnp.einsum("bhncm,nm->bhnc", lamc, owner)[..., None] * intra

  dp, vp = _pow2(d), _pow2(vd)
  kernel_op = lambda x, width: _merge(_pad_last(x, width)).astype(dtype)
  lam_k = _merge(jnp.moveaxis(lamc, -1, 2))[..., None]  # (BH, NS, NC, C, 1)
  o = _stack_read(kernel_op(qe, dp), None if w is None else kernel_op(w, dp), kernel_op(kw, dp),
                  kernel_op(uv, vp), _merge(gam)[..., None, None], lam_k, cps, erase, config)
  o = o.reshape(b, h, nc, c, vp)[..., :vd]
  o = scale * (o + o_intra)
  return jnp.moveaxis(o, 1, 3).reshape(b, nc * c, h, vd)[:, :t]
