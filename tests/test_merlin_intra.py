"""The intra-chunk kernels (``merlin.pallas.intra``, interpret mode on the CPU) against plain JAX.

Reference: ``merlin.chunked.intra_chunk`` on ``merlin.pallas.ops.chunk_inputs``' chunks, padded
and cast by ``kernel_operands`` (intra padded to the kernels' V with zeros, as the kernel writes
it): the op's plain-JAX path. The forward's six results are compared with it, and the kernels'
VJP, all five input gradients (q, k, v, g, beta) for random cotangents of the six results in their
dtypes, with JAX's autodiff of it. Both erase modes, float32 and bf16 inputs, weak decay and
strong decay (g down to -30 a token), T not a multiple of the chunk, D and V that are padded
(24, 40), B and H > 1 (the kernels read the (B, T, H, X) layout by row), chunks of 16 to 64
(one to four of the UT inverse's 16 x 16 blocks), and keys aligned within each chunk
(|L_ts| -> 1), where an inverse that is not a substitution loses every digit.
Error bounds (relative RMS, ||a - b|| / ||b||), those of tests/test_merlin_pallas.py:
  float32: 1e-5 for every result and gradient.
  bfloat16 inputs (the reference computes in float32 from the same bf16 values and rounds its
  results once, as the op does): results 1.5e-2, gradients 2e-2 (bf16 operands of the products
  not involving A, whose products stay float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from merlin.chunked import intra_chunk
from merlin.pallas import ops
from merlin.pallas.intra import intra_part
from testkit import rel_rms
from triadic.pallas.common import Config

jax.config.update("jax_default_matmul_precision", "highest")

BOUNDS = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (1.5e-2, 2e-2)}
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


def reference(q, k, v, g, beta, *, chunk, erase):
  """The op's plain-JAX intra-chunk part, results as ``intra_part``'s (intra padded)."""
  lam = jnp.zeros((*g.shape, 1))
  qc, kc, vc, gc, betac, lamc = ops.chunk_inputs(q, k, v, g, beta, lam, segment_len=chunk,
                                                 chunk_size=chunk)
  uv, w, qe, kw, gam, intra, _, _ = intra_chunk(qc, kc, vc, gc, betac, erase)
  *mats, gam, _, intra, _ = ops.kernel_operands(uv, w, qe, kw, gam, intra, gc, lamc, cps=1,
                                                erase=erase, dtype=q.dtype)
  vp = mats[-1].shape[-1]
  return (*mats, gam, jnp.pad(intra, [(0, 0)] * 4 + [(0, vp - intra.shape[-1])]))


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
def test_intra_kernels_match_plain_jax(b, t, h, d, vd, chunk, erase, decay, dtype):
  """Forward results and the VJP's five input gradients against the plain-JAX part's."""
  args = make_inputs(0, b, t, h, d, vd, decay, dtype)
  kernel = lambda *a: intra_part(*a, chunk_size=chunk, erase=erase, cfg=CFG)
  plain = lambda *a: reference(*a, chunk=chunk, erase=erase)
  got, pullback = jax.vjp(jax.jit(kernel), *args)
  want, pullback_ref = jax.vjp(jax.jit(plain), *args)
  out_bound, grad_bound = BOUNDS[dtype]
  nc, dp, vp = -(-t // chunk), ops.padded_width(d), ops.padded_width(vd)
  widths = {"gam": None, "uv": vp, "intra": vp}
  for name, x, y in zip(RESULTS[erase], got, want, strict=True):
    width = widths.get(name, dp)
    assert x.shape == (b, h, nc) + ((chunk, width) if width else ()), name
    assert x.dtype == (jnp.float32 if name in ("gam", "intra") else dtype), name
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    if width:  # the padded columns are zero
      assert np.all(x[..., (d if width == dp else vd):] == 0), name
    assert np.all(np.isfinite(x)), name
    assert np.linalg.norm(y) > 0 or name == "gam", name  # gamma underflows under strong decay
    assert rel_rms(x, y) < out_bound, f"{name}: rel RMS {rel_rms(x, y):.2e}"

  keys = jax.random.split(jax.random.PRNGKey(1), len(want))
  cots = [jax.random.normal(key, y.shape).astype(y.dtype) for key, y in zip(keys, want)]
  for name, x, gx, gw in zip("q k v g beta".split(), args, pullback(tuple(cots)),
                             pullback_ref(tuple(cots)), strict=True):
    assert gx.shape == x.shape and gx.dtype == x.dtype, name
    gx, gw = np.asarray(gx, np.float32), np.asarray(gw, np.float32)
    assert np.all(np.isfinite(gx)) and np.linalg.norm(gw) > 0, name
    assert rel_rms(gx, gw) < grad_bound, f"d{name}: rel RMS {rel_rms(gx, gw):.2e}"


def test_bad_chunk_raises():
  args = make_inputs(0, 1, 48, 1, 16, 16, "weak", jnp.float32)
  with pytest.raises(ValueError, match="power-of-two chunk size"):
    intra_part(*args, chunk_size=24, erase=True, cfg=CFG)
