"""triadic_gdn: scan and chunked against an independent float64 NumPy loop; gradients; contracts.

Error bounds (relative RMS, ||a - b|| / ||b||), per dtype of q, k, v, k2, q2:
  float32: outputs and final state 2e-5 against the float64 oracle; gradients 1e-4 against scan.
  bfloat16: outputs 1.5e-2 (o is returned in bf16, ~3e-3 from rounding alone), final state 1e-3
  (float32 throughout, only the inputs are rounded); gradients 2e-2 against scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from testkit import rel_rms
from testkit.triadic import make_inputs
from testkit.triadic_reference import (gated_deltanet_reference, gated_linear_attention_reference,
                                       triadic_reference)
from triadic import triadic_gdn

jax.config.update("jax_default_matmul_precision", "highest")

BOUNDS = {jnp.float32: dict(out=2e-5, state=2e-5, grad=1e-4),
          jnp.bfloat16: dict(out=1.5e-2, state=1e-3, grad=2e-2)}


# (T, E, D, V, chunk, decay): T = 1 and T not a multiple of the chunk, odd D and V, E = 3 (not a
# power of two), weak (0.01) and strong (5.0) decay.
CASES = [
    (1, 1, 8, 8, 16, 1.0),
    (63, 3, 5, 7, 16, 5.0),
    (100, 8, 16, 8, 32, 0.01),
    (100, 3, 8, 12, 64, 1.0),
]


@pytest.mark.parametrize("impl", ["scan", "chunked"])
@pytest.mark.parametrize("erase", [True, False])
@pytest.mark.parametrize("t,e,d,vdim,chunk,decay", CASES)
def test_forward_matches_float64_oracle(impl, erase, t, e, d, vdim, chunk, decay):
  args = make_inputs(t * 7 + e, 2, t, 2, d, vdim, e, decay=decay)
  want_o, want_s = triadic_reference(*args, erase=erase)
  o, s = triadic_gdn(*args, erase=erase, impl=impl, chunk_size=chunk)
  assert o.shape == (2, t, 2, vdim) and o.dtype == jnp.float32
  assert s.shape == (2, 2, e, d, vdim) and s.dtype == jnp.float32
  assert rel_rms(o, want_o) < BOUNDS[jnp.float32]["out"]
  assert rel_rms(s, want_s) < BOUNDS[jnp.float32]["state"]


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_initial_state_and_scale(impl):
  args = make_inputs(3, 1, 37, 3, 8, 4, 2)
  s0 = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, 2, 8, 4)), jnp.float32)
  want_o, want_s = triadic_reference(*args, initial_state=s0, scale=0.7)
  o, s = triadic_gdn(*args, initial_state=s0, scale=0.7, impl=impl, chunk_size=16)
  assert rel_rms(o, want_o) < 2e-5 and rel_rms(s, want_s) < 2e-5


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_bfloat16_inputs(impl):
  args = make_inputs(5, 2, 75, 2, 16, 16, 4, dtype=jnp.bfloat16)
  want_o, want_s = triadic_reference(*(np.asarray(x.astype(jnp.float32)) for x in args))
  o, s = triadic_gdn(*args, impl=impl, chunk_size=32)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert rel_rms(o.astype(jnp.float32), want_o) < BOUNDS[jnp.bfloat16]["out"]
  assert rel_rms(s, want_s) < BOUNDS[jnp.bfloat16]["state"]


def _grads(impl, args, s0, erase, chunk):
  """Gradients of (o * do).sum() + (final_state * ds).sum() for all seven inputs and the initial state."""
  rng = np.random.default_rng(1)
  do = jnp.asarray(rng.normal(size=args[2].shape), jnp.float32)
  ds = jnp.asarray(rng.normal(size=s0.shape), jnp.float32)

  def loss(*xs):
    o, s = triadic_gdn(*xs[:7], initial_state=xs[7], erase=erase, impl=impl, chunk_size=chunk)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * ds)

  return jax.jit(jax.grad(loss, argnums=tuple(range(8))))(*args, s0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("erase", [True, False])
@pytest.mark.parametrize("t,e,decay", [(63, 3, 5.0), (40, 1, 0.01)])
def test_chunked_gradients_match_scan(dtype, erase, t, e, decay):
  args = make_inputs(t + e, 1, t, 2, 8, 6, e, decay=decay, dtype=dtype)
  s0 = jnp.asarray(np.random.default_rng(2).normal(size=(1, 2, e, 8, 6)), jnp.float32)
  want = _grads("scan", args, s0, erase, 16)
  got = _grads("chunked", args, s0, erase, 16)
  names = ["q", "k", "v", "k2", "q2", "g", "beta", "initial_state"]
  for name, a, b in zip(names, got, want):
    assert a.dtype == b.dtype, name
    err = rel_rms(a.astype(jnp.float32), b.astype(jnp.float32))
    assert err < BOUNDS[dtype]["grad"], f"d{name}: rel-RMS {err:.2e}"


@pytest.mark.parametrize("c,e", [(64, 5), (48, 1), (40, 3)])
@pytest.mark.parametrize("decay", [0.01, 1.0, 30.0])
def test_sub_chunk_masks_match_the_definition(c, e, decay):
  """``sub_chunk_masks`` (matmuls across sub-chunks of 16) against ``chunk_masks`` (elementwise),
  values and gradients, float32: 1e-6 and 1e-5 relative RMS (the two differ by rounding only;
  seen: <= 3e-7). C = 40 is not a multiple of 16 (the definition is used); decay 30 makes
  exp(-gc_s) overflow, which the factorisation must never form."""
  from triadic.chunked import chunk_masks, sub_chunk_masks
  rng = np.random.default_rng(c + e)
  gc = jnp.asarray(np.cumsum(-decay * rng.uniform(size=(2, 3, c, e)), -2), jnp.float32)
  k2, q2 = (jnp.asarray(np.log1p(np.exp(rng.normal(size=(2, 3, c, e)))), jnp.float32)
            for _ in range(2))
  w = [jnp.asarray(rng.normal(size=(2, 3, c, c)), jnp.float32) for _ in range(2)]
  loss = lambda fn: lambda *x: sum(jnp.sum(m * wi) for m, wi in zip(fn(*x), w))
  for got, want in zip(jax.jit(sub_chunk_masks)(gc, k2, q2), jax.jit(chunk_masks)(gc, k2, q2)):
    assert bool(jnp.isfinite(got).all()) and rel_rms(got, want) < 1e-6
    assert bool(jnp.all(jnp.triu(got, 1) == 0))
  grads = [jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(gc, k2, q2)
           for fn in (sub_chunk_masks, chunk_masks)]
  for name, got, want in zip(("gc", "k2", "q2"), *grads):
    assert bool(jnp.isfinite(got).all()) and rel_rms(got, want) < 1e-5, name


def test_chunked_with_sub_chunk_masks_matches_the_default():
  """``triadic_chunked(sub_chunk=16)`` (three sub-chunks of a 48-token chunk) against the default
  masks: output, final state and every gradient, float32, 1e-5."""
  from triadic.chunked import triadic_chunked
  args = make_inputs(9, 1, 70, 2, 8, 6, 5)
  s0 = jnp.asarray(np.random.default_rng(3).normal(size=(1, 2, 5, 8, 6)), jnp.float32)
  do = jnp.asarray(np.random.default_rng(4).normal(size=(1, 70, 2, 6)), jnp.float32)

  def outputs(sub):
    def loss(*xs):
      o, s = triadic_chunked(*xs[:7], scale=0.3, initial_state=xs[7], erase=True, chunk_size=48,
                             sub_chunk=sub)
      return jnp.sum(o * do) + jnp.sum(s), (o, s)
    grads, (o, s) = jax.jit(jax.grad(loss, argnums=tuple(range(8)), has_aux=True))(*args, s0)
    return [o, s, *grads]

  for i, (got, want) in enumerate(zip(outputs(16), outputs(None))):
    assert rel_rms(got, want) < 1e-5, i


def test_scan_gradients_match_finite_differences():
  """The oracle's own gradient (scan) against central differences of the float64 loop."""
  args = make_inputs(11, 1, 9, 1, 4, 3, 2)
  s0 = jnp.zeros((1, 1, 2, 4, 3), jnp.float32)
  grads = _grads("scan", args, s0, True, 16)
  rng = np.random.default_rng(1)
  do = rng.normal(size=args[2].shape)
  ds = rng.normal(size=s0.shape)
  loss64 = lambda xs: (lambda o, s: np.sum(o * do) + np.sum(s * ds))(*triadic_reference(*xs))
  base = [np.asarray(x, np.float64) for x in args]
  for idx in (0, 3, 5, 6):  # q, k2, g, beta
    direction = rng.normal(size=base[idx].shape)
    plus = [x.copy() for x in base]
    minus = [x.copy() for x in base]
    plus[idx] += 1e-5 * direction
    minus[idx] -= 1e-5 * direction
    fd = (loss64(plus) - loss64(minus)) / 2e-5
    analytic = float(np.sum(np.asarray(grads[idx], np.float64) * direction))
    assert abs(fd - analytic) < 1e-3 * max(1.0, abs(fd)), (idx, fd, analytic)


def test_extreme_decay_is_finite():
  """g down to -30 per token: no inf or NaN in outputs, state or gradients (chunked)."""
  args = list(make_inputs(7, 1, 70, 2, 8, 8, 3, decay=30.0))
  args[5] = args[5].at[:, ::5].set(-30.0)
  o, s = jax.jit(lambda *xs: triadic_gdn(*xs, impl="chunked", chunk_size=32))(*args)
  grads = jax.jit(jax.grad(
      lambda *xs: jnp.sum(triadic_gdn(*xs, impl="chunked", chunk_size=32)[0] ** 2),
      argnums=tuple(range(7))))(*args)
  assert bool(jnp.isfinite(o).all()) and bool(jnp.isfinite(s).all())
  assert all(bool(jnp.isfinite(x).all()) for x in grads)
  want_o, _ = triadic_reference(*args)
  assert rel_rms(o, want_o) < 2e-5


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_e1_is_gated_deltanet(impl):
  q, k, v, _, _, g, beta = make_inputs(13, 2, 50, 2, 8, 5, 1)
  ones = jnp.ones(g.shape, jnp.float32)
  o, _ = triadic_gdn(q, k, v, ones, ones, g, beta, impl=impl, chunk_size=16)
  want = gated_deltanet_reference(q, k, v, g[..., 0], beta, scale=8 ** -0.5)
  assert rel_rms(o, want) < 2e-5


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_e1_without_erase_is_gated_linear_attention(impl):
  q, k, v, _, _, g, beta = make_inputs(17, 2, 50, 2, 8, 5, 1)
  ones = jnp.ones(g.shape, jnp.float32)
  o, _ = triadic_gdn(q, k, v, ones, ones, g, beta, erase=False, impl=impl, chunk_size=16)
  want = gated_linear_attention_reference(q, k, v, g[..., 0], beta, scale=8 ** -0.5)
  assert rel_rms(o, want) < 2e-5


def test_auto_runs_and_agrees_with_scan():
  args = make_inputs(19, 1, 33, 2, 8, 8, 2)
  o_auto, s_auto = jax.jit(lambda *xs: triadic_gdn(*xs, impl="auto", chunk_size=16))(*args)
  o_scan, s_scan = jax.jit(lambda *xs: triadic_gdn(*xs, impl="scan"))(*args)
  assert rel_rms(o_auto, o_scan) < 2e-5 and rel_rms(s_auto, s_scan) < 2e-5


def test_jit_with_static_options():
  args = make_inputs(23, 1, 20, 1, 4, 4, 2)
  f = jax.jit(lambda *xs: triadic_gdn(*xs, impl="chunked", chunk_size=8))
  o, _ = f(*args)
  want, _ = triadic_reference(*args)
  assert rel_rms(o, want) < 2e-5


class TestErrors:
  args = make_inputs(0, 2, 10, 3, 4, 5, 2)

  def call(self, **replace):
    names = ["q", "k", "v", "k2", "q2", "g", "beta"]
    xs = dict(zip(names, self.args))
    opts = {n: replace.pop(n) for n in list(replace) if n not in names}
    xs.update(replace)
    return triadic_gdn(*(xs[n] for n in names), **opts)

  @pytest.mark.parametrize("name,shape,match", [
      ("q", (2, 10, 3), r"q must have rank 4 .*\(B, T, H, D\)"),
      ("beta", (2, 10, 3, 1), r"beta must have rank 3"),
      ("k", (2, 10, 3, 6), r"k must have shape \(B, T, H, D\)"),
      ("v", (2, 9, 3, 5), r"v must have shape \(B, T, H, V\)"),
      ("k2", (2, 10, 4, 2), r"k2 must have shape"),
      ("q2", (2, 10, 3, 3), r"q2 must have shape \(B, T, H, E\) = \(2, 10, 3, 2\)"),
      ("g", (2, 10, 3, 1), r"g must have shape \(B, T, H, E\)"),
      ("beta", (1, 10, 3), r"beta must have shape \(B, T, H\)"),
  ])
  def test_shapes(self, name, shape, match):
    with pytest.raises(ValueError, match=match):
      self.call(**{name: jnp.zeros(shape)})

  def test_positive_g(self):
    with pytest.raises(ValueError, match=r"g .* must be <= 0"):
      self.call(g=jnp.full((2, 10, 3, 2), 0.5))

  def test_unknown_impl(self):
    with pytest.raises(ValueError, match=r"impl must be one of"):
      self.call(impl="cuda")

  def test_initial_state_shape(self):
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, E, D, V\)"):
      self.call(initial_state=jnp.zeros((2, 3, 2, 4, 4)))

  def test_chunk_size(self):
    with pytest.raises(ValueError, match=r"chunk_size must be a positive int"):
      self.call(chunk_size=0)


@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_aligned_keys_stay_accurate(impl):
  """A repeated token: identical keys over a whole chunk, beta near 1, no decay. The UT system is
  then (I + ~ones strictly below), whose doubling-product inverse loses every float32 digit."""
  q, k, v, k2, q2, g, beta = make_inputs(29, 1, 96, 2, 8, 8, 2, decay=0.0)
  k = jnp.broadcast_to(k[:, :1], k.shape)
  k2 = jnp.broadcast_to(k2[:, :1], k2.shape)
  beta = jnp.full(beta.shape, 0.99)
  want_o, want_s = triadic_reference(q, k, v, k2, q2, g, beta)
  o, s = jax.jit(lambda *xs: triadic_gdn(*xs, impl=impl, chunk_size=64))(q, k, v, k2, q2, g, beta)
  assert rel_rms(o, want_o) < 2e-5 and rel_rms(s, want_s) < 2e-5


@pytest.mark.parametrize("erase", [True, False])
def test_prefill_then_decode_steps_continue_the_sequence(erase):
  """triadic_gdn over a prompt that ends mid-chunk, then triadic_gdn_step token by token, equals
  one pass over the whole sequence (outputs and final state)."""
  from triadic import triadic_gdn_step
  args = make_inputs(31, 2, 45, 2, 8, 6, 3)
  prompt = 37  # not a multiple of the chunk
  want_o, want_s = triadic_reference(*args, erase=erase)
  o, state = jax.jit(lambda *xs: triadic_gdn(*xs, erase=erase, impl="chunked", chunk_size=16))(
      *(x[:, :prompt] for x in args))
  outs = [o]
  step = jax.jit(lambda s, *xs: triadic_gdn_step(s, *xs, erase=erase))
  for t in range(prompt, 45):
    o_t, state = step(state, *(x[:, t] for x in args))
    outs.append(o_t[:, None])
  assert rel_rms(jnp.concatenate(outs, axis=1), want_o) < 2e-5
  assert rel_rms(state, want_s) < 2e-5


def test_step_rejects_bad_shapes():
  from triadic import triadic_gdn_step
  q, k, v, k2, q2, g, beta = (x[:, 0] for x in make_inputs(0, 1, 2, 2, 4, 4, 2))
  with pytest.raises(ValueError, match=r"state must have shape \(B, H, E, D, V\)"):
    triadic_gdn_step(jnp.zeros((1, 2, 3, 4, 4)), q, k, v, k2, q2, g, beta)


@pytest.mark.parametrize("t", [40, 64])
def test_jit_of_the_output_alone(t):
  """One chunk, only o used under jit: the case jaxlib 0.10's CPU YNNPACK fusions miscompile
  (triadic/xla_flags.py)."""
  args = make_inputs(37, 1, t, 4, 64, 64, 2)
  o = jax.jit(lambda *xs: triadic_gdn(*xs, impl="chunked", chunk_size=64)[0])(*args)
  want, _ = triadic_reference(*args)
  assert rel_rms(o, want) < 2e-5


def test_entry_points_set_the_xla_cpu_workaround_and_import_triadic_does_not():
  """``apply_cpu_workaround`` runs where processes start (train.py, eval.py, conftest), never on
  ``import triadic``: in fresh interpreters without XLA_FLAGS, only the entry point sets the flag."""
  import os
  import subprocess
  import sys

  import jaxlib

  from triadic.xla_flags import FLAG
  if not jaxlib.__version__.startswith("0.10."):
    pytest.skip("the workaround applies to jaxlib 0.10 only")
  assert FLAG in os.environ["XLA_FLAGS"]  # this process: tests/conftest.py
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = root

  def flags_after(statement):
    code = f"import os; {statement}; print(os.environ.get('XLA_FLAGS', ''))"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    return out.stdout.strip()

  assert FLAG not in flags_after("import triadic, merlin, lm.model")
  assert FLAG in flags_after("import train")
