"""The public triadic op: one function, several implementations of the same mathematics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from triadic.scan import token_step, triadic_scan

IMPLS = ("auto", "scan", "chunked", "pallas")

# The chunk-parallel forms clamp g from below to this: exp(-30) ~ 1e-13 is far below float32
# resolution (a state reset, like exp(-inf) = 0 in the scan), and chunk-local cumulative sums of
# it stay finite, so their differences never become inf - inf = NaN.
G_FLOOR = -30.0
# The log decay that stands for a document reset (``reset_decay``): the floor itself, so every
# impl sees the same value. The decayed state is zero to float32 rounding, while chunk-local
# cumulative sums that include it (magnitude ~30 per reset) keep the small per-token differences
# to ~30 * 6e-8 absolute error per reset in the chunk (tests/test_documents.py measures it).
RESET = G_FLOOR


def check_array(name, x, rank, what, *, floating=True):
  """TypeError unless ``x`` is an array (of a floating dtype); ValueError unless it has ``rank``
  and no empty axis. ``what`` spells the expected shape, e.g. "(B, T, H, D)"."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray) of shape {what}, got "
                    f"{type(x).__name__}")
  if floating and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype (float32, bfloat16, ...), got {x.dtype}")
  if x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} with shape {what}, got shape {x.shape}")
  if 0 in x.shape:
    raise ValueError(f"{name} must have no empty axis, shape {what}, got shape {x.shape}")


def check_log_decay(g, name="g"):
  """ValueError for a concrete ``g`` with a NaN or a positive entry (under jit: not checked)."""
  try:
    values = np.asarray(g)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return
  if np.isnan(values).any():
    raise ValueError(f"{name} is a log decay and must not be NaN ({int(np.isnan(values).sum())} "
                     f"NaN entries)")
  gmax = float(np.max(values))
  if gmax > 0:
    raise ValueError(f"{name} is a log decay and must be <= 0 everywhere, got max({name}) = {gmax}")


def clamp_log_decay(g):
  """max(g, G_FLOOR): -inf (a reset) becomes a finite decay exp(G_FLOOR) ~ 1e-13; the gradient of
  a clamped entry is 0, as the scan's is at -inf."""
  return jnp.maximum(g, jnp.asarray(G_FLOOR, g.dtype))


_SHAPES = {"q": "(B, T, H, D)", "k": "(B, T, H, D)", "v": "(B, T, H, V)", "k2": "(B, T, H, E)",
           "q2": "(B, T, H, E)", "g": "(B, T, H, E)", "beta": "(B, T, H)"}


def validate(q, k, v, k2, q2, g, beta, initial_state, impl, chunk_size, state_name="initial_state",
             step=False):
  """Raise a TypeError / ValueError naming the argument and the expected dtype or shape for any
  bad input. ``step``: the inputs of ``triadic_gdn_step``, shapes without T.

  Returns (B, T, H, D, V, E) (T = 1 for a step). NaN and positive g are checked only for concrete
  arrays (not under jit).
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  drop_t = lambda what: what.replace("T, ", "") if step else what
  args = dict(q=q, k=k, v=v, k2=k2, q2=q2, g=g, beta=beta)
  for name, x in args.items():
    check_array(name, x, (3 if name == "beta" else 4) - step, drop_t(_SHAPES[name]))
  if step:
    b, h, d = q.shape
    t = 1
  else:
    b, t, h, d = q.shape
  vdim = v.shape[-1]
  e = k2.shape[-1]
  bt = (b,) if step else (b, t)
  expected = {"k": bt + (h, d), "v": bt + (h, vdim), "k2": bt + (h, e), "q2": bt + (h, e),
              "g": bt + (h, e), "beta": bt + (h,)}
  dims = f"B={b}, H={h}, D={d}" if step else f"B={b}, T={t}, H={h}, D={d}"
  for name, want in expected.items():
    if args[name].shape != want:
      raise ValueError(
          f"{name} must have shape {drop_t(_SHAPES[name])} = {want} to match q {q.shape} "
          f"({dims}) and k2 (E={e}), got {args[name].shape}")
  if initial_state is not None:
    check_array(state_name, initial_state, 5, "(B, H, E, D, V)")
    if initial_state.shape != (b, h, e, d, vdim):
      raise ValueError(f"{state_name} must have shape (B, H, E, D, V) = {(b, h, e, d, vdim)}, "
                       f"got {initial_state.shape}")
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
  check_log_decay(g)
  return b, t, h, d, vdim, e


def check_segment_ids(segment_ids, b: int, t: int):
  """ValueError/TypeError unless ``segment_ids`` is an integer (B, T) array."""
  check_array("segment_ids", segment_ids, 2, "(B, T)", floating=False)
  if segment_ids.shape != (b, t):
    raise ValueError(f"segment_ids must have shape (B, T) = {(b, t)}, got {segment_ids.shape}")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"segment_ids must be an integer array (document index per token), got dtype "
                    f"{segment_ids.dtype}")


def document_starts(segment_ids: jax.Array) -> jax.Array:
  """(B, T) bool: token t starts a new document (its id differs from token t - 1's); never t = 0,
  whose state is the row's initial state."""
  change = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.pad(change, ((0, 0), (1, 0)))


def document_positions(segment_ids: jax.Array) -> jax.Array:
  """(B, T) int32: each token's position counted from the start of its document (t - the index of
  the document's first token), the positions the token would have if its document were its own row."""
  pos = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
  first = jax.lax.cummax(jnp.where(document_starts(segment_ids), pos, 0), axis=1)
  return pos - first


def reset_decay(g: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """g (B, T, H, E) with RESET at every document start: the state is zeroed before that token
  writes, as if each document were its own row. The gradient of g there is zero, which is the
  true gradient of separate rows (the first token's decay multiplies a zero state)."""
  starts = document_starts(segment_ids)[:, :, None, None]
  return jnp.where(starts, jnp.asarray(RESET, g.dtype), g)


def _auto_impl(d, vdim, chunk_size):
  """Pallas on GPU when the kernels take these sizes; chunked JAX otherwise (CPU runs Pallas only
  in interpret mode, far slower; the TPU kernels are checked to lower, not run)."""
  from triadic.pallas.ops import default_platform, unsupported
  if default_platform() == "gpu" and unsupported(d, vdim, chunk_size) is None:
    return "pallas"
  return "chunked"


def triadic_gdn(q, k, v, k2, q2, g, beta, *, scale=None, initial_state=None, erase=True,
                impl="auto", chunk_size=64, segment_ids=None):
  """Triadic gated delta rule (docs/spec.md section 1).

  Args:
    q, k: (B, T, H, D) query and key.
    v: (B, T, H, V) value.
    k2, q2: (B, T, H, E) second key and query (non-negative in the layer).
    g: (B, T, H, E) per-slice log decay, <= 0 (-inf: a reset; the chunk-parallel forms clamp g
      at G_FLOOR, far below float32 resolution; NaN is an error on concrete inputs).
    beta: (B, T, H) write strength in (0, 1).
    scale: output scale, default D ** -0.5.
    initial_state: (B, H, E, D, V) float32, zeros if None.
    erase: True for the delta rule (Triadic GDN), False for no erase term (Triadic sGLA).
    impl: "scan" (the oracle), "chunked" (chunk-parallel JAX), "pallas" (kernels) or "auto".
    chunk_size: chunk length C of the chunked and Pallas forms.
    segment_ids: (B, T) int, the document of each token (packed rows). Each row then behaves
      exactly as if each of its documents were its own row: the state is zero at every change of
      id, ``initial_state`` applies to the row's first document, and the final state is the state
      after the row's last token. Every impl honours it through ``reset_decay`` (applied here,
      before dispatch).

  Returns:
    o (B, T, H, V) in q's dtype, final_state (B, H, E, D, V) float32.
  """
  b, t, h, d, vdim, e = validate(q, k, v, k2, q2, g, beta, initial_state, impl, chunk_size)
  if segment_ids is not None:
    check_segment_ids(segment_ids, b, t)
    g = reset_decay(g, segment_ids)
  if scale is None:
    scale = d ** -0.5
  if initial_state is None:
    initial_state = jnp.zeros((b, h, e, d, vdim), jnp.float32)
  if impl == "auto":
    impl = _auto_impl(d, vdim, chunk_size)
  if impl == "scan":
    o, state = triadic_scan(q, k, v, k2, q2, g, beta, scale=scale, initial_state=initial_state,
                            erase=erase)
    return o.astype(q.dtype), state
  g = clamp_log_decay(g)  # -inf (a reset) would make the chunked forms' cumsum differences NaN
  if impl == "chunked":
    from triadic.chunked import triadic_chunked
    o, state = triadic_chunked(q, k, v, k2, q2, g, beta, scale=scale, initial_state=initial_state,
                               erase=erase, chunk_size=chunk_size)
  else:
    from triadic.pallas.ops import triadic_pallas
    o, state = triadic_pallas(q, k, v, k2, q2, g, beta, scale=scale, initial_state=initial_state,
                              erase=erase, chunk_size=chunk_size)
  return o.astype(q.dtype), state


def triadic_gdn_step(state, q, k, v, k2, q2, g, beta, *, scale=None, erase=True):
  """One decoding step of ``triadic_gdn``: the same recurrence for a single token, from a carried state.

  Shapes are the op's without T: state (B, H, E, D, V) float32; q, k (B, H, D); v (B, H, V);
  k2, q2, g (B, H, E); beta (B, H). Returns (o (B, H, V) in q's dtype, new state float32). Running it
  over the tokens after ``triadic_gdn(..., )`` returned ``final_state`` continues that sequence exactly.
  """
  if state is None:
    raise TypeError("state must be an array of shape (B, H, E, D, V), got None")
  validate(q, k, v, k2, q2, g, beta, state, "scan", 1, state_name="state", step=True)
  if scale is None:
    scale = q.shape[-1] ** -0.5
  f32 = lambda x: x.astype(jnp.float32)
  o, state = token_step(f32(state), *map(f32, (q, k, v, k2, q2, g, beta)), scale=scale, erase=erase)
  return o.astype(q.dtype), state
