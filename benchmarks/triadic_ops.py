"""Scan vs chunked triadic op, forward and forward+backward, over T and E, on whatever backend runs it.

    python benchmarks/triadic_ops.py                        # the issue's CPU case and a small sweep
    python benchmarks/triadic_ops.py --T 2048,8192 --E 1,4,8 --B 1 --H 4 --D 64

Prints one table with the times of both impls side by side, their ratio, and each impl's
relative-RMS distance from a float64 NumPy oracle on the same inputs (checked at the smallest T),
and names the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from triadic import triadic_gdn  # noqa: E402


def machine() -> str:
  dev = jax.devices()[0]
  return (f"{platform.node()} | {dev.platform} {dev.device_kind} x{jax.device_count()} | "
          f"{os.cpu_count()} CPUs | jax {jax.__version__}")


def inputs(key, b, t, h, d, vdim, e, dtype):
  ks = jax.random.split(key, 7)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t, h, d)))
  k = unit(jax.random.normal(ks[1], (b, t, h, d)))
  v = jax.random.normal(ks[2], (b, t, h, vdim))
  k2 = unit(jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, e))))
  q2 = unit(jax.nn.softplus(jax.random.normal(ks[4], (b, t, h, e))))
  g = -0.1 * jax.random.uniform(ks[5], (b, t, h, e))
  beta = jax.nn.sigmoid(jax.random.normal(ks[6], (b, t, h)))
  return tuple(x.astype(dtype) for x in (q, k, v, k2, q2)) + (g, beta)


def oracle(q, k, v, k2, q2, g, beta):
  """float64 NumPy per-token loop (SPEC section 1), for the accuracy column."""
  q, k, v, k2, q2, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, k2, q2, g, beta))
  b, t, h, d = q.shape
  s = np.zeros((b, h, k2.shape[-1], d, v.shape[-1]))
  o = np.zeros(v.shape)
  for i in range(t):
    s *= np.exp(g[:, i])[..., None, None]
    r = np.einsum("bhe,bhd,bhedv->bhv", k2[:, i], k[:, i], s)
    u = beta[:, i, :, None] * (v[:, i] - r)
    s += np.einsum("bhe,bhd,bhv->bhedv", k2[:, i], k[:, i], u)
    o[:, i] = q.shape[-1] ** -0.5 * np.einsum("bhe,bhd,bhedv->bhv", q2[:, i], q[:, i], s)
  return o


def timed(fn, args, reps):
  jax.block_until_ready(fn(*args))  # compile + warm up
  best = float("inf")
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best * 1e3


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--T", default="512,2048")
  p.add_argument("--E", default="1,4,8")
  p.add_argument("--B", type=int, default=1)
  p.add_argument("--H", type=int, default=4)
  p.add_argument("--D", type=int, default=64)
  p.add_argument("--V", type=int, default=64)
  p.add_argument("--chunk", type=int, default=64)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--impls", default="scan,chunked")
  a = p.parse_args()
  impls = a.impls.split(",")
  dtype = jnp.dtype(a.dtype)
  print(f"machine: {machine()}")
  print(f"B={a.B} H={a.H} D={a.D} V={a.V} chunk={a.chunk} dtype={a.dtype}; times in ms (best of {a.reps})")
  head = f"{'T':>6} {'E':>3} " + " ".join(f"{i + ' fwd':>12} {i + ' f+b':>12}" for i in impls)
  head += "".join(f" {'scan/' + i + ' f+b':>16}" for i in impls if i != "scan") + f" {'rel-RMS vs f64':>22}"
  print(head)
  smallest = min(int(x) for x in a.T.split(","))
  for t in (int(x) for x in a.T.split(",")):
    for e in (int(x) for x in a.E.split(",")):
      args = inputs(jax.random.PRNGKey(t * 31 + e), a.B, t, a.H, a.D, a.V, e, dtype)
      row, fb, errs = f"{t:>6} {e:>3} ", {}, []
      ref = oracle(*args) if t == smallest else None
      for impl in impls:
        fwd = jax.jit(lambda *x, impl=impl: triadic_gdn(*x, impl=impl, chunk_size=a.chunk)[0])
        loss = lambda *x, impl=impl: jnp.sum(triadic_gdn(*x, impl=impl, chunk_size=a.chunk)[0]
                                             .astype(jnp.float32) ** 2)
        fwdbwd = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))))
        tf, fb[impl] = timed(fwd, args, a.reps), timed(fwdbwd, args, a.reps)
        row += f"{tf:>12.2f} {fb[impl]:>12.2f} "
        if ref is not None:
          out = np.asarray(fwd(*args), np.float64)
          errs.append(f"{impl}={np.linalg.norm(out - ref) / np.linalg.norm(ref):.1e}")
      row += "".join(f"{fb['scan'] / fb[i]:>16.1f}x" for i in impls if i != "scan" and "scan" in fb)
      print(row + "  " + " ".join(errs), flush=True)


if __name__ == "__main__":
  main()
