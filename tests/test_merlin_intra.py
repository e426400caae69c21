"""The intra-chunk forward kernel (``merlin.pallas.intra``; interpret mode) against plain JAX,
and the op's pullback of the intra-chunk part (``merlin.chunked.intra_chunk_pullback``, through
``merlin.pallas.ops.intra_stage``; in plain JAX and by the backward kernel) against JAX's
autodiff of the plain-JAX part.

Reference: ``merlin.pallas.ops.intra_operands``, the op's plain-JAX intra-chunk part
(``intra_chunk`` on the chunked inputs, padded and cast as the kernels take them), which a
differentiated call runs in the kernel's place. The kernel's six results are compared with it
(shapes, dtypes, zero padded columns, values). Both erase modes, float32 and bf16 inputs, weak
decay and strong decay (g down to -30 a token), T not a multiple of the chunk, D and V that are
padded (24, 40), B and H > 1 (the kernel reads the (B, T, H, X) layout by row), chunks of 16 to
64 (one to four of the UT inverse's 16 x 16 blocks), and keys aligned within each chunk
(|L_ts| -> 1), where an inverse that is not a substitution loses every digit.
Error bounds (relative RMS, ||a - b|| / ||b||), those of tests/test_merlin_pallas.py's outputs:
  float32: 1e-5 for every result.
  bfloat16 inputs (the reference computes in float32 from the same bf16 values and rounds its
  results once, as the op does): 1.5e-2 (bf16 operands of the products not involving A, whose
  products stay float32).
The pullback's gradients: 1e-5 (both float32 throughout on the same values, the kernels' bf16
cotangents included); 1e-2 for bf16 inputs, where the pullback reads the part's Uv and W as the
state kernels take them, rounded to bf16 (2.8e-3 seen), both round the gradients to bf16, and
the backward kernel takes bf16 operands for the products not involving A (3.5e-3 seen against
the plain-JAX pullback).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from merlin.pallas import intra, ops
from merlin.pallas.intra import intra_part
from testkit import rel_rms
from triadic.pallas.common import Config

jax.config.update("jax_default_matmul_precision", "highest")

BOUNDS = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}
GRAD_BOUNDS = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
CFG = Config("cpu", block_v=16, bwd_block_v=16)
RESULTS = {True: ("qe", "w", "kw", "uv", "gam", "intra"),
           False: ("qe", "kw", "uv", "gam", "intra")}


def make_inputs(seed, b, t, h, d, vd, decay, dtype):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t, h, d)))
  k = unit(jax.random.normal(ks[1], (b, t, h, d)))
  if decay == "aligned":  # every key of a chunk near one direction, beta near 1, little decay
    k = unit(k[:, :1] + 0.02 * k)
    g = -0.01 * jax.random.uniform(ks[3], (b, t, h))
    beta = 0.99 + 0.01 * jax.random.uniform(ks[4], (b, t, h))
  else:
    g = (-30.0 * jax.random.uniform(ks[3], (b, t, h)) ** 3 if decay == "strong"
         else -0.1 * jax.random.uniform(ks[3], (b, t, h)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
  v = jax.random.normal(ks[2], (b, t, h, vd))
  return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta


CASES = [
    # b, t, h, d, v, chunk, erase, decay, dtype
    pytest.param(2, 100, 2, 24, 40, 32, True, "strong", jnp.float32, id="erase-strong-D24-V40"),
    pytest.param(2, 100, 2, 24, 40, 16, True, "weak", jnp.bfloat16, id="erase-bf16-D24-V40"),
    pytest.param(1, 100, 3, 32, 16, 16, False, "strong", jnp.bfloat16, id="noerase-bf16-strong"),
    pytest.param(2, 100, 2, 16, 24, 32, False, "weak", jnp.float32, id="noerase-V24"),
    pytest.param(1, 128, 2, 32, 32, 64, True, "aligned", jnp.float32, id="erase-aligned-C64"),
    pytest.param(1, 100, 2, 32, 64, 64, True, "strong", jnp.bfloat16, id="erase-bf16-strong-C64"),
]


@pytest.mark.parametrize("b,t,h,d,vd,chunk,erase,decay,dtype", CASES)
def test_intra_kernel_matches_plain_jax(b, t, h, d, vd, chunk, erase, decay, dtype,
                                        monkeypatch):
  """The forward kernel's results against the plain-JAX part's, its value walk in blocks of 16
  columns (several where V > 16)."""
  monkeypatch.setattr(intra, "FORWARD_BLOCK_V", 16)
  args = make_inputs(0, b, t, h, d, vd, decay, dtype)
  got = jax.jit(lambda *a: intra_part(*a, chunk_size=chunk, erase=erase, cfg=CFG))(*args)
  want = jax.jit(lambda *a: ops.intra_operands(*a, chunk_size=chunk, erase=erase))(*args)
  nc, dp, vp = -(-t // chunk), ops.padded_width(d), ops.padded_width(vd)
  # each result's (width, its real columns): D and V padded, intra with the op's V, gam a scalar
  widths = {"gam": (None, None), "uv": (vp, vd), "intra": (vd, vd)}
  for name, x, y in zip(RESULTS[erase], got, want, strict=True):
    width, real = widths.get(name, (dp, d))
    assert x.shape == (b, h, nc) + ((chunk, width) if width else ()), name
    assert x.dtype == (jnp.float32 if name in ("gam", "intra") else dtype), name
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    if width:  # the padded columns are zero
      assert np.all(x[..., real:] == 0), name
    assert np.all(np.isfinite(x)), name
    assert np.linalg.norm(y) > 0 or name == "gam", name  # gamma underflows under strong decay
    assert rel_rms(x, y) < BOUNDS[dtype], f"{name}: rel RMS {rel_rms(x, y):.2e}"


def test_bad_chunk_raises():
  args = make_inputs(0, 1, 48, 1, 16, 16, "weak", jnp.float32)
  with pytest.raises(ValueError, match="power-of-two chunk size"):
    intra_part(*args, chunk_size=24, erase=True, cfg=CFG)


@pytest.mark.parametrize("kernels", [False, True], ids=["plain-jax", "kernels"])
@pytest.mark.parametrize("b,t,h,d,vd,chunk,erase,decay,dtype", CASES)
def test_intra_pullback_matches_autodiff(b, t, h, d, vd, chunk, erase, decay, dtype, kernels,
                                         monkeypatch):
  """``intra_stage``'s gradients (A kept, ``intra_chunk_pullback``) against ``jax.vjp`` of
  ``intra_operands`` (JAX's autodiff through the inverse's substitution), with random cotangents
  on every result, the padded columns' and rows' included: the plain-JAX forward and pullback,
  or (``kernels``) the forward kernel's A (``intra_part(inverse=True)``) and the backward kernel
  (``Config.intra_backward_kernel``: ``intra_part_pullback``), the kernels' walks here in blocks
  of 16 columns, so that each walks several blocks where D, V > 16."""
  monkeypatch.setattr(intra, "FORWARD_BLOCK_V", 16)
  monkeypatch.setattr(intra, "BACKWARD_BLOCKS", (16, 16))
  args = make_inputs(1, b, t, h, d, vd, decay, dtype)
  cfg = Config("cpu", block_v=16, bwd_block_v=16, intra_kernel=kernels,
               intra_backward_kernel=kernels)
  reference = lambda *a: ops.intra_operands(*a, chunk_size=chunk, erase=erase)
  stage = lambda *a: ops.intra_stage(chunk, erase, cfg, *a)
  outs = jax.eval_shape(reference, *args)
  keys = jax.random.split(jax.random.PRNGKey(2), len(outs))
  cots = tuple(jax.random.normal(key, o.shape).astype(o.dtype) for key, o in zip(keys, outs))
  grads = lambda f: jax.jit(lambda cots, *a: jax.vjp(f, *a)[1](cots))(cots, *args)
  names = ("dq", "dk", "dv", "dg", "dbeta")
  for name, x, y in zip(names, grads(stage), grads(reference), strict=True):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert x.shape == y.shape and np.all(np.isfinite(x)), name
    assert np.linalg.norm(y) > 0, name
    assert rel_rms(x, y) < GRAD_BOUNDS[dtype], f"{name}: rel RMS {rel_rms(x, y):.2e}"
