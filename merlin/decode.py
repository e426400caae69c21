"""Recurrent inference for multi-state linear attention: prefill a prompt, then one token at a time.

The decode cache of a multi-state layer holds the N segment states (B, H, N, D, V), the running
segment moments of the aggregator's small keys (sums of k' per segment, and of k' k'^T for
MERLIN, the one aggregator that reads the second moment) and the
number of tokens seen. Segments are uniform, so segment i's count is clip(length - i L, 0, L):
the counts are derived from the length instead of stored. A step then costs the same however
long the context is: no old token is revisited.

- ``multistate_prefill_states``: the final segment states after T tokens, by the chunk-parallel
  (or Pallas) single-state op: S^i(T) is the single-state recurrence run with the values of every
  token outside segment i set to zero (a zero value still decays and, with erase, erases; it writes
  nothing), so all segments run at once as a batch of ceil(T / L) masked copies.
- ``multistate_step``: docs/spec.md section 2's recurrence for one token (the scan oracle's step).
- ``moment_prefill`` / ``moment_step``: the segment sums after T tokens, and one token's update
  with the alignment scores (r_mu, r_sigma) it reads, as ``merlin.moments`` computes them.
- ``multistate_decode``: what ``MultiStateGDN`` / ``MultiStateMamba2`` run on a cached call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from merlin.ops import multistate_attention
from merlin.scan import token_step
from merlin.segments import num_segments_needed, segment_ids
from triadic.ops import triadic_gdn


def multistate_prefill_states(q, k, v, g, beta, *, segment_len: int, num_segments: int,
                              erase: bool, impl: str = "auto", chunk_size: int = 64):
  """Segment states (B, H, N, D, V) float32 after the T tokens of q, k (B, T, H, D), v (B, T, H, V),
  g, beta (B, T, H); zero for segments not yet started. T <= num_segments * segment_len."""
  b, t, h, d = q.shape
  used = num_segments_needed(t, segment_len)
  owner = segment_ids(t, segment_len)[None, :] == jnp.arange(used)[:, None]  # (S, T)
  many = lambda z: jnp.broadcast_to(z, (used,) + z.shape).reshape((used * b,) + z.shape[1:])
  vs = (v.astype(jnp.float32)[None] * owner[:, None, :, None, None]).reshape((used * b,) + v.shape[1:])
  ones = jnp.ones((used * b, t, h, 1), jnp.float32)
  _, state = triadic_gdn(many(q), many(k), vs.astype(v.dtype), ones, ones, many(g[..., None]),
                         many(beta), scale=1.0, erase=erase, impl=impl, chunk_size=chunk_size)
  states = jnp.moveaxis(state[:, :, 0].reshape(used, b, h, d, v.shape[-1]), 0, 2)
  return jnp.pad(states, [(0, 0), (0, 0), (0, num_segments - used), (0, 0), (0, 0)])


def visible_now(position, num_segments: int, segment_len: int):
  """(N,) bool: the segments token ``position`` (traced int) may read, i <= position // L."""
  return jnp.arange(num_segments) <= position // segment_len


def multistate_step(states, q, k, v, g, beta, lam, position, *, segment_len: int, scale: float,
                    erase: bool):
  """One token of multi-state linear attention, float32.

  states (B, H, N, D, V); q, k (B, H, D); v (B, H, V); g, beta (B, H); lam (B, H, N); position:
  the token's index t (traced int). Returns o (B, H, V) and the new states.
  """
  n = states.shape[2]
  f32 = lambda z: z.astype(jnp.float32)
  q, k, v, g, beta = map(f32, (q, k, v, g, beta))
  lam = jnp.where(visible_now(position, n, segment_len), f32(lam), 0.0)
  owner = jax.nn.one_hot(position // segment_len, n, dtype=jnp.float32)
  return token_step(states, q, k, v, g, beta, lam, owner, scale=scale, erase=erase)


def moment_prefill(kr, *, segment_len: int, num_segments: int, squares: bool = True):
  """Segment sums of k' and k' k'^T after the T tokens of kr (B, T, G, R):
  (B, G, N, R) and (B, G, N, R, R) float32 (None without ``squares``)."""
  t = kr.shape[1]
  owner = jax.nn.one_hot(segment_ids(t, segment_len), num_segments, dtype=jnp.float32)  # (T, N)
  kr = kr.astype(jnp.float32)
  sums = jnp.einsum("tn,btgr->bgnr", owner, kr)
  return sums, (jnp.einsum("tn,btgr,btgq->bgnrq", owner, kr, kr) if squares else None)


def moment_step(sums, squares, qr, kr, position, *, segment_len: int):
  """Add token ``position``'s k' (B, G, R) to its segment's sums; return the scores its q' (B, G, R)
  reads, (r_mu, r_sigma) each (B, G, N) (zero for segments not yet started), and the new sums.

  ``squares`` None (meanpool, which reads only r_mu): no second moments are kept, r_sigma is None.
  """
  n = sums.shape[2]
  qr, kr = qr.astype(jnp.float32), kr.astype(jnp.float32)
  owner = jax.nn.one_hot(position // segment_len, n, dtype=jnp.float32)
  sums = sums + owner[:, None] * kr[:, :, None]
  count = jnp.clip(position + 1 - jnp.arange(n) * segment_len, 0, segment_len).astype(jnp.float32)
  inv = jnp.where(count > 0, 1.0 / jnp.maximum(count, 1.0), 0.0)
  r_mu = jnp.einsum("bgr,bgnr->bgn", qr, sums) * inv
  if squares is None:
    return (r_mu, None), (sums, None)
  squares = squares + owner[:, None, None] * (kr[..., :, None] * kr[..., None, :])[:, :, None]
  second = jnp.einsum("bgr,bgnrs,bgs->bgn", qr, squares, qr) * inv
  return (r_mu, second - r_mu ** 2), (sums, squares)


def multistate_decode(layer, q, k, v, g, beta, lam, moments, cache, *, erase, scale):
  """The recurrent side of a multi-state layer's cached call (``layer``: its segment_len,
  max_segments, chunk_size, impl): prefill (T > 1, from an empty cache) or one step (T = 1).

  q, k (B, T, H, D); v (B, T, H, V); g, beta (B, T, H); lam (B, T, H, N) and the new moments, what
  the aggregator returned. Returns (o (B, T, H, V), the cache's new state, moments, length).
  """
  t, length = q.shape[1], cache["length"]
  capacity = layer.segment_len * layer.max_segments
  if not isinstance(length, jax.core.Tracer) and int(length) + t > capacity:
    raise ValueError(f"the cache holds {int(length)} tokens and {t} more exceed the layer's "
                     f"capacity segment_len * max_segments = {capacity}")
  if t == 1:
    o, state = multistate_step(cache["state"], *(z[:, 0] for z in (q, k, v, g, beta, lam)), length,
                               segment_len=layer.segment_len, scale=scale, erase=erase)
    o = o[:, None].astype(q.dtype)
  else:
    if not isinstance(length, jax.core.Tracer) and int(length) != 0:
      raise ValueError(f"a multi-state prefill must start the sequence (cache length 0), got "
                       f"length {int(length)}; continue with one-token steps instead")
    chunk = min(layer.chunk_size, layer.segment_len)
    o = multistate_attention(q, k, v, g, beta, lam, segment_len=layer.segment_len, erase=erase,
                             scale=scale, impl=layer.impl, chunk_size=chunk)
    state = multistate_prefill_states(q, k, v, g, beta, segment_len=layer.segment_len,
                                      num_segments=layer.max_segments, erase=erase,
                                      impl=layer.impl, chunk_size=chunk)
  return o, {"state": state, "moments": moments, "length": length + t}
