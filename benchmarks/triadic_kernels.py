"""Triadic kernels: Pallas vs chunked JAX vs causal attention (cuDNN), forward and forward+backward.

Issue 6's setting: bf16, H = 16, D = V = 128, 32768 tokens per batch (B=8 at T=4096, B=2 at 16384,
B=1 at 65536), E in {1, 2, 4, 8}, chunk 64. Prints one table: milliseconds (median of --reps timed
calls after a warm-up), the pallas/chunked and attention/pallas ratios, and the TFLOP/s each triadic
impl achieves against the matmul FLOP count of the chunked form (``chunked_flops``).

  PYTHONPATH=. python3 benchmarks/triadic_kernels.py                 # the full table (GPU)
  PYTHONPATH=. python3 benchmarks/triadic_kernels.py --check         # GPU correctness first
  PYTHONPATH=. python3 benchmarks/triadic_kernels.py --t 16384 --e 1 8
  PYTHONPATH=. python3 benchmarks/triadic_kernels.py --stages --t 16384 --e 1 8   # per kernel

On Hopper, "pallas" runs the Mosaic GPU kernels (the state-passing kernels, ``Config.mosaic_gpu``,
and the chunk-parallel backward's E-dependent part, ``Config.mosaic_gpu_backward``) and a
"pallas-triton" column the same op with the Triton kernels only (the path of other GPUs);
``--stages`` prints a row for each step between them. The stage table also measures this device's
matmul and HBM ceilings in the same run and gives each stage's achieved TFLOP/s.

Needs only jax (no grain / ml_collections), so it runs on the bare GPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import triadic_inputs as inputs  # noqa: E402
from testkit import rel_rms as rel  # noqa: E402
from triadic.ops import triadic_gdn  # noqa: E402
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
  chunk backward  K S, Q S, K dS, dk (2 products), dq (E slices);    12 E D V
                  A^T dU, dU rhs^T, dO U^T;  K K^T, Q K^T, dP K, dP^T Q, dL K, dL^T K;
                  A^T dA A^T                                          + 6 C V + 12 C D + 4 C^2
  Elementwise work (the C x C x E decay masks, the UT forward substitution) is not counted."""
  n = b * t * h
  return (n * 4 * c * d, n * (6 * e * d * vd + 4 * c * vd), n * (6 * e * d * vd + 4 * c * vd),
          n * (12 * e * d * vd + 6 * c * vd + 12 * c * d + 4 * c * c))


def ceilings(reps):
  """This device's bf16 matmul TFLOP/s (8192^3, f32 accumulation) and HBM GB/s (2 GiB f32 scaled
  copy: one read, one write), measured now, the reference for each stage's achieved rate."""
  n = 8192
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
  mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
  tflops = 2 * n ** 3 / (timeit(mm, (a, a), reps) * 1e-3) / 1e12
  x = jnp.ones((512, 1024, 1024), jnp.float32)
  gbs = 2 * x.nbytes / (timeit(jax.jit(lambda y: y * 1.5), (x,), reps) * 1e-3) / 1e9
  return tflops, gbs


def timeit(fn, args, reps):
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def pallas_config(e, vd, **fields):
  """This device's default kernel config at E (padded to a power of two) and V, with ``fields``
  replaced; a field given as None keeps its default."""
  cfg = pops.default_config(pops.default_platform(), pops._pow2(e), vd)
  return dataclasses.replace(cfg, **{k: x for k, x in fields.items() if x is not None})


def triadic_fns(impl, mosaic_gpu=None, mosaic_gpu_backward=None, xla_slice_grads=False):
  """jitted forward and forward+backward of ``impl``; for "pallas", ``mosaic_gpu`` and
  ``mosaic_gpu_backward`` True/False force the Hopper (Mosaic GPU) or the Triton state-passing
  kernels and chunk-parallel backward (None: the device's default); ``xla_slice_grads`` sets
  that ``Config`` field."""
  if mosaic_gpu is None and mosaic_gpu_backward is None and not xla_slice_grads:
    run = lambda *a: triadic_gdn(*a, impl=impl, chunk_size=64)[0]
  else:
    def run(q, k, v, k2, q2, g, beta):
      cfg = pallas_config(k2.shape[-1], v.shape[-1], mosaic_gpu=mosaic_gpu,
                          mosaic_gpu_backward=mosaic_gpu_backward,
                          xla_slice_grads=xla_slice_grads)
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


def check(only=None, xla_slice_grads=False):
  """Relative RMS error of pallas (the device's default kernels: Mosaic GPU on Hopper for bf16;
  with ``xla_slice_grads``, that ``Config`` field on) against scan (float32) and chunked (bf16)
  on this machine."""
  names = "o state dq dk dv dk2 dq2 dg dbeta dh0".split()
  print("| case | " + " | ".join(names) + " |")
  print("|" + "---|" * (len(names) + 1))
  cases = [("f32 scan B1 T300 H2 D64 V64 E3", (1, 300, 2, 64, 64, 3), jnp.float32, "scan", True),
           ("f32 scan sGLA E2", (1, 200, 2, 32, 48, 2), jnp.float32, "scan", False),
           ("bf16 vs chunked B1 T2048 H4 D128 E8", (1, 2048, 4, 128, 128, 8), jnp.bfloat16,
            "chunked", True),
           ("bf16 vs chunked B2 T1000 H2 D64 V128 E3", (2, 1000, 2, 64, 128, 3), jnp.bfloat16,
            "chunked", True),
           ("bf16 vs chunked sGLA B1 T777 H3 D128 E4", (1, 777, 3, 128, 128, 4), jnp.bfloat16,
            "chunked", False)]
  for i, (label, (b, t, h, d, vd, e), dtype, ref, erase) in enumerate(cases):
    if only and i not in only:
      continue
    args = inputs(jax.random.PRNGKey(0), b, t, h, d, vd, e, dtype)
    h0 = 0.1 * jax.random.normal(jax.random.PRNGKey(1), (b, h, e, d, vd))
    kd, ks = jax.random.split(jax.random.PRNGKey(2))
    do = jax.random.normal(kd, (b, t, h, vd), dtype)
    dh = jax.random.normal(ks, (b, h, e, d, vd))

    def grads(impl):
      f = lambda *a: triadic_gdn(*a[:7], initial_state=a[7], erase=erase, impl=impl,
                                 chunk_size=64)
      if impl == "pallas" and xla_slice_grads:
        cfg = pallas_config(e, vd, xla_slice_grads=True)
        f = lambda *a: pops.triadic_pallas(*a[:7], scale=d ** -0.5, initial_state=a[7],
                                           erase=erase, chunk_size=64, config=cfg)
      (o, s), pull = jax.vjp(f, *args, h0)
      return [o, s] + list(pull((do, dh)))

    got = jax.jit(lambda: grads("pallas"))()
    want = jax.jit(lambda: grads(ref))()
    print(f"| {label} | " + " | ".join(f"{rel(x, y):.1e}" for x, y in zip(got, want)) + " |")
  sys.stdout.flush()


def stages(t, e_list, reps, variants=False, only_default=False):
  """Time each Pallas stage alone (bf16, H = 16, D = V = 128): the Triton kernels (with
  ``variants``, also a few other tile configurations) and, on Hopper, the Mosaic GPU
  state-passing kernels ("mgpu") in their place. ``only_default``: on Hopper, only the
  default (all Mosaic GPU) row and the Mosaic chunk backward's parts."""
  from triadic.pallas.chunk_prep import chunk_prep
  b, h, d, vd, c = SHAPES.get(t, 1), 16, 128, 128, 64
  nc = t // c
  peak, hbm = ceilings(reps)
  print(f"# ceilings measured now: bf16 matmul {peak:.0f} TFLOP/s, HBM {hbm:.0f} GB/s; "
        f"B={b} T={t} H={h} D=V={d}; each cell: ms (TFLOP/s of the counted matmuls, "
        "``stage_flops``)")
  print("| E | config | prep | forward | backward states | chunk backward | total |")
  print("|---|---|---|---|---|---|---|")
  parts = []
  for e in e_list:
    q, k, v, k2, q2, g, beta = inputs(jax.random.PRNGKey(0), b, t, h, d, vd, e, jnp.bfloat16)
    ch = lambda x, dt: pops._chunks(x.astype(dt), nc, c).reshape(b * h, nc, c, -1)
    q, k, v, do = (ch(x, jnp.bfloat16) for x in (q, k, v, v))
    k2, q2, g, beta = (ch(x, jnp.float32) for x in (k2, q2, g, beta))
    rows = lambda x: jnp.swapaxes(x, -1, -2)
    h0 = jnp.zeros((b * h, e, d, vd), jnp.float32)
    base = pops.default_config("gpu", e, vd)
    base = dataclasses.replace(base, mosaic_gpu=False, mosaic_gpu_backward=False)
    configs = [base] + ([dataclasses.replace(base, **kw) for kw in (
        {"num_stages": 1}, {"num_stages": 3}, {"block_v": 64}, {"num_warps": 8},
        {"bwd_block_v": 64}, {"bwd_num_warps": 4})] if variants else [])
    if pops.is_hopper():
      mgpu = [dataclasses.replace(base, mosaic_gpu=True),
              dataclasses.replace(base, mosaic_gpu=True, mosaic_gpu_backward=True),
              dataclasses.replace(base, mosaic_gpu=True, mosaic_gpu_backward=True,
                                  xla_slice_grads=True)]
      configs = mgpu[1:] if only_default else configs + mgpu
    for cfg in configs:
      pre = jax.jit(lambda *x: chunk_prep(*x, erase=True, cfg=cfg))
      prep_args = (q, k, k2, rows(k2), q2, g, rows(g), beta)
      gcc, gcr, a, p = pre(*prep_args)
      state_fwd, state_bwd = pops._state_kernels(cfg, q, v, k2)
      fwd = jax.jit(functools.partial(state_fwd, scale=0.1, erase=True))
      fwd_args = (q, k, v, k2, q2, gcc, beta, a, p, h0)
      o, u, st, ht = fwd(*fwd_args)
      bst = jax.jit(functools.partial(state_bwd, scale=0.1, erase=True))
      bst_args = (q, k, do, k2, q2, gcc, beta, a, p, h0)
      du, dst, _ = bst(*bst_args)
      cbw = jax.jit(functools.partial(pops._chunk_backward(cfg, q, v, k2), scale=0.1, erase=True))
      cbw_args = (q, k, v, do, u, du, st, dst, k2, rows(k2), q2, gcc, gcr, beta, a)
      ms = [timeit(f, xs, reps) for f, xs in ((pre, prep_args), (fwd, fwd_args),
                                              (bst, bst_args), (cbw, cbw_args))]
      label = (f"bv{cfg.block_v} w{cfg.num_warps} s{cfg.num_stages} "
               f"bwd_bv{cfg.bwd_block_v} bwd_w{cfg.bwd_num_warps}")
      label = "mgpu state kernels, " + label if cfg.mosaic_gpu else label
      label = "mgpu chunk backward, " + label if cfg.mosaic_gpu_backward else label
      label = "XLA slice grads, " + label if cfg.xla_slice_grads else label
      fl = stage_flops(b, t, h, d, vd, e, c)
      cells = [f"{x:.2f} ({f / (x * 1e-3) / 1e12:.0f})" for x, f in zip(ms, fl)]
      cells.append(f"{sum(ms):.2f} ({sum(fl) / (sum(ms) * 1e-3) / 1e12:.0f})")
      print(f"| {e} | {label} | " + " | ".join(cells) + " |")
      sys.stdout.flush()
      if cfg.mosaic_gpu_backward and not cfg.xla_slice_grads:
        parts.append((e, mosaic_backward_parts(cbw_args, reps)))
  if parts:
    print("\nThe Mosaic chunk backward by part (ms): plain-JAX prologue (A^T dU, factor rows), "
          "the Mosaic value kernel (default block_v and staging buffers; and with one staging "
          "buffer), the Triton tail")
    print("| E | value kernel config | prologue | value kernel | value kernel, 1 stage | tail |")
    print("|---|---|---|---|---|---|")
    for e, cells in parts:
      print(f"| {e} | " + " | ".join(cells) + " |")


def mosaic_backward_parts(cbw_args, reps):
  """Table cells: the times of the parts of ``mosaic_backward.chunk_backward`` (erase=True,
  scale 0.1)."""
  from triadic.pallas import mosaic_backward as mb
  q, k, v, do, u, du, st, dst, k2c, k2r, q2c, gcc, gcr, beta_c, a = cbw_args
  bh, nc, c, d = q.shape
  bv = mb.default_block_v(d, v.shape[-1], c, k2c.shape[-1])
  n_stages = mb.default_stages(d, v.shape[-1], c, k2c.shape[-1], bv)
  pro = jax.jit(lambda a, du, gcc, k2c, q2c, beta_c: (
      mb._drhs(a, du, True), mb._factor_rows(gcc, k2c, q2c, beta_c)))
  pro_args = (a, du, gcc, k2c, q2c, beta_c)
  drhs, f = pro(*pro_args)
  val = jax.jit(functools.partial(mb.value_pass, scale=0.1, erase=True, block_v=bv))
  val_args = (q, k, v, do, u, drhs, st, dst, f)
  x, dqp, dkp, coef, lam = val(*val_args)
  one = float("nan")  # the value kernel with one staging buffer (where the default has two)
  if n_stages == 2:
    one = timeit(jax.jit(functools.partial(mb.value_pass, scale=0.1, erase=True, block_v=bv,
                                           stages=1)), val_args, reps)
  lam = jnp.sum(lam, axis=2, keepdims=True)
  tail = jax.jit(functools.partial(mb._tail, scale=0.1, erase=True, cfg=mb.tail_config(False)))
  tail_args = (q, k, x, do, u, du, drhs, dqp, dkp, coef, lam, k2c, k2r, q2c, gcc, gcr, beta_c, a)
  pro_ms, val_ms, tail_ms = [timeit(fn, xs, reps) for fn, xs in (
      (pro, pro_args), (val, val_args), (tail, tail_args))]
  return [f"bv{bv} {n_stages} st", f"{pro_ms:.2f}", f"{val_ms:.2f}", f"{one:.2f}", f"{tail_ms:.2f}"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--t", type=int, nargs="*", default=list(SHAPES))
  parser.add_argument("--e", type=int, nargs="*", default=[1, 2, 4, 8])
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--check", action="store_true", help="correctness table, then exit")
  parser.add_argument("--no-chunked", action="store_true", help="skip the chunked JAX column")
  parser.add_argument("--no-triton", action="store_true",
                      help="on Hopper, skip the pallas-triton column (Triton kernels only)")
  parser.add_argument("--cases", type=int, nargs="*", help="with --check: which cases (0..4)")
  parser.add_argument("--stages", action="store_true", help="per-kernel times, then exit")
  parser.add_argument("--xla-slice-grads", action="store_true",
                      help="--check with Config.xla_slice_grads; the table gains its f+b column")
  parser.add_argument("--only-default", action="store_true",
                      help="with --stages on Hopper: only the default row, the xla_slice_grads "
                           "row and the parts table")
  parser.add_argument("--variants", action="store_true",
                      help="with --stages: also other Triton tile configurations")
  args = parser.parse_args()
  dev = jax.devices()[0]
  print(f"# {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}")
  if args.check:
    check(args.cases, args.xla_slice_grads)
    return
  if args.stages:
    stages(args.t[0], args.e, args.reps, args.variants, args.only_default)
    return
  h, d, vd = 16, 128, 128
  hopper = pops.is_hopper()
  if hopper:
    print("# pallas: Mosaic GPU (wgmma) state-passing kernels and chunk-parallel backward where "
          "they take the sizes; pallas-triton: the same op with the Triton kernels only")
  print("| B | T | E | pallas fwd | pallas f+b | f+b vs E=1 | pallas-triton fwd "
        "| pallas-triton f+b "
        "| chunked fwd | chunked f+b | cudnn fwd | cudnn f+b "
        "| chunked/pallas f+b | cudnn/pallas f+b | pallas TFLOP/s fwd / f+b "
        "| chunked TFLOP/s fwd / f+b |"
        + (" xla-slice-grads f+b | its f+b vs E=1 |" if args.xla_slice_grads else ""))
  print("|" + "---|" * (18 if args.xla_slice_grads else 16))
  for t in args.t:
    b = SHAPES.get(t, max(1, 32768 // t))
    key = jax.random.PRNGKey(0)
    att_fwd, att_fb = attention_fns()
    qa, ka, va = inputs(key, b, t, h, d, vd, 1, jnp.bfloat16)[:3]
    try:
      att = (timeit(att_fwd, (qa, ka, va), args.reps), timeit(att_fb, (qa, ka, va), args.reps))
    except Exception as err:  # cuDNN missing or shape refused: report, do not stop the table
      print(f"# cudnn attention failed at T={t}: {type(err).__name__}: {err}"[:300])
      att = (float("nan"), float("nan"))
    e1 = xe1 = None
    for e in args.e:
      xs = inputs(key, b, t, h, d, vd, e, jnp.bfloat16)
      pf, pfb = triadic_fns("pallas")
      pal = (timeit(pf, xs, args.reps), timeit(pfb, xs, args.reps))
      e1 = pal[1] if e == 1 else e1
      xsg = ""
      if args.xla_slice_grads:  # the same op with Config.xla_slice_grads, side by side
        _, xfb = triadic_fns("pallas", xla_slice_grads=True)
        xms = timeit(xfb, xs, args.reps)
        xe1 = xms if e == 1 else xe1
        xsg = f" | {xms:.2f} | " + (f"{xms / xe1:.2f}x" if xe1 else "-")
      tri = (float("nan"), float("nan"))
      if hopper and not args.no_triton:
        tf_, tfb = triadic_fns("pallas", mosaic_gpu=False, mosaic_gpu_backward=False)
        tri = (timeit(tf_, xs, args.reps), timeit(tfb, xs, args.reps))
      if args.no_chunked:
        chk = (float("nan"), float("nan"))
      else:
        cf, cfb = triadic_fns("chunked")
        chk = (timeit(cf, xs, args.reps), timeit(cfb, xs, args.reps))
      fl = chunked_flops(b, t, h, d, vd, e)
      tf = lambda ms, mult: mult * fl / (ms * 1e-3) / 1e12
      vs1 = f"{pal[1] / e1:.2f}x" if e1 else "-"
      print(f"| {b} | {t} | {e} | {pal[0]:.2f} | {pal[1]:.2f} | {vs1} "
            f"| {tri[0]:.2f} | {tri[1]:.2f} "
            f"| {chk[0]:.2f} | {chk[1]:.2f} "
            f"| {att[0]:.2f} | {att[1]:.2f} | {chk[1] / pal[1]:.2f}x | {att[1] / pal[1]:.2f}x "
            f"| {tf(pal[0], 1):.0f} / {tf(pal[1], 3):.0f} "
            f"| {tf(chk[0], 1):.0f} / {tf(chk[1], 3):.0f}{xsg} |")
      sys.stdout.flush()


if __name__ == "__main__":
  main()
