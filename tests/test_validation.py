"""Every public op rejects a bad argument with a ValueError / TypeError that names it: wrong rank,
integer or bool dtype, a Python list, a mismatched size, T = 0; and the layers' size fields
(expand_e = 0) and the multi-state decode capacity.

Also the decay edge cases: g = -inf (a state reset, exp(-inf) = 0) gives the same result in every
impl, and a NaN in a concrete g is an error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from merlin import aggregators
from merlin.ops import multistate_attention
from testkit import rel_rms
from triadic.ops import triadic_gdn, triadic_gdn_step
from triadic.pallas.common import Config

B, T, H, D, V, E, N, L, R = 1, 6, 2, 4, 3, 2, 2, 4, 3
F32 = np.float32


def _r(*shape):
  return np.random.default_rng(sum(shape)).standard_normal(shape).astype(F32)


def triadic_args(t=T, d=D, vd=V):
  return dict(q=_r(B, t, H, d), k=_r(B, t, H, d), v=_r(B, t, H, vd), k2=np.abs(_r(B, t, H, E)),
              q2=np.abs(_r(B, t, H, E)), g=-np.abs(_r(B, t, H, E)),
              beta=np.full((B, t, H), 0.5, F32))


def step_args():
  return dict(state=np.zeros((B, H, E, D, V), F32), q=_r(B, H, D), k=_r(B, H, D), v=_r(B, H, V),
              k2=np.abs(_r(B, H, E)), q2=np.abs(_r(B, H, E)), g=-np.abs(_r(B, H, E)),
              beta=np.full((B, H), 0.5, F32))


def multistate_args():
  return dict(q=_r(B, T, H, D), k=_r(B, T, H, D), v=_r(B, T, H, V), g=-np.abs(_r(B, T, H)),
              beta=np.full((B, T, H), 0.5, F32), lam=np.ones((B, T, H, N), F32))


def _unit(*shape):
  x = _r(*shape)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def meanpool_args():
  return dict(qr=_unit(B, T, H, R), kr=_unit(B, T, H, R), tau_mu=np.ones((H,), F32))


def merlin_args():
  return dict(qr=_unit(B, T, H, R), kr=_unit(B, T, H, R), gamma=np.full((B, T, H), 0.5, F32),
              tau_mu=np.ones((H,), F32), tau_sigma=np.ones((H,), F32))


OPS = {
    "triadic_gdn": (triadic_args, lambda a: triadic_gdn(**a, impl="chunked", chunk_size=4)),
    "triadic_gdn_step": (step_args, lambda a: triadic_gdn_step(**a)),
    "multistate_attention": (multistate_args,
                             lambda a: multistate_attention(**a, segment_len=L, impl="chunked")),
    "meanpool_weights": (meanpool_args,
                         lambda a: aggregators.meanpool_weights(**a, segment_len=L, max_segments=N)),
    "merlin_weights": (merlin_args,
                       lambda a: aggregators.merlin_weights(**a, segment_len=L, max_segments=N)),
    "position_weights": (lambda: dict(p=_r(B, T, H, N)),
                         lambda a: aggregators.position_weights(**a, segment_len=L)),
}
CASES = [(op, arg) for op, (make, _) in OPS.items() for arg in make()]


def _expect_error(op, args, arg, kind):
  with pytest.raises(kind, match=rf"\b{arg}\b"):
    OPS[op][1](args)


@pytest.mark.parametrize("op,arg", CASES)
def test_wrong_rank_names_the_argument(op, arg):
  args = OPS[op][0]()
  args[arg] = args[arg][..., None]
  _expect_error(op, args, arg, ValueError)


@pytest.mark.parametrize("op,arg", CASES)
def test_integer_and_bool_dtypes_name_the_argument(op, arg):
  for dtype in (np.int32, np.bool_):
    args = OPS[op][0]()
    args[arg] = args[arg].astype(dtype)
    _expect_error(op, args, arg, TypeError)


@pytest.mark.parametrize("op,arg", CASES)
def test_python_lists_name_the_argument(op, arg):
  args = OPS[op][0]()
  args[arg] = args[arg].tolist()
  _expect_error(op, args, arg, TypeError)


@pytest.mark.parametrize("op,arg", [c for c in CASES if c[1] not in ("q", "p", "qr")])
def test_mismatched_size_names_the_argument(op, arg):
  """Every argument but the one the sizes are read from (q, qr; p alone): one axis it shares with
  another argument (the second-last, or the only one) one longer."""
  args = OPS[op][0]()
  x = args[arg]
  axis = -2 if x.ndim >= 2 else 0
  args[arg] = np.concatenate([x, np.take(x, [0], axis=axis)], axis=axis)
  _expect_error(op, args, arg, ValueError)


@pytest.mark.parametrize("op", ["triadic_gdn", "multistate_attention", "meanpool_weights",
                                "merlin_weights", "position_weights"])
def test_zero_length_sequence_is_a_value_error(op):
  args = {k: v[:, :0] if v.ndim > 1 else v for k, v in OPS[op][0]().items()}
  with pytest.raises(ValueError, match="empty axis|T = 0|segment"):
    OPS[op][1](args)


def test_step_error_cites_the_step_shapes():
  args = step_args()
  args["k"] = args["k"][:, :, :-1]
  with pytest.raises(ValueError, match=r"k must have shape \(B, H, D\) = \(1, 2, 4\)") as err:
    triadic_gdn_step(**args)
  assert "T" not in str(err.value).split("got")[0].replace("to match", "")


def test_vanilla_weights_sizes():
  with pytest.raises(ValueError, match=r"\bt\b"):
    aggregators.vanilla_weights(1, 0, 2, 2)


# ---------------------------------------------------------------------------------------------
# g = -inf and NaN


def _with_reset(args, where):
  args = dict(args)
  g = args["g"].copy()
  g[(0, min(2, g.shape[1] - 1)) + (slice(None),) * (g.ndim - 2)] = -np.inf if where == "inf" else np.nan
  args["g"] = g
  return args


@pytest.mark.parametrize("erase", [True, False])
def test_minus_inf_decay_is_a_reset_in_every_triadic_impl(erase):
  """One -inf in g (token 2, every head and slice): the state is wiped there. Every impl agrees
  with the scan, forward and gradient (the clamped entries get gradient 0, as in the scan)."""
  args = _with_reset(triadic_args(t=19, d=16, vd=16), "inf")  # sizes the Pallas kernels take
  run = lambda impl, **a: triadic_gdn(**a, erase=erase, impl=impl, chunk_size=16)
  want, want_state = run("scan", **args)
  assert np.isfinite(np.asarray(want)).all()
  for impl in ("chunked", "pallas") if erase else ("chunked",):  # Pallas interprets slowly on CPU
    got, got_state = run(impl, **args)
    assert rel_rms(got, want) < 1e-5 and rel_rms(got_state, want_state) < 1e-5, impl
  # After the reset the output does not depend on the tokens before it.
  other = dict(args, v=np.concatenate([args["v"][:, :2] + 1.0, args["v"][:, 2:]], axis=1))
  assert rel_rms(run("chunked", **other)[0][:, 3:], want[:, 3:]) < 1e-5
  grad = lambda impl: jax.jit(jax.grad(
      lambda q, k, g: run(impl, **dict(args, q=q, k=k, g=g))[0].sum(),
      argnums=(0, 1, 2)))(args["q"], args["k"], args["g"])
  for a, b in zip(grad("chunked"), grad("scan")):
    assert np.isfinite(np.asarray(a)).all() and rel_rms(a, b) < 1e-5


def test_minus_inf_decay_is_a_reset_in_multistate_attention():
  args = _with_reset(multistate_args(), "inf")
  want = multistate_attention(**args, segment_len=L, impl="scan")
  got = multistate_attention(**args, segment_len=L, impl="chunked")
  assert np.isfinite(np.asarray(want)).all() and rel_rms(got, want) < 1e-5


@pytest.mark.parametrize("op", ["triadic_gdn", "triadic_gdn_step", "multistate_attention"])
def test_nan_decay_is_an_error(op):
  with pytest.raises(ValueError, match=r"g .*NaN"):
    OPS[op][1](_with_reset(OPS[op][0](), "nan"))


# ---------------------------------------------------------------------------------------------
# Layers


def test_expand_e_zero_is_a_value_error_at_the_layer():
  from triadic import TriadicGDN
  layer = TriadicGDN(num_heads=2, head_dim=4, expand_e=0)
  with pytest.raises(ValueError, match="expand_e must be a positive int"):
    layer.init(jax.random.key(0), jnp.zeros((1, 4, 8)))


@pytest.mark.parametrize("name", ["MultiStateGDN", "MultiStateMamba2"])
def test_multistate_init_cache_refuses_past_capacity(name):
  import merlin
  layer = getattr(merlin, name)(num_heads=2, head_dim=4, segment_len=16, max_segments=4, d_r=4)
  layer.init_cache(1, 64)  # exactly the capacity
  with pytest.raises(ValueError, match=r"max_len = 1000 .*segment_len \* max_segments = 16 \* 4 = 64"):
    layer.init_cache(1, 1000)


def test_multistate_decode_step_past_capacity_is_an_error():
  """A concrete cache that is full refuses one more token instead of decoding it silently."""
  import merlin
  from merlin.decode import multistate_decode
  layer = merlin.MultiStateGDN(num_heads=H, head_dim=D, segment_len=2, max_segments=2, d_r=R)
  cache = {"state": jnp.zeros((B, H, 2, D, D)), "moments": {}, "length": jnp.asarray(4)}
  x = jnp.zeros((B, 1, H, D))
  gb = jnp.zeros((B, 1, H))
  with pytest.raises(ValueError, match=r"holds 4 tokens and 1 more exceed .* capacity"):
    multistate_decode(layer, x, x, x, gb, gb, jnp.ones((B, 1, H, 2)), {}, cache, erase=True,
                      scale=1.0)


@pytest.mark.parametrize("field,value,error", [
    ("state_warpgroups", 3, ValueError), ("sequence_pieces", -1, ValueError),
    ("slice_warpgroups", 0, ValueError), ("warmup_chunks", 0, ValueError),
    ("slice_unroll_max_e", -1, ValueError), ("partials_in_bf16", 1, TypeError),
    ("token_major", "yes", TypeError)])
def test_kernel_config_names_a_bad_field(field, value, error):
  """The Pallas kernels' ``Config`` rejects a bad field value with an error naming the field."""
  with pytest.raises(error, match=field):
    Config("gpu", block_v=32, bwd_block_v=32, **{field: value})
