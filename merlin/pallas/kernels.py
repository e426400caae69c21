"""The Triton Pallas kernels of multi-state linear attention's state work (docs/spec.md section 2).
``tpu.py`` runs the same stages in the TPU structure.

Per (batch*head), chunk n of C tokens and segment state i, from the chunk prep
(``merlin.chunked.intra_chunk`` in plain JAX, or its forward kernel, ``intra.py``): Qe_n, W_n,
Kw_n (C, D), Uv_n (C, V), the chunk decay gamma_n = exp(gc_C) and lam_n,i (C, 1). State i is
zero before its segment's first chunk n_i = i cps (cps = chunks per segment), is written during
its cps chunks (up to e_i) and only carried after:

    S_{n+1}^i = gamma_n S_n^i - Kw_n^T (W_n S_n^i) + [n < e_i] Kw_n^T Uv_n     (W = 0: no erase)
    o_n      += (lam_n,i Qe_n) S_n^i                                            (every i <= s(n))

Each state carries through its own chain of chunks, independent of the others, so the state
passes put the segment index on the grid: program (bh, value block j, segment i) walks segment i's
chunks with the (D, block_v) float32 state S^i in registers (or a group of consecutive
segments' states, ``Config.forward_states`` / ``reverse_states``, which then read each later
span's operands once for the group). The readout is parallel over chunks:
o_n = sum_{i <= s(n)} (lam_n,i Qe_n) S_n^i, the (C, (s(n)+1) D) x ((s(n)+1) D, V) product over the
stacked states, walked state by state (``_read``; a program takes a group of a span's chunks,
``Config.read_chunks``, and loads each state once for them). It stores the op's output, not o:
scale (o_n + own_n intra_n) with the intra-chunk part intra_n = P_n Uv_n and own_n the
tokens' lam of their own segment (float32), rounded once to the input dtype and written straight
into the caller's (B, T, H, V) layout (``_readout_call``).

Erase (the span form): a finished state keeps changing, by the same chunk maps
T_m = gamma_m I - Kw_m^T W_m for every finished state. Span s is segment s's chunks b .. b' - 1;
across it S_n^i = Phi_n S_b^i for every i < s, with Phi_n = T_{n-1} ... T_b (Phi_b = I) and the
span map U_s = Phi_{b'}. ``span_maps`` forms Phi_n, the walked queries P_n = Qe_n Phi_n and U_s
(program (bh, span), Phi in registers). The state pass writes S^i through its own segment chunk by
chunk (each chunk's start state, ``cur``), then crosses each later span j in one product,
S_{b'}^i = U_j S_b^i, storing the finished states only at span starts: the span stack,
NS (NS - 1) / 2 states (``span_index``), where every visible chunk-start state would be
sum_i (NC - n_i), cps times as many. The readout reads them with the walked query:
o_n = sum_{i < s} (lam_n,i P_n) S_b^i + (lam_n,s Qe_n) S_n^s.

Backward, with dS^i_{n+1} the gradient of the state leaving chunk n:

    dS_n^i  = gamma_n dS^i_{n+1} - W_n^T (Kw_n dS^i_{n+1}) + (lam_n,i Qe_n)^T dO_n
    dUv_n   = Kw_n dS^{s(n)}_{n+1}
    dQe_n   = sum_i lam_n,i (dO_n S_n^iT)          dlam_n,i = rowsum(dO_n * (Qe_n S_n^i))
    dKw_n   = Uv_n dS^{s(n)T}_{n+1} - W_n G_n^T     dW_n = -Kw_n G_n     dgamma_n = trace(G_n)
    G_n     = sum_i dS^i_{n+1} S_n^iT   (D, D)

(W_n and Kw_n are the same for every state i, so the erase terms' sums over i collapse into G_n.)
Across a later span the reverse pass takes one step, dS_b^i = U_j^T dS_{b'}^i
+ sum_n (lam_n,i P_n)^T dO_n, and stores the finished states' gradients only at span ends
(dS_{b'}^i, beside S_b^i in the same layout), its own segment chunk by chunk (``dcur``, dUv). For
the finished states, with Y_n = sum_{i < s} (lam_n,i dO_n) S_b^iT (C, D) and
K = sum_{i < s} dS_{b'}^i S_b^iT (D, D),

    dQe_n = Y_n Phi_n^T,   G_n = L_n Phi_n^T,   L_{b'-1} = K,   L_{n-1} = T_n^T L_n + Qe_n^T Y_n

(the reverse recurrence of dS_{n+1}^i with S_b^iT summed in): the finished-reads kernel, one
program per (batch*head, group of a span's chunks), reads each of the span's S_b^i once to form
Z = dO_n S_b^iT, which gives both Y_n and dlam; the chunk-gradients kernel, one program per
(batch*head, chunk), forms dQe and the own state's part of every gradient; the span-sums kernel,
one program per (batch*head, span), forms K from the stacks and runs L back through the span,
finishing dW, dKw and dgamma. No two programs write one output (no atomics). dUv, dQe, dW and
dKw are summed in float32 and stored in the input dtype: they leave the op as the cotangents of
operands in that dtype, so a float32 store would only be cast after (dgamma, dlam stay float32,
as their operands are).

Erase, forward only (the query walk, ``Config.query_walk``): as S_n^i = Phi_n U_{s-1} ... U_{i+1}
S_end^i, the read can move the query instead of the states:

    o_n = (lam_n,s Qe_n) S_n^s + sum_{j < s} (lam_n,j p_j) S_end^j,   p_{j-1} = p_j U_j

from p_{s-1} = P_n (lam a row scale, which commutes with the right products). ``write_pass`` with
W gives each chunk's current state and each segment's end state, as in the no-erase case; no
stack is stored. The backward pairs the states with their gradients (K, Y above), so a
differentiated call runs the span form's forward instead.

No erase (rescaled states): a finished state only decays, S_n^i = F_n,i S_end^i with
F_n,i = prod_{e_i <= m < n} gamma_m, so its contribution to every later token is a read of the one
end state S_end^i with the weight lam_n,i F_n,i, which ``ops.py`` folds into lam (plain JAX, so
its gradient to g is JAX's). The write pass stores only the current state of each chunk (NC of
them) and each segment's end state (NS): no per-chunk update or store of a finished state.
Backward: dS_end^i = sum_{n >= e_i} (lam_n,i Qe_n)^T dO_n, then segment i's write phase in
reverse (dUv in the input dtype, and dKw_n = Uv_n dS_{n+1}^T, dgamma_n = <dS_{n+1}, S_n> per value
block, float32, summed over the value blocks in JAX), and dQe (input dtype), dlam from the read as
in the erase case.

Layout: (BH, NC, C, X) for per-token operands, lam (BH, NS, NC, C, 1), gamma (BH, NC, 1, 1);
D, V padded to powers of two (Triton), NS = ceil(NC / cps) the segments the tokens occupy. The
readout's output alone is (B, NC * C, H, V), row bh of the others being batch bh // H, head bh % H.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.pallas.common import F32, call, mm, over_value_blocks, rowsum, total


def padded_width(n: int) -> int:
  """The kernels' width of a D or V dim of n: the next power of two, at least 16."""
  return max(16, 1 << (n - 1).bit_length())


def num_pairs(ns: int) -> int:
  """The (state i, span j > i) pairs of NS segments: the finished states at span starts, the
  entries of the span stack per batch*head (at least one, so that the array is never empty)."""
  return max(1, ns * (ns - 1) // 2)


def span_index(i, j):
  """Where S^i at the start of span j (i < j) lives in the span stack: span j's states are the
  entries j (j - 1) / 2 + i, i = 0 .. j - 1, one span's finished states side by side. Traced
  ints in both kernel structures (``lax.div``: Mosaic TPU lowers no floor division)."""
  return jax.lax.div(j * (j - 1), 2) + i


def _segment_bounds(i, nc, cps):
  """(first chunk, end) of segment i, the chunks of its write phase (span i): i cps up to
  min((i + 1) cps, NC)."""
  start = i * cps
  return start, jnp.minimum(start + cps, nc)


def _read(p_ref, qe_ref, lam_ref, finished, current_ref, cur, dtype):
  """The readouts of a group of G chunks r of one segment (refs (G, C, .), lam_ref (NS, G, C, 1)):
  o_r = sum_{i < cur} (lam_i p_r) finished(i) + (lam_cur qe_r) current_r, each finished state
  loaded once for the group (the finished states read with the query p: erase the walked query
  P, no erase Qe)."""
  group, c, _ = qe_ref.shape

  def state(i, outs):
    st = finished(i)
    return tuple(o + lam_ref[i, r] * mm(p_ref[r], st, dtype) for r, o in enumerate(outs))

  outs = jax.lax.fori_loop(0, cur, state, (jnp.zeros((c, current_ref.shape[-1]), F32),) * group)
  return [o + lam_ref[cur, r] * mm(qe_ref[r], current_ref[r], dtype) for r, o in enumerate(outs)]


def store_output(o_ref, o, intra_ref, own_ref, scale):
  """The op's output tile: scale (o + own intra) in float32, rounded once to the output dtype."""
  o_ref[...] = (scale * (o + own_ref[...] * intra_ref[...])).astype(o_ref.dtype)


def _store_outputs(o_ref, outs, intra_ref, own_ref, scale):
  """``store_output`` for each chunk r of a group: rows r C .. (r + 1) C of ``o_ref``."""
  c = intra_ref.shape[1]
  for r, o in enumerate(outs):
    o_ref[pl.ds(r * c, c), :] = (scale * (o + own_ref[r] * intra_ref[r])).astype(o_ref.dtype)


def _read_gradients(qe, lam_ref, do_ref, dlam_ref, finished, current, cur, vd, bv, dtype):
  """The read's dQe (returned) and dlam (written to ``dlam_ref[i]``, i <= cur) for one chunk,
  from one product a state, Z_i = dO S_i^T: dQe = sum_i lam_i Z_i, dlam_i = rowsum(Qe * Z_i)
  (= rowsum(dO * (Qe S_i))); finished(i, cols) and current(cols) give the states' value-block
  tiles."""
  c, d = qe.shape

  def state(tile, i, dqe):
    z = over_value_blocks(vd, bv, lambda cols, z: z + mm(do_ref[:, cols], tile(cols), dtype,
                                                         tb=True), jnp.zeros((c, d), F32))
    dlam_ref[i] = rowsum(qe.astype(F32) * z)
    return dqe + lam_ref[i] * z

  dqe = jax.lax.fori_loop(0, cur, lambda i, dqe: state(functools.partial(finished, i), i, dqe),
                          jnp.zeros((c, d), F32))
  return state(current, cur, dqe)


def identity(d):
  """The (d, d) float32 identity: Phi at a span's start."""
  return (jax.lax.broadcasted_iota(jnp.int32, (d, d), 0)
          == jax.lax.broadcasted_iota(jnp.int32, (d, d), 1)).astype(F32)


def chunk_map(s, gam, w, kw, dtype):
  """T S = gamma S - Kw^T (W S): a chunk's map of a state (erase), from its gamma, W and Kw."""
  return gam * s - mm(kw, mm(w, s, dtype), dtype, ta=True)


def write_step(n, s, w_ref, kw_ref, uv_ref, gam_ref, dtype):
  """Chunk n's update of the state it writes: T_n S + Kw_n^T Uv_n, with T_n = gamma_n I without
  erase (``w_ref`` None)."""
  kw = kw_ref[n]
  carried = gam_ref[n] * s if w_ref is None else chunk_map(s, gam_ref[n], w_ref[n], kw, dtype)
  return carried + mm(kw, uv_ref[n], dtype, ta=True)


# ---- erase: the span form ----

def _span_maps_kernel(qe_ref, w_ref, kw_ref, gam_ref, *out_refs, nc, cps, dtype):
  """Program (bh, span j) over the span's chunks n = b .. b' - 1 with Phi (D, D) float32 from
  the identity: Phi_n and P_n = Qe_n Phi_n stored, then Phi <- T_n Phi; U_j = Phi_{b'} last.
  ``out_refs``: (phi_ref,) p_ref, u_ref (without phi_ref where the caller needs no Phi)."""
  *phi_ref, p_ref, u_ref = out_refs
  j = pl.program_id(1)
  d = qe_ref.shape[-1]

  def chunk(n, phi):
    if phi_ref:
      phi_ref[0][n] = phi.astype(dtype)
    p_ref[n] = mm(qe_ref[n], phi, dtype).astype(dtype)
    return chunk_map(phi, gam_ref[n], w_ref[n], kw_ref[n], dtype)

  u_ref[...] = jax.lax.fori_loop(*_segment_bounds(j, nc, cps), chunk, identity(d)).astype(dtype)


def _span_state_kernel(w_ref, kw_ref, uv_ref, gam_ref, u_ref, cur_ref, span_ref, *, nc, cps, group,
                       dtype):
  """Program (bh, value block, group of G segments i = g G .. g G + G - 1; G = ``group``): each
  state S^i through its own segment from zero, chunk by chunk (each chunk's start state into
  ``cur_ref``), then across each later span j by its map U_j in one product that reads U_j once
  for the group's states that cross span j, stored at each span's start into the span stack
  (the last span is not crossed: nothing reads its end). States past the last segment (a short
  last group) take no step."""
  first = pl.program_id(2) * group
  ns = -(-nc // cps)

  def cross(lo, hi, ss):
    """The group's first len(ss) states across spans lo .. hi - 1."""
    def span(j, ss):
      for r, st in enumerate(ss):
        span_ref[span_index(first + r, j)] = st.astype(span_ref.dtype)
      u = u_ref[j]
      return tuple(mm(u, st, dtype) for st in ss)

    return jax.lax.fori_loop(lo, hi, span, ss)

  def own(i):
    def chunk(n, st):
      cur_ref[n] = st.astype(cur_ref.dtype)
      return write_step(n, st, w_ref, kw_ref, uv_ref, gam_ref, dtype)

    return jax.lax.fori_loop(*_segment_bounds(i, nc, cps), chunk,
                             jnp.zeros(cur_ref.shape[-2:], F32))

  ss = ()
  for m in range(group):  # segment first + m: a later span for the states before m, m's own
    if ss:
      ss = cross(first + m, jnp.minimum(first + m + 1, ns - 1), ss)
    ss = (*ss, own(first + m))
  ss = cross(first + group, ns - 1, ss)
  for r, st in enumerate(ss):
    @pl.when(first + r + 1 < ns)
    def _():
      span_ref[span_index(first + r, ns - 1)] = st.astype(span_ref.dtype)


def _span_readout_kernel(qe_ref, lam_ref, p_ref, span_ref, cur_ref, intra_ref, own_ref, o_ref, *,
                         cps, scale, dtype):
  s = pl.program_id(1) * qe_ref.shape[0] // cps
  outs = _read(p_ref, qe_ref, lam_ref, lambda i: span_ref[span_index(i, s)], cur_ref, s, dtype)
  _store_outputs(o_ref, outs, intra_ref, own_ref, scale)


def _span_reverse_kernel(qe_ref, p_ref, w_ref, kw_ref, u_ref, lam_ref, gam_ref, do_ref, dspan_ref,
                         dcur_ref, duv_ref, *, nc, cps, group, dtype):
  """Program (bh, value block, group of G segments i = g G .. g G + G - 1; G = ``group``): each
  state's dS^i from the sequence's end back across the later spans, each in one step
  dS_b = U_j^T dS_{b'} + sum_n (lam_n,i P_n)^T dO_n that reads U_j, P_n and dO_n once for the
  group's states that cross span j, storing the gradient at each span's end into the span
  stack; then through its own segment chunk by chunk, storing each chunk's dS^i_{n+1} and dUv_n.
  States past the last segment (a short last group) take no step."""
  first = pl.program_id(2) * group
  ns = -(-nc // cps)

  def cross(lo, hi, dss):
    """The group's first len(dss) states back across spans hi - 1 down to lo."""
    def span(k, dss):
      j = hi - 1 - k
      for r, ds in enumerate(dss):
        dspan_ref[span_index(first + r, j)] = ds.astype(dspan_ref.dtype)
      u = u_ref[j]

      def chunk(n, dss):
        p, do = p_ref[n], do_ref[n].astype(F32)
        return tuple(acc + mm(p, lam_ref[first + r, n] * do, dtype, ta=True)
                     for r, acc in enumerate(dss))

      return jax.lax.fori_loop(*_segment_bounds(j, nc, cps), chunk,
                               tuple(mm(u, ds, dtype, ta=True) for ds in dss))

    return jax.lax.fori_loop(0, hi - lo, span, tuple(dss))

  def own(i, ds):  # chunk n = end - 1 - m of segment i: dS_{n+1} -> dS_n
    start, end = _segment_bounds(i, nc, cps)

    def chunk(m, ds):
      n = end - 1 - m
      y = mm(kw_ref[n], ds, dtype)
      dcur_ref[n] = ds.astype(dcur_ref.dtype)
      duv_ref[n] = y.astype(duv_ref.dtype)
      return (gam_ref[n] * ds + mm(qe_ref[n], lam_ref[i, n] * do_ref[n].astype(F32), dtype,
                                   ta=True) - mm(w_ref[n], y, dtype, ta=True))

    jax.lax.fori_loop(0, end - start, chunk, ds)

  d, bv = dcur_ref.shape[-2:]
  dss = cross(first + group, ns, (jnp.zeros((d, bv), F32),) * group)
  for m in range(group - 1, 0, -1):  # span first + m: state m's own, a later one for those before
    own(first + m, dss[m])
    dss = cross(first + m, jnp.minimum(first + m + 1, ns), dss[:m])
  own(first, dss[0])


def _finished_reads_kernel(p_ref, lam_ref, do_ref, span_ref, y_ref, dlam_ref, *, nc, cps, vd, bv,
                           dtype):
  """Program (bh, group of G chunks n = b_g .. b_g + G - 1 of span s; G = ``group``), over the
  value blocks: the finished states' part of the chunks' gradients. Each span-start value S_b^i
  (i < s), read once for the group, gives every chunk's Z = dO_n S_b^iT (C, D), the one product
  a state needs:

      Y_n = sum_{i < s} lam_i Z (float32),   dlam_i = rowsum(P_n * Z),

  the latter equal to rowsum(dO_n * (P_n S_b^i))."""
  group, c, d = p_ref.shape
  first = _heaviest_first(nc // group)(pl.program_id(1)) * group
  s = first // cps

  def state(i, ys):
    def block(cols, zs):
      st = span_ref[span_index(i, s), :, cols]
      return tuple(z + mm(do_ref[r, :, cols], st, dtype, tb=True) for r, z in enumerate(zs))

    zs = over_value_blocks(vd, bv, block, (jnp.zeros((c, d), F32),) * group)
    for r, z in enumerate(zs):
      dlam_ref[r, i] = rowsum(p_ref[r].astype(F32) * z)
    return tuple(y + lam_ref[i, r] * z for r, (y, z) in enumerate(zip(ys, zs)))

  ys = jax.lax.fori_loop(0, s, state, (jnp.zeros((c, d), F32),) * group)
  for r, y in enumerate(ys):
    y_ref[r] = y


def _own_gradients_kernel(qe_ref, phi_ref, w_ref, uv_ref, duv_ref, lam_ref, do_ref, cur_ref,
                          dcur_ref, y_ref, dqe_ref, dlam_ref, dw_ref, dkw_ref, dgam_ref, *, cps,
                          vd, bv, dtype):
  """Program (bh, chunk n) in span s, over value blocks of at most ``bv`` columns: from the own
  state's S_n^s and dS_{n+1}^s its part of the chunk's gradients, with Z = dO S^T:
  dQe = lam_s Z (+ Y_n Phi_n^T, the finished states' read: dQe is whole here, stored in qe's
  dtype), dlam_s = rowsum(Qe * Z), and with G = dS S^T (never formed) dW = -Kw G = -dUv S^T,
  dKw = -W G^T + Uv dS^T = (Uv - W S) dS^T, dgamma = tr G = <dS, S> (float32, for
  ``_span_sums_kernel`` to finish)."""
  c, d = qe_ref.shape
  s = pl.program_id(1) // cps
  w = w_ref[...]

  def block(cols, carry):
    z, dw, dkw, dgam = carry
    st, dst = cur_ref[:, cols], dcur_ref[:, cols]
    return (z + mm(do_ref[:, cols], st, dtype, tb=True),
            dw - mm(duv_ref[:, cols], st, dtype, tb=True),
            dkw + mm(uv_ref[:, cols].astype(F32) - mm(w, st, dtype), dst, dtype, tb=True),
            dgam + total(dst.astype(F32) * st.astype(F32)))

  zero = jnp.zeros((c, d), F32)
  z, dw_ref[...], dkw_ref[...], dgam_ref[...] = over_value_blocks(
      vd, bv, block, (zero, zero, zero, jnp.zeros((1, 1), F32)))
  dlam_ref[...] = rowsum(qe_ref[...].astype(F32) * z)
  dqe = mm(y_ref[...], phi_ref[...], dtype, tb=True) + lam_ref[s] * z
  dqe_ref[...] = dqe.astype(dqe_ref.dtype)


def _span_sums_kernel(qe_ref, phi_ref, w_ref, kw_ref, gam_ref, span_ref, dspan_ref, y_ref,
                      dw_own_ref, dkw_own_ref, dgam_own_ref, dw_ref, dkw_ref, dgam_ref, *, nc, cps,
                      vd, bv, dtype):
  """Program (bh, span j), the last span first: K = sum_{i < j} dS_{b'}^i S_b^iT over the
  stacks, then the span's chunks n = b' - 1 down to b with L (D, D) float32 from L = K:

      dW_n = dW_own - (Kw_n L) Phi_n^T,   dKw_n = dKw_own - (W_n Phi_n) L^T,
      dgamma_n = dgamma_own + sum(L * Phi_n),   L <- T_n^T L + Qe_n^T Y_n

  (the finished states' G_n = L Phi_n^T, formed only through these products)."""
  j = _heaviest_first(-(-nc // cps))(pl.program_id(1))
  d = qe_ref.shape[-1]

  def pair(i, g):
    at = span_index(i, j)
    return over_value_blocks(vd, bv, lambda cols, g: g + mm(dspan_ref[at, :, cols],
                                                            span_ref[at, :, cols], dtype,
                                                            tb=True), g)

  first, last = _segment_bounds(j, nc, cps)

  def chunk(m, l):
    n = last - 1 - m
    phi, kw, w = phi_ref[n], kw_ref[n], w_ref[n]
    dgam_ref[n] = dgam_own_ref[n] + total(l * phi.astype(F32))
    a = mm(kw, l, dtype)
    dw_ref[n] = (dw_own_ref[n] - mm(a, phi, dtype, tb=True)).astype(dw_ref.dtype)
    dkw_ref[n] = (dkw_own_ref[n] - mm(mm(w, phi, dtype), l, dtype, tb=True)).astype(dkw_ref.dtype)
    return gam_ref[n] * l - mm(w, a, dtype, ta=True) + mm(qe_ref[n], y_ref[n], dtype, ta=True)

  k = jax.lax.fori_loop(0, j, pair, jnp.zeros((d, d), F32))
  jax.lax.fori_loop(0, last - first, chunk, k)


# ---- no erase: rescaled states ----

def _write_kernel(*refs, nc, cps, erase, dtype):
  """Segment i's write phase from a zero state: each chunk's start state into ``cur_ref`` and the
  segment's end state into ``end_ref[i]``, by ``write_step`` (with ``erase`` a W operand
  first)."""
  w_ref = refs[0] if erase else None
  kw_ref, uv_ref, gam_ref, cur_ref, end_ref = refs[erase:]
  i = pl.program_id(2)
  start, end = _segment_bounds(i, nc, cps)

  def chunk(n, s):
    cur_ref[n] = s.astype(cur_ref.dtype)
    return write_step(n, s, w_ref, kw_ref, uv_ref, gam_ref, dtype)

  d, bv = cur_ref.shape[-2:]
  s = jax.lax.fori_loop(start, end, chunk, jnp.zeros((d, bv), F32))
  end_ref[i] = s.astype(end_ref.dtype)


def _rescaled_readout_kernel(qe_ref, lam_ref, end_ref, cur_ref, intra_ref, own_ref, o_ref, *, cps,
                             scale, dtype):
  cur = pl.program_id(1) * qe_ref.shape[0] // cps
  outs = _read(qe_ref, qe_ref, lam_ref, lambda i: end_ref[i], cur_ref, cur, dtype)
  _store_outputs(o_ref, outs, intra_ref, own_ref, scale)


def _rescaled_reverse_kernel(qe_ref, kw_ref, uv_ref, lam_ref, gam_ref, do_ref, cur_ref, duv_ref,
                             dkw_ref, dgam_ref, *, nc, cps, dtype):
  start, end = _segment_bounds(pl.program_id(2), nc, cps)
  read = lambda n: mm(qe_ref[n], lam_ref[n] * do_ref[n].astype(F32), dtype, ta=True)
  d, bv = cur_ref.shape[-2:]
  ds = jax.lax.fori_loop(end, nc, lambda n, ds: ds + read(n), jnp.zeros((d, bv), F32))  # dS_end

  def chunk(n, ds):
    duv_ref[n] = mm(kw_ref[n], ds, dtype).astype(duv_ref.dtype)
    dkw_ref[n] = mm(uv_ref[n], ds, dtype, tb=True)
    dgam_ref[n] = total(ds * cur_ref[n].astype(F32))
    return gam_ref[n] * ds + read(n)

  jax.lax.fori_loop(0, end - start, lambda j, ds: chunk(end - 1 - j, ds), ds)


def _rescaled_gradients_kernel(qe_ref, lam_ref, do_ref, end_ref, cur_ref, dqe_ref, dlam_ref, *,
                               cps, vd, bv, dtype):
  cur = pl.program_id(1) // cps
  dqe = _read_gradients(qe_ref[...], lam_ref, do_ref, dlam_ref, lambda i, cols: end_ref[i, :, cols],
                        lambda cols: cur_ref[:, cols], cur, vd, bv, dtype)
  dqe_ref[...] = dqe.astype(dqe_ref.dtype)


# ---- erase, forward only: the query walk ----

def _walk_kernel(qe_ref, lam_ref, p_ref, cur_ref, end_ref, u_ref, intra_ref, own_ref, o_ref, *,
                 nc, cps, scale, dtype):
  """Program (bh, chunk n), the last chunk first (``_heaviest_first``), over the whole V: from the
  walked query p = P_n (``span_maps``), read each earlier segment's end state, crossing that
  segment by its span map U_j:

      o_n = (lam_s Qe_n) S_n + sum_{j < s} (lam_j p_j) S_end^j,   p_{s-1} = P_n, p_{j-1} = p_j U_j

  (S_n the current segment's state at the chunk's start). p and o stay float32; each product
  takes its operands in the input dtype, as the state passes do. The last segment crossed needs
  no map: the walk multiplies by U_j only for j >= 1, and segment 0's read is weighted by zero
  where the chunk lies in segment 0 itself (its state is then S_n)."""
  n = _heaviest_first(nc)(pl.program_id(1))
  s = n // cps
  o = lam_ref[s] * mm(qe_ref[...], cur_ref[...], dtype)

  def segment(k, carry):  # j = s - 1 - k, down to 1
    o, p = carry
    j = s - 1 - k
    return o + lam_ref[j] * mm(p, end_ref[j], dtype), mm(p, u_ref[j], dtype)

  o, p = jax.lax.fori_loop(0, jnp.maximum(s - 1, 0), segment, (o, p_ref[...].astype(F32)))
  o = o + jnp.where(s > 0, lam_ref[0], 0.0) * mm(p, end_ref[0], dtype)
  store_output(o_ref, o, intra_ref, own_ref, scale)


# ---- launchers ----

def _whole(*shape):
  """A block spanning a (BH, *shape) operand's trailing dims, for grids led by BH."""
  return pl.BlockSpec((None, *shape), lambda b, *_: (b,) + (0,) * len(shape))


def _vblock(*shape):
  """(BH, *shape, V) blocked by value columns on a (BH, V / bv, NS) grid: shape + (bv,)."""
  return pl.BlockSpec((None, *shape), lambda b, j, i: (b,) + (0,) * (len(shape) - 1) + (j,))


def _heaviest_first(nc):
  """Program index -> chunk for a (BH, NC) grid: the last chunk first. Chunk n's gradients walk
  s(n) + 1 states, so the longest programs start first and the short ones fill the last wave
  (the launch runs the BH programs of a grid row together, rows in order)."""
  return lambda p: nc - 1 - p


def _chunk_spec(*shape, chunk=lambda p: p, group=None):
  """One chunk's block on a (BH, NC, ...) grid, or with ``group`` G a group of G chunks'
  (G, *shape); ``chunk`` maps the program index to the chunk (group)."""
  return pl.BlockSpec((None, group, *shape), lambda b, p, *_: (b, chunk(p)) + (0,) * len(shape))


def _lam_of_chunk(ns, c, chunk=lambda p: p, group=None):
  """lam (BH, NS, NC, C, 1): every segment's weights of the program's chunk, (NS, C, 1), or of
  its group of G chunks, (NS, G, C, 1)."""
  return pl.BlockSpec((None, ns, group, c, 1), lambda b, p, *_: (b, 0, chunk(p), 0, 0))


def read_group(cfg, cps, nc):
  """The chunks a program of the span readout and chunk gradients takes (``Config.read_chunks``
  where it divides the chunks of a segment and of the sequence, else their common divisor): all
  in one span, so that each finished state is read once for the group."""
  return math.gcd(cfg.read_chunks, cps, nc)


def _lam_of_segment(nc, c):
  """lam (BH, NS, NC, C, 1): the program's segment's weights of every chunk, (NC, C, 1)."""
  return pl.BlockSpec((None, None, nc, c, 1), lambda b, j, i: (b, i, 0, 0, 0))


# The span-map and span-sum kernels carry a (D, D) float32 matrix (Phi, L): 8 warps hold it in
# registers at D = 128 (64 a thread).
SQUARE_WARPS = 8


def span_maps(qe, w, kw, gam, *, cps, cfg, phi=True):
  """Erase, per span: Phi_n = T_{n-1} ... T_b (BH, NC, D, D) (``phi``: else not stored), the
  walked queries P_n = Qe_n Phi_n (BH, NC, C, D) and the span maps U_j = Phi_{b'} (BH, NS, D, D),
  in kw's dtype, from the chunk maps T_n = gamma_n I - Kw_n^T W_n. Grid (BH, NS)."""
  bh, nc, c, d = kw.shape
  ns = -(-nc // cps)
  whole = lambda *shape: pl.BlockSpec((None, *shape), lambda b, j: (b,) + (0,) * len(shape))
  shape = lambda *s: jax.ShapeDtypeStruct((bh, *s), kw.dtype)
  outs = [(whole(nc, d, d), shape(nc, d, d))] if phi else []
  outs += [(whole(nc, c, d), shape(nc, c, d)),
           (pl.BlockSpec((None, None, d, d), lambda b, j: (b, j, 0, 0)), shape(ns, d, d))]
  kernel = functools.partial(_span_maps_kernel, nc=nc, cps=cps, dtype=kw.dtype)
  return call(kernel, cfg=cfg, grid=(bh, ns), in_specs=[whole(nc, c, d)] * 3 + [whole(nc, 1, 1)],
              out_specs=[spec for spec, _ in outs], out_shape=[s for _, s in outs],
              semantics=None, name="merlin_span_maps", num_warps=SQUARE_WARPS)(qe, w, kw, gam)


def span_state_pass(w, kw, uv, gam, u, *, cps, cfg):
  """Erase forward state pass: each chunk's own-segment start state ``cur`` (BH, NC, D, V) and
  the span stack ``span`` (BH, ``num_pairs``, D, V), S^i at the start of every span j > i at
  ``span_index(i, j)``, both in kw's dtype; ``u`` the span maps (``span_maps``). Grid
  (BH, V / block_v, NS / G), ``Config.forward_states`` = G segments a program (the last group
  short where G does not divide NS)."""
  bh, nc, c, d = kw.shape
  vd = uv.shape[-1]
  bv = min(cfg.block_v, vd)
  ns = -(-nc // cps)
  pairs = num_pairs(ns)
  group = min(cfg.forward_states, ns)
  kernel = functools.partial(_span_state_kernel, nc=nc, cps=cps, group=group, dtype=kw.dtype)
  return call(kernel, cfg=cfg, grid=(bh, vd // bv, -(-ns // group)),
              in_specs=[_whole(nc, c, d), _whole(nc, c, d), _vblock(nc, c, bv), _whole(nc, 1, 1),
                        _whole(ns, d, d)],
              out_specs=[_vblock(nc, d, bv), _vblock(pairs, d, bv)],
              out_shape=[jax.ShapeDtypeStruct((bh, nc, d, vd), kw.dtype),
                         jax.ShapeDtypeStruct((bh, pairs, d, vd), kw.dtype)],
              semantics=None, name="merlin_state_pass")(w, kw, uv, gam, u)


def _readout_call(kernel, qe, lam, state_specs, states, intra, own, heads, cfg, *, bv=None,
                  chunk=lambda p: p, group=None, name="merlin_readout", num_warps=None):
  """The readout launch: program (bh, p, j) reads chunk n = chunk(p)'s Qe, lam, own and value
  block j (``bv`` columns, default bwd_block_v) of intra and of the states, or with ``group`` G
  those of chunk group chunk(p) (G chunks, blocks (G, ...)), and writes the output's (C, bv)
  tile ((G C, bv)) in qe's dtype into the caller's (B, NC * C, H, V) layout: row bh is batch
  bh // H, head bh % H (the head dim squeezed, a strided block), so the output needs no
  relayout after."""
  bh, nc, c, d = qe.shape
  vd = intra.shape[-1]
  bv = min(bv or cfg.bwd_block_v, vd)
  programs = nc // (group or 1)
  return call(kernel, cfg=cfg, grid=(bh, programs, vd // bv),
              in_specs=[_chunk_spec(c, d, chunk=chunk, group=group),
                        _lam_of_chunk(lam.shape[1], c, chunk, group)]
                       + state_specs
                       + [pl.BlockSpec((None, group, c, bv),
                                       lambda b, p, j: (b, chunk(p), 0, j)),
                          _chunk_spec(c, 1, chunk=chunk, group=group)],
              out_specs=pl.BlockSpec((None, (group or 1) * c, None, bv),
                                     lambda b, p, j: (b // heads, chunk(p), b % heads, j)),
              out_shape=jax.ShapeDtypeStruct((bh // heads, nc * c, heads, vd), qe.dtype),
              semantics=None, name=name, num_warps=num_warps)(qe, lam, *states, intra, own)


def span_readout(qe, lam, p, span, cur, intra, own, *, cps, scale, heads, cfg):
  """The erase output: scale (o_n + own_n intra_n) with
  o_n = sum_{i < s(n)} (lam_n,i P_n) S_b^i + (lam_n,s(n) Qe_n) S_n^s(n), from the walked queries
  P (BH, NC, C, D), the span stack and the current states (``span_state_pass``) and the
  intra-chunk part intra = P Uv (BH, NC, C, V), weighted by own (BH, NC, C, 1), each token's lam
  of its own segment (both float32): summed in float32 and stored once in qe's dtype (the op's
  output dtype), (B, NC * C, H, V) with H = ``heads`` (``_readout_call``). Grid
  (BH, NC / G, V / bwd_block_v), G chunks a program (``read_group``)."""
  nc, c, d = qe.shape[1:]
  pairs, vd = span.shape[1], span.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  group = read_group(cfg, cps, nc)
  kernel = functools.partial(_span_readout_kernel, cps=cps, scale=scale, dtype=qe.dtype)
  specs = [_chunk_spec(c, d, group=group),
           pl.BlockSpec((None, pairs, d, bv), lambda b, n, j: (b, 0, 0, j)),
           pl.BlockSpec((None, group, d, bv), lambda b, n, j: (b, n, 0, j))]
  return _readout_call(kernel, qe, lam, specs, [p, span, cur], intra, own, heads, cfg,
                       group=group)


def span_reverse_pass(qe, p, w, kw, u, lam, gam, do, *, cps, cfg):
  """Erase reverse state pass: the span-end gradients ``dspan`` (BH, ``num_pairs``, D, V),
  dS^i_{b'} for span j > i at ``span_index(i, j)`` (b' the span's end), each chunk's own-segment
  gradient ``dcur`` dS^s(n)_{n+1} (BH, NC, D, V) and dUv (BH, NC, C, V), all in qe's dtype (dUv's
  one use is the op's cotangent of Uv, which has that dtype); p and u from ``span_maps``. Grid
  (BH, V / bwd_block_v, NS / G), ``Config.reverse_states`` = G segments a program (the last
  group short where G does not divide NS), at bwd_num_warps; do (BH, NC, C, V) in qe's dtype."""
  bh, nc, c, d = qe.shape
  ns, vd = lam.shape[1], do.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  pairs = num_pairs(ns)
  group = min(cfg.reverse_states, ns)
  kernel = functools.partial(_span_reverse_kernel, nc=nc, cps=cps, group=group, dtype=qe.dtype)
  return call(kernel, cfg=cfg, grid=(bh, vd // bv, -(-ns // group)),
              in_specs=[_whole(nc, c, d)] * 4 + [_whole(ns, d, d), _whole(ns, nc, c, 1),
                                                 _whole(nc, 1, 1), _vblock(nc, c, bv)],
              out_specs=[_vblock(pairs, d, bv), _vblock(nc, d, bv), _vblock(nc, c, bv)],
              out_shape=[jax.ShapeDtypeStruct((bh, pairs, d, vd), qe.dtype),
                         jax.ShapeDtypeStruct((bh, nc, d, vd), qe.dtype),
                         jax.ShapeDtypeStruct((bh, nc, c, vd), qe.dtype)],
              semantics=None, name="merlin_reverse_state_pass",
              num_warps=cfg.bwd_num_warps)(qe, p, w, kw, u, lam, gam, do)


# The own-state gradients run over value blocks of at most this many columns: at D = V = 128 the
# whole-V step's (C, V) float32 products are what fills the registers
# (benchmarks/triton_registers.py --merlin).
OWN_BLOCK_V = 64


def span_chunk_gradients(qe, p, phi, w, uv, duv, lam, do, span, cur, dcur, *, cps, cfg):
  """Erase, per chunk: dQe (BH, NC, C, D) in qe's dtype (the op's cotangent of Qe, which has it:
  summed in float32, rounded once); float32 Y and the own state's parts of dW, dKw
  (BH, NC, C, D) and dgamma (BH, NC, 1, 1) (``span_sums`` finishes them); dlam (BH, NC, NS, C, 1;
  entries i > s(n) undefined) whole. Two launches at bwd_num_warps: the finished states' reads
  (``_finished_reads_kernel``: Y, dlam_i for i < s; grid (BH, NC / G), G chunks a program,
  ``read_group``, the last group first), then each chunk's own state
  (``_own_gradients_kernel``: the rest; grid (BH, NC)), so that neither holds the other's
  registers."""
  bh, nc, c, d = qe.shape
  pairs, vd = span.shape[1], span.shape[-1]
  ns = lam.shape[1]
  group = read_group(cfg, cps, nc)
  order = _heaviest_first(nc // group)
  grouped = lambda *s: _chunk_spec(*s, chunk=order, group=group)
  shape = lambda *s, dtype=F32: jax.ShapeDtypeStruct((bh, nc, *s), dtype)
  bv = min(cfg.bwd_block_v, vd)
  kernel = functools.partial(_finished_reads_kernel, nc=nc, cps=cps, vd=vd, bv=bv,
                             dtype=qe.dtype)
  y, dlam = call(kernel, cfg=cfg, grid=(bh, nc // group),
                 in_specs=[grouped(c, d), _lam_of_chunk(ns, c, order, group), grouped(c, vd),
                           pl.BlockSpec((None, pairs, d, vd), lambda b, p: (b, 0, 0, 0))],
                 out_specs=[grouped(c, d), grouped(ns, c, 1)],
                 out_shape=[shape(c, d), shape(ns, c, 1)],
                 semantics=None, name="merlin_finished_reads",
                 num_warps=cfg.bwd_num_warps)(p, lam, do, span)
  kernel = functools.partial(_own_gradients_kernel, cps=cps, vd=vd,
                             bv=min(bv, OWN_BLOCK_V), dtype=qe.dtype)
  dqe, dlam_own, dw, dkw, dgam = call(
      kernel, cfg=cfg, grid=(bh, nc),
      in_specs=[_chunk_spec(c, d), _chunk_spec(d, d), _chunk_spec(c, d)]
               + [_chunk_spec(c, vd)] * 2 + [_lam_of_chunk(ns, c), _chunk_spec(c, vd)]
               + [_chunk_spec(d, vd)] * 2 + [_chunk_spec(c, d)],
      out_specs=[_chunk_spec(c, d), _chunk_spec(c, 1), _chunk_spec(c, d), _chunk_spec(c, d),
                 _chunk_spec(1, 1)],
      out_shape=[shape(c, d, dtype=qe.dtype), shape(c, 1), shape(c, d), shape(c, d),
                 shape(1, 1)],
      semantics=None, name="merlin_chunk_gradients", num_warps=cfg.bwd_num_warps)(
          qe, phi, w, uv, duv, lam, do, cur, dcur, y)
  own = (jnp.arange(ns)[None, :] == (jnp.arange(nc) // cps)[:, None])[None, :, :, None, None]
  return dqe, y, dw, dkw, dgam, jnp.where(own, dlam_own[:, :, None], dlam)


def span_sums(qe, phi, w, kw, gam, span, dspan, y, dw_own, dkw_own, dgam_own, *, cps, cfg):
  """Erase: the chunk gradients dW, dKw (BH, NC, C, D) in qe's dtype and dgamma (BH, NC, 1, 1)
  float32, the own parts (``span_chunk_gradients``) plus the finished states', through each
  span's K and L (``_span_sums_kernel``). Grid (BH, NS), the last span first. Its dot operands
  (Phi, L, each also transposed, and C x D tiles) take 224 KiB of shared memory at
  D = V = 128, C = 64 (benchmarks/triton_registers.py --merlin), near Hopper's 227 KiB a block:
  orders of the chunk step that hold fewer registers took 256-272 KiB, which would not launch."""
  bh, nc, c, d = qe.shape
  pairs, vd = span.shape[1], span.shape[-1]
  ns = -(-nc // cps)
  whole = lambda *shape: pl.BlockSpec((None, *shape), lambda b, j: (b,) + (0,) * len(shape))
  shape = lambda *s, dtype=F32: jax.ShapeDtypeStruct((bh, nc, *s), dtype)
  kernel = functools.partial(_span_sums_kernel, nc=nc, cps=cps, vd=vd,
                             bv=min(cfg.bwd_block_v, vd), dtype=qe.dtype)
  return call(kernel, cfg=cfg, grid=(bh, ns),
              in_specs=[whole(nc, c, d), whole(nc, d, d), whole(nc, c, d), whole(nc, c, d),
                        whole(nc, 1, 1), whole(pairs, d, vd), whole(pairs, d, vd),
                        whole(nc, c, d), whole(nc, c, d), whole(nc, c, d), whole(nc, 1, 1)],
              out_specs=[whole(nc, c, d)] * 2 + [whole(nc, 1, 1)],
              out_shape=[shape(c, d, dtype=qe.dtype)] * 2 + [shape(1, 1)],
              semantics=None, name="merlin_span_sums", num_warps=SQUARE_WARPS)(
                  qe, phi, w, kw, gam, span, dspan, y, dw_own, dkw_own, dgam_own)


def write_pass(kw, uv, gam, *, cps, cfg, w=None):
  """Each chunk's current-segment chunk-start state (BH, NC, D, V) and each segment's end state
  (BH, NS, D, V), in kw's dtype, every segment written from a zero state: the no-erase forward's
  states, or with the erase operand ``w`` those of the update gamma S - Kw^T (W S) + Kw^T Uv (the
  forward-only query walk's, ``walk_readout``). Grid (BH, V / block_v, NS)."""
  bh, nc, c, d = kw.shape
  vd = uv.shape[-1]
  bv = min(cfg.block_v, vd)
  ns = -(-nc // cps)
  erase = w is not None
  kernel = functools.partial(_write_kernel, nc=nc, cps=cps, erase=erase, dtype=kw.dtype)
  return call(kernel, cfg=cfg, grid=(bh, vd // bv, ns),
              in_specs=[_whole(nc, c, d)] * (1 + erase) + [_vblock(nc, c, bv), _whole(nc, 1, 1)],
              out_specs=[_vblock(nc, d, bv), _vblock(ns, d, bv)],
              out_shape=[jax.ShapeDtypeStruct((bh, nc, d, vd), kw.dtype),
                         jax.ShapeDtypeStruct((bh, ns, d, vd), kw.dtype)],
              semantics=None, name="merlin_write_pass")(*([w] if erase else []), kw, uv, gam)


def rescaled_readout(qe, lam, cur, end, intra, own, *, cps, scale, heads, cfg):
  """The no-erase output: scale (o_n + own_n intra_n) with o_n = sum_{i < s(n)} (lam_n,i Qe_n)
  S_end^i + (lam_n,s(n) Qe_n) S_n (lam already carrying the finished states' decay), stored as
  ``span_readout``'s: (B, NC * C, H, V) in qe's dtype, G chunks a program (``read_group``)."""
  ns, d, vd = end.shape[1:]
  nc = qe.shape[1]
  bv = min(cfg.bwd_block_v, vd)
  group = read_group(cfg, cps, nc)
  kernel = functools.partial(_rescaled_readout_kernel, cps=cps, scale=scale, dtype=qe.dtype)
  specs = [pl.BlockSpec((None, ns, d, bv), lambda b, n, j: (b, 0, 0, j)),
           pl.BlockSpec((None, group, d, bv), lambda b, n, j: (b, n, 0, j))]
  return _readout_call(kernel, qe, lam, specs, [end, cur], intra, own, heads, cfg, group=group)


def walk_readout(qe, lam, p, cur, end, u, intra, own, *, cps, scale, heads, cfg):
  """The erase output without a stack of states (forward only): scale (o_n + own_n intra_n),
  o_n = sum_{i <= s(n)} (lam_n,i Qe_n) S_n^i formed by walking the query back through the span
  maps (``_walk_kernel``) from the walked queries ``p`` (BH, NC, C, D) and span maps ``u``
  (BH, NS, D, D) (``span_maps``), each chunk's current state ``cur`` (BH, NC, D, V) and the
  segments' end states ``end`` (BH, NS, D, V) (both ``write_pass`` with W), all in qe's dtype;
  stored as ``span_readout``'s: (B, NC * C, H, V) in qe's dtype. Grid (BH, NC), the last chunk
  first, one program over the whole V: the walk of p (C, D) does not depend on the value columns,
  so value blocks would repeat it. At ``bwd_num_warps``: p and o, float32 (C, D) and (C, V)
  arrays, fit the registers at 4 and at 8 warps at C = 64, D = V = 128
  (benchmarks/triton_registers.py --merlin)."""
  nc, c, d = qe.shape[1:]
  ns, vd = end.shape[1], end.shape[-1]
  order = _heaviest_first(nc)
  kernel = functools.partial(_walk_kernel, nc=nc, cps=cps, scale=scale, dtype=qe.dtype)
  whole = lambda *shape: pl.BlockSpec((None, *shape), lambda b, p, j: (b,) + (0,) * len(shape))
  specs = [_chunk_spec(c, d, chunk=order), _chunk_spec(d, vd, chunk=order), whole(ns, d, vd),
           whole(ns, d, d)]
  return _readout_call(kernel, qe, lam, specs, [p, cur, end, u], intra, own, heads, cfg, bv=vd,
                       chunk=order, name="merlin_walk_readout", num_warps=cfg.bwd_num_warps)


def rescaled_reverse_pass(qe, kw, uv, lam, gam, do, cur, *, cps, cfg):
  """No-erase reverse pass: dUv (BH, NC, C, V) in qe's dtype (the op's cotangent of Uv, which has
  it), and per value block of ``bwd_block_v`` columns the partial dKw (BH, V / bwd_block_v, NC, C,
  D) and dgamma (BH, V / bwd_block_v, NC, 1, 1), float32 (summed over the blocks after). Grid
  (BH, V / bwd_block_v, NS) at bwd_num_warps."""
  bh, nc, c, d = qe.shape
  vd = uv.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  nv = vd // bv
  per_block = lambda *s: pl.BlockSpec((None, None, nc, *s), lambda b, j, i: (b, j) + (0,) * (
      len(s) + 1))
  kernel = functools.partial(_rescaled_reverse_kernel, nc=nc, cps=cps, dtype=qe.dtype)
  return call(kernel, cfg=cfg, grid=(bh, nv, lam.shape[1]),
              in_specs=[_whole(nc, c, d), _whole(nc, c, d), _vblock(nc, c, bv),
                        _lam_of_segment(nc, c), _whole(nc, 1, 1), _vblock(nc, c, bv),
                        _vblock(nc, d, bv)],
              out_specs=[_vblock(nc, c, bv), per_block(c, d), per_block(1, 1)],
              out_shape=[jax.ShapeDtypeStruct((bh, nc, c, vd), qe.dtype),
                         jax.ShapeDtypeStruct((bh, nv, nc, c, d), F32),
                         jax.ShapeDtypeStruct((bh, nv, nc, 1, 1), F32)],
              semantics=None, name="merlin_reverse_write_pass",
              num_warps=cfg.bwd_num_warps)(qe, kw, uv, lam, gam, do, cur)


def rescaled_read_gradients(qe, lam, do, cur, end, *, cps, cfg):
  """No-erase: the read's dQe (BH, NC, C, D) in qe's dtype (the op's cotangent of Qe, which has
  it) and dlam (BH, NC, NS, C, 1; entries i > s(n) unwritten) float32. Grid (BH, NC)."""
  bh, nc, c, d = qe.shape
  ns, vd = end.shape[1], end.shape[-1]
  shape = lambda *s, dtype=F32: jax.ShapeDtypeStruct((bh, nc, *s), dtype)
  kernel = functools.partial(_rescaled_gradients_kernel, cps=cps, vd=vd,
                             bv=min(cfg.bwd_block_v, vd), dtype=qe.dtype)
  return call(kernel, cfg=cfg, grid=(bh, nc),
              in_specs=[_chunk_spec(c, d), _lam_of_chunk(ns, c), _chunk_spec(c, vd),
                        pl.BlockSpec((None, ns, d, vd), lambda b, n: (b, 0, 0, 0)),
                        _chunk_spec(d, vd)],
              out_specs=[_chunk_spec(c, d), _chunk_spec(ns, c, 1)],
              out_shape=[shape(c, d, dtype=qe.dtype), shape(ns, c, 1)],
              semantics=None, name="merlin_read_gradients",
              num_warps=cfg.bwd_num_warps)(qe, lam, do, end, cur)
