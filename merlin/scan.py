"""The per-token recurrence of multi-state linear attention (docs/spec.md section 2): the oracle.

Per batch row and head, a stack of N states S^i (D, V), all zero at the start. For each token t:

    S^i    <- exp(g_t) S^i                          every state
    S^i    <- S^i - beta_t k_t (k_t^T S^i)          every state, if erase
    S^s(t) <- S^s(t) + beta_t k_t v_t^T             only the current segment's state
    o_t     = scale sum_{i <= s(t)} lam_ti (S^i)^T q_t
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from merlin.segments import document_segments, segment_ids


def token_step(states, q, k, v, g, beta, lam, owner, *, scale: float, erase: bool, keep=None):
  """One token, float32: states (B,H,N,D,V); q, k (B,H,D); v (B,H,V); g, beta (B,H); lam (B,H,N),
  zero for segments the token may not read; owner (N,) or (B, N) one-hot of the token's segment;
  keep (B,) or None: 0 where the token starts a new document (every state is zeroed first).
  Returns (o (B,H,V), new states). The scan runs it over T; decoding runs it once per token."""
  if keep is not None:
    states = states * keep[:, None, None, None, None]
  states = states * jnp.exp(g)[..., None, None, None]
  if erase:
    read = jnp.einsum("bhd,bhndv->bhnv", k, states)
    states = states - jnp.einsum("bh,bhd,bhnv->bhndv", beta, k, read)
  write = jnp.einsum("bh,bhd,bhv->bhdv", beta, k, v)
  owner = jnp.broadcast_to(owner, lam.shape[:1] + owner.shape[-1:])  # (B, N)
  states = states + owner[:, None, :, None, None] * write[:, :, None]
  o = scale * jnp.einsum("bhn,bhd,bhndv->bhv", lam, q, states)
  return o, states


def multistate_scan(q, k, v, g, beta, lam, *, segment_len: int, scale: float, erase: bool,
                    doc_ids=None):
  """``jax.lax.scan`` over tokens carrying the (B, H, N, D, V) stack, float32 throughout.

  ``lam`` must already be zero for i > s(t). ``doc_ids`` (B, T) (``merlin.multistate_attention``'s
  segment_ids): segments counted from each document's start, every state zeroed at a new document.
  Returns o (B, T, H, V) float32.
  """
  b, t, h, d = q.shape
  n, vdim = lam.shape[-1], v.shape[-1]
  time_major = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)
  if doc_ids is None:
    owner = jax.nn.one_hot(segment_ids(t, segment_len), n, dtype=jnp.float32)  # (T, N)
    keep = jnp.ones((t, b), jnp.float32)
  else:
    seg, starts = document_segments(doc_ids, segment_len)
    owner = time_major(jax.nn.one_hot(seg, n, dtype=jnp.float32))  # (T, B, N)
    keep = time_major(~starts)
  xs = tuple(map(time_major, (q, k, v, g, beta, lam))) + (owner, keep)

  def step(states, x):
    *x, keep_t = x
    o, states = token_step(states, *x, scale=scale, erase=erase, keep=keep_t)
    return states, o

  init = jnp.zeros((b, h, n, d, vdim), jnp.float32)
  _, o = jax.lax.scan(step, init, xs)
  return jnp.moveaxis(o, 0, 1)
