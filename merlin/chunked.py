"""Chunk-parallel multi-state linear attention in plain JAX (docs/spec.md section 2).

Chunks of C tokens never straddle a segment (C divides L), so inside a chunk one state, the
current segment's, is written. With gc the chunk-local inclusive cumsum of g and the decay mask
``D_ts = exp(gc_t - gc_s)`` (s <= t), the E = 1 case of the triadic chunked form gives, for a
state entering the chunk as S0:

    A  = (I + StrictLower(beta_t (k_t . k_s) D_ts))^-1             UT transform (erase only)
    Uv = A (beta V),   W = A (beta exp(gc) K)                        WY form: U = [current] Uv - W S0
    S  <- Phi S0 + [current] Kw^T Uv,   Phi = exp(gc_C) I - Kw^T W,   Kw_t = exp(gc_C - gc_t) k_t

``Phi`` does not depend on the state, so the whole (N, D, V) stack crosses the chunk as one
batched product (factored: ``exp(gc_C) S - Kw^T (W S)``), and only the current state gets the
write. The output splits the same way: with ``P_ts = (q_t . k_s) D_ts`` and the effective query
``Qe_t = exp(gc_t) q_t - sum_s P_ts W_s``,

    o_t = scale [ lam_t,s (P Uv)_t + sum_i lam_ti Qe_t^T S0^i ]

Without erase W = 0. ``multistate_chunked`` goes further: within a segment's span of chunks
every earlier segment's state moves by the same maps, so it reads and carries them span by span
(its docstring); ``multistate_chunked_documents``, whose segments need not align with spans,
reads and carries the stack chunk by chunk, the second term one (C, N*D) x (N*D, V) matmul.

Numerics: every exponent is a later-minus-earlier difference of gc (<= 0); the upper triangle is
masked before the exponential, so no g <= 0 overflows, forward or backward. Float32 throughout.

Memory: each loop is a two-level ``lax.scan`` whose inner groups (of ~sqrt(#spans) spans, or of
~sqrt(#chunks) chunks with documents) are rematerialised, so the backward keeps O(sqrt) stacks,
never per-token states.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from merlin.segments import document_segments
from triadic.chunked import to_chunks, unit_lower_inverse


def _group_size(n: int) -> int:
  """The largest divisor of n that is <= ceil(sqrt(n)): chunks per rematerialised group."""
  root = math.isqrt(n)
  root += root * root < n
  return max(g for g in range(1, root + 1) if n % g == 0)


def _decay_mask(gc, causal):
  """D_ts = exp(gc_t - gc_s) where ``causal`` (s <= t), else 0; the exponent is masked before the
  exponential, so no later-minus-earlier difference overflows."""
  diff = gc[..., :, None] - gc[..., None, :]
  return jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)


def intra_chunk(q, k, v, g, beta, erase: bool, docs=None):
  """Everything inside a chunk that does not touch a state. Inputs (..., C, D|V) and (..., C).

  ``docs`` (None: one document) is ``chunk_documents``'s (same, fresh, last): token pairs of one
  document (.., C, C), tokens that still see the chunk-start state (.., C), tokens of the chunk's
  last document (.., C); every mask that crosses a document start is zeroed, so the g of a
  document's first token enters no exponent.

  Returns (uv, w, q_eff, k_write, chunk_decay, intra, ut, qk): Uv (.., C, V); W (.., C, D) or
  None; Qe (.., C, D); Kw (.., C, D); exp(gc_C) (..,); P Uv (.., C, V); A (.., C, C) or None; P.
  """
  c = q.shape[-2]
  gc = jnp.cumsum(g, axis=-1)  # chunk-local, non-increasing, <= 0
  causal = jnp.tril(jnp.ones((c, c), bool))
  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  decay_s0, k_end, chunk_decay = jnp.exp(gc), jnp.exp(gc[..., -1:] - gc), jnp.exp(gc[..., -1])
  if docs is not None:
    same, fresh, last = docs
    causal, strict = causal & same, strict & same
    decay_s0 = jnp.where(fresh, decay_s0, 0.0)
    k_end = jnp.where(last, k_end, 0.0)
    chunk_decay = jnp.where(fresh[..., -1], chunk_decay, 0.0)
  decay = _decay_mask(gc, causal)
  qk = jnp.einsum("...td,...sd->...ts", q, k) * decay  # P
  uv = beta[..., None] * v
  w = ut = None
  q_eff = decay_s0[..., None] * q
  if erase:
    kk = jnp.einsum("...td,...sd->...ts", k, k)
    ut = unit_lower_inverse(jnp.where(strict, beta[..., None] * kk * decay, 0.0))
    rhs = jnp.concatenate([uv, (beta * decay_s0)[..., None] * k], axis=-1)
    sol = jnp.einsum("...ts,...sx->...tx", ut, rhs)
    uv, w = sol[..., :v.shape[-1]], sol[..., v.shape[-1]:]
    q_eff = q_eff - jnp.einsum("...ts,...sd->...td", qk, w)
  k_write = k_end[..., None] * k
  intra = jnp.einsum("...ts,...sv->...tv", qk, uv)
  return uv, w, q_eff, k_write, chunk_decay, intra, ut, qk


def intra_chunk_pullback(q, k, v, g, beta, ut, uv_w, cotangents, erase: bool):
  """The pullback of ``intra_chunk(q, k, v, g, beta, erase)`` (one document): (dq, dk, dv, dg,
  dbeta) from the cotangents (duv, dw, dq_eff, dk_write, dchunk_decay, dintra) of its first six
  results (dw None without erase), given its A (``ut``) and its Uv and W (``uv_w``, a pair;
  each None without erase), so that neither the inverse nor A R is formed again.

  With S = Q K^T, P = S * D and, erase, R = [beta V, beta a K], [Uv, W] = A R, a = exp(gc),
  b = exp(gc_C - gc):

    dP = dintra Uv^T - dQe W^T          dUv' = dUv + P^T dintra       dW' = dW - P^T dQe
    dA = [dUv', dW'] R^T                dR = A^T [dUv', dW']           dL = -A^T dA A^T (strict)
    dQ = a dQe + (dP * D) K             dK = (dP * D)^T Q + (G + G^T) K + beta a dR_k + b dKw

  with G = dL * beta_t * D (L = beta_t (K K^T)_ts D_ts); dD = dP * S + dL * beta_t K K^T enters
  gc as row sums minus column sums of dD * D, and g through the cumulative sum's transpose.
  Each product is one batched matmul over all chunks; the inverse's loop runs only forward.
  ``merlin.pallas.intra``'s backward kernel computes the same chunk by chunk."""
  duv, dw, dqe, dkw, dgam, dintra = cotangents
  c = q.shape[-2]
  rowsum = lambda x, y: jnp.sum(x * y, axis=-1)
  gc = jnp.cumsum(g, axis=-1)
  causal = jnp.tril(jnp.ones((c, c), bool))
  a, b = jnp.exp(gc), jnp.exp(gc[..., -1:] - gc)
  decay = _decay_mask(gc, causal)
  s = jnp.einsum("...td,...sd->...ts", q, k)
  p = s * decay
  rv = beta[..., None] * v
  uv, w = uv_w if erase else (rv, None)
  dp = jnp.einsum("...tv,...sv->...ts", dintra, uv)
  duv = duv + jnp.einsum("...ts,...tv->...sv", p, dintra)
  da = rowsum(dqe, q)  # d/da, a = exp(gc)
  dk = b[..., None] * dkw
  if erase:
    rk = (beta * a)[..., None] * k
    dp = dp - jnp.einsum("...td,...sd->...ts", dqe, w)
    dw = dw - jnp.einsum("...ts,...td->...sd", p, dqe)
    dmat = jnp.einsum("...tv,...sv->...ts", duv, rv) + jnp.einsum("...td,...sd->...ts", dw, rk)
    drv, drk = jnp.einsum("...ts,...tv->...sv", ut, duv), jnp.einsum("...ts,...td->...sd", ut, dw)
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    dmat_at = jnp.einsum("...tu,...vu->...tv", dmat, ut)  # dA A^T
    dl = jnp.where(strict, -jnp.einsum("...ts,...tu->...su", ut, dmat_at), 0.0)
    kk = jnp.einsum("...td,...sd->...ts", k, k)
    gmat = dl * beta[..., None] * decay
    dk = dk + jnp.einsum("...ts,...sd->...td", gmat, k) + jnp.einsum("...ts,...td->...sd", gmat, k)
    dk = dk + (beta * a)[..., None] * drk
    k_drk = rowsum(drk, k)
    dbeta = rowsum(dl * kk, decay) + a * k_drk
    da = da + beta * k_drk
    dd = dp * s + dl * beta[..., None] * kk
  else:
    drv, dbeta, dd = duv, 0.0, dp * s
  dv = beta[..., None] * drv
  dbeta = dbeta + rowsum(drv, v)
  dpd = dp * decay
  dq = a[..., None] * dqe + jnp.einsum("...ts,...sd->...td", dpd, k)
  dk = dk + jnp.einsum("...ts,...td->...sd", dpd, q)
  e = dd * decay  # d/d(gc_t - gc_s)
  db = b * rowsum(dkw, k)
  dgc = a * da - db + jnp.sum(e, axis=-1) - jnp.sum(e, axis=-2)
  dgc = dgc.at[..., -1].add(jnp.sum(db, axis=-1) + jnp.exp(gc[..., -1]) * dgam)
  dg = jnp.flip(jnp.cumsum(jnp.flip(dgc, -1), axis=-1), -1)  # transpose of the cumulative sum
  return dq, dk, dv, dg, dbeta


def chunk_documents(starts: jax.Array, n: int, c: int):
  """Per-chunk document masks from starts (B, T) bool (a token opens a new document).

  With r_t the number of document starts in the chunk up to and including t: tokens s <= t are in
  one document iff r_s = r_t; t sees the chunk-start state iff r_t = 0; t is in the chunk's last
  document iff r_t = r_C. Returns (same (B, 1, n, C, C), fresh (B, 1, n, C), last (B, 1, n, C)),
  with a head axis to broadcast against (B, H, n, C, .).
  """
  b, t = starts.shape
  r = jnp.cumsum(jnp.pad(starts, ((0, 0), (0, n * c - t))).reshape(b, 1, n, c), axis=-1)
  return r[..., :, None] == r[..., None, :], r == 0, r == r[..., -1:]


def multistate_chunked(q, k, v, g, beta, lam, *, segment_len: int, scale: float, erase: bool,
                       chunk_size: int):
  """Chunk-parallel multi-state recurrence; shapes as ``merlin.multistate_attention``.

  The scan runs over spans, one segment's chunks each. Entering span s (segment s's first
  chunk), the states of the earlier segments only decay and are erased until the span ends:
  chunk m of the span maps each of them by the same Phi_m, so the span reads them with the
  walked query Qe_m Phi_{m-1} ... Phi_0 and carries them once, by the composite
  Phi_{cps-1} ... Phi_0 (D x D), instead of chunk by chunk. Segment s's own state starts at
  zero and is the only one written; it runs chunk by chunk inside the span (``_own_chunk``).
  Per span that is one (cps C, N D) x (N D, V) read and one D x D map of the stack, where a
  chunk-by-chunk scan does the read and a C x D map of the stack per chunk; the walk adds
  O(C D^2) a chunk, whatever N (benchmarks/RESULTS.md: the forward is faster from N = 8 states
  on, forward and backward at every N timed, 4 to 64).

  ``lam`` must already be zero for i > s(t); ``chunk_size`` must divide ``segment_len``.
  Returns o (B, T, H, V) float32.
  """
  b, t, h, d = q.shape
  n_states, vdim = lam.shape[-1], v.shape[-1]
  c, cps = chunk_size, segment_len // chunk_size
  spans = -(-t // segment_len)
  n = spans * cps  # whole spans: padded chunks add nothing (below)
  # Padded tokens have q = k = v = beta = lam = 0 and g = 0: no write, no erase, no decay.
  q, k, v, lam = (to_chunks(x, n, c) for x in (q, k, v, lam))
  g, beta = to_chunks(g, n, c), to_chunks(beta, n, c)
  uv, w, q_eff, k_write, chunk_decay, intra, _, _ = intra_chunk(q, k, v, g, beta, erase)

  owner = jax.nn.one_hot(jnp.arange(spans), n_states, dtype=jnp.float32)  # (spans, N)
  lam_own = jnp.einsum("bhsmcn,sn->bhsmc", lam.reshape(b, h, spans, cps, c, n_states), owner)
  o_intra = lam_own.reshape(b, h, n, c)[..., None] * intra
  # The walk's map: without erase Phi_m = gamma_m I, so a scalar stands for it.
  walk_init = (jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), (b, h, d, d)) if erase
               else jnp.ones((b, h), jnp.float32))

  def span(states, xs):
    """One segment's span: the stack read by the walked queries, the own state chunk by chunk,
    then the stack carried by the span's composite map and the own state stored in it."""
    lam_s, qe_s, w_s, kw_s, uv_s, dec_s, lam_own_s, owner_s = xs
    own = jnp.zeros((b, h, d, vdim), jnp.float32)
    (own, walk), (walked, o_own) = jax.lax.scan(_own_chunk, (own, walk_init),
                                                (qe_s, w_s, kw_s, uv_s, dec_s))
    rows = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, h, cps * c, *x.shape[4:])  # span's tokens
    query = (rows(lam_s)[..., :, None] * rows(walked)[..., None, :]).reshape(
        b, h, cps * c, n_states * d)
    o = jnp.einsum("bhcx,bhxv->bhcv", query, states.reshape(b, h, n_states * d, vdim))
    o = o + rows(lam_own_s)[..., None] * rows(o_own)
    if erase:
      states = jnp.einsum("bhde,bhnev->bhndv", walk, states)
    else:
      states = walk[..., None, None, None] * states
    return states + owner_s[:, None, None] * own[:, :, None], o

  def group(states, xs):
    return jax.lax.scan(span, states, xs)

  per_group = _group_size(spans)
  split = lambda x: None if x is None else jnp.moveaxis(x, 2, 0).reshape(
      spans // per_group, per_group, cps, *x.shape[:2], *x.shape[3:])
  xs = tuple(map(split, (lam, q_eff, w, k_write, uv, chunk_decay, lam_own.reshape(b, h, n, c))))
  xs += (owner.reshape(spans // per_group, per_group, n_states),)
  init = jnp.zeros((b, h, n_states, d, vdim), jnp.float32)
  _, o_prev = jax.lax.scan(jax.checkpoint(group), init, xs)  # (groups, per_group, B, H, cps C, V)
  o_prev = jnp.moveaxis(o_prev.reshape(spans, b, h, cps * c, vdim), 0, 2)
  o = scale * (o_prev.reshape(b, h, n, c, vdim) + o_intra)  # (B, H, n, C, V)
  return jnp.moveaxis(o, 1, 3).reshape(b, n * c, h, vdim)[:, :t]


def _chunk_map(x, decay, w, kw):
  """Phi x for x (B, H, ..., D, X), factored: exp(gc_C) x - Kw^T (W x); without erase (w None)
  Phi = exp(gc_C) I, which also maps a scalar x (B, H) standing for a multiple of I."""
  x_decayed = decay.reshape(decay.shape + (1,) * (x.ndim - 2)) * x
  if w is None:
    return x_decayed
  return x_decayed - jnp.einsum("bhcd,bh...cx->bh...dx", kw,
                                jnp.einsum("bhcd,bh...dx->bh...cx", w, x))


def _own_chunk(carry, xs):
  """One chunk of a span: the own state's read (Qe S) and update (Phi S + Kw^T Uv), and the walk
  Phi_{m-1} ... Phi_0 (D x D; a scalar without erase) applied to the effective query, then
  extended by this chunk's Phi."""
  own, walk = carry
  qe, w, kw, uv, decay = xs
  o_own = jnp.einsum("bhcd,bhdv->bhcv", qe, own)
  walked = (walk[..., None, None] * qe if w is None
            else jnp.einsum("bhcd,bhde->bhce", qe, walk))
  own = _chunk_map(own, decay, w, kw) + jnp.einsum("bhcd,bhcv->bhdv", kw, uv)
  return (own, _chunk_map(walk, decay, w, kw)), (walked, o_own)


def multistate_chunked_documents(q, k, v, g, beta, lam, doc_ids, *, segment_len: int, scale: float,
                                 erase: bool, chunk_size: int):
  """``multistate_chunked`` for packed rows: documents (doc_ids (B, T)) start anywhere, each with
  its own segments counted from its start, so a chunk may hold several documents and segments.

  By linearity of the UT transform, state i's corrected values are U^i = A diag(m_i) (beta V) -
  W S0^i with m_i(s) = [seg(s) = i]. So, per chunk, the intra-chunk output is
  ((P A) * Lam) (beta V) with Lam_tr = lam_t,seg(r) (C x C), and state i's write is
  (A^T Kw)^T diag(m_i) (beta V): one einsum with the one-hot of seg over the N states. Every
  chunk reads the stack S0 with Qe and carries it by Phi (the module's equations).
  ``chunk_documents``' masks keep
  every product inside one document (A, P block-diagonal; no S0 read or carry across a start).
  ``lam`` must already be zero for segments a token may not read. Returns o (B, T, H, V) float32.
  """
  b, t, h, d = q.shape
  n_states, vdim = lam.shape[-1], v.shape[-1]
  c = chunk_size
  n = -(-t // c)
  seg, starts = document_segments(doc_ids, segment_len)
  docs = chunk_documents(starts, n, c)
  q, k, v, lam = (to_chunks(x, n, c) for x in (q, k, v, lam))
  g, beta = to_chunks(g, n, c), to_chunks(beta, n, c)
  _, w, q_eff, k_write, chunk_decay, _, ut, qk = intra_chunk(q, k, v, g, beta, erase, docs)
  bv = beta[..., None] * v  # (B, H, n, C, V)
  seg = jnp.pad(seg, ((0, 0), (0, n * c - t))).reshape(b, 1, n, 1, c)
  lam_r = jnp.take_along_axis(lam, jnp.broadcast_to(seg, (b, h, n, c, c)), axis=-1)  # lam_t,seg(r)
  pa = qk if ut is None else jnp.einsum("...ts,...sr->...tr", qk, ut)
  o_intra = jnp.einsum("...tr,...rv->...tv", pa * lam_r, bv)
  k_out = k_write if ut is None else jnp.einsum("...tr,...td->...rd", ut, k_write)  # A^T Kw
  owner = jax.nn.one_hot(seg[:, 0, :, 0], n_states, dtype=jnp.float32)  # (B, n, C, N)

  def step(states, xs):
    lam_c, qe_c, w_c, kt_c, kw_c, bv_c, dec_c, owner_c = xs
    query = (lam_c[..., :, None] * qe_c[..., None, :]).reshape(b, h, c, n_states * d)
    o = jnp.einsum("bhcx,bhxv->bhcv", query, states.reshape(b, h, n_states * d, vdim))
    carried = _chunk_map(states, dec_c, w_c, kw_c)
    return carried + jnp.einsum("bhcd,bcn,bhcv->bhndv", kt_c, owner_c, bv_c), o

  def group(states, xs):
    return jax.lax.scan(step, states, xs)

  per_group = _group_size(n)
  split = lambda x, axis=2: None if x is None else jnp.moveaxis(x, axis, 0).reshape(
      n // per_group, per_group, *(m for i, m in enumerate(x.shape) if i != axis))
  xs = tuple(map(split, (lam, q_eff, w, k_out, k_write, bv, chunk_decay))) + (split(owner, 1),)
  init = jnp.zeros((b, h, n_states, d, vdim), jnp.float32)
  _, o_prev = jax.lax.scan(jax.checkpoint(group), init, xs)
  o_prev = jnp.moveaxis(o_prev.reshape(n, b, h, c, vdim), 0, 2)
  o = scale * (o_prev + o_intra)
  return jnp.moveaxis(o, 1, 3).reshape(b, n * c, h, vdim)[:, :t]
