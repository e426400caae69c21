"""``multistate_pallas``: multi-state linear attention with its state work in Pallas kernels.

The E-independent, state-free part of each chunk (gc, the UT transform A, Uv, W, Qe, Kw, the
intra-chunk output P Uv and the chunk decay: ``merlin.chunked.intra_chunk``) is ``intra_stage``,
a ``jax.custom_vjp``: its forward the kernel of ``intra.py`` (``Config.intra_kernel``, one program
per chunk) or plain JAX batched over all chunks, float32 (``intra_operands``), either keeping A
where a gradient is taken; its backward ``merlin.chunked.intra_chunk_pullback`` (no inverse), by
the backward kernel of ``intra.py`` (``Config.intra_backward_kernel``, one program per chunk) or
as batched float32 matmuls over all chunks. Everything whose cost grows with the number of
segment states N is in ``kernels.py`` (Triton; ``tpu.py`` the same stages for Mosaic TPU, split
where a walk moves to the grid: ``stages``), behind one ``jax.custom_vjp``:

  erase     forward: span maps (Phi, the walked queries P, the span maps U; grid over spans)
            -> state pass (each chunk's own-segment state and the finished states at span
            starts; grid over segments) -> readout; backward: span maps again (with Phi) ->
            reverse state pass (the gradients at span ends and in the own segment, dUv) ->
            chunk gradients (Y, dQe, dlam, the own state's terms) -> span sums (dW, dKw,
            dgamma)
  no erase  forward: write pass (each chunk's current state, each segment's end state) ->
            readout, with a finished state's decay folded into lam here; backward: reverse
            write pass (dUv, dKw, dgamma) and the read's gradients (dQe, dlam)
  erase, no gradient taken, ``Config.query_walk``: write pass with W (each chunk's current
            state, each segment's end state) and the span maps -> the query-walk readout; no
            stack of states is formed

The readout also takes the intra-chunk part, P Uv and each token's lam of its own segment (own),
and writes the op's output scale (o + own P Uv) itself, in float32 and rounded once to the input
dtype, into the caller's (B, T, H, V) layout (T padded to whole chunks and V to ``padded_width``: a
slice after where either is padded). So the stack read o never leaves the kernel: no float32 o is
written and read back, and no relayout or cast pass follows. The custom_vjp saves its inputs and
the states the forward stored (in the input dtype; the erase backward forms the span maps again,
one cheap launch, rather than keeping Phi, P, U); its backward forms dO = scale dy (float32,
chunk layout), the cotangent of the kernels and of the intra-chunk part. Kernel operands are the
input dtype (bf16 inputs: bf16 tensor-core operands, float32 accumulation). The kernels store the
gradients of Qe, W, Kw, Uv in that dtype too, rounded once from their float32 sums: they are the
cotangents of operands in that dtype, so a float32 copy would only be cast. dgamma, dlam and the
no-erase partial dKw (summed over value blocks here) stay float32.
Under jit with B and/or H sharded, the forward and the backward each run per (B, H) shard
(``layers.partition.batch_head_partitioned``; every operand and result keeps (B, H) as
its dims, leading but for the output's (B, T, H, V), merged to B*H only inside).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from layers import partition
from merlin.chunked import intra_chunk, intra_chunk_pullback
from merlin.pallas import kernels, tpu
from merlin.pallas.intra import intra_part, intra_part_pullback
from merlin.pallas.kernels import padded_width
from merlin.segments import segment_ids
from triadic.chunked import to_chunks
from triadic.pallas.common import F32, Config


def stages(cfg: Config):
  """The module of the state kernels' stages for ``cfg``'s structure: ``tpu`` (Mosaic TPU, the
  walks on the grid) where ``cfg.chunk_grid``, else ``kernels`` (Triton); the same functions,
  arguments and results."""
  return tpu if cfg.chunk_grid else kernels


def _merge(x):
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _pad_last(x, width):
  if x.shape[-1] == width:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _visible(nc, cps, ns):
  """(NC, NS) bool: chunk n reads segment i iff i <= n // cps."""
  return jnp.arange(ns)[None, :] <= (jnp.arange(nc) // cps)[:, None]


def _split(x, b, h):
  return x.reshape(b, h, *x.shape[1:])


def kernel_layout(operands):
  """(B, H, ...) operands -> the kernels' (B*H, ...) ones: gam (.., NC) -> (.., NC, 1, 1), lam
  (.., NS, NC, C) -> (.., NS, NC, C, 1)."""
  *mats, gam, lam = map(_merge, operands)
  return mats, gam[..., None, None], lam[..., None]


def readout_layout(intra, own, width):
  """The readout's intra (B*H, NC, C, width) and own (B*H, NC, C, 1) from the (B, H, ...) ones.
  intra arrives with the op's V, so that its pullback (own's sum over V) runs on the real columns
  only, and is padded to the kernels' V (``width``) here."""
  return _pad_last(_merge(intra), width), _merge(own)[..., None]


def _forward(cps, erase, cfg, scale, *operands):
  """State pass and readout on (B, H, ...) operands: qe, [w (erase),] kw, uv, gam (B, H, NC),
  lam (B, H, NS, NC, C), and the intra-chunk part, float32: intra = P Uv (B, H, NC, C, V) and
  own (B, H, NC, C), each token's lam of its own segment. Returns the op's output
  scale (o + own intra), o the stack read, in qe's dtype and the caller's layout
  (B, NC * C, H, V), and the stored states: each chunk's current state (B, H, NC, D, V), then
  erase the span stack (B, H, NS (NS - 1) / 2, D, V) (``kernels.span_state_pass``), no erase
  each segment's end state (B, H, NS, D, V)."""
  b, h = operands[0].shape[:2]
  mats, gam, lam = kernel_layout(operands[:-2])
  intra, own = readout_layout(*operands[-2:], mats[-1].shape[-1])
  run = stages(cfg)
  read = {"cps": cps, "scale": scale, "heads": h, "cfg": cfg}
  if erase:
    qe, w, kw, uv = mats
    p, u = run.span_maps(qe, w, kw, gam, cps=cps, cfg=cfg, phi=False)
    cur, span = states = run.span_state_pass(w, kw, uv, gam, u, cps=cps, cfg=cfg)
    o = run.span_readout(qe, lam, p, span, cur, intra, own, **read)
  else:
    qe, kw, uv = mats
    states = run.write_pass(kw, uv, gam, cps=cps, cfg=cfg)
    o = run.rescaled_readout(qe, lam, *states, intra, own, **read)
  return (o, *(_split(x, b, h) for x in states))


def _walk_forward(cps, cfg, scale, *operands):
  """The erase output by the query walk, forward only (``kernels.walk_readout``): ``_forward``'s
  erase operands in, its output alone out, (B, NC * C, H, V) in qe's dtype. The states it reads
  are each chunk's current state and each segment's end state (``kernels.write_pass`` with W),
  with the walked queries and span maps (``kernels.span_maps``); none is kept."""
  h = operands[0].shape[1]
  (qe, w, kw, uv), gam, lam = kernel_layout(operands[:-2])
  intra, own = readout_layout(*operands[-2:], uv.shape[-1])
  cur, end = kernels.write_pass(kw, uv, gam, cps=cps, cfg=cfg, w=w)
  p, u = kernels.span_maps(qe, w, kw, gam, cps=cps, cfg=cfg, phi=False)
  return kernels.walk_readout(qe, lam, p, cur, end, u, intra, own, cps=cps, scale=scale,
                              heads=h, cfg=cfg)


def _backward(cps, erase, cfg, *args):
  """The gradients of ``_forward``'s kernel operands, all but intra and own (lam's zero for
  i > s(n)), from those operands, the states it stored and the stack read's cotangent do, all
  (B, H, ...); each in its operand's dtype."""
  n_states = 2
  operands, states, do = args[:-n_states - 1], args[-n_states - 1:-1], args[-1]
  b, h, nc = operands[0].shape[:3]
  mats, gam, lam = kernel_layout(operands)
  states = tuple(map(_merge, states))
  run = stages(cfg)
  do = _merge(do).astype(mats[0].dtype)
  if erase:
    qe, w, kw, uv = mats
    cur, span = states
    phi, p, u = run.span_maps(qe, w, kw, gam, cps=cps, cfg=cfg)
    dspan, dcur, duv = run.span_reverse_pass(qe, p, w, kw, u, lam, gam, do, cps=cps, cfg=cfg)
    dqe, y, *own, dlam = run.span_chunk_gradients(qe, p, phi, w, uv, duv, lam, do, span, cur,
                                                  dcur, cps=cps, cfg=cfg)
    dw, dkw, dgam = run.span_sums(qe, phi, w, kw, gam, span, dspan, y, *own, cps=cps, cfg=cfg)
    dmats = (dqe, dw, dkw, duv)
  else:
    qe, kw, uv = mats
    duv, dkw, dgam = run.rescaled_reverse_pass(qe, kw, uv, lam, gam, do, states[0], cps=cps,
                                               cfg=cfg)
    dqe, dlam = run.rescaled_read_gradients(qe, lam, do, *states, cps=cps, cfg=cfg)
    # dKw and dgamma: float32 sums over the value blocks, dKw rounded after the sum
    dmats = (dqe, jnp.sum(dkw, axis=1).astype(kw.dtype), duv)
    dgam = jnp.sum(dgam, axis=1)
  dlam = jnp.moveaxis(dlam[..., 0], 2, 1)  # (BH, NS, NC, C)
  dlam = jnp.where(_visible(nc, cps, lam.shape[1]).T[None, :, :, None], dlam, 0.0)
  grads = [*dmats, dgam[:, :, 0, 0], dlam]  # dmats: the kernels store them in the mats' dtype
  return tuple(_split(x, b, h) for x in grads)


# Shardy rules: b, h may be sharded on any mesh axes; chunks n, tokens c (t in the output's
# (B, T, H, V) layout), segments s, the stacked states i, D and V (v padded, u not) must be whole
# on every device (the recurrence runs along them).
_REPLICATED = ("n", "c", "t", "d", "v", "u", "s", "i")


def _rules(erase):
  mats = "b h n c d, " * (3 if erase else 2) + "b h n c v, b h n, b h s n c"
  states = "b h n d v, b h i d v" if erase else "b h n d v, b h s d v"
  return (f"{mats}, b h n c u, b h n c -> b t h v, {states}",
          f"{mats}, {states}, b h n c v -> {mats}")


_PARTITIONED = {
    erase: tuple(partition.batch_head_partitioned(
        fn, n_static=n_static, rule=rule,
        replicated=tuple(f for f in _REPLICATED if f in rule.split()))
                 for fn, n_static, rule in zip((_forward, _backward), (4, 3), _rules(erase)))
    for erase in (True, False)}


_WALK_RULE = _rules(True)[0].split(" -> ")[0] + " -> b t h v"  # the erase forward's output only
_WALK = partition.batch_head_partitioned(
    _walk_forward, n_static=3, rule=_WALK_RULE,
    replicated=tuple(f for f in _REPLICATED if f in _WALK_RULE.split()))


def kernels_walk(cps, cfg, scale, *operands):
  """The erase output by the query walk as the op launches it, per (B, H) shard
  (``_walk_forward``)."""
  return _WALK(cps, cfg, scale, *operands)


def kernels_forward(cps, erase, cfg, scale, *operands):
  """The kernels' forward as the op launches it, per (B, H) shard: ``_forward``'s results (the
  output, then the stored states) from its operands."""
  return _PARTITIONED[erase][0](cps, erase, cfg, scale, *operands)


def kernels_backward(cps, erase, cfg, *args):
  """The kernels' backward as the op launches it, per (B, H) shard: ``_backward``'s gradients
  from its operands (``_forward``'s but intra and own), the stored states and dO (float32,
  (B, H, NC, C, V) with V padded as the kernels')."""
  return _PARTITIONED[erase][1](cps, erase, cfg, *args)


def _intra_part(intra, own):
  """o_intra = own intra: the intra-chunk output, weighted by each token's own segment's lam."""
  return own[..., None] * intra


def _unpad(o, t, vd):
  """The output's first T tokens and V columns: a slice, and only where T or V were padded."""
  return o if o.shape[1::2] == (t, vd) else o[:, :t, :, :vd]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _attend(cps, erase, cfg, scale, t, *operands):
  """scale (sum_{i <= s(n)} (lam_n,i Qe_n) S_n^i + own_n intra_n) for every chunk n: the op's
  output (B, T, H, V) in qe's dtype; operands as ``_forward``'s. This primal runs only where no
  gradient is taken (``_attend_fwd`` otherwise): there the erase path may read by the query walk
  (``Config.query_walk``), which keeps no states for a backward."""
  if erase and cfg.query_walk:
    o = kernels_walk(cps, cfg, scale, *operands)
  else:
    o = kernels_forward(cps, erase, cfg, scale, *operands)[0]
  return _unpad(o, t, operands[-2].shape[-1])


def _attend_fwd(cps, erase, cfg, scale, t, *operands):
  o, *states = kernels_forward(cps, erase, cfg, scale, *operands)
  return _unpad(o, t, operands[-2].shape[-1]), (operands, tuple(states))


def _attend_bwd(cps, erase, cfg, scale, t, saved, dy):
  """The output's cotangent dy (B, T, H, V) in the output dtype gives dO = scale dy (float32,
  (B, H, NC, C, V), zero past T), by the float32 steps of the autodiff of the same output formed
  in plain JAX (cast, pad, relayout, scale), so the gradients are the same to the bit. The kernels
  take the stack read's gradients from dO (V padded as theirs, ``_backward``), ``_intra_part``'s
  pullback those of intra and own."""
  operands, states = saved
  b, h, nc, c = operands[0].shape[:4]
  vd = dy.shape[-1]
  dy = dy.astype(F32)
  if nc * c != t:
    dy = jnp.pad(dy, ((0, 0), (0, nc * c - t), (0, 0), (0, 0)))
  do = scale * jnp.moveaxis(dy.reshape(b, nc, c, h, vd), 3, 1)
  grads = kernels_backward(cps, erase, cfg, *operands[:-2], *states,
                           _pad_last(do, padded_width(vd)))
  return (*grads, *jax.vjp(_intra_part, *operands[-2:])[1](do))


_attend.defvjp(_attend_fwd, _attend_bwd)


def _finished_decay(gc_end, cps, ns):
  """F (B, H, NS, NC): prod_{e_i <= m < n} gamma_m for the chunks n >= e_i (segment i finished),
  1 elsewhere; gc_end (B, H, NC) the chunks' log decays. A cumulative sum that starts at e_i, so
  exp takes sums of decays (<= 0), never differences."""
  nc = gc_end.shape[-1]
  ends = jnp.minimum((jnp.arange(ns) + 1) * cps, nc)[:, None]  # e_i (NS, 1)
  after = jnp.arange(nc)[None, :] >= ends                      # (NS, NC)
  terms = jnp.where(after, gc_end[..., None, :], 0.0)
  before_n = jnp.cumsum(terms, axis=-1) - terms                # sum over e_i <= m < n
  return jnp.where(after, jnp.exp(jnp.where(after, before_n, 0.0)), 1.0)


def chunk_weights(g, lam, *, segment_len: int, chunk_size: int):
  """The chunks' g (B, H, NC, C) and lam's first NS states (B, H, NC, C, NS), float32,
  zero-padded at the end of T."""
  c = chunk_size
  nc = -(-g.shape[1] // c)
  ns = -(-nc // (segment_len // c))
  return to_chunks(g, nc, c), to_chunks(lam[..., :ns], nc, c)


def chunk_inputs(q, k, v, g, beta, *, chunk_size: int):
  """The op's q, k, v, g, beta in chunks as ``intra_chunk`` takes them ((B, H, NC, C, ...)),
  float32, zero-padded at the end of T."""
  nc = -(-q.shape[1] // chunk_size)
  # Padded tokens have q = k = v = beta = 0 and g = 0: no write, no erase, no decay.
  return tuple(to_chunks(x, nc, chunk_size) for x in (q, k, v, g, beta))


def chunk_operands(uv, w, qe, kw, gam, intra, *, dtype):
  """The state kernels' intra-chunk operands from ``intra_chunk``'s float32 results: qe, [w,] kw,
  uv padded to ``padded_width`` and cast to ``dtype``; gam; intra (float32, the op's V)."""
  dp, vp = padded_width(qe.shape[-1]), padded_width(uv.shape[-1])
  kernel_op = lambda x, width: _pad_last(x, width).astype(dtype)
  mats = [kernel_op(qe, dp)] + ([] if w is None else [kernel_op(w, dp)])
  return (*mats, kernel_op(kw, dp), kernel_op(uv, vp), gam, intra)


def intra_operands(q, k, v, g, beta, *, chunk_size: int, erase: bool):
  """The intra-chunk part in plain JAX, float32 over all chunks: ``chunk_inputs`` ->
  ``intra_chunk`` -> ``chunk_operands``, on the op's inputs (g clamped). Results as
  ``intra.intra_part``'s. The op differentiates it by ``intra_chunk_pullback`` (``intra_stage``)."""
  return _intra_forward(q, k, v, g, beta, chunk_size=chunk_size, erase=erase)[0]


def _intra_forward(q, k, v, g, beta, *, chunk_size: int, erase: bool):
  """``intra_operands``' results and ``intra_chunk``'s A (None without erase)."""
  uv, w, qe, kw, gam, intra, ut, _ = intra_chunk(*chunk_inputs(q, k, v, g, beta,
                                                               chunk_size=chunk_size), erase)
  return chunk_operands(uv, w, qe, kw, gam, intra, dtype=q.dtype), ut


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def intra_stage(chunk_size, erase, cfg, *inputs):
  """The op's intra-chunk stage: ``intra_operands``' results, by the forward kernel
  (``intra.intra_part``) with ``Config.intra_kernel``, else in plain JAX. Where a gradient is
  taken, the forward also keeps A (the kernel writes it) beside the inputs and its own Uv and W
  (in the input dtype, which the state kernels' custom_vjp keeps anyway), and the backward is
  ``intra_chunk_pullback`` (no inverse, no loop), which forms the other products again: no
  other float32 product of the part is kept. That backward runs chunk by chunk in the kernel of
  ``intra.intra_part_pullback`` with ``Config.intra_backward_kernel``, else as batched plain-JAX
  matmuls over all chunks."""
  if cfg.intra_kernel:
    return intra_part(*inputs, chunk_size=chunk_size, erase=erase, cfg=cfg)
  return intra_operands(*inputs, chunk_size=chunk_size, erase=erase)


def _intra_fwd(chunk_size, erase, cfg, *inputs):
  if cfg.intra_kernel:
    part = intra_part(*inputs, chunk_size=chunk_size, erase=erase, cfg=cfg, inverse=True)
    part, ut = (part[:-1], part[-1]) if erase else (part, None)
  else:
    part, ut = _intra_forward(*inputs, chunk_size=chunk_size, erase=erase)
  # erase: the kernels' Uv and W (the state kernels' operands, kept by their own custom_vjp too)
  return part, (inputs, ut, (part[3], part[1]) if erase else None)


def _intra_bwd(chunk_size, erase, cfg, saved, cotangents):
  """The cotangents of ``chunk_operands``' padded, cast results, back to the inputs': by the
  backward kernel (``Config.intra_backward_kernel``: ``intra.intra_part_pullback``), else by
  ``intra_chunk_pullback`` (sliced to D, V; float32) and ``chunk_inputs``' layout."""
  inputs, ut, uv_w = saved
  if cfg.intra_backward_kernel:
    residuals = (ut, uv_w[0], uv_w[1]) if erase else None
    return intra_part_pullback(inputs, residuals, cotangents, chunk_size=chunk_size,
                               erase=erase, cfg=cfg)
  d, vd = inputs[0].shape[-1], inputs[2].shape[-1]
  *mats, duv, dgam, dintra = cotangents
  dqe, dw, dkw = (mats[0], mats[1], mats[2]) if erase else (mats[0], None, mats[1])
  unpad = lambda x, width: None if x is None else x[..., :width].astype(F32)
  chunks, pullback = jax.vjp(functools.partial(chunk_inputs, chunk_size=chunk_size), *inputs)
  uv_w = (None, None) if uv_w is None else (unpad(uv_w[0], vd), unpad(uv_w[1], d))
  grads = intra_chunk_pullback(*chunks, ut, uv_w, (unpad(duv, vd), unpad(dw, d), unpad(dqe, d),
                                                   unpad(dkw, d), dgam, dintra), erase)
  return pullback(grads)


intra_stage.defvjp(_intra_fwd, _intra_bwd)


def weight_operands(gc, lamc, *, cps: int, erase: bool):
  """The readout's weights from the chunks' g (gc) and lam (lamc, (B, H, NC, C, NS)): lam
  (B, H, NS, NC, C), without erase times the finished states' decay, and own (B, H, NC, C), each
  token's lam of its own segment."""
  nc, ns = lamc.shape[2], lamc.shape[-1]
  owner = jax.nn.one_hot(segment_ids(nc, cps), ns, dtype=F32)  # (NC, NS)
  own = jnp.einsum("bhncm,nm->bhnc", lamc, owner)
  lam_k = jnp.moveaxis(lamc, -1, 2)  # (B, H, NS, NC, C)
  if not erase:  # a finished state is its end state, decayed: the decay goes into its weight
    lam_k = lam_k * _finished_decay(jnp.sum(gc, axis=-1), cps, ns)[..., None]
  return lam_k, own


def kernel_operands(part, gc, lamc, *, cps: int, erase: bool):
  """The kernels' operands (``_forward``'s): the intra-chunk part's results ``part`` (qe, [w,]
  kw, uv, gam, intra: ``intra_operands``') and the readout's weights from the chunks' g (gc) and
  lam (lamc) (``weight_operands``), in ``_forward``'s order."""
  *mats, gam, intra = part
  lam_k, own = weight_operands(gc, lamc, cps=cps, erase=erase)
  return [*mats, gam, lam_k, intra, own]


def multistate_pallas(q, k, v, g, beta, lam, *, segment_len: int, scale: float, erase: bool,
                      chunk_size: int, config: Config):
  """Chunk-parallel multi-state recurrence with the state stack in Pallas kernels; shapes as
  ``merlin.multistate_attention``. ``lam`` must already be zero for i > s(t), ``g`` clamped
  (``triadic.ops.clamp_log_decay``); ``chunk_size`` must divide ``segment_len`` and be one of
  ``plan.CHUNK_SIZES``; ``scale`` a Python float (a constant of the readout kernel). Returns
  o (B, T, H, V) in q's dtype, written by the readout kernel (a slice of its output where T is
  not a multiple of the chunk or V not a power of two >= 16: ``padded_width``).

  Its stages, each callable alone: ``intra_stage`` (``intra.intra_part`` with
  ``Config.intra_kernel``, else ``intra_operands``: ``chunk_inputs`` -> ``intra_chunk`` ->
  ``chunk_operands``; backward ``intra_chunk_pullback``) and
  ``chunk_weights`` -> ``kernel_operands`` -> ``_attend`` (``kernels_forward``; backward
  ``kernels_backward``)."""
  cps = segment_len // chunk_size
  inputs = (q, k, v, g, beta)
  part = intra_stage(chunk_size, erase, config, *inputs)
  gc, lamc = chunk_weights(g, lam, segment_len=segment_len, chunk_size=chunk_size)
  operands = kernel_operands(part, gc, lamc, cps=cps, erase=erase)
  return _attend(cps, erase, config, float(scale), q.shape[1], *operands)
