"""Segment bookkeeping shared by the ops and the aggregators: which segment owns token t, which
segment states token t may read, and the checks that go with them."""

from __future__ import annotations

import jax.numpy as jnp


def num_segments_needed(t: int, segment_len: int) -> int:
  """How many segments T tokens occupy: ceil(T / L)."""
  return -(-t // segment_len)


def check_segments(t: int, segment_len, max_segments: int, what: str) -> None:
  """ValueError unless segment_len is a positive int and T <= max_segments * segment_len."""
  if not isinstance(segment_len, int) or segment_len < 1:
    raise ValueError(f"segment_len must be a positive int, got {segment_len!r}")
  if not isinstance(max_segments, int) or max_segments < 1:
    raise ValueError(f"{what} must be a positive int, got {max_segments!r}")
  if t > max_segments * segment_len:
    raise ValueError(
        f"T = {t} tokens need {num_segments_needed(t, segment_len)} segments of segment_len = "
        f"{segment_len}, but {what} = {max_segments}: T must be <= {what} * segment_len = "
        f"{max_segments * segment_len}")


def segment_ids(t: int, segment_len: int) -> jnp.ndarray:
  """s(t) = t // L for t = 0..T-1, int32 (T,)."""
  return jnp.arange(t, dtype=jnp.int32) // segment_len


def visible(t: int, segment_len: int, n: int) -> jnp.ndarray:
  """(T, N) bool: segment i is readable by token t iff i <= s(t)."""
  return jnp.arange(n)[None, :] <= segment_ids(t, segment_len)[:, None]


def document_segments(doc_ids: jnp.ndarray, segment_len: int):
  """Segments counted from each document's start, for packed rows with document ids (B, T).

  Returns (seg, starts): seg (B, T) int32 = (t - start of t's document) // L, and starts (B, T)
  bool, true where a token opens a new document (never at t = 0; ``triadic.ops.document_starts``).
  """
  from triadic.ops import document_positions, document_starts
  return document_positions(doc_ids) // segment_len, document_starts(doc_ids)


def document_visible(seg: jnp.ndarray, n: int) -> jnp.ndarray:
  """(B, T, N) bool: segment i of a token's own document is readable iff i <= seg (B, T)."""
  return jnp.arange(n)[None, None, :] <= seg[..., None]
