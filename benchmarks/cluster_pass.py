"""The cluster state passes (``triadic.pallas.mosaic_cluster``: one block a slice, the sums over e
through distributed shared memory) against the value-split Mosaic GPU passes
(``mosaic.state_pass`` and ``reverse_state_pass``, the op's default), the forward as the op's
primal (o and the final state) and with the backward's residuals, the reverse pass with A^T dU
and dV where erase (as the op runs them).

First the accuracy of the cluster passes against the value-split ones on the same operands
(relative RMS of every output; the two round differently: bf16 parts of sum_e Y_e, diag(fw_e) K
instead of diag(fw_e) U as the rounded operand), then the time of both at the benchmark shape,
and the ratio. GPU only (H100 / H200).

  python benchmarks/cluster_pass.py --e 8 4 --t 16384 --passes forward
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import machine, median_ms, triadic_inputs  # noqa: E402
from testkit import rel_rms as rel  # noqa: E402
from triadic.pallas import mosaic, mosaic_cluster  # noqa: E402
from triadic.pallas.chunk_prep import chunk_prep  # noqa: E402
from triadic.pallas.ops import default_config, kernel_layout  # noqa: E402

C = 64


def operands(key, b, t, h, d, e, *, erase, decay):
  """The state passes' operands in the kernel layout, A and P from ``chunk_prep``, h0 random."""
  q, k, v, k2, q2, g, beta = triadic_inputs(key, b, t, h, d, d, e, jnp.bfloat16)
  g = g * decay
  nc = t // C
  merge = lambda x: x.reshape(b * h, *x.shape[2:])
  q, k, v = (merge(kernel_layout(x, nc, C)) for x in (q, k, v))
  k2, q2, g, beta = (merge(kernel_layout(x.astype(jnp.float32), nc, C)) for x in (k2, q2, g, beta))
  cfg = default_config("gpu", e, v.shape[-1], hopper=True)
  prep = chunk_prep(q, k, k2, q2, g, beta, erase=erase, cfg=cfg)
  gc, a, p = prep[0], prep[2], prep[3]
  h0 = 0.3 * jax.random.normal(jax.random.fold_in(key, 1), (b * h, e, d, d), jnp.float32)
  return q, k, v, k2, q2, gc, beta, a, p, h0


def passes(e, d, *, erase, scale, residuals):
  bv, wgs, _ = mosaic.default_state_tiles(d, d, C, e)
  split = jax.jit(functools.partial(mosaic.state_pass, scale=scale, erase=erase, block_v=bv,
                                    warpgroups=wgs, residuals=residuals))
  cluster = jax.jit(functools.partial(mosaic_cluster.state_pass, scale=scale, erase=erase,
                                      residuals=residuals))
  return split, cluster, f"block_v {bv}, {wgs} warpgroup(s)"


def reverse_passes(e, d, *, erase, scale):
  """The reverse passes as the op runs them: with A^T dU and dV (``save_drhs``) where erase."""
  bv, _, wgs = mosaic.default_state_tiles(d, d, C, e)
  split = jax.jit(functools.partial(mosaic.reverse_state_pass, scale=scale, erase=erase,
                                    block_v=bv, warpgroups=wgs, save_drhs=erase))
  cluster = jax.jit(functools.partial(mosaic_cluster.reverse_state_pass, scale=scale,
                                      erase=erase, save_drhs=erase))
  return split, cluster, f"block_v {bv}, {wgs} warpgroup(s)"


def reverse_operands(ops, key):
  """The forward operands with v replaced by a random dO and h0 by a random dht."""
  q, k, v, *rest, h0 = ops
  do = jax.random.normal(key, v.shape, jnp.float32).astype(v.dtype)
  dht = jax.random.normal(jax.random.fold_in(key, 1), h0.shape, jnp.float32)
  return (q, k, do, *rest, dht)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--e", type=int, nargs="+", default=[8, 4])
  ap.add_argument("--b", type=int, default=2)
  ap.add_argument("--h", type=int, default=16)
  ap.add_argument("--t", type=int, default=16384)
  ap.add_argument("--d", type=int, default=128)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--no-erase", action="store_true")
  ap.add_argument("--passes", nargs="+", choices=("forward", "reverse"),
                  default=["forward", "reverse"],
                  help="which passes (one per call: a pass that hangs then stops only itself)")
  args = ap.parse_args()
  erase = not args.no_erase
  scale = args.d ** -0.5
  print(f"# {machine()}")
  print("| E | case | o / dU | U / A^T dU | chunk-start states / dV | final state / dstates | "
        "dh0 | value-split ms | cluster ms | cluster / value-split |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  cases = ((1, 4, 2048, 1.0), (1, 2, 1024, 30.0))      # (B, H, T, decay scale) of the checks
  for e in args.e:
    checks = [operands(jax.random.key(e), b, t, h, args.d, e, erase=erase, decay=decay)
              for b, h, t, decay in cases]
    ops = operands(jax.random.key(0), args.b, args.t, args.h, args.d, e, erase=erase, decay=1.0)
    if "forward" in args.passes:        # checked, then timed
      split, cluster, _ = passes(e, args.d, erase=erase, scale=scale, residuals=True)
      for (b, h, t, decay), ops_c in zip(cases, checks):
        rels = " | ".join(f"{rel(x, y):.1e}" for x, y in zip(cluster(*ops_c), split(*ops_c)))
        print(f"| {e} | forward rel RMS, B{b} H{h} T{t} g x{decay:g} | {rels} | | | | |",
              flush=True)
      for residuals in (False, True):
        split, cluster, tiles = passes(e, args.d, erase=erase, scale=scale, residuals=residuals)
        timed(e, f"forward {'with residuals' if residuals else 'primal'}", args, tiles, split,
              cluster, ops)
    if "reverse" not in args.passes:
      continue
    split_r, cluster_r, tiles = reverse_passes(e, args.d, erase=erase, scale=scale)
    for (b, h, t, decay), ops_c in zip(cases, checks):
      rops = reverse_operands(ops_c, jax.random.key(e + 100))
      rels = " | ".join(f"{rel(x, y):.1e}" for x, y in zip(cluster_r(*rops), split_r(*rops)))
      print(f"| {e} | reverse rel RMS, B{b} H{h} T{t} g x{decay:g} | {rels} | | | |", flush=True)
    timed(e, "reverse", args, tiles, split_r, cluster_r,
          reverse_operands(ops, jax.random.key(1)))


def timed(e, what, args, tiles, split, cluster, ops):
  ms_split = median_ms(split, ops, reps=args.reps)
  ms_cluster = median_ms(cluster, ops, reps=args.reps)
  print(f"| {e} | {what}, B{args.b} H{args.h} T{args.t} (value split: {tiles}) | | | | | | "
        f"{ms_split:.3f} | {ms_cluster:.3f} | {ms_cluster / ms_split:.2f}x |", flush=True)


if __name__ == "__main__":
  main()
