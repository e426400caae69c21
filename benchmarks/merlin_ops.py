"""Multi-state attention's impls (scan, chunked, pallas) against the single-state GDN op.

    python benchmarks/merlin_ops.py                           # T = 1024, 4096 on this machine
    python benchmarks/merlin_ops.py --impls chunked,pallas --dtype bfloat16 --T 2048,16384 \
        --B 1 --H 16 --D 128 --V 128 --R 128 --segment-len 256 --aggregators merlin   # a GPU

Two tables. The op table times ``multistate_attention`` alone (lam fixed, from the MERLIN
aggregator) forward and forward+backward (the gradients and the output, as a training step needs
them) for each of ``--impls``, the single-state GDN op at the
same shape (``triadic_gdn`` with E = 1: its Pallas kernels on GPU, chunked elsewhere) and, where
``fla`` imports (CUDA torch), FLA's ``chunk_log_linear_attn`` (log-linear Mamba-2, no erase; its
own level count). Beside every time its floor: ``multistate_cost``'s matmul FLOPs at the matmul
ceiling or its HBM bytes at the copy bandwidth, whichever is larger, both ceilings measured in the
same run (``--no-floors`` skips them). The pipeline table times each aggregator + attention for
each impl (moments "scan" for impl "scan", else "parallel"), the compiled program's temporary
memory (XLA ``memory_analysis``) and the relative-RMS distance of each impl's output to the first
impl's. Every table names the machine, and the op table prints the plan "auto" would follow.

``--parts`` prints instead, per T (and per erase setting, ``--erase``), where the pallas impl's
time goes: its intra-chunk stage (``intra_stage``: the chunk layout, ``intra_chunk``, the
kernels' casts; forward, and forward+backward by its pullback), the kernels' forward (state pass
+ readout) and backward (reverse pass + chunk gradients), each kernel launch alone, the whole
op, and the glue (the op less those parts), each called as the op calls it
(``merlin.pallas.ops``' stages) and beside its floor (``part_costs``) and its share of the op.
On a GPU, both erase settings at B = 1, T = 16384 and B = 8, T = 2048:

    for bt in "1 16384" "8 2048"; do set -- $bt; python benchmarks/merlin_ops.py --parts \
        --erase both --dtype bfloat16 --B $1 --T $2 --H 16 --D 128 --V 128 --R 128 \
        --segment-len 256 --chunk 64 --repeats 10; done

``--profile`` prints instead, per T, each ``--impls`` op's forward+backward by kernel and XLA
fusion with its device time, from the JAX profiler (the same sizes, ``--impls pallas``).

``--tiles block_v=32,num_warps=4`` runs every table's pallas impl with those fields of the plan's
``default_config`` replaced (the state passes' value block and warps, ``bwd_block_v``, ...);
``--op-variants bwd_block_v=32 bwd_num_warps=8`` adds a row to the op table per set instead, so
that tile choices are timed beside the default in one process.
The GPU default's forward columns time the erase forward by the query walk (the forward where no
gradient is taken); ``--tiles query_walk=False`` times the stack forward there instead, which is
the forward a backward always runs.
The GPU default runs the intra-chunk part's forward by its kernel (``Config.intra_kernel``,
``merlin.pallas.intra``; where a gradient is taken it also writes A for the part's pullback)
and its pullback by the backward kernel (``Config.intra_backward_kernel``);
``--tiles intra_kernel=False`` runs the plain-JAX forward instead, and ``--op-variants
intra_backward_kernel=False`` adds a row with the plain-JAX pullback; ``--intra-backward 4,32,32
8,32,16`` adds a row per launch of the backward kernel (warps, value and key columns a block),
``--intra-forward 4,32 8,64`` one per launch of the forward kernel (warps, value columns).
The op table's last column is the gradients' error to the first impl's (the largest over the
arguments). On a GPU, with and without the forward kernel:

    for v in intra_kernel=False intra_kernel=True; do python benchmarks/merlin_ops.py \
        --impls pallas --dtype bfloat16 --B 1 --T 16384 --H 16 --D 128 --V 128 --R 128 \
        --segment-len 256 --chunk 64 --aggregators "" --tiles $v; done

``--parts`` runs the op and its stages with the plain-JAX intra-chunk forward (``intra_kernel``
off in its config; the pullback, by the plan's ``intra_backward_kernel``, is the same either
way); the forward kernel's time is the op table's and ``--profile``'s.

On a CPU shared with other jobs, XLA's multi-threaded kernels stall under oversubscription (the
chunked form, which has the larger parallel ops, by up to 100x); pin one core for stable numbers:

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false" taskset -c 0 \
        python benchmarks/merlin_ops.py --T 4096 --H 2 --D 32 --V 32 --R 32
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triadic.xla_flags import apply_cpu_workaround  # noqa: E402

apply_cpu_workaround()  # before the CPU backend starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import merlin  # noqa: E402
from benchmarks.common import ceilings, kernel_profile, machine, profile_table  # noqa: E402
from benchmarks.common import variant_fields  # noqa: E402
from layers.platform import default_platform  # noqa: E402
from merlin.pallas import intra as merlin_intra  # noqa: E402
from merlin.pallas import kernels as merlin_kernels  # noqa: E402
from merlin.pallas import ops as merlin_pallas  # noqa: E402
from merlin.pallas import plan as merlin_plan  # noqa: E402
from merlin.segments import visible  # noqa: E402
from triadic import triadic_gdn  # noqa: E402
from triadic.ops import clamp_log_decay  # noqa: E402


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
      qr=unit(jax.random.normal(ks[5], (b, t, h, r))),
      kr=unit(jax.random.normal(ks[6], (b, t, h, r))),
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


def attention(impl, segment_len, chunk, config=None):
  """(x, lam) -> o: multi-state attention of ``impl`` (the pallas kernels with ``config``, None:
  the plan's default)."""
  def run(x, lam):
    return merlin.multistate_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], lam,
                                       segment_len=segment_len, impl=impl,
                                       chunk_size=None if impl == "scan" else chunk,
                                       config=config if impl != "scan" else None)
  return run


def tiles_config(tiles, base=None):
  """The pallas Config of ``--tiles`` ("block_v=32,num_warps=4", "query_walk=True": fields of
  ``base``, by default the platform's ``merlin.pallas.plan.default_config``, replaced), or
  ``base`` itself (None: the default) without fields."""
  if not tiles:
    return base
  return dataclasses.replace(base or merlin_plan.default_config(default_platform()),
                             **variant_fields(tiles))


@contextlib.contextmanager
def intra_launch(forward="", backward=""):
  """Within: MERLIN's intra-chunk kernels launched as ``forward``, "WARPS,BV", and ``backward``,
  "WARPS,BV,BD" (warps, value and key columns a block; empty: as they are;
  ``merlin.pallas.intra``'s ``FORWARD_*``, ``BACKWARD_*``), for what is traced within."""
  names = ("FORWARD_WARPS", "FORWARD_BLOCK_V", "BACKWARD_WARPS", "BACKWARD_BLOCKS")
  saved = {name: getattr(merlin_intra, name) for name in names}
  if forward:
    merlin_intra.FORWARD_WARPS, merlin_intra.FORWARD_BLOCK_V = (int(x) for x in forward.split(","))
  if backward:
    warps, bv, bd = (int(x) for x in backward.split(","))
    merlin_intra.BACKWARD_WARPS, merlin_intra.BACKWARD_BLOCKS = warps, (bv, bd)
  try:
    yield
  finally:
    for name, value in saved.items():
      setattr(merlin_intra, name, value)


def pipeline(aggregator, impl, segment_len, n, chunk, config=None):
  """x (dict of arrays) -> o: the aggregator's lam, then multi-state attention."""
  op = attention(impl, segment_len, chunk, config)
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


def visible_pairs(n_chunks, cps):
  """The (chunk, visible segment state) pairs: sum over chunks i of n_i = i // cps + 1."""
  return sum(i // cps + 1 for i in range(n_chunks))


def multistate_cost(b, t, h, d, vd, r, segment_len, c, *, erase=True, aggregator="merlin",
                    itemsize=4):
  """(forward FLOPs, forward HBM bytes) of the chunk-parallel multi-state algorithm, counting the
  matmuls as 2 m n k and the bytes as every input read once and the output written once (the
  state stack kept on chip: the floor, not what the JAX form moves). Per chunk of C tokens and
  head, with n_i visible segment states at chunk i (n_i = i C // L + 1):

    intra-chunk (as the single state)   Q K^T and P Uv, 2 C^2 D + 2 C^2 V; with erase also
                                        K K^T, A [V | K] and P W, 2 C^2 (3 D + V)
    state stack                         erase: W S and Kw^T (W S) for every visible state,
                                        4 n_i C D V; the read Qe S over the stack, 2 n_i C D V;
                                        the current state's write Kw^T Uv, 2 C D V
    aggregator (merlin / meanpool)      per token and visible segment, r_mu = mu q' (2 R) and
                                        (merlin) r_sigma = q'^T Sigma q' (2 R^2); the moments'
                                        sums R + R^2 per token

  Forward+backward is counted as 3x forward. ``n_i = 1`` with no aggregator is the single-state
  GDN (``segment_len >= t``)."""
  n_chunks = -(-t // c)
  vis = visible_pairs(n_chunks, segment_len // c)
  per_head = n_chunks * (2 * c * c * d + 2 * c * c * vd)
  if erase:
    per_head += n_chunks * 2 * c * c * (3 * d + vd) + vis * 4 * c * d * vd
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


def part_costs(b, t, h, d, vd, segment_len, c, *, erase=True, itemsize=4, block_v=32):
  """{stage: (FLOPs, HBM bytes)} of the pallas op's stages as it runs them: "intra_chunk" (its
  forward) and each kernel launch, forward ones first. FLOPs count the matmuls as 2 m n k
  (``intra_chunk`` also the UT inverse's block merges, 2 C s^2 per level of s x s blocks); bytes
  count every operand of the stage read once and every result written once, in the dtypes and
  padded widths the op passes them (float32 in and out of ``intra_chunk``; the kernels' Qe, W, Kw,
  Uv, dO, stored states, output and matrix gradients in the input dtype; gamma, lam, intra, own,
  dlam float32; the chunk gradients' Y and own parts float32). So a stage's floor is that of the
  stage as the op splits the work (stored states included), where ``multistate_cost``'s is the
  algorithm's. Per head, with VIS the visible (segment, chunk) pairs, PAIRS the (state, later
  span) pairs (``kernels.num_pairs``), one product a (C, D) x (D, V) one and a square one a
  (C, D) x (D, D) one:

    span maps (erase)       Kw^T (W Phi) and Qe Phi per chunk (the backward's also store Phi)
    state pass (erase)      W S, Kw^T (W S), Kw^T Uv per chunk; U S, (D, D) x (D, V), per pair
                            of a span crossed (all but the last span)
    write pass (no erase)   Kw^T Uv per chunk
    readout                 (lam Qe) S per visible pair
    reverse pass            erase: Kw dS, W^T (Kw dS), (lam Qe)^T dO per chunk; U^T dS per pair,
                            (lam P)^T dO per visible pair of a finished state; no erase:
                            (lam Qe)^T dO per visible pair, Kw dS and Uv dS^T per chunk
    chunk gradients         erase: dO S^T per visible pair of a finished state (the finished
                            reads' launch, which stores Y); the own state's dO S^T, dUv S^T,
                            W S, (Uv - W S) dS^T and Y Phi^T per chunk (the own launch)
    span sums (erase)       dS S^T ((D, V) x (V, D)) per pair; seven square products per chunk
    read gradients          dO S^T per visible pair

  ``block_v``: the no-erase reverse pass stores its partial dKw and dgamma per value block."""
  nc = -(-t // c)
  cps = segment_len // c
  ns = -(-nc // cps)
  vis = visible_pairs(nc, cps)
  pairs = merlin_kernels.num_pairs(ns)
  dp, vp, it, f = merlin_pallas.padded_width(d), merlin_pallas.padded_width(vd), itemsize, 4
  tok, mm, state = nc * c, 2 * c * d * vd, itemsize * dp * vp
  lam, gam = f * ns * tok, f * nc
  n, size, ut = 1 << (c - 1).bit_length(), min(16, c), 0
  while size < n:
    ut, size = ut + 2 * n * size * size, 2 * size
  intra = 2 * c * c * (d + vd) + (2 * c * c * (3 * d + vd) + ut if erase else 0)
  costs = {"intra_chunk": (nc * intra, f * tok * (2 * d + vd + 2)
                           + f * (tok * (2 * vd + (3 if erase else 2) * d) + nc))}
  if erase:
    square, gram, sq = 2 * c * d * d, 2 * d * d * vd, it * dp * dp
    maps = (nc * 3 * square, it * tok * 4 * dp + gam + ns * sq)
    costs["span maps"] = maps
    costs["span maps, Phi"] = (maps[0], maps[1] + nc * sq)
    costs["state pass"] = (nc * 3 * mm + (ns - 1) * (ns - 2) // 2 * gram,  # the last not crossed
                           it * tok * (2 * dp + vp) + gam + ns * sq + (nc + pairs) * state)
    costs["readout"] = (vis * mm, it * tok * (2 * dp + vp) + lam + (nc + pairs) * state
                        + f * tok * (vp + 1))
    costs["reverse pass"] = (nc * 3 * mm + pairs * gram + (vis - nc) * mm,
                             it * tok * (4 * dp + 2 * vp) + ns * sq + lam + gam
                             + (nc + pairs) * state)
    costs["chunk gradients"] = ((vis - nc) * mm + nc * (4 * mm + square),
                                it * tok * 4 * (dp + vp) + nc * sq + 2 * lam + f * ns * tok
                                + (pairs + 2 * nc) * state + f * (4 * tok * dp + tok + nc))
    costs["span sums"] = (pairs * gram + nc * 7 * square,
                          it * tok * 5 * dp + nc * sq + 2 * pairs * state
                          + f * (3 * tok * dp + 3 * nc))
  else:
    nv = vp // min(block_v, vp)
    ends = (nc + ns) * state
    costs["write pass"] = (nc * mm, it * tok * (dp + vp) + gam + ends)
    costs["readout"] = (vis * mm, it * tok * (dp + vp) + lam + ends + f * tok * (vp + 1))
    costs["reverse pass"] = (vis * mm + nc * 2 * mm, it * tok * (2 * dp + 3 * vp) + lam + gam
                             + nc * state + f * nv * (tok * dp + nc))
    costs["read gradients"] = (vis * mm, it * tok * (2 * dp + vp) + 2 * lam + ends)
  return {k: (b * h * fl, b * h * by) for k, (fl, by) in costs.items()}


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


def training_grad(fn, n_args):
  """(cot, *args) -> (gradients of sum(cot * o) with respect to the ``n_args`` array arguments,
  o), o = fn(*args): the backward a training step runs, o kept as the step needs it. cot is an
  argument, not a closure: a captured array would be a constant of the program, which XLA then
  folds at compile time."""
  def loss(cot, *a):
    o = fn(*a)
    return jnp.sum(cot * o.astype(jnp.float32)), o

  return jax.grad(loss, argnums=tuple(range(1, n_args + 1)), has_aux=True)


def fwd_and_fwd_bwd(fn, args, cot, repeats, backward, keep_output=True):
  """(fwd s, f+b s, f+b temp MiB, output, gradients or None) of fn(*args); the f+b is the
  gradient of sum(cot * o) with respect to every array argument and, with ``keep_output``, o too,
  as a training step needs it (without, XLA drops whatever only o needs: the pallas op's readout
  kernel)."""
  fwd, _, out = measure(fn, args, repeats)
  if not backward:
    return fwd, np.nan, np.nan, out, None
  grad = training_grad(fn, len(args))
  fb, mem, res = measure(grad if keep_output else lambda *a: grad(*a)[0], (cot, *args), repeats)
  return fwd, fb, mem, out, res[0] if keep_output else res


def rel_err(a, b):
  """Relative error of a to b; of the gradients, the largest over their leaves (nan without)."""
  if a is None or b is None:
    return np.nan
  leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b))
  return max(float(np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64))
                   / max(np.linalg.norm(np.asarray(y, np.float64)), 1e-30)) for x, y in leaves)


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
  config = args.config
  if config is not None:
    print(merlin_plan.Plan("pallas", args.chunk, f"--tiles {args.tiles}", config))
  cols = ["op", "T", "fwd", "f+b", "floor fwd", "floor f+b", "f+b/floor", "f+b/GDN", "rel err",
          "grad err"]
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
    ref = None   # the first impl's (output, gradients): what the error columns compare to
    for impl in args.impls.split(","):
      res = fwd_and_fwd_bwd(attention(impl, args.segment_len, args.chunk, config), (x, lam), cot,
                            args.repeats, backward)
      ref = res[3:] if ref is None else ref
      rows.append((f"multistate {impl}", res, cost))
    for variant in args.op_variants:   # the pallas impl again, a Config set over --tiles' config
      res = fwd_and_fwd_bwd(attention("pallas", args.segment_len, args.chunk,
                                      tiles_config(variant, base=config)),
                            (x, lam), cot, args.repeats, backward)
      rows.append((f"pallas {variant}", res, cost))
    launches = ([(f"intra fwd {f}", dict(forward=f)) for f in args.intra_forward]
                + [(f"intra bwd {b}", dict(backward=b)) for b in args.intra_backward])
    for name, launch in launches:   # the pallas impl again, an intra-chunk kernel relaunched
      with intra_launch(**launch):
        res = fwd_and_fwd_bwd(attention("pallas", args.segment_len, args.chunk, config),
                              (x, lam), cot, args.repeats, backward)
      rows.append((name, res, cost))
    for name, (fwd, fb, _, out, grads), (fl, by) in rows:
      ffwd, ffb = floor_ms(fl, by, 1), floor_ms(fl, by, 3)
      errs = ((np.nan, np.nan) if name.startswith("gdn")
              else (rel_err(out, ref[0]), rel_err(grads, ref[1])))
      print(" | ".join(fmt(v) for v in (name, t, 1e3 * fwd, 1e3 * fb, ffwd, ffb, 1e3 * fb / ffb,
                                         fb / gdn[1], *errs)), flush=True)
    peer = fla_log_linear(x, args.repeats)
    if isinstance(peer, str):
      print(f"{'fla log-linear':>20} | {t:>12} | not run: {peer}")
    else:
      print(" | ".join(fmt(v) for v in ("fla log-lin", t, *peer, np.nan, np.nan, np.nan,
                                         peer[1] / (1e3 * gdn[1]), np.nan, np.nan)),
            flush=True)


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
        fwd, fb, mem, out, _ = fwd_and_fwd_bwd(
            pipeline(agg, impl, args.segment_len, n, args.chunk, args.config), (x,),
            cot, args.repeats, not args.no_backward)
        vals += [1e3 * fwd, 1e3 * fb, mem]
        outs.append(out)
      vals += [rel_err(o, outs[0]) for o in outs[1:]]
      fl, by = multistate_cost(args.B, t, args.H, args.D, args.V, args.R, args.segment_len,
                               args.chunk, aggregator=agg, itemsize=jnp.dtype(dtype).itemsize)
      vals += [floor_ms(fl, by, 1), floor_ms(fl, by, 3)]
      print(" | ".join(fmt(v) for v in vals), flush=True)


def hlo_census(fn, args):
  """{opcode: count} of the instructions that launch work in fn's optimized HLO: those of every
  computation but fused ones and reducers, less parameters, constants, tuples and bitcasts (a
  while loop's body counted once, not per trip)."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  inner = set(re.findall(r"(?:calls|to_apply)=%?([\w.-]+)", text))
  counts, skip = {}, False
  for line in text.splitlines():
    head = re.match(r"(?:ENTRY\s+)?%?([\w.-]+)\s.*\{\s*$", line)
    if head and not line[0].isspace():
      skip = head.group(1) in inner
      continue
    op = re.match(r"\s+(?:ROOT\s+)?%?[\w.-]+\s*=\s*.*?\s([a-z][a-z0-9-]*)\(", line)
    if op and not skip and op.group(1) not in ("parameter", "constant", "tuple",
                                               "get-tuple-element", "bitcast"):
      counts[op.group(1)] = counts.get(op.group(1), 0) + 1
  return counts


def census_line(counts):
  fusions, calls, loops = (counts.get(k, 0) for k in ("fusion", "custom-call", "while"))
  rest = sum(counts.values()) - fusions - calls - loops
  return f"{fusions} fusions, {calls} custom calls, {loops} while loops, {rest} other"


# The kernel launches of the pallas op's forward and backward, as part_costs names them
PART_ROWS = {True: (("span maps", "state pass", "readout"),
                    ("span maps, Phi", "reverse pass", "chunk gradients", "span sums")),
             False: (("write pass", "readout"), ("reverse pass", "read gradients"))}


def parts_table(args, t, dtype, erase, floor_ms):
  """Where the pallas op's time goes at length t: its stages timed alone on the operands the op
  hands them (``merlin.pallas.ops``: ``intra_stage`` (``chunk_inputs`` -> ``intra_chunk`` ->
  ``chunk_operands``) and ``chunk_weights`` -> ``kernel_operands`` -> ``kernels_forward``;
  backward ``kernels_backward``), with ``intra_kernel`` off, each kernel launch alone, the whole
  op, and the glue: the op less its stages (relayouts, casts, lam's layout, the output
  cotangent's dO, the autodiff of the plain-JAX steps around the stages). A stage's f+b is its
  time in the op's forward+backward: the kernels' forward runs in both, their backward only in
  the f+b; the intra-chunk stage's f+b is ``jax.vjp`` (its pullback) with random cotangents on
  its results. The op's f+b returns o with the gradients, as a training step needs it (so does
  the op table's); "op, grads only" is the gradients alone, for which XLA drops the readout
  kernel (and intra's P Uv): what the op table measured before it kept o."""
  b, h, d, vd, seg = args.B, args.H, args.D, args.V, args.segment_len
  plan = merlin_plan.resolve("pallas", d=d, segment_len=seg, chunk_size=args.chunk,
                             documents=False, config=args.config)
  plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, intra_kernel=False))
  c, cfg, scale = plan.chunk_size, plan.config, float(d ** -0.5)
  cps, n, nan = seg // c, -(-t // seg), float("nan")
  x = inputs(jax.random.PRNGKey(t), b, t, h, d, vd, args.R, n, dtype)
  lam = jax.jit(lambda x: weights("merlin", x, seg, n, "parallel"))(x)
  op_args = (x["q"], x["k"], x["v"], x["g"], x["beta"], lam)
  keys = iter(jax.random.split(jax.random.PRNGKey(2), 8))
  normal = lambda y: jax.random.normal(next(keys), y.shape, y.dtype)
  repeats = args.repeats
  times = {}

  def op(q, k, v, g, beta, lam):
    return merlin.multistate_attention(q, k, v, g, beta, lam, segment_len=seg, erase=erase,
                                       impl="pallas", chunk_size=c, config=cfg)

  def stage_inputs(q, k, v, g, beta, lam):  # as multistate_attention hands them on
    lam = jnp.where(visible(t, seg, n)[:, None, :], lam.astype(jnp.float32), 0.0)
    g = clamp_log_decay(g)
    return ((q, k, v, g, beta),
            merlin_pallas.chunk_weights(g, lam, segment_len=seg, chunk_size=c))

  cot = jax.random.normal(jax.random.PRNGKey(1), (b, t, h, vd))
  # the whole op first, while no stage's arrays hold device memory
  times["op"] = fwd_and_fwd_bwd(op, op_args, cot, repeats, True)[:2]
  times["op, grads only"] = (nan, fwd_and_fwd_bwd(op, op_args, cot, repeats, True,
                                                  keep_output=False)[1])
  intra_args, (gc, lamc) = jax.jit(stage_inputs)(*op_args)
  intra_fn = functools.partial(merlin_pallas.intra_stage, c, erase, cfg)
  def intra_vjp(cot, *a):  # its results too, as the op's f+b needs them
    out, pullback = jax.vjp(intra_fn, *a)
    return out, pullback(cot)

  fwd, _, intra_out = measure(intra_fn, intra_args, repeats)
  intra_cot = jax.tree.map(normal, intra_out)
  times["intra_chunk"] = (fwd, measure(intra_vjp, (intra_cot, *intra_args), repeats)[0])
  census = [census_line(hlo_census(fn, a)) for fn, a in ((intra_fn, intra_args),
                                                         (intra_vjp, (intra_cot, *intra_args)))]

  mats = jax.jit(functools.partial(merlin_pallas.kernel_operands, cps=cps, erase=erase))(
      intra_out, gc, lamc)
  kfwd, _, (_, *states) = measure(
      functools.partial(merlin_pallas.kernels_forward, cps, erase, cfg, scale), mats, repeats)
  vp = mats[-5].shape[-1]  # uv, padded
  do = jnp.pad(normal(mats[-2]), [(0, 0)] * 4 + [(0, vp - vd)])  # dO as _attend_bwd pads it
  kbwd = measure(functools.partial(merlin_pallas.kernels_backward, cps, erase, cfg),
                 (*mats[:-2], *states, do), repeats)[0]
  times["kernels fwd"], times["kernels bwd"] = (kfwd, kfwd), (nan, kbwd)

  # each launch alone, on the operands as _forward and _backward lay them out
  merge = lambda y: y.reshape(y.shape[0] * y.shape[1], *y.shape[2:])
  (kmats, gam, lam_k), (intra, own), states, do = jax.jit(lambda mats, states, do: (
      merlin_pallas.kernel_layout(mats[:-2]), merlin_pallas.readout_layout(*mats[-2:], vp),
      [merge(y) for y in states], merge(do).astype(dtype)))(mats, states, do)

  def launch(name, fn, operands, forward, **static):
    sec, _, out = measure(functools.partial(fn, cps=cps, cfg=cfg, **static), operands, repeats)
    times[name] = (sec, sec) if forward else (nan, sec)
    return out

  kern, read = merlin_pallas.stages(cfg), dict(scale=scale, heads=h)  # Triton or TPU stages
  if erase:
    qe, w, kw, uv = kmats
    p, u = launch("span maps", kern.span_maps, (qe, w, kw, gam), True, phi=False)
    cur, span = launch("state pass", kern.span_state_pass, (w, kw, uv, gam, u), True)
    launch("readout", kern.span_readout, (qe, lam_k, p, span, cur, intra, own), True, **read)
    phi, p, u = launch("span maps, Phi", kern.span_maps, (qe, w, kw, gam), False)
    dspan, dcur, duv = launch("reverse pass", kern.span_reverse_pass,
                              (qe, p, w, kw, u, lam_k, gam, do), False)
    _, y, *own_parts, _ = launch("chunk gradients", kern.span_chunk_gradients,
                                 (qe, p, phi, w, uv, duv, lam_k, do, span, cur, dcur), False)
    launch("span sums", kern.span_sums, (qe, phi, w, kw, gam, span, dspan, y, *own_parts),
           False)
  else:
    qe, kw, uv = kmats
    cur, end = launch("write pass", kern.write_pass, (kw, uv, gam), True)
    launch("readout", kern.rescaled_readout, (qe, lam_k, cur, end, intra, own), True, **read)
    launch("reverse pass", kern.rescaled_reverse_pass, (qe, kw, uv, lam_k, gam, do, cur), False)
    launch("read gradients", kern.rescaled_read_gradients, (qe, lam_k, do, cur, end), False)

  (fwd, fb), (intra_fwd, intra_fb) = times["op"], times["intra_chunk"]
  times["glue"] = (fwd - intra_fwd - kfwd, fb - intra_fb - kfwd - kbwd)

  costs = part_costs(b, t, h, d, vd, seg, c, erase=erase, itemsize=jnp.dtype(dtype).itemsize,
                     block_v=cfg.block_v)
  floor = lambda fl, by: floor_ms(fl, by, 1)
  fl, by = costs["intra_chunk"]
  floors = {"intra_chunk": (floor(fl, by), floor(3 * fl, 2 * by)), "glue": (nan, nan)}
  forward, backward = PART_ROWS[erase]
  launches = forward + backward
  for name in launches:
    floors[name] = ((floor(*costs[name]),) * 2 if name in forward
                    else (nan, floor(*costs[name])))
  for part, names in (("kernels fwd", forward), ("kernels bwd", backward)):
    fl, by = (sum(costs[k][i] for k in names) for i in (0, 1))
    floors[part] = (floor(fl, by) if part == "kernels fwd" else nan, floor(fl, by))
  fl, by = multistate_cost(b, t, h, d, vd, args.R, seg, c, erase=erase, aggregator="vanilla",
                           itemsize=jnp.dtype(dtype).itemsize)
  floors["op"] = (floor_ms(fl, by, 1), floor_ms(fl, by, 3))
  floors["op, grads only"] = (nan, floors["op"][1])

  print(f"\nparts of multistate_attention(impl=\"pallas\", erase={erase}), B={b} T={t} H={h} "
        f"D={d} V={vd} L={seg} C={c} {jnp.dtype(dtype).name}; {plan}")
  print(f"intra_chunk compiled: forward {census[0]}; f+b {census[1]}")
  print("floors: a stage's from part_costs (its launches' operands read once, results written "
        "once; intra_chunk's f+b 3x FLOPs, 2x bytes), the op's from multistate_cost; indented: "
        "each launch alone, within the kernels row above it; glue = op - intra_chunk - kernels; "
        "every f+b but the last row's returns the forward's results too")
  cols = ["part", "fwd ms", "f+b ms", "floor fwd", "floor f+b", "f+b/floor", "% op fwd",
          "% op f+b"]
  widths = [24] + [10] * (len(cols) - 1)
  line = lambda cells: "| " + " | ".join(f"{x:{'<' if i == 0 else '>'}{w}}"
                                         for i, (x, w) in enumerate(zip(cells, widths))) + " |"
  cell = lambda v, spec: "-" if np.isnan(v) else format(v, spec)
  print(line(cols))
  print("|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":"
                       for i, w in enumerate(widths)) + "|")
  order = ["intra_chunk", "kernels fwd", *forward, "kernels bwd", *backward, "glue", "op",
           "op, grads only"]
  for name in order:
    (fwd, fb), (ffwd, ffb) = times[name], floors[name]
    fwd, fb = 1e3 * fwd, 1e3 * fb
    label = ("  - " + name) if name in launches else name
    print(line([label, cell(fwd, ".3f"), cell(fb, ".3f"), cell(ffwd, ".3g"), cell(ffb, ".3g"),
                cell(fb / ffb, ".2f"), cell(100 * fwd / (1e3 * times["op"][0]), ".1f"),
                cell(100 * fb / (1e3 * times["op"][1]), ".1f")]), flush=True)


def profile_ops(args, t, dtype):
  """Each ``--impls`` op's forward+backward at T = t (``training_grad``, as ``fwd_and_fwd_bwd``
  times it) under the JAX profiler: device ms by kernel and XLA fusion
  (``common.kernel_profile``), glue included."""
  n = args.max_segments or -(-t // args.segment_len)
  x = inputs(jax.random.PRNGKey(t), args.B, t, args.H, args.D, args.V, args.R, n, dtype)
  lam = jax.jit(lambda x: weights("merlin", x, args.segment_len, n, "parallel"))(x)
  cot = jax.random.normal(jax.random.PRNGKey(1), (args.B, t, args.H, args.V))
  for impl in args.impls.split(","):
    grad = jax.jit(training_grad(attention(impl, args.segment_len, args.chunk, args.config), 2))
    rows, wall = kernel_profile(grad, (cot, x, lam), reps=args.repeats)
    print(f"\n## multistate {impl} f+b (o kept), T = {t}, N = {n}\n")
    print(profile_table(rows, wall), flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
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
  ap.add_argument("--parts", action="store_true",
                  help="only the parts table of the pallas impl: where its time goes")
  ap.add_argument("--profile", action="store_true",
                  help="only the profile: each --impls op's f+b (o kept) per T under the JAX "
                       "profiler, device ms by kernel and XLA fusion")
  ap.add_argument("--erase", default="on", choices=("on", "off", "both"),
                  help="the parts table's erase: on (multi-state GDN), off (multi-state Mamba-2) "
                       "or both")
  ap.add_argument("--tiles", default="",
                  help="the pallas impl's Config fields replaced in the plan's default, e.g. "
                       "block_v=32,num_warps=4 or query_walk=True (every table; default: the "
                       "plan's)")
  ap.add_argument("--op-variants", nargs="*", default=[],
                  help="the op table only: also the pallas impl with each of these sets of "
                       "Config fields (--tiles' syntax) over its config, a row each, so that a "
                       "tile choice is timed beside the default in one process")
  for kernel, launch in (("forward", "WARPS,BV (warps, value columns a block)"),
                         ("backward", "WARPS,BV,BD (warps, value and key columns a block)")):
    ap.add_argument(f"--intra-{kernel}", nargs="*", default=[],
                    help=f"the op table only: also the pallas impl with the intra-chunk {kernel} "
                         f"kernel launched as each {launch}, a row each")
  args = ap.parse_args(argv)
  args.config = tiles_config(args.tiles)   # the pallas impl's Config in every table

  lengths = [int(t) for t in args.T.split(",")]
  n = args.max_segments or -(-max(lengths) // args.segment_len)
  dtype = jnp.dtype(args.dtype)
  print(machine())
  print(f"B={args.B} H={args.H} D={args.D} V={args.V} R={args.R} L={args.segment_len} "
        f"N={n} (pipeline) C={args.chunk} {dtype.name}; times in ms (median of {args.repeats}), "
        "temp = XLA temporary MiB of the f+b")
  if args.profile:
    for t in lengths:
      profile_ops(args, t, dtype)
    return
  floor_ms = lambda fl, by, mult: np.nan
  if not args.no_floors:
    gpu = jax.default_backend() == "gpu"
    peak, hbm = ceilings(8192 if gpu else 1024, jnp.bfloat16 if gpu else jnp.float32,
                         2048 if gpu else 256)
    print(f"ceilings measured now: matmul {peak:.1f} TFLOP/s, memory {hbm:.0f} GB/s; floor = "
          "max(counted FLOPs / matmul ceiling, counted bytes / memory ceiling), f+b = 3x fwd")
    floor_ms = lambda fl, by, mult: 1e3 * max(mult * fl / (peak * 1e12), by / (hbm * 1e9))
  if args.parts:
    for t in lengths:
      for erase in {"on": (True,), "off": (False,), "both": (True, False)}[args.erase]:
        parts_table(args, t, dtype, erase, floor_ms)
    return
  if not args.no_op_table:
    op_table(args, lengths, dtype, floor_ms)
  if args.aggregators:
    pipeline_table(args, lengths, n, dtype, floor_ms)


if __name__ == "__main__":
  main()
