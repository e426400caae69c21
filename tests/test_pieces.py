"""The state passes over pieces of the sequence (``triadic/pallas/pieces.py``): the op with pieces
against the scan where every window decays enough (the pieces run) and where one does not (the
plain pass runs), the decision, the bound, and the CUDA lowering."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testkit import rel_rms
from testkit.triadic import (assert_matches_scan, bf16_transposes, check_against_scan,
                             cuda_lowering_text, make_grad_inputs, value_and_grads)
from triadic.pallas import ops as pops
from triadic.pallas import pieces
from triadic.pallas.common import Config
from triadic.pallas.ops import kernel_layout

jax.config.update("jax_default_matmul_precision", "highest")

# T = 181 at C = 16 is 12 chunks: three pieces of four, two-chunk warm-ups.
PIECES = Config("cpu", block_v=16, bwd_block_v=16, sequence_pieces=3, warmup_chunks=2)


def _window_fits(b, t, h, e, decay, chunk, cfg):
  """Whether the op's forward windows (before pieces 1 ..) all decay below exp(LOG_TOL) on
  ``make_grad_inputs``' values."""
  args, _, _ = make_grad_inputs(0, b, t, h, 16, 16, e, decay=decay, dtype=jnp.float32)
  nc = -(-t // chunk)
  lay = lambda x: kernel_layout(x, nc, chunk).reshape(b * h, nc, chunk, -1)
  k, k2, g, beta = (lay(args[i]) for i in (1, 3, 5, 6))
  live = jnp.ones((b * h, e), bool)
  choice = pieces.choose(cfg.sequence_pieces, cfg.warmup_chunks, programs=1, nc=nc)
  return bool(pieces._fits(pieces.token_log_bound(pieces.key_norms(k), k2, g, beta, live,
                                                  erase=True),
                           pieces.window_starts(choice, reverse=False), choice.warmup))


@pytest.mark.parametrize("e,erase,decay,dtype,pieces_run", [
    pytest.param(3, True, 4.0, jnp.float32, True, id="E3-decaying-pieces-run"),
    pytest.param(2, False, 6.0, jnp.bfloat16, True, id="E2-noerase-bf16-pieces-run"),
    pytest.param(3, True, 0.05, jnp.float32, False, id="E3-weak-decay-plain-pass"),
])
def test_pieces_match_scan(e, erase, decay, dtype, pieces_run):
  """Output, final state and every gradient against the scan with three pieces, B = 2, H = 2,
  E = 3 padded to 4 (an inert slice): where every window decays below exp(LOG_TOL) the pieces
  run; under weak decay the windows do not, and the op must take the plain pass (pieces there
  would drop state that still matters)."""
  assert _window_fits(2, 181, 2, e, decay, 16, PIECES) == pieces_run
  check_against_scan(2, 181, 2, 16, 32, e, 16, erase, decay, dtype, config=PIECES)


def test_mosaic_gpu_pieces_match_scan():
  """The Hopper state-passing kernels (Mosaic GPU interpret mode, a 64-column value block,
  ``Config.state_block_v``) over two pieces with 5-chunk warm-ups: 740 tokens at C = 64 are 12
  chunks."""
  from triadic.pallas import mosaic
  if not mosaic.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this JAX")
  cfg = Config("cpu", block_v=16, bwd_block_v=16, mosaic_gpu=True, state_block_v=64,
               sequence_pieces=2, warmup_chunks=5)
  plan = pops.explain(64, 64, 1, 64, jnp.bfloat16, config=cfg)
  assert plan.mosaic_state_kernels and "block_v 64" in plan.forward.tiles
  check_against_scan(1, 740, 1, 64, 64, 1, 64, True, 1.0, jnp.bfloat16, config=cfg)


def test_token_major_pieces_match_kernel_layout():
  """The Hopper kernels (interpret mode) over two pieces with q, k, v, o, dO in the caller's
  layout (``plan.layout`` takes it with pieces): output, final state and every gradient equal to
  the relayouted op's over the same pieces, where every window decays enough that the pieces
  run, and to the scan's within the bf16 bounds. B = H = 2: piece rows (b * H + h) * 2 + p."""
  from triadic.pallas import mosaic
  if not mosaic.interpret_available():
    pytest.skip("Mosaic GPU interpret mode unavailable in this JAX")
  b, t, h, d, vdim, e, decay = 2, 256, 2, 64, 32, 2, 4.0
  cfg = Config("cpu", block_v=16, bwd_block_v=16, mosaic_gpu=True, mosaic_gpu_backward=True,
               ut_kernel=True, sequence_pieces=2, warmup_chunks=2)
  assert pops.explain_layout(b, t, h, d, vdim, e, 64, jnp.bfloat16, config=cfg).token_major
  args, do, ds = make_grad_inputs(0, b, t, h, d, vdim, e, decay=decay, dtype=jnp.bfloat16)
  lay = lambda x: kernel_layout(x, t // 64, 64).reshape(b * h, t // 64, 64, -1)
  k, k2, g, beta = (lay(args[i]) for i in (1, 3, 5, 6))
  k_sq = pieces.key_norms(k)
  assert jnp.array_equal(pieces.key_norms(args[1], h, 64), k_sq)
  choice = pieces.choose(2, 2, programs=1, nc=t // 64)
  assert choice.count == 2 and bool(pieces._fits(
      pieces.token_log_bound(k_sq, k2, g.astype(jnp.float32), beta, jnp.ones((b * h, e), bool),
                             erase=True), pieces.window_starts(choice, reverse=False), 2))
  got = value_and_grads("pallas", args, do, ds, erase=True, chunk_size=64, config=cfg)
  want = value_and_grads("pallas", args, do, ds, erase=True, chunk_size=64,
                         config=dataclasses.replace(cfg, token_major=False))
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype
    assert rel_rms(x, y) < 1e-5, f"rel RMS {rel_rms(x, y):.2e}"
  assert_matches_scan(got, args, do, ds, erase=True, chunk_size=64)


def test_choose():
  auto = lambda programs, nc, sms=132: pieces.choose(0, 16, programs=programs, nc=nc, sms=sms)
  assert auto(64, 1024).count == 2            # B = 1, H = 16, four value blocks at T = 65536
  assert auto(16, 1024).count == 8
  assert auto(128, 1024).count == 1           # the programs fill the device
  assert auto(64, 24).count == 1              # pieces shorter than the warm-up
  assert auto(30, 36).count == 2              # 4 does not divide 36 into 16-chunk pieces; 2 does
  assert pieces.choose(1, 16, programs=1, nc=1024).count == 1
  assert pieces.choose(3, 2, programs=999, nc=12) == pieces.Pieces(3, 4, 2,
                                                                   "Config.sequence_pieces = 3")
  assert pieces.choose(5, 2, programs=1, nc=12).count == 1   # 5 does not divide 12


def test_token_log_bound():
  """With unit keys and beta in [0, 1] the bound is the decay of the weakest live slice; a key
  longer than 1 adds log(beta |u|^2 - 1) where that exceeds 1; dead slices are left out."""
  rng = np.random.default_rng(0)
  g = jnp.asarray(-rng.uniform(0.5, 1.0, size=(1, 2, 4, 3)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 2, 4, 8)), jnp.float32)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  k2 = jnp.full((1, 2, 4, 3), 3 ** -0.5, jnp.float32)
  beta = jnp.full((1, 2, 4, 1), 0.7, jnp.float32)
  live = jnp.array([[True, True, False]])
  bound = lambda k, erase=True: pieces.token_log_bound(pieces.key_norms(k), k2, g, beta, live,
                                                      erase=erase)
  np.testing.assert_allclose(bound(k), jnp.max(g[..., :2], -1), rtol=1e-6)
  np.testing.assert_allclose(bound(3 * k), jnp.max(g[..., :2], -1) + np.log(0.7 * 9 - 1),
                             rtol=1e-5)                                   # |u|^2 = 9
  assert jnp.all(bound(3 * k, erase=False) == jnp.max(g[..., :2], -1))


def test_pieces_lower_for_cuda():
  """The op with pieces (both branches of the cond, forward and backward) lowers for CUDA with
  the Mosaic GPU state kernels."""
  cfg = dataclasses.replace(pops.default_config("gpu", 1, 64), mosaic_gpu=True,
                            sequence_pieces=2, warmup_chunks=4)
  text = cuda_lowering_text(cfg, 1, 2048, 1, 64, 64, 1)
  assert text.count("triadic_forward_mgpu") >= 3      # the plain pass, the warm-up, the pieces
  assert "triadic_backward_states_mgpu" in text


def test_token_major_pieces_lower_for_cuda():
  """With pieces and token-major operands (two-warpgroup state passes at E = 4, D = 128) the op
  lowers for CUDA with no transpose of a q-sized bf16 array: the pieces read q, k, v, dO in place
  and only the warm-up windows are relayouted."""
  b, t, h, d, e = 1, 2048, 2, 128, 4
  cfg = dataclasses.replace(pops.default_config("gpu", e, d), mosaic_gpu=True,
                            mosaic_gpu_backward=True, sequence_pieces=2, warmup_chunks=4)
  assert pops.explain_layout(b, t, h, d, d, e, 64, jnp.bfloat16, config=cfg).token_major
  assert "2 warpgroup(s)" in pops.explain(d, d, e, 64, jnp.bfloat16, config=cfg).forward.tiles
  text = cuda_lowering_text(cfg, b, t, h, d, d, e)
  assert text.count("triadic_forward_mgpu") >= 3      # the plain pass, the warm-up, the pieces
  assert bf16_transposes(text, b, t, h, d) == 0
  relayouted = cuda_lowering_text(dataclasses.replace(cfg, token_major=False), b, t, h, d, d, e)
  assert bf16_transposes(relayouted, b, t, h, d) >= 4


def test_hopper_default_config(monkeypatch):
  """On Hopper the state passes take pieces by the device (``sequence_pieces=0``), and at E = 1
  64-column state blocks when 32-column ones would fill at most half the multiprocessors; every
  GPU takes the UT inverse's kernel."""
  monkeypatch.setattr(pops, "is_hopper", lambda: True)
  monkeypatch.setattr(pieces, "device_sms", lambda: 132)
  cfg = lambda **kw: pops.default_config("gpu", vd=128, **kw)
  assert cfg(e=1, bh=16).state_block_v == 64 and cfg(e=1, bh=16).sequence_pieces == 0
  assert cfg(e=1, bh=32).state_block_v is None          # 128 programs fill the device
  assert cfg(e=2, bh=16).state_block_v is None and cfg(e=2, bh=16).sequence_pieces == 0
  assert cfg(e=1).state_block_v is None                 # sizes without B*H: the plain default
  monkeypatch.setattr(pops, "is_hopper", lambda: False)
  assert cfg(e=1, bh=16).sequence_pieces == 1 and cfg(e=1, bh=16).state_block_v is None
  assert cfg(e=8).ut_kernel and not pops.default_config("cpu", 8, 128).ut_kernel  # GPUs only
