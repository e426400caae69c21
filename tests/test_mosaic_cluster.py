"""The cluster state passes (``triadic.pallas.mosaic_cluster``): the slice factors against
``mosaic``'s rows, the sizes they refuse, the CUDA lowering of both passes (layouts, swizzles,
the DSMEM stores into peer blocks' SMEM, the cluster launch; with and without erase, residuals,
X, A^T dU and dV, the caller's layout and pieces), the plan's choice under
``Config.cluster_state_passes`` and the whole op's CUDA lowering with them. The CPU interpreter
has no rule for DSMEM stores, so their numbers are checked on a GPU
(``benchmarks/cluster_pass.py`` against the value-split passes)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triadic.pallas import mosaic, mosaic_cluster

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32


def test_slice_factors_are_mosaics_rows_per_slice():
  """Row r of slice e is mosaic's factor row r * E + e (fe, fq, fw), beta its row 3E, lam_e
  repeated C times, and c = k2 exp(gc) (fe = beta c)."""
  bh, nc, c, e = 2, 3, 8, 3
  ks = jax.random.split(jax.random.key(0), 4)
  gc = -jnp.cumsum(jax.random.uniform(ks[0], (bh, nc, c, e)), axis=2)
  k2, q2 = (jax.random.uniform(k, (bh, nc, c, e)) for k in ks[1:3])
  beta = jax.random.uniform(ks[3], (bh, nc, c, 1))
  rows, lam = mosaic._factors(gc, k2, q2, beta)           # (BH, NC, 3E + 1, C), (BH, NC, E)
  got = mosaic_cluster.slice_factors(gc, k2, q2, beta)    # (BH, E, NC, 6, C)
  assert got.shape == (bh, e, nc, 6, c)
  for s in range(e):
    for r in range(3):
      np.testing.assert_allclose(got[:, s, :, r], rows[:, :, r * e + s], rtol=1e-6)
    np.testing.assert_allclose(got[:, s, :, 3], rows[:, :, 3 * e], rtol=1e-6)
    np.testing.assert_allclose(got[:, s, :, 4], jnp.broadcast_to(lam[:, :, s, None], (bh, nc, c)),
                               rtol=1e-6)
    np.testing.assert_allclose(got[:, s, :, 5] * got[:, s, :, 3], got[:, s, :, 0], rtol=1e-6)
    np.testing.assert_allclose(got[:, s, :, 5], k2[..., s] * jnp.exp(gc[..., s]), rtol=1e-6)


@pytest.mark.parametrize("args,match", [
    ((128, 128, 64, 8, F32), "bfloat16"), ((128, 128, 32, 8, BF16), "chunk size 64"),
    ((64, 128, 64, 8, BF16), "D = 128"), ((128, 128, 64, 3, BF16), r"E in \(2, 4, 8\)"),
    ((128, 64, 64, 8, BF16), "multiple of 16 \\* E"), ((128, 256, 64, 2, BF16), "V in"),
    ((128, 32, 64, 2, BF16), "V in")])
def test_supported_names_what_it_refuses(args, match):
  assert re.search(match, mosaic_cluster.supported(*args))
  assert mosaic_cluster.supported(128, 128, 64, 8, BF16) is None


def test_state_pass_refuses_sizes_it_cannot_take():
  bh, nc, c, d, e = 1, 2, 64, 64, 8
  args = [jnp.zeros((bh, nc, c, d), BF16)] * 3 + [jnp.zeros((bh, nc, c, e), F32)] * 3 + [
      jnp.zeros((bh, nc, c, 1), F32)] + [jnp.zeros((bh, nc, c, c), F32)] * 2 + [
      jnp.zeros((bh, e, d, d), F32)]
  with pytest.raises(ValueError, match="D = 128"):
    mosaic_cluster.state_pass(*args, scale=0.1, erase=True)


def specs(bh, nc, c, d, vd, e):
  return (S((bh, nc, c, d), BF16), S((bh, nc, c, d), BF16), S((bh, nc, c, vd), BF16),
          S((bh, nc, c, e), F32), S((bh, nc, c, e), F32), S((bh, nc, c, e), F32),
          S((bh, nc, c, 1), F32), S((bh, nc, c, c), F32), S((bh, nc, c, c), F32),
          S((bh, e, d, vd), F32))


@pytest.mark.parametrize("e,erase,residuals,vd", [(8, True, True, 128), (8, True, False, 128),
                                                  (4, True, True, 128), (2, True, True, 128),
                                                  (2, False, False, 128), (4, True, True, 64)])
def test_forward_lowers_for_cuda(e, erase, residuals, vd):
  """The forward passes the Mosaic GPU lowering as a cluster of E blocks of two warpgroups; with
  residuals it returns o, U, the chunk-start states and the final state."""
  bh, nc, c, d = 2, 4, 64, 128
  args = specs(bh, nc, c, d, vd, e)
  fn = jax.jit(functools.partial(mosaic_cluster.state_pass, scale=0.125, erase=erase,
                                 residuals=residuals))
  traced = fn.trace(*args)
  saved = [(bh, nc, c, vd), (bh, nc, e, d, vd)] if residuals else []
  assert [x.shape for x in traced.out_info] == [(bh, nc, c, vd), *saved, (bh, e, d, vd)]
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_forward_cluster" in text


@pytest.mark.parametrize("e,erase,save_drhs", [(8, True, True), (4, True, False),
                                               (2, True, True), (2, False, False)])
def test_reverse_lowers_for_cuda(e, erase, save_drhs):
  """The reverse pass lowers likewise and returns dU (bf16 with erase, float32 without),
  [A^T dU, dV,] the chunk-end state gradients and dh0."""
  bh, nc, c, d, vd = 2, 4, 64, 128, 128
  fn = jax.jit(functools.partial(mosaic_cluster.reverse_state_pass, scale=0.125, erase=erase,
                                 save_drhs=save_drhs))
  traced = fn.trace(*specs(bh, nc, c, d, vd, e))
  per_chunk = (bh, nc, c, vd)
  want = [per_chunk] * (1 + 2 * save_drhs) + [(bh, nc, e, d, vd), (bh, e, d, vd)]
  assert [x.shape for x in traced.out_info] == want
  assert traced.out_info[0].dtype == (BF16 if erase else F32)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_backward_states_cluster" in text


@pytest.mark.parametrize("pieces,save_x", [(1, True), (2, False)])
def test_heads_and_pieces_lower_for_cuda(pieces, save_x):
  """With ``heads`` (q, k, v, o, dO and dV in the caller's (B, T, H, X)) and ``pieces`` both
  passes lower; o and dV come back token-major, X after U with ``save_x``."""
  b, t, h, c, d, vd, e = 1, 4 * 64, 2, 64, 128, 128, 8
  rows, nc = b * h * pieces, t // c // pieces
  token = [S((b, t, h, d), BF16), S((b, t, h, d), BF16), S((b, t, h, vd), BF16)]
  per_row = [S((rows, nc, c, e), F32)] * 3 + [S((rows, nc, c, 1), F32)] + [
      S((rows, nc, c, c), F32)] * 2 + [S((rows, e, d, vd), F32)]
  kw = dict(scale=0.125, erase=True, heads=h, pieces=pieces)
  fwd = jax.jit(functools.partial(mosaic_cluster.state_pass, save_x=save_x, **kw))
  traced = fwd.trace(*token, *per_row)
  per_chunk = (rows, nc, c, vd)
  assert [x.shape for x in traced.out_info] == [(b, t, h, vd), per_chunk, *[per_chunk] * save_x,
                                                 (rows, nc, e, d, vd), (rows, e, d, vd)]
  assert "triadic_forward_cluster" in traced.lower(lowering_platforms=("cuda",)).as_text()
  rev = jax.jit(functools.partial(mosaic_cluster.reverse_state_pass, save_drhs=True, **kw))
  traced = rev.trace(*token, *per_row)
  assert [x.shape for x in traced.out_info] == [per_chunk, per_chunk, (b, t, h, vd),
                                                 (rows, nc, e, d, vd), (rows, e, d, vd)]
  assert "triadic_backward_states_cluster" in traced.lower(
      lowering_platforms=("cuda",)).as_text()


def test_save_x_needs_room_and_residuals():
  assert "E >= 4" in mosaic_cluster.supported(128, 128, 64, 2, BF16, save_x=True)
  assert mosaic_cluster.supported(128, 128, 64, 4, BF16, save_x=True) is None
  args = [jnp.zeros(s.shape, s.dtype) for s in specs(1, 2, 64, 128, 128, 8)]
  with pytest.raises(ValueError, match="save_x needs residuals"):
    mosaic_cluster.state_pass(*args, scale=0.1, erase=True, save_x=True, residuals=False)


def test_plan_takes_the_cluster_passes_where_they_fit():
  """``Config.cluster_state_passes`` on the GPU default: the plan's state passes are the cluster
  ones (and the op's kernel functions are theirs) where ``supported`` takes the sizes; else the
  value-split passes with the reason, as on the CPU interpreter."""
  from triadic.pallas import ops as pops
  from triadic.pallas import plan as plan_lib
  gpu = dataclasses.replace(pops.default_config("gpu", 8, 64, hopper=True), cluster_state_passes=True)
  plan = plan_lib.resolve(gpu, d=128, vd=128, c=64, e=8, dtype=BF16)
  assert plan.cluster_state_passes and plan.mosaic_state_kernels
  assert "a cluster of 8 blocks" in plan.forward.tiles and "cluster" in plan.backward_states.tiles
  q, v, k2 = jnp.zeros((1, 1, 64, 128), BF16), jnp.zeros((1, 1, 64, 128), BF16), jnp.zeros(
      (1, 1, 64, 8), F32)
  fwd, bwd = pops.state_pass_kernels(gpu, q, v, k2, save_x=True, heads=2)
  assert fwd.func is mosaic_cluster.state_pass and fwd.keywords["heads"] == 2
  assert bwd.func is mosaic_cluster.reverse_state_pass
  # E = 2 with the Mosaic chunk backward (which reads X): refused, the value-split passes run.
  plan = plan_lib.resolve(gpu, d=128, vd=128, c=64, e=2, dtype=BF16)
  assert not plan.cluster_state_passes and "not as clusters: " in plan.forward.reason
  assert "E >= 4" in plan.forward.reason
  cpu = dataclasses.replace(gpu, platform="cpu")
  plan = plan_lib.resolve(cpu, d=128, vd=128, c=64, e=8, dtype=BF16)
  assert not plan.cluster_state_passes and "no rule for DSMEM" in plan.forward.reason
  assert not plan_lib.resolve(pops.default_config("gpu", 8, 64, hopper=True), d=128, vd=128, c=64, e=8,
                              dtype=BF16).cluster_state_passes


@pytest.mark.parametrize("pieces,t", [(1, 256), (2, 4096)])
def test_op_lowers_for_cuda_with_the_cluster_passes(pieces, t):
  """The whole op, forward and backward, with ``cluster_state_passes``: the cluster kernels run
  in place of the value-split state passes, beside the Mosaic chunk backward, token-major; with
  two sequence pieces, under ``pieces``' cond between the split and the whole sequence (whose
  branches must return the same tuple)."""
  from testkit.triadic import cuda_lowering_text
  from triadic.pallas import ops as pops
  cfg = dataclasses.replace(pops.default_config("gpu", 8, 64, hopper=True), cluster_state_passes=True,
                            sequence_pieces=pieces)
  text = cuda_lowering_text(cfg, 1, t, 2, 128, 128, 8)
  for kernel in ("triadic_forward_cluster", "triadic_backward_states_cluster",
                 "triadic_chunk_backward_slices"):
    assert kernel in text, kernel
  assert "triadic_forward_mgpu" not in text and "triadic_backward_states_mgpu" not in text
