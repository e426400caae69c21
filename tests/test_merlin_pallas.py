"""multistate_attention(impl="pallas"): the kernels (interpret mode on the CPU) against the scan.

Every case checks the output and the gradients of all six inputs (q, k, v, g, beta, lam) through
loss = sum(o * do) with a random do, with lam drawn from one of the four aggregators or random
with NaN in the entries of segments not yet started (which must be ignored). T = 150 is not a
multiple of the chunk and crosses several segments; D, V of 24 are padded to 32 inside; T = 420
runs 14 segments, so the chunk gradients sum up to 14 stored states a chunk, over 4 value blocks;
T = 300 in segments of four chunks ends in a partial one (19 chunks), so the erase span form's
maps and sums run over several chunks a span, and over a short last span.
Error bounds (relative RMS, ||a - b|| / ||b||):
  float32: 1e-5 for the output and every gradient (float32 matmuls in the kernels).
  bfloat16 inputs (the scan runs on the same bf16-rounded values in float32): output 1.5e-2 (o is
  returned in bf16), gradients 2e-2 (bf16 tensor-core operands, chunk-start states kept in bf16).
The erase forward's query walk (``Config.query_walk``, taken only where no gradient is) is checked
against the scan with the same output bounds and against the span forward (float32 1e-5, bf16
the output bound), over five or more segments with a last partial one (and over one segment
alone), every aggregator's lam, weak and strong decay and weak decay with four tokens at -30
(strong decay everywhere leaves the finished states nothing to add); under ``jax.grad`` the op
keeps the span forward, with gradients identical to the bit to those without the walk.
The intra-chunk part's forward kernel (``Config.intra_kernel``; tests/test_merlin_intra.py checks
it and the part's pullback alone) is checked against the scan with the same output bounds and
against the plain-JAX part's output (float32 1e-5, bf16 the output bound), and under ``jax.grad``
(where it also writes A, and the part's backward kernel, ``Config.intra_backward_kernel``, runs
too) with the gradient bounds: both erase modes, float32 and bf16, padded D or V, strong decay.
The plan (which impl "auto" picks, and why), the bad-input errors, the Triton lowering of the
forward and backward for CUDA (the intra-chunk kernel in both), what each kernel
stores (dtypes; the readout the op's output itself, in the caller's layout) and the
per-(B, H)-shard run under jit (a subprocess with 4 fake CPU devices: gradients with and without
``intra_kernel``, and the forward alone by the intra-chunk kernel and, erase, the query walk) are
checked too.
"""

from __future__ import annotations

import dataclasses
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import merlin
from merlin import multistate_attention
from merlin.pallas import plan as plan_lib
from testkit import rel_rms
from triadic.pallas.common import Config
from testkit.devices import run_on_four_devices

jax.config.update("jax_default_matmul_precision", "highest")

NAMES = ("q", "k", "v", "g", "beta", "lam")
BOUNDS = {jnp.float32: (1e-5, 1e-5), jnp.bfloat16: (1.5e-2, 2e-2)}
# The state kernels of the forward (first) and the backward
FORWARD_KERNELS = {True: ("merlin_span_maps", "merlin_state_pass", "merlin_readout"),
                   False: ("merlin_write_pass", "merlin_readout")}
KERNELS = {True: (*FORWARD_KERNELS[True], "merlin_reverse_state_pass", "merlin_finished_reads",
                  "merlin_chunk_gradients", "merlin_span_sums"),
           False: (*FORWARD_KERNELS[False], "merlin_reverse_write_pass", "merlin_read_gradients")}


def make_lam(kind, key, b, t, h, n, segment_len):
  """lam (B, T, H, N) from an aggregator kind, or "random" with NaN for segments not started."""
  ks = jax.random.split(key, 4)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  qr, kr = (unit(jax.random.normal(kk, (b, t, h, 8))) for kk in ks[:2])
  kw = dict(segment_len=segment_len, max_segments=n)
  if kind == "vanilla":
    return merlin.vanilla_weights(b, t, h, n)
  if kind == "position":
    return merlin.position_weights(jax.random.normal(ks[2], (b, t, h, n)), segment_len=segment_len)
  if kind == "meanpool":
    return merlin.meanpool_weights(qr, kr, jnp.full((h,), 3.0), **kw)
  if kind == "merlin":
    gamma = jax.nn.sigmoid(jax.random.normal(ks[3], (b, t, h)))
    return merlin.merlin_weights(qr, kr, gamma, jnp.full((h,), 3.0), jnp.full((h,), 8.0), **kw)
  lam = jax.random.uniform(ks[2], (b, t, h, n), minval=0.1, maxval=2.0)
  future = np.arange(n)[None, :] > (np.arange(t) // segment_len)[:, None]
  return jnp.where(future[None, :, None, :], jnp.nan, lam)


def make_inputs(seed, b, t, h, d, vd, n, segment_len, decay, lam_kind, dtype):
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t, h, d))).astype(dtype)
  k = unit(jax.random.normal(ks[1], (b, t, h, d))).astype(dtype)
  v = jax.random.normal(ks[2], (b, t, h, vd)).astype(dtype)
  if decay == "strong":  # down to -30 per token, with some tokens near 0
    g = -30.0 * jax.random.uniform(ks[3], (b, t, h)) ** 3
  else:
    g = -0.1 * jax.random.uniform(ks[3], (b, t, h))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
  lam = make_lam(lam_kind, ks[5], b, t, h, n, segment_len)
  do = jax.random.normal(ks[6], (b, t, h, vd))
  return (q, k, v, g, beta, lam), do


def compiled_grads(impl, args, do, **kw):
  """The gradients of loss = sum(o * do) in the six inputs and o, compiled for ``args``."""
  def loss(*a):
    o = multistate_attention(*a, impl=impl, **kw)
    return jnp.sum(o.astype(jnp.float32) * do), o
  return jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True)).lower(*args).compile()


def grads(impl, args, do, **kw):
  return compiled_grads(impl, args, do, **kw)(*args)


CASES = [
    # b, t, h, d, v, segment_len, chunk, erase, decay, lam, dtype
    pytest.param(2, 150, 2, 16, 32, 32, 16, True, "weak", "random", jnp.float32, id="erase-random"),
    pytest.param(1, 150, 2, 24, 24, 32, 16, True, "strong", "merlin", jnp.float32,
                 id="erase-strong-merlin-D24"),
    pytest.param(1, 150, 2, 16, 32, 64, 16, False, "weak", "meanpool", jnp.float32,
                 id="noerase-meanpool-L64"),
    pytest.param(1, 150, 2, 32, 16, 32, 16, False, "strong", "position", jnp.float32,
                 id="noerase-strong-position"),
    pytest.param(1, 150, 2, 32, 32, 64, 32, True, "weak", "vanilla", jnp.bfloat16,
                 id="erase-bf16-vanilla-C32"),
    pytest.param(1, 150, 2, 16, 32, 32, 16, False, "weak", "random", jnp.bfloat16,
                 id="noerase-bf16-random"),
    pytest.param(1, 420, 2, 32, 64, 32, 16, True, "strong", "merlin", jnp.bfloat16,
                 id="erase-bf16-strong-merlin-V64"),
    pytest.param(1, 300, 2, 16, 32, 64, 16, True, "weak", "random", jnp.float32,
                 id="erase-four-chunk-spans"),
]


def check_against_scan(b, t, h, d, vd, segment_len, chunk, erase, decay, lam_kind, dtype,
                       **config):
  """The output and the six gradients of the pallas op (``config``: its Config, else the
  platform's default) against the scan's, within ``BOUNDS``."""
  n = -(-t // segment_len) + 1  # one more state than the tokens need
  args, do = make_inputs(0, b, t, h, d, vd, n, segment_len, decay, lam_kind, dtype)
  kw = dict(segment_len=segment_len, erase=erase, chunk_size=chunk)
  got, o = grads("pallas", args, do, **config, **kw)
  ref_args = tuple(x.astype(jnp.float32) for x in args)
  want, o_ref = grads("scan", ref_args, do, **kw)
  out_bound, grad_bound = BOUNDS[dtype]
  assert o.dtype == dtype and o.shape == (b, t, h, vd)
  assert rel_rms(o, o_ref) < out_bound, rel_rms(o, o_ref)
  visible = np.arange(n)[None, :] <= (np.arange(t) // segment_len)[:, None]
  for name, x, gx, gw in zip(NAMES, args, got, want):
    assert gx.shape == x.shape and gx.dtype == x.dtype, name
    gx, gw = np.asarray(gx, np.float32), np.asarray(gw, np.float32)
    if name == "lam":  # ignored entries get a zero gradient (NaN inputs there included)
      gx, gw = np.moveaxis(gx, 2, 1), np.moveaxis(gw, 2, 1)  # (B, H, T, N)
      assert np.all(gx[:, :, ~visible] == 0), name
      gx, gw = gx[:, :, visible], gw[:, :, visible]
    assert np.all(np.isfinite(gx)), name
    assert np.linalg.norm(gw) > 0, name
    assert rel_rms(gx, gw) < grad_bound, f"d{name}: rel RMS {rel_rms(gx, gw):.2e}"


@pytest.mark.parametrize("b,t,h,d,vd,segment_len,chunk,erase,decay,lam_kind,dtype", CASES)
def test_pallas_matches_scan(b, t, h, d, vd, segment_len, chunk, erase, decay, lam_kind, dtype):
  check_against_scan(b, t, h, d, vd, segment_len, chunk, erase, decay, lam_kind, dtype)


@pytest.mark.parametrize("erase", [True, False])
@pytest.mark.parametrize("bwd_block_v", [32, 64])
def test_forward_and_backward_tiles_differ(erase, bwd_block_v):
  """The GPU default gives the forward state pass and the backward's kernels different value
  blocks (``plan.default_config``: 32 columns forward, all of V = 128 backward): each kernel
  blocks the full-width stacks its own way, so 16-column forward blocks with 32-column backward
  blocks, or one backward block of all 64 columns, give the scan's output and gradients."""
  b, t, h, d, vd, segment_len, chunk = 1, 150, 2, 16, 64, 32, 16
  n = -(-t // segment_len)
  args, do = make_inputs(1, b, t, h, d, vd, n, segment_len, "strong", "merlin", jnp.float32)
  kw = dict(segment_len=segment_len, erase=erase, chunk_size=chunk)
  config = Config("cpu", block_v=16, bwd_block_v=bwd_block_v, num_warps=4, bwd_num_warps=8)
  got, o = grads("pallas", args, do, config=config, **kw)
  want, o_ref = grads("scan", args, do, **kw)
  out_bound, grad_bound = BOUNDS[jnp.float32]
  assert rel_rms(o, o_ref) < out_bound, rel_rms(o, o_ref)
  for name, gx, gw in zip(NAMES, got, want):
    assert rel_rms(gx, gw) < grad_bound, f"d{name}: rel RMS {rel_rms(gx, gw):.2e}"


@pytest.mark.parametrize("erase", [True, False])
@pytest.mark.parametrize("t,read_chunks,reverse_states", [
    (280, 2, 2),  # 18 chunks in spans of 4: the last span has 2; 5 segments: the last group 1
    (320, 4, 3),  # 20 chunks, a group of 4 a span; 5 segments in groups of 3 and 2
    (300, 4, 4),  # 19 chunks: groups of 4 do not divide them, so one chunk a program
])
def test_program_groups(erase, t, read_chunks, reverse_states):
  """Programs over several chunks of a span (the readout, the chunk gradients:
  ``Config.read_chunks``) and over several segments' states (the state passes:
  ``Config.reverse_states``, ``forward_states``), short last groups included, give the scan's
  output and gradients."""
  config = Config("cpu", block_v=16, bwd_block_v=16, read_chunks=read_chunks,
                  reverse_states=reverse_states, forward_states=reverse_states)
  check_against_scan(1, t, 2, 16, 32, 64, 16, erase, "weak", "random", jnp.float32,
                     config=config)


WALK_CASES = [
    # b, t, h, d, v, segment_len, chunk, decay, lam, dtype: NC = ceil(T / C) chunks, NS segments
    pytest.param(2, 150, 2, 16, 32, 32, 16, "weak", "random", jnp.float32,
                 id="random-NS5"),
    pytest.param(1, 300, 2, 24, 24, 64, 16, "strong", "merlin", jnp.float32,
                 id="strong-merlin-D24-NS5-partial"),  # 19 chunks: the last segment has 3 of 4
    pytest.param(1, 300, 2, 16, 16, 64, 16, "weak", "meanpool", jnp.float32,
                 id="meanpool-NS5-partial"),
    pytest.param(1, 300, 2, 32, 32, 64, 32, "weak", "vanilla", jnp.bfloat16,
                 id="bf16-vanilla-C32-NS5"),
    pytest.param(1, 420, 2, 32, 64, 32, 16, "weak", "merlin", jnp.bfloat16,
                 id="bf16-merlin-V64-NS14"),
    pytest.param(1, 300, 2, 16, 32, 32, 16, "mixed", "merlin", jnp.float32,
                 id="mixed-NS10"),
    pytest.param(1, 300, 2, 32, 32, 64, 16, "mixed", "position", jnp.bfloat16,
                 id="bf16-mixed-position-NS5-partial"),
    pytest.param(1, 20, 2, 16, 16, 32, 16, "weak", "random", jnp.float32,
                 id="one-segment"),
]


def option_config(field, on, **more):
  """The CPU test tiles with the Config option ``field`` (query_walk, intra_kernel) on or off,
  and the options ``more``."""
  return Config("cpu", block_v=16, bwd_block_v=16, **{field: on}, **more)


def check_forward_only(field, args, kw, dtype, kernels):
  """The op with ``field`` on, where no gradient is taken, against the scan within the output
  bound and against the op with it off (float32 1e-5; bf16 the output bound, the two rounding
  differently); the kernels traced are ``kernels``."""
  op = lambda on: jax.jit(lambda *a: multistate_attention(
      *a, impl="pallas", config=option_config(field, on), **kw))
  got, without = op(True)(*args), op(False)(*args)
  want = multistate_attention(*(x.astype(jnp.float32) for x in args), impl="scan", **kw)
  out_bound = BOUNDS[dtype][0]
  assert got.dtype == dtype and got.shape == args[2].shape
  assert rel_rms(got, want) < out_bound, rel_rms(got, want)
  bound = 1e-5 if dtype == jnp.float32 else out_bound
  assert rel_rms(got, without) < bound, rel_rms(got, without)
  found = kernel_outputs(jax.make_jaxpr(op(True))(*args).jaxpr)
  assert set(found) == set(kernels), set(found)


@pytest.mark.parametrize("b,t,h,d,vd,segment_len,chunk,decay,lam_kind,dtype", WALK_CASES)
def test_query_walk_matches_scan_and_span_form(b, t, h, d, vd, segment_len, chunk, decay,
                                                lam_kind, dtype):
  """The erase forward by the query walk (no gradient taken) against the scan, within the output
  bound, and against the span forward (float32 1e-5; bf16 the output bound, the two rounding
  differently); its kernels are the erase write pass, the span maps and the walk's readout, no
  state pass."""
  n = -(-t // segment_len) + 1
  args, _ = make_inputs(0, b, t, h, d, vd, n, segment_len, "weak" if decay == "mixed" else decay,
                        lam_kind, dtype)
  if decay == "mixed":  # weak, but -30 a token for four tokens of the second segment: the later
    # segments' finished states still reach the last chunks (strong decay everywhere erases them)
    args = (*args[:3], args[3].at[:, segment_len + 8:segment_len + 12].set(-30.0), *args[4:])
  kw = dict(segment_len=segment_len, erase=True, chunk_size=chunk)
  check_forward_only("query_walk", args, kw, dtype,
                     {"merlin_write_pass", "merlin_span_maps", "merlin_walk_readout"})


INTRA_CASES = [
    # b, t, h, d, v, segment_len, chunk, erase, decay, lam, dtype
    pytest.param(1, 150, 2, 24, 24, 32, 16, True, "strong", "merlin", jnp.float32,
                 id="erase-strong-merlin-D24"),
    pytest.param(1, 150, 2, 16, 40, 64, 32, False, "weak", "meanpool", jnp.float32,
                 id="noerase-meanpool-V40-C32"),
    pytest.param(1, 150, 2, 32, 32, 64, 32, True, "weak", "vanilla", jnp.bfloat16,
                 id="erase-bf16-vanilla-C32"),
    pytest.param(1, 150, 2, 16, 32, 32, 16, False, "strong", "random", jnp.bfloat16,
                 id="noerase-bf16-strong-random"),
]


@pytest.mark.parametrize("b,t,h,d,vd,segment_len,chunk,erase,decay,lam_kind,dtype", INTRA_CASES)
def test_intra_kernel_matches_scan_and_plain(b, t, h, d, vd, segment_len, chunk, erase, decay,
                                             lam_kind, dtype):
  """The output where no gradient is taken, with the intra-chunk part by its forward kernel,
  against the scan and against the plain-JAX part's output (``check_forward_only``); the kernel
  is traced, beside the state kernels."""
  n = -(-t // segment_len) + 1
  args, _ = make_inputs(0, b, t, h, d, vd, n, segment_len, decay, lam_kind, dtype)
  kw = dict(segment_len=segment_len, erase=erase, chunk_size=chunk)
  check_forward_only("intra_kernel", args, kw, dtype,
                     {"merlin_intra_forward", *FORWARD_KERNELS[erase]})


@pytest.mark.parametrize("b,t,h,d,vd,segment_len,chunk,erase,decay,lam_kind,dtype", INTRA_CASES)
def test_intra_kernel_gradients_match_scan(b, t, h, d, vd, segment_len, chunk, erase, decay,
                                           lam_kind, dtype):
  """Under ``jax.grad`` with ``Config.intra_kernel`` and ``Config.intra_backward_kernel`` the
  intra-chunk part runs by its two kernels, the forward kernel (erase: also writing A) and the
  backward kernel: the output and the six gradients against the scan's, within the bounds of
  ``test_pallas_matches_scan``."""
  check_against_scan(b, t, h, d, vd, segment_len, chunk, erase, decay, lam_kind, dtype,
                     config=option_config("intra_kernel", True, intra_backward_kernel=True))


def test_query_walk_leaves_the_gradients():
  """Under ``jax.jit(jax.grad)`` the op with the forward-only ``Config.query_walk`` runs what it
  runs without it (the custom VJP's forward rule, not its primal): the output and all six
  gradients are identical to the bit (padded D and V), and only the kernels of the op without
  the option are traced."""
  field, erase = "query_walk", True
  b, t, h, d, vd, segment_len, chunk = 1, 150, 2, 24, 40, 32, 16
  n = -(-t // segment_len) + 1
  args, do = make_inputs(3, b, t, h, d, vd, n, segment_len, "weak", "merlin", jnp.float32)
  kw = dict(segment_len=segment_len, erase=erase, chunk_size=chunk)
  (got, o), (want, o_ref) = (grads("pallas", args, do, config=option_config(field, on), **kw)
                             for on in (True, False))
  assert np.array_equal(np.asarray(o), np.asarray(o_ref))
  for name, gx, gw in zip(NAMES, got, want):
    assert np.array_equal(np.asarray(gx), np.asarray(gw), equal_nan=True), name

  def loss(*a):
    o = multistate_attention(*a, impl="pallas", config=option_config(field, True), **kw)
    return jnp.sum(o.astype(jnp.float32) * do)

  found = kernel_outputs(jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(6))))(*args).jaxpr)
  assert set(found) == set(KERNELS[erase]), set(found)


def test_plan():
  """"auto" picks the kernels on GPU only, and says why it does not elsewhere; "pallas" on a TPU
  runs the TPU structure (``merlin.pallas.tpu``)."""
  explain = plan_lib.explain
  gpu = explain(128, 256, platform="gpu")
  assert (gpu.impl, gpu.chunk_size, gpu.config.platform) == ("pallas", 64, "gpu")
  assert "pallas" in str(gpu) and "block_v" in str(gpu)
  cpu = explain(128, 256, platform="cpu")
  assert cpu.impl == "chunked" and "interpret" in cpu.reason
  tpu = explain(128, 256, platform="tpu")
  assert tpu.impl == "chunked" and "never timed" in tpu.reason
  tpu = explain(128, 256, platform="tpu", impl="pallas")
  assert tpu.impl == "pallas" and tpu.config.chunk_grid and "chunks on the grid" in str(tpu)
  docs = explain(128, 256, platform="gpu", documents=True)
  assert docs.impl == "chunked" and "segment_ids" in docs.reason
  small = explain(128, 24, platform="gpu")  # gcd(24, 64) = 8: no kernel chunk
  assert small.impl == "chunked" and "chunk_size" not in small.reason and "gcd" in small.reason
  assert explain(128, 256, impl="pallas", platform="cpu").config.interpret
  assert explain(128, 256, impl="scan").impl == "scan"
  # The GPU default reads by the query walk where no gradient is taken; the span form on request.
  span = plan_lib.resolve("pallas", d=128, segment_len=256, chunk_size=None, documents=False,
                          platform="gpu",
                          config=dataclasses.replace(gpu.config, query_walk=False))
  assert "query walk" in str(gpu) and "query walk" not in str(span)


def test_bad_input_raises():
  args, _ = make_inputs(1, 1, 40, 1, 16, 16, 2, 32, "weak", "random", jnp.float32)
  call = lambda **kw: multistate_attention(*args, **{"segment_len": 32, "impl": "pallas", **kw})
  with pytest.raises(ValueError, match="chunk_size must be one of"):
    call(chunk_size=8)
  with pytest.raises(ValueError, match="gcd"):
    call(segment_len=24, chunk_size=None)
  with pytest.raises(ValueError, match="segment_ids"):
    call(segment_ids=jnp.zeros((1, 40), jnp.int32))
  with pytest.raises(ValueError, match="q/k last dim D"):
    q = jnp.zeros((1, 40, 1, 512))
    multistate_attention(q, q, *args[2:], segment_len=32, impl="pallas")
  with pytest.raises(ValueError, match="query_walk, intra_kernel are Triton"):
    call(platform="tpu", config=dataclasses.replace(plan_lib.default_config("tpu"),
                                                    query_walk=True, intra_kernel=True))
  for name in plan_lib.GROUPS:
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
      Config("gpu", block_v=32, bwd_block_v=128, **{name: 0})
  with pytest.raises(ValueError, match="read_chunks group the Triton"):
    call(platform="tpu", config=dataclasses.replace(plan_lib.default_config("tpu"),
                                                    read_chunks=2))


def op_specs(b, t, h, d, vd, n, dtype=jnp.bfloat16):
  """Shape specs of the op's six inputs, q, k, v in ``dtype``."""
  spec = lambda *s, dt=dtype: jax.ShapeDtypeStruct(s, dt)
  f32 = jnp.float32
  return [spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, vd), spec(b, t, h, dt=f32),
          spec(b, t, h, dt=f32), spec(b, t, h, n, dt=f32)]


def pallas_op(erase, segment_len, platform="gpu", **kw):
  """The op on the platform's kernels (default the GPU's, Triton), to trace on this CPU
  machine."""
  return lambda *a: multistate_attention(*a, segment_len=segment_len, erase=erase, impl="pallas",
                                         platform=platform, **kw)


def grad_of_sum(fn):
  """The gradients of sum(fn(...)) in the op's six inputs."""
  return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=tuple(range(6)))


def kernel_outputs(jaxpr):
  """{name: [(shape, dtype) of each output]} of every pallas_call in a jaxpr, nested ones too."""
  found = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        found[eqn.params["name"]] = [(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr)
  return found


@pytest.mark.parametrize("erase", [True, False])
def test_kernels_lower_for_cuda(erase):
  """Forward and backward lower to Triton for CUDA on this CPU machine (bf16, padded D and V)."""
  b, t, h, d, vd, segment_len, n = 1, 300, 2, 48, 80, 128, 3
  text = jax.jit(grad_of_sum(pallas_op(erase, segment_len))).trace(
      *op_specs(b, t, h, d, vd, n)).lower(lowering_platforms=("cuda",)).as_text()
  for kernel in KERNELS[erase]:
    assert kernel in text, kernel


@pytest.mark.parametrize("erase,dtype", [(True, jnp.bfloat16), (False, jnp.bfloat16),
                                         (True, jnp.float32)])
def test_intra_kernel_lowers_for_cuda(erase, dtype):
  """The GPU default's forward, where no gradient is taken, runs the intra-chunk part by its
  kernel, which lowers to Triton for CUDA on this CPU machine beside the state kernels (padded D
  and V, T not a multiple of the chunk) and stores Qe, [W,] Kw, Uv in the inputs' dtype and
  gamma, intra float32 (B*H, NC, ...); the gradient's program runs it too, erase also writing A
  (float32, C x C a chunk), the pullback's residual, and the backward kernel, which writes dq,
  dk, dv in the inputs' dtype and dgc, dbeta float32 in the caller's (B, T, H, X) layout."""
  b, t, h, d, vd, segment_len, n = 1, 300, 2, 48, 80, 128, 3
  config = plan_lib.default_config("gpu")
  assert config.intra_kernel and config.intra_backward_kernel
  op = pallas_op(erase, segment_len, config=config)
  args = op_specs(b, t, h, d, vd, n, dtype)
  text = jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "merlin_intra_forward" in text
  found = kernel_outputs(jax.make_jaxpr(op)(*args).jaxpr)
  x, f = jnp.dtype(dtype), jnp.dtype(jnp.float32)
  chunks = lambda *s, dt=x: ((b * h, 5, *s), dt)  # 5 chunks of 64 tokens; D -> 64, V -> 128
  assert found["merlin_intra_forward"] == [chunks(64, 64)] * (2 + erase) + [
      chunks(64, 128), chunks(1, 1, dt=f), chunks(64, 128, dt=f)]
  grad_text = jax.jit(grad_of_sum(op)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "merlin_intra_forward" in grad_text
  found = kernel_outputs(jax.make_jaxpr(grad_of_sum(op))(*args).jaxpr)
  assert found["merlin_intra_forward"][-1] == (chunks(64, 64, dt=f) if erase
                                               else chunks(64, 128, dt=f))
  tokens = lambda width, dt=x: ((b, 320, h, width), dt)
  assert found["merlin_intra_backward"] == [tokens(64), tokens(64), tokens(128),
                                            tokens(1, dt=f), tokens(1, dt=f)]
  for kernel in KERNELS[erase]:
    assert kernel in grad_text, kernel


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_query_walk_lowers_for_cuda(dtype):
  """The query-walk forward lowers to Triton for CUDA on this CPU machine (padded D and V, a last
  partial segment), its kernels storing the current and end states, the walked queries and span
  maps and the output in the inputs' dtype, and no stack (the GPU default's intra-chunk kernel
  beside them)."""
  b, t, h, d, vd, segment_len, n = 1, 300, 2, 48, 80, 128, 3
  config = plan_lib.default_config("gpu")
  assert config.query_walk
  op = pallas_op(True, segment_len, config=config)
  args = op_specs(b, t, h, d, vd, n, dtype)
  text = jax.jit(op).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "merlin_walk_readout" in text and "merlin_state_pass" not in text
  found = kernel_outputs(jax.make_jaxpr(op)(*args).jaxpr)
  x = jnp.dtype(dtype)
  assert found.keys() == {"merlin_intra_forward", "merlin_write_pass", "merlin_span_maps",
                          "merlin_walk_readout"}
  assert found["merlin_write_pass"] == [((b * h, 5, 64, 128), x), ((b * h, 3, 64, 128), x)]
  assert found["merlin_span_maps"] == [((b * h, 5, 64, 64), x), ((b * h, 3, 64, 64), x)]
  assert found["merlin_walk_readout"] == [((b, 320, h, 128), x)]


# Each kernel's outputs: "x" in the inputs' dtype, "f" float32. The states, the op's output (the
# readout adds the intra-chunk part and rounds once) and the gradients of the input-dtype operands
# (Qe, W, Kw, Uv) are stored in that dtype, each use of them being a matmul operand or the op's
# output or cotangent in that dtype, as are the span maps' Phi, P and U (matmul operands);
# dgamma, dlam, the erase finished reads' Y, the chunk gradients' own parts of dW, dKw (summed on
# by the span sums) and the no-erase per-value-block dKw (summed after) stay float32, as do the
# intra-chunk kernel's gamma, P Uv and (erase) A; its backward kernel stores dq, dk, dv in that
# dtype (the inputs' cotangents) and dgc, dbeta float32. (The backward's span maps, with Phi, are
# listed: the forward's are the same less Phi.)
OUT_DTYPES = {True: {"merlin_intra_forward": "xxxxfff", "merlin_span_maps": "xxx",
                     "merlin_state_pass": "xx", "merlin_readout": "x",
                     "merlin_reverse_state_pass": "xxx", "merlin_finished_reads": "ff",
                     "merlin_chunk_gradients": "xffff",
                     "merlin_span_sums": "xxf", "merlin_intra_backward": "xxxff"},
              False: {"merlin_intra_forward": "xxxff", "merlin_write_pass": "xx",
                      "merlin_readout": "x", "merlin_reverse_write_pass": "xff",
                      "merlin_read_gradients": "xf", "merlin_intra_backward": "xxxff"}}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("erase", [True, False])
def test_kernel_output_dtypes(erase, dtype):
  """The dtypes the kernels of the forward and backward (traced for GPU) store."""
  b, t, h, d, vd, segment_len, n = 1, 100, 1, 16, 32, 32, 4
  jaxpr = jax.make_jaxpr(grad_of_sum(pallas_op(erase, segment_len)))(
      *op_specs(b, t, h, d, vd, n, dtype)).jaxpr
  found = {name: [dt for _, dt in outs] for name, outs in kernel_outputs(jaxpr).items()}
  want = {name: [jnp.dtype(dtype if k == "x" else jnp.float32) for k in kinds]
          for name, kinds in OUT_DTYPES[erase].items()}
  assert found == want


@pytest.mark.parametrize("erase", [True, False])
@pytest.mark.parametrize("t,vd", [(128, 32), (100, 24)])
def test_readout_writes_the_output(erase, t, vd):
  """The readout kernel stores the op's output itself, in the inputs' dtype and the caller's
  (B, T, H, V) layout (T padded to whole chunks, V to a power of two), not a float32
  (B*H, NC, C, V) stack read that plain JAX would add to, transpose and cast: the op returns that
  kernel output as it is, or one slice of it where T or V is padded."""
  b, h, d, segment_len, chunk, n = 2, 3, 16, 32, 16, 4
  tp, vp = -(-t // chunk) * chunk, max(16, 1 << (vd - 1).bit_length())
  args = op_specs(b, t, h, d, vd, n)
  op = pallas_op(erase, segment_len, chunk_size=chunk)
  jaxpr = jax.make_jaxpr(grad_of_sum(op))(*args).jaxpr
  assert kernel_outputs(jaxpr)["merlin_readout"] == [((b, tp, h, vp), jnp.dtype(jnp.bfloat16))]

  jaxpr = jax.make_jaxpr(op)(*args).jaxpr
  call = jaxpr.eqns[-1]  # the op's custom_vjp, with no step after it
  assert call.primitive.name == "custom_vjp_call" and jaxpr.outvars == call.outvars
  (inner,) = jax.extend.core.jaxprs_in_params(call.params)
  producer = {v: eqn for eqn in inner.eqns for v in eqn.outvars}
  step = producer[inner.outvars[0]]
  if (tp, vp) != (t, vd):
    assert step.primitive.name == "slice", step.primitive
    step = producer[step.invars[0]]
  # the forward kernels (custom-partitioned), whose first output is the readout's
  assert step.primitive.name == "custom_partitioning", step.primitive
  assert step.outvars[0].aval.shape == (b, tp, h, vp)


SHARDED_SCRIPT = textwrap.dedent("""
    import json, re, sys
    import jax, jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    jax.config.update("jax_default_matmul_precision", "highest")
    sys.path.insert(0, "tests")
    from test_merlin_pallas import NAMES, compiled_grads, grads, make_inputs
    from merlin import multistate_attention
    from testkit import rel_rms
    from triadic.pallas.common import Config

    b, t, h, d, vd, segment_len, n = 2, 70, 2, 16, 16, 32, 3
    args, do = make_inputs(0, b, t, h, d, vd, n, segment_len, "weak", "random", jnp.float32)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "tensor")))
    clean = lambda x: jnp.nan_to_num(x, nan=0.0)
    report = {}
    for erase in (True, False):
      kw = dict(segment_len=segment_len, chunk_size=16, erase=erase)
      ref, o_ref = grads("scan", args, do, **kw)
      for partitioner in ("shardy", "gspmd"):
        jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
        sharded = tuple(map(put, args))
        for intra_kernel in (False, True):
          f = compiled_grads("pallas", sharded, put(do), **kw,  # the values come from this HLO
                             config=Config("cpu", block_v=16, bwd_block_v=16,
                                           intra_kernel=intra_kernel,
                                           intra_backward_kernel=intra_kernel))
          got, o = f(*sharded)
          hlo = f.as_text()
          report[f"{partitioner} erase={erase}" + " intra kernel" * intra_kernel] = dict(
              errors={"o": rel_rms(o, o_ref), **{"d" + m: rel_rms(clean(x), clean(y))
                                                  for m, x, y in zip(NAMES, got, ref)}},
              # the kernels' (B, H, NC, C, X) operands: global (2, 2, 5, 16, .), per device
              # (1, 1, ..)
              local_kernel_shape=bool(re.search(r"\\[1,1,5,16,", hlo)),
              global_kernel_shape=bool(re.search(r"\\[2,2,5,16,", hlo)),
              all_gathers=len(re.findall(r"all-gather", hlo)))
        # the forward alone (no gradient) per shard too: the intra-chunk kernel and, erase, the
        # query walk
        fwd = jax.jit(lambda *a: multistate_attention(
            *a, impl="pallas", config=Config("cpu", block_v=16, bwd_block_v=16,
                                             query_walk=erase, intra_kernel=True),
            **kw)).lower(*sharded).compile()
        fwd_hlo = fwd.as_text()
        report[f"{partitioner} erase={erase} forward only"] = dict(
            errors={"o": rel_rms(fwd(*sharded), o_ref)},
            local_kernel_shape=bool(re.search(r"\\[1,1,5,16,", fwd_hlo)),
            global_kernel_shape=bool(re.search(r"\\[2,2,5,16,", fwd_hlo)),
            all_gathers=len(re.findall(r"all-gather", fwd_hlo)))
    print("RESULT", json.dumps(report))
""")


def test_pallas_runs_per_shard_under_jit():
  """Batch over "data" and heads over "tensor" on 4 fake CPU devices, under Shardy and GSPMD,
  both erase modes, gradients with and without the intra-chunk part's kernels (``intra_kernel``,
  ``intra_backward_kernel``) and the forward alone by the intra-chunk kernel (erase: and the
  query walk): values and gradients match the unsharded scan, and every device runs the kernels
  on its own (B/2, H/2) slice (no all-gather, no array of the global kernel layout)."""
  report = run_on_four_devices(SHARDED_SCRIPT, timeout=600)
  for partitioner, r in report.items():
    for name, err in r["errors"].items():
      assert err < 1e-5, (partitioner, name, err)
    assert r["local_kernel_shape"] and not r["global_kernel_shape"], partitioner
    assert r["all_gathers"] == 0, partitioner
