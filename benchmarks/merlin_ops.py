"""Multi-state attention's impls (scan, chunked, pallas) against the single-state GDN op.

    python benchmarks/merlin_ops.py                                  # T = 1024, 4096 on this machine
    python benchmarks/merlin_ops.py --impls chunked,pallas --dtype bfloat16 --T 2048,16384 \
        --B 1 --H 16 --D 128 --V 128 --R 128 --segment-len 256 --aggregators merlin   # a GPU

Two tables. The op table times ``multistate_attention`` alone (lam fixed, from the MERLIN
aggregator) forward and forward+backward for each of ``--impls``, the single-state GDN op at the
same shape (``triadic_gdn`` with E = 1: its Pallas kernels on GPU, chunked elsewhere) and, where
``fla`` imports (CUDA torch), FLA's ``chunk_log_linear_attn`` (log-linear Mamba-2, no erase; its
own level count). Beside every time its floor: ``multistate_cost``'s matmul FLOPs at the matmul
ceiling or its HBM bytes at the copy bandwidth, whichever is larger, both ceilings measured in the
same run (``--no-floors`` skips them). The pipeline table times each aggregator + attention for
each impl (moments "scan" for impl "scan", else "parallel"), the compiled program's temporary
memory (XLA ``memory_analysis``) and the relative-RMS distance of each impl's output to the first
impl's. Every table names the machine, and the op table prints the plan "auto" would follow.

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
from merlin.pallas import plan as merlin_plan  # noqa: E402
from triadic import triadic_gdn  # noqa: E402


def moments_impl(impl):
  return "scan" if impl == "scan" else "parallel"


def inputs(key, b, t, h, d, vdim, r, n, dtype=jnp.float32):
  """Layer-like inputs: unit q, k (and the aggregator's qr, kr), weak decay, beta in (0, 1);
  q, k, v in ``dtype``, the rest float32."""
  ks = jax.random.split(key, 10)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  return dict(
      q=unit(jax.random.normal(ks[0], (b, t, h, d))).astype(dtype),
      k=unit(jax.random.normal(ks[1], (b, t, h, d))).astype(dtype),
      v=jax.random.normal(ks[2], (b, t, h, vdim)).astype(dtype),
      g=-0.1 * jax.random.uniform(ks[3], (b, t, h)),
      beta=jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))),
      qr=unit(jax.random.normal(ks[5], (b, t, h, r))), kr=unit(jax.random.normal(ks[6], (b, t, h, r))),
      gamma=jax.nn.sigmoid(jax.random.normal(ks[7], (b, t, h))),
      tau_mu=jnp.full((h,), r ** 0.5), tau_sigma=jnp.full((h,), float(r)),
      p=jax.random.normal(ks[8], (b, t, h, n)))


def weights(aggregator, x, segment_len, n, moments):
  """lam (B, T, H, N) of ``aggregator`` on inputs ``x``."""
  kw = dict(segment_len=segment_len, max_segments=n, impl=moments)
  if aggregator == "vanilla":
    return merlin.vanilla_weights(*x["q"].shape[:3], n)
  if aggregator == "position":
    return merlin.position_weights(x["p"], segment_len=segment_len)
  if aggregator == "meanpool":
    return merlin.meanpool_weights(x["qr"], x["kr"], x["tau_mu"], **kw)
  return merlin.merlin_weights(x["qr"], x["kr"], x["gamma"], x["tau_mu"], x["tau_sigma"], **kw)


def attention(impl, segment_len, chunk):
  """(x, lam) -> o: multi-state attention of ``impl``."""
  def run(x, lam):
    return merlin.multistate_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], lam,
                                       segment_len=segment_len, impl=impl,
                                       chunk_size=None if impl == "scan" else chunk)
  return run


def pipeline(aggregator, impl, segment_len, n, chunk):
  """x (dict of arrays) -> o: the aggregator's lam, then multi-state attention."""
  op = attention(impl, segment_len, chunk)
  return lambda x: op(x, weights(aggregator, x, segment_len, n, moments_impl(impl)))


def single_state(chunk, gpu):
  """(x, lam) -> o: the single-state GDN op (``triadic_gdn``, E = 1) on x's q, k, v, g, beta."""
  def run(x, lam):
    ones = jnp.ones(x["q"].shape[:3] + (1,), x["q"].dtype)
    return triadic_gdn(x["q"], x["k"], x["v"], ones, ones, x["g"][..., None], x["beta"],
                       impl="pallas" if gpu else "chunked", chunk_size=chunk)[0]
  return run


def fla_log_linear(x, reps):
  """(fwd ms, f+b ms) of FLA's ``chunk_log_linear_attn`` on x's q, k, v, g (level scales 1), or
  the reason it did not run."""
  try:
    import torch
    from fla.ops.log_linear_attn import chunk_log_linear_attn
  except ImportError as err:
    return f"{type(err).__name__}: {err}"[:120]
  if not torch.cuda.is_available():
    return "torch without CUDA"
  from benchmarks.peers import _time_cuda
  try:
    q, k, v = (torch.from_dlpack(x[n]).clone() for n in ("q", "k", "v"))
    g = torch.from_dlpack(x["g"]).float().clone()
    t = q.shape[1]
    levels = max(1, (t - 1).bit_length()) + 1
    scales = torch.ones(q.shape[:3] + (levels,), device=q.device, dtype=q.dtype)
    with torch.no_grad():
      fwd = _time_cuda(torch, lambda: chunk_log_linear_attn(q, k, v, g, scales), reps)
    leaves = [y.detach().requires_grad_(True) for y in (q, k, v, g, scales)]
    do = torch.ones_like(v)
    fb = _time_cuda(torch, lambda: chunk_log_linear_attn(*leaves)[0].backward(do), reps)
    return fwd, fb
  except Exception as err:  # a peer that fails on this shape is reported, not fatal
    return f"{type(err).__name__}: {err}"[:120]


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


def measure(fn, args, repeats):
  """(median seconds, temp MiB, output) of a jitted fn; compile excluded."""
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
  out = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)), (np.nan if temp is None else temp / 2 ** 20), out


def fwd_and_fwd_bwd(fn, args, cot, repeats, backward):
  """(fwd s, f+b s, f+b temp MiB, output) of fn(*args); the f+b is the gradient of sum(cot * o)
  with respect to every array argument."""
  fwd, _, out = measure(fn, args, repeats)
  if not backward:
    return fwd, np.nan, np.nan, out
  # cot is an argument, not a closure: a captured array would be a constant of the program,
  # which XLA then folds at compile time.
  loss = lambda cot, *a: jnp.sum(cot * fn(*a).astype(jnp.float32))
  fb, mem, _ = measure(jax.grad(loss, argnums=tuple(range(1, len(args) + 1))), (cot, *args),
                       repeats)
  return fwd, fb, mem, out


def rel_err(a, b):
  a, b = (np.asarray(x, np.float64) for x in (a, b))
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def fmt(v):
  if isinstance(v, str):
    return f"{v:>20}"
  if isinstance(v, int):
    return f"{v:>12}"
  return f"{v:>12.1e}" if 0 < abs(v) < 0.05 else f"{v:>12.2f}"


def op_table(args, lengths, dtype, floor_ms):
  """The op table: each impl, the single-state GDN op and FLA's log-linear attention. N is
  ``--max-segments`` or, per T, just the segments T needs."""
  gpu = jax.default_backend() == "gpu"
  print(merlin_plan.explain(args.D, args.segment_len, chunk_size=args.chunk))
  cols = ["op", "T", "fwd", "f+b", "floor fwd", "floor f+b", "f+b/floor", "f+b/GDN", "rel err"]
  print(" | ".join(f"{c:>{20 if i == 0 else 12}}" for i, c in enumerate(cols)))
  backward = not args.no_backward
  for t in lengths:
    n = args.max_segments or -(-t // args.segment_len)
    x = inputs(jax.random.PRNGKey(t), args.B, t, args.H, args.D, args.V, args.R, n, dtype)
    lam = jax.jit(lambda x: weights("merlin", x, args.segment_len, n, "parallel"))(x)
    cot = jax.random.normal(jax.random.PRNGKey(1), (args.B, t, args.H, args.V))
    dims = (args.B, t, args.H, args.D, args.V, args.R)
    item = jnp.dtype(dtype).itemsize
    cost = multistate_cost(*dims, args.segment_len, args.chunk, aggregator="vanilla",
                           itemsize=item)
    gdn_cost = multistate_cost(*dims, t, args.chunk, aggregator="vanilla", itemsize=item)
    gdn = fwd_and_fwd_bwd(single_state(args.chunk, gpu), (x, lam), cot, args.repeats, backward)
    rows = [("gdn E=1 " + ("pallas" if gpu else "chunked"), gdn, gdn_cost)]
    ref = None
    for impl in args.impls.split(","):
      res = fwd_and_fwd_bwd(attention(impl, args.segment_len, args.chunk), (x, lam), cot,
                            args.repeats, backward)
      ref = res[3] if ref is None else ref
      rows.append((f"multistate {impl}", res, cost))
    for name, (fwd, fb, _, out), (fl, by) in rows:
      ffwd, ffb = floor_ms(fl, by, 1), floor_ms(fl, by, 3)
      err = rel_err(out, ref) if name.startswith("multistate") else np.nan
      print(" | ".join(fmt(v) for v in (name, t, 1e3 * fwd, 1e3 * fb, ffwd, ffb, 1e3 * fb / ffb,
                                         fb / gdn[1], err)), flush=True)
    peer = fla_log_linear(x, args.repeats)
    if isinstance(peer, str):
      print(f"{'fla log-linear':>20} | {t:>12} | not run: {peer}")
    else:
      print(" | ".join(fmt(v) for v in ("fla log-lin", t, *peer, np.nan, np.nan, np.nan,
                                         peer[1] / (1e3 * gdn[1]), np.nan)), flush=True)


def pipeline_table(args, lengths, n, dtype, floor_ms):
  """The pipeline table: each aggregator + attention for each impl."""
  impls = args.impls.split(",")
  cols = ["aggregator", "T"] + [f"{i} {w}" for i in impls for w in ("fwd", "f+b", "temp")]
  cols += [f"err {i}" for i in impls[1:]] + ["floor fwd", "floor f+b"]
  print(" | ".join(f"{c:>{20 if i == 0 else 12}}" for i, c in enumerate(cols)))
  for t in lengths:
    x = inputs(jax.random.PRNGKey(t), args.B, t, args.H, args.D, args.V, args.R, n, dtype)
    cot = jax.random.normal(jax.random.PRNGKey(1), (args.B, t, args.H, args.V))
    for agg in args.aggregators.split(","):
      vals, outs = [agg, t], []
      for impl in impls:
        fwd, fb, mem, out = fwd_and_fwd_bwd(pipeline(agg, impl, args.segment_len, n, args.chunk),
                                            (x,), cot, args.repeats, not args.no_backward)
        vals += [1e3 * fwd, 1e3 * fb, mem]
        outs.append(out)
      vals += [rel_err(o, outs[0]) for o in outs[1:]]
      fl, by = multistate_cost(args.B, t, args.H, args.D, args.V, args.R, args.segment_len,
                               args.chunk, aggregator=agg, itemsize=jnp.dtype(dtype).itemsize)
      vals += [floor_ms(fl, by, 1), floor_ms(fl, by, 3)]
      print(" | ".join(fmt(v) for v in vals), flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--T", default="1024,4096", help="comma-separated sequence lengths")
  ap.add_argument("--B", type=int, default=1)
  ap.add_argument("--H", type=int, default=2)
  ap.add_argument("--D", type=int, default=64, help="key dim")
  ap.add_argument("--V", type=int, default=64, help="value dim")
  ap.add_argument("--R", type=int, default=32, help="d_r, the aggregator's key dim")
  ap.add_argument("--segment-len", type=int, default=256)
  ap.add_argument("--max-segments", type=int, default=0,
                  help="N; 0 = just enough for each T (op table) or the largest T (pipeline table)")
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--impls", default="scan,chunked",
                  help="comma-separated multistate_attention impls; the first is the reference "
                       "of the error columns")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                  help="dtype of q, k, v")
  ap.add_argument("--aggregators", default=",".join(merlin.AGGREGATORS),
                  help="the pipeline table's aggregators; empty: no pipeline table")
  ap.add_argument("--no-op-table", action="store_true", help="skip the op table")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--no-backward", action="store_true", help="forward only")
  ap.add_argument("--no-floors", action="store_true", help="skip the ceilings and floors")
  args = ap.parse_args(argv)

  lengths = [int(t) for t in args.T.split(",")]
  n = args.max_segments or -(-max(lengths) // args.segment_len)
  dtype = jnp.dtype(args.dtype)
  print(machine())
  print(f"B={args.B} H={args.H} D={args.D} V={args.V} R={args.R} L={args.segment_len} "
        f"N={n} (pipeline) C={args.chunk} {dtype.name}; times in ms (median of {args.repeats}), temp = XLA "
        "temporary MiB of the f+b")
  floor_ms = lambda fl, by, mult: np.nan
  if not args.no_floors:
    gpu = jax.default_backend() == "gpu"
    peak, hbm = ceilings(8192 if gpu else 1024, jnp.bfloat16 if gpu else jnp.float32,
                         2048 if gpu else 256)
    print(f"ceilings measured now: matmul {peak:.1f} TFLOP/s, memory {hbm:.0f} GB/s; floor = "
          "max(counted FLOPs / matmul ceiling, counted bytes / memory ceiling), f+b = 3x fwd")
    floor_ms = lambda fl, by, mult: 1e3 * max(mult * fl / (peak * 1e12), by / (hbm * 1e9))
  if not args.no_op_table:
    op_table(args, lengths, dtype, floor_ms)
  if args.aggregators:
    pipeline_table(args, lengths, n, dtype, floor_ms)


if __name__ == "__main__":
  main()
