"""Mosaic GPU chunk-parallel backward (``triadic.pallas.mosaic_backward``) against the Triton
structured ``backward.chunk_backward``, both in interpret mode on this CPU.

Inputs are built as ``ops._backward`` sees them: chunked bf16 q, k, v, do, float32 k2, q2, beta,
``chunk_prep`` for gc, A, P, then ``recurrent.forward`` / ``recurrent.backward`` (Pallas interpret
mode) for realistic U, chunk-start states, dU and chunk-end state gradients. The Mosaic value
kernel runs in Mosaic GPU interpret mode (simulated SMEM, TMA, barriers, wgmma), its tail in
Pallas interpret mode.
Error bound (relative RMS, ||a - b|| / ||b||): 1e-2 for every output, 2e-2 for dk2 and dgc's
column parts (they collect the row sums, which the two kernels form from differently rounded bf16
products: rowsum((K S_e) * dX) here, rowsum(K * (dX S_e^T)) in Triton); the errors each case
reaches are in benchmarks/RESULTS.md ("Kernel errors in interpret mode").
A second test lowers the whole function for "cuda" (Mosaic GPU lowering: layout inference,
wgmma / TMA operand checks, the SMEM limit) and the Triton tail; nothing runs.

``xla_slice_grads=True`` (the per-slice work in plain JAX, ``slice_grads.py``, around the
E-independent tail kernel ``_tail_ut``) is checked three ways: its tail against the in-kernel
tail on the same inputs, every case (1e-5: the two differ by float32 reassociation only; strong
decay included: g down to -20 per token, mean -5 or -10, which only the masking before exp keeps
finite; and weak decay, mean -0.01, where the chunk-end term dlam exp(gc_C) is not negligible),
the whole function against the Triton structure with the same bounds (two cases), and the whole
op against the scan; and it lowers for "cuda".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testkit.triadic import check_against_scan, make_grad_inputs
from testkit import rel_rms
from triadic.pallas import backward, mosaic, mosaic_backward, recurrent
from triadic.pallas import ops as pops
from triadic.pallas.chunk_prep import chunk_prep
from triadic.pallas.common import Config
from triadic.pallas.ops import _chunks

SCALE = 0.125
CPU = Config("cpu", block_v=16, bwd_block_v=16)
NAMES = ("dq", "dk", "dv", "dk2c", "dk2r", "dq2c", "dgcc", "dgcr", "dbeta")
BOUNDS = dict.fromkeys(NAMES, 1e-2) | {"dk2c": 2e-2, "dgcc": 2e-2}

pytestmark = pytest.mark.skipif(not mosaic.interpret_available(),
                                reason="Mosaic GPU interpret mode unavailable in this JAX")


def backward_operands(b, t, h, d, vdim, e, erase, decay, c=64, seed=0):
  """``chunk_backward``'s operands as ``ops._backward`` passes them."""
  args, do, ds = make_grad_inputs(seed, b, t, h, d, vdim, e, decay=decay, dtype=jnp.bfloat16)
  nc = -(-t // c)
  merge = lambda x: x.reshape(b * h, *x.shape[2:])
  rows = lambda x: jnp.swapaxes(x, -1, -2)
  q, k, v = (merge(_chunks(x, nc, c)) for x in args[:3])
  k2, q2, g, beta = (merge(_chunks(x.astype(jnp.float32), nc, c)) for x in args[3:7])
  h0, dht = merge(args[7]), merge(ds)
  do = merge(_chunks(do, nc, c)).astype(q.dtype)
  gcc, gcr, a, p = chunk_prep(q, k, k2, rows(k2), q2, g, rows(g), beta, erase=erase, cfg=CPU)
  kw = dict(scale=SCALE, erase=erase, cfg=CPU)
  _, u, states, _ = recurrent.forward(q, k, v, k2, q2, gcc, beta, a, p, h0, **kw)
  du, dstates, _ = recurrent.backward(q, k, do, k2, q2, gcc, beta, a, p, dht, **kw)
  return (q, k, v, do, u, du, states, dstates, k2, rows(k2), q2, gcc, gcr, beta, a)


CASES = [
    # b, t, h, v, e, block_v (None: default), erase, decay, stages (None: default), d
    # (C = 64; NC = 3). The defaults at D = 64 take two staging buffers (``default_stages``).
    pytest.param(1, 150, 2, 32, 1, None, True, 1.0, None, 64, id="E1-erase"),
    pytest.param(2, 150, 1, 64, 3, None, False, 1.0, None, 64, id="E3-noerase"),
    pytest.param(1, 150, 2, 32, 4, 16, True, 20.0, None, 64, id="E4-BV16-erase-strong-decay"),
    pytest.param(1, 150, 2, 32, 8, None, False, 1.0, None, 64, id="E8-noerase"),
    # One staging buffer (S, then dS in it): the path of D = 128, E = 8 and of a forced wider BV.
    # (E = 8 with erase runs here only: two staging buffers with erase run at E = 1 and 4.)
    pytest.param(1, 150, 2, 32, 8, None, True, 1.0, 1, 64, id="E8-erase-1stage"),
    pytest.param(2, 150, 1, 64, 3, None, False, 1.0, 1, 64, id="E3-noerase-1stage"),
    # D = 128, E = 4: the new default (BV = 16, two staging buffers) and the old one (BV = 32,
    # one staging buffer, the only one that fits at that BV).
    pytest.param(1, 150, 2, 64, 4, None, True, 1.0, None, 128, id="D128-E4-default"),
    pytest.param(1, 150, 2, 64, 4, 32, True, 1.0, None, 128, id="D128-E4-BV32-1stage"),
]


@pytest.mark.parametrize("b,t,h,vdim,e,bv,erase,decay,stages,d", CASES)
def test_matches_triton_structure(b, t, h, vdim, e, bv, erase, decay, stages, d):
  args = backward_operands(b, t, h, d, vdim, e, erase, decay)
  assert args[0].shape[0] >= 2 and args[0].shape[1] >= 3
  want = backward.chunk_backward(*args, scale=SCALE, erase=erase, cfg=CPU)
  got = jax.jit(functools.partial(mosaic_backward.chunk_backward, scale=SCALE, erase=erase,
                                  block_v=bv, stages=stages, interpret=True))(*args)
  errs = {}
  for name, x, y in zip(NAMES, got, want):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    errs[name] = rel_rms(x, y)
  bad = {k: f"{v:.2e}" for k, v in errs.items() if not v < BOUNDS[k]}
  assert not bad, f"rel RMS over bound: {bad} (all: {errs})"


def _abstract_operands(d, vdim, e, bh=2, nc=4, c=64):
  """Shapes and dtypes of ``chunk_backward``'s operands, for the lowering tests."""
  bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  return (bf(bh, nc, c, d), bf(bh, nc, c, d), bf(bh, nc, c, vdim), bf(bh, nc, c, vdim),
          f32(bh, nc, c, vdim), f32(bh, nc, c, vdim), bf(bh, nc, e, d, vdim),
          bf(bh, nc, e, d, vdim), f32(bh, nc, c, e), f32(bh, nc, e, c), f32(bh, nc, c, e),
          f32(bh, nc, c, e), f32(bh, nc, e, c), f32(bh, nc, c, 1), f32(bh, nc, c, c))


@pytest.mark.parametrize("d,vdim,e,erase,bv,stages", [
    (128, 128, 8, True, None, None),     # BV 16, one staging buffer (201 KiB)
    (64, 64, 3, False, None, None),      # BV 32, two
    (128, 128, 1, True, None, None),     # BV 64, two (187 KiB)
    (128, 128, 4, True, None, None),     # BV 16, two (142 KiB)
    (128, 128, 4, True, 32, None),       # BV 32, one (214 KiB)
    (128, 128, 2, True, 32, 2),          # BV 32, two (156 KiB)
])
def test_lowers_for_cuda(d, vdim, e, erase, bv, stages):
  """The Mosaic GPU kernel (with the hardware's transpose_ref operands) and the Triton tail lower
  for "cuda" (which checks the SMEM allocation against 227 KiB); nothing runs."""
  args = _abstract_operands(d, vdim, e)
  fn = jax.jit(functools.partial(mosaic_backward.chunk_backward, scale=SCALE, erase=erase,
                                 block_v=bv, stages=stages))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_chunk_backward_mgpu" in text
  assert "triadic_chunk_backward_tail" in text


def test_supported():
  sup = mosaic_backward.supported
  assert sup(64, 64, 64, 8, jnp.bfloat16) is None
  assert sup(128, 128, 64, 8, jnp.bfloat16) is None
  assert sup(128, 128, 64, 1, jnp.bfloat16) is None
  assert mosaic_backward.default_block_v(128, 128, 64, 8) == 16
  # (D, E) -> default (BV, stages) at V = 128.
  want = {(128, 1): (64, 2), (128, 2): (32, 2), (128, 4): (16, 2), (128, 8): (16, 1),
          (64, 1): (64, 2), (64, 2): (64, 2), (64, 4): (32, 2), (64, 8): (16, 2)}
  for (d, e), (bv, st) in want.items():
    assert mosaic_backward.default_block_v(d, 128, 64, e) == bv, (d, e)
    assert mosaic_backward.default_stages(d, 128, 64, e, bv) == st, (d, e)
    assert mosaic_backward.smem_bytes(d, 128, 64, e, bv, stages=st) <= mosaic_backward.SMEM_LIMIT
  assert "SMEM" in sup(128, 128, 64, 8, jnp.bfloat16, block_v=16, stages=2)
  assert sup(128, 128, 64, 4, jnp.bfloat16, block_v=32) is None      # one staging buffer
  assert "SMEM" in sup(128, 128, 64, 4, jnp.bfloat16, block_v=32, stages=2)
  assert "stages" in sup(128, 128, 64, 4, jnp.bfloat16, stages=3)
  assert "bfloat16" in sup(64, 64, 64, 8, jnp.float32)
  assert "chunk size" in sup(64, 64, 32, 8, jnp.bfloat16)
  assert "D in" in sup(32, 64, 64, 1, jnp.bfloat16)
  assert "SMEM" in sup(128, 128, 64, 8, jnp.bfloat16, block_v=32)
  assert "divides V=40" in sup(64, 40, 64, 1, jnp.bfloat16)
  assert "multiple" in sup(64, 40, 64, 1, jnp.bfloat16, block_v=16)
  with pytest.raises(ValueError, match="bfloat16"):
    x = jnp.zeros((1, 1, 64, 64), jnp.float32)
    mosaic_backward.chunk_backward(x, x, x, x, x, x, jnp.zeros((1, 1, 1, 64, 64)),
                                   jnp.zeros((1, 1, 1, 64, 64)), *(jnp.zeros((1, 1, 64, 1)),) * 5,
                                   jnp.zeros((1, 1, 64, 1)), x, scale=1.0, erase=True)


XLA_CASES = [
    # b, t, h, v, e, erase, decay (g = -decay * U(0, 1) per token), d; C = 64, NC = 3.
    pytest.param(1, 150, 2, 32, 1, True, 1.0, 64, id="E1-erase"),
    pytest.param(2, 150, 1, 64, 3, False, 1.0, 64, id="E3-noerase"),
    pytest.param(1, 150, 2, 32, 4, True, 20.0, 64, id="E4-erase-strong-decay"),
    pytest.param(2, 150, 1, 32, 3, False, 10.0, 64, id="E3-noerase-strong-decay"),
    pytest.param(1, 150, 2, 32, 8, True, 1.0, 64, id="E8-erase"),
    pytest.param(1, 150, 2, 64, 4, True, 10.0, 128, id="D128-E4-erase-strong-decay"),
    # Weak decay: only here is exp(gc_C) of a whole chunk far from 0, so that the chunk-end
    # term dlam exp(gc_C) of d gc counts (at decay 1, exp(gc_C) ~ e^-32).
    pytest.param(1, 150, 2, 32, 4, True, 0.02, 64, id="E4-erase-weak-decay"),
    pytest.param(2, 150, 1, 32, 3, False, 0.02, 64, id="E3-noerase-weak-decay"),
]


def check_outputs(got, want, bounds, names=NAMES):
  """Shapes, dtypes, finiteness and relative RMS of every output against ``bounds``."""
  errs = {}
  for name, x, y in zip(names, got, want, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    assert np.all(np.isfinite(np.asarray(x))), name
    errs[name] = rel_rms(x, y)
  bad = {k: f"{v:.2e}" for k, v in errs.items() if not v < bounds[k]}
  assert not bad, f"rel RMS over bound: {bad} (all: {errs})"


@pytest.mark.parametrize("b,t,h,vdim,e,erase,decay,d", [XLA_CASES[i] for i in (2, 7)])
def test_xla_slice_grads_matches_triton_structure(b, t, h, vdim, e, erase, decay, d):
  """``xla_slice_grads=True``: every output against the Triton structure, the bounds above. Two
  cases (strong decay with erase, weak decay without): the value kernel is the same as with the
  flag off (``test_matches_triton_structure``) and the tail is checked against the in-kernel
  tail on every case of XLA_CASES below."""
  args = backward_operands(b, t, h, d, vdim, e, erase, decay)
  want = backward.chunk_backward(*args, scale=SCALE, erase=erase, cfg=CPU)
  got = jax.jit(functools.partial(mosaic_backward.chunk_backward, scale=SCALE, erase=erase,
                                  interpret=True, xla_slice_grads=True))(*args)
  check_outputs(got, want, BOUNDS)


@pytest.mark.parametrize("b,t,h,vdim,e,erase,decay,d", XLA_CASES)
def test_xla_slice_grads_tail_matches_kernel_tail(b, t, h, vdim, e, erase, decay, d):
  """The plain-JAX per-slice tail against ``_tail`` (``backward.chunk_local``) on the same
  inputs: the same sums up to float32 reassociation, so 1e-5 on every output (a term dropped or
  mis-signed anywhere in ``slice_grads`` shows up far above that). Both tails are functions of
  the value kernel's outputs, which are random here (the value kernel has its own tests; running
  it in Mosaic GPU interpret mode is most of this file's time); q, k, U, dU, gc, A are real."""
  (q, k, v, do, u, du, states, dstates, k2c, k2r, q2c, gcc, gcr, beta_c, a) = (
      backward_operands(b, t, h, d, vdim, e, erase, decay))
  f32 = jnp.float32
  drhs = mosaic_backward._drhs(a, du, erase)
  keys = jax.random.split(jax.random.PRNGKey(e), 5)
  bh, nc, c = q.shape[:3]
  normal = lambda key, *shape: jax.random.normal(key, (bh, nc, *shape), f32)
  x = normal(keys[0], c, vdim) if erase else v.astype(f32)
  dqp, dkp = normal(keys[1], c, d), normal(keys[2], c, d)
  coef = normal(keys[3], c, mosaic_backward.COEF_W)
  lam = normal(keys[4], 1, mosaic_backward.LAM_W)
  tail_args = (q, k, x, do, u, du, drhs, dqp, dkp, coef, lam, k2c, k2r, q2c, gcc, gcr, beta_c, a)
  tail = lambda flag: jax.jit(functools.partial(
      mosaic_backward.tail, scale=SCALE, erase=erase, cfg=CPU, xla_slice_grads=flag))(*tail_args)
  names = [n for n in NAMES if n != "dv"]
  want, got = tail(False), tail(True)
  assert len(got) == len(want) == len(names)
  check_outputs(got, want, dict.fromkeys(NAMES, 1e-5), names)


@pytest.mark.parametrize("d,vdim,e,erase", [(128, 128, 8, True), (64, 64, 3, False),
                                            (128, 128, 1, True)])
def test_xla_slice_grads_lowers_for_cuda(d, vdim, e, erase):
  """With ``xla_slice_grads`` the Mosaic GPU kernel and the E-independent Triton tail lower for
  "cuda", and the in-kernel tail is gone."""
  args = _abstract_operands(d, vdim, e)
  fn = jax.jit(functools.partial(mosaic_backward.chunk_backward, scale=SCALE, erase=erase,
                                 xla_slice_grads=True))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_chunk_backward_mgpu" in text
  assert "triadic_chunk_backward_tail_ut" in text
  assert text.count("triadic_chunk_backward_tail") == text.count("triadic_chunk_backward_tail_ut")


def test_xla_slice_grads_whole_op_matches_scan():
  """The whole op (Mosaic state kernels and chunk backward with ``xla_slice_grads``, interpret
  mode, inside ``triadic_pallas``'s custom_vjp) against the scan, bf16 bounds of
  ``test_triadic_pallas``; E = 3 is padded to 4 by the op."""
  cfg = Config("cpu", block_v=16, bwd_block_v=16, mosaic_gpu=True, mosaic_gpu_backward=True,
               xla_slice_grads=True)
  q, v, k2 = (jnp.zeros((1, 1, 64, n), dt) for n, dt in ((64, jnp.bfloat16), (32, jnp.bfloat16),
                                                         (4, jnp.float32)))
  fn = pops._chunk_backward(cfg, q, v, k2)
  assert fn.func is mosaic_backward.chunk_backward and fn.keywords["xla_slice_grads"]
  check_against_scan(1, 150, 2, 64, 32, 3, 64, True, 1.0, jnp.bfloat16, config=cfg)


def test_xla_slice_grads_hopper_op_lowers_for_cuda():
  """The whole op, forward and backward, with the Hopper defaults and ``xla_slice_grads``, lowers
  for CUDA (bf16, C = 64)."""
  b, t, h, d, vdim, e = 1, 200, 2, 64, 64, 4
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  args = [spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, vdim), spec(b, t, h, e),
          spec(b, t, h, e), spec(b, t, h, e), spec(b, t, h), spec(b, h, e, d, vdim, dt=jnp.float32)]
  cfg = dataclasses.replace(pops.default_config("gpu", e, vdim), mosaic_gpu=True,
                            mosaic_gpu_backward=True, xla_slice_grads=True)

  def loss(*a):
    o, s = pops.triadic_pallas(*a[:7], scale=d ** -0.5, initial_state=a[7], erase=True,
                               chunk_size=64, config=cfg)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  text = jax.jit(jax.grad(loss, argnums=tuple(range(8)))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  for kernel in ("triadic_forward_mgpu", "triadic_backward_states_mgpu",
                 "triadic_chunk_backward_mgpu", "triadic_chunk_backward_tail_ut"):
    assert kernel in text, kernel
