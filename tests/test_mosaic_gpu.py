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
The two-warpgroup kernels (``warpgroups=2``, D = 128) are checked the same way, against the same
reference and bounds. They run eagerly (the kernel alone under jit): inside a larger jitted
function the interpreter's two simulated warpgroups can wait on each other forever on a 2-core
machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from testkit.triadic import make_grad_inputs
from testkit import rel_rms
from triadic.pallas import mosaic, mosaic_backward, recurrent
from triadic.pallas.chunk_prep import chunk_prep
from triadic.pallas.common import Config
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
    # b, t, h, v, e, erase, save_x   (D = 128, C = 64, block_v = 32; NC = 3 for t = 150)
    pytest.param(1, 150, 2, 64, 1, False, False, id="E1-noerase-V64"),
    pytest.param(1, 150, 2, 32, 3, True, True, id="E3-erase-saveX"),
    pytest.param(1, 150, 2, 32, 8, True, False, id="E8-erase"),
]


@pytest.mark.parametrize("b,t,h,vdim,e,erase,save_x", WG2_CASES)
def test_two_warpgroups_match_recurrent(b, t, h, vdim, e, erase, save_x):
  """``warpgroups=2`` (each warpgroup 64 of the D = 128 state rows, E * block_v = 256 at E = 8):
  the forward and reverse passes against ``recurrent``; with save_x, X against X formed from the
  reference's chunk-start states."""
  d, c = 128, 64
  fargs, do, dht = build(b, t, h, d, vdim, e, c, erase)
  kw = dict(scale=SCALE, erase=erase)
  bv = mosaic.default_block_v(d, vdim, c, e, warpgroups=2)
  assert bv == 32
  got = mosaic.state_pass(*fargs, warpgroups=2, save_x=save_x, interpret=True, **kw)
  want = recurrent.state_pass(*fargs, cfg=CPU, **kw)
  if save_x:
    x, got = got[2], got[:2] + got[3:]
    q, k, v, k2, _, gc_col = fargs[:6]
    want_x = mosaic_backward.x_from_states(k, v, want[2], k2, gc_col)
    assert x.shape == want_x.shape and x.dtype == q.dtype
    assert rel_rms(x, want_x) < BOUND, f"X: rel RMS {rel_rms(x, want_x):.2e}"
  check_close(FORWARD_OUTPUTS, got, want)
  bargs = (fargs[0], fargs[1], do, *fargs[3:9], dht)
  got = mosaic.reverse_state_pass(*bargs, warpgroups=2, interpret=True, **kw)
  check_close(BACKWARD_OUTPUTS, got, recurrent.reverse_state_pass(*bargs, cfg=CPU, **kw))


@pytest.mark.parametrize("d,vdim,e,erase,wgs,save_x", [
    (64, 64, 8, True, 1, False), (128, 128, 8, True, 1, False), (128, 64, 2, False, 1, False),
    (64, 32, 3, True, 1, False),
    # two warpgroups at D = 128 with their default block_v (32: E * block_v = 256 at E = 8)
    (128, 128, 8, True, 2, True), (128, 128, 8, False, 2, False), (128, 64, 3, True, 2, False),
    (128, 32, 1, True, 2, True),
])
def test_kernels_lower_for_cuda(d, vdim, e, erase, wgs, save_x):
  """Both kernels pass the Mosaic GPU lowering (layout inference, wgmma/TMA checks, SMEM size)
  for the default block_v; nothing runs."""
  bh, nc, c = 2, 4, 64
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  f32 = functools.partial(spec, dt=jnp.float32)
  common = [f32(bh, nc, c, e), f32(bh, nc, c, e), f32(bh, nc, c, e), f32(bh, nc, c, 1),
            f32(bh, nc, c, c), f32(bh, nc, c, c)]
  args = (spec(bh, nc, c, d), spec(bh, nc, c, d), spec(bh, nc, c, vdim), *common,
          f32(bh, e, d, vdim))
  kw = dict(scale=SCALE, erase=erase, warpgroups=wgs)
  suffix = "_wg2" if wgs == 2 else ""
  fwd = jax.jit(functools.partial(mosaic.state_pass, save_x=save_x, **kw))
  text = fwd.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_forward_mgpu" + suffix in text
  bwd = jax.jit(functools.partial(mosaic.reverse_state_pass, **kw))
  text = bwd.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_backward_states_mgpu" + suffix in text


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
