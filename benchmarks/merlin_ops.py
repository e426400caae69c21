"""Scan vs chunked multi-state attention with each aggregator, forward and forward+backward.

    python benchmarks/merlin_ops.py                                  # T = 1024, 4096 on this machine
    python benchmarks/merlin_ops.py --T 4096,16384 --B 2 --H 8 --D 128 --R 128 --max-segments 64

"scan" is the oracle (per-token scan of the N-state stack, running-sum moments); "chunked" is the
default (chunk-parallel stack, parallel moments). Each row times the whole aggregator + attention
pipeline, reports the compiled program's temporary memory (XLA ``memory_analysis``) and the
relative-RMS distance between the two outputs, and names the machine. Beside the times, the
floor of the chunked algorithm (``multistate_cost``: its matmul FLOPs at the matmul ceiling, or
its HBM bytes at the copy bandwidth, whichever is larger; both ceilings measured in the same run)
and the same for the single-state GDN op at this shape (``--floors`` off skips the ceilings).

On a CPU shared with other jobs, XLA's multi-threaded kernels stall under oversubscription (the
chunked form, which has the larger parallel ops, by up to 100x); pin one core for stable numbers:

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false" taskset -c 0 python benchmarks/merlin_ops.py --T 4096 --H 2 --D 32 --V 32 --R 32
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

import merlin  # noqa: E402
from benchmarks.common import ceilings, machine  # noqa: E402

MOMENTS = {"scan": "scan", "chunked": "parallel"}


def inputs(key, b, t, h, d, vdim, r, n):
  ks = jax.random.split(key, 10)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  return dict(
      q=unit(jax.random.normal(ks[0], (b, t, h, d))), k=unit(jax.random.normal(ks[1], (b, t, h, d))),
      v=jax.random.normal(ks[2], (b, t, h, vdim)), g=-0.1 * jax.random.uniform(ks[3], (b, t, h)),
      beta=jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))),
      qr=unit(jax.random.normal(ks[5], (b, t, h, r))), kr=unit(jax.random.normal(ks[6], (b, t, h, r))),
      gamma=jax.nn.sigmoid(jax.random.normal(ks[7], (b, t, h))),
      tau_mu=jnp.full((h,), r ** 0.5), tau_sigma=jnp.full((h,), float(r)),
      p=jax.random.normal(ks[8], (b, t, h, n)))


def pipeline(aggregator, impl, segment_len, n, chunk):
  """x (dict of arrays) -> o: the aggregator's lam, then multi-state attention."""
  def run(x):
    kw = dict(segment_len=segment_len, max_segments=n, impl=MOMENTS[impl])
    if aggregator == "vanilla":
      lam = merlin.vanilla_weights(*x["q"].shape[:3], n)
    elif aggregator == "position":
      lam = merlin.position_weights(x["p"], segment_len=segment_len)
    elif aggregator == "meanpool":
      lam = merlin.meanpool_weights(x["qr"], x["kr"], x["tau_mu"], **kw)
    else:
      lam = merlin.merlin_weights(x["qr"], x["kr"], x["gamma"], x["tau_mu"], x["tau_sigma"], **kw)
    return merlin.multistate_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], lam,
                                       segment_len=segment_len, impl=impl,
                                       chunk_size=None if impl == "scan" else chunk)
  return run


def multistate_cost(b, t, h, d, vd, r, segment_len, c, *, erase=True, aggregator="merlin",
                    itemsize=4):
  """(forward FLOPs, forward HBM bytes) of the chunk-parallel multi-state algorithm, counting the
  matmuls as 2 m n k and the bytes as every input read once and the output written once (the
  state stack kept on chip: the floor, not what the JAX form moves). Per chunk of C tokens and
  head, with n_i visible segment states at chunk i (n_i = i C // L + 1):

    intra-chunk (as the single state)   Q K^T and P Uv, 2 C^2 D + 2 C^2 V; with erase also
                                        K K^T, A [V | K] and P W, 2 C^2 (2 D + V)
    state stack                         erase: W S and Kw^T (W S) for every visible state,
                                        4 n_i C D V; the read Qe S over the stack, 2 n_i C D V;
                                        the current state's write Kw^T Uv, 2 C D V
    aggregator (merlin / meanpool)      per token and visible segment, r_mu = mu q' (2 R) and
                                        (merlin) r_sigma = q'^T Sigma q' (2 R^2); the moments'
                                        sums R + R^2 per token

  Forward+backward is counted as 3x forward. ``n_i = 1`` with no aggregator is the single-state
  GDN (``segment_len >= t``)."""
  n_chunks = -(-t // c)
  vis = sum(i * c // segment_len + 1 for i in range(n_chunks))   # sum over chunks of n_i
  per_head = n_chunks * (2 * c * c * d + 2 * c * c * vd)
  if erase:
    per_head += n_chunks * 2 * c * c * (2 * d + vd) + vis * 4 * c * d * vd
  per_head += vis * 2 * c * d * vd + n_chunks * 2 * c * d * vd
  if aggregator in ("merlin", "meanpool"):
    quad = r * r if aggregator == "merlin" else 0
    per_head += vis * c * (2 * r + 2 * quad) + t * (r + quad)
  flops = b * h * per_head
  n_states = -(-t // segment_len)
  per_token = (2 * d + vd) + 2 + n_states + vd          # q, k, v, g, beta, lam in; o out
  if aggregator in ("merlin", "meanpool"):
    per_token += 2 * r + 1
  return flops, b * t * h * per_token * itemsize


def measure(fn, x, repeats):
  """(median seconds, temp MiB, output) of a jitted fn; compile excluded."""
  compiled = jax.jit(fn).lower(x).compile()
  mem = compiled.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
  out = jax.block_until_ready(compiled(x))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(x))
    times.append(time.perf_counter() - start)
  return float(np.median(times)), (np.nan if temp is None else temp / 2 ** 20), out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--T", default="1024,4096", help="comma-separated sequence lengths")
  ap.add_argument("--B", type=int, default=1)
  ap.add_argument("--H", type=int, default=2)
  ap.add_argument("--D", type=int, default=64, help="key dim")
  ap.add_argument("--V", type=int, default=64, help="value dim")
  ap.add_argument("--R", type=int, default=32, help="d_r, the aggregator's key dim")
  ap.add_argument("--segment-len", type=int, default=256)
  ap.add_argument("--max-segments", type=int, default=0, help="N; 0 = just enough for the largest T")
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--aggregators", default=",".join(merlin.AGGREGATORS))
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--no-backward", action="store_true", help="forward only")
  ap.add_argument("--no-floors", action="store_true", help="skip the ceilings and floors")
  args = ap.parse_args(argv)

  lengths = [int(t) for t in args.T.split(",")]
  n = args.max_segments or -(-max(lengths) // args.segment_len)
  print(machine())
  print(f"B={args.B} H={args.H} D={args.D} V={args.V} R={args.R} L={args.segment_len} N={n} "
        f"C={args.chunk} float32; times in ms (median of {args.repeats}), temp = XLA temporary MiB")
  peak = hbm = None
  if not args.no_floors:
    gpu = jax.default_backend() == "gpu"
    peak, hbm = ceilings(8192 if gpu else 1024, jnp.bfloat16 if gpu else jnp.float32,
                         2048 if gpu else 256)
    print(f"ceilings measured now: matmul {peak:.1f} TFLOP/s, memory {hbm:.0f} GB/s; floor = "
          "max(counted FLOPs / matmul ceiling, counted bytes / memory ceiling), f+b = 3x fwd FLOPs")
  cols = ["aggregator", "T", "scan fwd", "chunk fwd", "x", "scan f+b", "chunk f+b", "x",
          "scan temp", "chunk temp", "rel err", "floor fwd", "floor f+b", "GDN floor f+b",
          "chunk f+b/floor"]
  print(" | ".join(f"{c:>10}" for c in cols))
  for t in lengths:
    x = inputs(jax.random.PRNGKey(t), args.B, t, args.H, args.D, args.V, args.R, n)
    cot = jax.random.normal(jax.random.PRNGKey(1), (args.B, t, args.H, args.V))
    for agg in args.aggregators.split(","):
      row = {}
      for impl in ("scan", "chunked"):
        fwd = pipeline(agg, impl, args.segment_len, n, args.chunk)
        row[impl, "fwd"], _, row[impl, "out"] = measure(fwd, x, args.repeats)
        if args.no_backward:
          row[impl, "fwd_bwd"], row[impl, "mem"] = np.nan, np.nan
          continue
        loss = lambda x, fwd=fwd: jnp.sum(cot * fwd(x))
        row[impl, "fwd_bwd"], row[impl, "mem"], _ = measure(jax.grad(loss), x, args.repeats)
      a, b = (np.asarray(row[i, "out"], np.float64) for i in ("chunked", "scan"))
      err = np.linalg.norm(a - b) / np.linalg.norm(b)
      vals = [agg, t, 1e3 * row["scan", "fwd"], 1e3 * row["chunked", "fwd"],
              row["scan", "fwd"] / row["chunked", "fwd"], 1e3 * row["scan", "fwd_bwd"],
              1e3 * row["chunked", "fwd_bwd"], row["scan", "fwd_bwd"] / row["chunked", "fwd_bwd"],
              row["scan", "mem"], row["chunked", "mem"], err]
      if peak:
        floor = lambda fl, by, mult: 1e3 * max(mult * fl / (peak * 1e12), by / (hbm * 1e9))
        dims = (args.B, t, args.H, args.D, args.V, args.R)
        fl, by = multistate_cost(*dims, args.segment_len, args.chunk, aggregator=agg)
        gfl, gby = multistate_cost(*dims, t, args.chunk, aggregator="vanilla")
        fb = floor(fl, by, 3)
        vals += [floor(fl, by, 1), fb, floor(gfl, gby, 3), 1e3 * row["chunked", "fwd_bwd"] / fb]
      else:
        vals += [np.nan] * 4
      print(" | ".join(f"{v:>10}" if isinstance(v, (str, int)) else
                       (f"{v:>10.1e}" if v is err else f"{v:>10.1f}") for v in vals), flush=True)


if __name__ == "__main__":
  main()
