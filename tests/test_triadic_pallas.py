"""impl="pallas": kernels (interpret mode on CPU) against the scan oracle; TPU and GPU lowering.

Every case checks the output, the final state and the gradients of all seven inputs and of the
initial state, through loss = sum(o * do) + sum(final_state * dS) with random do, dS.
Error bounds (relative RMS, ||a - b|| / ||b||):
  float32: 1e-4 for everything (measured ~1e-6: the kernels use full float32 matmuls).
  bfloat16 inputs (scan run on the same bf16-rounded values in float32): outputs 1.5e-2 (o is
  returned in bf16), final state 1e-2 and gradients 2e-2 (bf16 tensor-core operands in the kernels,
  chunk-start states kept in bf16).
Shapes are small (interpret mode is slow, CI has 2 cores) but odd: T not a multiple of the chunk,
E = 3 (padded to 4 inside), V = 48 (padded to 64), several value blocks per program.
The sharded case (batch and heads over a 2 x 2 mesh of fake CPU devices) runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triadic import triadic_gdn
from triadic.pallas.ops import triadic_pallas
from tests.util import rel_rms

jax.config.update("jax_default_matmul_precision", "highest")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BOUNDS = {jnp.float32: dict(out=1e-4, state=1e-4, grad=1e-4),
          jnp.bfloat16: dict(out=1.5e-2, state=1e-2, grad=2e-2)}
NAMES = ("q", "k", "v", "k2", "q2", "g", "beta", "initial_state")


def make_inputs(seed, b, t, h, d, vdim, e, *, decay, dtype):
  """Layer-like inputs: unit q, k; non-negative unit k2, q2; g = -decay * U(0, 1); beta in (0, 1);
  a random initial state."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  softplus = lambda x: np.log1p(np.exp(x))
  xs = [unit(rng.normal(size=(b, t, h, d))), unit(rng.normal(size=(b, t, h, d))),
        rng.normal(size=(b, t, h, vdim)), unit(softplus(rng.normal(size=(b, t, h, e)))),
        unit(softplus(rng.normal(size=(b, t, h, e)))), -decay * rng.uniform(size=(b, t, h, e)),
        1 / (1 + np.exp(-rng.normal(size=(b, t, h))))]
  xs = [jnp.asarray(x, jnp.float32).astype(dtype) for x in xs]
  h0 = jnp.asarray(0.3 * rng.normal(size=(b, h, e, d, vdim)), jnp.float32)
  do = jnp.asarray(rng.normal(size=(b, t, h, vdim)), jnp.float32)
  ds = jnp.asarray(rng.normal(size=(b, h, e, d, vdim)), jnp.float32)
  return xs + [h0], do, ds


def value_and_grads(impl, args, do, ds, *, erase, chunk_size):
  def loss(*a):
    o, s = triadic_gdn(*a[:7], initial_state=a[7], erase=erase, impl=impl, chunk_size=chunk_size)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * ds), (o, s)

  grad = jax.grad(loss, argnums=tuple(range(8)), has_aux=True)
  return jax.jit(grad)(*args)


CASES = [
    # b, t, h, d, v, e, chunk, erase, decay, dtype
    pytest.param(1, 50, 2, 16, 32, 1, 16, True, 1.0, jnp.float32, id="E1-T50-C16"),
    pytest.param(2, 100, 1, 32, 16, 3, 32, True, 1.0, jnp.float32, id="E3-T100-C32"),
    pytest.param(1, 50, 1, 16, 48, 3, 16, False, 1.0, jnp.float32, id="E3-V48-noerase"),
    pytest.param(1, 40, 1, 16, 16, 2, 16, True, 20.0, jnp.float32, id="E2-strong-decay"),
    pytest.param(1, 50, 2, 32, 32, 2, 32, True, 1.0, jnp.bfloat16, id="E2-bf16"),
]


@pytest.mark.parametrize("b,t,h,d,vdim,e,chunk,erase,decay,dtype", CASES)
def test_pallas_matches_scan(b, t, h, d, vdim, e, chunk, erase, decay, dtype):
  args, do, ds = make_inputs(0, b, t, h, d, vdim, e, decay=decay, dtype=dtype)
  grads, (o, s) = value_and_grads("pallas", args, do, ds, erase=erase, chunk_size=chunk)
  ref_args = [x.astype(jnp.float32) for x in args]
  ref_grads, (o_ref, s_ref) = value_and_grads("scan", ref_args, do, ds, erase=erase,
                                              chunk_size=chunk)
  bound = BOUNDS[dtype]
  assert o.dtype == dtype and o.shape == o_ref.shape
  assert s.dtype == jnp.float32 and s.shape == s_ref.shape
  assert rel_rms(o, o_ref) < bound["out"], rel_rms(o, o_ref)
  assert rel_rms(s, s_ref) < bound["state"], rel_rms(s, s_ref)
  for name, got, want, x in zip(NAMES, grads, ref_grads, args):
    assert got.shape == x.shape and got.dtype == x.dtype, name
    assert np.all(np.isfinite(np.asarray(got, np.float32))), name
    err = rel_rms(got, want)
    assert err < bound["grad"], f"d{name}: rel RMS {err:.2e}"


def test_unsupported_sizes_raise_under_pallas_and_fall_back_under_auto():
  args, _, _ = make_inputs(1, 1, 20, 1, 24, 16, 2, decay=1.0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="multiple of 16"):
    triadic_gdn(*args[:7], impl="pallas")
  o_auto, s_auto = triadic_gdn(*args[:7], impl="auto")
  o_ref, s_ref = triadic_gdn(*args[:7], impl="scan")
  assert rel_rms(o_auto, o_ref) < 1e-4 and rel_rms(s_auto, s_ref) < 1e-4
  args, _, _ = make_inputs(1, 1, 20, 1, 16, 16, 2, decay=1.0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="chunk_size"):
    triadic_gdn(*args[:7], impl="pallas", chunk_size=24)


@pytest.mark.parametrize("platform,target", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower(platform, target, dtype):
  """Forward and backward lower for TPU (Mosaic) and GPU (Triton) on this CPU machine.

  This checks the Pallas -> Mosaic / Triton IR lowering; Mosaic's own layout passes run only when
  a TPU compiles the kernel, which CI cannot do.
  """
  b, t, h, d, vdim, e = 1, 100, 2, 32, 64, 3
  spec = lambda *s, dt=dtype: jax.ShapeDtypeStruct(s, dt)
  args = [spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, vdim), spec(b, t, h, e),
          spec(b, t, h, e), spec(b, t, h, e), spec(b, t, h), spec(b, h, e, d, vdim, dt=jnp.float32)]

  def loss(*a):
    o, s = triadic_pallas(*a[:7], scale=d ** -0.5, initial_state=a[7], erase=True, chunk_size=32,
                          platform=platform)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  lowered = jax.jit(jax.grad(loss, argnums=tuple(range(8)))).trace(*args).lower(
      lowering_platforms=(target,))
  text = lowered.as_text()
  for kernel in ("triadic_chunk_prep", "triadic_forward", "triadic_backward_states",
                 "triadic_chunk_backward"):
    assert kernel in text, kernel


def test_aligned_keys_stay_accurate():
  """A repeated token (identical keys in a chunk, beta near 1): the UT inverse must stay exact."""
  args, do, ds = make_inputs(3, 1, 64, 1, 16, 16, 2, decay=0.0, dtype=jnp.float32)
  args[1] = jnp.broadcast_to(args[1][:, :1], args[1].shape)
  args[3] = jnp.broadcast_to(args[3][:, :1], args[3].shape)
  args[6] = jnp.full(args[6].shape, 0.99)
  grads, (o, s) = value_and_grads("pallas", args, do, ds, erase=True, chunk_size=64)
  ref_grads, (o_ref, s_ref) = value_and_grads("scan", args, do, ds, erase=True, chunk_size=64)
  assert rel_rms(o, o_ref) < 1e-4 and rel_rms(s, s_ref) < 1e-4
  for name, got, want in zip(NAMES, grads, ref_grads):
    assert rel_rms(got, want) < 1e-4, name


SHARDED_SCRIPT = textwrap.dedent("""
    import json, re, sys
    import jax, jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    jax.config.update("jax_default_matmul_precision", "highest")
    from tests.test_triadic_pallas import make_inputs, rel_rms, value_and_grads, NAMES
    from triadic import triadic_gdn

    b, t, h, d, vdim, e, chunk = 2, 40, 2, 16, 32, 2, 16
    args, do, ds = make_inputs(0, b, t, h, d, vdim, e, decay=1.0, dtype=jnp.float32)
    ref_grads, (o_ref, s_ref) = value_and_grads("scan", args, do, ds, erase=True, chunk_size=chunk)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    specs = [P("data", None, "tensor")] * 7 + [P("data", "tensor")]
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
    do = jax.device_put(do, NamedSharding(mesh, specs[0]))
    ds = jax.device_put(ds, NamedSharding(mesh, specs[-1]))
    report = {}
    for partitioner in ("shardy", "gspmd"):
      jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")

      def loss(*a):
        o, s = triadic_gdn(*a[:7], initial_state=a[7], impl="pallas", chunk_size=chunk)
        return jnp.sum(o * do) + jnp.sum(s * ds), (o, s)

      f = jax.jit(jax.grad(loss, argnums=tuple(range(8)), has_aux=True))
      hlo = f.lower(*sharded).compile().as_text()
      grads, (o, s) = f(*sharded)
      report[partitioner] = dict(
          errors={"o": rel_rms(o, o_ref), "state": rel_rms(s, s_ref),
                  **{"d" + n: rel_rms(g, r) for n, g, r in zip(NAMES, grads, ref_grads)}},
          # the kernels' merged (B*H, NC, C, X) layout: global B*H = 4, per device 1
          global_kernel_shape=bool(re.search(r"\\[4,3,16,", hlo)),
          local_kernel_shape=bool(re.search(r"\\[1,3,16,", hlo)),
          all_gathers=len(re.findall(r"all-gather", hlo)),
          sharded_like_inputs=[str(g.sharding.spec) == str(s) for g, s in zip(grads, specs)]
                              + [str(o.sharding.spec) == str(specs[0])])
    print("RESULT", json.dumps(report))
""")


def test_pallas_runs_per_shard_under_jit():
  """Batch over "data" and heads over "tensor" on 4 fake CPU devices, under Shardy and GSPMD:
  values and gradients match the unsharded scan, every device runs the kernels on its own
  (B/2, H/2) slice (no all-gather of the operands, no array of the global kernel layout), and
  outputs and gradients keep the inputs' sharding. In a subprocess so the device count flag
  stays out of this pytest session."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], cwd=ROOT, env=env, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
  report = json.loads(line[len("RESULT "):])
  bound = BOUNDS[jnp.float32]["grad"]
  for partitioner, r in report.items():
    for name, err in r["errors"].items():
      assert err < bound, f"{partitioner}: {name} rel RMS {err:.2e}"
    assert r["all_gathers"] == 0, (partitioner, r)
    assert not r["global_kernel_shape"] and r["local_kernel_shape"], (partitioner, r)
    assert all(r["sharded_like_inputs"]), (partitioner, r)
