"""Mosaic GPU chunk-parallel backward (``triadic.pallas.mosaic_backward``) against the Triton
structured ``backward.chunk_gradients``, both in interpret mode on this CPU.

Inputs are built as ``ops._backward`` sees them: chunked bf16 q, k, v, do, float32 k2, q2, beta,
``chunk_prep`` for gc, A, P, then ``recurrent.state_pass`` / ``recurrent.reverse_state_pass``
(Pallas interpret mode) for realistic U, chunk-start states, dU and chunk-end state gradients.
The slice kernel runs in Mosaic GPU interpret mode (simulated SMEM, TMA, barriers, wgmma), the
tail kernel in Pallas interpret mode and the mask work (``masks.py``) in plain JAX, or the mask
gradients by their kernel (Pallas interpret mode) where a case says so.
Error bound (relative RMS, ||a - b|| / ||b||): 1e-2 for every output, 2e-2 for dk2 and d gc
(they collect the row sums, which the two kernels form from differently rounded bf16 products).
Cases cover E unrolled and as a loop (E > ``UNROLL_MAX_E``), E not a power of two, X from the
forward or formed in plain JAX, with and without erase, strong decay (g down to -20 per
token, which only the masking before exp keeps finite) and weak decay (where the chunk-end term
dlam exp(gc_C) of d gc is not negligible), one and two warpgroups. Lowering tests compile the
whole function for "cuda" (Mosaic GPU layout inference, wgmma / TMA operand checks, the SMEM
limit) and the Triton tail; nothing runs.

``heads=H`` (q, k, v, dO in the caller's (B, T, H, X) layout, dq, dk, dv returned in it) is
checked against the default layout on the same data (the same arithmetic, only the copies'
boxes and block index maps differ: rel RMS <= 1e-6), for CUDA lowering with no argument
transposed before the kernels, and for the shape checks' errors.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testkit.triadic import check_against_scan, make_grad_inputs, transposes_an_argument
from testkit import rel_rms
from triadic.pallas import backward, mosaic, mosaic_backward, recurrent
from triadic.pallas import ops as pops
from triadic.pallas.chunk_prep import chunk_prep
from triadic.pallas.common import Config, token_major
from triadic.pallas.ops import kernel_layout

SCALE = 0.125
CPU = Config("cpu", block_v=16, bwd_block_v=16)
NAMES = ("dq", "dk", "dv", "dk2", "dq2", "dgc", "dbeta")
BOUNDS = dict.fromkeys(NAMES, 1e-2) | {"dk2": 2e-2, "dgc": 2e-2}

pytestmark = pytest.mark.skipif(not mosaic.interpret_available(),
                                reason="Mosaic GPU interpret mode unavailable in this JAX")


def backward_operands(b, t, h, d, vdim, e, erase, decay, c=64, seed=0):
  """``chunk_gradients``'s operands as ``ops._backward`` passes them."""
  args, do, ds = make_grad_inputs(seed, b, t, h, d, vdim, e, decay=decay, dtype=jnp.bfloat16)
  return _operands(args, do, ds, c=c, erase=erase)


@functools.partial(jax.jit, static_argnames=("c", "erase"))
def _operands(args, do, ds, *, c, erase):
  """``backward_operands``' relayouts, prep and state passes as one program (run eagerly, each
  of their ops compiles on its own: seconds a call on the 2-core CI)."""
  b, t, h = args[0].shape[:3]
  nc = -(-t // c)
  merge = lambda x: x.reshape(b * h, *x.shape[2:])
  rows = lambda x: jnp.swapaxes(x, -1, -2)
  q, k, v = (merge(kernel_layout(x, nc, c)) for x in args[:3])
  k2, q2, g, beta = (merge(kernel_layout(x.astype(jnp.float32), nc, c)) for x in args[3:7])
  h0, dht = merge(args[7]), merge(ds)
  do = merge(kernel_layout(do, nc, c)).astype(q.dtype)
  gc_col, gc_row, a, p, _ = chunk_prep(q, k, k2, q2, g, beta, erase=erase, cfg=CPU)[:5]
  kw = dict(scale=SCALE, erase=erase, cfg=CPU)
  _, u, states, _ = recurrent.state_pass(q, k, v, k2, q2, gc_col, beta, a, p, h0, **kw)
  du, dstates, _ = recurrent.reverse_state_pass(q, k, do, k2, q2, gc_col, beta, a, p, dht, **kw)
  return (q, k, v, do, u, du, states, dstates, k2, rows(k2), q2, gc_col, gc_row, beta, a)


CASES = [
    # b, t, h, v, e, erase, decay, d, x from the forward (else ``x_from_states``), the tails run
    # (``fused_tail``, None: the default); C = 64, NC = 3
    # E = 1 takes the fused tail by default, and the split one on the same operands
    pytest.param(1, 150, 2, 32, 1, True, 1.0, 64, True, (None, False), id="E1-erase"),
    pytest.param(2, 150, 1, 64, 3, False, 1.0, 64, False, (None,), id="E3-noerase"),
    pytest.param(1, 150, 2, 32, 4, True, 0.02, 64, True, (None,), id="E4-erase-weak-decay"),
    pytest.param(1, 150, 2, 32, 5, True, 20.0, 64, True, (None,), id="E5-erase-strong-decay"),
    pytest.param(2, 150, 1, 32, 6, False, 10.0, 64, False, (None,), id="E6-noerase-strong-decay"),
    pytest.param(1, 150, 2, 32, 8, True, 0.02, 64, False, (None,), id="E8-erase-weak-decay-x-jax"),
    pytest.param(1, 150, 2, 64, 4, True, 1.0, 128, True, (None,), id="D128-E4"),
]


@pytest.mark.parametrize("b,t,h,vdim,e,erase,decay,d,saved_x,tails", CASES)
def test_matches_triton_structure(b, t, h, vdim, e, erase, decay, d, saved_x, tails):
  """The slice kernel (and, for ``saved_x``, X as the Mosaic forward saves it) against the
  Triton structure, followed by each of ``tails`` (one reference for them all)."""
  args = backward_operands(b, t, h, d, vdim, e, erase, decay)
  want = triton_structure(args, erase)
  x = ()
  if saved_x:
    q, k, v, _, _, _, _, _, k2, _, q2, gc, _, beta, a = args
    p = jnp.zeros_like(a)
    h0 = jnp.zeros((q.shape[0], e, d, vdim), jnp.float32)
    *_, x, states, _ = jax.jit(functools.partial(
        mosaic.state_pass, scale=SCALE, erase=True, save_x=True, interpret=True))(
            q, k, v, k2, q2, gc, beta, a, p, h0)
    assert x.dtype == q.dtype
    # The forward's states from h0 = 0 are the test's states (``backward_operands`` starts
    # from a random h0), so X is checked on its own against its definition.
    x_from_states = jax.jit(mosaic_backward.x_from_states)
    want_x = x_from_states(k, v, states, k2, gc)
    assert rel_rms(x, want_x) < 1e-2
    x = (x_from_states(k, v, args[6], k2, gc).astype(q.dtype),)
  for fused in tails:
    got = jax.jit(functools.partial(mosaic_backward.chunk_gradients, scale=SCALE, erase=erase,
                                    fused_tail=fused, interpret=True))(*args, *x)
    check_outputs(got, want, BOUNDS)


def test_unrolled_items_match_loop():
  """The slice kernel's items unrolled (``slice_unroll_max_e`` >= E) and as a loop per piece
  (below E: the default at E = 3) compute the same sums in the same order; and the loop with the
  default (split) tail reading its dq, dk partials in bf16 (``Config.partials_in_bf16``) against
  the Triton structure."""
  args = backward_operands(1, 150, 2, 64, 32, 3, True, 1.0)
  run = lambda unroll: jax.jit(functools.partial(
      mosaic_backward.chunk_gradients, scale=SCALE, erase=True, slice_unroll_max_e=unroll,
      partials_in_bf16=True, interpret=True))(*args)
  loop = run(0)
  for got, want, name in zip(loop, run(3), NAMES):
    assert rel_rms(got, want) < 1e-6, name
  check_outputs(loop, triton_structure(args, True), BOUNDS)


@pytest.mark.parametrize("e,erase,decay,fused,bf16_partials,grads_kernel", [
    # (E = 1 with the split tail: ``test_matches_triton_structure[E1-erase]``)
    (2, False, 20.0, None, False, False),  # the default (fused) without erase
    (4, True, 20.0, True, False, False),   # E = 4 takes the split tail by default: fused here
    (3, True, 20.0, False, False, False),  # the split tail at an E that is no power of two
    (1, True, 20.0, None, True, False),    # the slice kernel's dq, dk partials in bf16: fused
    # (and split: ``test_unrolled_items_match_loop``)
    (3, True, 20.0, False, True, True),    # the split tail's mask gradients by their kernel
    (4, False, 0.02, False, True, True),   # ... without erase, weak decay
])
def test_tail_variants_match_triton_structure(e, erase, decay, fused, bf16_partials,
                                              grads_kernel):
  """Both tails (``fused_tail_kernel``; masks in JAX around ``tail_kernel``, the mask gradients
  in plain JAX or by ``masks.mask_grads_kernel``), D = 64, V = 32, reading the slice kernel's
  dq, dk partials in float32 or bf16 (``Config.partials_in_bf16``)."""
  args = backward_operands(1, 150, 2, 64, 32, e, erase, decay)
  want = triton_structure(args, erase)
  got = jax.jit(functools.partial(mosaic_backward.chunk_gradients, scale=SCALE, erase=erase,
                                  fused_tail=fused, partials_in_bf16=bf16_partials,
                                  mask_grads_kernel=grads_kernel, interpret=True))(*args)
  check_outputs(got, want, BOUNDS)


def triton_structure(args, erase):
  """The reference: ``backward.chunk_gradients`` (Pallas interpret mode) under jit."""
  return jax.jit(functools.partial(backward.chunk_gradients, scale=SCALE, erase=erase,
                                   cfg=CPU))(*args)


def check_outputs(got, want, bounds):
  """Shapes, dtypes, finiteness and relative RMS of every output against ``bounds``. The Hopper
  path writes dq, dk and dv in the (bf16) inputs' dtype, the Triton structure float32."""
  errs = {}
  for name, x, y in zip(NAMES, got, want, strict=True):
    dtype = jnp.bfloat16 if name in ("dq", "dk", "dv") else y.dtype
    assert x.shape == y.shape and x.dtype == dtype, name
    assert np.all(np.isfinite(np.asarray(x))), name
    errs[name] = rel_rms(x, y)
  bad = {k: f"{v:.2e}" for k, v in errs.items() if not v < bounds[k]}
  assert not bad, f"rel RMS over bound: {bad} (all: {errs})"


def _abstract_operands(d, vdim, e, bh=2, nc=4, c=64):
  """Shapes and dtypes of ``chunk_gradients``'s operands, for the lowering tests."""
  bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  return (bf(bh, nc, c, d), bf(bh, nc, c, d), bf(bh, nc, c, vdim), bf(bh, nc, c, vdim),
          f32(bh, nc, c, vdim), f32(bh, nc, c, vdim), bf(bh, nc, e, d, vdim),
          bf(bh, nc, e, d, vdim), f32(bh, nc, c, e), f32(bh, nc, e, c), f32(bh, nc, c, e),
          f32(bh, nc, c, e), f32(bh, nc, e, c), f32(bh, nc, c, 1), f32(bh, nc, c, c))


def test_slice_kernel_two_warpgroups_match_one(e=5, erase=True):
  """The slice kernel with two warpgroups (each its own piece, stream and slots) gives what one
  gives: dq, dk the same products, the row sums and dlam summed over the warpgroups' partials.
  (The kernel alone under jit: inside a larger jitted function the interpreter's two simulated
  threads can wait on each other forever on a 2-core machine.) Two chunks, the last one partial,
  of B * H = 2 rows: both grid dims (B * H, NC) past one, and no more programs than that (the
  interpreter runs the two warpgroups' kernel body once a program)."""
  q, k, v, do, u, du, st, dst, k2, _, q2, gc, _, beta, a = backward_operands(
      1, 100, 2, 128, 32, e, erase, 1.0)
  low = lambda y: y.astype(jnp.bfloat16)
  ops_in = (q, k, low(beta * mosaic_backward.rhs_gradient(a, du, erase)), do, low(u), st, dst,
            mosaic_backward.factor_rows(gc, k2, q2, beta))
  run = lambda wgs: jax.jit(functools.partial(mosaic_backward.slices_pass, scale=SCALE,
                                              erase=erase, warpgroups=wgs, interpret=True))(*ops_in)
  for got, want in zip(run(2), run(1), strict=True):
    assert got.shape == want.shape
    assert rel_rms(got, want) < 1e-6


@pytest.mark.parametrize("d,vdim,e,erase,wgs,bf16_partials", [
    (128, 128, 8, True, 1, False),
    (128, 128, 8, True, 2, True),   # 214 KiB: the largest the slice kernel takes
    (128, 64, 4, False, 2, False),
    (128, 128, 1, True, 1, True),
    (64, 32, 3, False, 1, False),
    (128, 64, 2, True, 1, False),
])
def test_lowers_for_cuda(d, vdim, e, erase, wgs, bf16_partials):
  """The slice kernel (transpose_ref operands of the staged row pieces; one or two warpgroups;
  dq, dk partials stored in float32 or bf16) lowers for "cuda" within the SMEM limit, X given;
  nothing runs."""
  args = _abstract_operands(d, vdim, e) + (jax.ShapeDtypeStruct((2, 4, 64, vdim), jnp.bfloat16),)
  fn = jax.jit(functools.partial(mosaic_backward.chunk_gradients, scale=SCALE, erase=erase,
                                 slice_warpgroups=wgs, partials_in_bf16=bf16_partials))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_chunk_backward_slices" in text
  tail = "fused" if mosaic_backward.default_fused_tail(e) else "ut"
  assert f"triadic_chunk_backward_tail_{tail}" in text


def test_supported():
  sup = mosaic_backward.supported
  for d, vd, e in ((128, 128, 8), (128, 128, 1), (64, 64, 3), (64, 32, 8)):
    assert sup(d, vd, 64, e, jnp.bfloat16) is None, (d, vd, e)
  for wgs in (1, 2):
    smem = mosaic_backward.slice_kernel_smem(128, 128, 64, 8, True, wgs)
    assert smem <= mosaic_backward.SMEM_LIMIT, wgs
  assert "bfloat16" in sup(128, 128, 64, 8, jnp.float32)
  assert "E <=" in sup(128, 128, 64, 16, jnp.bfloat16)
  assert "V in" in sup(128, 256, 64, 1, jnp.bfloat16)
  assert "D in" in sup(32, 64, 64, 1, jnp.bfloat16)
  assert "chunk size" in sup(128, 128, 32, 1, jnp.bfloat16)
  assert [mosaic_backward.slice_warpgroups(r, d) for r, d in
          ((None, 128), (None, 64), (1, 128), (2, 64))] == [2, 1, 1, 1]
  with pytest.raises(ValueError, match="bfloat16"):
    x = jnp.zeros((1, 1, 64, 64), jnp.float32)
    mosaic_backward.chunk_gradients(x, x, x, x, x, x, jnp.zeros((1, 1, 1, 64, 64)),
                                   jnp.zeros((1, 1, 1, 64, 64)), *(jnp.zeros((1, 1, 64, 1)),) * 5,
                                   jnp.zeros((1, 1, 64, 1)), x, scale=1.0, erase=True)
  with pytest.raises(ValueError, match="drhs and dv .* come together and only with erase"):
    x = jnp.zeros((1, 1, 64, 64), jnp.bfloat16)
    mosaic_backward.chunk_gradients(x, x, x, x, x, x, jnp.zeros((1, 1, 1, 64, 64)),
                                   jnp.zeros((1, 1, 1, 64, 64)), *(jnp.zeros((1, 1, 64, 1)),) * 5,
                                   jnp.zeros((1, 1, 64, 1)), x, scale=1.0, erase=True, drhs=x)
  with pytest.raises(ValueError, match=r"m \(the mask M\) must be given exactly when mq"):
    x = jnp.zeros((1, 1, 64, 64), jnp.bfloat16)
    mosaic_backward.chunk_gradients(x, x, x, x, x, x, jnp.zeros((1, 1, 1, 64, 64)),
                                   jnp.zeros((1, 1, 1, 64, 64)), *(jnp.zeros((1, 1, 64, 1)),) * 5,
                                   jnp.zeros((1, 1, 64, 1)), x, scale=1.0, erase=True,
                                   mq=jnp.zeros((1, 1, 64, 64)))
  with pytest.raises(ValueError, match="slice_warpgroups"):
    Config("gpu", block_v=16, bwd_block_v=16, slice_warpgroups=3)
  with pytest.raises(ValueError, match="state_warpgroups"):
    Config("gpu", block_v=16, bwd_block_v=16, state_warpgroups=3)


def test_hopper_op_matches_scan():
  """The whole op with the Hopper kernels (the Mosaic state passes and the slice kernel, reading
  the X that the Mosaic forward saves: ``Plan.saves_x``, and at E = 4 the split tail reading the
  masks M, M' the forward kept: ``Plan.saves_masks``; interpret mode, inside ``triadic_pallas``'s
  custom_vjp) against the scan, bf16 bounds of ``test_triadic_pallas``; E = 3 padded to 4."""
  cfg = Config("cpu", block_v=16, bwd_block_v=16, mosaic_gpu=True, mosaic_gpu_backward=True)
  plan = pops.explain(64, 32, 3, 64, jnp.bfloat16, config=cfg)
  assert plan.mosaic_chunk_gradients and plan.saves_x(True) and not plan.saves_x(False)
  assert plan.saves_masks and "kept from the forward" in plan.chunk_gradients.tiles
  # The reverse pass writes A^T dU and dV for the chunk backward (erase only).
  assert plan.saves_drhs(True) and not plan.saves_drhs(False)
  assert "A^T dU and dV" in plan.backward_states.tiles
  no_drhs = dataclasses.replace(cfg, drhs_in_reverse_pass=False)
  assert not pops.explain(64, 32, 3, 64, jnp.bfloat16, config=no_drhs).saves_drhs(True)
  # The masks are kept only for the split tail, and only where the prep formed them in plain JAX.
  for e, changes in ((2, {}), (3, {"save_masks": False}), (3, {"masks_in_prep": True})):
    other = pops.explain(64, 32, e, 64, jnp.bfloat16, config=dataclasses.replace(cfg, **changes))
    assert not other.saves_masks, (e, changes)
  fn = pops.chunk_gradients_kernel(cfg, *(jnp.zeros((1, 1, 64, n), dt) for n, dt in (
      (64, jnp.bfloat16), (32, jnp.bfloat16), (4, jnp.float32))))
  assert fn.func is mosaic_backward.chunk_gradients and fn.keywords["slice_warpgroups"] == 1
  assert fn.keywords["partials_in_bf16"]                  # the default: Config.partials_in_bf16
  # Without the Mosaic forward nothing saves X (the backward forms it).
  alone = dataclasses.replace(cfg, mosaic_gpu=False)
  assert not pops.explain(64, 32, 3, 64, jnp.bfloat16, config=alone).saves_x(True)
  off = dataclasses.replace(cfg, mosaic_gpu_backward=False)
  assert "off" in pops.explain(64, 32, 3, 64, jnp.bfloat16, config=off).chunk_gradients.reason
  two = dataclasses.replace(cfg, slice_warpgroups=2)
  at_128 = pops.explain(128, 32, 3, 64, jnp.bfloat16, config=two).chunk_gradients
  assert "2 warpgroup(s)" in at_128.tiles
  at_64 = pops.explain(64, 32, 3, 64, jnp.bfloat16, config=two).chunk_gradients
  assert "1 warpgroup(s)" in at_64.tiles and "D = 128" in at_64.reason
  check_against_scan(1, 150, 2, 64, 32, 3, 64, True, 1.0, jnp.bfloat16, config=cfg)


@pytest.mark.parametrize("d,e,state_wgs,fwd_wgs,rev_wgs", [
    (64, 4, None, 1, 1),      # D = 64: one warpgroup
    (128, 8, None, 1, 2),     # the default at E = 8: block_v 16, two warpgroups in reverse only
    (128, 8, 2, 2, 2),        # Config.state_warpgroups=2: both passes, block_v 32
])
def test_hopper_op_lowers_for_cuda(d, e, state_wgs, fwd_wgs, rev_wgs):
  """The whole op, forward and backward, with the Hopper defaults (the state passes' warpgroups
  per pass by ``mosaic.default_state_tiles``, or both set by ``Config.state_warpgroups``), lowers
  for CUDA (bf16, C = 64) with the kernels the plan names."""
  b, t, h, vdim = 1, 200, 2, 64
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  args = [spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, vdim), spec(b, t, h, e),
          spec(b, t, h, e), spec(b, t, h, e), spec(b, t, h), spec(b, h, e, d, vdim, dt=jnp.float32)]
  cfg = dataclasses.replace(pops.default_config("gpu", e, vdim), mosaic_gpu=True,
                            mosaic_gpu_backward=True, state_warpgroups=state_wgs)
  plan = pops.explain(d, vdim, e, 64, jnp.bfloat16, config=cfg)
  assert f"{fwd_wgs} warpgroup(s)" in plan.forward.tiles
  assert f"{rev_wgs} warpgroup(s)" in plan.backward_states.tiles
  if state_wgs == 2:   # refused at D = 64, with the reason
    narrow = pops.explain(64, vdim, e, 64, jnp.bfloat16, config=cfg).backward_states
    assert "1 warpgroup(s)" in narrow.tiles and "D = 128" in narrow.reason

  def loss(*a):
    o, s = pops.triadic_pallas(*a[:7], scale=d ** -0.5, initial_state=a[7], erase=True,
                               chunk_size=64, config=cfg)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  text = jax.jit(jax.grad(loss, argnums=tuple(range(8)))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  # Not differentiated: the partitioned forward without X.
  assert "triadic_forward_mgpu" in jax.jit(loss).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  wg2 = lambda wgs: "_wg2" if wgs == 2 else ""
  tail = "fused" if mosaic_backward.default_fused_tail(e) else "ut"
  for kernel in ("triadic_chunk_prep", "triadic_forward_mgpu" + wg2(fwd_wgs),
                 "triadic_backward_states_mgpu" + wg2(rev_wgs), "triadic_chunk_backward_slices",
                 f"triadic_chunk_backward_tail_{tail}"):
    assert kernel in text, kernel


# ------------------------------------------------------------------------------------------------
# heads=H: the per-token operands in the caller's (B, T, H, X) layout.


@pytest.mark.parametrize("fused,erase,saved_x", [
    (True, True, True),
    (False, True, False),     # X formed from the token-major k, v (``x_from_states``)
    (False, False, False),    # x = V, relayouted (``head_major``)
])
def test_heads_layout_matches_default(fused, erase, saved_x):
  """``chunk_gradients(heads=H)`` on token-major q, k, v, dO gives the default layout's outputs
  (dq, dk, dv token-major, the rest as they are) to rel RMS 1e-6: both tails, with and without
  erase, X given and formed. B = H = 2 (b = i // H, h = i % H), two chunks, D = 64 (one
  warpgroup); the tails' block index maps do not depend on erase, so three cases cover them."""
  b, t, h, d, vdim, e = 2, 128, 2, 64, 32, 2
  args = backward_operands(b, t, h, d, vdim, e, erase, 1.0)
  x = ()
  if saved_x:   # as the Mosaic forward saves it: (BH, NC, C, V) bf16 with heads too
    q, k, v, _, _, _, states, _, k2, _, _, gc = args[:12]
    x = (jax.jit(mosaic_backward.x_from_states)(k, v, states, k2, gc).astype(q.dtype),)
  kw = dict(scale=SCALE, erase=erase, fused_tail=fused, interpret=True)
  want = jax.jit(functools.partial(mosaic_backward.chunk_gradients, **kw))(*args, *x)
  tok = [token_major(y, b, h) for y in args[:4]]
  got = jax.jit(functools.partial(mosaic_backward.chunk_gradients, heads=h, **kw))(
      *tok, *args[4:], *x)
  want = [token_major(y, b, h) for y in want[:3]] + list(want[3:])
  for name, g, w in zip(NAMES, got, want, strict=True):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    assert rel_rms(g, w) <= 1e-6, name


@pytest.mark.parametrize("e,wgs,fused,erase,saved_x", [
    (1, 1, True, True, True),
    (1, 2, False, True, True),
    (8, 1, False, True, True),
    (8, 2, True, True, True),
    (8, 2, False, False, False),
])
def test_heads_layout_lowers_for_cuda(e, wgs, fused, erase, saved_x):
  """With ``heads`` the slice kernel (strided TMA boxes of q, k in 64-column pieces and of dO)
  and the tail kernels (q, k, dO read and dq, dk written through block index maps with a
  squeezed head dim) lower for "cuda" at D = V = 128; dq, dk, dv come back (B, T, H, X) and no
  (B, T, H, X) argument is transposed before the kernels (without erase V is relayouted for the
  tail's X by a reshape first: ``head_major``, by design)."""
  b, h, nc, c, d, vdim = 2, 2, 4, 64, 128, 128
  bh, t = b * h, nc * c
  bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  args = (bf(b, t, h, d), bf(b, t, h, d), bf(b, t, h, vdim), bf(b, t, h, vdim),
          *_abstract_operands(d, vdim, e, bh=bh, nc=nc)[4:])
  x = (bf(bh, nc, c, vdim),) if saved_x else ()
  fn = jax.jit(functools.partial(mosaic_backward.chunk_gradients, scale=SCALE, erase=erase,
                                 slice_warpgroups=wgs, fused_tail=fused, heads=h))
  traced = fn.trace(*args, *x)
  assert [o.shape for o in traced.out_info[:3]] == [(b, t, h, d), (b, t, h, d), (b, t, h, vdim)]
  assert traced.out_info[0].dtype == jnp.bfloat16 and traced.out_info[2].dtype == jnp.bfloat16
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "triadic_chunk_backward_slices" in text
  assert f"triadic_chunk_backward_tail_{'fused' if fused else 'ut'}" in text
  assert not transposes_an_argument(text, (b, t, h))


def test_heads_layout_rejects():
  """With ``heads`` T must be whole chunks, named by the argument (``common.check_heads``), in
  ``chunk_gradients`` and in the kernels' own entry points."""
  z = lambda *s, dt=jnp.bfloat16: jnp.zeros(s, dt)
  ok, bad = z(1, 128, 2, 64), z(1, 150, 2, 64)
  per_chunk = lambda *s: z(2, 2, *s, dt=jnp.float32)
  rest = (per_chunk(64, 64), per_chunk(64, 64), z(2, 2, 1, 64, 64), z(2, 2, 1, 64, 64),
          per_chunk(64, 1), per_chunk(1, 64), per_chunk(64, 1), per_chunk(64, 1),
          per_chunk(1, 64), per_chunk(64, 1), per_chunk(64, 64))
  kw = dict(scale=1.0, erase=True, heads=2)
  with pytest.raises(ValueError, match="q: T = 150 must be a multiple of the chunk size C = 64"):
    mosaic_backward.chunk_gradients(bad, ok, ok, ok, *rest, **kw)
  with pytest.raises(ValueError, match="do: T = 150"):
    mosaic_backward.chunk_gradients(ok, ok, ok, bad, *rest, **kw)
  f = per_chunk(4, 64)
  with pytest.raises(ValueError, match="k: T = 150"):
    mosaic_backward.slices_pass(ok, bad, per_chunk(64, 64), ok, per_chunk(64, 64), rest[2],
                                rest[3], f, **kw)
  tail_args = (ok, ok, per_chunk(64, 64), bad, *(per_chunk(64, 64),) * 5)
  with pytest.raises(ValueError, match="do: T = 150"):
    mosaic_backward.tail_kernel(*tail_args, per_chunk(64, 64), per_chunk(64, 64),
                                per_chunk(64, 1), per_chunk(64, 64), cfg=CPU, **kw)
