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
A second test lowers both kernels for "cuda" (Mosaic GPU lowering and layout checks, no GPU).
The two-warpgroup kernels (``warpgroups=2``, D = 128), with narrow and with wide products over D
(``wide_products``), are checked the same way, against the same reference and bounds. They run
eagerly (the kernel alone under jit): inside a larger jitted
function the interpreter's two simulated warpgroups can wait on each other forever on a 2-core
machine.
With ``transpose_ref`` (transposed operands as views of the SMEM copies; in interpret mode
explicit transposes) one one-warpgroup and one two-warpgroup case run the same comparison; the
CUDA lowering of every variant is checked with it on and off, and that with it on no transposed
copy of an input is made.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from testkit.triadic import make_grad_inputs
from testkit import rel_rms
from triadic.pallas import mosaic, mosaic_backward, recurrent
from triadic.pallas.chunk_prep import chunk_prep
from triadic.pallas.common import Config
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
  nc = -(-t // c)
  merge = lambda x: x.reshape(b * h, *x.shape[2:])
  q, k, v = (merge(kernel_layout(x, nc, c)) for x in args[:3])
  k2, q2, g, beta = (merge(kernel_layout(x.astype(jnp.float32), nc, c)) for x in args[3:7])
  h0, dht = merge(args[7]), merge(ds)
  do = merge(kernel_layout(do, nc, c)).astype(q.dtype)
  gc_col, _, a, p = chunk_prep(q, k, k2, q2, g, beta, erase=erase, cfg=CPU)
  return (q, k, v, k2, q2, gc_col, beta, a, p, h0), do, dht


CPU = Config("cpu", block_v=16, bwd_block_v=16)

CASES = [
    # b, t, h, v, e, block_v, erase   (D = 64, C = 64; NC = 3 for t = 150)
    pytest.param(1, 150, 2, 32, 1, 32, True, id="E1-BV32-erase"),
    pytest.param(2, 150, 1, 64, 3, 32, True, id="E3-BV32-erase"),
    pytest.param(1, 150, 2, 32, 4, 16, False, id="E4-BV16-noerase"),
    pytest.param(1, 150, 2, 32, 8, 16, True, id="E8-BV16-erase"),
    pytest.param(1, 150, 2, 32, 8, 32, False, id="E8-BV32-noerase"),
]


@pytest.mark.parametrize("b,t,h,vdim,e,bv,erase", CASES)
def test_forward_and_backward_match_recurrent(b, t, h, vdim, e, bv, erase):
  d, c = 64, 64
  fargs, do, dht = build(b, t, h, d, vdim, e, c, erase)
  assert fargs[0].shape[1] >= 3 and fargs[0].shape[0] >= 2
  kw = dict(scale=SCALE, erase=erase)
  got = jax.jit(functools.partial(mosaic.state_pass, block_v=bv, interpret=True, **kw))(*fargs)
  check_close(FORWARD_OUTPUTS, got, recurrent.state_pass(*fargs, cfg=CPU, **kw))
  bargs = (fargs[0], fargs[1], do, *fargs[3:9], dht)
  got = jax.jit(functools.partial(mosaic.reverse_state_pass, block_v=bv, interpret=True,
                                  **kw))(*bargs)
  check_close(BACKWARD_OUTPUTS, got, recurrent.reverse_state_pass(*bargs, cfg=CPU, **kw))


FORWARD_OUTPUTS = ("o", "U", "states", "final state")
BACKWARD_OUTPUTS = ("dU", "dstates", "dh0")


def check_close(names, got, want):
  """Shape, dtype and relative RMS (< BOUND) of each output against the reference's."""
  for name, x, y in zip(names, got, want, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    assert rel_rms(x, y) < BOUND, f"{name}: rel RMS {rel_rms(x, y):.2e}"


WG2_CASES = [
    # b, t, h, v, e, erase, save_x, wide   (D = 128, C = 64; NC = 3 for t = 150)
    # narrow products, the default block_v (32: E * block_v = 256 at E = 8)
    pytest.param(1, 150, 2, 64, 1, False, False, None, id="E1-noerase-V64"),
    pytest.param(1, 150, 2, 32, 3, True, True, None, id="E3-erase-saveX"),
    pytest.param(1, 150, 2, 32, 8, True, False, None, id="E8-erase"),
    # wide products at this block_v (E * block_v <= 128; E = 3: the K, Q pieces' swizzle is 64 B)
    pytest.param(1, 150, 2, 16, 8, True, True, 16, id="E8-BV16-wide-erase-saveX"),
    pytest.param(1, 150, 2, 32, 3, True, False, 32, id="E3-BV32-wide-erase"),
]


@pytest.mark.parametrize("b,t,h,vdim,e,erase,save_x,wide", WG2_CASES)
def test_two_warpgroups_match_recurrent(b, t, h, vdim, e, erase, save_x, wide):
  """``warpgroups=2`` (each warpgroup 64 of the D = 128 state rows): the forward and reverse
  passes against ``recurrent``, with narrow products over D at the default block_v, or with
  ``wide_products`` at block_v ``wide``; with save_x, X against X formed from the reference's
  chunk-start states."""
  d, c = 128, 64
  wg2 = dict(warpgroups=2)
  if wide:
    wg2.update(block_v=wide, wide_products=True)
  else:
    assert mosaic.default_block_v(d, vdim, c, e, warpgroups=2) == 32
  match_recurrent(build(b, t, h, d, vdim, e, c, erase), erase, save_x, wg2)


@pytest.mark.parametrize("b,t,h,d,vdim,e,bv,wgs,wide", [
    pytest.param(1, 150, 2, 64, 32, 2, 32, 1, False, id="D64-E2-one-warpgroup"),
    pytest.param(1, 150, 2, 128, 16, 8, 16, 2, True, id="D128-E8-BV16-two-warpgroups-wide"),
])
def test_transpose_ref_matches_recurrent(b, t, h, d, vdim, e, bv, wgs, wide):
  """``transpose_ref``: the forward (with save_x) and reverse passes against ``recurrent``, one
  warpgroup and two with wide products (K, Q, S_cat then at the block_v swizzle)."""
  kernel_kw = dict(block_v=bv, warpgroups=wgs, wide_products=wide, transpose_ref=True)
  match_recurrent(build(b, t, h, d, vdim, e, 64, True), True, True, kernel_kw)


def match_recurrent(built, erase, save_x, kernel_kw):
  """The Mosaic forward (with ``save_x``) and reverse passes with ``kernel_kw`` against
  ``recurrent`` on ``build``'s operands; with save_x, X against X formed from the reference's
  chunk-start states. Two warpgroups run eagerly (module docstring), one under jit."""
  fargs, do, dht = built
  kw = dict(scale=SCALE, erase=erase)
  run = (lambda f: f) if kernel_kw.get("warpgroups", 1) == 2 else jax.jit
  mk = dict(kw, interpret=True, **kernel_kw)
  got = run(functools.partial(mosaic.state_pass, save_x=save_x, **mk))(*fargs)
  want = recurrent.state_pass(*fargs, cfg=CPU, **kw)
  if save_x:
    x, got = got[2], got[:2] + got[3:]
    q, k, v, k2, _, gc_col = fargs[:6]
    want_x = mosaic_backward.x_from_states(k, v, want[2], k2, gc_col)
    assert x.shape == want_x.shape and x.dtype == q.dtype
    assert rel_rms(x, want_x) < BOUND, f"X: rel RMS {rel_rms(x, want_x):.2e}"
  check_close(FORWARD_OUTPUTS, got, want)
  bargs = (fargs[0], fargs[1], do, *fargs[3:9], dht)
  got = run(functools.partial(mosaic.reverse_state_pass, **mk))(*bargs)
  check_close(BACKWARD_OUTPUTS, got, recurrent.reverse_state_pass(*bargs, cfg=CPU, **kw))


@pytest.mark.parametrize("d,vdim,e,erase,wgs,save_x,wide", [
    (64, 64, 8, True, 1, False, None), (128, 128, 8, True, 1, False, None),
    (128, 64, 2, False, 1, False, None), (64, 32, 3, True, 1, False, None),
    # two warpgroups at D = 128 with their default block_v (32: E * block_v = 256 at E = 8)
    (128, 128, 8, True, 2, True, None), (128, 128, 8, False, 2, False, None),
    (128, 64, 3, True, 2, False, None), (128, 32, 1, True, 2, True, None),
    # two warpgroups with wide products at block_v ``wide`` (E * block_v <= 128)
    (128, 128, 8, True, 2, True, 16), (128, 128, 8, False, 2, False, 16),
    (128, 128, 4, True, 2, False, 32), (128, 64, 3, True, 2, True, 32),
    (128, 32, 1, False, 2, False, 32),
])
@pytest.mark.parametrize("transpose", [False, True], ids=["copies", "transpose_ref"])
def test_kernels_lower_for_cuda(d, vdim, e, erase, wgs, save_x, wide, transpose):
  """Both kernels pass the Mosaic GPU lowering (layout inference, wgmma/TMA checks, SMEM size)
  for the default block_v, or with ``wide_products`` at block_v ``wide``; nothing runs. The
  inputs transposed in the program before the kernel (a ``stablehlo.transpose`` of an argument):
  without ``transpose_ref`` K (argument 1) in the forward, K, Q, A, P (1, 0, 7, 8) in the
  reverse; with it none."""
  bh, nc, c = 2, 4, 64
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  f32 = functools.partial(spec, dt=jnp.float32)
  common = [f32(bh, nc, c, e), f32(bh, nc, c, e), f32(bh, nc, c, e), f32(bh, nc, c, 1),
            f32(bh, nc, c, c), f32(bh, nc, c, c)]
  args = (spec(bh, nc, c, d), spec(bh, nc, c, d), spec(bh, nc, c, vdim), *common,
          f32(bh, e, d, vdim))
  kw = dict(scale=SCALE, erase=erase, warpgroups=wgs, transpose_ref=transpose)
  if wide:
    kw.update(block_v=wide, wide_products=True)
  suffix = "_wg2" if wgs == 2 else ""
  transposed = lambda text: {int(x) for x in re.findall(r"stablehlo\.transpose %arg(\d+)", text)}
  fwd = jax.jit(functools.partial(mosaic.state_pass, save_x=save_x, **kw))
  text = fwd.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_forward_mgpu" + suffix in text
  assert transposed(text) == (set() if transpose else {1})
  bwd = jax.jit(functools.partial(mosaic.reverse_state_pass, **kw))
  text = bwd.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_backward_states_mgpu" + suffix in text
  assert transposed(text) == (set() if transpose else {0, 1, 7, 8})


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
  # With wide products the forward takes two warpgroups at block_v 16 as well.
  assert mosaic.default_state_tiles(128, 128, 64, 8, wide_products=True) == (16, 2, 2)
  assert mosaic.default_state_tiles(128, 128, 64, 2, wide_products=True) == (32, 1, 1)
  for e, bv in ((8, 16), (4, 32), (3, 32)):
    assert mosaic.wide_products_supported(128, 128, 64, e, bv) is None, (e, bv)
    for backward in (False, True):
      assert (mosaic.smem_bytes_2wg(128, 64, e, bv, backward, wide=True)
              == mosaic.smem_bytes_2wg(128, 64, e, bv, backward) + 128 * e * bv * 2)
  assert "> 128" in mosaic.wide_products_supported(128, 128, 64, 8, 32)
  assert "D = 128" in mosaic.wide_products_supported(64, 64, 64, 4, 32)
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
  with pytest.raises(ValueError, match="wide_products needs warpgroups=2"):
    mosaic.state_pass(x, x, x, *rest, scale=1.0, erase=True, wide_products=True)


def test_plan_shows_wide_products():
  """``Config.state_wide_products``: the plan's tiles and reasons say which two-warpgroup passes
  form their products wide (E * block_v <= 128) and which stay narrow, and why; the kernels get
  it as ``wide_products``; with the warpgroups left open the forward takes two at block_v 16."""
  bf16 = jnp.bfloat16
  cfg = Config("gpu", block_v=16, bwd_block_v=32, mosaic_gpu=True, state_wide_products=True)
  plan = pops.explain(128, 128, 8, 64, bf16, config=cfg)
  for stage in (plan.forward, plan.backward_states):
    assert "block_v 16" in stage.tiles and "2 warpgroup(s), wide products (N = 128)" in stage.tiles
    assert "wide products: Config.state_wide_products" in stage.reason
  zeros = lambda n, dt: jnp.zeros((1, 1, 64, n), dt)
  fwd, bwd = pops.state_pass_kernels(cfg, zeros(128, bf16), zeros(128, bf16),
                                     zeros(8, jnp.float32))
  assert fwd.keywords["wide_products"] and bwd.keywords["wide_products"]
  assert fwd.keywords["warpgroups"] == bwd.keywords["warpgroups"] == 2
  off = pops.explain(128, 128, 8, 64, bf16,
                     config=dataclasses.replace(cfg, state_wide_products=False))
  assert "1 warpgroup(s)" in off.forward.tiles
  assert "Config.state_wide_products off" in off.forward.reason
  assert "narrow products (8 x N = 16)" in off.backward_states.tiles
  # E * block_v = 256: both passes narrow, with the reason; D = 64: one warpgroup, nothing to say.
  wide_256 = pops.explain(128, 128, 8, 64, bf16,
                          config=dataclasses.replace(cfg, state_warpgroups=2))
  assert "narrow products (8 x N = 32)" in wide_256.forward.tiles
  assert "narrow products: E * block_v = 256 > 128" in wide_256.backward_states.reason
  at_64 = pops.explain(64, 64, 8, 64, bf16, config=cfg).forward
  assert "1 warpgroup(s)" in at_64.tiles and "products" not in at_64.tiles + at_64.reason
  with pytest.raises(ValueError, match="state_wide_products"):
    Config("gpu", block_v=16, bwd_block_v=16, state_wide_products=True, state_warpgroups=1)
  with pytest.raises(ValueError, match="state_wide_products must be a bool"):
    Config("gpu", block_v=16, bwd_block_v=16, state_wide_products=1)


def test_plan_shows_transpose_ref():
  """``Config.state_transpose_ref``: the plan's tiles say how each pass gets its transposed
  operands (views or pre-transposed copies) and the reason names the option; the kernels get it
  as ``transpose_ref``; a non-bool is refused."""
  bf16 = jnp.bfloat16
  cfg = Config("gpu", block_v=16, bwd_block_v=32, mosaic_gpu=True, state_transpose_ref=True,
               state_wide_products=True)
  plan = pops.explain(128, 128, 8, 64, bf16, config=cfg)
  assert "K^T as transpose_ref views (K, Q, S_cat at block_v swizzle)" in plan.forward.tiles
  assert "K^T Q^T A^T P^T as transpose_ref views" in plan.backward_states.tiles
  for stage in (plan.forward, plan.backward_states):
    assert "transposed views: Config.state_transpose_ref" in stage.reason
  zeros = lambda n, dt: jnp.zeros((1, 1, 64, n), dt)
  for c in (cfg, dataclasses.replace(cfg, state_warpgroups=1, state_wide_products=False)):
    fwd, bwd = pops.state_pass_kernels(c, zeros(128, bf16), zeros(128, bf16),
                                       zeros(8, jnp.float32))
    assert fwd.keywords["transpose_ref"] and bwd.keywords["transpose_ref"]
  off = pops.explain(64, 64, 2, 64, bf16,
                     config=dataclasses.replace(cfg, state_transpose_ref=False))
  assert "K^T as pre-transposed copies" in off.forward.tiles
  assert "K^T Q^T A^T P^T as pre-transposed copies" in off.backward_states.tiles
  assert "state_transpose_ref" not in off.forward.reason
  with pytest.raises(ValueError, match="state_transpose_ref must be a bool"):
    Config("gpu", block_v=16, bwd_block_v=16, state_transpose_ref="yes")


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
