"""The decay masks M, M' and their gradients (``triadic.pallas.masks``) against a float64
autodiff oracle.

The oracle is ``triadic.chunked.chunk_masks`` (the definition, elementwise over (C, C, E)) in a
scalar L = <dM, M> + <dM', M'> + the row-coefficient terms that ``mask_grads`` adds (dcoef k2 a,
dqcoef q2 a, dkcoef k2 b, dlam exp(gc_C); a = exp(gc), b = exp(gc_C - gc)), differentiated by
JAX in float64 with respect to k2, q2 and gc. Inputs: C = 64, E = 3 (not a power of two; one
case at E = 8), strong decay (g down to -30 per token, where only masking before exp keeps the
upper triangle finite and the sub-chunk factors underflow) and weak, with and without erase; by
sub-chunks of 16, 8 and 32 and elementwise (``subchunk=0``, the default). Bound: relative RMS
1e-5 (float32 against float64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testkit import rel_rms
from triadic.chunked import chunk_masks
from triadic.pallas import masks

BOUND = 1e-5
C, E = 64, 3
CASES = [(30.0, True), (0.05, True), (30.0, False)]


def operands(decay, seed=0, e_dim=E):
  """(k2, q2, gc) columns (BH, NC, C, E) float32 and cotangents dM, dM' (BH, NC, C, C) and row
  coefficients dcoef, dqcoef, dkcoef (BH, NC, C, E), dlam (BH, NC, E)."""
  rng = np.random.default_rng(seed)
  shape = (2, 3, C, e_dim)
  k2, q2 = (np.abs(rng.standard_normal(shape)) / np.sqrt(e_dim) for _ in range(2))
  g = -decay * rng.uniform(0.0, 1.0, shape)
  gc = np.cumsum(g, axis=-2)
  tri = np.tril(np.ones((C, C)))
  dm, dmq = (rng.standard_normal((2, 3, C, C)) * tri for _ in range(2))
  dcoef, dqcoef, dkcoef = (rng.standard_normal(shape) for _ in range(3))
  dlam = rng.standard_normal((2, 3, e_dim))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return tuple(map(f32, (k2, q2, gc))), tuple(map(f32, (dm, dmq, dcoef, dqcoef, dkcoef, dlam)))


def oracle(cols, cots, erase):
  """(dk2, dq2, dgc) in float64 by autodiff of the definition."""
  dm, dmq, dcoef, dqcoef, dkcoef, dlam = (jnp.asarray(x, jnp.float64) for x in cots)

  def loss(k2, q2, gc):
    m, mq = chunk_masks(gc, k2, q2)
    a, gl = jnp.exp(gc), gc[..., -1:, :]
    b = jnp.exp(gl - gc)
    out = jnp.sum(dmq * mq) + jnp.sum(dqcoef * q2 * a) + jnp.sum(dkcoef * k2 * b)
    out = out + jnp.sum(dlam * jnp.exp(gl[..., 0, :]))
    if erase:
      out = out + jnp.sum(dm * m) + jnp.sum(dcoef * k2 * a)
    return out

  return jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float64) for x in cols))


@pytest.mark.parametrize("decay,erase,subchunk,e_dim",
                         [(d, er, sub, E) for sub in (16, 0) for d, er in CASES]
                         + [(30.0, True, 8, E), (0.05, True, 32, E), (30.0, True, 16, 8),
                            (0.05, False, 16, 8)])
def test_masks_and_gradients_match_float64_oracle(decay, erase, subchunk, e_dim):
  (k2, q2, gc), cots = operands(decay, e_dim=e_dim)
  rows = lambda x: jnp.swapaxes(x, -1, -2)
  m, mq = masks.decay_masks(k2, rows(k2), q2, gc, rows(gc), erase=erase, subchunk=subchunk)
  assert mq.dtype == jnp.float32
  with jax.enable_x64(True):
    want_m, want_mq = chunk_masks(*(jnp.asarray(x, jnp.float64) for x in (gc, k2, q2)))
    assert rel_rms(mq, want_mq) < BOUND
    if erase:
      assert rel_rms(m, want_m) < BOUND
    else:
      assert m is None
    want = oracle((k2, q2, gc), cots, erase)
  dm, dmq, dcoef, dqcoef, dkcoef, dlam = cots
  dk2_col, dk2_row, dq2, dgc_col, dgc_row = masks.mask_grads(
      dmq, dm if erase else None, dcoef, dqcoef, dkcoef, dlam, k2, rows(k2), q2, gc, rows(gc),
      erase=erase, subchunk=subchunk)
  got = (dk2_col + rows(dk2_row), dq2, dgc_col + rows(dgc_row))
  for name, x, y in zip(("dk2", "dq2", "dgc"), got, want):
    assert x.dtype == jnp.float32 and x.shape == y.shape, name
    assert rel_rms(x, y) < BOUND, f"{name}: rel RMS {rel_rms(x, y):.2e}"


def test_sub_chunk_sizes():
  """0 and sizes >= C take the elementwise form; a size that does not divide C is refused."""
  assert masks.sub_chunk(16, 64) == 16 and masks.sub_chunk(0, 64) == 0
  assert masks.sub_chunk(64, 64) == 0 and masks.sub_chunk(16, 16) == 0
  for bad in (24, -1, 1.5):
    with pytest.raises(ValueError, match="subchunk"):
      masks.sub_chunk(bad, 64)
