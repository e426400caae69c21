"""Scan vs chunked triadic op, forward and forward+backward, over T and E, on whatever backend runs it.

    python benchmarks/triadic_ops.py                        # the issue's CPU case and a small sweep
    python benchmarks/triadic_ops.py --T 2048,8192 --E 1,4,8 --B 1 --H 4 --D 64
    python benchmarks/triadic_ops.py --impls chunked,chunked_sub --E 1,4,8,16  # the two mask forms

"chunked_sub" is the chunked op with the masks by sub-chunks of 16 (``triadic.chunked.
sub_chunk_masks``: matmuls across sub-chunks) instead of by their elementwise definition
(``chunk_masks``, C^2 E exponentials a chunk); any impl after the first gets a ratio column
against it.

Prints one table with the times of both impls side by side, their ratio, and each impl's
relative-RMS distance from the tests' float64 NumPy oracle on the same inputs (at the smallest T),
and names the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triadic.xla_flags import apply_cpu_workaround  # noqa: E402

apply_cpu_workaround()  # before the CPU backend starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import machine, triadic_inputs  # noqa: E402
from testkit.triadic_reference import triadic_reference  # noqa: E402
from triadic import triadic_gdn  # noqa: E402
from triadic.chunked import triadic_chunked  # noqa: E402


def op(impl, chunk):
  """(q, k, v, k2, q2, g, beta) -> o of ``impl``: an impl of ``triadic_gdn``, or "chunked_sub"."""
  if impl != "chunked_sub":
    return lambda *x: triadic_gdn(*x, impl=impl, chunk_size=chunk)[0]

  def run(q, k, v, k2, q2, g, beta):
    b, _, h, d = q.shape
    h0 = jnp.zeros((b, h, k2.shape[-1], d, v.shape[-1]), jnp.float32)
    return triadic_chunked(q, k, v, k2, q2, g, beta, scale=d ** -0.5, initial_state=h0,
                           erase=True, chunk_size=chunk, sub_chunk=16)[0].astype(q.dtype)

  return run


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
  base = impls[0]
  head += "".join(f" {base + '/' + i + ' f+b':>16}" for i in impls[1:]) + f" {'rel-RMS vs f64':>22}"
  print(head)
  smallest = min(int(x) for x in a.T.split(","))
  for t in (int(x) for x in a.T.split(",")):
    for e in (int(x) for x in a.E.split(",")):
      args = triadic_inputs(jax.random.PRNGKey(t * 31 + e), a.B, t, a.H, a.D, a.V, e, dtype)
      row, fwd_bwd_ms, errs = f"{t:>6} {e:>3} ", {}, []
      ref = triadic_reference(*args)[0] if t == smallest else None
      for impl in impls:
        f = op(impl, a.chunk)
        fwd = jax.jit(f)
        loss = lambda *x, f=f: jnp.sum(f(*x).astype(jnp.float32) ** 2)
        fwdbwd = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))))
        fwd_ms, fwd_bwd_ms[impl] = timed(fwd, args, a.reps), timed(fwdbwd, args, a.reps)
        row += f"{fwd_ms:>12.2f} {fwd_bwd_ms[impl]:>12.2f} "
        if ref is not None:
          out = np.asarray(fwd(*args), np.float64)
          errs.append(f"{impl}={np.linalg.norm(out - ref) / np.linalg.norm(ref):.1e}")
      row += "".join(f"{fwd_bwd_ms[base] / fwd_bwd_ms[i]:>16.2f}x" for i in impls[1:])
      print(row + "  " + " ".join(errs), flush=True)


if __name__ == "__main__":
  main()
