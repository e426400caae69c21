"""The forward's prep in one kernel (``Config.fused_prep``: masks M, M' and the UT inverse inside)
against the plain-JAX masks and inverse around the E-independent kernel, in interpret mode: gc, A
and P per chunk, then the whole op against the scan and the aligned-keys case of the inverse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from testkit import rel_rms
from testkit.triadic import check_against_scan, make_grad_inputs, value_and_grads
from triadic.pallas import plan
from triadic.pallas.chunk_prep import chunk_prep, fused_prep_supported
from triadic.pallas.common import Config
from triadic.pallas.ops import kernel_layout

PLAIN = Config("cpu", block_v=16, bwd_block_v=16)
FUSED = Config("cpu", block_v=16, bwd_block_v=16, fused_prep=True)


def prep_operands(seed, t, h, d, e, c, decay, dtype):
  args, _, _ = make_grad_inputs(seed, 1, t, h, d, 16, e, decay=decay, dtype=dtype)
  nc = -(-t // c)
  lay = lambda x: kernel_layout(x, nc, c).reshape(h, nc, c, -1)
  q, k = (lay(x) for x in args[:2])
  k2, q2, g, beta = (lay(x.astype(jnp.float32)) for x in args[3:7])
  return q, k, k2, q2, g, beta


@pytest.mark.parametrize("t,d,e,c,erase,decay,dtype", [
    pytest.param(150, 32, 3, 64, True, 1.0, jnp.float32, id="E3-C64"),
    pytest.param(100, 16, 1, 32, True, 20.0, jnp.float32, id="E1-C32-strong-decay"),
    pytest.param(90, 32, 2, 64, True, 0.02, jnp.bfloat16, id="E2-C64-bf16-weak-decay"),
    pytest.param(70, 16, 5, 16, False, 1.0, jnp.float32, id="E5-C16-noerase"),
])
def test_fused_prep_matches_plain(t, d, e, c, erase, decay, dtype):
  ops = prep_operands(0, t, 2, d, e, c, decay, dtype)
  want = chunk_prep(*ops, erase=erase, cfg=PLAIN)
  got = chunk_prep(*ops, erase=erase, cfg=FUSED, fused=True)
  for name, x, y in zip(("gc", "gc rows", "A", "P"), got, want, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    assert rel_rms(x, y) < 1e-5, f"{name}: {rel_rms(x, y):.2e}"


def test_fused_prep_aligned_keys():
  """Identical keys in a chunk with beta near 1 (|L_ts| -> 1): the blocked substitution stays
  exact where a product of powers of L would lose every digit."""
  args, do, ds = make_grad_inputs(3, 1, 64, 1, 16, 16, 2, decay=0.0, dtype=jnp.float32)
  args[1] = jnp.broadcast_to(args[1][:, :1], args[1].shape)
  args[3] = jnp.broadcast_to(args[3][:, :1], args[3].shape)
  args[6] = jnp.full(args[6].shape, 0.99)
  got, (o, s) = value_and_grads(None, args, do, ds, erase=True, chunk_size=64, config=FUSED)
  want, (o_ref, s_ref) = value_and_grads("scan", args, do, ds, erase=True, chunk_size=64)
  assert rel_rms(o, o_ref) < 1e-4 and rel_rms(s, s_ref) < 1e-4
  for i, (x, y) in enumerate(zip(got, want)):
    assert rel_rms(x, y) < 1e-4, i


def test_op_with_fused_prep_matches_scan():
  """The Triton structure with the one-kernel prep, float32 (the Mosaic path's bf16 op test
  takes it too: tests/test_mosaic_gpu.py)."""
  check_against_scan(1, 150, 2, 32, 48, 3, 64, True, 20.0, jnp.float32, config=FUSED)


def test_fused_prep_supported_and_planned():
  assert fused_prep_supported(64) is None and fused_prep_supported(16) is None
  assert "multiple of 16" in fused_prep_supported(24)
  assert "multiple of 16" in fused_prep_supported(8)
  sizes = dict(d=64, vd=64, e=2, dtype=jnp.bfloat16)
  assert plan.resolve(FUSED, c=64, **sizes).fused_prep
  assert not plan.resolve(PLAIN, c=64, **sizes).fused_prep
  unsupported = plan.resolve(FUSED, c=24, **sizes)
  assert not unsupported.fused_prep and "multiple of 16" in unsupported.prep.reason
  tpu = Config("tpu", block_v=128, bwd_block_v=128, interpret=True, fused_prep=True)
  assert "TPU" in plan.resolve(tpu, c=64, **sizes).prep.reason


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_prep_lowers_for_cuda(dtype):
  """The one-kernel prep lowers to Triton IR for CUDA (C = 64, E = 8); nothing runs."""
  shape = lambda *s, dt=jnp.float32: jax.ShapeDtypeStruct(s, dt)
  bh, nc, c, d, e = 4, 3, 64, 128, 8
  args = (shape(bh, nc, c, d, dt=dtype), shape(bh, nc, c, d, dt=dtype), shape(bh, nc, c, e),
          shape(bh, nc, c, e), shape(bh, nc, c, e), shape(bh, nc, c, 1))
  gpu = Config("gpu", block_v=32, bwd_block_v=32, fused_prep=True)
  fn = jax.jit(lambda *a: chunk_prep(*a, erase=True, cfg=gpu, fused=True))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_chunk_prep_fused" in text
