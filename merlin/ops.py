"""The public multi-state op: one function, a scan oracle, a chunk-parallel form and Pallas kernels
of the same math; which one runs is ``merlin.pallas.plan.resolve``'s decision."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from merlin.chunked import multistate_chunked, multistate_chunked_documents
from merlin.pallas import plan as plan_lib
from merlin.scan import multistate_scan
from merlin.segments import check_segments, document_segments, document_visible, visible
from triadic.ops import check_array, check_log_decay, check_segment_ids, clamp_log_decay

IMPLS = ("auto", "scan", "chunked", "pallas")


def validate(q, k, v, g, beta, lam, segment_len, impl, chunk_size):
  """Raise a TypeError / ValueError naming the argument and what was expected; return
  (B, T, H, D, V, N)."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  for name, x, rank, what in (("q", q, 4, "(B, T, H, D)"), ("k", k, 4, "(B, T, H, D)"),
                              ("v", v, 4, "(B, T, H, V)"), ("g", g, 3, "(B, T, H)"),
                              ("beta", beta, 3, "(B, T, H)"), ("lam", lam, 4, "(B, T, H, N)")):
    check_array(name, x, rank, what)
  b, t, h, d = q.shape
  vdim, n = v.shape[-1], lam.shape[-1]
  for name, x, want, what in (("k", k, (b, t, h, d), "(B, T, H, D)"),
                              ("v", v, (b, t, h, vdim), "(B, T, H, V)"),
                              ("g", g, (b, t, h), "(B, T, H)"), ("beta", beta, (b, t, h), "(B, T, H)"),
                              ("lam", lam, (b, t, h, n), "(B, T, H, N)")):
    if x.shape != want:
      raise ValueError(f"{name} must have shape {what} = {want} to match q {q.shape}, got {x.shape}")
  check_segments(t, segment_len, n, "lam.shape[-1] (N, the number of segment states)")
  if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1
                                 or segment_len % chunk_size):
    raise ValueError(f"chunk_size must be a positive int dividing segment_len = {segment_len}, "
                     f"got {chunk_size!r}")
  check_log_decay(g)  # concrete g only (NumPy, so also inside a trace)
  return b, t, h, d, vdim, n


def multistate_attention(q, k, v, g, beta, lam, *, segment_len: int, erase: bool = True,
                         scale: float | None = None, impl: str = "auto", chunk_size: int | None = None,
                         segment_ids=None, platform: str | None = None, config=None):
  """Multi-state gated linear attention (docs/spec.md section 2).

  Segment i = t // segment_len owns state S^i; every state decays (and is erased, if ``erase``)
  at every token, only the current segment's is written, and the output reads all visible states
  weighted by ``lam``. With lam = 1 this is Gated DeltaNet (erase) or Mamba-2 / linear attention.

  Args:
    q, k: (B, T, H, D) query and key.
    v: (B, T, H, V) value.
    g: (B, T, H) log decay, <= 0 (-inf: a reset; the chunked form clamps it as ``triadic_gdn``
      does; NaN is an error on concrete inputs).
    beta: (B, T, H) write strength (1 for Mamba-2).
    lam: (B, T, H, N) segment weights from an aggregator; entries for i > t // segment_len are
      ignored. N >= ceil(T / segment_len) is required.
    segment_len: tokens per segment, L.
    erase: True for multi-state Gated DeltaNet, False for multi-state Mamba-2 / linear attention.
    scale: output scale, default D ** -0.5.
    impl: "scan" (per-token oracle), "chunked" (chunk-parallel JAX), "pallas" (the state work in
      Pallas kernels, ``merlin.pallas``) or "auto" ("pallas" on GPU where the kernels take the
      sizes, else "chunked"; ``merlin.pallas.plan.resolve`` decides and says why).
    chunk_size: chunk length C of the chunked and Pallas forms; must divide segment_len (Pallas:
      16, 32, 64 or 128). Default gcd(segment_len, 64).
    segment_ids: (B, T) int, the document of each token (packed rows). Each row then behaves
      exactly as if each of its documents were its own row: every state is zero at a change of
      id, segments are counted from the document's start (s(t) = (t - start) // L) and lam's index
      i is relative to that document. Runs in the chunked form under "auto".
    platform: the kernels' platform for impl="pallas" ("gpu" Triton, "tpu" Mosaic TPU, "cpu"
      interpret mode); default from ``jax.default_backend()``.
    config: the kernels' launch ``triadic.pallas.common.Config`` (tiles, warps) where the plan
      runs them; default ``merlin.pallas.plan.default_config`` for the platform.

  Returns:
    o (B, T, H, V) in q's dtype.
  """
  b, t, _, d, _, n = validate(q, k, v, g, beta, lam, segment_len, impl, chunk_size)
  plan = plan_lib.resolve(impl, d=d, segment_len=segment_len, chunk_size=chunk_size,
                          documents=segment_ids is not None, platform=platform, config=config)
  scale = d ** -0.5 if scale is None else scale
  if segment_ids is None:
    mask = visible(t, segment_len, n)[:, None, :]
  else:
    check_segment_ids(segment_ids, b, t)
    mask = document_visible(document_segments(segment_ids, segment_len)[0], n)[:, :, None, :]
  lam = jnp.where(mask, lam.astype(jnp.float32), 0.0)
  # Materialise lam: XLA:CPU otherwise fuses the aggregator's softmax into the chunk relayout and
  # recomputes it there (orders of magnitude slower at long T).
  lam = jax.lax.optimization_barrier(lam)
  if plan.impl == "scan":
    o = multistate_scan(q, k, v, g, beta, lam, segment_len=segment_len, scale=scale, erase=erase,
                        doc_ids=segment_ids)
  elif plan.impl == "pallas":
    from merlin.pallas.ops import multistate_pallas
    o = multistate_pallas(q, k, v, clamp_log_decay(g), beta, lam, segment_len=segment_len,
                          scale=scale, erase=erase, chunk_size=plan.chunk_size, config=plan.config)
  elif segment_ids is None:
    o = multistate_chunked(q, k, v, clamp_log_decay(g), beta, lam, segment_len=segment_len,
                           scale=scale, erase=erase, chunk_size=plan.chunk_size)
  else:
    o = multistate_chunked_documents(q, k, v, clamp_log_decay(g), beta, lam, segment_ids,
                                     segment_len=segment_len, scale=scale, erase=erase,
                                     chunk_size=plan.chunk_size)
  return o.astype(q.dtype)
