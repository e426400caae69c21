"""What one exchange through distributed shared memory (DSMEM) costs on this GPU: the reduce-scatter
a cluster of E blocks would run every chunk if each block held one slice of the triadic state.

Each block holds a (C, V) float32 tile in registers (the WGMMA layout, as a product leaves it);
column block j (V / E wide) of every block's tile is summed in block j. One round is that exchange
and the sum; a kernel runs ``rounds`` of them back to back, each round's tile depending on the
round, as a chunk loop would. Mechanisms:

  st.async   each block stores its pieces from registers into the peers' SMEM
             (``plgpu.async_store_smem``), completing on the receiver's barrier
  push       plain stores into the peers' SMEM (``plgpu.cluster_ref``), then a cluster barrier
             (``plgpu.ClusterBarrier``: one thread arrives for the warpgroup, after a
             warpgroup barrier). Nothing orders the other threads' stores before that arrival
             at cluster scope (it releases at CTA scope), so a sum can be wrong (the table's
             last column says so); a cluster-scope fence would make it right, at a cost
  pull       each block stores its whole tile into its own SMEM; after a cluster barrier it
             loads its column block from every peer's SMEM
  bulk       each block stores its E pieces into its own SMEM, and one thread sends each with
             one ``cp.async.bulk`` to shared::cluster, completing its bytes on the receiver's
             barrier (one completion a copy; inline PTX, as Pallas has no primitive for it); a
             cluster barrier after the reads frees the buffers for round r + 2
  local      no exchange: the block sums the E column blocks of its own tile (the round's
             register work without the cluster), the floor under the others

Receive buffers alternate by round parity, so a round's stores never overwrite what a slower
block still reads: a block starts round r + 2 only once every peer has finished round r. A block
ends only once nothing more is sent to it or read from it.

Push and pull lower with Lane semantics, since Warpgroup semantics (JAX's default from 0.11) has
no plain stores to, or loads from, a peer's SMEM; bulk too (its inline PTX is written, and
lowering-tested, there). St.async and local lower with Warpgroup semantics, in which st.async
completes once per sending warpgroup on the receiver's barrier (the count its
``plgpu.Barrier(num_arrivals=E)`` asks for; in Lane semantics the kernel fails to launch).

Each row gives the time a round from kernels of R and 2R rounds (their difference, so the launch
drops out), for 32 clusters (the op's B * H at B = 2, H = 16). It is wall time, with the clusters
in as many waves as the state passes' blocks. Every block's sum is checked. GPU only (Hopper).

  python benchmarks/dsmem_exchange.py --e 8 4 --rounds 256
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402
from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jax._src.lib.mlir.dialects import arith, llvm  # noqa: E402

from benchmarks.common import machine, median_ms  # noqa: E402
from triadic.pallas.mosaic import _smem, _swizzle  # noqa: E402

F32 = jnp.float32
MECHANISMS = ("st.async", "push", "pull", "bulk", "local")
_LANE, _WG = plgpu.LoweringSemantics.Lane, plgpu.LoweringSemantics.Warpgroup
SEMANTICS = {"st.async": _WG, "push": _LANE, "pull": _LANE, "bulk": _LANE, "local": _WG}


def _asm(operands, text, constraints):
  llvm.inline_asm(ir.Type.parse("!llvm.void"), operands, text, constraints,
                  has_side_effects=True)


def _address(ref):
  """A shared-memory ref's 32-bit shared::cta address."""
  return llvm.ptrtoint(ir.IntegerType.get_signless(32), mgpu_utils.memref_ptr(ref))


def _first_thread():
  return mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.WARPGROUP)


_BAR_BYTES = 128       # the receive barriers' row stride (an mbarrier and its padding)


@plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
def _init_barriers(ctx, bars):
  """Two mbarriers of one arrival at ``bars``' rows 0 and 1, visible to the cluster before any
  block goes on."""
  del ctx
  i32 = ir.IntegerType.get_signless(32)
  base = _address(bars)
  for i in range(2):
    addr = arith.addi(base, arith.constant(i32, _BAR_BYTES * i))
    _asm([_first_thread(), addr], "@$0 mbarrier.init.shared::cta.b64 [$1], 1;", "b,r")
  _asm([], "fence.mbarrier_init.release.cluster;\n"
       "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;", "")


def _bulk_round(stage, part, bars, r, *, e: int, nbytes: int, transforms):
  """Round r: block s's piece j (``stage`` row j) goes to block j's ``part`` row s by one bulk
  copy (its own piece included), completing on block j's barrier r % 2; then every thread waits
  for its own barrier's E pieces. ``transforms``: ``stage``'s and ``part``'s, as allocated."""
  tiled = plgpu.RefType(transforms=transforms)

  @plgpu.inline_mgpu(arg_types=(tiled, tiled, plgpu.RefType(), plgpu.Layout.WG_SPLAT(shape=())))
  def send_and_wait(ctx, stage, part, bars, r):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    r = r.registers.item()
    par = arith.andi(r, arith.constant(i32, 1))
    parity = arith.andi(arith.shrui(r, arith.constant(i32, 1)), arith.constant(i32, 1))
    bar = arith.addi(_address(bars), arith.muli(par, arith.constant(i32, _BAR_BYTES)))
    rank = llvm.inline_asm(i32, [], "mov.u32 $0, %cluster_ctarank;", "=r")
    dst = arith.addi(_address(part), arith.muli(rank, arith.constant(i32, nbytes)))
    first = _first_thread()
    _asm([first, bar, arith.constant(i32, e * nbytes)],
         "@$0 mbarrier.arrive.expect_tx.shared::cta.b64 _, [$1], $2;", "b,r,r")
    src0 = _address(stage)
    for j in range(e):
      src = arith.addi(src0, arith.constant(i32, j * nbytes))
      _asm([first, dst, bar, arith.constant(i32, j), src, arith.constant(i32, nbytes)],
           "{\n.reg .b32 d, b;\nmapa.shared::cluster.u32 d, $1, $3;\n"
           "mapa.shared::cluster.u32 b, $2, $3;\n"
           "@$0 cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes "
           "[d], [$4], $5, [b];\n}", "b,r,r,r,r,r")
    _asm([bar, parity],
         "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
         "@!p bra WAIT;\n}", "r,r")

  send_and_wait(stage, part, bars, r)


def exchange_kernel(mechanism: str, *, e: int, c: int, v: int, rounds: int, clusters: int):
  """A kernel of ``rounds`` reduce-scatters over clusters of ``e`` blocks. Returns every block's
  sum over rounds of its column block of the summed tiles, (clusters, e, c, v / e) float32;
  block s's tile in round r is (s + 1) (r + 1) everywhere."""
  if mechanism not in MECHANISMS:
    raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
  if v % e or (v // e) % 8:
    raise ValueError(f"v / e must be a multiple of 8, got v={v}, e={e}")
  bw = v // e
  # Every mechanism allocates both buffers (132 KiB at E = 8), so each runs one block a
  # multiprocessor, as the state passes (about 200 KiB) would.
  part = _smem((2, e, c, bw), F32, _swizzle(bw, F32))      # received parts, by round parity
  whole = _smem((2, c, v), F32, _swizzle(bw, F32))   # pull: its tile, by parity (BW-wide tiles)
  if mechanism == "bulk":                            # the pieces to send, laid out as received
    whole = part
  if mechanism == "st.async":
    bar = plgpu.Barrier(num_arrivals=e, num_barriers=2)    # E sending warpgroups a round
  else:
    bar = plgpu.ClusterBarrier(collective_axes=("slice",), num_barriers=2)

  def meet(bar):
    """Every thread's stores done, then the warpgroup's one arrival in every block, and the
    wait for all blocks' arrivals."""
    plgpu.commit_smem()
    plgpu.barrier_arrive(bar)
    plgpu.barrier_wait(bar)

  def body(out_g, part_s, whole_s, bar_s, out_s, recv_s):
    s = lax.axis_index("slice")
    if mechanism == "bulk":
      _init_barriers(recv_s)
      plgpu.barrier_arrive(bar_s.at[0])              # rounds -2 and -1 "read": 0 and 1 may send
      plgpu.barrier_arrive(bar_s.at[1])
    ones = plgpu.layout_cast(jnp.full((c, v), 1.0, F32), plgpu.Layout.WGMMA)
    tile0 = ones * (s + 1).astype(F32)

    def one_round(r, acc):
      x = tile0 * (r + 1).astype(F32)
      par = r % 2
      if mechanism == "local":
        parts = [x[:, j * bw:(j + 1) * bw] for j in range(e)]
      elif mechanism == "st.async":
        for j in range(e):
          plgpu.async_store_smem(x[:, j * bw:(j + 1) * bw], part_s.at[par, s], bar_s.at[par],
                                 cluster_idx=j, cluster_dim="slice")
        plgpu.barrier_wait(bar_s.at[par])
        parts = [part_s.at[par, j][...] for j in range(e)]
      elif mechanism == "push":
        for j in range(e):
          peer = plgpu.cluster_ref(part_s, {"slice": j})
          peer.at[par, s][...] = x[:, j * bw:(j + 1) * bw]
        meet(bar_s.at[par])
        parts = [part_s.at[par, j][...] for j in range(e)]
      elif mechanism == "bulk":
        plgpu.barrier_wait(bar_s.at[par])          # every block has read round r - 2's parts
        for j in range(e):
          whole_s.at[par, j][...] = x[:, j * bw:(j + 1) * bw]
        plgpu.commit_smem()                        # the stores visible to the bulk copies
        _bulk_round(whole_s.at[par], part_s.at[par], recv_s, r, e=e, nbytes=c * bw * 4,
                    transforms=part.transforms)
        parts = [part_s.at[par, j][...] for j in range(e)]
        plgpu.commit_smem()                        # every thread's reads done, then free them
        plgpu.barrier_arrive(bar_s.at[par])
      else:                                                # pull
        whole_s.at[par][...] = x
        meet(bar_s.at[par])
        parts = [plgpu.cluster_ref(whole_s, {"slice": j}).at[par, :, pl.ds(s * bw, bw)][...]
                 for j in range(e)]
      for piece in parts:
        acc = acc + plgpu.layout_cast(piece, plgpu.Layout.WGMMA)
      return acc

    acc = lax.fori_loop(0, rounds, one_round,
                        plgpu.layout_cast(jnp.zeros((c, bw), F32), plgpu.Layout.WGMMA))
    out_s[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s, out_g.at[lax.axis_index("cluster"), s])
    plgpu.wait_smem_to_gmem(0)
    if mechanism == "pull":                  # no block leaves while a peer may still read it
      meet(bar_s.at[rounds % 2])
    if mechanism == "bulk":                  # nor while its copies may still be in flight
      plgpu.barrier_wait(bar_s.at[rounds % 2])
      plgpu.barrier_wait(bar_s.at[(rounds + 1) % 2])

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((clusters, e, c, bw), F32),
      scratch_types=[part, whole, bar, _smem((c, bw), F32, _swizzle(bw, F32)),
                     _smem((2, _BAR_BYTES // 4), jnp.int32)],
      grid=(clusters,), grid_names=("cluster",), cluster=(e,), cluster_names=("slice",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=SEMANTICS[mechanism]),
      kernel_name=f"dsmem_{mechanism.replace('.', '_')}")


def expected(mechanism, e, c, v, rounds, clusters):
  """Every block's column block summed over the E tiles and the rounds: sum_s (s + 1) *
  sum_r (r + 1); for ``local``, block s's E column blocks of its own tile: E (s + 1) *
  sum_r (r + 1)."""
  per_round = np.full(e, e * (e + 1) / 2) if mechanism != "local" else e * np.arange(1, e + 1)
  value = per_round * rounds * (rounds + 1) / 2
  return np.broadcast_to(value[None, :, None, None], (clusters, e, c, v // e)).astype(np.float32)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--e", type=int, nargs="+", default=[8, 4])
  ap.add_argument("--c", type=int, default=64)
  ap.add_argument("--v", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=256)
  ap.add_argument("--clusters", type=int, default=32)
  ap.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS), choices=MECHANISMS)
  ap.add_argument("--reps", type=int, default=10)
  args = ap.parse_args(argv)
  print(f"# {machine()}")
  print(f"# C = {args.c}, V = {args.v} float32 a block; {args.clusters} clusters; time a round "
        f"from kernels of {args.rounds} and {2 * args.rounds} rounds")
  print("| E | mechanism | KiB a block and round | us a round | sum right |")
  print("|---|---|---|---|---|")
  for e in args.e:
    kib = args.c * args.v * 4 / 1024 * (e - 1) / e
    for mech in args.mechanisms:
      ms = []
      ok = True
      for rounds in (args.rounds, 2 * args.rounds):
        fn = jax.jit(exchange_kernel(mech, e=e, c=args.c, v=args.v, rounds=rounds,
                                     clusters=args.clusters))
        out = np.asarray(fn())
        ok &= bool(np.allclose(out, expected(mech, e, args.c, args.v, rounds, args.clusters),
                               rtol=1e-5))
        ms.append(median_ms(fn, (), reps=args.reps))
      us = 1e3 * (ms[1] - ms[0]) / args.rounds
      print(f"| {e} | {mech} | {kib if mech != 'local' else 0:.0f} | {us:.2f} | {ok} |",
            flush=True)


if __name__ == "__main__":
  main()
