"""MERLIN's intra-chunk part (``merlin.chunked.intra_chunk``) as Triton Pallas kernels.

One program per (batch*head, chunk). For a chunk of C tokens, q, k (C, D), v (C, V), g, beta
(C, 1), with gc the chunk-local cumulative sum of g, a = exp(gc), b = exp(gc_C - gc) and the
decay mask D_ts = exp(gc_t - gc_s) (s <= t, else 0):

    P  = (Q K^T) * D      L = StrictLower(beta (K K^T) * D)      A = (I + L)^-1
    Uv = A R_v,  R_v = beta V        W = A R_k,  R_k = beta a K       (no erase: A = I, no W)
    Qe = a Q - P W        Kw = b K        gamma = exp(gc_C)        intra = P Uv

The forward kernel reads q, k, v, g, beta and writes Qe, [W,] Kw, Uv in the input dtype (the
state kernels' operands) and gamma, intra float32 (the readout adds intra in float32); it keeps
nothing else. The backward kernel recomputes gc, D, P, L, A, Uv and W from the same inputs and,
from the cotangents dQe, dW, dKw, dUv, dgamma, dintra, forms (with dX' the cotangent of X at its
uses inside the chunk)

    dUv' = dUv + P^T dintra       dW' = dW - P^T dQe
    dR_v = A^T dUv'               dR_k = A^T dW'
    dL   = -StrictLower(dR_v Uv^T + dR_k W^T)          (-A^T dA A^T, dA = dUv' R_v^T + dW' R_k^T)
    dP   = Lower(dintra Uv^T - dQe W^T)                dM = beta dL * D
    dQ   = a dQe + (dP * D) K
    dK   = b dKw + beta a dR_k + (dP * D)^T Q + dM K + dM^T K
    dV   = beta dR_v
    dbeta = rowsum(dR_v * V) + a rowsum(dR_k * K) + rowsum(dL * (K K^T) * D)
    d gc = rowsum(dE) - colsum(dE)^T + a da - b db  (+ sum(b db) + gamma dgamma at the last token)
    dE   = (dP * (Q K^T) + beta dL * (K K^T)) * D
    da   = rowsum(dQe * Q) + beta rowsum(dR_k * K)        db = rowsum(dKw * K)
    dg_t = sum_{s >= t} d gc_s

Layout: q, k, v, g, beta are read, and dq, dk, dv, dg, dbeta written, in the caller's (B, T, H, X)
layout (``common.token_block``; g and beta as (B, T, H, 1)), T a multiple of C and D, V padded to
``kernels.padded_width`` with zeros (exact: padded columns add nothing and get nothing), both by
``intra_part`` in plain JAX where needed; the results and their cotangents are in the state
kernels' (B*H, NC, C, X) layout. The value axis is walked in blocks of ``bwd_block_v`` columns
(``common.over_value_blocks``). Both kernels run at ``bwd_num_warps``: several (C, C) float32
tiles (D, P, A and, backward, K K^T, dP, dL) are live at once.

The UT transform: L's SUB x SUB blocks (``lax.split`` of the register tile; Triton cannot index
one) give A by ``chunk_prep.blocked_inverse`` (substitution, as accurate as a triangular solve),
and A is joined back into one (C, C) tile (``_join``). A's products (A R, A^T dX' and dL's) take
float32 operands at ``Config.f32_precision``; the others (Q K^T, K K^T, P W, P Uv and their
gradients) the input dtype's, as the state kernels' products do.

Numerics: every exponent is a later-minus-earlier difference of gc (<= 0), the upper triangle
masked before the exponential (``common.decay_mask``), so no g <= 0 overflows, forward or
backward.
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


def _ut_transform(kk, beta, decay, *, c, precision):
  """A = (I + L)^-1 (C, C) float32, L = StrictLower(beta (K K^T) * D), from K K^T (``kk``), beta
  (C, 1) and D (``decay``): ``blocked_inverse`` on L's SUB x SUB register blocks, rejoined."""
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
  return _join([_join([inv[i, j] if j <= i else zero for j in range(nb)], axis=1)
                for i in range(nb)], axis=0)


def _decays(g_ref, c):
  """gc's per-chunk quantities from g (C, 1): a = exp(gc) (C, 1), b = exp(gc_C - gc) (C, 1),
  gamma = exp(gc_C) (1, 1) and the decay mask D (C, C)."""
  causal, _, _, _ = masks(c)
  gc = jnp.cumsum(g_ref[...], axis=0)
  is_last = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
  gl = colsum(jnp.where(is_last, gc, 0.0))  # gc_C, picked (exact)
  return jnp.exp(gc), jnp.exp(gl - gc), jnp.exp(gl), decay_mask(gc, gc.T, causal)


def _forward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, *outs, c, erase, vd, bv, dtype,
                    precision):
  qe_ref, kw_ref, uv_ref, gam_ref, intra_ref = (outs[0], *outs[1 + erase:])  # outs[1]: W, erase
  a, b, gam, decay = _decays(g_ref, c)
  k = k_ref[...]
  beta = beta_ref[...]
  p = mm(q_ref[...], k, dtype, tb=True) * decay
  if erase:
    amat = _ut_transform(mm(k, k, dtype, tb=True), beta, decay, c=c, precision=precision)

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


def _backward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, dqe_ref, *refs, c, erase, vd, bv,
                     dtype, precision):
  dkw_ref, duv_ref, dgam_ref, dintra_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref = \
      refs[erase:]
  causal, strict, t, s = masks(c)
  a, b, gam, decay = _decays(g_ref, c)
  q, k = q_ref[...], k_ref[...]
  qf, kf = q.astype(F32), k.astype(F32)
  beta = beta_ref[...]
  qk = mm(q, k, dtype, tb=True)
  p = qk * decay
  if erase:
    kk = mm(k, k, dtype, tb=True)
    amat = _ut_transform(kk, beta, decay, c=c, precision=precision)

  def value_block(cols, carry):
    """Block ``cols`` of V: its dV, and its terms of the sums over V of dP, dbeta and (erase)
    dL (``dl``: [that sum] with erase, else [])."""
    dp, dbeta, *dl = carry
    v = v_ref[:, cols].astype(F32)
    dintra = dintra_ref[:, cols]
    duv = duv_ref[:, cols].astype(F32) + mm(p, dintra, dtype, ta=True)
    uv = beta * v
    if erase:
      uv = mm(amat, uv, F32, precision=precision)
      duv = mm(amat, duv, F32, ta=True, precision=precision)  # dR_v
      dl = [dl[0] - mm(duv, uv, F32, tb=True, precision=precision)]
    dv_ref[:, cols] = (beta * duv).astype(dv_ref.dtype)
    return (dp + mm(dintra, uv, dtype, tb=True), dbeta + rowsum(duv * v), *dl)

  zeros = jnp.zeros((c, c), F32)
  dp, dbeta, *dl_v = over_value_blocks(
      vd, bv, value_block, (zeros, jnp.zeros((c, 1), F32)) + ((zeros,) if erase else ()))
  dqe, dkw = dqe_ref[...].astype(F32), dkw_ref[...].astype(F32)
  dq, da = a * dqe, rowsum(dqe * qf)
  dk, db = b * dkw, rowsum(dkw * kf)
  if erase:
    w = mm(amat, beta * a * kf, F32, precision=precision)
    dw = refs[0][...].astype(F32) - mm(p, dqe, dtype, ta=True)
    drk = mm(amat, dw, F32, ta=True, precision=precision)
    dl = jnp.where(strict, dl_v[0] - mm(drk, w, F32, tb=True, precision=precision), 0.0)
    dp = dp - mm(dqe, w, dtype, tb=True)
    dk = dk + beta * a * drk
    drk_k = rowsum(drk * kf)
    dbeta, da = dbeta + a * drk_k, da + beta * drk_k
  dqk = jnp.where(causal, dp, 0.0) * decay
  dq = dq + mm(dqk, k, dtype)
  dk = dk + mm(dqk, q, dtype, ta=True)
  de = dqk * qk
  if erase:
    dlk = dl * kk * decay
    dm = beta * dl * decay
    dk = dk + mm(dm, k, dtype) + mm(dm, k, dtype, ta=True)
    dbeta = dbeta + rowsum(dlk)
    de = de + beta * dlk
  is_last = jax.lax.broadcasted_iota(jnp.int32, (1, c), 1) == c - 1
  dgc = (rowsum(de) + a * da - b * db).T - colsum(de) + jnp.where(
      is_last, total(b * db) + gam * dgam_ref[...], 0.0)  # (1, C)
  dg_ref[...] = rowsum(jnp.where(s >= t, dgc, 0.0))     # the reverse cumulative sum
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dbeta_ref[...] = dbeta


def _specs(c, d, vd, heads):
  """The (B, T, H, X) blocks of q, k, v, g, beta for a (B*H, NC) grid."""
  return ([token_block(c, d, heads)] * 2 + [token_block(c, vd, heads)]
          + [token_block(c, 1, heads)] * 2)


def _kernel_params(c, q, v, erase, cfg):
  """The kernels' static parameters: the chunk, the mode, V and its value block, the matmul
  operands' dtype and A's products' precision."""
  vd = v.shape[-1]
  return dict(c=c, erase=erase, vd=vd, bv=min(cfg.bwd_block_v, vd), dtype=q.dtype,
              precision=cfg.f32_precision)


def _forward(c, erase, cfg, q, k, v, g, beta):
  """The forward kernel on ``intra_part``'s operands: qe, [w,] kw (B, H, NC, C, D) and uv
  (B, H, NC, C, V) in q's dtype, gam (B, H, NC) and intra (B, H, NC, C, V) float32."""
  b, t, h, d = q.shape
  vd, nc = v.shape[-1], t // c
  shape = lambda x, dtype=q.dtype: jax.ShapeDtypeStruct((b * h, nc, c, x), dtype)
  mats = [chunk_block(c, d)] * (2 + erase)
  kernel = functools.partial(_forward_kernel, **_kernel_params(c, q, v, erase, cfg))
  outs = call(kernel, cfg=cfg, grid=(b * h, nc), in_specs=_specs(c, d, vd, h),
              out_specs=mats + [chunk_block(c, vd), chunk_block(1, 1), chunk_block(c, vd)],
              out_shape=[shape(d)] * (2 + erase) + [
                  shape(vd), jax.ShapeDtypeStruct((b * h, nc, 1, 1), F32), shape(vd, F32)],
              semantics=("parallel", "parallel"), name="merlin_intra_forward",
              num_warps=cfg.bwd_num_warps)(q, k, v, g, beta)
  *mats, gam, intra = (x.reshape(b, h, *x.shape[1:]) for x in outs)
  return (*mats, gam[..., 0, 0], intra)


def _backward(c, erase, cfg, q, k, v, g, beta, *cotangents):
  """The backward kernel: dq, dk, dv, dg, dbeta, each as its input (``_forward``'s operands),
  from those operands and the cotangents of ``_forward``'s results."""
  b, t, h, d = q.shape
  vd, nc = v.shape[-1], t // c
  *dmats, dgam, dintra = (x.reshape(b * h, *x.shape[2:]) for x in cotangents)
  dgam = dgam[..., None, None]
  kernel = functools.partial(_backward_kernel, **_kernel_params(c, q, v, erase, cfg))
  specs = _specs(c, d, vd, h)
  return tuple(call(
      kernel, cfg=cfg, grid=(b * h, nc),
      in_specs=specs + [chunk_block(c, d)] * (2 + erase) + [chunk_block(c, vd), chunk_block(1, 1),
                                                            chunk_block(c, vd)],
      out_specs=specs, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)
                                  for x in (q, k, v, g, beta)],
      semantics=("parallel", "parallel"), name="merlin_intra_backward",
      num_warps=cfg.bwd_num_warps)(q, k, v, g, beta, *dmats, dgam, dintra))


def _rules(erase):
  inputs = "b t h d, b t h d, b t h v, b t h o, b t h o"
  results = "b h n c d, " * (2 + erase) + "b h n c v, b h n, b h n c v"
  return f"{inputs} -> {results}", f"{inputs}, {results} -> {inputs}"


# Shardy: b, h may be sharded on any mesh axes; tokens t, chunks n, c, D, V and g's unit dim o
# must be whole on every device (the kernels walk them).
_PARTITIONED = {
    erase: tuple(partition.batch_head_partitioned(
        fn, n_static=3, rule=rule, replicated=("t", "n", "c", "d", "v", "o"))
        for fn, rule in zip((_forward, _backward), _rules(erase)))
    for erase in (True, False)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _intra(c, erase, cfg, q, k, v, g, beta):
  """``_forward`` per (B, H) shard; its backward ``_backward``, likewise."""
  return _PARTITIONED[erase][0](c, erase, cfg, q, k, v, g, beta)


def _intra_fwd(c, erase, cfg, *inputs):
  return _intra(c, erase, cfg, *inputs), inputs


def _intra_bwd(c, erase, cfg, inputs, cotangents):
  return _PARTITIONED[erase][1](c, erase, cfg, *inputs, *cotangents)


_intra.defvjp(_intra_fwd, _intra_bwd)


def intra_part(q, k, v, g, beta, *, chunk_size: int, erase: bool, cfg):
  """The state kernels' intra-chunk operands from the op's inputs q, k (B, T, H, D), v
  (B, T, H, V), g, beta (B, T, H) (g clamped): qe, [w (erase),] kw (B, H, NC, C, D') and uv
  (B, H, NC, C, V') in q's dtype, gam (B, H, NC) and intra (B, H, NC, C, V') float32, with
  NC = ceil(T / chunk_size) and D', V' the kernels' widths (``padded_width``):
  ``merlin.chunked.intra_chunk``'s values on the chunked inputs, padded and cast as
  ``merlin.pallas.ops.kernel_operands`` does (intra padded too).
  T is padded to whole chunks and D, V to their widths here (zeros: no write, no decay), so the
  kernels read the op's arrays in place where neither is padded."""
  c = chunk_size
  if c % SUB or c & (c - 1):
    raise ValueError(f"the intra-chunk kernels need a power-of-two chunk size >= {SUB}, got {c}")
  t = q.shape[1]
  tp = -(-t // c) * c

  def padded(x, width):
    if (x.shape[1], x.shape[-1]) == (tp, width):
      return x
    return jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, width - x.shape[-1])))

  dp, vp = padded_width(q.shape[-1]), padded_width(v.shape[-1])
  inputs = (padded(q, dp), padded(k, dp), padded(v, vp),
            *(padded(x.astype(F32)[..., None], 1) for x in (g, beta)))
  return _intra(c, erase, cfg, *inputs)
