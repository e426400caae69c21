"""Random inputs of ``triadic_gdn`` and the check of an implementation's values and gradients
against the scan oracle (shared by the op, Pallas and Mosaic tests)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from testkit.metrics import rel_rms
from triadic import triadic_gdn

# The inputs value_and_grads differentiates, in order.
NAMES = ("q", "k", "v", "k2", "q2", "g", "beta", "initial_state")
# Relative RMS bounds of the Pallas kernels against scan, by input dtype: float32 kernels use full
# float32 matmuls; bfloat16 ones bf16 tensor-core operands and chunk-start states kept in bf16.
PALLAS_BOUNDS = {jnp.float32: dict(out=1e-4, state=1e-4, grad=1e-4),
                 jnp.bfloat16: dict(out=1.5e-2, state=1e-2, grad=2e-2)}


def _draw(rng, b, t, h, d, vdim, e, decay):
  """Layer-like values in float64: unit q, k; non-negative unit k2, q2; g = -decay * U(0, 1);
  beta in (0, 1)."""
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  softplus = lambda x: np.log1p(np.exp(x))
  return [unit(rng.normal(size=(b, t, h, d))), unit(rng.normal(size=(b, t, h, d))),
          rng.normal(size=(b, t, h, vdim)), unit(softplus(rng.normal(size=(b, t, h, e)))),
          unit(softplus(rng.normal(size=(b, t, h, e)))), -decay * rng.uniform(size=(b, t, h, e)),
          1 / (1 + np.exp(-rng.normal(size=(b, t, h))))]


def _cast(x, dtype):
  return jnp.asarray(x, jnp.float32).astype(dtype)


def make_inputs(seed, b, t, h, d, vdim, e, *, decay=1.0, dtype=jnp.float32,
                gates_dtype=jnp.float32):
  """(q, k, v, k2, q2, g, beta) of ``triadic_gdn``: q, k (B, T, H, D), v (B, T, H, V), k2, q2, g
  (B, T, H, E), beta (B, T, H); q, k, v, k2, q2 in ``dtype``, g and beta in ``gates_dtype``."""
  xs = _draw(np.random.default_rng(seed), b, t, h, d, vdim, e, decay)
  return tuple(_cast(x, dtype) for x in xs[:5]) + tuple(_cast(x, gates_dtype) for x in xs[5:])


def make_grad_inputs(seed, b, t, h, d, vdim, e, *, decay, dtype):
  """``make_inputs`` (every input in ``dtype``) plus a random initial state (B, H, E, D, V), and
  the cotangents do (B, T, H, V), dS (B, H, E, D, V): (args, do, ds), args a list of eight."""
  rng = np.random.default_rng(seed)
  xs = [_cast(x, dtype) for x in _draw(rng, b, t, h, d, vdim, e, decay)]
  h0 = jnp.asarray(0.3 * rng.normal(size=(b, h, e, d, vdim)), jnp.float32)
  do = jnp.asarray(rng.normal(size=(b, t, h, vdim)), jnp.float32)
  ds = jnp.asarray(rng.normal(size=(b, h, e, d, vdim)), jnp.float32)
  return xs + [h0], do, ds


def value_and_grads(impl, args, do, ds, *, erase, chunk_size, config=None):
  """Gradients of all eight inputs and (o, final state), through
  loss = sum(o * do) + sum(final_state * dS); ``config`` runs ``triadic_pallas`` with those launch
  choices (e.g. the TPU structure in interpret mode) instead of ``impl``."""
  def loss(*a):
    if config is None:
      o, s = triadic_gdn(*a[:7], initial_state=a[7], erase=erase, impl=impl,
                         chunk_size=chunk_size)
    else:
      from triadic.pallas.ops import triadic_pallas
      o, s = triadic_pallas(*a[:7], scale=a[0].shape[-1] ** -0.5, initial_state=a[7],
                            erase=erase, chunk_size=chunk_size, config=config)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * ds), (o, s)

  grad = jax.grad(loss, argnums=tuple(range(8)), has_aux=True)
  return jax.jit(grad)(*args)


def check_against_scan(b, t, h, d, vdim, e, chunk, erase, decay, dtype, config=None):
  """impl="pallas" (or ``config``) against scan on the same values (bf16 inputs rounded, then
  float32): outputs, final state and all eight gradients within ``PALLAS_BOUNDS[dtype]``."""
  args, do, ds = make_grad_inputs(0, b, t, h, d, vdim, e, decay=decay, dtype=dtype)
  got = value_and_grads("pallas", args, do, ds, erase=erase, chunk_size=chunk, config=config)
  assert_matches_scan(got, args, do, ds, erase=erase, chunk_size=chunk)


def assert_matches_scan(got, args, do, ds, *, erase, chunk_size):
  """``got``, ``value_and_grads``' result for ``args`` (in one dtype), against the scan's on the
  same values (bf16 inputs rounded, then float32): outputs, final state and all eight gradients
  within ``PALLAS_BOUNDS`` of the inputs' dtype."""
  grads, (o, s) = got
  dtype = args[0].dtype
  ref_args = [x.astype(jnp.float32) for x in args]
  ref_grads, (o_ref, s_ref) = value_and_grads("scan", ref_args, do, ds, erase=erase,
                                              chunk_size=chunk_size)
  bound = PALLAS_BOUNDS[dtype.type]
  assert o.dtype == dtype and o.shape == o_ref.shape
  assert s.dtype == jnp.float32 and s.shape == s_ref.shape
  assert rel_rms(o, o_ref) < bound["out"], rel_rms(o, o_ref)
  assert rel_rms(s, s_ref) < bound["state"], rel_rms(s, s_ref)
  for name, got, want, x in zip(NAMES, grads, ref_grads, args):
    assert got.shape == x.shape and got.dtype == x.dtype, name
    assert np.all(np.isfinite(np.asarray(got, np.float32))), name
    err = rel_rms(got, want)
    assert err < bound["grad"], f"d{name}: rel RMS {err:.2e}"


def cuda_lowering_text(config, b, t, h, d, vdim, e, *, erase=True, chunk_size=64):
  """The StableHLO text of the op's forward and backward under ``config`` (bf16 inputs), lowered
  for CUDA on this machine: what kernels a GPU would run."""
  from triadic.pallas.ops import triadic_pallas
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
  args = [spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, vdim), spec(b, t, h, e),
          spec(b, t, h, e), spec(b, t, h, e), spec(b, t, h), spec(b, h, e, d, vdim, dt=jnp.float32)]

  def loss(*a):
    o, s = triadic_pallas(*a[:7], scale=d ** -0.5, initial_state=a[7], erase=erase,
                          chunk_size=chunk_size, config=config)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  return jax.jit(jax.grad(loss, argnums=tuple(range(8)))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()


def bf16_transposes(text, b, t, h, x) -> int:
  """The stablehlo.transpose ops of a lowered program on bf16 arrays of B * T * H * X elements:
  the relayouts of q, k, v, o, dO and their gradients."""
  size = b * t * h * x
  count = 0
  for m in re.finditer(r"stablehlo\.transpose .*?: \(tensor<([0-9x]+)xbf16>\)", text):
    count += int(np.prod([int(n) for n in m.group(1).split("x")])) == size
  return count


def transposes_an_argument(text, shape=None) -> bool:
  """Whether a lowered program transposes one of its arguments (``stablehlo.transpose %argN``)
  before the kernels; with ``shape`` (leading dims), one of that shape only (the split tail's
  plain-JAX masks transpose the small (C, E) float32 operands in either layout)."""
  if shape is None:
    return re.search(r"stablehlo\.transpose %arg\d+", text) is not None
  dims = "x".join(map(str, shape))
  return re.search(rf"stablehlo\.transpose %arg\d+, [^\n]*: \(tensor<{dims}x", text) is not None
