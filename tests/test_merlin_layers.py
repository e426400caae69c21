"""The multi-state mixers: checkpoint compatibility with the single-state layers, the vanilla
aggregator reproducing them, a float64 NumPy Mamba-2 mixer, errors, and the state-memory figures."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import merlin
import triadic
from testkit import rel_rms as rel

BATCH, T, MODEL, H, P, L, N = 2, 19, 16, 2, 8, 4, 5  # 19 tokens: 5 segments of 4 (last partial)
SMALL = dict(segment_len=L, max_segments=N, d_r=4, chunk_size=4)


def shapes(tree):
  return jax.tree_util.tree_map(lambda x: x.shape, nn.unbox(tree))


@pytest.fixture(scope="module")
def x():
  return jax.random.normal(jax.random.PRNGKey(0), (BATCH, T, MODEL))


def load(single, multi):
  """The single-state parameters written into the multi-state tree by name (a checkpoint load)."""
  params = dict(nn.unbox(multi)["params"])
  for name, value in nn.unbox(single)["params"].items():
    assert name in params, name
    params[name] = value
  return {"params": params}


@pytest.mark.parametrize("erase", [True, False])
def test_gdn_loads_single_state_checkpoint(x, erase):
  single = triadic.TriadicGDN(num_heads=H, head_dim=P, expand_e=1, erase=erase)
  single_params = jax.jit(single.init)(jax.random.PRNGKey(1), x)
  for agg in merlin.AGGREGATORS:
    layer = merlin.MultiStateGDN(num_heads=H, head_dim=P, aggregator=agg, erase=erase, **SMALL)
    params = jax.jit(layer.init)(jax.random.PRNGKey(2), x)
    shared = {k: v for k, v in shapes(params)["params"].items() if k != "aggregator"}
    assert shared == shapes(single_params)["params"], agg  # same names, same shapes
    y, _ = jax.jit(layer.apply)(load(single_params, params), x)
    assert y.shape == x.shape and np.all(np.isfinite(np.asarray(y))), agg
    if agg == "vanilla":  # lam = 1: the single-state layer exactly
      assert rel(y, jax.jit(single.apply)(single_params, x)[0]) < 1e-5


def test_mamba2_loads_into_multistate(x):
  single = merlin.Mamba2(num_heads=H, head_dim=P, state_dim=6, chunk_size=4)
  single_params = jax.jit(single.init)(jax.random.PRNGKey(1), x)
  for agg in merlin.AGGREGATORS:
    layer = merlin.MultiStateMamba2(num_heads=H, head_dim=P, state_dim=6, aggregator=agg, **SMALL)
    params = jax.jit(layer.init)(jax.random.PRNGKey(2), x)
    shared = {k: v for k, v in shapes(params)["params"].items() if k != "aggregator"}
    assert shared == shapes(single_params)["params"], agg
    y, _ = jax.jit(layer.apply)(load(single_params, params), x)
    assert y.shape == x.shape and np.all(np.isfinite(np.asarray(y))), agg
    if agg == "vanilla":
      assert rel(y, jax.jit(single.apply)(single_params, x)[0]) < 1e-5
  assert shapes(params)["params"]["aggregator"]["kr_proj"]["kernel"] == (MODEL, 4)  # one group


def numpy_mamba2(p, x, conv_width=4):
  """The Mamba-2 mixer (one group) from its parameters, in float64 with an explicit SSD loop."""
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), nn.unbox(p)["params"])
  x = np.asarray(x, np.float64)
  silu = lambda z: z / (1 + np.exp(-z))
  softplus = lambda z: np.log1p(np.exp(z))

  def stream(name):
    z = np.tensordot(x, p[f"{name}_proj"]["kernel"], 1)
    w = p[f"{name}_conv"]["kernel"]
    zp = np.concatenate([np.zeros((z.shape[0], conv_width - 1) + z.shape[2:]), z], 1)
    return silu(sum(zp[:, i:i + z.shape[1]] * w[i] for i in range(conv_width)))

  xs, b, c = stream("x"), stream("b"), stream("c")
  dt = softplus(np.tensordot(x, p["dt_proj"]["kernel"], 1) + p["dt_bias"])  # (B, T, H)
  a = -np.exp(p["A_log"])
  y = np.zeros(xs.shape)
  for bi in range(x.shape[0]):
    for hi in range(xs.shape[2]):
      state = np.zeros((b.shape[-1], xs.shape[-1]))
      for ti in range(x.shape[1]):
        state = np.exp(a[hi] * dt[bi, ti, hi]) * state + np.outer(b[bi, ti], dt[bi, ti, hi] * xs[bi, ti, hi])
        y[bi, ti, hi] = state.T @ c[bi, ti]
  y = (y + p["D"][:, None] * xs) * silu(np.tensordot(x, p["z_proj"]["kernel"], 1))
  y = y / np.sqrt(np.mean(y * y, -1, keepdims=True) + 1e-6) * p["norm"]["scale"]
  return np.tensordot(y, p["out_proj"]["kernel"], 2)


def test_mamba2_matches_numpy(x):
  layer = merlin.Mamba2(num_heads=H, head_dim=P, state_dim=6, chunk_size=4)
  params = layer.init(jax.random.PRNGKey(3), x)
  assert rel(layer.apply(params, x)[0], numpy_mamba2(params, x)) < 1e-5


def test_multistate_layers_differentiate(x):
  for layer in (merlin.MultiStateGDN(num_heads=H, head_dim=P, **SMALL),
                merlin.MultiStateMamba2(num_heads=H, head_dim=P, state_dim=6, **SMALL)):
    params = jax.jit(layer.init)(jax.random.PRNGKey(4), x)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply(p, x)[0] ** 2)))(params)
    agg = nn.unbox(grads)["params"]["aggregator"]
    for leaf in jax.tree_util.tree_leaves(agg):
      assert np.all(np.isfinite(np.asarray(leaf))) and np.any(np.asarray(leaf) != 0)


def test_aggregator_params_are_partitioned(x):
  params = merlin.MultiStateGDN(num_heads=H, head_dim=P, **SMALL).init(jax.random.PRNGKey(5), x)
  spec = nn.get_partition_spec(params)["params"]["aggregator"]
  assert tuple(spec["kr_proj"]["kernel"]) == ("embed", "heads", "moment")
  assert tuple(spec["log_tau_sigma"]) == ("heads",)


def test_layer_errors(x):
  with pytest.raises(ValueError, match="aggregator must be one of"):
    merlin.MultiStateGDN(num_heads=H, head_dim=P, aggregator="max", **SMALL).init(
        jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="T must be <="):
    merlin.MultiStateGDN(num_heads=H, head_dim=P, segment_len=4, max_segments=4, d_r=4).init(
        jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="chunk_size must be a positive int dividing segment_len"):
    merlin.MultiStateMamba2(num_heads=H, head_dim=P, segment_len=6, max_segments=4, d_r=4,
                            chunk_size=4).init(jax.random.PRNGKey(0), x)


def test_state_memory_matches_the_paper():
  """MERLIN paper: GDN-1.3B heads (6 x 256 x 512, R = 128 per head) +12.6%; Mamba-2-780M
  (48 heads of 64 x 128, one group) +4.2%."""
  gdn = merlin.state_memory(6, 256, 512, 128)
  assert round(100 * gdn.moment_overhead, 1) == 12.6
  assert gdn.state_bytes_per_head == 256 * 512 * 4
  assert gdn.moment_bytes_per_layer == 6 * (128 + 128 ** 2) * 4
  mamba = merlin.state_memory(48, 128, 64, 128, moment_groups=1)
  assert round(100 * mamba.moment_overhead, 1) == 4.2
  layer = merlin.MultiStateMamba2(num_heads=48, head_dim=64, state_dim=128, d_r=128)
  assert layer.state_memory().moment_overhead == mamba.moment_overhead
  assert layer.state_memory().state_bytes_per_layer == 64 * mamba.state_bytes_per_layer
  small = merlin.MultiStateGDN(num_heads=6, head_dim=256, value_dim=512, d_r=32).state_memory(1)
  assert small.moment_overhead == pytest.approx(gdn.moment_overhead * (32 + 32 ** 2) / (128 + 128 ** 2))
  assert merlin.state_memory(6, 256, 512, 128, aggregator="position").moment_bytes_per_layer == 0
  with pytest.raises(ValueError, match="moment_groups must be 1 or num_heads"):
    merlin.state_memory(6, 256, 512, 128, moment_groups=2)
