"""impl="pallas": kernels (interpret mode on CPU) against the scan oracle; TPU and GPU lowering.

Every case checks the output, the final state and the gradients of all seven inputs and of the
initial state, through loss = sum(o * do) + sum(final_state * dS) with random do, dS.
Error bounds (relative RMS, ||a - b|| / ||b||):
  float32: 1e-4 for everything (the kernels use full float32 matmuls).
  bfloat16 inputs (scan run on the same bf16-rounded values in float32): outputs 1.5e-2 (o is
  returned in bf16), final state 1e-2 and gradients 2e-2 (bf16 tensor-core operands in the kernels,
  chunk-start states kept in bf16).
Shapes are small (interpret mode is slow, CI has 2 cores) but odd: T not a multiple of the chunk,
E = 3 (padded to 4 inside), V = 48 (padded to 64), several value blocks per program.
The sharded case (batch and heads over a 2 x 2 mesh of fake CPU devices) runs in a subprocess.

Both structures of the state-passing kernels run here: platform "cpu" interprets the Triton one
(chunk loop inside the kernel over whole-sequence blocks), ``Config("tpu", ..., interpret=True)``
the Mosaic TPU one (chunks on the grid, one chunk per block, state in VMEM scratch); a trace at
T = 65536 checks that no TPU block grows with T.
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from testkit import rel_rms
from testkit.devices import run_on_four_devices
from testkit.pallas import kernel_blocks
from testkit.triadic import (NAMES, PALLAS_BOUNDS, assert_matches_scan, bf16_transposes,
                             check_against_scan, cuda_lowering_text, make_grad_inputs,
                             value_and_grads)
from triadic import triadic_gdn
from triadic.pallas import ops as pops
from triadic.pallas import recurrent
from triadic.pallas.chunk_prep import chunk_prep, unit_lower_inverse_kernel
from triadic.pallas.common import Config
from triadic.pallas.ops import kernel_layout, triadic_pallas

jax.config.update("jax_default_matmul_precision", "highest")


CASES = [
    # b, t, h, d, v, e, chunk, erase, decay, dtype
    pytest.param(1, 50, 2, 16, 32, 1, 16, True, 1.0, jnp.float32, id="E1-T50-C16"),
    pytest.param(2, 100, 1, 32, 16, 3, 32, True, 1.0, jnp.float32, id="E3-T100-C32"),
    pytest.param(1, 50, 1, 16, 48, 3, 16, False, 1.0, jnp.float32, id="E3-V48-noerase"),
    pytest.param(1, 40, 1, 16, 16, 2, 16, True, 20.0, jnp.float32, id="E2-strong-decay"),
    pytest.param(1, 50, 2, 32, 32, 2, 32, True, 1.0, jnp.bfloat16, id="E2-bf16"),
]


@pytest.mark.parametrize("b,t,h,d,vdim,e,chunk,erase,decay,dtype", CASES)
def test_pallas_matches_scan(b, t, h, d, vdim, e, chunk, erase, decay, dtype):
  check_against_scan(b, t, h, d, vdim, e, chunk, erase, decay, dtype)


def tpu_interpreted(block_v=16, interpret=True):
  """The TPU kernels' structure run on this CPU. block_v 16 gives the small shapes several value
  blocks (a TPU itself needs a multiple of 128 or the whole V, see ``default_config``)."""
  return Config("tpu", block_v=block_v, bwd_block_v=16, interpret=interpret)


@pytest.mark.parametrize("b,t,h,d,vdim,e,chunk,erase,decay,dtype", [
    pytest.param(1, 50, 2, 16, 32, 3, 16, True, 1.0, jnp.float32, id="E3-T50-C16"),
    pytest.param(1, 40, 1, 32, 32, 2, 16, False, 1.0, jnp.bfloat16, id="E2-bf16-noerase"),
])
def test_tpu_structure_matches_scan(b, t, h, d, vdim, e, chunk, erase, decay, dtype):
  """Chunks on the grid ("arbitrary"), state in VMEM scratch (from h0 at the first chunk, to the
  final state at the last, reversed for the state gradient), in interpret mode: output, final
  state and every gradient against the scan, with the same bounds as the Triton structure."""
  check_against_scan(b, t, h, d, vdim, e, chunk, erase, decay, dtype, config=tpu_interpreted())


@pytest.mark.parametrize("e,erase,decay", [(3, True, 20.0), (1, False, 1.0)])
def test_masks_in_prep_match_scan(e, erase, decay):
  """``Config.masks_in_prep``: the prep kernel forms M, M' itself (strong decay, E = 3 padded to
  4; and E = 1 without erase): output, final state and every gradient against the scan; the
  plan says so."""
  cfg = Config("cpu", block_v=16, bwd_block_v=16, masks_in_prep=True)
  assert pops.explain(16, 16, e, 32, jnp.float32, config=cfg).masks_in_prep
  check_against_scan(1, 100, 2, 16, 16, e, 32, erase, decay, jnp.float32, config=cfg)


def test_masks_in_prep_match_plain_masks():
  """The prep with the masks formed in its kernel gives the plain-JAX masks' gc, A and P (float32
  sums in another order), E = 3 at chunk 32; on the TPU structure the plan refuses it and says
  why."""
  args, _, _ = make_grad_inputs(0, 2, 64, 1, 16, 16, 3, decay=5.0, dtype=jnp.float32)
  nc, c = 2, 32
  merge = lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
  q, k, k2, q2, g, beta = (merge(kernel_layout(x, nc, c)) for x in (*args[:2], *args[3:7]))
  cfg = Config("cpu", block_v=16, bwd_block_v=16)
  want = chunk_prep(q, k, k2, q2, g, beta, erase=True, cfg=cfg)
  got = chunk_prep(q, k, k2, q2, g, beta, erase=True, cfg=cfg, masks_in_kernel=True)
  assert got.mq is None and got.m is None and want.mq is not None and want.m is not None
  for name, x, y in zip(("gc", "gc^T", "A", "P", "A operand"), got[:5], want[:5], strict=True):
    assert rel_rms(x, y) < 1e-6, f"{name}: rel RMS {rel_rms(x, y):.2e}"
  tpu = dataclasses.replace(tpu_interpreted(), masks_in_prep=True)
  plan = pops.explain(16, 16, 3, 32, jnp.float32, config=tpu)
  assert not plan.masks_in_prep and "GPU structure only" in plan.prep.reason


def test_tpu_structure_under_tpu_interpret_mode():
  """The TPU-structured recurrent kernels under Pallas' TPU interpret mode, which simulates VMEM
  and the pipeline's DMAs, fills uninitialised scratch with NaN, splits the "parallel" grid axes
  over two cores (as a megacore TPU does, each core with its own scratch) and visits them in a
  random order: forward and reverse pass equal the Triton structure's. Called directly (TPU
  interpret mode cannot run inside ``triadic_pallas``'s custom_partitioning)."""
  b, t, h, d, vdim, e, c = 1, 40, 2, 16, 32, 2, 16
  nc = -(-t // c)
  args, do, ds = make_grad_inputs(2, b, t, h, d, vdim, e, decay=1.0, dtype=jnp.float32)
  merge = lambda x: x.reshape(b * h, *x.shape[2:])
  q, k, v, k2, q2, g, beta = (merge(kernel_layout(x, nc, c)) for x in args[:7])
  h0, dht, do = merge(args[7]), merge(ds), merge(kernel_layout(do, nc, c))
  loop = Config("cpu", block_v=16, bwd_block_v=16)
  cum_log_decay, _, a, p, _ = chunk_prep(q, k, k2, q2, g, beta, erase=True, cfg=loop)[:5]
  kernel_args = (q, k, v, k2, q2, cum_log_decay, beta, a, p)
  grid = tpu_interpreted(interpret=pltpu.InterpretParams(random_seed=0, num_cores_or_threads=2))
  want = (recurrent.state_pass(*kernel_args, h0, scale=0.25, erase=True, cfg=loop)
          + recurrent.reverse_state_pass(q, k, do, *kernel_args[3:], dht, scale=0.25, erase=True,
                                         cfg=loop))
  got = (recurrent.state_pass(*kernel_args, h0, scale=0.25, erase=True, cfg=grid)
         + recurrent.reverse_state_pass(q, k, do, *kernel_args[3:], dht, scale=0.25, erase=True,
                                        cfg=grid))
  names = ("o", "U", "states", "final state", "dU", "dstates", "dh0")
  for name, x, y in zip(names, got, want):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    assert rel_rms(x, y) < 1e-6, f"{name}: rel RMS {rel_rms(x, y):.2e}"


@pytest.mark.parametrize("b,t,h,d,vdim,e,erase,decay,chunk_bwd", [
    pytest.param(1, 150, 2, 64, 32, 3, True, 1.0, False, id="E3-T150-V32"),
    pytest.param(2, 100, 1, 64, 64, 8, False, 20.0, False, id="E8-noerase-strong-decay"),
    pytest.param(1, 150, 2, 64, 32, 2, True, 1.0, True, id="E2-T150-V32-mgpu-chunk-backward"),
])
def test_mosaic_gpu_kernels_match_scan(b, t, h, d, vdim, e, erase, decay, chunk_bwd):
  """The whole op with the Hopper (Mosaic GPU, wgmma) state-passing kernels (and, with
  ``chunk_bwd``, the Mosaic chunk-parallel backward), run in Mosaic GPU interpret mode inside
  ``triadic_pallas``'s custom_vjp, with the UT inverse's kernel as on GPUs: output, final state
  and every gradient against the scan, bf16, with the Triton structure's bounds. The kernels take
  C = 64 and D in (64, 128) only; E = 3 is padded to 4 by the op."""
  from triadic.pallas import mosaic, mosaic_backward
  if not mosaic.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this JAX")
  cfg = Config("cpu", block_v=16, bwd_block_v=16, mosaic_gpu=True, mosaic_gpu_backward=chunk_bwd,
               ut_kernel=True)
  q, v, k2 = (jnp.zeros((1, 1, 64, n), dt) for n, dt in ((d, jnp.bfloat16), (vdim, jnp.bfloat16),
                                                         (4, jnp.float32)))
  assert pops.state_pass_kernels(cfg, q, v, k2)[0].func is mosaic.state_pass
  assert (pops.chunk_gradients_kernel(cfg, q, v,
                                     k2).func is mosaic_backward.chunk_gradients) == chunk_bwd
  check_against_scan(b, t, h, d, vdim, e, 64, erase, decay, jnp.bfloat16, config=cfg)


def token_major_config(**fields):
  """The Hopper kernels in interpret mode with ``Config.token_major``."""
  return Config("cpu", block_v=16, bwd_block_v=16, mosaic_gpu=True, mosaic_gpu_backward=True,
                ut_kernel=True, token_major=True, **fields)


@pytest.mark.parametrize("e,erase,fused_tail,grads_kernel", [(3, True, None, True),
                                                              (2, False, False, False)])
def test_token_major_matches_kernel_layout(e, erase, fused_tail, grads_kernel):
  """``Config.token_major`` (q, k, v, o, dO and dq, dk, dv read and written in the caller's
  (B, T, H, X) by the kernels) computes what the relayouted kernels compute: output, final state
  and every gradient to float32 rounding, B = H = 2 (b = i // H, h = i % H), two chunks; and the
  scan's values within the bf16 bounds. E = 3 (padded to 4) takes the split tail, there with the
  mask gradients by their kernel (``Config.mask_grads_kernel``)."""
  from triadic.pallas import mosaic
  if not mosaic.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this JAX")
  b, t, h, d, vdim = 2, 128, 2, 64, 32
  cfg = token_major_config(fused_tail=fused_tail, mask_grads_kernel=grads_kernel)
  assert pops.explain_layout(b, t, h, d, vdim, e, 64, jnp.bfloat16, config=cfg).token_major
  args, do, ds = make_grad_inputs(0, b, t, h, d, vdim, e, decay=1.0, dtype=jnp.bfloat16)
  got = value_and_grads("pallas", args, do, ds, erase=erase, chunk_size=64, config=cfg)
  want = value_and_grads("pallas", args, do, ds, erase=erase, chunk_size=64,
                         config=dataclasses.replace(cfg, token_major=False))
  for name, x, y in zip((*("d" + n for n in NAMES), "o", "state"), jax.tree.leaves(got),
                        jax.tree.leaves(want), strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    assert rel_rms(x, y) < 1e-5, f"{name}: rel RMS {rel_rms(x, y):.2e}"
  assert_matches_scan(got, args, do, ds, erase=erase, chunk_size=64)


def test_token_major_layout_reasons():
  """``explain_layout`` takes the caller's layout only where every stage reads it, and says why
  not elsewhere: the option off, T not whole chunks, D or V padded, the Triton kernels. The state
  passes over pieces of the sequence read it in place too."""
  cfg = token_major_config()
  layout = lambda t=128, d=64, vdim=32, **kw: pops.explain_layout(
      2, t, 2, d, vdim, 2, 64, jnp.bfloat16, config=dataclasses.replace(cfg, **kw))
  assert layout().token_major and "(B, T, H, X), in place" in str(layout())
  assert layout(token_major=False).reason == "Config.token_major off"
  assert "T = 100 is not a multiple of the chunk size 64" in layout(t=100).reason
  assert "D = 80, V = 32 are padded to 128, 32" in layout(d=80).reason
  assert layout(t=2048, sequence_pieces=2).token_major
  assert "Mosaic GPU state passes and chunk backward" in layout(mosaic_gpu_backward=False).reason
  for reason in (layout(t=100), layout(token_major=False)):
    assert not reason.token_major and "relayouted" in str(reason)


def test_token_major_lowers_for_cuda_without_relayouts():
  """With ``token_major`` the whole op (forward and backward) lowers for CUDA with no transpose
  of a q-sized bf16 array (D = V = 128): the kernels read q, k, v, dO and write o, dq, dk in
  place. The relayouted op has them (so the count can fail). The mask gradients' kernel, which
  the Hopper default takes at this E, lowers too."""
  b, t, h, d = 2, 256, 2, 128
  assert pops.default_config("gpu", 8, d, hopper=True).mask_grads_kernel
  assert not pops.default_config("gpu", 4, d, hopper=True).mask_grads_kernel
  cfg = dataclasses.replace(pops.default_config("gpu", 8, d), mosaic_gpu=True,
                            mosaic_gpu_backward=True, token_major=True, mask_grads_kernel=True)
  assert pops.explain_layout(b, t, h, d, d, 8, 64, jnp.bfloat16, config=cfg).token_major
  text = cuda_lowering_text(cfg, b, t, h, d, d, 8)
  for kernel in ("triadic_chunk_prep", "triadic_forward_mgpu", "triadic_backward_states_mgpu",
                 "triadic_chunk_backward_slices", "triadic_chunk_backward_tail",
                 "triadic_mask_grads"):
    assert kernel in text, kernel
  assert bf16_transposes(text, b, t, h, d) == 0
  relayouted = cuda_lowering_text(dataclasses.replace(cfg, token_major=False), b, t, h, d, d, 8)
  assert bf16_transposes(relayouted, b, t, h, d) >= 4


def test_unsupported_sizes_raise_under_pallas_and_fall_back_under_auto():
  args, _, _ = make_grad_inputs(1, 1, 20, 1, 24, 16, 2, decay=1.0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="multiple of 16"):
    triadic_gdn(*args[:7], impl="pallas")
  o_auto, s_auto = triadic_gdn(*args[:7], impl="auto")
  o_ref, s_ref = triadic_gdn(*args[:7], impl="scan")
  assert rel_rms(o_auto, o_ref) < 1e-4 and rel_rms(s_auto, s_ref) < 1e-4
  args, _, _ = make_grad_inputs(1, 1, 20, 1, 16, 16, 2, decay=1.0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="chunk_size"):
    triadic_gdn(*args[:7], impl="pallas", chunk_size=24)


@pytest.mark.parametrize("platform,target", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower(platform, target, dtype):
  """Forward and backward lower for TPU (Mosaic) and GPU (Triton) on this CPU machine.

  This checks the Pallas -> Mosaic / Triton IR lowering; Mosaic's own layout passes run only when
  a TPU compiles the kernel, which CI cannot do.
  """
  b, t, h, d, vdim, e = 1, 100, 2, 32, 64, 3
  spec = lambda *s, dt=dtype: jax.ShapeDtypeStruct(s, dt)
  args = [spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, vdim), spec(b, t, h, e),
          spec(b, t, h, e), spec(b, t, h, e), spec(b, t, h), spec(b, h, e, d, vdim, dt=jnp.float32)]

  def loss(*a):
    o, s = triadic_pallas(*a[:7], scale=d ** -0.5, initial_state=a[7], erase=True, chunk_size=32,
                          platform=platform)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  lowered = jax.jit(jax.grad(loss, argnums=tuple(range(8)))).trace(*args).lower(
      lowering_platforms=(target,))
  text = lowered.as_text()
  for kernel in ("triadic_chunk_prep", "triadic_forward", "triadic_backward_states",
                 "triadic_chunk_backward"):
    assert kernel in text, kernel


def test_hopper_path_lowers_for_cuda():
  """With ``mosaic_gpu=True`` (the default on Hopper) and ``mosaic_gpu_backward=True`` the whole
  op, forward and backward, lowers for CUDA with the Mosaic GPU kernels in place of the Triton
  state-passing kernels and chunk-parallel backward (bf16, C = 64)."""
  cfg = dataclasses.replace(pops.default_config("gpu", 8, 64), mosaic_gpu=True,
                            mosaic_gpu_backward=True)
  text = cuda_lowering_text(cfg, 1, 200, 2, 64, 64, 8)
  for kernel in ("triadic_chunk_prep", "triadic_ut_inverse", "triadic_forward_mgpu",
                 "triadic_backward_states_mgpu", "triadic_chunk_backward_slices",
                 "triadic_chunk_backward_tail"):
    assert kernel in text, kernel


def trace_long(platform, t, e=2, d=128, vdim=128, chunk=64):
  """Forward and backward traced at (B, T, H) = (1, t, 1), bf16, for ``platform``; nothing runs."""
  b, h = 1, 1
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  args = [spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, vdim), spec(b, t, h, e),
          spec(b, t, h, e), spec(b, t, h, e), spec(b, t, h),
          spec(b, h, e, d, vdim, dt=jnp.float32)]

  def loss(*a):
    o, s = triadic_pallas(*a[:7], scale=d ** -0.5, initial_state=a[7], erase=True,
                          chunk_size=chunk, platform=platform)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  return jax.jit(jax.grad(loss, argnums=tuple(range(8)))).trace(*args)


def test_tpu_blocks_do_not_span_the_sequence():
  """At T = 65536 (D = V = 128, E = 2, C = 64; traced and lowered, not run) no block of any TPU
  kernel depends on T, and each program's VMEM (double-buffered blocks plus scratch, ~1.3 MiB)
  stays far below the 16 MiB a TPU core gives a kernel by default; the recurrent kernels walk
  the 1024 chunks on the grid. The Triton structure, whose blocks span the sequence, would need
  ~700 MiB by the same estimate: the check has teeth."""
  limit = 16 * 2 ** 20
  traced = trace_long("tpu", 65536)
  long, short = kernel_blocks(traced), kernel_blocks(trace_long("tpu", 4096))
  names = ("triadic_chunk_prep", "triadic_forward", "triadic_backward_states",
           "triadic_chunk_backward")
  assert sorted(x[0] for x in long) == sorted(names), [x[0] for x in long]
  for (name, grid, shapes, vmem), (_, _, short_shapes, _) in zip(long, short):
    assert shapes == short_shapes, (name, shapes, short_shapes)
    assert vmem < limit / 4, (name, vmem / 2 ** 20, shapes)
    if name in ("triadic_forward", "triadic_backward_states"):
      assert grid == (1, 1, 1024), (name, grid)
  text = traced.lower(lowering_platforms=("tpu",)).as_text()
  assert all(name in text for name in names)
  triton = {name: vmem for name, _, _, vmem in kernel_blocks(trace_long("gpu", 65536))}
  assert triton["triadic_forward"] > limit and triton["triadic_backward_states"] > limit, triton


@pytest.mark.parametrize("ut_kernel", [False, True])
def test_aligned_keys_stay_accurate(ut_kernel):
  """A repeated token (identical keys in a chunk, beta near 1): the UT inverse must stay exact,
  by plain JAX and by its kernel."""
  args, do, ds = make_grad_inputs(3, 1, 64, 1, 16, 16, 2, decay=0.0, dtype=jnp.float32)
  args[1] = jnp.broadcast_to(args[1][:, :1], args[1].shape)
  args[3] = jnp.broadcast_to(args[3][:, :1], args[3].shape)
  args[6] = jnp.full(args[6].shape, 0.99)
  cfg = Config("cpu", block_v=16, bwd_block_v=16, ut_kernel=ut_kernel)
  grads, (o, s) = value_and_grads("pallas", args, do, ds, erase=True, chunk_size=64, config=cfg)
  ref_grads, (o_ref, s_ref) = value_and_grads("scan", args, do, ds, erase=True, chunk_size=64)
  assert rel_rms(o, o_ref) < 1e-4 and rel_rms(s, s_ref) < 1e-4
  for name, got, want in zip(NAMES, grads, ref_grads):
    assert rel_rms(got, want) < 1e-4, name


@pytest.mark.parametrize("c", [32, 64])
def test_ut_inverse_kernel(c):
  """``unit_lower_inverse_kernel`` against the float64 inverse: random strictly lower L and the
  all-ones L of aligned keys (|L_ts| = 1, whose inverse is bidiagonal); and it lowers for CUDA."""
  rng = np.random.default_rng(c)
  lower = np.tril(0.4 * rng.normal(size=(2, 3, c, c)), -1)
  lower[1, 2] = np.tril(np.ones((c, c)), -1)
  want = np.linalg.inv(np.eye(c) + lower)
  got = unit_lower_inverse_kernel(jnp.asarray(lower, jnp.float32),
                                  cfg=Config("cpu", block_v=16, bwd_block_v=16))
  assert got.dtype == jnp.float32 and got.shape == lower.shape
  assert rel_rms(got, want) < 1e-5 and rel_rms(got[1, 2], want[1, 2]) < 1e-6
  with pytest.raises(ValueError, match="multiple of 16"):
    unit_lower_inverse_kernel(jnp.zeros((1, 1, 24, 24)), cfg=Config("cpu", 16, 16))
  with pytest.raises(ValueError, match="GPU structure"):
    unit_lower_inverse_kernel(jnp.zeros((1, 1, c, c)), cfg=Config("tpu", c, c))
  text = jax.jit(functools.partial(unit_lower_inverse_kernel, cfg=Config("gpu", 32, 32))).trace(
      jax.ShapeDtypeStruct((2, 3, c, c), jnp.float32)).lower(
          lowering_platforms=("cuda",)).as_text()
  assert "triadic_ut_inverse" in text


SHARDED_SCRIPT = textwrap.dedent("""
    import json, re, sys
    import jax, jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    jax.config.update("jax_default_matmul_precision", "highest")
    from testkit import rel_rms
    from testkit.triadic import NAMES, make_grad_inputs, value_and_grads
    from triadic import triadic_gdn

    b, t, h, d, vdim, e, chunk = 2, 40, 2, 16, 32, 2, 16
    args, do, ds = make_grad_inputs(0, b, t, h, d, vdim, e, decay=1.0, dtype=jnp.float32)
    ref_grads, (o_ref, s_ref) = value_and_grads("scan", args, do, ds, erase=True, chunk_size=chunk)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    specs = [P("data", None, "tensor")] * 7 + [P("data", "tensor")]
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    do = jax.device_put(do, NamedSharding(mesh, specs[0]))
    ds = jax.device_put(ds, NamedSharding(mesh, specs[-1]))
    report = {}
    for partitioner in ("shardy", "gspmd"):
      jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")

      def loss(*a):
        o, s = triadic_gdn(*a[:7], initial_state=a[7], impl="pallas", chunk_size=chunk)
        return jnp.sum(o * do) + jnp.sum(s * ds), (o, s)

      # one compile: the values below come from the program whose HLO is read
      f = jax.jit(jax.grad(loss, argnums=tuple(range(8)), has_aux=True)).lower(*sharded).compile()
      hlo = f.as_text()
      grads, (o, s) = f(*sharded)
      report[partitioner] = dict(
          errors={"o": rel_rms(o, o_ref), "state": rel_rms(s, s_ref),
                  **{"d" + n: rel_rms(g, r) for n, g, r in zip(NAMES, grads, ref_grads)}},
          # the kernels' merged (B*H, NC, C, X) layout: global B*H = 4, per device 1
          global_kernel_shape=bool(re.search(r"\\[4,3,16,", hlo)),
          local_kernel_shape=bool(re.search(r"\\[1,3,16,", hlo)),
          all_gathers=len(re.findall(r"all-gather", hlo)),
          sharded_like_inputs=[str(g.sharding.spec) == str(s) for g, s in zip(grads, specs)]
                              + [str(o.sharding.spec) == str(specs[0])])
    print("RESULT", json.dumps(report))
""")


def test_pallas_runs_per_shard_under_jit():
  """Batch over "data" and heads over "tensor" on 4 fake CPU devices, under Shardy and GSPMD:
  values and gradients match the unsharded scan, every device runs the kernels on its own
  (B/2, H/2) slice (no all-gather of the operands, no array of the global kernel layout), and
  outputs and gradients keep the inputs' sharding."""
  report = run_on_four_devices(SHARDED_SCRIPT, timeout=600)
  bound = PALLAS_BOUNDS[jnp.float32]["grad"]
  for partitioner, r in report.items():
    for name, err in r["errors"].items():
      assert err < bound, f"{partitioner}: {name} rel RMS {err:.2e}"
    assert r["all_gathers"] == 0, (partitioner, r)
    assert not r["global_kernel_shape"] and r["local_kernel_shape"], (partitioner, r)
    assert all(r["sharded_like_inputs"]), (partitioner, r)


PARTITION_SCRIPT = textwrap.dedent("""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from layers import partition

    def fun(scale, x, y):
      # per (b, h): x (B, T, H, D) token-major, y (B, H, N) head-major
      return x * scale + jnp.sum(y, -1)[:, None, :, None], 2 * y

    wrapped = partition.batch_head_partitioned(fun, n_static=1, rule="b t h d, b h n -> "
                                               "b t h d, b h n", replicated=("t", "d", "n", "c"))
    x = jnp.arange(2 * 8 * 2 * 4, dtype=jnp.float32).reshape(2, 8, 2, 4)
    y = jnp.arange(2 * 2 * 3, dtype=jnp.float32).reshape(2, 2, 3)
    want = fun(3.0, x, y)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    specs = (P("data", None, "tensor"), P("data", "tensor"))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, y), specs)]
    report = {}
    for partitioner in ("shardy", "gspmd"):
      jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
      f = jax.jit(lambda a, b: wrapped(3.0, a, b)).lower(*args).compile()
      hlo = f.as_text()
      got = f(*args)
      report[partitioner] = dict(
          exact=all(bool(np.array_equal(g, w)) for g, w in zip(got, want)),
          local_shapes=bool(re.search(r"f32\\[1,8,1,4\\]", hlo)),
          global_shapes=bool(re.search(r"f32\\[2,8,2,4\\]", hlo)),
          all_gathers=len(re.findall(r"all-gather", hlo)),
          sharded_like_inputs=[str(g.sharding.spec) == str(s) for g, s in zip(got, specs)])
    print("RESULT", json.dumps(report))
""")


def test_partition_finds_batch_and_heads_by_name():
  """``partition.batch_head_partitioned`` shards each array on the dims its rule names b and h,
  wherever they sit: a token-major (B, T, H, D) operand beside a (B, H, N) one, B over "data" and
  H over "tensor" on 4 fake CPU devices, under Shardy and GSPMD: exact values, every device on
  its (B/2, T, H/2, D) slice (no global shape, no all-gather), results sharded like the inputs."""
  report = run_on_four_devices(PARTITION_SCRIPT, timeout=300)
  for partitioner, r in report.items():
    assert r["exact"], (partitioner, r)
    assert r["local_shapes"] and not r["global_shapes"], (partitioner, r)
    assert r["all_gathers"] == 0, (partitioner, r)
    assert all(r["sharded_like_inputs"]), (partitioner, r)


def test_primal_on_the_triton_path():
  """Where the Triton structure runs the state passes (interpret mode) the op's primal (no
  gradient) keeps o and the final state of the pass's outputs (that kernel has no variant
  without residuals): equal to the differentiated call's (``jax.vjp``, ``_core_fwd``); the
  plan promises no leaner primal there."""
  cfg = Config("cpu", block_v=16, bwd_block_v=16)
  assert "without gradients" not in pops.explain(16, 16, 2, 16, jnp.float32,
                                                 config=cfg).forward.tiles
  args, _, _ = make_grad_inputs(0, 1, 40, 2, 16, 16, 2, decay=1.0, dtype=jnp.float32)
  run = lambda *a: triadic_pallas(*a[:7], scale=0.25, initial_state=a[7], erase=True,
                                  chunk_size=16, config=cfg)
  for x, y in zip(run(*args), jax.vjp(run, *args)[0], strict=True):
    assert x.shape == y.shape and jnp.array_equal(x, y)
