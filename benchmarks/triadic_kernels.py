"""Triadic kernels: Pallas vs chunked JAX vs causal attention (cuDNN) vs the public GDN kernels.

The setting: bf16, H = 16, D = V = 128, 32768 tokens per batch (B=8 at T=4096, B=2 at 16384, B=1 at
65536), E in {1, 2, 4, 8}, chunk 64. The op table gives milliseconds (median of --reps timed calls
after a warm-up) for forward and forward+backward, the ratio to our E = 1, and the ratio to the
fastest of FLA's Triton chunk GDN and FlashQLA (``benchmarks/peers.py``), timed in the same process
on the E = 1 slice of the same inputs when torch and those packages import (else reported missing),
and the triadic paper's authors' kernels (``cute-triadic-gdn``) at every E on the same inputs.

  PYTHONPATH=. python3 benchmarks/triadic_kernels.py                 # the full table (GPU)
  PYTHONPATH=. python3 benchmarks/triadic_kernels.py --check         # GPU correctness first
  PYTHONPATH=. python3 benchmarks/triadic_kernels.py --t 16384 --e 1 8 --no-chunked --no-triton
  PYTHONPATH=. python3 benchmarks/triadic_kernels.py --stages --t 16384 --e 1 8   # per kernel
  PYTHONPATH=. python3 benchmarks/triadic_kernels.py --layouts --t 16384 --e 1 8  # q, k, v layout
  PYTHONPATH=. python3 benchmarks/triadic_kernels.py --profile --t 16384 --e 1 8  # the op's kernels
  PYTHONPATH=. python3 benchmarks/triadic_kernels.py --regions --t 4096 --e 8     # inside the loops

On Hopper, "pallas" runs the Mosaic GPU kernels (the state-passing kernels, ``Config.mosaic_gpu``,
and the chunk-parallel backward's E-dependent part, ``Config.mosaic_gpu_backward``) and a
"pallas-triton" column the same op with the Triton kernels only (the path of other GPUs).
``--stages`` times each stage alone with this device's matmul and HBM ceilings measured in the
same run (each stage's achieved TFLOP/s of counted matmuls), and the chunk backward by part.
``--profile`` runs the whole op's forward+backward as training calls it under the JAX profiler
and lists every kernel and XLA fusion it launched with its device time: the stages as they run
inside the op, glue included, with nothing taken out by a harness. ``--regions`` looks inside the
Mosaic GPU state passes: their chunk loops' named stages and input waits by SM clock cycles per
chunk (Mosaic GPU's profiler, ``triadic.pallas.mosaic.trace_regions``).

Needs only jax (no grain / ml_collections) for our kernels, so it runs on the bare GPU machine;
the peers need torch plus flash-linear-attention / flash-qla (``../shared/device/wheels.sh``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gzip
import os
import re
import shutil
import statistics
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The PyTorch peers share the GPU with JAX in this process: JAX must not take 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from triadic import xla_flags  # noqa: E402

xla_flags.apply_cpu_workaround()

from benchmarks import peers  # noqa: E402
from benchmarks.common import ceilings, kernel_profile, median_ms, profile_table  # noqa: E402
from benchmarks.common import kernel_regions, mosaic_kernel_name, regions_plot  # noqa: E402
from benchmarks.common import regions_table  # noqa: E402
from benchmarks.common import variant_fields  # noqa: E402
from benchmarks.common import triadic_inputs as inputs  # noqa: E402
from testkit import rel_rms as rel  # noqa: E402
from triadic.ops import triadic_gdn  # noqa: E402
from triadic.pallas import mosaic  # noqa: E402
from triadic.pallas import ops as pops  # noqa: E402

SHAPES = {4096: 8, 16384: 2, 65536: 1}  # T -> B, 32768 tokens per batch


def chunked_flops(b, t, h, d, vd, e, c=64):
  """Matmul FLOPs of the chunked form, forward: per token and head, Q K^T and K K^T (4 C D),
  A rhs and P U (4 C V), the state read, the output read and the state write (6 E D V). The UT
  inverse and the elementwise masks are not counted. Forward+backward is counted as 3x forward."""
  return b * t * h * (4 * c * d + 4 * c * vd + 6 * e * d * vd)


def stage_flops(b, t, h, d, vd, e, c=64):
  """Matmul FLOPs of each Pallas stage (prep, forward, backward states, chunk backward), counted
  as 2 m n k per product, per token and head:

  prep            K K^T, Q K^T                                       4 C D
  forward         K S, Q S, K^T W (E slices);  A rhs, P U             6 E D V + 4 C V
  backward states K dS, Q^T dO, K^T (A^T dU) (E slices);  P^T dO, A^T dU   6 E D V + 4 C V
  chunk backward  dX S^T, dO S^T, U dS^T, the diagonal blocks of       8 E D V
                  S dS^T (E slices; the slice kernel, at C = 64)
                  A^T dU, dU rhs^T, dO U^T;  K K^T, Q K^T, dP K, dP^T Q, dL K, dL^T K;
                  A^T dA A^T                                          + 6 C V + 12 C D + 4 C^2
  Elementwise work (the C x C x E decay masks, the UT forward substitution) is not counted."""
  n = b * t * h
  return (n * 4 * c * d, n * (6 * e * d * vd + 4 * c * vd), n * (6 * e * d * vd + 4 * c * vd),
          n * (8 * e * d * vd + 6 * c * vd + 12 * c * d + 4 * c * c))


def stage_bytes(b, t, h, d, vd, e, c=64, half=2):
  """HBM bytes of each Pallas stage (prep, forward, backward states, chunk backward) with every
  operand read once and every result written once, in the dtypes the kernels take and give
  (``half`` bytes for q, k, v, o, dO, U, dU, X and the chunk states, 4 for the rest; erase), per
  token and head:

  prep            q, k; k2, q2, g, beta  ->  gc (column and row), A, P (C each)
  forward         q, k, v; k2, q2, gc, beta; A, P  ->  o, U, X, chunk-start states (E D V / C)
  backward states q, k, dO; k2, q2, gc, beta; A, P  ->  dU, chunk-end state gradients
  chunk backward  q, k, v, X, dO; U, dU; both chunk states; k2 (both layouts), q2, gc (both), beta,
                  A  ->  dq, dk (half), dv, dk2 (both parts), dq2, d gc (both parts), dbeta

  The floor of the stages as designed: re-reads (each value block of a state pass reads the
  chunk's K, Q, A, P again), plain-JAX intermediates (the masks M, M', transposed and cast copies)
  and residuals the stage keeps on chip are not counted."""
  n = b * t * h
  states = half * e * d * vd / c
  return (n * (2 * half * d + 4 * (3 * e + 1) + 4 * 2 * e + 4 * 2 * c),
          n * (half * (2 * d + vd) + 4 * (3 * e + 1) + 4 * 2 * c + 3 * half * vd + states),
          n * (half * (2 * d + vd) + 4 * (3 * e + 1) + 4 * 2 * c + half * vd + states),
          n * (half * (2 * d + 5 * vd) + 2 * states + 4 * (5 * e + 1) + 4 * c
               + half * 2 * d + 4 * vd + 4 * (5 * e + 1)))


def roofline_cells(ms, flops, nbytes, peak, hbm):
  """Table cells per stage: counted GB, the floor max(FLOPs / matmul ceiling, bytes / HBM
  ceiling) in ms, and measured / floor."""
  cells = []
  for x, f, by in zip(ms, flops, nbytes):
    floor = 1e3 * max(f / (peak * 1e12), by / (hbm * 1e9))
    cells.append(f"{by / 1e9:.2f} GB, {floor:.2f} ms, {x / floor:.1f}x")
  return cells


def timeit(fn, args, reps):
  """Median ms of ``fn(*args)`` over ``reps`` calls after a warm-up (``common.median_ms``)."""
  return median_ms(fn, args, reps=reps)


def pallas_config(e, vd, bh, **fields):
  """This device's default kernel config at E (padded to a power of two), V and B*H (as the op
  takes it), with ``fields`` replaced; a field given as None keeps its default."""
  cfg = pops.default_config(pops.default_platform(), pops.pow2(e), vd, bh=bh)
  return dataclasses.replace(cfg, **{k: x for k, x in fields.items() if x is not None})


def triadic_fns(impl, **config):
  """jitted forward and forward+backward of ``impl``; for "pallas", ``config`` replaces fields of
  the device's default kernel ``Config`` (e.g. ``mosaic_gpu=False, mosaic_gpu_backward=False``
  for the Triton kernels on Hopper, ``slice_warpgroups=1``)."""
  if not config:
    run = lambda *a: triadic_gdn(*a, impl=impl, chunk_size=64)[0]
  else:
    def run(q, k, v, k2, q2, g, beta):
      cfg = pallas_config(k2.shape[-1], v.shape[-1], q.shape[0] * q.shape[2], **config)
      h0 = jnp.zeros((q.shape[0], q.shape[2], k2.shape[-1], q.shape[-1], v.shape[-1]),
                     jnp.float32)
      return pops.triadic_pallas(q, k, v, k2, q2, g, beta, scale=q.shape[-1] ** -0.5,
                                 initial_state=h0, erase=True, chunk_size=64, config=cfg)[0]

  def fwd_bwd(*a):
    o, pull = jax.vjp(run, *a)
    return pull(jnp.ones_like(o))

  return jax.jit(run), jax.jit(fwd_bwd)


def attention_fns():
  run = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                      implementation="cudnn")

  def fwd_bwd(q, k, v):
    o, pull = jax.vjp(run, q, k, v)
    return pull(jnp.ones_like(o))

  return jax.jit(run), jax.jit(fwd_bwd)


def check(only=None, variants=()):
  """Relative RMS error of pallas (the device's default kernels: Mosaic GPU on Hopper for bf16)
  and of each of ``variants`` (``--op-variants``' sets: ``Config`` fields over the default)
  against scan (float32) and chunked (bf16) on this machine; the reference once per case. Each
  config also gets a "primal" row: o and the final state of the op called without a gradient
  (``_core``'s primal, whose Mosaic forward state pass writes nothing else), against the same
  reference."""
  names = "o state dq dk dv dk2 dq2 dg dbeta dh0".split()
  print("| case | config | " + " | ".join(names) + " |")
  print("|" + "---|" * (len(names) + 2))
  cases = [("f32 scan B1 T300 H2 D64 V64 E3", (1, 300, 2, 64, 64, 3), jnp.float32, "scan", True),
           ("f32 scan sGLA E2", (1, 200, 2, 32, 48, 2), jnp.float32, "scan", False),
           ("bf16 vs chunked B1 T2048 H4 D128 E8", (1, 2048, 4, 128, 128, 8), jnp.bfloat16,
            "chunked", True),
           ("bf16 vs chunked B2 T1000 H2 D64 V128 E3", (2, 1000, 2, 64, 128, 3), jnp.bfloat16,
            "chunked", True),
           ("bf16 vs chunked sGLA B1 T777 H3 D128 E4", (1, 777, 3, 128, 128, 4), jnp.bfloat16,
            "chunked", False),
           ("bf16 vs chunked B2 T1000 H2 D128 E1", (2, 1000, 2, 128, 128, 1), jnp.bfloat16,
            "chunked", True),
           ("bf16 vs chunked sGLA B1 T777 H3 D64 V128 E2", (1, 777, 3, 64, 128, 2), jnp.bfloat16,
            "chunked", False),
           ("bf16 vs chunked B2 T1024 H16 D128 E2", (2, 1024, 16, 128, 128, 2), jnp.bfloat16,
            "chunked", True)]
  for i, (label, (b, t, h, d, vd, e), dtype, ref, erase) in enumerate(cases):
    if only and i not in only:
      continue
    args = inputs(jax.random.PRNGKey(0), b, t, h, d, vd, e, dtype)
    h0 = 0.1 * jax.random.normal(jax.random.PRNGKey(1), (b, h, e, d, vd))
    kd, ks = jax.random.split(jax.random.PRNGKey(2))
    do = jax.random.normal(kd, (b, t, h, vd), dtype)
    dh = jax.random.normal(ks, (b, h, e, d, vd))

    def grads(impl, fields=None):
      f = lambda *a: triadic_gdn(*a[:7], initial_state=a[7], erase=erase, impl=impl,
                                 chunk_size=64)
      if fields:
        cfg = pallas_config(e, vd, b * h, **fields)
        f = lambda *a: pops.triadic_pallas(*a[:7], scale=d ** -0.5, initial_state=a[7],
                                           erase=erase, chunk_size=64, config=cfg)
      (o, s), pull = jax.vjp(f, *args, h0)
      return [o, s] + list(pull((do, dh)))

    def primal(fields):
      cfg = pallas_config(e, vd, b * h, **fields)
      return list(pops.triadic_pallas(*args, scale=d ** -0.5, initial_state=h0, erase=erase,
                                      chunk_size=64, config=cfg))

    want = jax.jit(lambda: grads(ref))()
    for name, fields in [("default", None)] + [(v, variant_fields(v)) for v in variants]:
      if dtype == jnp.bfloat16:  # the bf16 cases run the Hopper kernels: which layout they take
        cfg = pallas_config(e, vd, b * h, **(fields or {}))
        layout = pops.explain_layout(b, t, h, d, vd, e, 64, dtype, config=cfg)
        plan = pops.explain(d, vd, e, 64, dtype, config=cfg)
        print(f"# {label}, {name}: {layout}; M, M' kept from the forward: {plan.saves_masks}; "
              f"A^T dU and dV from the reverse pass: {plan.saves_drhs(erase)}; dq, dk partials "
              f"in bf16: {plan.mosaic_chunk_gradients and cfg.partials_in_bf16}")
      try:
        got = jax.jit(lambda: grads("pallas", fields))()
      except Exception as err:  # one failing option must not end the table
        print(f"| {label} | {name} | failed: {type(err).__name__}: {err}"[:300] + " |")
      else:
        print(f"| {label} | {name} | "
              + " | ".join(f"{rel(x, y):.1e}" for x, y in zip(got, want)) + " |")
      try:      # the primal: o and the state (the Mosaic forward without residuals)
        got = jax.jit(lambda: primal(fields or {}))()
      except Exception as err:
        print(f"| {label} | {name} primal | failed: {type(err).__name__}: {err}"[:300] + " |")
      else:
        print(f"| {label} | {name} primal | "
              + " | ".join(f"{rel(x, y):.1e}" for x, y in zip(got, want[:2]))
              + " |" + " - |" * (len(names) - 2))
      sys.stdout.flush()


def stages(t, e_list, reps, variants=False, tails=False, fields=()):
  """Time each Pallas stage alone (bf16, H = 16, D = V = 128). On Hopper: the default kernels (all
  Mosaic GPU where they take the sizes) and the default with each of ``fields`` (``Config``
  fields, ``--op-variants``' sets) set over it; with ``variants``, also the Triton kernels and a
  few of their tile configurations; with ``tails``, the Hopper backward's tail (fused and split)
  under ``TAIL_VARIANTS``. Elsewhere: the Triton kernels (and their variants)."""
  from triadic.pallas.chunk_prep import chunk_prep
  b, h, d, vd, c = SHAPES.get(t, 1), 16, 128, 128, 64
  nc = t // c
  peak, hbm = ceilings(reps=reps)
  print(f"# ceilings measured now: bf16 matmul {peak:.0f} TFLOP/s, HBM {hbm:.0f} GB/s; "
        f"B={b} T={t} H={h} D=V={d}; each cell: ms (TFLOP/s of the counted matmuls, "
        "``stage_flops``)")
  print("| E | config | prep | forward | backward states | chunk backward | total |")
  print("|---|---|---|---|---|---|---|")
  parts, tail_rows = [], []
  for e in e_list:
    q, k, v, k2, q2, g, beta = inputs(jax.random.PRNGKey(0), b, t, h, d, vd, e, jnp.bfloat16)
    ch = lambda x, dt: pops.kernel_layout(x.astype(dt), nc, c).reshape(b * h, nc, c, -1)
    q, k, v, do = (ch(x, jnp.bfloat16) for x in (q, k, v, v))
    k2, q2, g, beta = (ch(x, jnp.float32) for x in (k2, q2, g, beta))
    rows = lambda x: jnp.swapaxes(x, -1, -2)
    h0 = jnp.zeros((b * h, e, d, vd), jnp.float32)
    default = pops.default_config("gpu", e, vd)
    triton = dataclasses.replace(default, mosaic_gpu=False, mosaic_gpu_backward=False)
    configs = [default] + [dataclasses.replace(default, **f) for f in fields]
    if variants or not default.mosaic_gpu:
      configs += [triton] + ([dataclasses.replace(triton, **kw) for kw in (
          {"num_stages": 1}, {"num_stages": 3}, {"block_v": 64}, {"num_warps": 8},
          {"bwd_block_v": 64}, {"bwd_num_warps": 4})] if variants else [])
    for cfg in configs:
      pre = jax.jit(lambda *x: chunk_prep(*x, erase=True, cfg=cfg))
      prep_args = (q, k, k2, q2, g, beta)
      prep = pre(*prep_args)
      gc_col, gc_row, a, p, a_operand = prep[:5]
      plan = pops.explain(d, vd, e, c, jnp.bfloat16, config=cfg)
      saves_x = plan.saves_x(True)
      state_fwd, state_bwd = pops.state_pass_kernels(cfg, q, v, k2, save_x=saves_x,
                                                     save_drhs=plan.saves_drhs(True))
      fwd = jax.jit(functools.partial(state_fwd, scale=0.1, erase=True))
      fwd_args = (q, k, v, k2, q2, gc_col, beta, a_operand, p, h0)
      o, u, *x, st, ht = fwd(*fwd_args)     # X where the plan saves it (``Plan.saves_x``)
      bst = jax.jit(functools.partial(state_bwd, scale=0.1, erase=True))
      bst_args = (q, k, do, k2, q2, gc_col, beta, a_operand, p, h0)
      du, *rhs_grads, dst, _ = bst(*bst_args)    # A^T dU, dV where ``Plan.saves_drhs``
      kernel = functools.partial(pops.chunk_gradients_kernel(cfg, q, v, k2), scale=0.1,
                                 erase=True)
      # As the op: M', M kept from the prep (``Plan.saves_masks``), A^T dU and dV from the
      # reverse pass (``Plan.saves_drhs``), passed by name after the positional operands.
      extra = dict(zip(("mq", "m"), (prep.mq, prep.m))) if plan.saves_masks else {}
      extra.update(zip(("drhs", "dv"), rhs_grads))
      n_pos = 15 + len(x)

      def chunk_backward(*xs):
        return kernel(*xs[:n_pos], **dict(zip(extra, xs[n_pos:])))

      cbw = jax.jit(chunk_backward)
      cbw_args = (q, k, v, do, u, du, st, dst, k2, rows(k2), q2, gc_col, gc_row, beta, a, *x,
                  *extra.values())
      ms = [timeit(f, xs, reps) for f, xs in ((pre, prep_args), (fwd, fwd_args),
                                              (bst, bst_args), (cbw, cbw_args))]
      label = (f"bv{cfg.block_v} w{cfg.num_warps} s{cfg.num_stages} "
               f"bwd_bv{cfg.bwd_block_v} bwd_w{cfg.bwd_num_warps}")
      label = "mgpu state kernels, " + label if cfg.mosaic_gpu else label
      label = "mgpu chunk backward, " + label if cfg.mosaic_gpu_backward else label
      changed = [f.name for f in dataclasses.fields(cfg)
                 if getattr(cfg, f.name) != getattr(default, f.name)]
      label = "".join(f"{n}={getattr(cfg, n)}, " for n in changed) + label
      fl = stage_flops(b, t, h, d, vd, e, c)
      cells = [f"{x:.2f} ({f / (x * 1e-3) / 1e12:.0f})" for x, f in zip(ms, fl)]
      cells.append(f"{sum(ms):.2f} ({sum(fl) / (sum(ms) * 1e-3) / 1e12:.0f})")
      print(f"| {e} | {label} | " + " | ".join(cells) + " |")
      by = stage_bytes(b, t, h, d, vd, e, c)
      roof = roofline_cells(ms + [sum(ms)], fl + (sum(fl),), by + (sum(by),), peak, hbm)
      print(f"# roofline, E = {e} (counted bytes, floor, measured / floor): prep | forward | "
            "backward states | chunk backward | total: " + " | ".join(roof), flush=True)
      print(f"# prep by part, E = {e}: " + prep_parts(prep_args, reps), flush=True)
      lean = jax.jit(functools.partial(   # the primal's pass: o and the final state only
          pops.state_pass_kernels(cfg, q, v, k2, residuals=False)[0], scale=0.1, erase=True))
      print(f"# forward state pass without residuals (a call without gradients), E = {e}: "
            f"{timeit(lean, fwd_args, reps):.2f} ms", flush=True)
      if cfg.mosaic_gpu_backward:  # each row also printed as it comes (a run cut short keeps it)
        parts.append((e, mosaic_backward_parts(cbw_args[:15], x[0] if x else None, reps, cfg)))
        print(f"# chunk backward by part, E = {e}: " + " | ".join(parts[-1][1]), flush=True)
        if tails and cfg is default:
          for row in tail_variants(cbw_args[:15], reps):
            tail_rows.append(row)
            print("# tail " + row, flush=True)
  if parts:
    print("\nThe Mosaic chunk backward by part (ms): plain-JAX prologue (A^T dU, factor rows; "
          "the op takes A^T dU from the reverse pass where Plan.saves_drhs), the Mosaic slice "
          "kernel, the tail (masks M, M' in plain JAX, which the op keeps from the forward where "
          "Plan.saves_masks, the E-independent tail kernel, the mask gradients in plain JAX, "
          "and instead by their kernel at 4 / 8 warps: Config.mask_grads_kernel)")
    print("| E | slice kernel | prologue | slice kernel | masks | tail kernel "
          "| mask grads | mask grads kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for e, cells in parts:
      print(f"| {e} | " + " | ".join(cells) + " |")
  if tail_rows:
    print("\nThe tail (everything after the slice kernel; ms) by tiles, as one fused kernel and as "
          "the E-independent kernel between the plain-JAX masks and mask gradients")
    print("| E | tiles | fused | split |")
    print("|---|---|---|---|")
    print("\n".join(tail_rows))


def kernel_relayout(q, k, v, o, *, c):
  """The op's layout copies around a state pass (``ops.triadic_pallas``): q, k, v (B, T, H, X) to
  the kernels' (B*H, NC, C, X) and the pass's o (B*H, NC, C, V) back to (B, T, H, V)."""
  b, t, h = q.shape[:3]
  nc = -(-t // c)
  ch = lambda x: pops.kernel_layout(x, nc, c).reshape(b * h, nc, c, -1)
  back = jnp.moveaxis(o.reshape(b, h, nc * c, o.shape[-1])[:, :, :t], 1, 2)
  return ch(q), ch(k), ch(v), back


def layouts(t_list, e_list, reps):
  """The one-warpgroup Mosaic forward state pass (``mosaic.state_pass``) in the kernels' (BH, NC,
  C, X) layout against the same pass reading q, k, v and writing o in the user's (B, T, H, X)
  layout (``heads=H``), per T and E (bf16, H = 16, D = V = 128, erase, the default one-warpgroup
  block_v): the pass alone on relayouted operands, the relayout itself (q, k, v to the kernel
  layout and o back, as ``ops.triadic_pallas`` does them, one jitted function), the pass with
  ``heads``, and (pass + relayout) / (pass with heads): what reading the user's layout in place
  would save. Hopper only (the Mosaic GPU kernels)."""
  from triadic.pallas import mosaic
  from triadic.pallas.chunk_prep import chunk_prep
  if not pops.is_hopper():
    sys.exit("--layouts times the Mosaic GPU kernels: it needs a Hopper GPU, got "
             f"{jax.devices()[0].device_kind}")
  h, d, vd, c = 16, 128, 128, 64
  print(f"# one-warpgroup forward state pass, H={h} D=V={d}, erase; ms (median of {reps}); "
        "relayout: q, k, v -> (BH, NC, C, X) and o back, as the op does them")
  print("| B | T | E | block_v | pass | relayout | pass + relayout | pass with heads "
        "| (pass + relayout) / heads | o rel RMS |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for t in t_list:
    b = SHAPES.get(t, max(1, 32768 // t))
    if t % c:
      print(f"# T={t}: not a multiple of C={c}, which the heads layout needs; skipped")
      continue
    nc = t // c
    for e in e_list:
      bv = mosaic.default_block_v(d, vd, c, e)
      if bv is None:
        print(f"# E={e}: no one-warpgroup block_v at D={d}; skipped")
        continue
      xs = inputs(jax.random.PRNGKey(0), b, t, h, d, vd, e, jnp.bfloat16)
      ch = lambda x, dt: pops.kernel_layout(x.astype(dt), nc, c).reshape(b * h, nc, c, -1)
      q, k, v = (ch(x, jnp.bfloat16) for x in xs[:3])
      k2, q2, g, beta = (ch(x, jnp.float32) for x in xs[3:])
      h0 = jnp.zeros((b * h, e, d, vd), jnp.float32)
      cfg = pops.default_config("gpu", e, vd)
      prep = jax.jit(lambda *x: chunk_prep(*x, erase=True, cfg=cfg))(q, k, k2, q2, g, beta)
      gc_col, p, a = prep.gc_col, prep.p, prep.a_operand
      save_x = pops.explain(d, vd, e, c, jnp.bfloat16, config=cfg).saves_x(True)
      kw = dict(scale=0.1, erase=True, block_v=bv, save_x=save_x, warpgroups=1)
      rest = (k2, q2, gc_col, beta, a, p, h0)
      fwd = jax.jit(functools.partial(mosaic.state_pass, **kw))
      fwd_heads = jax.jit(functools.partial(mosaic.state_pass, heads=h, **kw))
      o = fwd(q, k, v, *rest)[0]
      relayout = jax.jit(functools.partial(kernel_relayout, c=c))
      rel_args = (*xs[:3], o)
      heads_args = (*xs[:3], *rest)
      ms = [timeit(fwd, (q, k, v, *rest), reps), timeit(relayout, rel_args, reps),
            timeit(fwd_heads, heads_args, reps)]
      err = rel(fwd_heads(*heads_args)[0], relayout(*rel_args)[3])
      cells = [b, t, e, bv] + [f"{x:.3f}" for x in (ms[0], ms[1], ms[0] + ms[1], ms[2])] + [
          f"{(ms[0] + ms[1]) / ms[2]:.2f}x", f"{err:.1e}"]
      print("| " + " | ".join(str(x) for x in cells) + " |", flush=True)


def prep_parts(prep_args, reps):
  """The prep's plain-JAX parts, each timed alone (ms): the cumulative decay and the masks M, M'
  (``masks``), and the UT inverse (``unit_lower_inverse``); the kernel with its glue is the rest
  of the whole stage's time. Beside them the UT inverse's kernel (``unit_lower_inverse_kernel``,
  ``Config.ut_kernel``) at 1, 2 and 4 warps."""
  from triadic.chunked import unit_lower_inverse
  from triadic.pallas import masks
  from triadic.pallas.chunk_prep import unit_lower_inverse_kernel
  q, k, k2, q2, g, beta = prep_args
  c = q.shape[-2]

  def mask_work(k2, q2, g):
    gc_col = masks.chunk_cumsum(g)
    return masks.decay_masks(k2, jnp.swapaxes(k2, -1, -2).astype(jnp.float32), q2, gc_col,
                             jnp.swapaxes(gc_col, -1, -2), erase=True)

  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  lower = jnp.where(strict, 0.1 * jax.random.normal(jax.random.PRNGKey(3), q.shape[:2] + (c, c)),
                    0.0)
  ms_masks = timeit(jax.jit(mask_work), (k2, q2, g), reps)
  ms_inv = timeit(jax.jit(unit_lower_inverse), (lower,), reps)
  cfg = pops.default_config(pops.default_platform(), 1, 128)
  kernel_ms = {w: timeit(jax.jit(functools.partial(unit_lower_inverse_kernel, cfg=cfg,
                                                   num_warps=w)), (lower,), reps)
               for w in (1, 2, 4)}
  kernel = ", ".join(f"{ms:.2f} ms ({w} warp{'s' if w > 1 else ''})" for w, ms in kernel_ms.items())
  return (f"masks {ms_masks:.2f} | UT inverse {ms_inv:.2f} ms (plain JAX); its kernel "
          f"(Config.ut_kernel): {kernel}")


def mosaic_backward_parts(cbw_args, x, reps, cfg):
  """Table cells: the times of the parts of ``mosaic_backward.chunk_gradients`` (erase=True,
  scale 0.1) under ``cfg`` (``x``: X as the forward saved it, or None; the masks and their
  gradients in plain JAX, then the gradients by ``masks.mask_grads_kernel`` at 4 and 8 warps in
  one cell, both with the same results; the masks are not the op's backward's where
  ``Plan.saves_masks``)."""
  from triadic.pallas import masks
  from triadic.pallas import mosaic_backward as mb
  q, k, v, do, u, du, st, dst, k2_col, k2_row, q2_col, gc_col, gc_row, beta_col, a = cbw_args
  d, e_dim = q.shape[-1], k2_col.shape[-1]
  wgs = mb.slice_warpgroups(cfg.slice_warpgroups, d)
  pro = jax.jit(lambda a, du, gc_col, k2_col, q2_col, beta_col: (
      mb.rhs_gradient(a, du, True), mb.factor_rows(gc_col, k2_col, q2_col, beta_col)))
  drhs, _ = pro(a, du, gc_col, k2_col, q2_col, beta_col)
  x = mb.x_from_states(k, v, st, k2_col, gc_col) if x is None else x
  label = f"{e_dim} slices, {wgs} warpgroup(s)"
  low = lambda y: y.astype(q.dtype)

  def slices(q, k, do, u, drhs, st, dst, gc_col, k2_col, q2_col, beta_col):
    f = mb.factor_rows(gc_col, k2_col, q2_col, beta_col)
    return mb.slices_pass(q, k, low(beta_col * drhs), low(do), low(u), st, dst, f, scale=0.1,
                          erase=True, warpgroups=wgs, partials_in_bf16=cfg.partials_in_bf16,
                          unroll_max_e=cfg.slice_unroll_max_e)

  sk = jax.jit(slices)
  sk_args = (q, k, do, u, drhs, st, dst, gc_col, k2_col, q2_col, beta_col)
  dqp, dkp, coef, _ = sk(*sk_args)
  msk = jax.jit(functools.partial(masks.decay_masks, erase=True))
  msk_args = (k2_col, k2_row, q2_col, gc_col, gc_row)
  m, mq = msk(*msk_args)
  tk = jax.jit(functools.partial(mb.tail_kernel, scale=0.1, erase=True,
                                 cfg=mb.tail_config(False, fused=False)))
  tk_args = (q, k, x, do, u, du, drhs, dqp, dkp, mq, m, beta_col, a)
  _, _, _, dmq, dm = tk(*tk_args)
  cols = coef[..., :e_dim]
  dlam = jnp.zeros_like(k2_col[..., 0, :])
  mg = jax.jit(functools.partial(masks.mask_grads, erase=True))
  mg_args = (dmq, dm, cols, cols, cols, dlam, k2_col, k2_row, q2_col, gc_col, gc_row)
  mg_kernels = [jax.jit(functools.partial(masks.mask_grads_kernel, erase=True, num_warps=w,
                                          cfg=mb.tail_config(False))) for w in (4, 8)]
  mgk_args = (dmq, dm, coef, dlam, k2_col, q2_col, gc_col)
  times = [timeit(fn, xs, reps) for fn, xs in ((pro, (a, du, gc_col, k2_col, q2_col, beta_col)),
                                               (sk, sk_args), (msk, msk_args), (tk, tk_args),
                                               (mg, mg_args))]
  kernel_times = " / ".join(f"{timeit(fn, mgk_args, reps):.2f}" for fn in mg_kernels)
  return [label] + [f"{x:.2f}" for x in times] + [kernel_times]


TAIL_VARIANTS = ({}, {"bwd_block_v": 128, "num_stages": 1}, {"bwd_block_v": 32},
                 {"bwd_num_warps": 4}, {"bwd_num_warps": 8}, {"num_stages": 3})


def tile_label(tiles):
  return f"bv{tiles['bwd_block_v']} w{tiles['bwd_num_warps']} s{tiles['num_stages']}"


def tail_variants(cbw_args, reps):
  """Table rows: ``mosaic_backward.tail`` (everything after the slice kernel), fused and split,
  under ``TAIL_VARIANTS`` (overrides of each one's ``mosaic_backward.TAIL_TILES``), in ms."""
  from triadic.pallas import mosaic_backward as mb
  q, k, v, do, u, du, st, dst, k2_col, k2_row, q2_col, gc_col, gc_row, beta_col, a = cbw_args
  e_dim = k2_col.shape[-1]
  drhs = mb.rhs_gradient(a, du, True)
  low = lambda y: y.astype(q.dtype)
  dqp = jnp.zeros(q.shape, jnp.float32)
  coef = jnp.full((*k2_col.shape[:-1], 3 * e_dim), 0.01, jnp.float32)
  args = (q, k, v, do, low(u), low(du), low(drhs), dqp, dqp, coef,
          jnp.zeros(k2_col.shape[:2] + (e_dim,), jnp.float32), k2_col, k2_row, q2_col, gc_col,
          gc_row, beta_col, a)
  rows = []
  for tiles in TAIL_VARIANTS:
    cells = []
    for fused in (True, False):
      fn = jax.jit(functools.partial(mb.tail, scale=0.1, erase=True, fused=fused,
                                     cfg=mb.tail_config(False, fused, **tiles)))
      label = tile_label({**mb.TAIL_TILES[fused], **tiles})
      try:
        cells.append(f"{timeit(fn, args, reps):.2f} ({label})")
      except Exception as err:  # a variant that does not compile (registers, shared memory)
        cells.append(f"failed ({type(err).__name__})")
    rows.append(f"| {e_dim} | {tiles or 'default'} | " + " | ".join(cells) + " |")
  return rows


def peer_table(e1_inputs, names, reps):
  """Time the PyTorch peers on our E = 1 inputs (``inputs(..., e=1)``), print one line each, and
  return the fastest forward and forward+backward (ms; nan where no peer ran)."""
  q, k, v, _, _, g, beta = e1_inputs
  b, t = q.shape[:2]
  res = peers.time_gdn_peers(q, k, v, g[..., 0], beta, reps, names) if names else {}
  for name, r in res.items():
    cell = f"{r[0]:.2f} / {r[1]:.2f} ms" if isinstance(r, tuple) else f"missing ({r})"
    print(f"# peer {name} chunk GDN B={b} T={t}: fwd / f+b {cell}")
  times = [r for r in res.values() if isinstance(r, tuple)]
  nan = float("nan")
  return (min((x[0] for x in times), default=nan), min((x[1] for x in times), default=nan))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--t", type=int, nargs="*", default=list(SHAPES))
  parser.add_argument("--e", type=int, nargs="*", default=[1, 2, 4, 8])
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=1,
                      help="op table: time the default and every --op-variants set in turn this "
                           "many times and print the median per cell")
  parser.add_argument("--check", action="store_true", help="correctness table, then exit")
  parser.add_argument("--no-chunked", action="store_true", help="skip the chunked JAX column")
  parser.add_argument("--no-attention", action="store_true", help="skip the cuDNN attention column")
  parser.add_argument("--no-triton", action="store_true",
                      help="on Hopper, skip the pallas-triton column (Triton kernels only)")
  parser.add_argument("--cases", type=int, nargs="*", help="with --check: which cases (0..7)")
  parser.add_argument("--stages", action="store_true", help="per-kernel times, then exit")
  parser.add_argument("--profile", action="store_true",
                      help="the op's forward+backward under the JAX profiler: device ms per "
                      "kernel and XLA fusion (default and each --op-variants set), then exit")
  parser.add_argument("--regions", action="store_true",
                      help="Hopper: one forward+backward (B = --b, T = the first --t) with the "
                           "Mosaic GPU state passes recording their chunk loops' named regions: "
                           "clock cycles per chunk per region and warpgroup (default and each "
                           "--op-variants set), then exit")
  parser.add_argument("--b", type=int, default=1, help="with --regions: the batch")
  parser.add_argument("--regions-out", help="with --regions: write each run's PNG (a bar per "
                      "kernel and warpgroup) and its Perfetto traces into this folder")
  parser.add_argument("--layouts", action="store_true",
                      help="Hopper: the one-warpgroup forward state pass on relayouted q, k, v "
                           "(plus the relayout) vs on (B, T, H, X) ones (heads), then exit")
  parser.add_argument("--peers", nargs="*", default=list(peers.PEERS),
                      help="PyTorch GDN kernels timed on the same inputs (E = 1 slices of ours); "
                           "missing packages are reported and skipped; none: --peers")
  parser.add_argument("--no-authors", action="store_true",
                      help="op table and --profile: skip the triadic paper's authors' kernels "
                           "(cute-triadic-gdn, run at every E on the same inputs where it imports)")
  parser.add_argument("--op-variants", nargs="*", default=[],
                      help="op table: also the op with these Config fields set over the "
                           "default (which depends on B*H), one comma-joined set per pair of "
                           "columns: a name alone is True, name=N an int, e.g. ut_kernel "
                           "sequence_pieces=1,state_block_v=32 (--check, --stages: a row per set "
                           "beside the default's). The forward columns time the op without a "
                           "gradient (its primal)")
  parser.add_argument("--tail-variants", action="store_true",
                      help="with --stages on Hopper: the chunk backward's tail, fused and split, "
                           "under a few tile choices")
  parser.add_argument("--variants", action="store_true",
                      help="with --stages: also other Triton tile configurations")
  args = parser.parse_args()
  dev = jax.devices()[0]
  print(f"# {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}")
  if args.check:
    check(args.cases, args.op_variants)
    return
  if args.stages:
    stages(args.t[0], args.e, args.reps, args.variants, args.tail_variants,
           [variant_fields(v) for v in args.op_variants])
    return
  if args.layouts:
    layouts(args.t, args.e, args.reps)
    return
  if args.profile:
    profile(args.t[0], args.e, args.reps, args.op_variants, authors=not args.no_authors)
    return
  if args.regions:
    regions(args.t[0], args.b, args.e, args.op_variants, args.regions_out)
    return
  op_table(args)


def profile(t, e_list, reps, variants=(), authors=True):
  """Per E, the op's forward+backward (bf16, H = 16, D = V = 128, 32768 tokens) under the JAX
  profiler, default config and each ``variants`` set: a table of every kernel and XLA fusion
  with its launches and device ms per call (``common.kernel_profile``); with ``authors``, the
  authors' kernels on the same inputs under the PyTorch profiler (``peers.authors_kernels``)."""
  h, d, vd = 16, 128, 128
  b = SHAPES.get(t, max(1, 32768 // t))
  for e in e_list:
    xs = inputs(jax.random.PRNGKey(0), b, t, h, d, vd, e, jnp.bfloat16)
    for variant in ("", *variants):
      fields = variant_fields(variant) if variant else {}
      fwd_bwd = triadic_fns("pallas", **fields)[1]
      rows, wall = kernel_profile(fwd_bwd, xs, reps=reps)
      print(f"\n## f+b B={b} T={t} E={e} {variant or 'default'}\n")
      print(profile_table(rows, wall))
      sys.stdout.flush()
    if authors:
      rows = peers.authors_kernels(*xs, reps=reps)
      print(f"\n## {peers.AUTHORS} f+b B={b} T={t} E={e}\n")
      if isinstance(rows, str):
        print(f"missing ({rows})")
        continue
      print("| kernel | launches | ms |\n|---|---|---|")
      print("\n".join(f"| {name[:80]} | {n:g} | {ms:.3f} |" for name, n, ms in rows))
      print(f"| total | {sum(r[1] for r in rows):g} | {sum(r[2] for r in rows):.3f} |")
      sys.stdout.flush()


def regions(t, b, e_list, variants=(), out=None):
  """Per E, the op's forward+backward (bf16, H = 16, D = V = 128, B = ``b``) with the Mosaic GPU
  state passes recording their named regions (``mosaic.trace_regions``), default config and each
  ``variants`` set: per kernel run, the clock cycles per chunk of each stage and input wait and
  their share of the program, per warpgroup (``common.kernel_regions``), below the kernel's
  device ms with and without the recording (``common.kernel_profile``), which is what the
  recording costs. With ``out``, each run's bars as a PNG there (``common.regions_plot``) and its
  gzipped Perfetto traces (ui.perfetto.dev opens them). The regions, up to 40 a chunk (the
  two-warpgroup passes' products are one region each), cost the kernel 16 bytes of SMEM each: a
  T of 4096 fits at E = 8 and 2048 at E = 4; a kernel that no longer fits is reported."""
  h, d, vd, c = 16, 128, 128, 64
  nc = -(-t // c)
  for e in e_list:
    xs = inputs(jax.random.PRNGKey(0), b, t, h, d, vd, e, jnp.bfloat16)
    for variant in ("", *variants):
      fields = variant_fields(variant) if variant else {}
      title = f"\n## regions: f+b B={b} T={t} E={e} {variant or 'default'}"
      plain = kernel_profile(triadic_fns("pallas", **fields)[1], xs, reps=3, sources={})[0]
      with tempfile.TemporaryDirectory() as trace_dir:
        try:
          with mosaic.trace_regions(trace_dir, regions=40 * nc + 8), warnings.catch_warnings():
            warnings.simplefilter("ignore")     # later runs find their trace files written
            fwd_bwd = triadic_fns("pallas", **fields)[1]
            jax.block_until_ready(fwd_bwd(*xs))                 # compiles
            for name in os.listdir(trace_dir):
              os.remove(os.path.join(trace_dir, name))
            traced = kernel_profile(fwd_bwd, xs, reps=1, sources={})[0]
        except ValueError as err:
          if "shared memory" not in str(err):
            raise
          print(f"{title}: not recorded, a kernel's SMEM with the recording is over the limit "
                f"(a smaller --t records fewer chunks): {str(err).splitlines()[0]}")
          continue
        print(title)
        runs, names = {}, sorted(os.listdir(trace_dir))
        for name in names:
          kernel = name.rsplit("-", 2)[0]
          wgs = 2 if "wg2" in kernel else 1
          ms = lambda rows: sum(r.ms for r in rows if mosaic_kernel_name(r.name) == kernel)
          print(f"\n{kernel} ({wgs} warpgroup{'s' * (wgs > 1)}): {ms(plain):.3f} ms a call "
                f"without the recording, {ms(traced):.3f} with (every launch of this kernel)\n")
          found = kernel_regions(os.path.join(trace_dir, name), wgs)
          runs[kernel if kernel not in runs else f"{kernel} ({len(runs)})"] = found
          print(regions_table(found))
        if out and runs:
          os.makedirs(out, exist_ok=True)
          stem = re.sub(r"[^\w.-]", "_", f"regions_B{b}_T{t}_E{e}_{variant or 'default'}")
          print("\n" + regions_plot(runs, os.path.join(out, stem + ".png"), title.strip("# \n")))
          for i, name in enumerate(names):
            with open(os.path.join(trace_dir, name), "rb") as src, \
                gzip.open(os.path.join(out, f"{stem}_{i}.json.gz"), "wb") as dst:
              shutil.copyfileobj(src, dst)
      sys.stdout.flush()


def time_in_rounds(configs, xs, reps, rounds, where):
  """{name: (fwd ms, f+b ms)} of each {name: (forward, forward+backward)} in ``configs``, each
  the median over ``rounds`` rounds that time every config in turn (so a drift of the machine
  during the table reaches all of them alike), each round's time the median of ``reps`` calls.
  A config that fails (an untimed option) is reported and gets nan; the others go on."""
  times = {name: ([], []) for name in configs}
  failed = set()
  for _ in range(rounds):
    for name, fns in configs.items():
      if name in failed:
        continue
      try:
        for fn, out in zip(fns, times[name]):
          out.append(timeit(fn, xs, reps))
      except Exception as err:  # an untimed option that fails here must not end the table
        print(f"# {name} failed at {where}: {type(err).__name__}: {err}"[:300])
        failed.add(name)
  nan = float("nan")
  return {name: tuple(nan if name in failed else statistics.median(x) for x in pair)
          for name, pair in times.items()}


def op_table(args):
  """The whole op, forward and forward+backward, at every (T, E): pallas (the device's defaults;
  with --op-variants also those Config variants), on Hopper the Triton-only kernels,
  the chunked JAX form, cuDNN attention, and the PyTorch peers on the E = 1 slice of the same
  inputs, with the ratios to the fastest peer, and the authors' kernels at this E (``--no-authors``
  skips them)."""
  h, d, vd = 16, 128, 128
  hopper = pops.is_hopper()
  nan = float("nan")
  if hopper:
    print("# pallas: Mosaic GPU (wgmma) state-passing kernels and chunk-parallel backward where "
          "they take the sizes; pallas-triton: the same op with the Triton kernels only")
  extra = "".join(f" {v} fwd | {v} f+b |" for v in args.op_variants)
  cols = ("B | T | E | pallas fwd | pallas f+b | f+b vs E=1 |" + extra
          + " pallas-triton fwd | pallas-triton f+b | chunked fwd | chunked f+b | cudnn fwd"
          " | cudnn f+b | best peer fwd | best peer f+b | fwd vs peer | f+b vs peer"
          " | authors fwd | authors f+b | f+b vs authors | pallas TFLOP/s fwd / f+b")
  from triadic.pallas import plan as plan_lib
  print("| " + cols + " |")
  print("|" + "---|" * (cols.count("|") + 1))
  for t in args.t:
    b = SHAPES.get(t, max(1, 32768 // t))
    key = jax.random.PRNGKey(0)
    att_fwd, att_fb = attention_fns()
    e1_inputs = inputs(key, b, t, h, d, vd, 1, jnp.bfloat16)
    qa, ka, va = e1_inputs[:3]
    att = (nan, nan)
    try:
      if not args.no_attention:
        att = (timeit(att_fwd, (qa, ka, va), args.reps), timeit(att_fb, (qa, ka, va), args.reps))
    except Exception as err:  # cuDNN missing or shape refused: report, do not stop the table
      print(f"# cudnn attention failed at T={t}: {type(err).__name__}: {err}"[:300])
    best = peer_table(e1_inputs, args.peers, args.reps)
    e1 = None
    for e in args.e:
      xs = inputs(key, b, t, h, d, vd, e, jnp.bfloat16)
      pieces_of = lambda cfg: plan_lib.sequence_pieces(
          cfg, bh=b * h, nc=-(-t // 64), d=d, vd=vd, c=64, e=pops.pow2(e), dtype=jnp.bfloat16)
      plan = pops.explain(d, vd, e, 64, jnp.bfloat16, bh=b * h)
      default = pallas_config(e, vd, b * h)
      layout = pops.explain_layout(b, t, h, d, vd, e, 64, jnp.bfloat16, config=default)
      print("\n".join("# " + line for line in str(plan).splitlines())
            + f"\n# state passes at B={b} T={t}: {pieces_of(default)}; {layout}")
      configs = {"default": triadic_fns("pallas")}
      for variant in args.op_variants:
        fields = variant_fields(variant)
        cfg = pallas_config(e, vd, b * h, **fields)
        print(f"# {variant} at B={b} T={t} E={e}: {pieces_of(cfg)}; "
              f"{pops.explain_layout(b, t, h, d, vd, e, 64, jnp.bfloat16, config=cfg)}")
        configs[variant] = triadic_fns("pallas", **fields)
      timed = time_in_rounds(configs, xs, args.reps, args.rounds, f"E={e}")
      pal = timed.pop("default")
      e1 = pal[1] if e == 1 else e1
      variants = [x for pair in timed.values() for x in pair]
      tri = (nan, nan)
      if hopper and not args.no_triton:
        tf_, tfb = triadic_fns("pallas", mosaic_gpu=False, mosaic_gpu_backward=False)
        tri = (timeit(tf_, xs, args.reps), timeit(tfb, xs, args.reps))
      chk = (nan, nan)
      if not args.no_chunked:
        cf, cfb = triadic_fns("chunked")
        chk = (timeit(cf, xs, args.reps), timeit(cfb, xs, args.reps))
      authors = (nan, nan)
      if not args.no_authors:
        res = peers.time_authors(*xs, reps=args.reps)
        cell = f"{res[0]:.2f} / {res[1]:.2f} ms" if isinstance(res, tuple) else f"missing ({res})"
        print(f"# peer {peers.AUTHORS} B={b} T={t} E={e}: fwd / f+b {cell}")
        authors = res if isinstance(res, tuple) else authors
      fl = chunked_flops(b, t, h, d, vd, e)
      tf = lambda ms, mult: mult * fl / (ms * 1e-3) / 1e12
      vs1 = f"{pal[1] / e1:.2f}x" if e1 else "-"
      cells = ([b, t, e, f"{pal[0]:.2f}", f"{pal[1]:.2f}", vs1] + [f"{x:.2f}" for x in variants]
               + [f"{x:.2f}" for x in (*tri, *chk, *att, *best)]
               + [f"{pal[0] / best[0]:.2f}x", f"{pal[1] / best[1]:.2f}x",
                  f"{authors[0]:.2f}", f"{authors[1]:.2f}", f"{pal[1] / authors[1]:.2f}x",
                  f"{tf(pal[0], 1):.0f} / {tf(pal[1], 3):.0f}"])
      print("| " + " | ".join(str(x) for x in cells) + " |")
      sys.stdout.flush()


if __name__ == "__main__":
  main()
