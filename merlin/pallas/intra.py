"""MERLIN's intra-chunk part (``merlin.chunked.intra_chunk``) as a forward Triton kernel.

One program per (batch*head, chunk). For a chunk of C tokens, q, k (C, D), v (C, V), g, beta
(C, 1), with gc the chunk-local cumulative sum of g, a = exp(gc), b = exp(gc_C - gc) and the
decay mask D_ts = exp(gc_t - gc_s) (s <= t, else 0):

    P  = (Q K^T) * D      L = StrictLower(beta (K K^T) * D)      A = (I + L)^-1
    Uv = A R_v,  R_v = beta V        W = A R_k,  R_k = beta a K       (no erase: A = I, no W)
    Qe = a Q - P W        Kw = b K        gamma = exp(gc_C)        intra = P Uv

The kernel reads q, k, v, gc, beta and writes Qe, [W,] Kw, Uv in the input dtype (the state
kernels' operands) and gamma, intra float32 (the readout adds intra in float32); where a gradient
is taken, also A (float32) for the part's pullback (``merlin.chunked.intra_chunk_pullback``, by
``merlin.pallas.ops.intra_stage``), which reads it with q, k, v, g, beta and the kernel's own Uv
and W, and forms the other products again.

Layout: q, k, v, gc, beta are read in the caller's (B, T, H, X) layout (``common.token_block``;
gc and beta as (B, T, H, 1)), T a multiple of C and D, V padded to ``kernels.padded_width`` with
zeros (exact: padded columns add nothing), both by ``intra_part`` in plain JAX where needed; the
results are in the state kernels' (B*H, NC, C, X) layout. The value axis is walked in blocks of
``bwd_block_v`` columns (``common.over_value_blocks``). The kernel runs at ``bwd_num_warps``:
several (C, C) float32 tiles (D, P, A) are live at once.

The UT transform: L's SUB x SUB blocks (``lax.split`` of the register tile; Triton cannot index
one) give A by ``chunk_prep.blocked_inverse`` (substitution, as accurate as a triangular solve),
and A is joined back into one (C, C) tile (``_join``). A's products (A R) take float32 operands at
``Config.f32_precision``; the others (Q K^T, K K^T, P W, P Uv) the input dtype's, as the state
kernels' products do.

Numerics: every exponent is a later-minus-earlier difference of gc (<= 0), the upper triangle
masked before the exponential (``common.decay_mask``), so no g <= 0 overflows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from layers import partition
from merlin.pallas.kernels import padded_width
from triadic.pallas.chunk_prep import SUB, blocked_inverse
from triadic.pallas.common import (F32, call, chunk_block, colsum, decay_mask, masks, mm,
                                   over_value_blocks, rowsum, token_block)


def _join(parts, axis):
  """The 2-D tiles ``parts`` (a power of two of them) concatenated along ``axis``: Triton has no
  general concatenate, so each pair is stacked on a new last axis, which is moved before
  ``axis`` and merged into it."""
  while len(parts) > 1:
    pairs = []
    for x, y in zip(parts[0::2], parts[1::2]):
      z = jnp.transpose(jnp.stack([x, y], axis=-1), (2, 0, 1) if axis == 0 else (0, 2, 1))
      pairs.append(z.reshape((2 * x.shape[0], x.shape[1]) if axis == 0
                             else (x.shape[0], 2 * x.shape[1])))
    parts = pairs
  return parts[0]


def _ut_transform(kk, beta, decay, *, c, precision, out_ref=None):
  """A = (I + L)^-1 (C, C) float32, L = StrictLower(beta (K K^T) * D), from K K^T (``kk``), beta
  (C, 1) and D (``decay``): ``blocked_inverse`` on L's SUB x SUB register blocks, rejoined.
  With ``out_ref`` A is also stored there, block by block before the join (fewer registers
  spilled than storing the joined tile: benchmarks/RESULTS.md)."""
  _, strict, _, _ = masks(c)
  nb = c // SUB
  lower = jnp.where(strict, beta * kk * decay, 0.0)
  blocks = [jax.lax.split(r, (SUB,) * nb, axis=1)
            for r in jax.lax.split(lower, (SUB,) * nb, axis=0)]
  in_block = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  inv = blocked_inverse(lambda i, m: blocks[i][m],
                        lambda i, s: rowsum(jnp.where(in_block == s, blocks[i][i], 0.0)),
                        nb, precision)
  zero = jnp.zeros((SUB, SUB), F32)
  if out_ref is not None:
    for i in range(nb):
      for j in range(nb):
        out_ref[i * SUB:(i + 1) * SUB, j * SUB:(j + 1) * SUB] = inv[i, j] if j <= i else zero
  return _join([_join([inv[i, j] if j <= i else zero for j in range(nb)], axis=1)
                for i in range(nb)], axis=0)


def _decays(gc_ref, c):
  """gc's per-chunk quantities from gc (C, 1): a = exp(gc) (C, 1), b = exp(gc_C - gc) (C, 1),
  gamma = exp(gc_C) (1, 1) and the decay mask D (C, C)."""
  causal, _, _, _ = masks(c)
  gc = gc_ref[...]
  is_last = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
  gl = colsum(jnp.where(is_last, gc, 0.0))  # gc_C, picked (exact)
  return jnp.exp(gc), jnp.exp(gl - gc), jnp.exp(gl), decay_mask(gc, gc.T, causal)


def _forward_kernel(q_ref, k_ref, v_ref, gc_ref, beta_ref, *outs, c, erase, inverse, vd, bv,
                    dtype, precision):
  if inverse:  # the last result: A
    *outs, ut_ref = outs
  qe_ref, kw_ref, uv_ref, gam_ref, intra_ref = (outs[0], *outs[1 + erase:])  # outs[1]: W, erase
  a, b, gam, decay = _decays(gc_ref, c)
  k = k_ref[...]
  beta = beta_ref[...]
  p = mm(q_ref[...], k, dtype, tb=True) * decay
  if erase:
    amat = _ut_transform(mm(k, k, dtype, tb=True), beta, decay, c=c, precision=precision,
                         out_ref=ut_ref if inverse else None)

  def value_block(cols, carry):
    uv = beta * v_ref[:, cols].astype(F32)
    if erase:
      uv = mm(amat, uv, F32, precision=precision)
    uv_ref[:, cols] = uv.astype(uv_ref.dtype)
    intra_ref[:, cols] = mm(p, uv, dtype)
    return carry

  over_value_blocks(vd, bv, value_block, None)
  qe = a * q_ref[...].astype(F32)
  if erase:
    w = mm(amat, beta * a * k.astype(F32), F32, precision=precision)
    outs[1][...] = w.astype(outs[1].dtype)
    qe = qe - mm(p, w, dtype)
  qe_ref[...] = qe.astype(qe_ref.dtype)
  kw_ref[...] = (b * k.astype(F32)).astype(kw_ref.dtype)
  gam_ref[...] = gam


def _specs(c, d, vd, heads):
  """The (B, T, H, X) blocks of q, k, v, gc, beta for a (B*H, NC) grid."""
  return ([token_block(c, d, heads)] * 2 + [token_block(c, vd, heads)]
          + [token_block(c, 1, heads)] * 2)


def _forward(c, erase, inverse, cfg, q, k, v, gc, beta):
  """The forward kernel on ``intra_part``'s operands: qe, [w,] kw (B, H, NC, C, D) and uv
  (B, H, NC, C, V) in q's dtype, gam (B, H, NC) and intra (B, H, NC, C, V) float32, [and A
  (B, H, NC, C, C) float32 with ``inverse``]."""
  b, t, h, d = q.shape
  vd, nc = v.shape[-1], t // c
  shape = lambda x, dtype=q.dtype: jax.ShapeDtypeStruct((b * h, nc, c, x), dtype)
  mats = [chunk_block(c, d)] * (2 + erase)
  kernel = functools.partial(_forward_kernel, c=c, erase=erase, inverse=inverse, vd=vd,
                             bv=min(cfg.bwd_block_v, vd), dtype=q.dtype,
                             precision=cfg.f32_precision)
  out_specs = mats + [chunk_block(c, vd), chunk_block(1, 1), chunk_block(c, vd)]
  out_shape = [shape(d)] * (2 + erase) + [
      shape(vd), jax.ShapeDtypeStruct((b * h, nc, 1, 1), F32), shape(vd, F32)]
  if inverse:
    out_specs, out_shape = out_specs + [chunk_block(c, c)], out_shape + [shape(c, F32)]
  outs = call(kernel, cfg=cfg, grid=(b * h, nc), in_specs=_specs(c, d, vd, h),
              out_specs=out_specs, out_shape=out_shape, semantics=("parallel", "parallel"),
              name="merlin_intra_forward", num_warps=cfg.bwd_num_warps)(q, k, v, gc, beta)
  outs = [x.reshape(b, h, *x.shape[1:]) for x in outs]
  outs[2 + erase + 1] = outs[2 + erase + 1][..., 0, 0]  # gam
  return tuple(outs)


# Shardy: b, h may be sharded on any mesh axes; tokens t, chunks n, c, D, V and g's unit dim o
# must be whole on every device (the kernel walks them).
_PARTITIONED = {
    (erase, inverse): partition.batch_head_partitioned(
        _forward, n_static=4,
        rule=("b t h d, b t h d, b t h v, b t h o, b t h o -> "
              + "b h n c d, " * (2 + erase) + "b h n c v, b h n, b h n c v"
              + (", b h n c s" if inverse else "")),
        replicated=("t", "n", "c", "d", "v", "o", "s"))
    for erase in (True, False) for inverse in ((True, False) if erase else (False,))}


def intra_part(q, k, v, g, beta, *, chunk_size: int, erase: bool, cfg, inverse: bool = False):
  """The state kernels' intra-chunk operands by the forward kernel, from the op's inputs q, k
  (B, T, H, D), v (B, T, H, V), g, beta (B, T, H) (g clamped): qe, [w (erase),] kw
  (B, H, NC, C, D') and uv (B, H, NC, C, V') in q's dtype, gam (B, H, NC) and intra
  (B, H, NC, C, V) float32, and with ``inverse`` (erase) A (B, H, NC, C, C) float32, the
  residual of the pullback; with NC = ceil(T / chunk_size) and D', V' the kernels' widths
  (``padded_width``): ``merlin.chunked.intra_chunk``'s values on the chunked inputs, padded and
  cast as ``merlin.pallas.ops.kernel_operands`` does. Per (B, H) shard under jit.
  T is padded to whole chunks and D, V to their widths here (zeros: no write, no decay), so the
  kernel reads the op's arrays in place where neither is padded; intra is sliced back to V. gc,
  the chunk-local cumulative sum of g, is formed here too (a scan inside a Triton kernel is
  the one construct of these kernels that not every Triton lowers).
  The op calls it through ``merlin.pallas.ops.intra_stage`` (``Config.intra_kernel``), with
  ``inverse`` where a gradient is taken."""
  c, inverse = chunk_size, inverse and erase
  if c % SUB or c & (c - 1):
    raise ValueError(f"the intra-chunk kernel needs a power-of-two chunk size >= {SUB}, got {c}")
  t, vd = q.shape[1], v.shape[-1]
  tp = -(-t // c) * c

  def padded(x, width):
    if (x.shape[1], x.shape[-1]) == (tp, width):
      return x
    return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, width - x.shape[-1])))

  dp, vp = padded_width(q.shape[-1]), padded_width(vd)
  g, beta = (padded(x.astype(F32)[..., None], 1) for x in (g, beta))
  b, _, h, _ = g.shape
  gc = jnp.cumsum(g.reshape(b, tp // c, c, h, 1), axis=2).reshape(g.shape)  # chunk-local
  inputs = (padded(q, dp), padded(k, dp), padded(v, vp), gc, beta)
  outs = list(_PARTITIONED[erase, inverse](c, erase, inverse, cfg, *inputs))
  i = 2 + erase + 2  # intra
  outs[i] = outs[i] if vp == vd else outs[i][..., :vd]
  return tuple(outs)
