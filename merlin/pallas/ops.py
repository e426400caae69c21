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
Under jit with B and/or H sharded, the forward and the backward each run per (B, H) shard
(``triadic.pallas.partition.batch_head_partitioned``; every operand and result keeps (B, H) as
leading dims, merged to B*H only inside).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from merlin.chunked import intra_chunk
from merlin.pallas import kernels
from triadic.pallas import partition
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


def _split(x, b, h):
  return x.reshape(b, h, *x.shape[1:])


def _forward(cps, erase, cfg, qe, *rest):
  """State pass and readout on (B, H, ...) operands (qe, [w,] kw, uv, gam (B, H, NC), lam
  (B, H, NS, NC, C)). Returns the stack read (B, H, NC, C, V) float32 and the stacked states."""
  b, h = qe.shape[:2]
  w, (kw, uv, gam, lam) = (rest[0], rest[1:]) if erase else (None, rest)
  qe, w, kw, uv = (None if x is None else _merge(x) for x in (qe, w, kw, uv))
  gam, lam = _merge(gam)[..., None, None], _merge(lam)[..., None]
  states = kernels.state_pass(qe, w, kw, uv, gam, cps=cps, erase=erase, cfg=cfg)
  o = kernels.readout(qe, lam, states, cps=cps, cfg=cfg)
  return _split(o, b, h), _split(states, b, h)


def _backward(cps, erase, cfg, qe, *rest):
  """Reverse state pass and chunk gradients: ``_forward``'s operands, its states and the
  cotangent do, all (B, H, ...). Returns the operands' gradients (lam's zero for i > s(n))."""
  b, h, nc = qe.shape[:3]
  w, (kw, uv, gam, lam, states, do) = (rest[0], rest[1:]) if erase else (None, rest)
  qe, w, kw, uv, states = (None if x is None else _merge(x) for x in (qe, w, kw, uv, states))
  gam, lam = _merge(gam)[..., None, None], _merge(lam)[..., None]
  do = _merge(do).astype(qe.dtype)
  dstates, duv = kernels.reverse_state_pass(qe, w, kw, lam, gam, do, cps=cps, erase=erase,
                                            cfg=cfg)
  dqe, dw, dkw, dgam, dlam = kernels.chunk_gradients(qe, w, kw, uv, lam, do, states, dstates,
                                                     cps=cps, erase=erase, cfg=cfg)
  ns = lam.shape[1]
  dlam = jnp.moveaxis(dlam[..., 0], 2, 1)  # (BH, NS, NC, C)
  dlam = jnp.where(_visible(nc, cps, ns).T[None, :, :, None], dlam, 0.0)
  grads = [dqe.astype(qe.dtype)] + ([dw.astype(w.dtype)] if erase else [])
  grads += [dkw.astype(kw.dtype), duv.astype(uv.dtype), dgam[:, :, 0, 0], dlam]
  return tuple(_split(x, b, h) for x in grads)


# Shardy rules: b, h may be sharded on any mesh axes; chunks n, tokens c, segments s, the stacked
# states i, D and V must be whole on every device (the recurrence runs along them).
_REPLICATED = ("n", "c", "d", "v", "s", "i")


def _rules(erase):
  mats = "b h n c d, " * (2 if erase else 1) + "b h n c d, b h n c v, b h n, b h s n c"
  fwd = f"{mats} -> b h n c v, b h i d v"
  bwd = f"{mats}, b h i d v, b h n c v -> " + mats
  return fwd, bwd


_PARTITIONED = {
    erase: tuple(partition.batch_head_partitioned(fn, n_static=3, rule=rule,
                                                  replicated=_REPLICATED)
                 for fn, rule in zip((_forward, _backward), _rules(erase)))
    for erase in (True, False)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _stack_read(cps, erase, cfg, *operands):
  """sum_{i <= s(n)} (lam_n,i Qe_n) S_n^i for every chunk n: (B, H, NC, C, V) float32."""
  return _PARTITIONED[erase][0](cps, erase, cfg, *operands)[0]


def _stack_read_fwd(cps, erase, cfg, *operands):
  o, states = _PARTITIONED[erase][0](cps, erase, cfg, *operands)
  return o, (operands, states)


def _stack_read_bwd(cps, erase, cfg, saved, do):
  operands, states = saved
  return _PARTITIONED[erase][1](cps, erase, cfg, *operands, states, do)


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
  kernel_op = lambda x, width: _pad_last(x, width).astype(dtype)
  mats = [kernel_op(qe, dp)] + ([kernel_op(w, dp)] if erase else [])
  mats += [kernel_op(kw, dp), kernel_op(uv, vp), gam, jnp.moveaxis(lamc, -1, 2)]
  o = _stack_read(cps, erase, config, *mats)[..., :vd]
  o = scale * (o + o_intra)
  return jnp.moveaxis(o, 1, 3).reshape(b, nc * c, h, vd)[:, :t]
