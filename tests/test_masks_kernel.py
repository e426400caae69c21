"""The Pallas mask kernels (``masks.decay_masks_kernel``, ``masks.mask_grads_kernel``) against
the plain-JAX ``masks.decay_masks`` / ``masks.mask_grads`` (which the op's tests check against
the float64 scan), in Pallas interpret mode on this CPU.

Inputs are fresh random float32 per case: k2, q2, the row coefficients, dlam and dM', dM over the
whole C x C square (the decay mask must zero the part above the diagonal); gc the chunk-local
cumsum of g, with g down to -30 per token (strong decay: gc far below 0, which only the masking
before exp keeps finite) or down to -0.02 (weak decay: the chunk-end term dlam exp(gc_C) of d gc is
not negligible). Both sides are float32 arithmetic in another order: relative RMS bound 1e-6.
Also: the forward prep with the masks formed inside its kernel and the Mosaic GPU chunk backward
with the mask kernels (``mask_kernel=True`` against False, end to end in interpret mode), the
refusals, and that both kernels and that prep lower for "cuda" (Triton; nothing runs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testkit import rel_rms
from triadic.pallas import masks, mosaic, mosaic_backward
from triadic.pallas.chunk_prep import chunk_prep, prep_num_warps
from triadic.pallas.common import Config

CPU = Config("cpu", block_v=16, bwd_block_v=16)
GPU = Config("gpu", block_v=32, bwd_block_v=64)
TPU = Config("tpu", block_v=128, bwd_block_v=128)
BOUND = 1e-6
rows = lambda x: jnp.swapaxes(x, -1, -2)


def mask_inputs(seed, c, e, g_min, bh=2, nc=2):
  """(base, grads): base = (k2 col, k2 row, q2 col, gc col, gc row) and the gradient operands
  (dM', dM, dcoef, dqcoef, dkcoef, dlam), float32, (BH, NC, ...)."""
  rng = np.random.default_rng(seed)
  f = lambda x: jnp.asarray(x, jnp.float32)
  normal = lambda *s: f(rng.normal(size=(bh, nc, *s)))
  gc = masks.chunk_cumsum(f(rng.uniform(g_min, 0.0, size=(bh, nc, c, e))))
  k2, q2 = normal(c, e), normal(c, e)
  base = (k2, rows(k2), q2, gc, rows(gc))
  grads = (normal(c, c), normal(c, c), normal(c, e), normal(c, e), normal(c, e), normal(e))
  return base, grads


def check(got, want):
  for i, (x, y) in enumerate(zip(got, want, strict=True)):
    if y is None:
      assert x is None, i
      continue
    assert x.shape == y.shape and x.dtype == y.dtype == jnp.float32, i
    assert np.all(np.isfinite(np.asarray(x))), i
    assert rel_rms(x, y) < BOUND, (i, rel_rms(x, y))


STRONG, WEAK = -30.0, -0.02


@pytest.mark.parametrize("c,e,erase,g_min", [
    (64, 1, True, STRONG),
    (64, 1, False, WEAK),
    (64, 3, True, WEAK),
    (64, 3, False, STRONG),
    (64, 8, True, STRONG),
    (64, 8, True, WEAK),
    (64, 8, False, WEAK),
    (32, 3, True, STRONG),
    (16, 8, False, WEAK),
])
def test_kernels_match_plain_jax(c, e, erase, g_min):
  """Both kernels give the plain-JAX functions' outputs (M None without erase; dm and dcoef
  unused without erase)."""
  base, (dmq, dm, dcoef, dqcoef, dkcoef, dlam) = mask_inputs(100 * c + 10 * e + erase, c, e, g_min)
  check(masks.decay_masks_kernel(*base, erase=erase, cfg=CPU),
        masks.decay_masks(*base, erase=erase))
  grads = (dmq, dm if erase else None, dcoef, dqcoef, dkcoef, dlam)
  check(masks.mask_grads_kernel(*grads, *base, erase=erase, cfg=CPU),
        masks.mask_grads(*grads, *base, erase=erase))


def test_refusals():
  """Chunk sizes the kernels' C x C Triton tiles cannot take, the TPU structure, and E not a
  power of two on the GPU (interpret mode takes it) raise a ValueError saying why."""
  base, grads = mask_inputs(0, 24, 2, WEAK, bh=1, nc=1)
  for fn, args in ((masks.decay_masks_kernel, base), (masks.mask_grads_kernel, grads + base)):
    with pytest.raises(ValueError, match="power of two in"):
      fn(*args, erase=True, cfg=CPU)
  assert "power of two in" in masks.kernel_supported(256, 8, GPU)
  assert "power of two in" in masks.kernel_supported(8, 8, CPU)
  assert "GPU structure" in masks.kernel_supported(64, 8, TPU)
  assert "E to be a power of two" in masks.kernel_supported(64, 3, GPU)
  assert masks.kernel_supported(64, 3, CPU) is None
  assert masks.kernel_supported(128, 16, GPU) is None
  assert [masks.kernel_num_warps(c) for c in (16, 32, 64, 128)] == [1, 1, 4, 16]


def prep_inputs(seed, e, g_min, bh=1, nc=2, c=64, d=16):
  """``chunk_prep``'s operands: unit-norm bf16 q, k rows (so |L_ts| < 1 and the UT inverse is
  well conditioned), k2, q2 normal / sqrt(E) (both signs), g in [g_min, 0], beta in (0, 1)."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = (jnp.asarray(unit(rng.normal(size=(bh, nc, c, d))), jnp.bfloat16) for _ in range(2))
  k2, q2 = (jnp.asarray(rng.normal(size=(bh, nc, c, e)) / np.sqrt(e), jnp.float32)
            for _ in range(2))
  g = jnp.asarray(rng.uniform(g_min, 0.0, size=(bh, nc, c, e)), jnp.float32)
  beta = jnp.asarray(rng.uniform(size=(bh, nc, c, 1)), jnp.float32)
  return q, k, k2, q2, g, beta


@pytest.mark.parametrize("e,erase,g_min", [
    (1, True, STRONG),
    (1, False, WEAK),
    (3, True, WEAK),
    (3, False, STRONG),
    (8, True, STRONG),
    (8, False, WEAK),
])
def test_chunk_prep_mask_kernel(e, erase, g_min):
  """The prep kernel that forms the masks itself (``mask_kernel=True``) gives gc, its transpose,
  A and P as the prep kernel reading the plain-JAX masks does (float32, another order of sums;
  P in q's dtype, bf16 here, where that order can flip a rounding: one bf16 step, 2^-8)."""
  args = prep_inputs(10 * e + erase, e, g_min)
  run = lambda mk: chunk_prep(*args, erase=erase, cfg=CPU, mask_kernel=mk)
  for i, (got, want) in enumerate(zip(run(True), run(False), strict=True)):
    dtype, bound = (args[0].dtype, 2.0 ** -8) if i == 3 else (jnp.float32, BOUND)
    assert got.shape == want.shape and got.dtype == want.dtype == dtype, i
    assert np.all(np.isfinite(np.asarray(got, np.float32))), i
    assert rel_rms(got, want) < bound, (i, rel_rms(got, want))


def test_chunk_prep_mask_kernel_refusal():
  """With ``mask_kernel=True`` the prep refuses what ``masks.kernel_supported`` refuses, with its
  reason (the caller, ``ops``, asks for it only where the sizes are taken). Its warps: the plain
  prep kernel's (``Config.num_warps``) up to C = 64, the mask kernels' 16 at C = 128."""
  args = prep_inputs(0, 2, WEAK, nc=1, c=24)
  with pytest.raises(ValueError, match="power of two in"):
    chunk_prep(*args, erase=True, cfg=CPU, mask_kernel=True)
  assert [prep_num_warps(c, GPU) for c in (16, 32, 64, 128)] == [4, 4, 4, 16]


@pytest.mark.skipif(not mosaic.interpret_available(),
                    reason="Mosaic GPU interpret mode unavailable in this JAX")
def test_chunk_backward_mask_kernel_matches_plain_jax():
  """``mosaic_backward.chunk_gradients`` with the split tail: ``mask_kernel=True`` gives the
  outputs of ``mask_kernel=False`` (float32 outputs to 1e-6; dq, dk bf16 in both, to 1e-3)."""
  from tests.test_mosaic_gpu_backward import SCALE, backward_operands
  e, erase = 3, True
  args = backward_operands(1, 64, 1, 64, 32, e, erase, 1.0)
  run = lambda mk: jax.jit(functools.partial(
      mosaic_backward.chunk_gradients, scale=SCALE, erase=erase, fused_tail=False,
      mask_kernel=mk, interpret=True))(*args)
  for i, (got, want) in enumerate(zip(run(True), run(False), strict=True)):
    assert got.shape == want.shape and got.dtype == want.dtype, i
    assert rel_rms(got, want) < (1e-3 if want.dtype == jnp.bfloat16 else BOUND), i


@pytest.mark.parametrize("e,erase", [(8, True), (8, False), (16, True), (1, True)])
def test_kernels_lower_for_cuda(e, erase):
  """Both kernels lower for "cuda" (Triton, C = 64), and so does the prep that forms the masks
  itself: one kernel, ``triadic_chunk_prep``, with no ``triadic_decay_masks`` beside it."""
  bh, nc, c, d = 2, 4, 64, 128
  f32 = lambda *s, dt=jnp.float32: jax.ShapeDtypeStruct((bh, nc, *s), dt)
  base = (f32(c, e), f32(e, c), f32(c, e), f32(c, e), f32(e, c))
  grads = (f32(c, c), f32(c, c) if erase else None, f32(c, e), f32(c, e), f32(c, e), f32(e))
  lower = lambda fn, *a: jax.jit(fn).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
  text = lower(functools.partial(masks.decay_masks_kernel, erase=erase, cfg=GPU), *base)
  assert "triadic_decay_masks" in text
  text = lower(functools.partial(masks.mask_grads_kernel, erase=erase, cfg=GPU), *grads, *base)
  assert "triadic_mask_grads" in text
  if e in (8, 1):
    prep = functools.partial(chunk_prep, erase=erase, cfg=GPU, mask_kernel=True)
    text = lower(prep, f32(c, d, dt=jnp.bfloat16), f32(c, d, dt=jnp.bfloat16), f32(c, e),
                 f32(c, e), f32(c, e), f32(c, 1))
    assert "triadic_chunk_prep" in text and "triadic_decay_masks" not in text


def test_config_mask_kernel_plan_and_op():
  """``Config.mask_kernel``: the plan names the mask kernels where ``masks.kernel_supported``
  takes the sizes (and why not where it does not), and the whole op with them, the Hopper
  structure in interpret mode with the split tail (E = 3, padded to 4), matches the scan."""
  from testkit.triadic import check_against_scan
  from triadic.pallas import ops as pops
  cfg = Config("cpu", block_v=16, bwd_block_v=16, mosaic_gpu=True, mosaic_gpu_backward=True,
               mask_kernel=True)
  plan = pops.explain(64, 32, 3, 64, jnp.bfloat16, config=cfg)
  assert "formed in the prep kernel (Config.mask_kernel)" in plan.prep.reason
  assert "tail between mask kernels" in plan.chunk_gradients.tiles
  off = pops.explain(64, 32, 3, 64, jnp.bfloat16,
                     config=Config("cpu", block_v=16, bwd_block_v=16, mosaic_gpu=True,
                                   mosaic_gpu_backward=True))
  assert "in plain JAX" in off.prep.reason and "JAX mask work" in off.chunk_gradients.tiles
  tpu = pops.explain(64, 128, 4, 64, jnp.float32,
                     config=Config("tpu", block_v=128, bwd_block_v=128, mask_kernel=True))
  assert "in plain JAX (the mask kernels have the GPU structure only" in tpu.prep.reason
  check_against_scan(1, 150, 2, 64, 32, 3, 64, True, 1.0, jnp.bfloat16, config=cfg)
