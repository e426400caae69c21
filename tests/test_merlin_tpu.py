"""multistate_attention's TPU structure (``merlin.pallas.tpu``: Mosaic TPU kernels, the walks on
the grid), on this CPU machine: in interpret mode against the scan, in Pallas' TPU interpret mode
against the Triton structure's stages, lowered for a TPU, and its blocks' VMEM at long T.

Cases and error bounds: tests/test_merlin_pallas.py's (``CASES``, ``check_against_scan``). The
TPU interpret mode fills uninitialised VMEM with NaN, copies blocks in and out as the TPU's
pipeline does (an output block goes back to HBM when its index changes) and runs the "parallel"
grid axes in a random order over two simulated cores, so a step that leaves an output block
unwritten, or a carry that leaks across a parallel axis, shows; there the two structures agree to
float32 rounding (1e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from merlin.pallas import ops
from merlin.pallas import plan as plan_lib
from testkit import rel_rms
from testkit.pallas import kernel_blocks
from tests import test_merlin_pallas as pallas_tests
from tests.test_merlin_pallas import (check_against_scan, grad_of_sum, make_inputs, op_specs,
                                      pallas_op)
from triadic.ops import clamp_log_decay
from triadic.pallas.common import Config

jax.config.update("jax_default_matmul_precision", "highest")

# Interpret mode with the TPU structure; 16-column value blocks so that V runs several
TPU = Config("tpu", block_v=16, bwd_block_v=16, interpret=True)
KERNELS = {True: ("merlin_span_maps", "merlin_write_pass", "merlin_span_cross", "merlin_readout",
                  "merlin_later_spans", "merlin_own_reverse", "merlin_chunk_gradients",
                  "merlin_pair_sums", "merlin_span_sums"),
           False: ("merlin_write_pass", "merlin_readout", "merlin_later_spans",
                   "merlin_own_reverse", "merlin_read_gradients")}

# The GPU kernels' cases (tests/test_merlin_pallas.py), and one segment alone
CASES = [*pallas_tests.CASES,
         pytest.param(1, 40, 1, 16, 32, 64, 16, True, "weak", "random", jnp.float32,
                      id="erase-one-segment")]


@pytest.mark.parametrize("b,t,h,d,vd,segment_len,chunk,erase,decay,lam_kind,dtype", CASES)
def test_tpu_structure_matches_scan(b, t, h, d, vd, segment_len, chunk, erase, decay, lam_kind,
                                    dtype):
  check_against_scan(b, t, h, d, vd, segment_len, chunk, erase, decay, lam_kind, dtype,
                     platform="tpu", config=TPU)


def stage_results(cfg, b, t, h, d, vd, segment_len, chunk, erase):
  """The state kernels' forward (output, stored states) and backward (the operands' gradients)
  under ``cfg``, called directly (TPU interpret mode cannot run inside the op's
  custom_partitioning)."""
  n = -(-t // segment_len)
  (q, k, v, g, beta, lam), _ = make_inputs(4, b, t, h, d, vd, n, segment_len, "strong",
                                           "merlin", jnp.float32)
  cps = segment_len // chunk
  part = ops.intra_operands(q, k, v, clamp_log_decay(g), beta, chunk_size=chunk, erase=erase)
  gc, lamc = ops.chunk_weights(g, lam, segment_len=segment_len, chunk_size=chunk)
  operands = ops.kernel_operands(part, gc, lamc, cps=cps, erase=erase)
  o, *states = ops._forward(cps, erase, cfg, 0.25, *operands)
  do = jax.random.normal(jax.random.PRNGKey(5), operands[-2].shape[:-1] + (vd,))
  return (o, *states, *ops._backward(cps, erase, cfg, *operands[:-2], *states, do))


@pytest.mark.parametrize("erase", [True, False])
def test_tpu_structure_under_tpu_interpret_mode(erase):
  """Every stage of the TPU structure, under the TPU interpret mode (module docstring), equals
  the Triton structure's: 19 chunks in 5 segments of 4 (a short last one), two value blocks."""
  sizes = (1, 300, 2, 16, 32, 64, 16, erase)
  grid = Config("tpu", block_v=16, bwd_block_v=16,
                interpret=pltpu.InterpretParams(random_seed=0, num_cores_or_threads=2))
  got = stage_results(grid, *sizes)
  want = stage_results(Config("cpu", block_v=16, bwd_block_v=16), *sizes)
  assert len(got) == len(want) == (9 if erase else 8)
  for i, (x, y) in enumerate(zip(got, want)):
    assert x.shape == y.shape and x.dtype == y.dtype, i
    assert np.all(np.isfinite(np.asarray(x, np.float32))), i
    assert rel_rms(x, y) < 1e-6, f"result {i}: rel RMS {rel_rms(x, y):.2e}"


def traced(erase, t, dtype=jnp.bfloat16, platform="tpu"):
  """The gradients of the op's sum at D = V = 128, segment 256 (chunk 64), B = 1, H = 2, with the
  platform's default kernels; traced, not run."""
  return jax.jit(grad_of_sum(pallas_op(erase, 256, platform))).trace(
      *op_specs(1, t, 2, 128, 128, -(-t // 256), dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("erase", [True, False])
def test_tpu_kernels_lower(erase, dtype):
  """Forward and backward lower to Mosaic TPU on this CPU machine (T = 1000: a last partial
  segment). This checks the Pallas -> Mosaic lowering; Mosaic's own layout passes run only when a
  TPU compiles the kernels, which CI cannot do."""
  text = traced(erase, 1000, dtype).lower(lowering_platforms=("tpu",)).as_text()
  for kernel in KERNELS[erase]:
    assert kernel in text, kernel
  assert plan_lib.default_config("tpu").block_v % 128 == 0


@pytest.mark.parametrize("erase", [True, False])
def test_tpu_blocks_do_not_span_the_sequence(erase):
  """At T = 16384 (64 segments) every TPU kernel's blocks are those at T = 2048 (8 segments) and
  a program's VMEM (double-buffered blocks plus scratch) stays under 2 MiB, far below the 16 MiB
  a TPU core gives a kernel by default: the walks are on the grid. The Triton structure's blocks
  span the sequence and the span stack (its state pass ~100 MiB by the same estimate)."""
  long, short = kernel_blocks(traced(erase, 16384)), kernel_blocks(traced(erase, 2048))
  assert sorted({x[0] for x in long}) == sorted(KERNELS[erase])
  for (name, grid, shapes, vmem), (_, _, short_shapes, _) in zip(long, short):
    assert shapes == short_shapes, (name, shapes, short_shapes)
    assert vmem < 2 * 2 ** 20, (name, vmem / 2 ** 20, shapes)
  triton = {name: vmem for name, _, _, vmem in kernel_blocks(traced(erase, 16384,
                                                                    platform="gpu"))}
  assert max(triton.values()) > 16 * 2 ** 20, triton
