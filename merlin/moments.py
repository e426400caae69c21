"""Segment moments of the small keys k' and the alignment scores a query q' reads from them.

For token t and visible segment i <= s(t), with J = {j <= t : s(j) = i} and n = |J|:

    r_mu    = mu_ti^T q'_t,                     mu_ti    = (1/n) sum_J k'_j
    r_sigma = q'_t^T Sigma_ti q'_t - r_mu^2,    Sigma_ti = (1/n) sum_J k'_j k'_j^T

Finished segments (i < s(t)) hold all L of their keys; the current one (i = s(t)) holds its keys
up to t, so the scores are causal. Two implementations give the same numbers:

- ``scan``: running sums (R + R^2 per segment), updated token by token: the decode-time form.
- ``parallel`` (the default): finished segments from their full sums (one segment einsum), the
  current segment from the in-segment alignments a_tj = q'_t . k'_j (an L x L causal block per
  segment), so nothing per-token of size R^2 is ever materialised. The finished segments' second
  moments q'_t^T Sigma_i q'_t are taken a block of queries at a time (``_quadratic_forms``), so
  memory, backward included, is O(B T G (N + R + L) + B G N R^2) plus one block's
  (B, block, G, N, R) product of at most ``BLOCK_ELEMENTS``, not the (B, T, G, N, R) product
  of all queries, which would be quadratic in T.

q', k' have G groups: G = H (per head, Gated DeltaNet) or G = 1 (shared, Mamba-2).

Packed rows (``doc_ids``, the ops' segment_ids): segments are counted from each document's start
and J holds only the token's own document. That runs the ``scan`` form with its sums reset at each
document start, whatever ``impl`` says: the parallel form's L x L blocks are aligned to the row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from merlin.segments import document_segments, num_segments_needed, segment_ids

IMPLS = ("auto", "scan", "parallel")
# Float32 elements (64 MiB) of one query block's (B, block, G, N, R) product in _quadratic_forms.
BLOCK_ELEMENTS = 1 << 24


def moment_scores(qr, kr, *, segment_len: int, num_segments: int, impl: str = "auto",
                  doc_ids=None):
  """(r_mu, r_sigma), each (B, T, G, N) float32, zero for i > s(t). qr, kr: (B, T, G, R);
  doc_ids (B, T) int or None: the document of each token (segments counted from its start)."""
  if impl == "scan" or doc_ids is not None:
    return _scan(qr, kr, segment_len, num_segments, doc_ids)
  return _parallel(qr, kr, segment_len, num_segments)


def _scan(qr, kr, segment_len, n, doc_ids=None):
  b, t, grp, r = qr.shape
  time_major = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)
  if doc_ids is None:
    owner = jnp.broadcast_to(jax.nn.one_hot(segment_ids(t, segment_len), n)[:, None], (t, b, n))
    keep = jnp.ones((t, b), jnp.float32)
  else:
    seg, starts = document_segments(doc_ids, segment_len)
    owner, keep = time_major(jax.nn.one_hot(seg, n)), time_major(~starts)

  def step(sums, x):
    s1, s2, count = sums  # (B,G,N,R), (B,G,N,R,R), (B,N)
    q_t, k_t, owner_t, keep_t = x  # owner_t (B, N), keep_t (B,): 0 at a document start
    s1, s2, count = (z * keep_t.reshape((b,) + (1,) * (z.ndim - 1)) for z in (s1, s2, count))
    s1 = s1 + owner_t[:, None, :, None] * k_t[:, :, None]
    s2 = s2 + owner_t[:, None, :, None, None] * (k_t[..., :, None] * k_t[..., None, :])[:, :, None]
    count = count + owner_t
    inv = jnp.where(count > 0, 1.0 / jnp.maximum(count, 1.0), 0.0)
    r_mu = jnp.einsum("bgr,bgnr->bgn", q_t, s1) * inv[:, None]
    second = jnp.einsum("bgr,bgnrs,bgs->bgn", q_t, s2, q_t) * inv[:, None]
    return (s1, s2, count), (r_mu, second - r_mu ** 2)

  init = (jnp.zeros((b, grp, n, r)), jnp.zeros((b, grp, n, r, r)), jnp.zeros((b, n)))
  _, (r_mu, r_sigma) = jax.lax.scan(step, init, (time_major(qr), time_major(kr),
                                                 owner.astype(jnp.float32), keep))
  return jnp.moveaxis(r_mu, 0, 1), jnp.moveaxis(r_sigma, 0, 1)


def _parallel(qr, kr, segment_len, n):
  b, t, grp, r = qr.shape
  used, ln = num_segments_needed(t, segment_len), segment_len
  pad = used * ln - t
  blocks = lambda x: jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(
      b, used, ln, grp, r)
  qb, kb = blocks(qr), blocks(kr)  # (B, S, L, G, R); padded keys are never read (see below)

  # Finished segments: full-segment means of k' and k'k'^T, read by every later token.
  mean1 = kb.mean(axis=2)  # (B, S, G, R)
  mean2 = jnp.einsum("bslgr,bslgq->bsgrq", kb, kb) / ln  # (B, S, G, R, R)
  q_flat = qb.reshape(b, used * ln, grp, r)
  fin_mu = jnp.einsum("btgr,bigr->btgi", q_flat, mean1)
  fin_2 = _quadratic_forms(q_flat, mean2)

  # Current segment: causal running means of a_tj and a_tj^2 inside each L x L block.
  align = jnp.einsum("bslgr,bsmgr->bsglm", qb, kb)
  causal = jnp.tril(jnp.ones((ln, ln), bool))
  count = jnp.arange(1, ln + 1, dtype=jnp.float32)  # tokens of the current segment up to t
  cur_mu = jnp.where(causal, align, 0.0).sum(-1) / count  # (B, S, G, L)
  cur_2 = jnp.where(causal, align ** 2, 0.0).sum(-1) / count
  cur = lambda x: jnp.moveaxis(x, 2, 3).reshape(b, used * ln, grp)[..., None]

  seg = segment_ids(used * ln, ln)[:, None, None]  # (T', 1, 1)
  idx = jnp.arange(used)
  r_mu = jnp.where(idx == seg, cur(cur_mu), jnp.where(idx < seg, fin_mu, 0.0))
  second = jnp.where(idx == seg, cur(cur_2), jnp.where(idx < seg, fin_2, 0.0))
  r_sigma = second - r_mu ** 2
  widen = lambda x: jnp.pad(x[:, :t], [(0, 0), (0, 0), (0, 0), (0, n - used)])
  return widen(r_mu), widen(r_sigma)


def _quadratic_forms(q, m):
  """q_t^T M_i q_t, (B, T, G, N), for queries q (B, T, G, R) and matrices M (B, N, G, R, R).

  The product q_t^T M_i, (B, T, G, N, R), is formed a block of queries at a time: at most
  ``BLOCK_ELEMENTS`` of it a block (at least one token), the blocks one after another, each under
  ``jax.checkpoint`` so that the backward recomputes a block's product instead of keeping every
  block's. Memory is that one block plus O(B T G (N + R)) for the queries and the results. When
  the whole product fits in one block it is a single einsum.
  """
  b, t, grp, r = q.shape
  n = m.shape[1]
  form = lambda qs: jnp.einsum("btgiq,btgq->btgi", jnp.einsum("btgr,bigrq->btgiq", qs, m), qs)
  size = max(1, BLOCK_ELEMENTS // (b * grp * n * r))  # query tokens a block
  if size >= t:
    return form(q)
  num = -(-t // size)
  size = -(-t // num)  # the same number of blocks, the least padding
  qs = jnp.pad(q, [(0, 0), (0, num * size - t), (0, 0), (0, 0)]).reshape(b, num, size, grp, r)
  out = jax.lax.map(jax.checkpoint(form), jnp.moveaxis(qs, 1, 0))  # (num, B, size, G, N)
  return jnp.moveaxis(out, 0, 1).reshape(b, num * size, grp, n)[:, :t]
