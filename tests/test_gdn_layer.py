"""The GDN-style layers' input and output sides (layers/gdn.py): the fused projection + short
convolution against one projection and one convolution per stream (same parameters, same
initialisation, same outputs and decoding caches), the A_log initialisation and the output side
(the rank-r gate inside the sigmoid-gated RMSNorm)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers.blocks import ShortConv, dense, l2norm
from layers.gdn import A_MIN, DecayGate, a_log_init, gdn_cache, gdn_inputs, gdn_output
from merlin import Mamba2
from testkit import rel_rms


def per_stream_inputs(x, num_heads, head_dim, value_dim=None, expand_e=1, conv_width=4, *,
                      conv_cache=None, segment_ids=None):
  """gdn_inputs written as one DenseGeneral and one ShortConv per stream (the unfused form)."""
  h, d, e = num_heads, head_dim, expand_e
  vd = value_dim or head_dim
  new_cache = None if conv_cache is None else {}

  def stream(features, names, name):
    z = dense(features, ("embed",) + names, name=f"{name}_proj")(x)
    y, cache = ShortConv(conv_width, names, name=f"{name}_conv")(
        z, None if conv_cache is None else conv_cache[name], segment_ids=segment_ids)
    if conv_cache is not None:
      new_cache[name] = cache
    return y

  q = l2norm(jax.nn.silu(stream((h, d), ("heads", "head_dim"), "q")))
  k = l2norm(jax.nn.silu(stream((h, d), ("heads", "head_dim"), "k")))
  v = jax.nn.silu(stream((h, vd), ("heads", "head_dim"), "v"))
  b, t = x.shape[:2]
  if e > 1:
    k2 = l2norm(jax.nn.softplus(stream((h, e), ("heads", "expand"), "k2")))
    q2 = l2norm(jax.nn.softplus(stream((h, e), ("heads", "expand"), "q2")))
  else:
    k2 = q2 = jnp.ones((b, t, h, 1), jnp.float32)
  g = DecayGate(h, e, name="decay")(x)
  beta = jax.nn.sigmoid(dense((h,), ("embed", "heads"), name="beta_proj")(x))
  return (q, k, v, k2, q2, g, beta), new_cache


class Inputs(nn.Module):
  fn: object
  e: int
  vd: int | None

  @nn.compact
  def __call__(self, x, conv_cache=None, segment_ids=None):
    return self.fn(x, 2, 8, self.vd, self.e, 4, conv_cache=conv_cache, segment_ids=segment_ids)


@pytest.mark.parametrize("e,vd", [(1, None), (3, 4)])
def test_fused_inputs_equal_one_projection_and_conv_per_stream(e, vd):
  x = jax.random.normal(jax.random.key(0), (2, 13, 16))
  fused, ref = Inputs(gdn_inputs, e, vd), Inputs(per_stream_inputs, e, vd)
  params = jax.jit(fused.init)(jax.random.key(1), x)
  ref_params = jax.jit(ref.init)(jax.random.key(1), x)
  # the same tree with the same fresh values: checkpoints and initialisation are unchanged
  assert jax.tree.structure(params) == jax.tree.structure(ref_params)
  jax.tree.map(np.testing.assert_array_equal, nn.unbox(params), nn.unbox(ref_params))
  params = jax.tree.map(lambda z: z + 0.1 * jax.random.normal(jax.random.key(2), z.shape),
                        nn.unbox(params))  # not the initialisation (whose conv kernels are all < 1/2)
  fused_apply, ref_apply = jax.jit(fused.apply), jax.jit(ref.apply)
  got, none = fused_apply(params, x)
  want, _ = ref_apply(params, x)
  assert none is None
  for a, b in zip(got, want):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert rel_rms(a, b) < 1e-6
  # packed documents (a start at token 5 in row 0, at 1 and 11 in row 1): the same masked taps
  segment_ids = jnp.array([[0] * 5 + [1] * 8, [0] + [1] * 10 + [2] * 2])
  got, _ = fused_apply(params, x, segment_ids=segment_ids)
  want, _ = ref_apply(params, x, segment_ids=segment_ids)
  assert rel_rms(got[0], fused_apply(params, x)[0][0]) > 1e-3  # the mask changes q
  for a, b in zip(got, want):
    assert rel_rms(a, b) < 1e-6

  # decoding: a prompt then one token, each continuing the cached convolution inputs
  cache = gdn_cache(2, 2, 8, vd, e, 4, state=False)["conv"]
  for lo, hi in ((0, 9), (9, 10), (10, 13)):
    got, new = fused_apply(params, x[:, lo:hi], cache)
    want, ref_cache = ref_apply(params, x[:, lo:hi], cache)
    assert jax.tree.structure(new) == jax.tree.structure(cache)
    # The cached conv inputs are projections of O(1) size: one fused matmul against one per
    # stream may round differently by a few float32 ulps of that size (seen: 4e-7 on a 0.047).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), new,
                 ref_cache)
    for a, b in zip(got, want):
      assert rel_rms(a, b) < 1e-6
    cache = new


def test_a_log_is_log_uniform_0_16_with_a_finite_lower_end():
  a = np.exp(np.asarray(a_log_init(jax.random.key(3), (200_000,))))
  assert np.all(np.isfinite(a)) and a.min() >= A_MIN and a.max() < 16
  assert abs(np.mean(a < 1) - 1 / 16) < 0.003 and abs(a.mean() - 8) < 0.05  # U(0, 16), not U(1, 16)
  # the layers: GDN's decay gate draws from U(0, 16), Mamba-2 keeps its own U(1, 16)
  x = jnp.zeros((1, 2, 4))
  gate = nn.unbox(jax.jit(DecayGate(256, 8).init)(jax.random.key(4), x))["params"]
  assert 0 < np.mean(np.exp(gate["A_log"]) < 1) < 0.2
  mamba = nn.unbox(jax.jit(Mamba2(512, 2, state_dim=2).init)(jax.random.key(5), x))["params"]
  assert np.exp(mamba["A_log"]).min() >= 1


class Output(nn.Module):
  rank: int

  @nn.compact
  def __call__(self, o, x):
    return gdn_output(o, x, self.rank)


@pytest.mark.parametrize("rank", [3, 0])
def test_output_is_the_gated_rmsnorm_with_a_low_rank_gate(rank):
  """out_proj(RMSNorm(o) * sigmoid(gate_up(gate_down(x)))) (rank 0: sigmoid(gate_proj(x)))."""
  o = jax.random.normal(jax.random.key(6), (2, 5, 2, 4))
  x = jax.random.normal(jax.random.key(7), (2, 5, 16))
  params = nn.unbox(Output(rank).init(jax.random.key(8), o, x))["params"]
  params = jax.tree.map(lambda z: z + 0.1 * jax.random.normal(jax.random.key(9), z.shape), params)
  if rank:
    assert params["gate_down"]["kernel"].shape == (16, rank) and "bias" not in params["gate_down"]
    assert params["gate_up"]["kernel"].shape == (rank, 2, 4) and params["gate_up"]["bias"].shape == (2, 4)
    gate = jnp.einsum("btr,rhv->bthv", x @ params["gate_down"]["kernel"], params["gate_up"]["kernel"])
    gate = gate + params["gate_up"]["bias"]
  else:
    assert set(params) == {"gate_proj", "o_norm", "out_proj"}
    gate = jnp.einsum("btd,dhv->bthv", x, params["gate_proj"]["kernel"])
  normed = o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + 1e-6) * params["o_norm"]["scale"]
  want = jnp.einsum("bthv,hvd->btd", normed * jax.nn.sigmoid(gate), params["out_proj"]["kernel"])
  assert rel_rms(Output(rank).apply({"params": params}, o, x), want) < 1e-6
  with pytest.raises(ValueError, match="gate_rank must be a non-negative int"):
    Output(-2).init(jax.random.key(8), o, x)


@pytest.mark.parametrize("e", [1, 2])
def test_grouped_value_heads_are_heads_with_their_key_heads_q_k_repeated(e):
  """num_v_heads = G num_heads is the num_v_heads-head layer whose q, k (k2, q2) projection and
  conv kernels are the key heads' repeated G times (key head i serving value heads iG .. iG+G-1);
  num_v_heads = num_heads and value_dim = head_dim are the defaults' trees and outputs."""
  from triadic import TriadicGDN
  x = jax.random.normal(jax.random.key(0), (2, 11, 16))
  kw = dict(expand_e=e, impl="chunked", chunk_size=8)
  grouped = TriadicGDN(2, 8, value_dim=4, num_v_heads=6, **kw)
  params = nn.unbox(jax.jit(grouped.init)(jax.random.key(1), x))["params"]
  assert params["q_proj"]["kernel"].shape == (16, 2, 8)
  assert params["v_proj"]["kernel"].shape == (16, 6, 4)
  assert params["beta_proj"]["kernel"].shape == (16, 6)
  assert params["decay"]["A_log"].shape == (6, e)
  assert params["out_proj"]["kernel"].shape == (6, 4, 16)
  params = jax.tree.map(lambda z: z + 0.1 * jax.random.normal(jax.random.key(2), z.shape), params)
  y, _ = jax.jit(grouped.apply)({"params": params}, x)
  assert y.shape == x.shape
  cache = grouped.init_cache(2)
  assert cache["state"].shape == (2, 6, e, 8, 4)
  assert cache["conv"]["q"].shape == (2, 3, 2, 8) and cache["conv"]["v"].shape == (2, 3, 6, 4)

  keys = ("q_proj", "k_proj", "q_conv", "k_conv") + (("k2_proj", "q2_proj", "k2_conv", "q2_conv")
                                                     if e > 1 else ())
  wide = dict(params)
  for name in keys:
    wide[name] = {"kernel": jnp.repeat(params[name]["kernel"], 3, axis=-2)}
  wide_apply = jax.jit(TriadicGDN(6, 8, value_dim=4, **kw).apply)
  ref, _ = wide_apply({"params": wide}, x)
  assert rel_rms(y, ref) < 1e-5
  other = dict(params, q_proj={"kernel": jnp.tile(params["q_proj"]["kernel"], (1, 3, 1))})
  assert rel_rms(y, wide_apply(
      {"params": dict(wide, q_proj=other["q_proj"])}, x)[0]) > 1e-3  # the head order matters

  plain = TriadicGDN(2, 8, **kw)
  explicit = TriadicGDN(2, 8, value_dim=8, num_v_heads=2, **kw)
  p0 = jax.jit(plain.init)(jax.random.key(3), x)
  p1 = jax.jit(explicit.init)(jax.random.key(3), x)
  jax.tree.map(np.testing.assert_array_equal, nn.unbox(p0), nn.unbox(p1))
  np.testing.assert_array_equal(jax.jit(plain.apply)(p0, x)[0], jax.jit(explicit.apply)(p0, x)[0])
  with pytest.raises(ValueError, match="num_v_heads must be a positive multiple of num_heads"):
    TriadicGDN(2, 8, num_v_heads=3, **kw).init(jax.random.key(1), x)
