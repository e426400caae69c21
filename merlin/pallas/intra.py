"""MERLIN's intra-chunk part (``merlin.chunked.intra_chunk``) as Triton kernels, forward and
backward.

One program per (batch*head, chunk). For a chunk of C tokens, q, k (C, D), v (C, V), g, beta
(C, 1), with gc the chunk-local cumulative sum of g, a = exp(gc), b = exp(gc_C - gc) and the
decay mask D_ts = exp(gc_t - gc_s) (s <= t, else 0):

    P  = (Q K^T) * D      L = StrictLower(beta (K K^T) * D)      A = (I + L)^-1
    Uv = A R_v,  R_v = beta V        W = A R_k,  R_k = beta a K       (no erase: A = I, no W)
    Qe = a Q - P W        Kw = b K        gamma = exp(gc_C)        intra = P Uv

The forward kernel reads q, k, v, gc, beta and writes Qe, [W,] Kw, Uv in the input dtype (the
state kernels' operands) and gamma, intra float32 (the readout adds intra in float32); where a
gradient is taken, also A (float32), the residual of the backward. The backward is
``merlin.chunked.intra_chunk_pullback`` chunk by chunk: either that plain-JAX function over all
chunks, or (``Config.intra_backward_kernel``) the backward kernel here, which reads q, k, v, gc,
beta, A, the forward's own Uv and W and the results' cotangents, forms S, P and K K^T again,
and writes dq, dk, dv (input dtype) and dgc, dbeta (float32) in the caller's layout
(``intra_part_pullback``; both by ``merlin.pallas.ops.intra_stage``).

Layout: q, k, v, gc, beta are read in the caller's (B, T, H, X) layout (``common.token_block``;
gc and beta as (B, T, H, 1)), T a multiple of C and D, V padded to ``kernels.padded_width`` with
zeros (exact: padded columns add nothing), both by ``kernel_inputs`` in plain JAX where needed; the
forward's results are in the state kernels' (B*H, NC, C, X) layout. The forward walks the value
axis in blocks (``common.over_value_blocks``), the backward V and D, each kernel at its own
launch (``FORWARD_WARPS``, ``FORWARD_BLOCK_V``; ``BACKWARD_WARPS``, ``BACKWARD_BLOCKS``).
Several (C, C) float32 tiles (D, P, A; the backward's dP and dA too) are live at once.

The UT transform: L's SUB x SUB blocks (``lax.split`` of the register tile; Triton cannot index
one) give A by ``chunk_prep.blocked_inverse`` (substitution, as accurate as a triangular solve),
and A is joined back into one (C, C) tile (``_join``); its block products run at
``Config.f32_precision``, and the residual A is stored in float32. Every other product (A R; Q K^T,
K K^T, P W, P Uv; the backward's A^T dUv', A^T dW', A^T dA A^T and the gradients' products) takes
operands in the input dtype with float32 accumulation, as the state kernels' products, the
triadic op's A products and FLA's do: in bf16, A is rounded to bf16 for them (float32 inputs run
them in float32 at ``Config.f32_precision``). Float32 operands would double the (C, C) tiles'
registers and run as three TF32 products each (benchmarks/RESULTS.md has the spills).

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
                                   over_value_blocks, rowsum, token_block, total)


# The kernels' launches, the fastest benchmarks/merlin_ops.py --intra-backward / --intra-forward
# timed (benchmarks/RESULTS.md). The backward: 4 warps, the value and key walks in blocks of 32
# columns (2 / 4 / 8 / 16 warps, 16-128 columns timed): at 8 warps it is slower, although it
# spills fewer registers there (benchmarks/triton_registers.py --merlin). The forward: 4 warps,
# blocks of 64 columns (8 warps slower).
FORWARD_WARPS = 4
FORWARD_BLOCK_V = 64
BACKWARD_WARPS = 4
BACKWARD_BLOCKS = (32, 32)  # (value columns, key columns) a block


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
  p = (mm(q_ref[...], k, dtype, tb=True) * decay).astype(dtype)  # a product operand only
  if erase:
    amat = _ut_transform(mm(k, k, dtype, tb=True), beta, decay, c=c, precision=precision,
                         out_ref=ut_ref if inverse else None).astype(dtype)

  def value_block(cols, carry):
    uv = beta * v_ref[:, cols].astype(F32)
    if erase:
      uv = mm(amat, uv, dtype, precision=precision)
    uv_ref[:, cols] = uv.astype(uv_ref.dtype)
    intra_ref[:, cols] = mm(p, uv, dtype)
    return carry

  def key_block(cols, carry):
    kb = k_ref[:, cols].astype(F32)
    qe = a * q_ref[:, cols].astype(F32)
    if erase:
      w = mm(amat, beta * a * kb, dtype, precision=precision)
      outs[1][:, cols] = w.astype(outs[1].dtype)
      qe = qe - mm(p, w, dtype)
    qe_ref[:, cols] = qe.astype(qe_ref.dtype)
    kw_ref[:, cols] = (b * kb).astype(kw_ref.dtype)
    return carry

  over_value_blocks(vd, bv, value_block, None)
  d = k.shape[-1]
  over_value_blocks(d, min(bv, d), key_block, None)
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
                             bv=min(FORWARD_BLOCK_V, vd), dtype=q.dtype,
                             precision=cfg.f32_precision)
  out_specs = mats + [chunk_block(c, vd), chunk_block(1, 1), chunk_block(c, vd)]
  out_shape = [shape(d)] * (2 + erase) + [
      shape(vd), jax.ShapeDtypeStruct((b * h, nc, 1, 1), F32), shape(vd, F32)]
  if inverse:
    out_specs, out_shape = out_specs + [chunk_block(c, c)], out_shape + [shape(c, F32)]
  outs = call(kernel, cfg=cfg, grid=(b * h, nc), in_specs=_specs(c, d, vd, h),
              out_specs=out_specs, out_shape=out_shape, semantics=("parallel", "parallel"),
              name="merlin_intra_forward", num_warps=FORWARD_WARPS)(q, k, v, gc, beta)
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


def kernel_inputs(q, k, v, g, beta, *, chunk_size: int):
  """The kernels' q, k, v, gc, beta from the op's inputs q, k (B, T, H, D), v (B, T, H, V), g, beta
  (B, T, H) (g clamped): T padded to whole chunks and D, V to their widths (``padded_width``)
  with zeros (no write, no decay; the arrays themselves where nothing is padded), g and beta
  float32 as (B, T', H, 1), and gc the chunk-local cumulative sum of g (a scan inside a Triton
  kernel is the one construct of these kernels that not every Triton lowers)."""
  c, t = chunk_size, q.shape[1]
  tp = -(-t // c) * c

  def padded(x, width):
    if (x.shape[1], x.shape[-1]) == (tp, width):
      return x
    return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, width - x.shape[-1])))

  g, beta = (padded(x.astype(F32)[..., None], 1) for x in (g, beta))
  b, _, h, _ = g.shape
  gc = jnp.cumsum(g.reshape(b, tp // c, c, h, 1), axis=2).reshape(g.shape)
  return (padded(q, padded_width(q.shape[-1])), padded(k, padded_width(k.shape[-1])),
          padded(v, padded_width(v.shape[-1])), gc, beta)


def _check_chunk(c):
  if c % SUB or c & (c - 1):
    raise ValueError(f"the intra-chunk kernel needs a power-of-two chunk size >= {SUB}, got {c}")


def intra_part(q, k, v, g, beta, *, chunk_size: int, erase: bool, cfg, inverse: bool = False):
  """The state kernels' intra-chunk operands by the forward kernel, from the op's inputs q, k
  (B, T, H, D), v (B, T, H, V), g, beta (B, T, H) (g clamped): qe, [w (erase),] kw
  (B, H, NC, C, D') and uv (B, H, NC, C, V') in q's dtype, gam (B, H, NC) and intra
  (B, H, NC, C, V) float32, and with ``inverse`` (erase) A (B, H, NC, C, C) float32, the
  residual of the pullback; with NC = ceil(T / chunk_size) and D', V' the kernels' widths
  (``padded_width``): ``merlin.chunked.intra_chunk``'s values on the chunked inputs, padded and
  cast as ``merlin.pallas.ops.kernel_operands`` does. Per (B, H) shard under jit. The kernel
  reads ``kernel_inputs``' arrays (the op's own where nothing is padded); intra is sliced back
  to V. The op calls it through ``merlin.pallas.ops.intra_stage`` (``Config.intra_kernel``),
  with ``inverse`` where a gradient is taken."""
  _check_chunk(chunk_size)
  inverse = inverse and erase
  vd = v.shape[-1]
  inputs = kernel_inputs(q, k, v, g, beta, chunk_size=chunk_size)
  outs = list(_PARTITIONED[erase, inverse](chunk_size, erase, inverse, cfg, *inputs))
  i = 2 + erase + 2  # intra
  outs[i] = outs[i] if outs[i].shape[-1] == vd else outs[i][..., :vd]
  return tuple(outs)


def _backward_kernel(q_ref, k_ref, v_ref, gc_ref, beta_ref, *refs, c, erase, d, vd, bv, bd,
                     dtype, precision):
  """One chunk of ``merlin.chunked.intra_chunk_pullback`` in three walks over column blocks (``bv``
  value, ``bd`` key columns), so that few (C, X) tiles are live at once: over V, dP's P Uv part,
  dUv', dA's R_v part, dR_v = A^T dUv', dv and dbeta's v part; over D, dP's Qe part, dW', dA's
  R_k part and the row sums of dR_k K, dQe Q, dKw K; then dL = -A^T dA A^T, dbeta and the decays'
  gradient dgc; and over D again dq and dk (dW' and dR_k formed again rather than kept). S is
  formed again too where used: the (C, C) float32 tiles are what fills the registers."""
  if erase:
    ut_ref, uv_ref, w_ref, dqe_ref, dw_ref, dkw_ref, duv_ref, dgam_ref, dintra_ref, *outs = refs
  else:
    dqe_ref, dkw_ref, duv_ref, dgam_ref, dintra_ref, *outs = refs
  dq_ref, dk_ref, dv_ref, dgc_ref, dbeta_ref = outs
  a, b, gam, decay = _decays(gc_ref, c)
  beta = beta_ref[...]
  qk = lambda: mm(q_ref[...], k_ref[...], dtype, tb=True)  # S, formed again where used
  p = (qk() * decay).astype(dtype)  # an operand of products in dtype only
  ut = ut_ref[...].astype(dtype) if erase else None  # A, an operand of products in dtype
  d_w = lambda cols: dw_ref[:, cols].astype(F32) - mm(p, dqe_ref[:, cols], dtype, ta=True)  # dW'
  d_rk = lambda dw: mm(ut, dw, dtype, ta=True, precision=precision)  # A^T dW'

  def value_block(cols, carry):
    dp, dbeta, *dmat = carry
    dintra = dintra_ref[:, cols]
    v = v_ref[:, cols].astype(F32)
    rv = beta * v
    dp = dp + mm(dintra, uv_ref[:, cols] if erase else rv, dtype, tb=True)
    duv = duv_ref[:, cols].astype(F32) + mm(p, dintra, dtype, ta=True)
    if erase:
      dmat = [dmat[0] + mm(duv, rv, dtype, tb=True)]
      duv = mm(ut, duv, dtype, ta=True, precision=precision)  # dR_v
    dv_ref[:, cols] = (beta * duv).astype(dv_ref.dtype)
    return (dp, dbeta + rowsum(duv * v), *dmat)

  def key_block_sums(cols, carry):
    dp, da, db, *rest = carry
    dqe, k = dqe_ref[:, cols], k_ref[:, cols].astype(F32)
    da = da + rowsum(dqe.astype(F32) * q_ref[:, cols].astype(F32))
    db = db + rowsum(dkw_ref[:, cols].astype(F32) * k)
    if erase:
      dmat, k_drk = rest
      dp = dp - mm(dqe, w_ref[:, cols], dtype, tb=True)
      dw = d_w(cols)
      rest = [dmat + mm(dw, beta * a * k, dtype, tb=True), k_drk + rowsum(d_rk(dw) * k)]
    return (dp, da, db, *rest)

  zero, zero_col = jnp.zeros((c, c), F32), jnp.zeros((c, 1), F32)
  dp, dbeta, *dmat = over_value_blocks(vd, bv, value_block, (zero, zero_col, *([zero] * erase)))
  dp, da, db, *rest = over_value_blocks(d, bd, key_block_sums, (dp, zero_col, zero_col, *dmat,
                                                                 *([zero_col] * erase)))
  db = b * db
  dd = dp * qk()
  if erase:
    dmat, k_drk = rest
    dl = jnp.where(masks(c)[1], -mm(ut, mm(dmat, ut, dtype, tb=True, precision=precision),
                                     dtype, ta=True, precision=precision), 0.0)
    kk = mm(k_ref[...], k_ref[...], dtype, tb=True)
    dbeta = dbeta + rowsum(dl * kk * decay) + a * k_drk
    da = da + beta * k_drk
    dd = dd + dl * beta * kk
    gmat = (dl * beta * decay).astype(dtype)  # product operands only, as p
  dpd = (dp * decay).astype(dtype)
  e = dd * decay  # d/d(gc_t - gc_s)
  dgc = a * da - db + rowsum(e) - colsum(e).T
  is_last = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
  dgc_ref[...] = dgc + jnp.where(is_last, total(db) + gam * dgam_ref[...], 0.0)
  dbeta_ref[...] = dbeta

  def key_block_grads(cols, carry):
    k = k_ref[:, cols]
    dq_ref[:, cols] = (a * dqe_ref[:, cols].astype(F32) + mm(dpd, k, dtype)).astype(dq_ref.dtype)
    dk = b * dkw_ref[:, cols].astype(F32) + mm(dpd, q_ref[:, cols], dtype, ta=True)
    if erase:
      dk = dk + beta * a * d_rk(d_w(cols)) + mm(gmat, k, dtype) + mm(gmat, k, dtype, ta=True)
    dk_ref[:, cols] = dk.astype(dk_ref.dtype)
    return carry

  over_value_blocks(d, bd, key_block_grads, 0)


def _backward(c, erase, cfg, q, k, v, gc, beta, *saved_and_cotangents):
  """The backward kernel on ``kernel_inputs``' arrays, (erase) A, Uv, W, and the cotangents of
  the forward's results (dqe, [dw,] dkw, duv, dgam, dintra; dintra padded to V' as uv):
  dq, dk (B, T', H, D'), dv (B, T', H, V') in q's dtype, dgc, dbeta (B, T', H, 1) float32."""
  b, t, h, d = q.shape
  vd, nc = v.shape[-1], t // c
  merge = lambda x: x.reshape(b * h, *x.shape[2:])
  *mats, dgam, dintra = saved_and_cotangents
  mat_specs = (([chunk_block(c, c), chunk_block(c, vd), chunk_block(c, d)] if erase else [])
               + [chunk_block(c, d)] * (2 + erase))
  in_specs = _specs(c, d, vd, h) + mat_specs + [chunk_block(c, vd), chunk_block(1, 1),
                                                chunk_block(c, vd)]
  kernel = functools.partial(_backward_kernel, c=c, erase=erase, d=d, vd=vd,
                             bv=min(BACKWARD_BLOCKS[0], vd), bd=min(BACKWARD_BLOCKS[1], d),
                             dtype=q.dtype, precision=cfg.f32_precision)
  token = lambda x, dtype=q.dtype: jax.ShapeDtypeStruct((b, t, h, x), dtype)
  return call(kernel, cfg=cfg, grid=(b * h, nc), in_specs=in_specs,
              out_specs=_specs(c, d, vd, h), out_shape=[token(d), token(d), token(vd),
                                                        token(1, F32), token(1, F32)],
              semantics=("parallel", "parallel"), name="merlin_intra_backward",
              num_warps=BACKWARD_WARPS)(
                  q, k, v, gc, beta, *map(merge, mats), dgam.reshape(b * h, nc, 1, 1),
                  merge(dintra))


_PARTITIONED_BACKWARD = {
    erase: partition.batch_head_partitioned(
        _backward, n_static=3,
        rule=("b t h d, b t h d, b t h v, b t h o, b t h o, "
              + ("b h n c s, b h n c v, b h n c d, " if erase else "")
              + "b h n c d, " * (2 + erase) + "b h n c v, b h n, b h n c v -> "
              + "b t h d, b t h d, b t h v, b t h o, b t h o"),
        replicated=("t", "n", "c", "d", "v", "o", "s"))
    for erase in (True, False)}


def intra_part_pullback(inputs, residuals, cotangents, *, chunk_size: int, erase: bool, cfg):
  """The gradients (dq, dk, dv, dg, dbeta) of ``intra_part``'s inputs ``inputs`` (q, k, v, g,
  beta) by the backward kernel, from the forward's residuals (erase: A and its own Uv, W; None
  without erase) and the cotangents of its results (qe, [w,] kw, uv, gam, intra). The kernel
  computes ``merlin.chunked.intra_chunk_pullback`` chunk by chunk, reading the op's layout and
  writing the gradients in it (dq, dk, dv in the inputs' dtype); the padding and the
  cumulative sum of ``kernel_inputs`` are pulled back by JAX."""
  _check_chunk(chunk_size)
  padded, pullback = jax.vjp(functools.partial(kernel_inputs, chunk_size=chunk_size), *inputs)
  *mats, dgam, dintra = cotangents
  vp = padded[2].shape[-1]
  if dintra.shape[-1] != vp:
    dintra = jnp.pad(dintra, ((0, 0),) * 4 + ((0, vp - dintra.shape[-1]),))
  grads = _PARTITIONED_BACKWARD[erase](chunk_size, erase, cfg, *padded, *(residuals or ()),
                                       *mats, dgam, dintra)
  return pullback(tuple(grads))
