"""Registers, spills and shared memory of the ops' Pallas kernels, without a GPU.

    PYTHONPATH=. python benchmarks/triton_registers.py                          # triadic, E = 1 2 4 8
    PYTHONPATH=. python benchmarks/triton_registers.py --e 1 2 --op-variants masks_in_prep
    PYTHONPATH=. python benchmarks/triton_registers.py --merlin --no-triadic    # the MERLIN kernels
    PYTHONPATH=. python benchmarks/triton_registers.py --merlin --no-triadic --merlin-variants bwd_num_warps=8
    PYTHONPATH=. python benchmarks/triton_registers.py --conv --no-triadic --b 4 --t 4096

Lowers the op's forward and backward for CUDA on this machine (the triadic op with the Hopper
defaults, ``ops.default_config(hopper=True)``, and each ``--op-variants`` Config, each also as
the op's primal, whose Mosaic forward state pass writes o and the final state only; the MERLIN op
with its GPU config; with ``--conv`` the short convolution's kernels, ``layers.conv_kernel``, over
the GDN layer's q, k, v channels, 3 H D, with and without packed documents) and prints two
tables.

The Mosaic GPU kernels, at the shape given (``--b``, ``--t``, ``--h`` set the grids): grid,
threads, the dynamic shared memory Mosaic asks for, how many blocks of it a Hopper
multiprocessor holds (228 KiB, 1 KiB reserved a block) and how many waves the grid takes on
``--sms`` multiprocessors. A state pass is a chain of dependent chunks per program: a second wave
runs after the first, where a second resident block would have hidden the first's latency.
Their registers are not listed (``MOSAIC_GPU_DUMP_PTXAS=1`` on a GPU shows them).

The Pallas-Triton kernels (needs ``pip install triton``, which brings the compiler and ptxas):
each kernel's module as JAX emits it (TTIR), compiled with the num_warps / num_stages it asks for
by the ``triton`` package for sm_90a: warps, stages, shared memory, registers a thread and
ptxas' spill stores and loads a thread. The device compiles these modules with the Triton that
XLA bundles, not this package, so its allocation can differ by some registers: compare variants
with each other in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import math
import os
import re
import subprocess
import sys
import tempfile
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import variant_fields  # noqa: E402
from layers.conv_kernel import causal_conv_pallas  # noqa: E402
from merlin.ops import multistate_attention  # noqa: E402
from merlin.pallas import plan as merlin_plan  # noqa: E402
from triadic.pallas import ops as pops  # noqa: E402

SM = 90     # the compute capability compiled for (Hopper)
SMEM_PER_SM = 228 * 1024    # Hopper's shared memory a multiprocessor ...
SMEM_RESERVED = 1024        # ... of which the driver reserves this much per resident block


class TritonKernel(NamedTuple):
  """One Pallas-Triton kernel of a lowering: its name, TTIR text and launch parameters."""
  name: str
  ttir: str
  num_warps: int
  num_stages: int


class Usage(NamedTuple):
  """What ptxas reports for a kernel: per thread registers and spill bytes; the block's shared
  memory (Triton's)."""
  registers: int
  spill_stores: int
  spill_loads: int
  shared: int


@contextlib.contextmanager
def _recorded_modules():
  """Within the context, every Pallas-Triton lowering's (kernel name, module text) is appended to
  the yielded list. It wraps JAX's private ``lower_jaxpr_to_triton_module``, the one place the
  module exists before it is serialized; tests/test_benchmarks.py fails if JAX moves it."""
  from jax._src.pallas.triton import pallas_call_registration as registration
  lowering = registration.lowering
  lower = lowering.lower_jaxpr_to_triton_module
  modules = []

  def recording(*args, **kwargs):
    result = lower(*args, **kwargs)
    text = result.module.operation.get_asm(enable_debug_info=False)
    name = re.search(r"tt\.func public @([\w$]+)", text).group(1)
    modules.append((name, text))
    return result

  lowering.lower_jaxpr_to_triton_module = recording
  try:
    yield modules
  finally:
    lowering.lower_jaxpr_to_triton_module = lower


_LAUNCH = re.compile(r'name = "([\w$]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')


def triton_kernels(fn, args) -> list[TritonKernel]:
  """The Triton kernels of ``jax.jit(fn)`` lowered for CUDA on the list ``args`` (arrays or shape
  specs), each once, in lowering order: name, TTIR and the num_warps / num_stages of its custom
  call."""
  return lowered_kernels(fn, args)[0]


def lowered_kernels(fn, args) -> tuple[list[TritonKernel], list[MosaicKernel]]:
  """The Triton and the Mosaic GPU kernels of one lowering of ``jax.jit(fn)`` for CUDA on ``args``
  (one lowering for both: JAX caches a function's lowering, so a second one would not reach the
  kernels' lowering rules), in lowering order: each Triton kernel once, each Mosaic kernel once
  per distinct launch (a kernel over pieces of the sequence has a second grid)."""
  with _recorded_modules() as modules, _recorded_mosaic() as mosaic:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  launch = {name: (int(warps), int(stages)) for name, stages, warps in _LAUNCH.findall(text)}
  kernels = {}
  for name, ttir in modules:
    if name not in launch:
      raise RuntimeError(f"kernel {name} is in no custom call of the lowering")
    kernels.setdefault(name, TritonKernel(name, ttir, *launch[name]))
  return list(kernels.values()), list(dict.fromkeys(mosaic))


class MosaicKernel(NamedTuple):
  """One Mosaic GPU kernel of a lowering: its name, grid, threads a block and dynamic SMEM bytes."""
  name: str
  grid: tuple[int, int, int]
  threads: int
  smem: int

  @property
  def blocks_per_sm(self) -> int:
    """Resident blocks a multiprocessor holds by shared memory alone."""
    return SMEM_PER_SM // (self.smem + SMEM_RESERVED)

  def waves(self, sms: int) -> float:
    return math.prod(self.grid) / (sms * max(1, self.blocks_per_sm))


_SMEM = re.compile(r"dynamic_shared_memory_size %c(\d+)")


@contextlib.contextmanager
def _recorded_mosaic():
  """Within the context, every Mosaic GPU kernel lowered is appended to the yielded list. It wraps
  Mosaic GPU's private ``_lower_as_gpu_kernel``, which sees the launch (grid, block) and builds
  the module that states the shared memory; tests/test_benchmarks.py fails if JAX moves it."""
  from jax.experimental.mosaic.gpu import core
  lower = core._lower_as_gpu_kernel
  signature = inspect.signature(lower)
  kernels = []

  def recording(*args, **kwargs):
    result = lower(*args, **kwargs)
    launch = signature.bind(*args, **kwargs).arguments
    module = result[0] if isinstance(result, tuple) else result
    smem = _SMEM.search(str(module))
    kernels.append(MosaicKernel(launch["kernel_name"], tuple(launch["grid"]),
                                math.prod(launch["block"]), int(smem.group(1)) if smem else 0))
    return result

  core._lower_as_gpu_kernel = recording
  try:
    yield kernels
  finally:
    core._lower_as_gpu_kernel = lower


_USED = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(report: str) -> tuple[int, int, int]:
  """(registers, spill store bytes, spill load bytes) from ``ptxas -v``'s report of one kernel."""
  used, spills = _USED.search(report), _SPILLS.search(report)
  if not used or not spills:
    raise ValueError(f"no register / spill line in the ptxas report:\n{report}")
  return int(used.group(1)), int(spills.group(1)), int(spills.group(2))


def usage(kernel: TritonKernel) -> Usage:
  """Compile ``kernel`` with the ``triton`` package for sm_90a and run ``ptxas -v`` on its PTX."""
  import triton
  from triton.backends.compiler import GPUTarget
  with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, f"{kernel.name}.ttir")
    with open(src, "w") as f:
      f.write(kernel.ttir)
    compiled = triton.compile(src, target=GPUTarget("cuda", SM, 32),
                              options={"num_warps": kernel.num_warps,
                                       "num_stages": kernel.num_stages})
    ptx = os.path.join(tmp, f"{kernel.name}.ptx")
    with open(ptx, "w") as f:
      f.write(compiled.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    report = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{SM}a", ptx, "-o", os.devnull],
                            capture_output=True, text=True, check=True).stderr
  return Usage(*parse_ptxas(report), shared=compiled.metadata.shared)


def spec(*shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def triadic_args(b, t, h, d, vd, e):
  """The triadic op's eight input specs: q, k, v, k2, q2, g, beta (bf16) and h0 (float32)."""
  return [spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, vd), spec(b, t, h, e),
          spec(b, t, h, e), spec(b, t, h, e), spec(b, t, h), spec(b, h, e, d, vd, dtype=jnp.float32)]


def triadic_primal(b, t, h, d, vd, e, erase, cfg):
  """(fn, specs): the triadic op under ``cfg`` without a gradient (its primal, whose Mosaic
  forward state pass writes o and the final state only)."""
  def forward(*a):
    return pops.triadic_pallas(*a[:7], scale=d ** -0.5, initial_state=a[7], erase=erase,
                               chunk_size=64, config=cfg)

  return forward, triadic_args(b, t, h, d, vd, e)


def triadic_grad(b, t, h, d, vd, e, erase, cfg):
  """(fn, specs): the gradients of the triadic op under ``cfg`` in all eight inputs."""
  args = triadic_args(b, t, h, d, vd, e)

  def loss(*a):
    o, s = pops.triadic_pallas(*a[:7], scale=d ** -0.5, initial_state=a[7], erase=erase,
                               chunk_size=64, config=cfg)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  return jax.grad(loss, argnums=tuple(range(8))), args


def merlin_args(b, t, h, d, vd, segment_len):
  """The MERLIN op's six input specs: q, k, v (bf16), g, beta and lam (float32, one weight per
  segment)."""
  n = -(-t // segment_len)
  f32 = jnp.float32
  return [spec(b, t, h, d), spec(b, t, h, d), spec(b, t, h, vd), spec(b, t, h, dtype=f32),
          spec(b, t, h, dtype=f32), spec(b, t, h, n, dtype=f32)]


def merlin_grad(b, t, h, d, vd, segment_len, erase, cfg=None):
  """(fn, specs): the gradients of the MERLIN op (its GPU kernels; ``cfg`` None: the GPU
  default) in its six inputs."""
  args = merlin_args(b, t, h, d, vd, segment_len)

  def loss(*a):
    o = multistate_attention(*a, segment_len=segment_len, erase=erase, impl="pallas",
                             platform="gpu", config=cfg)
    return jnp.sum(o.astype(jnp.float32))

  return jax.grad(loss, argnums=tuple(range(6))), args


def merlin_walk(b, t, h, d, vd, segment_len):
  """(fn, specs): the MERLIN erase op's forward alone by the query walk (``Config.query_walk``;
  the GPU's default tiles)."""
  cfg = dataclasses.replace(merlin_plan.default_config("gpu"), query_walk=True)

  def forward(*a):
    return multistate_attention(*a, segment_len=segment_len, erase=True, impl="pallas",
                                platform="gpu", config=cfg)

  return forward, merlin_args(b, t, h, d, vd, segment_len)


def conv_grad(b, t, c, width, documents):
  """(fn, specs): the short convolution's kernels (value and gradients in x and the kernel, so
  that the forward is not dead code), bf16 x (B, T, C), float32 kernel (width, C)."""
  args = [spec(b, t, c), spec(width, c, dtype=jnp.float32)]
  if documents:
    args.append(spec(b, t, dtype=jnp.int32))

  def loss(x, kernel, *segment_ids):
    y = causal_conv_pallas(x, kernel, *segment_ids, platform="gpu")
    return jnp.sum(jnp.square(y.astype(jnp.float32)))

  return jax.value_and_grad(loss, argnums=(0, 1)), args


def rows(label: str, kernels: list[TritonKernel]):
  for kernel in kernels:
    use = usage(kernel)
    yield (f"| {label} | {kernel.name} | {kernel.num_warps} | {kernel.num_stages} | "
           f"{use.shared // 1024} | {use.registers} | {use.spill_stores} | {use.spill_loads} |")


def mosaic_rows(label: str, kernels: list[MosaicKernel], sms: int):
  for k in kernels:
    yield (f"| {label} | {k.name} | {'x'.join(map(str, k.grid))} | {k.threads} | "
           f"{k.smem / 1024:.1f} | {k.blocks_per_sm} | {k.waves(sms):.2f} |")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--e", type=int, nargs="+", default=[1, 2, 4, 8])
  ap.add_argument("--op-variants", nargs="*", default=[],
                  help="Config variants of the triadic op (benchmarks/triadic_kernels.py syntax)")
  ap.add_argument("--b", type=int, default=2)
  ap.add_argument("--t", type=int, default=16384,
                  help="tokens (registers do not depend on it; the Mosaic grids do)")
  ap.add_argument("--h", type=int, default=16)
  ap.add_argument("--d", type=int, default=128)
  ap.add_argument("--v", type=int, default=128)
  ap.add_argument("--sms", type=int, default=132, help="multiprocessors for the waves column")
  ap.add_argument("--no-erase", action="store_true")
  ap.add_argument("--no-triadic", action="store_true")
  ap.add_argument("--merlin", action="store_true", help="also the MERLIN op's kernels")
  ap.add_argument("--merlin-variants", nargs="*", default=[],
                  help="with --merlin: also the gradient under these Config variants of MERLIN's "
                       "GPU default (the --op-variants syntax), e.g. bwd_num_warps=8")
  ap.add_argument("--segment-len", type=int, default=256)
  ap.add_argument("--conv", action="store_true",
                  help="also the short convolution's kernels (C = 3 H D, width 4)")
  args = ap.parse_args(argv)
  erase = not args.no_erase
  lowerings = []          # (label, fn, specs)
  if not args.no_triadic:
    for e in args.e:
      base = pops.default_config("gpu", pops.pow2(e), args.v, bh=args.b * args.h, hopper=True)
      for variant in ["", *args.op_variants]:
        cfg = dataclasses.replace(base, **(variant_fields(variant) if variant else {}))
        label = f"triadic E={e}" + (f" {variant}" if variant else "")
        lowerings.append((label, *triadic_grad(args.b, args.t, args.h, args.d, args.v, e, erase,
                                               cfg)))
        # The gradient runs the forward with residuals; the primal's writes o and ht only.
        lowerings.append((label + " primal", *triadic_primal(args.b, args.t, args.h, args.d,
                                                              args.v, e, erase, cfg)))
  if args.merlin:
    for variant in ["", *args.merlin_variants]:
      cfg = (dataclasses.replace(merlin_plan.default_config("gpu"), **variant_fields(variant))
             if variant else None)
      lowerings.append((f"MERLIN segment {args.segment_len}" + (f" {variant}" if variant else ""),
                        *merlin_grad(args.b, args.t, args.h, args.d, args.v, args.segment_len,
                                     erase, cfg)))
    if erase:
      lowerings.append(("MERLIN query walk",
                        *merlin_walk(args.b, args.t, args.h, args.d, args.v, args.segment_len)))
  if args.conv:
    c = 3 * args.h * args.d
    for documents in (False, True):
      label = f"conv C={c}" + (" documents" if documents else "")
      lowerings.append((label, *conv_grad(args.b, args.t, c, 4, documents)))
  shape = (f"B={args.b} T={args.t} H={args.h} D={args.d} V={args.v}, bf16, erase={erase}")
  print(f"# Mosaic GPU kernels, JAX {jax.__version__}; {shape}; shared memory KiB a block, "
        f"blocks a multiprocessor by it, waves on {args.sms} multiprocessors")
  print("| op | kernel | grid | threads | shared KiB | blocks / SM | waves |")
  print("|---|---|---|---|---|---|---|")
  kernels = [(label, *lowered_kernels(fn, specs)) for label, fn, specs in lowerings]
  for label, _, mosaic in kernels:
    for line in mosaic_rows(label, mosaic, args.sms):
      print(line, flush=True)
  try:
    import triton
  except ImportError:
    print("\n(no triton package: pip install triton for the Triton kernels' registers)")
    return
  print(f"\n# Pallas-Triton kernels compiled for sm_{SM}a by triton {triton.__version__}; "
        f"{shape}; registers and spill bytes per thread, shared KiB per block")
  print("| op | kernel | warps | stages | shared KiB | registers | spill stores | spill loads |")
  print("|---|---|---|---|---|---|---|---|")
  for label, triton_list, _ in kernels:
    for line in rows(label, triton_list):
      print(line, flush=True)


if __name__ == "__main__":
  main()
