"""The decay masks M, M' and their gradients, in plain JAX over all chunks at once.

Every per-slice (E-dependent) piece of the chunk-local work is C x C work per slice e around the
decay mask D_ets = exp(gc_te - gc_se) (s <= t), which XLA fuses over all chunks; the Pallas
kernels around these functions are then E-independent:

  forward   ``chunk_cumsum``: gc, the chunk-local inclusive cumsum of g;
            ``decay_masks``: M_ts = sum_e k2_te k2_se D_ets, M'_ts = sum_e q2_te k2_se D_ets,
            masked before exp (``common.decay_mask``): nothing overflows for any g <= 0.
  backward  ``mask_grads``: from dM' = dP * (Q K^T) and dM = dL * beta * (K K^T) (the tail
            kernel's outputs) and the slice kernel's row coefficients, dk2, dq2 and d gc.

Per slice e, with W'_ts = dM'_ts D_ets and W_ts = dM_ts D_ets (W only with erase), and
a = exp(gc), b = exp(gc_C - gc):

  dq2_t     = sum_s W'_ts k2_s + dqcoef_t a_t
  dk2 col_t = dkcoef_t b_t [+ sum_s W_ts k2_s + dcoef_t a_t]
  dk2 row_s = sum_t W'_ts q2_t [+ sum_t W_ts k2_t]
  dG_ts     = W'_ts q2_t k2_s [+ W_ts k2_t k2_s]                (through exp(gc_t - gc_s))
  dgc col_t = sum_s dG_ts + dqcoef_t q2_t a_t - dkcoef_t k2_t b_t [+ dcoef_t k2_t a_t]
              (+ at t = C-1: sum_t dkcoef_t k2_t b_t + dlam exp(gc_C))
  dgc row_s = -sum_t dG_ts

The four C x C reductions rq = sum_s W' k2_s, rk = sum_s W k2_s, cq = sum_t W' q2_t,
ck = sum_t W k2_t are the only ones taken: sum_s dG_ts = q2_t rq_t + k2_t rk_t and
sum_t dG_ts = k2_s (cq_s + ck_s) = k2_s dk2 row_s.

Sub-chunks (``subchunk`` = S, ``Config.mask_subchunk``; S divides C). Formed elementwise, every
element of the masks and of each reduction evaluates its own exponential, C^2 E a chunk per
expression, and that is what bounds these fusions. Cut the chunk into C / S sub-chunks and anchor
each source token s (in sub-chunk j) at the last token of its sub-chunk, b_j = S j + S - 1. For t
in a later sub-chunk, gc_t <= gc_{b_j} <= gc_s (gc is non-increasing), so

  D_ets = L_tje R_se,  L_tje = exp(gc_te - gc_{b_j}e) (sub-chunk of t > j),
                       R_se = exp(gc_{b_j}e - gc_se),

both exponents <= 0: nothing overflows for any g <= 0, and a factor that underflows to 0 bounds
a true value below float32's range. L (masked before exp, as ``decay``) and R take C (C / S) E +
C E exponentials a chunk. The blocks off the diagonal are then matmuls contracting over tokens
with no exponential per element, and the S x S diagonal blocks (t, s in one sub-chunk, the only
place where s <= t needs the elementwise mask) keep the direct form, C S E exponentials:

  M'     = (q2 L) (R k2)^T          (q2 L: (C, (C / S) E); R k2 spread into the columns of its
                                     own sub-chunk, zero in the others: (C, (C / S) E))
  rq_te  = sum_j L_tje (dM' (R k2))_tje
  cq_se  = R_se (dM'^T (q2 L))_{s j(s) e}

and so for M, rk and ck with k2 for q2. The block-diagonal spread of R k2 makes every product a
plain (C, C) x (C, (C / S) E) matmul per chunk, reading dM' and dM as they are (cq, ck contract
over their major axis, no transposed copy); its zeros make each C / S times the multiply-adds it
needs, C^2 (C / S) E a chunk, which smaller sub-chunks trade against fewer exponentials in the
diagonal blocks. Dots are float32 at ``Precision.HIGHEST`` (no TF32 on the GPU). In the diagonal
blocks the four reductions are each over the minor axis of a (.., E, S, S) expression (cq, ck
over the transposed blocks), so that they can share one fusion. ``subchunk=0`` (or S >= C) is the
elementwise form: M and M' an unrolled sum over e of elementwise (BH, NC, C, C) terms, each
reduction over the minor axis of a (BH, NC, E, C, C) broadcast expression with its own decay
mask, so that it fuses its exponentials instead of reading one materialised E x C x C mask.

Layout: as the kernels, (BH, NC, C, E) columns and (BH, NC, E, C) rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def _cols(x):
  """(BH, NC, C, E) -> (BH, NC, E, C, 1): slice e's per-token values along the second-minor axis."""
  return jnp.swapaxes(x, -1, -2)[..., :, :, None]


def _rows(x):
  """(BH, NC, E, C) -> (BH, NC, E, 1, C): slice e's per-token values along the minor axis."""
  return x[..., :, None, :]


def _lower(c):
  """(C, C) s <= t with t the row index (``common.masks``' causal)."""
  return jnp.arange(c)[None, :] <= jnp.arange(c)[:, None]


def decay(gc_col, gc_row, *, transpose=False):
  """D_ets = exp(gc_te - gc_se) where s <= t, else 0, as a (BH, NC, E, C_t, C_s) expression, or
  with ``transpose`` as (BH, NC, E, C_s, C_t) (same values: gc_t from gc_col, gc_s from gc_row, as
  ``chunk_local``). Masked before exp: nothing overflows for any g <= 0."""
  if transpose:
    causal = _lower(gc_col.shape[-2]).T
    diff = _rows(jnp.swapaxes(gc_col, -1, -2)) - gc_row[..., :, :, None]
  else:
    causal = _lower(gc_col.shape[-2])
    diff = _cols(gc_col) - _rows(gc_row)
  return jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)


def chunk_cumsum(g_col):
  """gc: the chunk-local inclusive cumsum of g (BH, NC, C, E) float32, non-increasing, <= 0."""
  return jnp.cumsum(g_col.astype(jnp.float32), axis=-2)


def sub_chunk(subchunk, c):
  """The sub-chunk size that ``decay_masks`` and ``mask_grads`` use at chunk size ``c``: 0 (the
  elementwise form) for ``subchunk`` 0 or >= c (one sub-chunk would be the whole chunk), else
  ``subchunk``, which must divide c (a ValueError otherwise)."""
  if not isinstance(subchunk, int) or isinstance(subchunk, bool) or subchunk < 0:
    raise ValueError(f"subchunk must be an int >= 0 (0: elementwise), got {subchunk!r}")
  if subchunk == 0 or subchunk >= c:
    return 0
  if c % subchunk:
    raise ValueError(f"subchunk must divide the chunk size {c} (or be 0: elementwise), got "
                     f"{subchunk}")
  return subchunk


def _anchor_factors(gc_col, s):
  """L (BH, NC, C, C / S, E): exp(gc_te - gc_{b_j}e) where t's sub-chunk is after j, else 0
  (masked before exp), and R (BH, NC, C, E): exp(gc_{b_j(s)}e - gc_se); b_j = S j + S - 1, the
  last token of sub-chunk j. Both exponents <= 0."""
  c, e = gc_col.shape[-2:]
  ns = c // s
  anchor = gc_col[..., s - 1::s, :]                                     # (BH, NC, C / S, E)
  later = ((jnp.arange(c) // s)[:, None] > jnp.arange(ns)[None, :])[:, :, None]
  diff = gc_col[..., :, None, :] - anchor[..., None, :, :]
  l = jnp.where(later, jnp.exp(jnp.where(later, diff, 0.0)), 0.0)
  own = jnp.broadcast_to(anchor[..., :, None, :], (*anchor.shape[:-2], ns, s, e))
  r = jnp.exp(own.reshape(gc_col.shape) - gc_col)
  return l, r


def _spread(x, s):
  """(BH, NC, C, E) -> (BH, NC, C, (C / S) E): row s's values in the E columns of its own
  sub-chunk j(s), zero in the others (the right factor of the cross-sub-chunk matmuls)."""
  c, e = x.shape[-2:]
  ns = c // s
  own = ((jnp.arange(c) // s)[:, None] == jnp.arange(ns)[None, :])[:, :, None]
  return jnp.where(own, x[..., :, None, :], 0.0).reshape(*x.shape[:-2], c, ns * e)


def _own_block(x, s):
  """(BH, NC, C, (C / S) E) -> (BH, NC, C, E): row s's E columns of its own sub-chunk j(s)."""
  c = x.shape[-2]
  ns = c // s
  x = x.reshape(*x.shape[:-1], ns, -1)
  own = ((jnp.arange(c) // s)[:, None] == jnp.arange(ns)[None, :])[:, :, None]
  return jnp.sum(jnp.where(own, x, 0.0), axis=-2)


def _flat(x):
  """(..., C, C / S, E) -> (..., C, (C / S) E)."""
  return x.reshape(*x.shape[:-2], -1)


def _blocks(x, s):
  """(BH, NC, C, E) -> (BH, NC, C / S, S, E) and its rows (BH, NC, C / S, E, S): per sub-chunk."""
  x = x.reshape(*x.shape[:-2], x.shape[-2] // s, s, x.shape[-1])
  return x, jnp.swapaxes(x, -1, -2)


def _diag_blocks(x, s):
  """(BH, NC, C, C) -> (BH, NC, C / S, S, S): the blocks of t and s in one sub-chunk."""
  return jnp.stack([x[..., j * s:(j + 1) * s, j * s:(j + 1) * s]
                    for j in range(x.shape[-1] // s)], axis=-3)


def _place_diag(blocks, c):
  """(BH, NC, C / S, S, S) -> (BH, NC, C, C): the blocks on the diagonal, zero elsewhere (by
  padding, so that each block's value is used once)."""
  ns, s = blocks.shape[-3], blocks.shape[-1]
  lead = [(0, 0)] * (blocks.ndim - 3)
  return jnp.concatenate([jnp.pad(blocks[..., j, :, :], lead + [(0, 0), (j * s, c - j * s - s)])
                          for j in range(ns)], axis=-2)


def decay_masks(k2_col, k2_row, q2_col, gc_col, gc_row, *, erase, subchunk=0):
  """M and M' of every chunk, (BH, NC, C, C) float32 each (M is None without erase). ``subchunk``:
  by sub-chunks of that many tokens (``sub_chunk``; the module docstring), 0 elementwise (one
  unrolled sum over the slices each)."""
  c, e_dim = gc_col.shape[-2:]
  s = sub_chunk(subchunk, c)
  if not s:
    m = mq = 0.0
    for e in range(e_dim):
      dec = decay(gc_col[..., e:e + 1], gc_row[..., e:e + 1, :])[..., 0, :, :]
      k2s = k2_row[..., e:e + 1, :]
      mq = mq + q2_col[..., e:e + 1] * k2s * dec
      if erase:
        m = m + k2_col[..., e:e + 1] * k2s * dec
    return (m if erase else None), mq
  l, r = _anchor_factors(gc_col, s)
  rk2 = _spread(k2_col * r, s)
  gcb, gcb_row = _blocks(gc_col, s)
  dec = decay(gcb, gcb_row)                                     # (BH, NC, C / S, E, S, S)
  k2b, k2b_row = _blocks(k2_col, s)
  q2b = _blocks(q2_col, s)[0]

  def mask(x_col, xb):
    across = jnp.einsum("...tf,...sf->...ts", _flat(x_col[..., :, None, :] * l), rk2,
                        precision=HIGHEST)
    within = 0.0
    for e in range(e_dim):
      within = within + xb[..., :, e:e + 1] * k2b_row[..., e:e + 1, :] * dec[..., e, :, :]
    return across + _place_diag(within, c)

  return (mask(k2_col, k2b) if erase else None), mask(q2_col, q2b)


def mask_grads(dmq, dm, dcoef, dqcoef, dkcoef, dlam, k2_col, k2_row, q2_col, gc_col, gc_row, *,
               erase, subchunk=0):
  """The per-slice gradients of the masks (``backward.chunk_local``'s loop over e), for all
  chunks at once.

  dmq = dM' (BH, NC, C, C), dm = dM (None without erase); the slice kernel's row coefficients
  dcoef (unused without erase), dqcoef, dkcoef (BH, NC, C, E) and dlam (BH, NC, E); k2, q2, gc
  in the kernels' column (C, E) and row (E, C) layouts. ``subchunk``: the reductions by
  sub-chunks of that many tokens (``sub_chunk``; the module docstring), 0 elementwise. Returns
  float32 dk2 column (C, E), dk2 row (E, C), dq2 (C, E), d gc column (C, E) and d gc row (E, C)
  parts, each (BH, NC, ...)."""
  s = sub_chunk(subchunk, gc_col.shape[-2])
  reductions = _sub_chunk_reductions if s else _elementwise_reductions
  rq, rk, ck_cq = reductions(dmq, dm, k2_col, k2_row, q2_col, gc_col, gc_row, erase=erase, s=s)
  dk2_col, dq2, dgc_col = _factor_grads(dcoef, dqcoef, dkcoef, dlam, k2_col, q2_col, gc_col,
                                        erase=erase)
  dq2 = dq2 + rq
  dk2_row = ck_cq
  dgc_col = dgc_col + q2_col * rq                         # + sum_s dG_ts
  if erase:
    dk2_col = dk2_col + rk
    dgc_col = dgc_col + k2_col * rk
  dgc_row = -(k2_row * dk2_row)                                 # -sum_t dG_ts = -k2_s dk2 row_s
  return dk2_col, dk2_row, dq2, dgc_col, dgc_row


def _elementwise_reductions(dmq, dm, k2_col, k2_row, q2_col, gc_col, gc_row, *, erase, s):
  """rq, rk (columns (C, E); rk None without erase) and cq + ck (rows (E, C)), each reduction
  over the minor axis of a (BH, NC, E, C, C) expression with its own exponentials."""
  del s
  rows = lambda x: jnp.swapaxes(x, -1, -2)
  # Per-token factors along the minor axis: s of (E, C_t, C_s), t of the transposed (E, C_s, C_t).
  k2_minor, q2_minor = _rows(k2_row), _rows(rows(q2_col))
  # rq_et = sum_s W'_ts k2_s, cq_es = sum_t W'_ts q2_t
  rq = jnp.sum(dmq[:, :, None] * decay(gc_col, gc_row) * k2_minor, axis=-1)
  cq = jnp.sum(rows(dmq)[:, :, None] * decay(gc_col, gc_row, transpose=True) * q2_minor, axis=-1)
  if not erase:
    return rows(rq), None, cq
  # rk_et = sum_s W_ts k2_s, ck_es = sum_t W_ts k2_t
  rk = jnp.sum(dm[:, :, None] * decay(gc_col, gc_row) * k2_minor, axis=-1)
  ck = jnp.sum(rows(dm)[:, :, None] * decay(gc_col, gc_row, transpose=True) * k2_minor, axis=-1)
  return rows(rq), rows(rk), cq + ck


def _sub_chunk_reductions(dmq, dm, k2_col, k2_row, q2_col, gc_col, gc_row, *, erase, s):
  """``_elementwise_reductions`` by sub-chunks of ``s`` tokens: across sub-chunks matmuls with
  the anchor factors L, R (no exponential per element), within them the direct form."""
  del k2_row, gc_row
  c, e_dim = gc_col.shape[-2:]
  ns = c // s
  l, r = _anchor_factors(gc_col, s)
  rk2 = _spread(k2_col * r, s)                                  # (BH, NC, C, (C / S) E)
  gcb, gcb_row = _blocks(gc_col, s)
  # The diagonal blocks' decay as (BH, NC, C / S, E, S_t, S_s) and transposed, (.., S_s, S_t): each
  # reduction over the minor axis, as the elementwise form's.
  dec, dec_t = decay(gcb, gcb_row), decay(gcb, gcb_row, transpose=True)
  k2b_row, q2b_row = _blocks(k2_col, s)[1], _blocks(q2_col, s)[1]
  per_token = lambda x: x.reshape(*x.shape[:-3], c, e_dim)      # (.., C / S, S, E) -> (.., C, E)
  as_cols = lambda x: per_token(jnp.swapaxes(x, -1, -2))        # (.., C / S, E, S) -> (.., C, E)

  def row_sum(dmx):
    """sum_s dmx_ts D_ets k2_se: (BH, NC, C, E)."""
    across = jnp.einsum("...ts,...sf->...tf", dmx, rk2, precision=HIGHEST)
    across = jnp.sum(l * across.reshape(*across.shape[:-1], ns, e_dim), axis=-2)
    within = jnp.sum(_diag_blocks(dmx, s)[..., None, :, :] * dec * k2b_row[..., :, None, :],
                     axis=-1)                                   # (BH, NC, C / S, E, S_t)
    return across + as_cols(within)

  def col_sum(dmx, x_col, xb_row):
    """sum_t dmx_ts D_ets x_te: (BH, NC, C, E)."""
    across = jnp.einsum("...ts,...tf->...sf", dmx, _flat(x_col[..., :, None, :] * l),
                        precision=HIGHEST)
    blocks_t = jnp.swapaxes(_diag_blocks(dmx, s), -1, -2)      # (BH, NC, C / S, S_s, S_t)
    within = jnp.sum(blocks_t[..., None, :, :] * dec_t * xb_row[..., :, None, :],
                     axis=-1)                                   # (BH, NC, C / S, E, S_s)
    return r * _own_block(across, s) + as_cols(within)

  rq = row_sum(dmq)
  cq = col_sum(dmq, q2_col, q2b_row)
  if not erase:
    return rq, None, jnp.swapaxes(cq, -1, -2)
  rk = row_sum(dm)
  ck = col_sum(dm, k2_col, k2b_row)
  return rq, rk, jnp.swapaxes(cq + ck, -1, -2)


def _factor_grads(dcoef, dqcoef, dkcoef, dlam, k2_col, q2_col, gc_col, *, erase):
  """The terms of ``mask_grads`` that come from the slice kernel's row coefficients, not from M
  or M': (dk2, dq2, d gc) columns (C, E), d gc with the chunk-end decay's term in its last row."""
  c = gc_col.shape[-2]
  a = jnp.exp(gc_col)
  gl = gc_col[..., c - 1:, :]                             # (BH, NC, 1, E)
  b = jnp.exp(gl - gc_col)
  dk2 = dkcoef * b
  dq2 = dqcoef * a
  dgc = dqcoef * q2_col * a - dkcoef * k2_col * b
  if erase:
    dk2 = dk2 + dcoef * a
    dgc = dgc + dcoef * k2_col * a
  dgl = jnp.sum(dkcoef * k2_col * b, axis=-2) + dlam * jnp.exp(gl[..., 0, :])   # (BH, NC, E)
  return dk2, dq2, dgc.at[..., c - 1, :].add(dgl)
