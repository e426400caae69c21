"""The decay masks M, M' and their gradients (``triadic.pallas.masks``) against a float64
autodiff oracle.

The oracle is ``triadic.chunked.chunk_masks`` (the definition, elementwise over (C, C, E)) in a
scalar L = <dM, M> + <dM', M'> + the row-coefficient terms that ``mask_grads`` adds (dcoef k2 a,
dqcoef q2 a, dkcoef k2 b, dlam exp(gc_C); a = exp(gc), b = exp(gc_C - gc)), differentiated by
JAX in float64 with respect to k2, q2 and gc. Inputs: C = 64, E = 3 (not a power of two), strong
decay (g down to -30 per token, where only masking before exp keeps the upper triangle finite)
and weak, with and without erase. Bound: relative RMS 1e-5 (float32 against float64).
``mask_grads_kernel`` (Pallas interpret mode) is held to the same oracle and bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testkit import rel_rms
from triadic.chunked import chunk_masks
from triadic.pallas import masks
from triadic.pallas.common import Config

BOUND = 1e-5
C, E = 64, 3


def operands(decay, seed=0):
  """(k2, q2, gc) columns (BH, NC, C, E) float32 and cotangents dM, dM' (BH, NC, C, C) and row
  coefficients dcoef, dqcoef, dkcoef (BH, NC, C, E), dlam (BH, NC, E)."""
  rng = np.random.default_rng(seed)
  shape = (2, 3, C, E)
  k2, q2 = (np.abs(rng.standard_normal(shape)) / np.sqrt(E) for _ in range(2))
  g = -decay * rng.uniform(0.0, 1.0, shape)
  gc = np.cumsum(g, axis=-2)
  tri = np.tril(np.ones((C, C)))
  dm, dmq = (rng.standard_normal((2, 3, C, C)) * tri for _ in range(2))
  dcoef, dqcoef, dkcoef = (rng.standard_normal(shape) for _ in range(3))
  dlam = rng.standard_normal((2, 3, E))
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


@pytest.mark.parametrize("decay,erase", [(30.0, True), (0.05, True), (30.0, False)])
def test_masks_and_gradients_match_float64_oracle(decay, erase):
  (k2, q2, gc), cots = operands(decay)
  rows = lambda x: jnp.swapaxes(x, -1, -2)
  m, mq = masks.decay_masks(k2, rows(k2), q2, gc, rows(gc), erase=erase)
  with jax.enable_x64(True):
    want_m, want_mq = chunk_masks(*(jnp.asarray(x, jnp.float64) for x in (gc, k2, q2)))
    assert rel_rms(mq, want_mq) < BOUND
    if erase:
      assert rel_rms(m, want_m) < BOUND
    else:
      assert m is None
    want = oracle((k2, q2, gc), cots, erase)
  dm, dmq, dcoef, dqcoef, dkcoef, dlam = cots
  got = masks.mask_grads(dmq, dm if erase else None, dcoef, dqcoef, dkcoef, dlam, k2, rows(k2),
                         q2, gc, rows(gc), erase=erase)
  for name, x, y in zip(("dk2", "dq2", "dgc"), got, want, strict=True):
    assert x.dtype == jnp.float32 and x.shape == y.shape, name
    assert rel_rms(x, y) < BOUND, f"{name}: rel RMS {rel_rms(x, y):.2e}"



@pytest.mark.parametrize("decay,erase", [(30.0, True), (0.05, False)])
def test_mask_grads_kernel_matches_float64_oracle(decay, erase):
  """The kernel's summed dk2, dq2, d gc, its row coefficients in a wider (C, 3E + 2) matrix as
  the slice kernel hands them over."""
  cols, cots = operands(decay, seed=1)
  dm, dmq, dcoef, dqcoef, dkcoef, dlam = cots
  pad = jnp.zeros((*dcoef.shape[:-1], 2), jnp.float32)
  coef = jnp.concatenate([dcoef, dqcoef, dkcoef, pad], axis=-1)
  got = masks.mask_grads_kernel(dmq, dm if erase else None, coef, dlam, *cols, erase=erase,
                                cfg=Config("cpu", block_v=16, bwd_block_v=16))
  with jax.enable_x64(True):
    want = oracle(cols, cots, erase)
  for name, x, y in zip(("dk2", "dq2", "dgc"), got, want, strict=True):
    assert x.dtype == jnp.float32 and x.shape == y.shape, name
    assert rel_rms(x, y) < BOUND, f"{name}: rel RMS {rel_rms(x, y):.2e}"


def test_mask_grads_kernel_rejects_bad_operands():
  """A row-sum matrix narrower than 3E, or dM given without erase (or missing with it), is a
  ValueError naming the operand."""
  (k2, q2, gc), (dm, dmq, _, _, _, dlam) = operands(1.0)
  cfg = Config("cpu", block_v=16, bwd_block_v=16)
  with pytest.raises(ValueError, match="coef must be"):
    masks.mask_grads_kernel(dmq, dm, jnp.zeros((*k2.shape[:-1], 3 * E - 1)), dlam, k2, q2, gc,
                            erase=True, cfg=cfg)
  coef = jnp.zeros((*k2.shape[:-1], 3 * E))
  for given, erase in ((dm, False), (None, True)):
    with pytest.raises(ValueError, match="dm must be given exactly with erase"):
      masks.mask_grads_kernel(dmq, given, coef, dlam, k2, q2, gc, erase=erase, cfg=cfg)
