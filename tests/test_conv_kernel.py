"""The short convolution's Pallas kernels (layers/conv_kernel.py, interpret mode on the CPU)
against a float64 NumPy oracle and the XLA form (``causal_conv(impl="xla")``): forward, dx and
dkernel, float32 and bf16, T and C not multiples of the tiles, widths 2 and 4, packed documents
starting mid-tile and at tile boundaries; the impl decision; bad input; the CUDA lowering; the
per-shard partitioning on 4 fake CPU devices (subprocess)."""

from __future__ import annotations

import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers.blocks import ShortConv, causal_conv
from layers.conv_kernel import Tiles, causal_conv_pallas, choose_impl
from layers.gdn import gdn_inputs
from testkit import rel_rms
from testkit.devices import run_on_four_devices

# Small tiles, so that the test shapes have several T blocks (a ragged last one), several channel
# blocks (a ragged last one) and several backward programs (partial sums) per row.
TILES = Tiles(block_t=16, block_c=16, bwd_block_t=8, bwd_steps=2)
B, T, C = 2, 45, 37


def oracle(x, kernel, g, segment_ids=None):
  """(y, dx, dkernel) in float64 for the cotangent g: loops over the taps, documents kept apart."""
  x, kernel, g = (np.asarray(a, np.float64) for a in (x, kernel, g))
  width, t = kernel.shape[0], x.shape[1]
  ids = np.zeros(x.shape[:2], int) if segment_ids is None else np.asarray(segment_ids)
  y, dx, dk = np.zeros_like(x), np.zeros_like(x), np.zeros_like(kernel)
  for w in range(width):
    lag = width - 1 - w
    same = (ids[:, lag:] == ids[:, :t - lag])[..., None]     # token s + lag reads token s
    src, dst = x[:, :t - lag] * same, g[:, lag:] * same
    y[:, lag:] += kernel[w] * src
    dx[:, :t - lag] += kernel[w] * dst
    dk[w] = np.sum(src * g[:, lag:], axis=(0, 1))
  return y, dx, dk


def documents(kind):
  """(B, T) segment ids: None; or row 0 with starts mid-tile (5, 21), at tile boundaries (16, 32)
  and documents shorter than the width (16..20, 21, 32), row 1 one start at 40."""
  if kind is None:
    return None
  ids = np.zeros((B, T), np.int32)
  for start in (5, 16, 21, 22, 32):
    ids[0, start:] += 1
  ids[1, 40:] = 7
  return jnp.asarray(ids)


def inputs(dtype, width, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(B, T, C)), dtype)
  kernel = jnp.asarray(rng.normal(size=(width, C)) / np.sqrt(width), jnp.float32)
  g = jnp.asarray(rng.normal(size=(B, T, C)), dtype)
  return x, kernel, g


def value_and_grads(fn, x, kernel, g):
  """(y, dx, dkernel) of ``fn(x, kernel)`` for the cotangent g, as one jitted call."""
  def run(x, kernel, g):
    y, vjp = jax.vjp(fn, x, kernel)
    return (y, *vjp(g))
  return jax.jit(run)(x, kernel, g)


# Relative RMS bounds against the float64 oracle on the same (rounded) inputs: float32 rounding;
# in bf16 y and dx are rounded once to bf16 (2^-9 relative, RMS below it), dkernel is summed in
# float32 from exact products of bf16 values.
BOUNDS = {jnp.float32: (1e-6, 1e-6, 1e-6), jnp.bfloat16: (4e-3, 4e-3, 1e-5)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("docs", [None, "packed"])
def test_kernels_match_the_oracle(dtype, width, docs):
  x, kernel, g = inputs(dtype, width)
  ids = documents(docs)
  want = oracle(x, kernel, g, ids)
  got = value_and_grads(lambda a, k: causal_conv_pallas(a, k, ids, tiles=TILES), x, kernel, g)
  assert [a.dtype for a in got] == [x.dtype, x.dtype, kernel.dtype]
  for name, a, w, bound in zip(("y", "dx", "dkernel"), got, want, BOUNDS[dtype]):
    assert rel_rms(a, w) < bound, (name, rel_rms(a, w))
  # The XLA form computes in x's dtype (the kernel rounded to it): in bf16 the kernels are the
  # closer of the two to the exact function.
  ref = value_and_grads(lambda a, k: causal_conv(a, k, segment_ids=ids, impl="xla")[0], x, kernel,
                        g)
  for name, a, r, w in zip(("y", "dx", "dkernel"), got, ref, want):
    assert rel_rms(a, w) <= rel_rms(r, w) * 1.01 + 1e-7, (name, rel_rms(a, w), rel_rms(r, w))


def test_default_tiles_and_one_program():
  """The default tiles (every block shrunk to the array: one program per row) and a single
  token: the same function."""
  for t in (1, 45):
    x, kernel, g = (a[:, :t] if a.ndim == 3 else a for a in inputs(jnp.float32, 4, seed=1))
    want = oracle(x, kernel, g)
    got = value_and_grads(lambda a, k: causal_conv_pallas(a, k), x, kernel, g)
    for a, w in zip(got, want):
      assert rel_rms(a, w) < 1e-6


def test_causal_conv_impls_agree_through_the_layers():
  """``causal_conv(impl="pallas")`` over (B, T, H, D) channels, ``ShortConv(impl=...)`` (same
  parameters) and ``gdn_inputs(conv_impl=...)`` give the XLA form's values and gradients."""
  x, _, _ = inputs(jnp.float32, 4)
  x4 = x[..., :36].reshape(B, T, 3, 12)
  kernel = jax.random.normal(jax.random.key(0), (4, 3, 12))
  ids = documents("packed")
  f = lambda impl: lambda a, k: jnp.sum(jnp.sin(causal_conv(a, k, segment_ids=ids, impl=impl)[0]))
  got, want = (jax.jit(jax.value_and_grad(f(impl), (0, 1)))(x4, kernel)
               for impl in ("pallas", "xla"))
  assert abs(got[0] - want[0]) < 1e-5 * abs(want[0])
  for a, w in zip(got[1], want[1]):
    assert rel_rms(a, w) < 1e-6

  conv = {impl: ShortConv(4, names=("h", "d"), impl=impl) for impl in ("pallas", "xla")}
  params = conv["xla"].init(jax.random.key(1), x4)
  assert jax.tree.map(jnp.shape, conv["pallas"].init(jax.random.key(1), x4)) == \
      jax.tree.map(jnp.shape, params)
  ys = [jax.jit(conv[impl].apply)(params, x4, segment_ids=ids)[0] for impl in ("pallas", "xla")]
  assert rel_rms(*ys) < 1e-6

  class Inputs(nn.Module):
    impl: str

    @nn.compact
    def __call__(self, h):
      return gdn_inputs(h, 2, 8, expand_e=2, segment_ids=ids, conv_impl=self.impl)[0]

  h = jax.random.normal(jax.random.key(2), (B, T, 16))
  params = jax.jit(Inputs("xla").init)(jax.random.key(3), h)
  outs = [jax.jit(Inputs(impl).apply)(params, h) for impl in ("pallas", "xla")]
  for a, w in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
    assert rel_rms(a, w) < 1e-5


def test_choose_impl():
  """One decision with its reason: auto is XLA on the CPU and with a cache (decoding), the
  kernels on a GPU without one; a cache runs XLA whatever the request."""
  impl, reason = choose_impl("auto", cache=False, dtype=jnp.bfloat16)
  assert impl == "xla" and "cpu" in reason and "interpret" in reason
  impl, reason = choose_impl("auto", cache=True, dtype=jnp.bfloat16, platform="gpu")
  assert impl == "xla" and "cache" in reason
  assert choose_impl("auto", cache=False, dtype=jnp.bfloat16, platform="gpu")[0] == "pallas"
  assert choose_impl("pallas", cache=True, dtype=jnp.float32, platform="gpu")[0] == "xla"
  impl, reason = choose_impl("pallas", cache=False, dtype=jnp.float32)
  assert impl == "pallas" and "interpret" in reason
  assert choose_impl("xla", cache=False, dtype=jnp.float32, platform="gpu") == ("xla", "impl='xla'")
  impl, reason = choose_impl("auto", cache=False, dtype=jnp.int32, platform="gpu")
  assert impl == "xla" and "int32" in reason
  # causal_conv with a cache continues from it under every impl
  x, kernel, _ = inputs(jnp.float32, 4)
  cache = jnp.ones((B, 3, C))
  for impl in ("auto", "pallas"):
    y, new = causal_conv(x, kernel, cache, impl=impl)
    want, want_cache = causal_conv(x, kernel, cache, impl="xla")
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(new, want_cache)


def test_bad_input_names_the_argument():
  x, kernel, _ = inputs(jnp.float32, 4)
  with pytest.raises(ValueError, match="impl must be one of"):
    causal_conv(x, kernel, impl="cudnn")
  with pytest.raises(ValueError, match="impl must be one of"):
    ShortConv(4, names=("c",), impl="triton").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="impl='pallas'.*float64|float64"):
    choose_impl("pallas", cache=False, dtype=jnp.float64)
  with pytest.raises(ValueError, match="kernel must be"):
    causal_conv_pallas(x, kernel[:, :5])
  with pytest.raises(ValueError, match="x must be"):
    causal_conv_pallas(x[0], kernel)
  with pytest.raises(ValueError, match="segment_ids must be"):
    causal_conv_pallas(x, kernel, jnp.zeros((B, T + 1), jnp.int32))
  with pytest.raises(TypeError, match="segment_ids must be an integer"):
    causal_conv_pallas(x, kernel, jnp.zeros((B, T)))
  with pytest.raises(ValueError, match="block_t"):
    Tiles(block_t=24)
  with pytest.raises(ValueError, match="bwd_steps"):
    Tiles(bwd_steps=0)


@pytest.mark.parametrize("docs", [False, True])
def test_kernels_lower_for_cuda(docs):
  """Forward and backward lower to Triton kernels for CUDA on this CPU (the GDN layer's shape:
  bf16 x, 6144 channels, float32 kernel). This checks the Pallas -> Triton IR lowering; ptxas
  (benchmarks/triton_registers.py --conv) and running them need the triton package or a GPU."""
  spec = jax.ShapeDtypeStruct
  args = [spec((2, 300, 6144), jnp.bfloat16), spec((4, 6144), jnp.float32)]
  if docs:
    args.append(spec((2, 300), jnp.int32))

  def loss(x, k, *ids):
    y = causal_conv_pallas(x, k, *ids, platform="gpu")
    return jnp.sum(y.astype(jnp.float32) ** 2)

  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "causal_conv_forward" in text and "causal_conv_backward" in text


SHARDED_SCRIPT = textwrap.dedent("""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from layers.blocks import causal_conv
    from layers.conv_kernel import Tiles, causal_conv_pallas
    from testkit import rel_rms

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 24, 32)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(4, 32)), jnp.float32)
    ids = jnp.asarray(np.cumsum(rng.random((4, 24)) < 0.2, axis=1), jnp.int32)
    tiles = Tiles(block_t=8, block_c=8, bwd_block_t=8, bwd_steps=1)
    loss = lambda f: lambda a, w, s: jnp.sum(jnp.sin(f(a, w, s)))
    pallas = loss(lambda a, w, s: causal_conv_pallas(a, w, s, tiles=tiles))
    xla = loss(lambda a, w, s: causal_conv(a, w, segment_ids=s, impl="xla")[0])
    want = jax.value_and_grad(xla, (0, 1))(x, k, ids)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    specs = (P("data", None, "tensor"), P(None, "tensor"), P("data", None))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, k, ids), specs)]
    report = {}
    for partitioner in ("shardy", "gspmd"):
      jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
      f = jax.jit(jax.value_and_grad(pallas, (0, 1))).lower(*args).compile()
      hlo = f.as_text()
      value, (dx, dk) = f(*args)
      report[partitioner] = dict(
          errors=[abs(float(value - want[0])) / abs(float(want[0])), rel_rms(dx, want[1][0]),
                  rel_rms(dk, want[1][1])],
          all_gathers=len(re.findall(r"all-gather", hlo)),
          dx_sharded=str(dx.sharding.spec) == str(specs[0]))
    print("RESULT", json.dumps(report))
""")


def test_kernels_run_per_shard():
  """Batch over "data" and channels over "tensor" on 4 fake CPU devices, Shardy and GSPMD: the
  values and gradients of the unsharded XLA form, no all-gather (every device runs the kernels
  on its own (B/2, T, C/2) slice; dkernel's partial sums are reduced across the batch shards),
  dx sharded like x."""
  report = run_on_four_devices(SHARDED_SCRIPT, timeout=300)
  for partitioner, r in report.items():
    assert max(r["errors"]) < 1e-5, (partitioner, r)
    assert r["all_gathers"] == 0, (partitioner, r)
    assert r["dx_sharded"], (partitioner, r)
