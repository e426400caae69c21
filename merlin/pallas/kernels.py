"""The Triton Pallas kernels of multi-state linear attention's state work (docs/spec.md section 2).

Per (batch*head), chunk n of C tokens and segment state i, from the chunk prep
(``merlin.chunked.intra_chunk`` in plain JAX, or its forward kernel, ``intra.py``): Qe_n, W_n,
Kw_n (C, D), Uv_n (C, V), the chunk decay gamma_n = exp(gc_C) and lam_n,i (C, 1). State i is
zero before its segment's first chunk n_i = i cps (cps = chunks per segment), is written during
its cps chunks (up to e_i) and only carried after:

    S_{n+1}^i = gamma_n S_n^i - Kw_n^T (W_n S_n^i) + [n < e_i] Kw_n^T Uv_n     (W = 0: no erase)
    o_n      += (lam_n,i Qe_n) S_n^i                                            (every i <= s(n))

Each state carries through its own chain of chunks, independent of the others, so the state
passes put the segment index on the grid: program (bh, value block j, segment i) walks segment i's
chunks with the (D, block_v) float32 state S^i in registers. The readout is parallel over chunks:
o_n = sum_{i <= s(n)} (lam_n,i Qe_n) S_n^i, the (C, (s(n)+1) D) x ((s(n)+1) D, V) product over the
stacked states, walked state by state (``_read``). It stores the op's output, not o:
scale (o_n + own_n intra_n) with the intra-chunk part intra_n = P_n Uv_n and own_n the
tokens' lam of their own segment (float32), rounded once to the input dtype and written straight
into the caller's (B, T, H, V) layout (``_readout_call``).

Erase (the carried stack): a finished state keeps changing (Phi_n), so the forward stores every
visible chunk-start state S_n^i (n >= n_i, in the input dtype) once, in a compact (BH, VIS, D, V)
array, VIS = sum_i (NC - n_i), at ``index(i, n)``. Backward, with dS^i_{n+1} the gradient of the
state leaving chunk n:

    dS_n^i  = gamma_n dS^i_{n+1} - W_n^T (Kw_n dS^i_{n+1}) + (lam_n,i Qe_n)^T dO_n
    dUv_n   = Kw_n dS^{s(n)}_{n+1}
    dQe_n   = sum_i lam_n,i (dO_n S_n^iT)          dlam_n,i = rowsum(dO_n * (Qe_n S_n^i))
    dKw_n   = Uv_n dS^{s(n)T}_{n+1} - W_n G_n^T     dW_n = -Kw_n G_n     dgamma_n = trace(G_n)
    G_n     = sum_i dS^i_{n+1} S_n^iT   (D, D)

(W_n and Kw_n are the same for every state i, so the erase terms' sums over i collapse into G_n.)
The reverse state pass (the forward's grid, at the backward's tiles) stores dS^i_{n+1} at
``index(i, n)`` and dUv; the chunk-gradients kernel, one program per (batch*head, chunk), reads
each visible S_n^i and dS^i_{n+1} once and sums dQe, dlam and G_n over i and the value axis, so no
two programs write one output (no atomics). dUv, dQe, dW and dKw are summed in float32 and stored
in the input dtype: they leave the op as the cotangents of operands in that dtype, so a float32
store would only be cast after (dgamma, dlam stay float32, as their operands are).

Erase, forward only (the query walk, ``Config.query_walk``): every finished state moves under the
same chunk map, S_{m+1}^i = T_m S_m^i with T_m = gamma_m I - Kw_m^T W_m (D, D), so
S_n^i = T_{n-1} ... T_{e_i} S_end^i and the read can move the query instead of the states:

    p = Qe_n T_{n-1} ... T_{n_s}            (p <- gamma_m p - (p Kw_m^T) W_m, chunk n in segment s)
    o_n = (lam_n,s Qe_n) S_n^s + sum_{j < s} (lam_n,j p_j) S_end^j,   p_{j-1} = p_j U_j

with U_j = T_{e_j - 1} ... T_{n_j} the product of segment j's chunk maps (formed once per segment,
plain JAX) and lam a row scale, which commutes with the right products. ``write_pass`` with W
gives each chunk's current state and each segment's end state, as in the no-erase case; no
(VIS, D, V) stack is stored. The backward pairs every state with its own gradient (G_n above),
so a differentiated call runs the stack forward instead.

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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triadic.pallas.common import F32, call, mm, over_value_blocks, rowsum, total


def padded_width(n: int) -> int:
  """The kernels' width of a D or V dim of n: the next power of two, at least 16."""
  return max(16, 1 << (n - 1).bit_length())


def num_visible(nc: int, cps: int) -> int:
  """VIS: the number of (segment i, chunk n >= n_i) pairs, the stored states per batch*head."""
  return sum(nc - i * cps for i in range(-(-nc // cps)))


def index(i, n, nc: int, cps: int):
  """Where S_n^i lives in the compact stack: the pairs of segments j < i, then n - n_i."""
  return i * nc - cps * (i * (i - 1)) // 2 + n - i * cps


def _segment_bounds(nc, cps):
  """(first chunk, end of the write phase) of the program's segment, from its grid index."""
  start = pl.program_id(2) * cps
  return start, jnp.minimum(start + cps, nc)


def _read(qe, lam_ref, finished, current, cur, dtype):
  """sum_{i < cur} (lam_i Qe) finished(i) + (lam_cur Qe) current: the readout of one chunk."""
  acc = jax.lax.fori_loop(0, cur, lambda i, acc: acc + mm(lam_ref[i] * qe, finished(i), dtype),
                          jnp.zeros((qe.shape[0], current.shape[-1]), F32))
  return acc + mm(lam_ref[cur] * qe, current, dtype)


def _store_output(o_ref, o, intra_ref, own_ref, scale):
  """The op's output tile: scale (o + own intra) in float32, rounded once to the output dtype."""
  o_ref[...] = (scale * (o + own_ref[...] * intra_ref[...])).astype(o_ref.dtype)


def _read_gradients(qe, lam_ref, do_ref, dlam_ref, finished, current, cur, vd, bv, dtype):
  """The read's dQe (returned) and dlam (written to ``dlam_ref[i]``, i <= cur) for one chunk:
  dQe = sum_i lam_i (dO S_i^T), dlam_i = rowsum(dO * (Qe S_i)); finished(i, cols) and
  current(cols) give the states' value-block tiles."""
  c, d = qe.shape

  def state(tile, i, dqe):
    def block(cols, carry):
      dq, dlam = carry
      s, do = tile(cols), do_ref[:, cols]
      return (dq + mm(do, s, dtype, tb=True),
              dlam + rowsum(do.astype(F32) * mm(qe, s, dtype)))

    dq, dlam = over_value_blocks(vd, bv, block, (jnp.zeros((c, d), F32),
                                                 jnp.zeros((c, 1), F32)))
    dlam_ref[i] = dlam
    return dqe + lam_ref[i] * dq

  dqe = jax.lax.fori_loop(0, cur, lambda i, dqe: state(functools.partial(finished, i), i, dqe),
                          jnp.zeros((c, d), F32))
  return state(current, cur, dqe)


# ---- erase: the carried stack ----

def _stack_kernel(w_ref, kw_ref, uv_ref, gam_ref, states_ref, *, nc, cps, dtype):
  i = pl.program_id(2)
  start, end = _segment_bounds(nc, cps)

  def chunk(n, s, write):
    states_ref[index(i, n, nc, cps)] = s.astype(states_ref.dtype)
    kw = kw_ref[n]
    new = gam_ref[n] * s - mm(kw, mm(w_ref[n], s, dtype), dtype, ta=True)
    return new + mm(kw, uv_ref[n], dtype, ta=True) if write else new

  d, bv = states_ref.shape[-2:]
  s = jax.lax.fori_loop(start, end, lambda n, s: chunk(n, s, True), jnp.zeros((d, bv), F32))
  jax.lax.fori_loop(end, nc, lambda n, s: chunk(n, s, False), s)


def _stack_readout_kernel(qe_ref, lam_ref, states_ref, intra_ref, own_ref, o_ref, *, nc, cps,
                          scale, dtype):
  n = pl.program_id(1)
  cur = n // cps
  o = _read(qe_ref[...].astype(F32), lam_ref, lambda i: states_ref[index(i, n, nc, cps)],
            states_ref[index(cur, n, nc, cps)], cur, dtype)
  _store_output(o_ref, o, intra_ref, own_ref, scale)


def _stack_reverse_kernel(qe_ref, w_ref, kw_ref, lam_ref, gam_ref, do_ref, dstates_ref, duv_ref,
                          *, nc, cps, dtype):
  i = pl.program_id(2)
  start, end = _segment_bounds(nc, cps)

  def chunk(n, ds, write):
    dstates_ref[index(i, n, nc, cps)] = ds.astype(dstates_ref.dtype)
    y = mm(kw_ref[n], ds, dtype)
    if write:
      duv_ref[n] = y.astype(duv_ref.dtype)
    return (gam_ref[n] * ds + mm(lam_ref[n] * qe_ref[n].astype(F32), do_ref[n], dtype, ta=True)
            - mm(w_ref[n], y, dtype, ta=True))

  d, bv = dstates_ref.shape[-2:]
  ds = jax.lax.fori_loop(0, nc - end, lambda j, ds: chunk(nc - 1 - j, ds, False),
                         jnp.zeros((d, bv), F32))
  jax.lax.fori_loop(0, end - start, lambda j, ds: chunk(end - 1 - j, ds, True), ds)


def _stack_gradients_kernel(qe_ref, w_ref, kw_ref, uv_ref, lam_ref, do_ref, states_ref,
                            dstates_ref, dqe_ref, dw_ref, dkw_ref, dgam_ref, dlam_ref, *, nc, cps,
                            vd, bv, dtype):
  """Program (bh, chunk n): one walk over the visible states i <= s(n) and the value blocks,
  each state S_n^i and its gradient dS^i_{n+1} read once, accumulating

      dQe = sum_i (lam_i dO) S_i^T,   dlam_i = rowsum(dO * (Qe S_i)),   G = sum_i dS_i S_i^T.

  The three erase-term gradients share the chunk's Kw and W across the states, so they follow
  from the (D, D) sum G alone: dW = -Kw G, dKw = -W G^T (+ Uv dS_{s(n)}^T, the write into the
  current state), dgamma = trace(G). Per state and value column that is one D x D product
  instead of the four C x D ones of forming W S and Kw dS per state."""
  n = _heaviest_first(nc)(pl.program_id(1))
  cur = n // cps
  c, d = qe_ref.shape
  qe = qe_ref[...]
  tile = lambda ref, i, cols: ref[index(i, n, nc, cps), :, cols]

  def state(i, carry):
    def block(cols, carry):
      dqe, dlam, g = carry
      s, ds, do = tile(states_ref, i, cols), tile(dstates_ref, i, cols), do_ref[:, cols]
      return (dqe + mm(lam_ref[i] * do.astype(F32), s, dtype, tb=True),
              dlam + rowsum(do.astype(F32) * mm(qe, s, dtype)),
              g + mm(ds, s, dtype, tb=True))

    dqe, g = carry
    dqe, dlam, g = over_value_blocks(vd, bv, block, (dqe, jnp.zeros((c, 1), F32), g))
    dlam_ref[i] = dlam
    return dqe, g

  dqe, g = jax.lax.fori_loop(0, cur + 1, state, (jnp.zeros((c, d), F32), jnp.zeros((d, d), F32)))
  dqe_ref[...] = dqe.astype(dqe_ref.dtype)
  diagonal = (jax.lax.broadcasted_iota(jnp.int32, (d, d), 0)
              == jax.lax.broadcasted_iota(jnp.int32, (d, d), 1))
  dgam_ref[...] = total(jnp.where(diagonal, g, 0.0))
  dw_ref[...] = (-mm(kw_ref[...], g, dtype)).astype(dw_ref.dtype)
  dkw = over_value_blocks(   # the write Kw^T Uv into the current state
      vd, bv, lambda cols, dkw: dkw + mm(uv_ref[:, cols], tile(dstates_ref, cur, cols), dtype,
                                         tb=True), -mm(w_ref[...], g, dtype, tb=True))
  dkw_ref[...] = dkw.astype(dkw_ref.dtype)


# ---- no erase: rescaled states ----

def _write_kernel(*refs, nc, cps, erase, dtype):
  """Segment i's write phase from a zero state: each chunk's start state into ``cur_ref`` and the
  segment's end state into ``end_ref[i]``; with ``erase`` (a W operand first) the erase update,
  by the same operations as ``_stack_kernel``'s, else gamma S + Kw^T Uv."""
  w_ref = refs[0] if erase else None
  kw_ref, uv_ref, gam_ref, cur_ref, end_ref = refs[erase:]
  i = pl.program_id(2)
  start, end = _segment_bounds(nc, cps)

  def chunk(n, s):
    cur_ref[n] = s.astype(cur_ref.dtype)
    if not erase:
      return gam_ref[n] * s + mm(kw_ref[n], uv_ref[n], dtype, ta=True)
    kw = kw_ref[n]
    new = gam_ref[n] * s - mm(kw, mm(w_ref[n], s, dtype), dtype, ta=True)
    return new + mm(kw, uv_ref[n], dtype, ta=True)

  d, bv = cur_ref.shape[-2:]
  s = jax.lax.fori_loop(start, end, chunk, jnp.zeros((d, bv), F32))
  end_ref[i] = s.astype(end_ref.dtype)


def _rescaled_readout_kernel(qe_ref, lam_ref, end_ref, cur_ref, intra_ref, own_ref, o_ref, *, cps,
                             scale, dtype):
  cur = pl.program_id(1) // cps
  o = _read(qe_ref[...].astype(F32), lam_ref, lambda i: end_ref[i], cur_ref[...], cur, dtype)
  _store_output(o_ref, o, intra_ref, own_ref, scale)


def _rescaled_reverse_kernel(qe_ref, kw_ref, uv_ref, lam_ref, gam_ref, do_ref, cur_ref, duv_ref,
                             dkw_ref, dgam_ref, *, nc, cps, dtype):
  start, end = _segment_bounds(nc, cps)
  read = lambda n: mm(lam_ref[n] * qe_ref[n].astype(F32), do_ref[n], dtype, ta=True)
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

def _walk_kernel(qe_ref, lam_ref, w_ref, kw_ref, gam_ref, cur_ref, end_ref, u_ref, intra_ref,
                 own_ref, o_ref, *, nc, cps, scale, dtype):
  """Program (bh, chunk n), the last chunk first (``_heaviest_first``), over the whole V: the
  query p = Qe_n walks back through the chunk maps T_m = gamma_m I - Kw_m^T W_m of its own
  segment (p <- gamma_m p - (p Kw_m^T) W_m, m = n - 1 down to n_s), then reads each earlier
  segment's end state and crosses that segment by its composite U_j:

      o_n = (lam_s Qe_n) S_n + sum_{j < s} (lam_j p_j) S_end^j,   p_{j-1} = p_j U_j

  (S_n the current segment's state at the chunk's start). p and o stay float32; each product
  takes its operands in the input dtype, as the state passes do. The last segment crossed needs
  no composite: the walk multiplies by U_j only for j >= 1, and segment 0's read is weighted
  by zero where the chunk lies in segment 0 itself (its state is then S_n)."""
  n = _heaviest_first(nc)(pl.program_id(1))
  s = n // cps
  qe = qe_ref[...].astype(F32)
  o = mm(lam_ref[s] * qe, cur_ref[...], dtype)

  def own_chunk(k, p):  # m = n - 1 - k, down to the segment's first chunk
    m = n - 1 - k
    return gam_ref[m] * p - mm(mm(p, kw_ref[m], dtype, tb=True), w_ref[m], dtype)

  p = jax.lax.fori_loop(0, n - s * cps, own_chunk, qe)

  def segment(k, carry):  # j = s - 1 - k, down to 1
    o, p = carry
    j = s - 1 - k
    return o + mm(lam_ref[j] * p, end_ref[j], dtype), mm(p, u_ref[j], dtype)

  o, p = jax.lax.fori_loop(0, jnp.maximum(s - 1, 0), segment, (o, p))
  o = o + mm(jnp.where(s > 0, lam_ref[0], 0.0) * p, end_ref[0], dtype)
  _store_output(o_ref, o, intra_ref, own_ref, scale)


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


def _chunk_spec(*shape, chunk=lambda p: p):
  """One chunk's block on a (BH, NC, ...) grid; ``chunk`` maps the program index to the chunk."""
  return pl.BlockSpec((None, None, *shape), lambda b, p, *_: (b, chunk(p)) + (0,) * len(shape))


def _lam_of_chunk(ns, c, chunk=lambda p: p):
  """lam (BH, NS, NC, C, 1): every segment's weights of the program's chunk, (NS, C, 1)."""
  return pl.BlockSpec((None, ns, None, c, 1), lambda b, p, *_: (b, 0, chunk(p), 0, 0))


def _lam_of_segment(nc, c):
  """lam (BH, NS, NC, C, 1): the program's segment's weights of every chunk, (NC, C, 1)."""
  return pl.BlockSpec((None, None, nc, c, 1), lambda b, j, i: (b, i, 0, 0, 0))


def stack_state_pass(w, kw, uv, gam, *, cps, cfg):
  """Erase forward state pass: every visible chunk-start state, (BH, VIS, D, V) in kw's dtype.
  Grid (BH, V / block_v, NS)."""
  bh, nc, c, d = kw.shape
  vd = uv.shape[-1]
  bv = min(cfg.block_v, vd)
  vis = num_visible(nc, cps)
  kernel = functools.partial(_stack_kernel, nc=nc, cps=cps, dtype=kw.dtype)
  return call(kernel, cfg=cfg, grid=(bh, vd // bv, -(-nc // cps)),
              in_specs=[_whole(nc, c, d), _whole(nc, c, d), _vblock(nc, c, bv), _whole(nc, 1, 1)],
              out_specs=_vblock(vis, d, bv),
              out_shape=jax.ShapeDtypeStruct((bh, vis, d, vd), kw.dtype),
              semantics=None, name="merlin_state_pass")(w, kw, uv, gam)


def _readout_call(kernel, qe, lam, state_specs, states, intra, own, heads, cfg, *, bv=None,
                  chunk=lambda p: p, name="merlin_readout", num_warps=None):
  """The readout launch: program (bh, p, j) reads chunk n = chunk(p)'s Qe, lam, own and value
  block j (``bv`` columns, default bwd_block_v) of intra and of the states, and writes the
  output's (C, bv) tile in qe's dtype into the caller's (B, NC * C, H, V) layout: row bh is batch
  bh // H, head bh % H (the head dim squeezed, a strided block), so the output needs no relayout
  after."""
  bh, nc, c, d = qe.shape
  vd = intra.shape[-1]
  bv = min(bv or cfg.bwd_block_v, vd)
  return call(kernel, cfg=cfg, grid=(bh, nc, vd // bv),
              in_specs=[_chunk_spec(c, d, chunk=chunk), _lam_of_chunk(lam.shape[1], c, chunk)]
                       + state_specs
                       + [pl.BlockSpec((None, None, c, bv), lambda b, p, j: (b, chunk(p), 0, j)),
                          _chunk_spec(c, 1, chunk=chunk)],
              out_specs=pl.BlockSpec((None, c, None, bv),
                                     lambda b, p, j: (b // heads, chunk(p), b % heads, j)),
              out_shape=jax.ShapeDtypeStruct((bh // heads, nc * c, heads, vd), qe.dtype),
              semantics=None, name=name, num_warps=num_warps)(qe, lam, *states, intra, own)


def stack_readout(qe, lam, states, intra, own, *, cps, scale, heads, cfg):
  """The erase output: scale (o_n + own_n intra_n) with o_n = sum_{i <= s(n)} (lam_n,i Qe_n) S_n^i
  from the stored stack and the intra-chunk part intra = P Uv (BH, NC, C, V), weighted by own
  (BH, NC, C, 1), each token's lam of its own segment (both float32): summed in float32 and
  stored once in qe's dtype (the op's output dtype), (B, NC * C, H, V) with H = ``heads``
  (``_readout_call``). Grid (BH, NC, V / bwd_block_v)."""
  nc, d = qe.shape[1], qe.shape[-1]
  vis, vd = states.shape[1], states.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  kernel = functools.partial(_stack_readout_kernel, nc=nc, cps=cps, scale=scale, dtype=qe.dtype)
  spec = pl.BlockSpec((None, vis, d, bv), lambda b, n, j: (b, 0, 0, j))
  return _readout_call(kernel, qe, lam, [spec], [states], intra, own, heads, cfg)


def stack_reverse_state_pass(qe, w, kw, lam, gam, do, *, cps, cfg):
  """Erase reverse state pass: dS^i_{n+1} at ``index(i, n)`` (BH, VIS, D, V) and dUv
  (BH, NC, C, V), both in qe's dtype (dUv's one use is the op's cotangent of Uv, which has that
  dtype). Grid (BH, V / bwd_block_v, NS) at bwd_num_warps; do (BH, NC, C, V) in qe's dtype."""
  bh, nc, c, d = qe.shape
  vd = do.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  vis = num_visible(nc, cps)
  kernel = functools.partial(_stack_reverse_kernel, nc=nc, cps=cps, dtype=qe.dtype)
  return call(kernel, cfg=cfg, grid=(bh, vd // bv, lam.shape[1]),
              in_specs=[_whole(nc, c, d)] * 3 + [_lam_of_segment(nc, c), _whole(nc, 1, 1),
                                                 _vblock(nc, c, bv)],
              out_specs=[_vblock(vis, d, bv), _vblock(nc, c, bv)],
              out_shape=[jax.ShapeDtypeStruct((bh, vis, d, vd), qe.dtype),
                         jax.ShapeDtypeStruct((bh, nc, c, vd), qe.dtype)],
              semantics=None, name="merlin_reverse_state_pass",
              num_warps=cfg.bwd_num_warps)(qe, w, kw, lam, gam, do)


def stack_chunk_gradients(qe, w, kw, uv, lam, do, states, dstates, *, cps, cfg):
  """Erase: dQe, dW, dKw (BH, NC, C, D) in qe's dtype (the op's cotangents of those operands, which
  have it: summed in float32, rounded once at the store), dgamma (BH, NC, 1, 1) and dlam
  (BH, NC, NS, C, 1; entries i > s(n) unwritten) float32. Grid (BH, NC), the last chunk first
  (``_heaviest_first``)."""
  bh, nc, c, d = qe.shape
  vis, vd = states.shape[1], states.shape[-1]
  ns = lam.shape[1]
  order = _heaviest_first(nc)
  per_chunk = lambda *s: _chunk_spec(*s, chunk=order)
  stack = pl.BlockSpec((None, vis, d, vd), lambda b, p: (b, 0, 0, 0))
  shape = lambda *s, dtype=F32: jax.ShapeDtypeStruct((bh, nc, *s), dtype)
  kernel = functools.partial(_stack_gradients_kernel, nc=nc, cps=cps, vd=vd,
                             bv=min(cfg.bwd_block_v, vd), dtype=qe.dtype)
  return call(kernel, cfg=cfg, grid=(bh, nc),
              in_specs=[per_chunk(c, d)] * 3 + [per_chunk(c, vd), _lam_of_chunk(ns, c, order),
                                                per_chunk(c, vd), stack, stack],
              out_specs=[per_chunk(c, d)] * 3 + [per_chunk(1, 1), per_chunk(ns, c, 1)],
              out_shape=[shape(c, d, dtype=qe.dtype)] * 3 + [shape(1, 1), shape(ns, c, 1)],
              semantics=None, name="merlin_chunk_gradients",
              num_warps=cfg.bwd_num_warps)(qe, w, kw, uv, lam, do, states, dstates)


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
  ``stack_readout``'s: (B, NC * C, H, V) in qe's dtype."""
  ns, d, vd = end.shape[1:]
  bv = min(cfg.bwd_block_v, vd)
  kernel = functools.partial(_rescaled_readout_kernel, cps=cps, scale=scale, dtype=qe.dtype)
  specs = [pl.BlockSpec((None, ns, d, bv), lambda b, n, j: (b, 0, 0, j)),
           pl.BlockSpec((None, None, d, bv), lambda b, n, j: (b, n, 0, j))]
  return _readout_call(kernel, qe, lam, specs, [end, cur], intra, own, heads, cfg)


def walk_readout(qe, lam, w, kw, gam, cur, end, composites, intra, own, *, cps, scale, heads,
                 cfg):
  """The erase output without a stack of states (forward only): scale (o_n + own_n intra_n),
  o_n = sum_{i <= s(n)} (lam_n,i Qe_n) S_n^i formed by walking the query back through the chunk
  maps (``_walk_kernel``) from each chunk's current state ``cur`` (BH, NC, D, V), the segments'
  end states ``end`` (BH, NS, D, V) (both ``write_pass`` with W) and the segments' composite maps
  ``composites`` U_j = T_{e_j - 1} ... T_{n_j} (BH, NS, D, D), all in qe's dtype; stored as
  ``stack_readout``'s: (B, NC * C, H, V) in qe's dtype. Grid (BH, NC), the last chunk first, one
  program over the whole V: the walk of p (C, D) does not depend on the value columns, so value
  blocks would repeat it. At ``bwd_num_warps``: p and o, two float32 (C, D) and (C, V) arrays,
  spill at 4 warps at C = 64, D = V = 128 (192 bytes a thread, benchmarks/triton_registers.py
  --merlin) and fit at 8."""
  nc, c, d = qe.shape[1:]
  ns, vd = end.shape[1], end.shape[-1]
  order = _heaviest_first(nc)
  kernel = functools.partial(_walk_kernel, nc=nc, cps=cps, scale=scale, dtype=qe.dtype)
  whole = lambda *shape: pl.BlockSpec((None, *shape), lambda b, p, j: (b,) + (0,) * len(shape))
  specs = [whole(nc, c, d), whole(nc, c, d), whole(nc, 1, 1), _chunk_spec(d, vd, chunk=order),
           whole(ns, d, vd), whole(ns, d, d)]
  return _readout_call(kernel, qe, lam, specs, [w, kw, gam, cur, end, composites], intra, own,
                       heads, cfg, bv=vd, chunk=order, name="merlin_walk_readout",
                       num_warps=cfg.bwd_num_warps)


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
