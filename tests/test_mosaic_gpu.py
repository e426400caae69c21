"""Mosaic GPU (Hopper) state-passing kernels (``triadic.pallas.mosaic``) against the
Triton-structured ``recurrent.state_pass`` / ``recurrent.reverse_state_pass`` run in Pallas
interpret mode.

The Mosaic GPU kernels run under Mosaic GPU interpret mode on this CPU (simulated SMEM, TMA copies,
barriers, wgmma). Inputs are built as ``ops._forward`` builds them: chunked bf16 q, k, v, float32
k2, q2, beta, then ``chunk_prep`` for gc, A, P; h0 and dht nonzero.
Error bound (relative RMS, ||a - b|| / ||b||): 1e-2 for every output. Both sides use bf16 operands
with float32 accumulation but round differently (the Triton kernel scales K by the per-row factors
before the bf16 cast, the Mosaic kernel scales the float32 product after), so they are not
bit-equal.
A second test lowers both kernels for "cuda" (Mosaic GPU lowering and layout checks, no GPU),
which is where the transposed operands are checked as ``plgpu.transpose_ref`` views of the SMEM
copies (interpret mode writes explicit transposes instead), and that no transposed copy of an
input is made.
The two-warpgroup kernels (``warpgroups=2``, D = 128) are checked the same way, against the same
reference and bounds. They run eagerly (the kernel alone under jit): inside a larger jitted
function the interpreter's two simulated warpgroups can wait on each other forever on a 2-core
machine.
With ``heads`` (q, k, v, o and dO in (B, T, H, X)) the forward and reverse passes, one and two
warpgroups, are checked against the default layout's outputs on the same data (bit-equal in
interpret mode) and by the CUDA lowering.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from testkit.triadic import PALLAS_BOUNDS, make_grad_inputs, transposes_an_argument
from testkit import rel_rms
from triadic import triadic_gdn
from triadic.pallas import mosaic, mosaic_backward, recurrent
from triadic.pallas import plan as plan_lib
from triadic.pallas.chunk_prep import chunk_prep
from triadic.pallas.common import Config, token_major
from triadic.pallas import ops as pops
from triadic.pallas.ops import kernel_layout

BOUND = 1e-2
SCALE = 0.125

pytestmark = pytest.mark.skipif(not mosaic.interpret_available(),
                                reason="Mosaic GPU interpret mode unavailable in this JAX")


def build(b, t, h, d, vdim, e, c, erase, seed=0):
  """Kernel operands as ops._forward makes them: (q, k, v, k2, q2, gc_col, beta, A, P, h0), do, dht
  (do in q's dtype, as ops._backward passes it)."""
  args, do, ds = make_grad_inputs(seed, b, t, h, d, vdim, e, decay=1.0, dtype=jnp.bfloat16)
  return _operands(args, do, ds, c=c, erase=erase)


@functools.partial(jax.jit, static_argnames=("c", "erase"))
def _operands(args, do, ds, *, c, erase):
  """``build``'s relayouts and ``chunk_prep`` as one program (run eagerly, each of their ops
  compiles on its own: seconds a call on the 2-core CI)."""
  b, t, h = args[0].shape[:3]
  nc = -(-t // c)
  merge = lambda x: x.reshape(b * h, *x.shape[2:])
  q, k, v = (merge(kernel_layout(x, nc, c)) for x in args[:3])
  k2, q2, g, beta = (merge(kernel_layout(x.astype(jnp.float32), nc, c)) for x in args[3:7])
  h0, dht = merge(args[7]), merge(ds)
  do = merge(kernel_layout(do, nc, c)).astype(q.dtype)
  gc_col, _, a, p, _ = chunk_prep(q, k, k2, q2, g, beta, erase=erase, cfg=CPU)[:5]
  return (q, k, v, k2, q2, gc_col, beta, a, p, h0), do, dht


CPU = Config("cpu", block_v=16, bwd_block_v=16)


def reference(fn, *args, **kw):
  """``recurrent``'s pass ``fn`` (the Triton structure, Pallas interpret mode) under jit."""
  return jax.jit(functools.partial(fn, cfg=CPU, **kw))(*args)

CASES = [
    # b, t, h, v, e, block_v, erase, heads   (D = 64, C = 64; NC = 3 for t = 150 and 192)
    pytest.param(1, 150, 2, 32, 1, 32, True, False, id="E1-BV32-erase"),
    pytest.param(2, 150, 1, 64, 3, 32, True, False, id="E3-BV32-erase"),
    pytest.param(1, 150, 2, 32, 4, 16, False, False, id="E4-BV16-noerase"),
    pytest.param(1, 150, 2, 32, 8, 16, True, False, id="E8-BV16-erase"),
    # heads without erase, in whole chunks (B = H = 2 with erase: the save_x test below)
    pytest.param(1, 192, 1, 32, 8, 32, False, True, id="E8-BV32-noerase-heads"),
]


@pytest.mark.parametrize("b,t,h,vdim,e,bv,erase,heads", CASES)
def test_forward_and_backward_match_recurrent(b, t, h, vdim, e, bv, erase, heads):
  """One warpgroup, the forward and reverse passes against ``recurrent``; with ``heads``, the
  passes with ``heads=H`` give these outputs bit for bit (``match_default_with_heads``)."""
  d, c = 64, 64
  built = build(b, t, h, d, vdim, e, c, erase)
  assert built[0][0].shape[1] >= 3 and (built[0][0].shape[0] >= 2 or heads)
  match_recurrent(built, erase, False, dict(block_v=bv), heads=(b, h) if heads else None)


FORWARD_OUTPUTS = ("o", "U", "states", "final state")
BACKWARD_OUTPUTS = ("dU", "dstates", "dh0")


def check_close(names, got, want):
  """Shape, dtype and relative RMS (< BOUND) of each output against the reference's."""
  for name, x, y in zip(names, got, want, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    assert rel_rms(x, y) < BOUND, f"{name}: rel RMS {rel_rms(x, y):.2e}"


WG2_CASES = [
    # b, t, h, v, e, erase, save_x, block_v, heads   (D = 128, C = 64; NC = 3 for t = 150 and 192)
    # The interpreter runs the two warpgroups' kernel body once a program (B * H * V / block_v of
    # them; the larger E, the longer): one (b, h) row, but B = H = 2 where heads needs them.
    # With heads (whole chunks): two value blocks (the column offsets of v, o and dO) and
    # B = H = 2 (b = i // H, h = i % H).
    # the two-warpgroup default block_v (32: E * block_v = 256 at E = 8)
    pytest.param(1, 192, 1, 64, 1, False, False, None, True, id="E1-noerase-V64-heads"),
    pytest.param(2, 192, 2, 32, 1, True, True, None, True, id="B2-H2-E1-erase-saveX-heads"),
    pytest.param(1, 150, 1, 32, 3, True, True, None, False, id="E3-erase-saveX"),
    pytest.param(1, 150, 1, 32, 8, True, False, None, False, id="E8-erase"),
    # block_v 16, the default reverse pass at E = 8 (``default_state_tiles``)
    pytest.param(1, 150, 1, 16, 8, True, True, 16, False, id="E8-BV16-erase-saveX"),
]


@pytest.mark.parametrize("b,t,h,vdim,e,erase,save_x,bv,heads", WG2_CASES)
def test_two_warpgroups_match_recurrent(b, t, h, vdim, e, erase, save_x, bv, heads):
  """``warpgroups=2`` (each warpgroup 64 of the D = 128 state rows): the forward and reverse
  passes against ``recurrent`` at block_v ``bv`` (None: the default); with save_x, X against X
  formed from the reference's chunk-start states. With ``heads``, the passes with ``heads=H`` give
  these outputs bit for bit (``match_default_with_heads``; each warpgroup copies its 64 columns of
  q and k as a strided box)."""
  d, c = 128, 64
  wg2 = dict(warpgroups=2)
  if bv:
    wg2.update(block_v=bv)
  else:
    assert mosaic.default_block_v(d, vdim, c, e, warpgroups=2) == 32
  match_recurrent(build(b, t, h, d, vdim, e, c, erase), erase, save_x, wg2,
                  heads=(b, h) if heads else None)


def test_one_warpgroup_save_x_matches_recurrent():
  """One warpgroup at D = 64, E = 2, the forward with save_x and the reverse pass against
  ``recurrent``; and with ``heads``: B = H = 2 and two value blocks (block_v 16: the column
  offsets of v, o, dO and dV) in whole chunks."""
  b, h = 2, 2
  match_recurrent(build(b, 192, h, 64, 32, 2, 64, True), True, True, dict(block_v=16),
                  heads=(b, h))


def match_recurrent(built, erase, save_x, kernel_kw, heads=None):
  """The Mosaic forward (with ``save_x``) and reverse passes with ``kernel_kw`` against
  ``recurrent`` on ``build``'s operands; with save_x, X against X formed from the reference's
  chunk-start states, and the reverse pass with ``save_drhs`` (as the op pairs them): A^T dU and
  dV = beta A^T dU against their definition on the pass's own dU, to bf16 rounding. With
  ``heads`` = (B, H), ``match_default_with_heads`` against these passes' outputs. Two
  warpgroups run eagerly (module docstring), one under jit."""
  fargs, do, dht = built
  kw = dict(scale=SCALE, erase=erase)
  run = (lambda f: f) if kernel_kw.get("warpgroups", 1) == 2 else jax.jit
  mk = dict(kw, interpret=True, **kernel_kw)
  fwd = got = run(functools.partial(mosaic.state_pass, save_x=save_x, **mk))(*fargs)
  want = reference(recurrent.state_pass, *fargs, **kw)
  if save_x:
    x, got = got[2], got[:2] + got[3:]
    q, k, v, k2, _, gc_col = fargs[:6]
    want_x = jax.jit(mosaic_backward.x_from_states)(k, v, want[2], k2, gc_col)
    assert x.shape == want_x.shape and x.dtype == q.dtype
    assert rel_rms(x, want_x) < BOUND, f"X: rel RMS {rel_rms(x, want_x):.2e}"
  check_close(FORWARD_OUTPUTS, got, want)
  bargs = (fargs[0], fargs[1], do, *fargs[3:9], dht)
  bwd = got = run(functools.partial(mosaic.reverse_state_pass, save_drhs=save_x, **mk))(*bargs)
  if save_x:
    du, drhs, dv, *got = got
    got = (du, *got)
    a, beta = fargs[7], fargs[6]
    want_drhs = jax.jit(functools.partial(mosaic_backward.rhs_gradient, erase=True))(a, du)
    for name, x, want in (("A^T dU", drhs, want_drhs), ("dV", dv, beta * want_drhs)):
      assert x.shape == du.shape and x.dtype == fargs[0].dtype, name
      assert rel_rms(x, want) < 4e-3, f"{name}: rel RMS {rel_rms(x, want):.2e}"
  check_close(BACKWARD_OUTPUTS, got, reference(recurrent.reverse_state_pass, *bargs, **kw))
  if heads:
    match_default_with_heads(built, *heads, run, dict(kw, **kernel_kw), save_x,
                             default=(fwd, bwd))


@pytest.mark.parametrize("d,vdim,e,erase,wgs,save_x,bv", [
    (64, 64, 8, True, 1, False, None), (128, 128, 8, True, 1, False, None),
    (128, 64, 2, False, 1, False, None), (64, 32, 3, True, 1, False, None),
    (128, 128, 1, True, 1, True, 64),
    # two warpgroups at D = 128 with their default block_v (32: E * block_v = 256 at E = 8)
    (128, 128, 8, True, 2, True, None), (128, 128, 8, False, 2, False, None),
    (128, 64, 3, True, 2, False, None), (128, 32, 1, True, 2, True, None),
    # two warpgroups at block_v 16 (the default reverse pass at E = 8) and at E = 4
    (128, 128, 8, True, 2, True, 16), (128, 128, 8, False, 2, False, 16),
    (128, 128, 4, True, 2, False, 32),
])
def test_kernels_lower_for_cuda(d, vdim, e, erase, wgs, save_x, bv):
  """Both kernels pass the Mosaic GPU lowering (layout inference, wgmma/TMA checks, SMEM size,
  the transposed operands as ``transpose_ref`` views) at block_v ``bv`` (None: the default);
  nothing runs. No input is transposed in the program before the kernel (a
  ``stablehlo.transpose`` of an argument): the kernels take the transposes as views."""
  bh, nc, c = 2, 4, 64
  qkv = [(bh, nc, c, d), (bh, nc, c, d), (bh, nc, c, vdim)]
  args = kernel_arg_specs(qkv, bh=bh, nc=nc, c=c, d=d, vdim=vdim, e=e)
  kw = dict(scale=SCALE, erase=erase, warpgroups=wgs, block_v=bv)
  suffix = "_wg2" if wgs == 2 else ""
  fwd = jax.jit(functools.partial(mosaic.state_pass, save_x=save_x, **kw))
  text = fwd.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_forward_mgpu" + suffix in text
  assert not transposes_an_argument(text)
  # The reverse pass with save_drhs where the op pairs it with save_x (``Plan.saves_drhs``).
  bwd = jax.jit(functools.partial(mosaic.reverse_state_pass, save_drhs=save_x, **kw))
  traced = bwd.trace(*args)
  assert len(traced.out_info) == 3 + 2 * (save_x and erase)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_backward_states_mgpu" + suffix in text
  assert not transposes_an_argument(text)


@pytest.mark.parametrize("wgs", [1, 2])
def test_trace_regions_record_the_stages(wgs, monkeypatch, tmp_path):
  """Under ``mosaic.trace_regions`` both state passes lower for CUDA with Mosaic GPU's profiler:
  an extra uint32 output of ``regions`` * 4 entries a warpgroup, and the regions it records are
  the chunk loop's stages, each input's wait and the helpers' parts (products, SMEM stores). (The profiler's dump is a host callback, which
  only a CUDA backend lowers: replaced here.)"""
  from jax.experimental.mosaic.gpu import profiler
  specs = []
  init = profiler.ProfilerSpec.__init__

  def record(self, *a, **kw):
    init(self, *a, **kw)
    specs.append(self)

  monkeypatch.setattr(profiler.ProfilerSpec, "__init__", record)
  monkeypatch.setattr(jax.debug, "callback", lambda *a, **kw: None)
  bh, nc, c, d, e = 2, 4, 64, 128, 8
  args = kernel_arg_specs([(bh, nc, c, d)] * 3, bh=bh, nc=nc, c=c, d=d, vdim=d, e=e)
  stages = {1: ({"wait update", "chunk start", "rhs", "U", "output", "update"},
                {"wait update", "chunk start", "dU", "X, Z", "update"}),
            2: ({"wait update", "chunk start", "partials", "exchange", "U, output", "meet",
                 "update"},
                {"wait update", "chunk start", "partial", "exchange", "dU, X, Z", "meet",
                 "update"})}[wgs]
  for fn, names in zip((mosaic.state_pass, mosaic.reverse_state_pass), stages):
    specs.clear()
    with mosaic.trace_regions(str(tmp_path), regions=64):
      run = jax.jit(functools.partial(fn, scale=SCALE, erase=True, warpgroups=wgs))
      text = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    [results] = mosaic_results(text)
    entries = re.fullmatch(r"tensor<(\d+)xui32>", results[-1])
    assert entries and int(entries[1]) % (64 * 4 * wgs) == 0, results[-1]
    [spec] = specs
    assert names | {"wait lam", "wait f", "wait k", "product", "wait stores", "state to SMEM",
                    "expand over e"} <= set(spec.interned_names)
  assert mosaic._compiler_params().profile_space == 0    # the context has ended


def kernel_arg_specs(qkv_shapes, *, bh, nc, c, d, vdim, e):
  """Shape specs of a state pass's operands: q, k, v (bf16) of ``qkv_shapes``, then the float32
  k2, q2, gc (BH, NC, C, E), beta (BH, NC, C, 1), A, P (BH, NC, C, C) and h0 / dht (BH, E, D, V)."""
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  f32 = functools.partial(spec, dt=jnp.float32)
  return (*(spec(*s) for s in qkv_shapes), f32(bh, nc, c, e), f32(bh, nc, c, e),
          f32(bh, nc, c, e), f32(bh, nc, c, 1), f32(bh, nc, c, c), f32(bh, nc, c, c),
          f32(bh, e, d, vdim))


@pytest.mark.parametrize("wgs,e,bv", [(1, 2, 16), (2, 1, 32)])
def test_heads_layout_over_pieces_matches_default(wgs, e, bv):
  """``pieces=2`` with ``heads``: every (BH, ...) operand cut into two pieces of the sequence
  ((BH * 2, NC / 2, ...), row (b * H + h) * 2 + piece) while q, k, v, o, dO stay whole in the
  caller's layout: the passes read piece p's chunk n at the caller's chunk 2 p + n, bit for bit
  what the default layout gives on the pieces' relayouted operands. D = 128 for two warpgroups,
  64 for one; NC = 4. B = H = 2 for one warpgroup checks the row order; both warpgroup counts
  take their boxes from one index map (``mosaic._chunk_box``), so two warpgroups run one (b, h)
  row, two pieces (the interpreter's time grows with the programs)."""
  d = 128 if wgs == 2 else 64
  b, h = (1, 1) if wgs == 2 else (2, 2)
  match_default_with_heads(build(b, 256, h, d, 32, e, 64, True), b, h,
                           jax.jit if wgs == 1 else (lambda f: f),
                           dict(scale=SCALE, erase=True, block_v=bv, warpgroups=wgs), True,
                           pieces=2)


def zero_operands(*, bh, nc, c, d, vdim, e):
  """Zeros in the shapes and dtypes of a state pass's operands (``kernel_arg_specs``), for the
  argument checks."""
  qkv = [(bh, nc, c, d), (bh, nc, c, d), (bh, nc, c, vdim)]
  specs = kernel_arg_specs(qkv, bh=bh, nc=nc, c=c, d=d, vdim=vdim, e=e)
  return [jnp.zeros(x.shape, x.dtype) for x in specs]


def test_pieces_without_heads_raise():
  fargs = zero_operands(bh=1, nc=2, c=64, d=64, vdim=32, e=1)
  with pytest.raises(ValueError, match="pieces=2 needs heads"):
    mosaic.state_pass(*fargs, scale=SCALE, erase=True, pieces=2, interpret=True)


def match_default_with_heads(built, b, h, run, kernel_kw, save_x, pieces=1, default=None):
  """Both state passes (``run``: jax.jit or eager) with ``heads=h`` on token-major copies of their
  per-token inputs (q, k, v; q, k, dO) against the default layout on ``build``'s operands: every
  output bit-equal (rel RMS <= 1e-6), o (and with ``save_x`` the reverse pass's dV: its
  ``save_drhs``) compared in (B, T, H, V). With ``pieces`` P > 1 both run
  over P pieces: the (BH, NC, ...) operands reshaped to (BH * P, NC / P, ...), each piece started
  from its row's h0 (dht), the token-major copies whole. ``default``: the default layout's
  (forward, reverse) outputs where the caller has them (without pieces), not run again."""
  fargs, do, dht = built
  if pieces > 1:
    cut = lambda x: x.reshape(x.shape[0] * pieces, x.shape[1] // pieces, *x.shape[2:])
    fargs = (*map(cut, fargs[:9]), jnp.repeat(fargs[9], pieces, axis=0))
    do, dht = cut(do), jnp.repeat(dht, pieces, axis=0)
  whole = lambda x: x.reshape(x.shape[0] // pieces, x.shape[1] * pieces, *x.shape[2:])
  tok = lambda x: token_major(whole(x), b, h)
  mk = dict(kernel_kw, interpret=True, **({"pieces": pieces} if pieces > 1 else {}))
  plain = dict(kernel_kw, interpret=True)

  def check(got, want):
    for x, y in zip(got, want, strict=True):
      assert x.shape == y.shape and x.dtype == y.dtype
      assert rel_rms(x, y) <= 1e-6, f"rel RMS {rel_rms(x, y):.2e}"

  want = default[0] if default else run(functools.partial(mosaic.state_pass, save_x=save_x,
                                                        **plain))(*fargs)
  got = run(functools.partial(mosaic.state_pass, save_x=save_x, heads=h, **mk))(
      *(tok(x) for x in fargs[:3]), *fargs[3:])
  assert len(got) == (5 if save_x else 4)
  check(got, (tok(want[0]), *want[1:]))
  # The reverse pass with save_drhs where the op pairs it with save_x: dV comes back (B, T, H, V).
  bargs = (fargs[0], fargs[1], do, *fargs[3:9], dht)
  want = default[1] if default else run(functools.partial(
      mosaic.reverse_state_pass, save_drhs=save_x, **plain))(*bargs)
  if save_x:
    want = (*want[:2], tok(want[2]), *want[3:])
  check(run(functools.partial(mosaic.reverse_state_pass, heads=h, save_drhs=save_x, **mk))(
      *(tok(x) for x in bargs[:3]), *bargs[3:]), want)


@pytest.mark.parametrize("d,vdim,e,erase,wgs,save_x,bv", [
    (128, 128, 1, True, 1, True, 32), (128, 128, 1, False, 1, False, 64),
    (128, 128, 4, True, 1, False, None),
    (128, 128, 8, True, 1, False, 16), (128, 128, 8, False, 1, False, 16),
    (64, 64, 8, True, 1, True, None), (64, 32, 3, False, 1, False, None),
    # two warpgroups (D = 128) at their default block_v (32) and at block_v 16
    (128, 128, 1, True, 2, True, None), (128, 128, 4, False, 2, False, None),
    (128, 128, 8, True, 2, True, None), (128, 128, 8, False, 2, False, 16),
])
def test_heads_layout_lowers_for_cuda(d, vdim, e, erase, wgs, save_x, bv):
  """Both state passes with ``heads`` pass the Mosaic GPU lowering: their TMA copies of q, k, v
  (dO) and the stores of o are strided boxes of the (B, T, H, X) arrays (row stride H * X; with
  two warpgroups, 64 columns of q and k each); o (and the reverse pass's dV, ``save_drhs``) comes
  back (B, T, H, V), every other output in its (BH, ...) layout, and no input is transposed
  before the kernel."""
  b, h, nc, c = 2, 2, 4, 64
  bh, t = b * h, nc * c
  args = kernel_arg_specs([(b, t, h, d), (b, t, h, d), (b, t, h, vdim)], bh=bh, nc=nc, c=c, d=d,
                          vdim=vdim, e=e)
  kw = dict(scale=SCALE, erase=erase, block_v=bv, warpgroups=wgs, heads=h)
  suffix = "_wg2" if wgs == 2 else ""
  traced = jax.jit(functools.partial(mosaic.state_pass, save_x=save_x, **kw)).trace(*args)
  shapes = [x.shape for x in jax.tree.leaves(traced.out_info)]
  assert shapes == [(b, t, h, vdim)] + [(bh, nc, c, vdim)] * (2 if save_x else 1) + [
      (bh, nc, e, d, vdim), (bh, e, d, vdim)]
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_forward_mgpu" + suffix in text
  assert not transposes_an_argument(text)
  # The reverse pass with save_drhs where the op pairs it with save_x: dV stored (B, T, H, V).
  traced = jax.jit(functools.partial(mosaic.reverse_state_pass, save_drhs=save_x,
                                     **kw)).trace(*args)
  shapes = [x.shape for x in jax.tree.leaves(traced.out_info)]
  rhs = [(bh, nc, c, vdim), (b, t, h, vdim)] if save_x and erase else []
  assert shapes == [(bh, nc, c, vdim), *rhs, (bh, nc, e, d, vdim), (bh, e, d, vdim)]
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_backward_states_mgpu" + suffix in text
  assert not transposes_an_argument(text)


def test_heads_layout_rejects():
  """``heads`` needs T a multiple of C (whole chunks: the argument is named) and matching B * H
  and T, in both passes; two warpgroups take it where they take the sizes (D = 128)."""
  z = lambda *s, dt=jnp.bfloat16: jnp.zeros(s, dt)
  rest = lambda bh, nc: (*(z(bh, nc, 64, 1, dt=jnp.float32),) * 4,
                         *(z(bh, nc, 64, 64, dt=jnp.float32),) * 2, z(bh, 1, 64, 64,
                                                                     dt=jnp.float32))
  x = z(1, 128, 2, 64)
  kw = dict(scale=1.0, erase=True, heads=2)
  with pytest.raises(ValueError, match="q: T = 150 must be a multiple of the chunk size C = 64"):
    mosaic.state_pass(z(1, 150, 2, 64), x, x, *rest(2, 3), **kw)
  with pytest.raises(ValueError, match="v: T = 100"):
    mosaic.state_pass(x, x, z(1, 100, 2, 64), *rest(2, 2), **kw)
  with pytest.raises(ValueError, match="k: .B . H, T. = .2, 192. does not match"):
    mosaic.state_pass(x, z(1, 192, 2, 64), x, *rest(2, 2), **kw)
  with pytest.raises(ValueError, match="two warpgroups need D = 128"):
    mosaic.state_pass(x, x, x, *rest(2, 2), warpgroups=2, **kw)
  with pytest.raises(ValueError, match="do: T = 100 must be a multiple of the chunk size C = 64"):
    mosaic.reverse_state_pass(x, x, z(1, 100, 2, 64), *rest(2, 2), **kw)
  with pytest.raises(ValueError, match="q: .B . H, T. = .2, 128. does not match"):
    mosaic.reverse_state_pass(x, x, x, *rest(2, 3), warpgroups=2, **kw)


def test_two_warpgroups_supported():
  bf16 = jnp.bfloat16
  assert mosaic.warpgroups_supported(128, 128, 64, 8) is None
  assert mosaic.default_block_v(128, 128, 64, 8, warpgroups=2) == 32
  assert mosaic.default_block_v(128, 128, 64, 8) == 16              # one warpgroup unchanged
  # By default two warpgroups where one warpgroup's state fills its registers (E * BV = 128 at
  # D = 128), the forward only at BV >= 32; block_v stays one warpgroup's.
  assert mosaic.default_state_tiles(128, 128, 64, 8) == (16, 1, 2)
  assert mosaic.default_state_tiles(128, 128, 64, 4) == (32, 2, 2)
  assert mosaic.default_state_tiles(128, 128, 64, 2) == (32, 1, 1)
  assert mosaic.default_state_tiles(128, 128, 64, 8, block_v=32) == (32, 2, 2)
  assert mosaic.default_state_tiles(64, 64, 64, 8) == (16, 1, 1)    # two need D = 128
  assert max(mosaic.smem_bytes_2wg(128, 64, 8, 32, backward) for backward in (False, True)) <= (
      mosaic.SMEM_LIMIT)
  assert mosaic.supported(128, 128, 64, 8, bf16, block_v=32, warpgroups=2) is None
  assert mosaic.supported(128, 128, 64, 3, bf16, warpgroups=2) is None
  assert "D = 128" in mosaic.warpgroups_supported(64, 64, 64, 8)
  assert "D = 128" in mosaic.supported(64, 64, 64, 8, bf16, warpgroups=2)
  assert "bfloat16" in mosaic.supported(128, 128, 64, 8, jnp.float32, warpgroups=2)
  assert "multiple of 32" in mosaic.warpgroups_supported(128, 128, 64, 3, block_v=16)
  assert "warpgroups" in mosaic.supported(128, 128, 64, 8, bf16, warpgroups=3)
  x = jnp.zeros((1, 1, 64, 64), bf16)
  rest = (*(jnp.zeros((1, 1, 64, 1)),) * 4, jnp.zeros((1, 1, 64, 64)), jnp.zeros((1, 1, 64, 64)),
          jnp.zeros((1, 1, 64, 64)))
  with pytest.raises(ValueError, match="D = 128"):
    mosaic.state_pass(x, x, x, *rest, scale=1.0, erase=True, warpgroups=2)
  with pytest.raises(ValueError, match="warpgroups must be 1 or 2"):
    mosaic.reverse_state_pass(x, x, x, *rest, scale=1.0, erase=True, warpgroups=4)


def test_plan_shows_state_tiles():
  """The plan's tiles for the state passes: warpgroups per pass (E = 8: one for the forward at
  block_v 16, with the reason, two for the reverse, its E products of N = block_v), the
  transposed operands as SMEM views; the kernels get the plan's warpgroups and block_v."""
  bf16 = jnp.bfloat16
  cfg = Config("gpu", block_v=16, bwd_block_v=32, mosaic_gpu=True)
  plan = pops.explain(128, 128, 8, 64, bf16, config=cfg)
  assert "block_v 16" in plan.forward.tiles and "1 warpgroup(s)" in plan.forward.tiles
  assert "two would run the forward's products over D as 8 wgmmas of N = 16" in (
      plan.forward.reason)
  assert "2 warpgroup(s), 8 x N = 16 products" in plan.backward_states.tiles
  assert "K^T as transposed SMEM views" in plan.forward.tiles
  assert "K^T Q^T A^T P^T as transposed SMEM views" in plan.backward_states.tiles
  zeros = lambda n, dt: jnp.zeros((1, 1, 64, n), dt)
  fwd, bwd = pops.state_pass_kernels(cfg, zeros(128, bf16), zeros(128, bf16),
                                     zeros(8, jnp.float32))
  assert (fwd.keywords["warpgroups"], bwd.keywords["warpgroups"]) == (1, 2)
  assert fwd.keywords["block_v"] == bwd.keywords["block_v"] == 16
  at_64 = pops.explain(64, 64, 8, 64, bf16, config=cfg).forward
  assert "1 warpgroup(s)" in at_64.tiles and "products" not in at_64.tiles


def test_supported():
  assert mosaic.supported(64, 64, 64, 8, jnp.bfloat16) is None
  assert mosaic.supported(128, 128, 64, 8, jnp.bfloat16) is None
  assert "bfloat16" in mosaic.supported(64, 64, 64, 8, jnp.float32)
  assert "chunk size" in mosaic.supported(64, 64, 32, 8, jnp.bfloat16)
  assert mosaic.supported(128, 128, 64, 8, jnp.bfloat16, block_v=32) is not None  # 2 WGs needed
  assert mosaic.supported(64, 48, 64, 1, jnp.bfloat16) is not None
  with pytest.raises(ValueError, match="bfloat16"):
    x = jnp.zeros((1, 1, 64, 64), jnp.float32)
    mosaic.state_pass(x, x, x, *(jnp.zeros((1, 1, 64, 1)),) * 4, jnp.zeros((1, 1, 64, 64)),
                   jnp.zeros((1, 1, 64, 64)), jnp.zeros((1, 1, 64, 64)), scale=1.0, erase=True)


# The lean forward (``state_pass(residuals=False)``, the op's primal): o and the final state
# only. Its arithmetic is the full forward's, so in interpret mode it gives the same bits.

@pytest.mark.parametrize("wgs,d,vdim,e,bv,erase,heads,pieces", [
    pytest.param(1, 64, 32, 8, 16, True, False, 1, id="wg1-E8-BV16-erase"),
    pytest.param(2, 128, 32, 8, 32, True, True, 1, id="wg2-E8-erase-heads"),
    pytest.param(2, 128, 16, 2, 16, False, False, 1, id="wg2-E2-BV16-noerase"),  # one program
])
def test_lean_forward_matches_full(wgs, d, vdim, e, bv, erase, heads, pieces):
  """``residuals=False``: the forward returns o and the final state alone, bit for bit the full
  forward's (one and two warpgroups, erase or not, the (BH, NC, C, X) layout or ``heads``, and
  over two pieces with ``heads``). Two warpgroups run eagerly (module docstring)."""
  b, h, t = 1, 2 if wgs == 1 else 1, 128 * pieces    # NC = 2 a piece
  fargs, _, _ = build(b, t, h, d, vdim, e, 64, erase)
  kw = dict(scale=SCALE, erase=erase, block_v=bv, warpgroups=wgs, interpret=True)
  if heads:
    kw["heads"] = h
    if pieces > 1:
      cut = lambda x: x.reshape(x.shape[0] * pieces, x.shape[1] // pieces, *x.shape[2:])
      fargs = (*map(cut, fargs[:9]), jnp.repeat(fargs[9], pieces, axis=0))
      kw["pieces"] = pieces
    whole = lambda x: x.reshape(x.shape[0] // pieces, x.shape[1] * pieces, *x.shape[2:])
    fargs = (*(token_major(whole(x), b, h) for x in fargs[:3]), *fargs[3:])
  run = jax.jit if wgs == 1 else (lambda f: f)
  full = run(functools.partial(mosaic.state_pass, **kw))(*fargs)
  lean = run(functools.partial(mosaic.state_pass, residuals=False, **kw))(*fargs)
  assert len(full) == 4 and len(lean) == 2
  for name, x, y in zip(("o", "ht"), lean, (full[0], full[-1]), strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    assert jnp.array_equal(x, y), f"{name}: rel RMS {rel_rms(x, y):.2e}"


def test_lean_forward_refuses_save_x():
  fargs = zero_operands(bh=1, nc=1, c=64, d=64, vdim=32, e=1)
  with pytest.raises(ValueError, match="save_x needs residuals"):
    mosaic.state_pass(*fargs, scale=SCALE, erase=True, save_x=True, residuals=False,
                      interpret=True)


def hopper_config(**fields):
  """The Hopper kernels in interpret mode, as the op runs them on a GPU."""
  return Config("cpu", block_v=16, bwd_block_v=16, mosaic_gpu=True, mosaic_gpu_backward=True,
                ut_kernel=True, **fields)


def primal(args, erase, cfg):
  """``triadic_pallas``' (o, final state) without a gradient: ``_core``'s primal."""
  return pops.triadic_pallas(*args[:7], scale=args[0].shape[-1] ** -0.5, initial_state=args[7],
                             erase=erase, chunk_size=64, config=cfg)


@pytest.mark.parametrize("b,t,h,d,e,erase,fields", [
    pytest.param(1, 128, 2, 64, 3, True, {}, id="wg1-E3-erase-token-major"),
    pytest.param(1, 150, 1, 64, 2, False, {}, id="wg1-E2-noerase-relayout"),
    pytest.param(2, 256, 2, 64, 2, True, dict(sequence_pieces=2, warmup_chunks=2),
                 id="wg1-E2-erase-pieces"),
    pytest.param(1, 128, 1, 128, 2, True, dict(state_warpgroups=2), id="wg2-E2-erase"),
])
def test_primal_matches_the_differentiated_forward(b, t, h, d, e, erase, fields):
  """The op's output and final state without a gradient (``_core``'s primal: the forward state
  pass writing o and ht only) equal those of the differentiated call (``jax.vjp``: ``_core_fwd``,
  the pass with residuals, in a program that also keeps X and the masks) to 1e-3 relative RMS: the
  two programs are compiled apart, so their bf16 roundings may differ (the kernel alone gives the
  same bits with and without residuals: ``test_lean_forward_matches_full``). One and two
  warpgroups (``Config.state_warpgroups``), token-major (T whole chunks) and relayouted (T = 150),
  over two pieces (decay 4: every window decays enough that the pieces run), erase or not; and the
  first case the scan's within the bf16 bounds. One warpgroup runs under jit, two eagerly (module
  docstring)."""
  vdim = 32
  cfg = hopper_config(**fields)
  plan = pops.explain(d, vdim, e, 64, jnp.bfloat16, config=cfg)
  assert plan.mosaic_state_kernels and "without gradients o and the final state only" in (
      plan.forward.tiles)
  wgs = fields.get("state_warpgroups", 1)
  assert f"{wgs} warpgroup(s)" in plan.forward.tiles
  assert pops.explain_layout(b, t, h, d, vdim, e, 64, jnp.bfloat16,
                             config=cfg).token_major == (t % 64 == 0)
  args, _, _ = make_grad_inputs(0, b, t, h, d, vdim, e, decay=4.0 if fields else 1.0,
                                dtype=jnp.bfloat16)
  run = jax.jit if wgs == 1 else (lambda f: f)
  got = run(lambda a: primal(a, erase, cfg))(args)
  want = run(lambda a: jax.vjp(lambda *x: primal(x, erase, cfg), *a)[0])(args)
  for name, x, y in zip(("o", "state"), got, want, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    assert rel_rms(x, y) < 1e-3, f"{name}: rel RMS {rel_rms(x, y):.2e}"
  if t == 128 and h == 2:
    scan = jax.jit(lambda *a: triadic_gdn(*a[:7], initial_state=a[7], erase=erase, impl="scan",
                                          chunk_size=64))
    o_ref, s_ref = scan(*(x.astype(jnp.float32) for x in args[:7]), args[7])
    bound = PALLAS_BOUNDS[jnp.bfloat16]
    assert rel_rms(got[0], o_ref) < bound["out"], rel_rms(got[0], o_ref)
    assert rel_rms(got[1], s_ref) < bound["state"], rel_rms(got[1], s_ref)


def mosaic_results(text):
  """The result types of every Mosaic GPU custom call in a StableHLO text, in order."""
  out = []
  for line in text.splitlines():
    if "stablehlo.custom_call @mosaic_gpu" in line:
      out.append(re.findall(r"tensor<[^>]*>", line.rsplit(" -> ", 1)[1]))
  return out


@pytest.mark.parametrize("e,state_wgs,token_major", [(8, None, True), (8, 2, False),
                                                     (2, 2, True)])
def test_primal_lowers_for_cuda_without_residuals(e, state_wgs, token_major):
  """The op's primal lowers for CUDA (D = V = 128; one warpgroup at E = 8 by default, two with
  ``Config.state_warpgroups``) with one Mosaic GPU kernel, the forward state pass, whose outputs
  are o and the final state (in its (B*H, V / BV, D, E*BV) layout) only; under a gradient the
  same pass also returns U and the chunk-start states."""
  b, t, h, d = 1, 128, 2, 128
  cfg = dataclasses.replace(pops.default_config("gpu", e, d), mosaic_gpu=True,
                            mosaic_gpu_backward=True, state_warpgroups=state_wgs,
                            token_major=token_major)
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  args = [spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, e),
          spec(b, t, h, e), spec(b, t, h, e), spec(b, t, h), spec(b, h, e, d, d, dt=jnp.float32)]
  tiles = plan_lib.state_tiles(cfg, d=d, vd=d, c=64, e=e)
  assert tiles.forward_warpgroups == (state_wgs or 1)
  bv, nc = tiles.block_v, t // 64
  o = f"tensor<{b}x{t}x{h}x{d}xbf16>" if token_major else f"tensor<{b * h}x{nc}x64x{d}xbf16>"
  ht = f"tensor<{b * h}x{d // bv}x{d}x{e * bv}xf32>"
  per_chunk = f"tensor<{b * h}x{nc}x64x{d}xbf16>"
  states = f"tensor<{b * h}x{nc}x{e}x{d}x{d}xbf16>"
  lower = lambda fn: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  text = lower(lambda *a: primal(a, True, cfg))
  assert ("triadic_forward_mgpu_wg2" in text) == (state_wgs == 2)
  assert mosaic_results(text) == [[o, ht]]
  loss = lambda *a: primal(a, True, cfg)[0].astype(jnp.float32).sum()
  forward = mosaic_results(lower(jax.grad(loss, argnums=tuple(range(8)))))[0]
  assert forward[:2] == [o, per_chunk] and forward[-2:] == [states, ht], forward


