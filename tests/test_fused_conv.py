"""The fused short-convolution kernel (layers/fused_conv.py, interpret mode) against the JAX path
of ``gdn_inputs`` (``causal_conv``, the activations, ``l2norm``): outputs and the gradients of z
and the conv kernel, float32 and bf16, with and without packed documents; the layers with
conv_impl="pallas" against "xla"; the Triton lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers.blocks import causal_conv, l2norm
from layers.fused_conv import Stream, fused_short_conv
from layers.gdn import gdn_inputs
from lm.model import ModelConfig
from merlin import MultiStateGDN
from testkit import rel_rms
from triadic import TriadicGDN
from triadic.pallas.common import Config


def gdn_streams(h, d, e, vd=None):
  """gdn_inputs' streams: q, k, v and (E > 1) k2, q2."""
  out = [Stream(h, d), Stream(h, d), Stream(h, vd or d, norm=False)]
  if e > 1:
    out += [Stream(h, e, "softplus", dtype=jnp.float32)] * 2
  return out


def reference(z, kernel, streams, segment_ids=None):
  """The JAX path: one causal_conv over all channels, then each stream's activation and norm."""
  y = causal_conv(z, kernel, None, segment_ids)[0]
  outs, c = [], 0
  for s in streams:
    part = y[..., c:c + s.heads * s.width].reshape(z.shape[:2] + (s.heads, s.width))
    c += s.heads * s.width
    u = jax.nn.silu(part) if s.act == "silu" else jax.nn.softplus(part.astype(jnp.float32))
    outs.append(l2norm(u) if s.norm else u)
  return tuple(outs)


def documents(b, t, seed=3):
  """(B, T) segment ids with documents starting at random tokens (mid-block)."""
  starts = jax.random.bernoulli(jax.random.PRNGKey(seed), 0.15, (b, t))
  return jnp.cumsum(starts, axis=1).astype(jnp.int32)


def inputs(streams, b, t, dtype, width=4):
  c = sum(s.heads * s.width for s in streams)
  z = jax.random.normal(jax.random.PRNGKey(0), (b, t, c), jnp.float32).astype(dtype)
  kernel = 0.5 * jax.random.normal(jax.random.PRNGKey(1), (width, c), jnp.float32)
  return z, kernel


def vjp_of(fn, z, kernel, cts):
  return jax.vjp(fn, z, kernel)[1](cts)


@pytest.mark.parametrize("dtype,tol,e,docs", [
    (jnp.float32, 1e-5, 1, True), (jnp.float32, 1e-5, 3, False),
    (jnp.bfloat16, 2e-2, 3, True), (jnp.bfloat16, 2e-2, 1, False)])
def test_matches_jax_path(dtype, tol, e, docs):
  """Outputs and the gradients of z and the kernel; T = 45 is no multiple of either token block
  (16 forward, 8 backward), so the last blocks are partial."""
  streams = gdn_streams(2, 16, e, vd=8)
  b, t = 2, 45
  z, kernel = inputs(streams, b, t, dtype)
  seg = documents(b, t) if docs else None
  fused = lambda z, w: fused_short_conv(z, w, streams, seg, block_t=16, bwd_block_t=8)
  plain = lambda z, w: reference(z, w, streams, seg)
  got, want = fused(z, kernel), plain(z, kernel)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    assert rel_rms(g, w) < tol
  keys = jax.random.split(jax.random.PRNGKey(5), len(want))
  cts = tuple(jax.random.normal(k, w.shape, jnp.float32).astype(w.dtype)
              for k, w in zip(keys, want))
  for g, w in zip(vjp_of(fused, z, kernel, cts), vjp_of(plain, z, kernel, cts)):
    assert g.dtype == w.dtype
    assert rel_rms(g, w) < tol


def test_documents_do_not_leak():
  """An output after a document start does not depend on any token of the previous document."""
  streams = gdn_streams(1, 16, 1)
  z, kernel = inputs(streams, 1, 24, jnp.float32)
  seg = jnp.where(jnp.arange(24) < 13, 0, 1)[None]
  f = lambda z: fused_short_conv(z, kernel, streams, seg, block_t=8)
  jac = jax.jacobian(lambda z: f(z)[0][0, 13:])(z)  # outputs of the 2nd document
  assert float(jnp.abs(jac[..., :13, :]).max()) == 0.0


def _layers(e):
  common = dict(num_heads=2, head_dim=16, expand_e=e, chunk_size=16, impl="chunked")
  return TriadicGDN(**common), TriadicGDN(**common, conv_impl="pallas")


def test_triadic_layer_pallas_equals_xla():
  """TriadicGDN (E = 3: every stream) with conv_impl="pallas" gives "xla"'s output and parameter
  gradients (same params), with packed documents; decoding (a cache) takes the JAX path under
  either."""
  xla, pallas = _layers(3)
  x = jax.random.normal(jax.random.PRNGKey(2), (1, 40, 32), jnp.float32)
  seg = documents(1, 40)
  params = xla.init(jax.random.PRNGKey(0), x)["params"]
  loss = lambda layer: lambda p: jnp.sum(layer.apply({"params": p}, x, segment_ids=seg)[0] ** 2)
  (lx, gx), (lp, gp) = (jax.value_and_grad(loss(m))(params) for m in (xla, pallas))
  assert abs(float(lx - lp)) < 1e-4 * abs(float(lx))
  for a, b in zip(jax.tree.leaves(gx), jax.tree.leaves(gp)):
    assert rel_rms(b, a) < 1e-4
  cache = pallas.init_cache(1)
  y, _ = pallas.apply({"params": params}, x[:, :8], cache)
  want, _ = xla.apply({"params": params}, x[:, :8], cache)
  np.testing.assert_allclose(y, want, rtol=0, atol=0)


def test_multistate_layer_pallas_equals_xla():
  common = dict(num_heads=2, head_dim=16, segment_len=16, max_segments=4, d_r=8, chunk_size=16,
                impl="chunked")
  xla, pallas = MultiStateGDN(**common), MultiStateGDN(**common, conv_impl="pallas")
  x = jax.random.normal(jax.random.PRNGKey(2), (1, 32, 32), jnp.float32)
  params = xla.init(jax.random.PRNGKey(0), x)["params"]
  assert rel_rms(pallas.apply({"params": params}, x)[0], xla.apply({"params": params}, x)[0]) < 1e-5


def test_unknown_conv_impl():
  x = jnp.zeros((1, 8, 32))
  with pytest.raises(ValueError, match="conv_impl"):
    TriadicGDN(2, 16, conv_impl="triton").init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="conv_impl"):
    jax.eval_shape(lambda: gdn_inputs(x, 2, 16, conv_impl="cuda"))
  with pytest.raises(ValueError, match="model.conv_impl"):
    ModelConfig(vocab_size=8, num_layers=1, d_model=32, num_heads=2, head_dim=16, mlp_dim=64,
                conv_impl="fused")
  assert ModelConfig(vocab_size=8, num_layers=1, d_model=32, num_heads=2, head_dim=16,
                     mlp_dim=64).conv_impl == "xla"


@pytest.mark.parametrize("docs", [False, True])
def test_lowers_for_cuda(docs):
  """The forward and backward kernels lower to Triton IR for CUDA (the paper's heads of 128,
  E = 8, bf16); nothing runs."""
  streams = gdn_streams(4, 128, 8)
  c = sum(s.heads * s.width for s in streams)
  gpu = Config("gpu", block_v=16, bwd_block_v=16)
  shape = jax.ShapeDtypeStruct
  args = (shape((2, 200, c), jnp.bfloat16), shape((4, c), jnp.float32),
          shape((2, 200), jnp.int32) if docs else None)

  def f(z, kernel, seg):
    fn = lambda z, w: fused_short_conv(z, w, streams, seg, cfg=gpu)
    out, vjp = jax.vjp(fn, z, kernel)
    return vjp(out)

  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "gdn_short_conv_fwd" in text and "gdn_short_conv_bwd" in text
