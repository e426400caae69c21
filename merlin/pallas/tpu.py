"""The state work of ``kernels.py`` in the TPU structure: Mosaic TPU kernels, the walks on the grid.

``kernels.py``'s Triton programs walk chunks, segments or spans in a loop over blocks that span
the whole sequence (a Triton block is a pointer into HBM). Mosaic TPU copies every block into
VMEM, so here each block is one chunk, one state or one span map, and each walk is the last,
sequential ("arbitrary") grid axis, its carry (a state, Phi, L, a sum) in VMEM scratch or in an
output block whose index stays fixed along the walk (Mosaic writes an output block back to HBM
when its index changes, once). A program's VMEM is then the same at every T. The math and the
stored arrays are ``kernels.py``'s (its module docstring), stage by stage, with the same
signatures and results, so ``ops.py`` runs either module (``stages``); only the splits differ:

  span_state_pass      write pass (own segment, chunk by chunk, each segment's end state) ->
                       span crossing (grid (BH, V / bv, segment i, span j > i): S <- U_j S)
  span_reverse_pass    later spans (grid (BH, V / bv, i, span j from the last, chunk of j):
                       the span-end gradients and dS at the own segment's end) -> own segment
                       (chunk by chunk in reverse: dS, dUv)
  span_sums            K_j = sum_i dS_{b'}^i S_b^iT (grid (BH, span j, i, V / bv)) -> the
                       span's chunks in reverse with L (grid (BH, j, chunk))
  readouts, chunk      grid (BH, chunk, V / bv, state i) and (BH, chunk, state i, V / bv): the
  gradients            states read one a step, the sum in scratch or in the output block

A walk whose length varies (a segment's later spans, the last partial span's chunks) runs on a
grid axis as long as the longest; the steps past its end do nothing, and every output block index
they map to is the last one the walk wrote, so nothing is written back for them. Only the
per-token operands' (C, 1) and scalar blocks are narrower than Mosaic's (8, 128) tiles, which
they equal as whole trailing dims. The readout writes (BH, NC, C, V), moved to the caller's
(B, T, H, V) by one XLA transpose (a squeezed head dim is not a Mosaic block). Value blocks of
``Config.block_v`` / ``bwd_block_v`` columns must be multiples of 128 or the whole V on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from merlin.pallas.kernels import (chunk_map, identity, num_pairs, span_index, store_output,
                                   write_step)
from triadic.pallas.common import F32, call, mm, rowsum, token_major, total

WHOLE = ...  # a one-chunk block is read whole: ``write_step``'s chunk index


def _segment_of(n, cps):
  """The segment of chunk n, a traced int >= 0 (``lax.div``: Mosaic TPU lowers no floor
  division)."""
  return jax.lax.div(n, cps)


def _finished(fin_index, i, n, cps):
  """Where chunk n's finished state i lives (``fin_index(i, segment)``), i clamped to the last
  one (segment - 1, or 0 in segment 0) for the steps past them."""
  s = _segment_of(n, cps)
  return fin_index(jnp.minimum(i, jnp.maximum(s - 1, 0)), s)


def _spec(shape, index):
  """A BlockSpec of ``shape`` (None: a squeezed dim) whose index map returns ``index(*grid)``."""
  return pl.BlockSpec(shape, lambda *g: tuple(index(*g)))


def _forward_chunk(i, m, nc, cps):
  """Chunk m of segment / span i, clamped to the last chunk (a short last span's extra steps)."""
  return jnp.minimum(i * cps + m, nc - 1)


def _reverse_chunk(i, m, nc, cps):
  """Chunk m from the end of segment / span i, clamped to its first chunk."""
  return jnp.maximum(jnp.minimum((i + 1) * cps, nc) - 1 - m, i * cps)


def _steps(i, nc, cps):
  """The chunks of segment / span i."""
  return jnp.minimum((i + 1) * cps, nc) - i * cps


def _call(kernel, *, cfg, grid, in_specs, outs, scratch, name, parallel):
  """``call`` on a grid whose first ``parallel`` axes are independent and the rest sequential."""
  semantics = ("parallel",) * parallel + ("arbitrary",) * (len(grid) - parallel)
  return call(kernel, cfg=cfg, grid=grid, in_specs=in_specs, out_specs=[s for s, _ in outs],
              out_shape=[x for _, x in outs], semantics=semantics, name=name,
              scratch_shapes=[pltpu.VMEM(shape, F32) for shape in scratch])


# ---- erase: span maps ----

def _span_maps_kernel(qe_ref, w_ref, kw_ref, gam_ref, *refs, nc, cps, dtype):
  *phi_ref, p_ref, u_ref, phi_s = refs
  j, m = pl.program_id(1), pl.program_id(2)

  @pl.when(m == 0)
  def _():
    phi_s[...] = identity(phi_s.shape[0])

  @pl.when(m < _steps(j, nc, cps))
  def _():
    phi = phi_s[...]
    if phi_ref:
      phi_ref[0][...] = phi.astype(dtype)
    p_ref[...] = mm(qe_ref[...], phi, dtype).astype(dtype)
    phi_s[...] = chunk_map(phi, gam_ref[...], w_ref[...], kw_ref[...], dtype)

  @pl.when(m == _steps(j, nc, cps) - 1)
  def _():
    u_ref[...] = phi_s[...].astype(dtype)


def span_maps(qe, w, kw, gam, *, cps, cfg, phi=True):
  """``kernels.span_maps``: grid (BH, NS, chunk of the span), Phi in scratch."""
  bh, nc, c, d = kw.shape
  ns = -(-nc // cps)
  at = lambda *s: _spec((None, None, *s), lambda b, j, m: (b, _forward_chunk(j, m, nc, cps))
                        + (0,) * len(s))
  shape = lambda *s: jax.ShapeDtypeStruct((bh, *s), kw.dtype)
  outs = [(at(d, d), shape(nc, d, d))] if phi else []
  outs += [(at(c, d), shape(nc, c, d)),
           (_spec((None, None, d, d), lambda b, j, m: (b, j, 0, 0)), shape(ns, d, d))]
  kernel = functools.partial(_span_maps_kernel, nc=nc, cps=cps, dtype=kw.dtype)
  return _call(kernel, cfg=cfg, grid=(bh, ns, cps), in_specs=[at(c, d)] * 3 + [at(1, 1)],
               outs=outs, scratch=[(d, d)], name="merlin_span_maps", parallel=2)(qe, w, kw, gam)


# ---- the write pass (no erase; erase: the span state pass's own segments) ----

def _write_kernel(*refs, nc, cps, erase, dtype):
  w_ref = refs[0] if erase else None
  kw_ref, uv_ref, gam_ref, cur_ref, end_ref, s_ref = refs[erase:]
  i, m = pl.program_id(2), pl.program_id(3)

  @pl.when(m == 0)
  def _():
    s_ref[...] = jnp.zeros(s_ref.shape, F32)

  @pl.when(m < _steps(i, nc, cps))
  def _():
    s = s_ref[...]
    cur_ref[...] = s.astype(cur_ref.dtype)
    s_ref[...] = write_step(WHOLE, s, w_ref, kw_ref, uv_ref, gam_ref, dtype)

  @pl.when(m == _steps(i, nc, cps) - 1)
  def _():
    end_ref[...] = s_ref[...].astype(end_ref.dtype)


def write_pass(kw, uv, gam, *, cps, cfg, w=None):
  """``kernels.write_pass``: grid (BH, V / block_v, NS, chunk of the segment), S in scratch."""
  bh, nc, c, d = kw.shape
  vd = uv.shape[-1]
  bv = min(cfg.block_v, vd)
  ns = -(-nc // cps)
  erase = w is not None
  chunk = lambda *s: _spec((None, None, *s), lambda b, jv, i, m: (
      b, _forward_chunk(i, m, nc, cps)) + (0,) * len(s))
  vchunk = lambda *s: _spec((None, None, *s, bv), lambda b, jv, i, m: (
      b, _forward_chunk(i, m, nc, cps)) + (0,) * len(s) + (jv,))
  outs = [(vchunk(d), jax.ShapeDtypeStruct((bh, nc, d, vd), kw.dtype)),
          (_spec((None, None, d, bv), lambda b, jv, i, m: (b, i, 0, jv)),
           jax.ShapeDtypeStruct((bh, ns, d, vd), kw.dtype))]
  kernel = functools.partial(_write_kernel, nc=nc, cps=cps, erase=erase, dtype=kw.dtype)
  return _call(kernel, cfg=cfg, grid=(bh, vd // bv, ns, cps),
               in_specs=[chunk(c, d)] * (1 + erase) + [vchunk(c), chunk(1, 1)], outs=outs,
               scratch=[(d, bv)], name="merlin_write_pass", parallel=3)(
                   *([w] if erase else []), kw, uv, gam)


# ---- erase: the span stack ----

def _cross_kernel(end_ref, u_ref, span_ref, s_ref, *, ns, dtype):
  if ns == 1:  # no span after the first: the stack's one entry is never read
    span_ref[...] = jnp.zeros(span_ref.shape, span_ref.dtype)
    return
  i, k = pl.program_id(2), pl.program_id(3)
  live = i + 1 + k < ns  # span j = i + 1 + k exists

  @pl.when(live & (k == 0))
  def _():
    s_ref[...] = end_ref[...].astype(F32)

  @pl.when(live & (k > 0))
  def _():
    s_ref[...] = mm(u_ref[...], s_ref[...], dtype)

  @pl.when(live)
  def _():
    span_ref[...] = s_ref[...].astype(span_ref.dtype)


def span_cross(end, u, *, cfg):
  """The span stack (BH, ``num_pairs``, D, V) from each segment's end state ``end``
  (BH, NS, D, V) and the span maps ``u`` (BH, NS, D, D): S^i at span i + 1's start is its end
  state, at span j + 1's start U_j times that at span j's. Grid (BH, V / block_v, segment i,
  later span), in end's dtype."""
  bh, ns, d, vd = end.shape
  bv = min(cfg.block_v, vd)
  last = max(ns - 2, 0)   # the last segment with a later span (ns = 1: none; one unused entry)

  def pair(b, jv, i, k):
    j = jnp.minimum(i + 1 + k, ns - 1)
    return b, span_index(i, j), 0, jv

  specs = [_spec((None, None, d, bv), lambda b, jv, i, k: (b, jnp.minimum(i, last), 0, jv)),
           _spec((None, None, d, d), lambda b, jv, i, k: (
               b, jnp.maximum(jnp.minimum(i + k, ns - 2), 0), 0, 0))]
  out = (_spec((None, None, d, bv), pair),
         jax.ShapeDtypeStruct((bh, num_pairs(ns), d, vd), end.dtype))
  kernel = functools.partial(_cross_kernel, ns=ns, dtype=end.dtype)
  return _call(kernel, cfg=cfg, grid=(bh, vd // bv, max(ns - 1, 1), max(ns - 1, 1)),
               in_specs=specs, outs=[out], scratch=[(d, bv)], name="merlin_span_cross",
               parallel=3)(end, u)[0]


def span_state_pass(w, kw, uv, gam, u, *, cps, cfg):
  """``kernels.span_state_pass``: the write pass with W (``cur``), then ``span_cross``."""
  cur, end = write_pass(kw, uv, gam, cps=cps, cfg=cfg, w=w)
  return cur, span_cross(end, u, cfg=cfg)


# ---- readouts and chunk gradients: grid (BH, NC, ...), one state a step ----

def _per_chunk(c, bv, cps, fin_index, *, value_axis):
  """BlockSpec makers for a (BH, chunk n, ., .) grid whose axis ``value_axis`` (2 or 3) is the
  value block and the other the state i: a chunk's block (``chunk(*shape)``) and its value
  block (``vchunk(*shape)``), lam's weights of state i (the current one past it) and the
  finished state i's value block (``fin(d)``, at ``fin_index``; ``_finished``)."""
  state_axis = 5 - value_axis
  chunk = lambda *s: _spec((None, None, *s), lambda b, n, *_: (b, n) + (0,) * len(s))
  vchunk = lambda *s: _spec((None, None, *s, bv), lambda b, n, *g: (b, n) + (0,) * len(s)
                            + (g[value_axis - 2],))
  lam = _spec((None, None, None, c, 1), lambda b, n, *g: (
      b, jnp.minimum(g[state_axis - 2], _segment_of(n, cps)), n, 0, 0))
  fin = lambda d: _spec((None, None, d, bv), lambda b, n, *g: (
      b, _finished(fin_index, g[state_axis - 2], n, cps), 0, g[value_axis - 2]))
  return chunk, vchunk, lam, fin


def _readout_kernel(r_ref, qe_ref, lam_ref, fin_ref, cur_ref, intra_ref, own_ref, o_ref, acc_ref,
                    *, cps, scale, dtype):
  """Program (bh, chunk n, value block), step i over the states: the finished ones (i < s) read
  with r (P or Qe), the current one (i = s) with Qe, which stores the output."""
  i, s = pl.program_id(3), _segment_of(pl.program_id(1), cps)

  @pl.when(i == 0)
  def _():
    acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

  @pl.when(i < s)
  def _():
    acc_ref[...] += lam_ref[...] * mm(r_ref[...], fin_ref[...], dtype)

  @pl.when(i == s)
  def _():
    o = acc_ref[...] + lam_ref[...] * mm(qe_ref[...], cur_ref[...], dtype)
    store_output(o_ref, o, intra_ref, own_ref, scale)


def _readout(r, qe, lam, finished, fin_index, cur, intra, own, *, cps, scale, heads, cfg):
  bh, nc, c, d = qe.shape
  ns, vd = lam.shape[1], intra.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  chunk, vchunk, lam_spec, fin_spec = _per_chunk(c, bv, cps, fin_index, value_axis=2)
  specs = [chunk(c, d), chunk(c, d), lam_spec, fin_spec(d), vchunk(d), vchunk(c), chunk(c, 1)]
  out = (vchunk(c), jax.ShapeDtypeStruct((bh, nc, c, vd), qe.dtype))
  kernel = functools.partial(_readout_kernel, cps=cps, scale=scale, dtype=qe.dtype)
  o = _call(kernel, cfg=cfg, grid=(bh, nc, vd // bv, ns), in_specs=specs, outs=[out],
            scratch=[(c, bv)], name="merlin_readout", parallel=3)(
                r, qe, lam, finished, cur, intra, own)[0]
  return token_major(o, bh // heads, heads)


def span_readout(qe, lam, p, span, cur, intra, own, *, cps, scale, heads, cfg):
  """``kernels.span_readout``: grid (BH, NC, V / bwd_block_v, state)."""
  return _readout(p, qe, lam, span, lambda i, s: span_index(i, jnp.maximum(s, 1)), cur, intra,
                  own, cps=cps, scale=scale, heads=heads, cfg=cfg)


def rescaled_readout(qe, lam, cur, end, intra, own, *, cps, scale, heads, cfg):
  """``kernels.rescaled_readout``: grid (BH, NC, V / bwd_block_v, state)."""
  return _readout(qe, qe, lam, end, lambda i, s: i, cur, intra, own, cps=cps, scale=scale,
                  heads=heads, cfg=cfg)


# ---- reverse passes ----

def _later_kernel(r_ref, lam_ref, do_ref, *refs, nc, cps, ns, erase, dtype):
  """Program (bh, value block, segment i), steps (k, m): span j = NS - 1 - k (while j > i), its
  chunk m: dS^i from the sequence's end back across the later spans (``kernels``'
  ``_span_reverse_kernel``'s first loop; without erase U = I and r = Qe)."""
  if erase:
    u_ref, dspan_ref, dend_ref, ds_ref = refs
  else:
    dend_ref, ds_ref = refs
  i, k, m = pl.program_id(2), pl.program_id(3), pl.program_id(4)
  j = ns - 1 - k
  live = j > i

  @pl.when((k == 0) & (m == 0))
  def _():
    ds_ref[...] = jnp.zeros(ds_ref.shape, F32)

  if erase:
    @pl.when(live & (m == 0))
    def _():
      dspan_ref[...] = ds_ref[...].astype(dspan_ref.dtype)
      ds_ref[...] = mm(u_ref[...], ds_ref[...], dtype, ta=True)

  @pl.when(live & (m < _steps(j, nc, cps)))
  def _():
    ds_ref[...] += mm(r_ref[...], lam_ref[...] * do_ref[...].astype(F32), dtype, ta=True)

  @pl.when((k == pl.num_programs(3) - 1) & (m == cps - 1))
  def _():
    dend_ref[...] = ds_ref[...]


def _later_spans(r, lam, do, u, *, cps, cfg):
  """dS^i at the end of segment i's own span (BH, NS - 1 (at least 1), D, V) float32 and, with
  the span maps ``u`` (erase), the span-end gradients (BH, ``num_pairs``, D, V) in r's dtype."""
  bh, nc, c, d = r.shape
  ns, vd = lam.shape[1], do.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  last = max(ns - 2, 0)
  erase = u is not None

  def span(i, k):  # the span of step k, clamped to the last live one (i + 1) past the walk
    i = jnp.minimum(i, last)
    return i, jnp.minimum(jnp.maximum(ns - 1 - k, i + 1), ns - 1)

  def chunk(i, k, m):
    return _forward_chunk(span(i, k)[1], m, nc, cps)

  specs = [_spec((None, None, c, d), lambda b, jv, i, k, m: (b, chunk(i, k, m), 0, 0)),
           _spec((None, None, None, c, 1), lambda b, jv, i, k, m: (
               b, jnp.minimum(i, last), chunk(i, k, m), 0, 0)),
           _spec((None, None, c, bv), lambda b, jv, i, k, m: (b, chunk(i, k, m), 0, jv))]
  outs = []
  if erase:
    specs.append(_spec((None, None, d, d), lambda b, jv, i, k, m: (b, span(i, k)[1], 0, 0)))
    outs.append((_spec((None, None, d, bv), lambda b, jv, i, k, m: (
        b, span_index(*span(i, k)), 0, jv)),
                 jax.ShapeDtypeStruct((bh, num_pairs(ns), d, vd), r.dtype)))
  outs.append((_spec((None, None, d, bv), lambda b, jv, i, k, m: (b, i, 0, jv)),
               jax.ShapeDtypeStruct((bh, max(ns - 1, 1), d, vd), F32)))
  kernel = functools.partial(_later_kernel, nc=nc, cps=cps, ns=ns, erase=erase, dtype=r.dtype)
  steps = max(ns - 1, 1)
  return _call(kernel, cfg=cfg, grid=(bh, vd // bv, steps, steps, cps), in_specs=specs,
               outs=outs, scratch=[(d, bv)], name="merlin_later_spans", parallel=3)(
                   r, lam, do, *([u] if erase else []))


def _own_kernel(*refs, nc, cps, ns, erase, dtype):
  """Program (bh, value block, segment i), step m: chunk n = (segment end) - 1 - m, from the
  gradient at the segment's end (zero for the last segment): ``_span_reverse_kernel``'s own loop
  (erase: dS^i_{n+1}, dUv) or ``_rescaled_reverse_kernel``'s (dUv, partial dKw and dgamma)."""
  if erase:
    qe_ref, w_ref, kw_ref, lam_ref, gam_ref, do_ref, dend_ref, dcur_ref, duv_ref, ds_ref = refs
  else:
    (qe_ref, kw_ref, uv_ref, lam_ref, gam_ref, do_ref, cur_ref, dend_ref, duv_ref, dkw_ref,
     dgam_ref, ds_ref) = refs
  i, m = pl.program_id(2), pl.program_id(3)

  @pl.when(m == 0)
  def _():
    ds_ref[...] = jnp.where(i < ns - 1, dend_ref[...], 0.0)

  @pl.when(m < _steps(i, nc, cps))
  def _():
    ds, kw = ds_ref[...], kw_ref[...]
    y = mm(kw, ds, dtype)
    duv_ref[...] = y.astype(duv_ref.dtype)
    carried = gam_ref[...] * ds + mm(qe_ref[...], lam_ref[...] * do_ref[...].astype(F32), dtype,
                                     ta=True)
    if erase:
      dcur_ref[...] = ds.astype(dcur_ref.dtype)
      ds_ref[...] = carried - mm(w_ref[...], y, dtype, ta=True)
    else:
      dkw_ref[...] = mm(uv_ref[...], ds, dtype, tb=True)
      dgam_ref[...] = total(ds * cur_ref[...].astype(F32))
      ds_ref[...] = carried


def _own_segments(qe, kw, lam, gam, do, dend, *, cps, cfg, w=None, uv=None, cur=None):
  bh, nc, c, d = qe.shape
  ns, vd = lam.shape[1], do.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  nv = vd // bv
  erase = w is not None
  n_of = lambda i, m: _reverse_chunk(i, m, nc, cps)
  chunk = lambda *s: _spec((None, None, *s), lambda b, jv, i, m: (b, n_of(i, m)) + (0,) * len(s))
  vchunk = lambda *s: _spec((None, None, *s, bv), lambda b, jv, i, m: (b, n_of(i, m))
                            + (0,) * len(s) + (jv,))
  lam_spec = _spec((None, None, None, c, 1), lambda b, jv, i, m: (b, i, n_of(i, m), 0, 0))
  dend_spec = _spec((None, None, d, bv), lambda b, jv, i, m: (
      b, jnp.minimum(i, max(ns - 2, 0)), 0, jv))
  vshape = lambda *s, dtype=qe.dtype: jax.ShapeDtypeStruct((bh, nc, *s, vd), dtype)
  if erase:
    specs = [chunk(c, d)] * 3 + [lam_spec, chunk(1, 1), vchunk(c), dend_spec]
    operands = (qe, w, kw, lam, gam, do, dend)
    outs = [(vchunk(d), vshape(d)), (vchunk(c), vshape(c))]
  else:
    specs = [chunk(c, d)] * 2 + [vchunk(c), lam_spec, chunk(1, 1), vchunk(c), vchunk(d),
                                 dend_spec]
    operands = (qe, kw, uv, lam, gam, do, cur, dend)
    per_block = lambda *s: _spec((None, None, None, *s), lambda b, jv, i, m: (
        b, jv, n_of(i, m)) + (0,) * len(s))
    outs = [(vchunk(c), vshape(c)),
            (per_block(c, d), jax.ShapeDtypeStruct((bh, nv, nc, c, d), F32)),
            (per_block(1, 1), jax.ShapeDtypeStruct((bh, nv, nc, 1, 1), F32))]
  kernel = functools.partial(_own_kernel, nc=nc, cps=cps, ns=ns, erase=erase, dtype=qe.dtype)
  return _call(kernel, cfg=cfg, grid=(bh, nv, ns, cps), in_specs=specs, outs=outs,
               scratch=[(d, bv)], name="merlin_own_reverse", parallel=3)(*operands)


def span_reverse_pass(qe, p, w, kw, u, lam, gam, do, *, cps, cfg):
  """``kernels.span_reverse_pass``: the later spans, then the own segments."""
  dspan, dend = _later_spans(p, lam, do, u, cps=cps, cfg=cfg)
  dcur, duv = _own_segments(qe, kw, lam, gam, do, dend, cps=cps, cfg=cfg, w=w)
  return dspan, dcur, duv


def rescaled_reverse_pass(qe, kw, uv, lam, gam, do, cur, *, cps, cfg):
  """``kernels.rescaled_reverse_pass``: dS_end^i from the later chunks' reads, then the own
  segments."""
  (dend,) = _later_spans(qe, lam, do, None, cps=cps, cfg=cfg)
  return _own_segments(qe, kw, lam, gam, do, dend, cps=cps, cfg=cfg, uv=uv, cur=cur)


# ---- the chunks' gradients ----

def _gradients_kernel(*refs, cps, erase, dtype):
  """Program (bh, chunk n), steps (state i, value block): the finished states (i < s) read with
  r (P or Qe) give Y (erase; without erase dQe directly) and dlam_i; the current state (i = s)
  dQe's own part, dlam_s and (erase) the own parts of dW, dKw, dgamma (``kernels``'
  ``_span_gradients_kernel``, ``_rescaled_gradients_kernel``)."""
  if erase:
    (r_ref, qe_ref, phi_ref, w_ref, uv_ref, duv_ref, lam_ref, do_ref, fin_ref, cur_ref, dcur_ref,
     dqe_ref, y_ref, dw_ref, dkw_ref, dgam_ref, dlam_ref, dq_ref) = refs
  else:
    (r_ref, qe_ref, lam_ref, do_ref, fin_ref, cur_ref, dqe_ref, dlam_ref, dq_ref) = refs
    y_ref = dq_ref
  i, jv = pl.program_id(2), pl.program_id(3)
  s = _segment_of(pl.program_id(1), cps)
  first = jv == 0

  @pl.when((i == 0) & first)
  def _():
    y_ref[...] = jnp.zeros(y_ref.shape, F32)

  @pl.when((i <= s) & first)
  def _():
    dlam_ref[...] = jnp.zeros(dlam_ref.shape, F32)

  @pl.when(i < s)
  def _():
    st, do = fin_ref[...], do_ref[...].astype(F32)
    y_ref[...] += mm(lam_ref[...] * do, st, dtype, tb=True)
    dlam_ref[...] += rowsum(do * mm(r_ref[...], st, dtype))

  @pl.when(i == s)
  def _():
    st, do, qe = cur_ref[...], do_ref[...].astype(F32), qe_ref[...]
    if erase:
      @pl.when(first)
      def _():
        dq_ref[...] = mm(y_ref[...], phi_ref[...], dtype, tb=True)
        dgam_ref[...] = jnp.zeros(dgam_ref.shape, F32)
        dw_ref[...] = jnp.zeros(dw_ref.shape, F32)
        dkw_ref[...] = jnp.zeros(dkw_ref.shape, F32)

      dst = dcur_ref[...]
      dgam_ref[...] += total(dst.astype(F32) * st.astype(F32))
      dw_ref[...] -= mm(duv_ref[...], st, dtype, tb=True)
      dkw_ref[...] += mm(uv_ref[...].astype(F32) - mm(w_ref[...], st, dtype), dst, dtype,
                         tb=True)
    dq_ref[...] += mm(lam_ref[...] * do, st, dtype, tb=True)
    dlam_ref[...] += rowsum(do * mm(qe, st, dtype))

    @pl.when(jv == pl.num_programs(3) - 1)
    def _():
      dqe_ref[...] = dq_ref[...].astype(dqe_ref.dtype)


def _chunk_gradients(r, qe, lam, do, finished, fin_index, cur, *, cps, cfg, erase_operands=None):
  bh, nc, c, d = qe.shape
  ns, vd = lam.shape[1], do.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  chunk, vchunk, lam_spec, fin = _per_chunk(c, bv, cps, fin_index, value_axis=3)
  fin_spec = fin(d)
  shape = lambda *s, dtype=F32: jax.ShapeDtypeStruct((bh, nc, *s), dtype)
  dlam = (_spec((None, None, None, c, 1), lambda b, n, i, jv: (
      b, n, jnp.minimum(i, _segment_of(n, cps)), 0, 0)), shape(ns, c, 1))
  dqe = (chunk(c, d), shape(c, d, dtype=qe.dtype))
  erase = erase_operands is not None
  if erase:
    phi, w, uv, duv, dcur = erase_operands
    specs = [chunk(c, d), chunk(c, d), chunk(d, d), chunk(c, d), vchunk(c), vchunk(c), lam_spec,
             vchunk(c), fin_spec, vchunk(d), vchunk(d)]
    operands = (r, qe, phi, w, uv, duv, lam, do, finished, cur, dcur)
    outs = [dqe] + [(chunk(c, d), shape(c, d))] * 3 + [(chunk(1, 1), shape(1, 1)), dlam]
  else:
    specs = [chunk(c, d), chunk(c, d), lam_spec, vchunk(c), fin_spec, vchunk(d)]
    operands = (r, qe, lam, do, finished, cur)
    outs = [dqe, dlam]
  kernel = functools.partial(_gradients_kernel, cps=cps, erase=erase, dtype=qe.dtype)
  return _call(kernel, cfg=cfg, grid=(bh, nc, ns, vd // bv), in_specs=specs, outs=outs,
               scratch=[(c, d)], parallel=2,
               name="merlin_chunk_gradients" if erase else "merlin_read_gradients")(*operands)


def span_chunk_gradients(qe, p, phi, w, uv, duv, lam, do, span, cur, dcur, *, cps, cfg):
  """``kernels.span_chunk_gradients``: grid (BH, NC, state, V / bwd_block_v)."""
  return _chunk_gradients(p, qe, lam, do, span, lambda i, s: span_index(i, jnp.maximum(s, 1)),
                          cur, cps=cps, cfg=cfg, erase_operands=(phi, w, uv, duv, dcur))


def rescaled_read_gradients(qe, lam, do, cur, end, *, cps, cfg):
  """``kernels.rescaled_read_gradients``: grid (BH, NC, state, V / bwd_block_v)."""
  return _chunk_gradients(qe, qe, lam, do, end, lambda i, s: i, cur, cps=cps, cfg=cfg)


# ---- erase: the span sums ----

def _pair_sums_kernel(span_ref, dspan_ref, k_ref, *, dtype):
  j, i, jv = pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when((i == 0) & (jv == 0))
  def _():
    k_ref[...] = jnp.zeros(k_ref.shape, F32)

  @pl.when(i < j)
  def _():
    k_ref[...] += mm(dspan_ref[...], span_ref[...], dtype, tb=True)


def _span_sums_kernel(qe_ref, phi_ref, w_ref, kw_ref, gam_ref, y_ref, dw_own_ref, dkw_own_ref,
                      dgam_own_ref, k_ref, dw_ref, dkw_ref, dgam_ref, l_ref, *, nc, cps, dtype):
  """``kernels``' ``_span_sums_kernel``'s chunk step, chunk m from the span's end, L in
  scratch from K."""
  j, m = pl.program_id(1), pl.program_id(2)

  @pl.when(m == 0)
  def _():
    l_ref[...] = k_ref[...]

  @pl.when(m < _steps(j, nc, cps))
  def _():
    l, phi, kw, w = l_ref[...], phi_ref[...], kw_ref[...], w_ref[...]
    dgam_ref[...] = dgam_own_ref[...] + total(l * phi.astype(F32))
    a = mm(kw, l, dtype)
    dw_ref[...] = (dw_own_ref[...] - mm(a, phi, dtype, tb=True)).astype(dw_ref.dtype)
    dkw_ref[...] = (dkw_own_ref[...] - mm(mm(w, phi, dtype), l, dtype, tb=True)).astype(
        dkw_ref.dtype)
    l_ref[...] = (gam_ref[...] * l - mm(w, a, dtype, ta=True)
                  + mm(qe_ref[...], y_ref[...], dtype, ta=True))


def span_sums(qe, phi, w, kw, gam, span, dspan, y, dw_own, dkw_own, dgam_own, *, cps, cfg):
  """``kernels.span_sums``: K_j = sum_{i < j} dS_{b'}^i S_b^iT (BH, NS, D, D) float32 (grid
  (BH, span j, i, V / bwd_block_v)), then each span's chunks from its end with L from K_j (grid
  (BH, span, chunk))."""
  bh, nc, c, d = qe.shape
  vd = span.shape[-1]
  bv = min(cfg.bwd_block_v, vd)
  ns = -(-nc // cps)
  pair = _spec((None, None, d, bv), lambda b, j, i, jv: (
      b, span_index(jnp.minimum(i, jnp.maximum(j - 1, 0)), jnp.maximum(j, 1)), 0, jv))
  k = _call(functools.partial(_pair_sums_kernel, dtype=qe.dtype), cfg=cfg,
            grid=(bh, ns, max(ns - 1, 1), vd // bv), in_specs=[pair, pair],
            outs=[(_spec((None, None, d, d), lambda b, j, i, jv: (b, j, 0, 0)),
                   jax.ShapeDtypeStruct((bh, ns, d, d), F32))],
            scratch=[], name="merlin_pair_sums", parallel=2)(span, dspan)[0]
  chunk = lambda *s: _spec((None, None, *s), lambda b, j, m: (b, _reverse_chunk(j, m, nc, cps))
                           + (0,) * len(s))
  shape = lambda *s, dtype=F32: jax.ShapeDtypeStruct((bh, nc, *s), dtype)
  kernel = functools.partial(_span_sums_kernel, nc=nc, cps=cps, dtype=qe.dtype)
  return _call(kernel, cfg=cfg, grid=(bh, ns, cps),
               in_specs=[chunk(c, d), chunk(d, d), chunk(c, d), chunk(c, d), chunk(1, 1),
                         chunk(c, d), chunk(c, d), chunk(c, d), chunk(1, 1),
                         _spec((None, None, d, d), lambda b, j, m: (b, j, 0, 0))],
               outs=[(chunk(c, d), shape(c, d, dtype=qe.dtype))] * 2
                    + [(chunk(1, 1), shape(1, 1))],
               scratch=[(d, d)], name="merlin_span_sums", parallel=2)(
                   qe, phi, w, kw, gam, y, dw_own, dkw_own, dgam_own, k)
