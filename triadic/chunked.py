"""The chunk-parallel triadic gated delta rule in plain JAX (docs/spec.md section 1, "The chunked form").

Tokens are cut into chunks of C. Inside a chunk everything is parallel (matmuls over C x C), and
only the state S (E, D, V) is passed from chunk to chunk by a `lax.scan`. Per chunk, with gc the
chunk-local inclusive cumulative sum of g (C, E):

  decay_tse = exp(gc_te - gc_se)                    s <= t, (C, C, E): the only E-dependent masks
  M_ts      = sum_e k2_te k2_se decay_tse           what token t's joint key reads of token s's write
  M'_ts     = sum_e q2_te k2_se decay_tse           what query t reads of token s's write
  A         = (I + StrictLower(beta_t (k_t . k_s) M_ts))^-1          the UT transform
  U         = A (beta (V - W S0)),  W_t = k2_t exp(gc_t) (x) k_t      corrected values
  o_t       = scale [ (q2_t exp(gc_t) (x) q_t) . S0 + sum_{s<=t} (q_t . k_s) M'_ts U_s ]
  S_e      <- exp(gc_Ce) S_e0 + sum_t k2_te exp(gc_Ce - gc_te) k_t U_t^T

The joint key k2 (x) k is never formed for C x C products: (q (x) q2)^T diag(decay) (k (x) k2) =
(q . k) (q2^T diag(decay) k2), so the masks cost C^2 (D + E). It is formed (C, E*D) only where it
meets the state, which is a (C, E*D) x (E*D, V) matmul either way.

Numerics: the decay masks are computed as exponentials of differences gc_t - gc_s with s <= t (and
gc_C - gc_t, gc_t), all <= 0, never as a product exp(gc_t) exp(-gc_s); the upper triangle is
masked before the exponential. So any g <= 0 (even -30 per token) gives no inf and no NaN, in the
forward and in the gradients. Everything is float32.

Memory: `jax.lax.scan` over chunks with a rematerialised body keeps only the chunk-start states
(T / C of them) and per-token (C, E*D) keys for the backward, never per-token states.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp


def to_chunks(x: jax.Array, n: int, c: int) -> jax.Array:
  """(B, T, H, ...) -> (B, H, n, C, ...) float32, zero-padded at the end of T."""
  x = x.astype(jnp.float32)
  pad = n * c - x.shape[1]
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape(x.shape[0], n, c, *x.shape[2:])
  return jnp.moveaxis(x, 3, 1)


def chunk_masks(gc: jax.Array, k2: jax.Array, q2: jax.Array):
  """Decay-weighted second-key masks of a chunk: (M, M'), each (..., C, C), zero above the diagonal.

  gc, k2, q2: (..., C, E). The upper triangle is masked before the exponential (double `where`),
  so its positive differences never overflow and never poison the gradient. This is the
  definition, elementwise over (C, C, E); ``sub_chunk_masks`` computes the same numbers.
  """
  c = gc.shape[-2]
  causal = jnp.tril(jnp.ones((c, c), bool))[..., None]  # (t, s, 1)
  diff = gc[..., :, None, :] - gc[..., None, :, :]  # (..., t, s, E), <= 0 where s <= t
  decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
  m = jnp.einsum("...te,...se,...tse->...ts", k2, k2, decay)
  mq = jnp.einsum("...te,...se,...tse->...ts", q2, k2, decay)
  return m, mq


SUB_CHUNK = 16  # sub-chunk of ``sub_chunk_masks``: elementwise inside, matmuls across


def sub_chunk_masks(gc: jax.Array, k2: jax.Array, q2: jax.Array, sub: int = SUB_CHUNK):
  """``chunk_masks`` by secondary chunking (GLA's trick, as FLA's KDA does for per-channel decay).

  Cut the chunk into sub-chunks of ``sub`` tokens. Within a sub-chunk (the diagonal blocks) the
  masks are the elementwise definition. Across, for t in sub-chunk i >= 1 and s before it, the
  decay factorises through the anchor n_i = i * sub - 1 (the token just before sub-chunk i), with
  s <= n_i < t, so both exponents are <= 0 (no overflow for any g <= 0):

    exp(gc_te - gc_se) = exp(gc_te - gc_{n_i} e) exp(gc_{n_i} e - gc_se)
    M[i, :i*sub] = (k2 * exp(gc - gc_{n_i}))_i  @  (k2 * exp(gc_{n_i} - gc))[:i*sub]^T

  a matmul contracting over E. So a chunk costs C * sub * E exponentials plus (C / sub) C E ones
  for the factors, instead of C^2 E, and the backward (autodiff) is matmuls too, with nothing of
  size C^2 E kept for it. Falls back to the definition when C is not a multiple of ``sub`` or is
  at most ``sub``. Agrees with ``chunk_masks`` to float32 rounding (tests: strong and weak decay,
  forward and gradients).

  Not the default of ``triadic_chunked``: on the 2-core CPU, forward+backward of the whole op
  ranged from 0.85x to 1.4x the definition's speed over E = 1..16 (benchmarks/RESULTS.md), since
  the state matmuls dominate there. The Pallas op forms its masks by the definition (by
  sub-chunks they measured slower on the H200: benchmarks/RESULTS.md).
  """
  c, e = gc.shape[-2:]
  if c % sub or c <= sub:
    return chunk_masks(gc, k2, q2)
  nb, lead = c // sub, gc.shape[:-2]
  blocks = lambda x: x.reshape(*lead, nb, sub, e)
  gb, k2b, q2b = blocks(gc), blocks(k2), blocks(q2)
  m_diag, mq_diag = chunk_masks(gb, k2b, q2b)                     # (..., nb, sub, sub)
  anchor = gc[..., sub - 1:c - 1:sub, :]                          # (..., nb - 1, E): n_1, n_2, ..
  rows = jnp.exp(gb[..., 1:, :, :] - anchor[..., :, None, :])     # (..., nb - 1, sub, E), t > n_i
  before = jnp.arange(c)[None, :, None] < sub * jnp.arange(1, nb)[:, None, None]  # s <= n_i
  diff = anchor[..., :, None, :] - gc[..., None, :, :]            # (..., nb - 1, C, E)
  cols = k2[..., None, :, :] * jnp.where(before, jnp.exp(jnp.where(before, diff, 0.0)), 0.0)
  off_m = jnp.einsum("...ite,...ise->...its", k2b[..., 1:, :, :] * rows, cols)
  off_mq = jnp.einsum("...ite,...ise->...its", q2b[..., 1:, :, :] * rows, cols)

  def assemble(diag, off):  # diagonal blocks in place, then the rows of sub-chunks 1.. get off
    eye = jnp.eye(nb, dtype=diag.dtype)
    full = jnp.einsum("...its,ij->...itjs", diag, eye).reshape(*lead, nb, sub, c)
    return full.at[..., 1:, :, :].add(off).reshape(*lead, c, c)

  return assemble(m_diag, off_m), assemble(mq_diag, off_mq)


_BASE = 16  # diagonal blocks inverted by row substitution; larger blocks are merged by matmuls


def _diag_blocks(x: jax.Array, size: int) -> jax.Array:
  """The diagonal (size x size) blocks of x (..., n, n), as (..., n / size, size, size)."""
  m = x.shape[-1] // size
  x = x.reshape(*x.shape[:-2], m, size, m, size)
  return jnp.moveaxis(jnp.diagonal(x, axis1=-4, axis2=-2), -1, -3)


@jax.custom_vjp
def unit_lower_inverse(lower: jax.Array) -> jax.Array:
  """(I + L)^-1 for strictly lower-triangular L (..., C, C): blocked forward substitution.

  Diagonal 16 x 16 blocks are inverted by substitution over their rows (15 steps, all blocks at
  once); then pairs of inverted blocks merge, [[A11, 0], [A21, A22]] with A21 = -A22 L21 A11, up to
  C (log2(C / 16) levels of matmuls). Every step is substitution, so it is as accurate as a
  triangular solve. Why not the alternatives: `jax.scipy.linalg.solve_triangular` deadlocks on
  jaxlib 0.10's CPU runtime when two solves run at once (LAPACK trsm FFI, seen in training steps
  on a 2-core machine), and the all-matmul doubling product (I - L)(I + L^2)(I + L^4)... loses every
  digit in float32 when keys in a chunk are aligned (|L_ts| -> 1: L^32 reaches 1e16 at C = 64).
  """
  c = lower.shape[-1]
  n = max(1, 1 << (c - 1).bit_length())  # a power of two; zero padding of L is exact
  base = min(n, _BASE)
  padded = jnp.pad(lower, [(0, 0)] * (lower.ndim - 2) + [(0, n - c), (0, n - c)])
  blocks = _diag_blocks(padded, base)
  eye = jnp.broadcast_to(jnp.eye(base, dtype=lower.dtype), blocks.shape)

  def row(t, inv):  # row t of A = I - L A needs only rows s < t, which are final
    new = eye[..., t, :] - jnp.einsum("...s,...sc->...c", blocks[..., t, :], inv)
    return inv.at[..., t, :].set(new)

  inv = jax.lax.fori_loop(1, base, row, eye)
  size = base
  while size < n:
    l21 = _diag_blocks(padded, 2 * size)[..., size:, :size]
    a11, a22 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
    a21 = -jnp.einsum("...ij,...jk,...kl->...il", a22, l21, a11)
    top = jnp.concatenate([a11, jnp.zeros_like(a11)], axis=-1)
    inv = jnp.concatenate([top, jnp.concatenate([a21, a22], axis=-1)], axis=-2)
    size *= 2
  return inv[..., 0, :c, :c]


def _unit_lower_inverse_fwd(lower):
  inv = unit_lower_inverse(lower)
  return inv, inv


def _unit_lower_inverse_bwd(inv, d_inv):
  """d(A)/d(L) for A = (I + L)^-1: dL = -A^T dA A^T, kept on the strict lower triangle."""
  c = inv.shape[-1]
  grad = -jnp.einsum("...ts,...tu,...vu->...sv", inv, d_inv, inv)
  return (jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), grad, 0.0),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def joint(k2w: jax.Array, k: jax.Array) -> jax.Array:
  """Joint key k2 (x) k flattened e-major: (..., C, E) x (..., C, D) -> (..., C, E*D)."""
  out = k2w[..., :, None] * k[..., None, :]
  return out.reshape(*out.shape[:-2], -1)


def triadic_chunked(q, k, v, k2, q2, g, beta, *, scale: float, initial_state: jax.Array,
                    erase: bool, chunk_size: int, sub_chunk: int | None = None):
  """Chunk-parallel triadic gated delta rule. Shapes and result as ``triadic.triadic_gdn``.

  sub_chunk: None (``triadic_gdn``'s choice): the masks by their elementwise definition
  (``chunk_masks``); an int: by ``sub_chunk_masks`` with sub-chunks of that many tokens (the same
  numbers; on the CPU no faster at these sizes, benchmarks/RESULTS.md)."""
  b, t, h, d = q.shape
  vdim, e = v.shape[-1], k2.shape[-1]
  c = max(1, min(chunk_size, t))
  n = -(-t // c)
  # Padded tokens have k = k2 = q = q2 = v = beta = 0 and g = 0: they leave the state unchanged.
  q, k, v, k2, q2, g = (to_chunks(x, n, c) for x in (q, k, v, k2, q2, g))
  beta = to_chunks(beta, n, c)

  gc = jnp.cumsum(g, axis=-2)  # (B, H, n, C, E), chunk-local, non-increasing, <= 0
  m, mq = chunk_masks(gc, k2, q2) if sub_chunk is None else sub_chunk_masks(gc, k2, q2, sub_chunk)
  # Inter-chunk factors: every exponent is <= 0.
  w_read = joint(k2 * jnp.exp(gc), k)  # (.., C, E*D) reads S0 at token t (after its decay)
  q_read = joint(q2 * jnp.exp(gc), q)  # (.., C, E*D) query of S0
  k_write = joint(k2 * jnp.exp(gc[..., -1:, :] - gc), k)  # (.., C, E*D) write, decayed to chunk end
  chunk_decay = jnp.exp(gc[..., -1, :])  # (B, H, n, E)

  u_part = beta[..., None] * v
  if erase:
    tril_strict = jnp.tril(jnp.ones((c, c), bool), -1)
    kk = jnp.einsum("...td,...sd->...ts", k, k)
    ut = unit_lower_inverse(jnp.where(tril_strict, beta[..., None] * kk * m, 0.0))
    rhs = jnp.concatenate([u_part, beta[..., None] * w_read], axis=-1)
    sol = jnp.einsum("...ts,...sx->...tx", ut, rhs)
    u_part, w_part = sol[..., :vdim], sol[..., vdim:]  # U = u_part - w_part S0 (WY form)
  else:
    w_part = None  # U = beta V: no dependence on the state

  intra = jnp.einsum("...td,...sd->...ts", q, k) * mq  # (q_t . k_s) M'_ts, lower triangular

  def step(state, xs):
    """One chunk: corrected values U from the chunk-start state, then the state at chunk end."""
    u_c, w_c, kw_c, dec_c = xs
    flat = state.reshape(b, h, e * d, vdim)
    u = u_c if w_c is None else u_c - jnp.einsum("bhcx,bhxv->bhcv", w_c, flat)
    new = dec_c[..., None, None] * state + jnp.einsum(
        "bhcx,bhcv->bhxv", kw_c, u).reshape(b, h, e, d, vdim)
    return new, (u, state)

  lead = lambda x: None if x is None else jnp.moveaxis(x, 2, 0)
  final_state, (u, starts) = jax.lax.scan(
      jax.checkpoint(step), initial_state.astype(jnp.float32),
      (lead(u_part), lead(w_part), lead(k_write), lead(chunk_decay)))
  u, starts = jnp.moveaxis(u, 0, 2), jnp.moveaxis(starts, 0, 2)  # (B,H,n,C,V), (B,H,n,E,D,V)

  o = jnp.einsum("bhncx,bhnxv->bhncv", q_read, starts.reshape(b, h, n, e * d, vdim))
  o = scale * (o + jnp.einsum("bhnts,bhnsv->bhntv", intra, u))
  o = jnp.moveaxis(o, 1, 3).reshape(b, n * c, h, vdim)[:, :t]
  return o, final_state
