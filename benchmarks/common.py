"""What the benchmark scripts share: the machine line every table starts with, op inputs, a
median timer, a per-kernel device profile, a kernel's named regions by clock cycles and an
out-of-memory test."""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import math
import os
import platform
import re
import statistics
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from triadic.pallas.common import Config


def machine() -> str:
  """Host, accelerator kind and count, CPU count and jax version, for the table header."""
  dev = jax.devices()[0]
  return (f"{platform.node()} | {dev.platform} {dev.device_kind} x{jax.device_count()} | "
          f"{os.cpu_count()} CPUs | jax {jax.__version__}")


def triadic_inputs(key, b, t, h, d, vdim, e, dtype):
  """Layer-like inputs of ``triadic_gdn``: unit q, k; non-negative unit k2, q2; weak decay g <= 0;
  beta in (0, 1). q, k, v, k2, q2 in ``dtype``; g and beta float32."""
  ks = jax.random.split(key, 7)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (b, t, h, d)))
  k = unit(jax.random.normal(ks[1], (b, t, h, d)))
  v = jax.random.normal(ks[2], (b, t, h, vdim))
  k2 = unit(jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, e))))
  q2 = unit(jax.nn.softplus(jax.random.normal(ks[4], (b, t, h, e))))
  g = -0.1 * jax.nn.softplus(jax.random.normal(ks[5], (b, t, h, e)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[6], (b, t, h)))
  return [x.astype(dtype) for x in (q, k, v, k2, q2)] + [g, beta]


def median_ms(fn, args, *, reps: int | None = None, budget_s: float = 1.0, max_reps: int = 20) -> float:
  """Median milliseconds of ``fn(*args)`` (``jax.block_until_ready`` on the result) after one
  compile-and-warm-up call. Without ``reps``, as many calls as fit in ``budget_s`` (3 to
  ``max_reps``), judged from one timed call, so long cases get few repetitions."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - start
  if reps is None:
    reps = max(3, min(max_reps, int(budget_s / max(first, 1e-6))))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def ceilings(n: int = 8192, dtype=jnp.bfloat16, copy_mib: int = 2048, reps: int = 5):
  """This device's matmul TFLOP/s (n^3 in ``dtype``, float32 accumulation) and memory GB/s (a
  ``copy_mib`` float32 scaled copy: one read, one write), measured now: the ceilings a measured
  time is compared against (a CPU wants a smaller n and copy)."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
  tflops = 2 * n ** 3 / (median_ms(mm, (a, a), reps=reps) * 1e-3) / 1e12
  x = jnp.ones((copy_mib, 256, 1024), jnp.float32)
  gbs = 2 * x.nbytes / (median_ms(jax.jit(lambda y: y * 1.5), (x,), reps=reps) * 1e-3) / 1e9
  return tflops, gbs


class KernelTime(NamedTuple):
  """One kernel (or XLA fusion) of a profiled call: launches and device ms per call, and for an
  XLA op its output shape and the JAX op it came from (``hlo_sources``)."""
  name: str
  launches: float
  ms: float
  source: str = ""


# Timelines a profiler may derive from the kernels' (per module, op, step): not kernels themselves.
_DERIVED_LINES = frozenset({"XLA Modules", "XLA Ops", "Async XLA Ops", "XLA TraceMe", "Steps",
                            "Framework Ops", "Framework Name Scope", "Source code",
                            "Launch Stats"})


def _profiled_events(plane):
  """(name, duration ns) of the kernels in an XLA profile plane: on a GPU every event of its
  stream lines (kernels, memcpy), named by kernel (any line but the derived ones where no line
  is named for a stream); on a CPU the host's thunk events that name an
  HLO op (``hlo_op`` stat), so the table can be tried without a GPU."""
  if plane.name.startswith("/device:"):
    streams = [line for line in plane.lines if line.name.startswith("Stream")]
    for line in streams or [line for line in plane.lines if line.name not in _DERIVED_LINES]:
      for event in line.events:
        yield event.name, event.duration_ns
  elif plane.name == "/host:CPU":
    for line in plane.lines:
      for event in line.events:
        if any(key == "hlo_op" for key, _ in event.stats):
          yield event.name, event.duration_ns


# An HLO module's text: a computation's header, and an instruction (name, output shape, a tuple's
# with its spaces, the rest of the line).
_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_HLO_OP = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (\([^)]*\)|\S+) (.*)$")
_OP_NAME = re.compile(r'metadata=\{op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")


def hlo_computations(text: str) -> dict[str, list[tuple[str | None, str, str, str]]]:
  """A compiled program's text (``compiled.as_text()``) as {computation: its instructions in
  order, each (``"ROOT "`` or None, name, output shape without layout, the rest of the line)}."""
  computations, current = {}, None
  for line in text.splitlines():
    header = _HLO_COMPUTATION.match(line)
    if header:
      current = computations.setdefault(header.group(1), [])
      continue
    match = _HLO_OP.match(line)
    if match and current is not None:
      root, name, shape, rest = match.groups()
      current.append((root, name, re.sub(r"\{[^}]*\}", "", shape), rest))
  return computations


def hlo_sources(fn, args, text: str | None = None) -> dict[str, str]:
  """For a jitted ``fn``, each instruction of its compiled program (an XLA fusion's name is its
  kernel's; also keyed as the GPU names it) -> "shape  op_name": the output shape without layout
  (a tuple's as its number of values) and the JAX op it came from (the name stack:
  ``transpose(jvp(...))`` for the backward, Flax module paths). An instruction without metadata
  of its own (most fusions) takes that of the computation it calls: its root's, else its first
  instruction's that has one. ``text``: the compiled program's text where the caller has it
  (else ``fn`` is compiled here). Empty when ``fn`` has no ``lower`` (not jitted)."""
  if text is None:
    if not hasattr(fn, "lower"):
      return {}
    text = fn.lower(*args).compile().as_text()
  ops, computation_names = [], {}
  for computation, instructions in hlo_computations(text).items():
    for root, name, shape, rest in instructions:
      op_name = _OP_NAME.search(rest)
      calls = _CALLS.search(rest)
      if shape.startswith("("):                   # a tuple: its size, not its members
        shape = f"({shape.count('[')} values)"
      ops.append((name, shape, op_name and op_name.group(1), calls and calls.group(1)))
      if op_name and (root or computation not in computation_names):
        computation_names[computation] = op_name.group(1)
  sources = {}
  for name, shape, op_name, calls in ops:
    source = f"{shape}  {op_name or computation_names.get(calls, '')}".rstrip()
    sources[name] = source
    # The GPU backend names a fusion's kernel after the instruction with '.' and '-' made '_'.
    sources.setdefault(re.sub(r"[.\-]", "_", name), source)
  return sources


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
                "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_OPCODE = re.compile(r"^([\w\-]+)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_BODY = re.compile(r"body=%([\w.\-]+)")
_REFERENCE = re.compile(r"%([\w.\-]+)")   # an operand or a called computation
MOVES = ("copy", "copy-start", "dynamic-slice", "dynamic-update-slice")


def _shape_bytes(shape: str) -> int:
  return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(int(n) for n in dims.split(",") if n)
             for dt, dims in _ARRAY.findall(shape))


def hlo_moves(text: str) -> list[tuple[str, str, int, float]]:
  """Where a compiled program (``compiled.as_text()``) moves data rather than computes: rows
  (what, where, count, MB of outputs), largest first, of the instructions outside fusions whose
  opcode is in ``MOVES``, the fusions whose root is one (an in-place dynamic-update-slice, a
  copy), the custom calls by target, and the instructions XLA's rematerialization cloned
  (``*.remat*`` names: computed twice to save memory). ``where`` is "loop" inside a while loop's
  body or a computation it calls (a GPU command buffer, a call: once per iteration), else
  "once". A dynamic-update-slice's MB is its whole output array (updated in place when XLA can),
  so its count says more than its MB."""
  computations = hlo_computations(text)
  fused, bodies, roots, callees = set(), set(), {}, collections.defaultdict(set)
  for name, ops in computations.items():
    for root, _, _, rest in ops:
      opcode = _OPCODE.match(rest)
      if root and opcode:
        roots[name] = opcode.group(1)
      calls, body = _CALLS.search(rest), _BODY.search(rest)
      if calls and rest.startswith("fusion("):
        fused.add(calls.group(1))
      if body:
        bodies.add(body.group(1))
      callees[name].update(c for c in _REFERENCE.findall(rest) if c in computations)
  in_loop, reached = set(), list(bodies)
  while reached:                   # the bodies and everything they call, transitively
    comp = reached.pop()
    if comp not in in_loop:
      in_loop.add(comp)
      reached.extend(callees[comp])
  rows = collections.defaultdict(lambda: [0, 0])
  for comp, ops in computations.items():
    if comp in fused:
      continue
    where = "loop" if comp in in_loop else "once"
    for _, name, shape, rest in ops:
      opcode = _OPCODE.match(rest)
      opcode = opcode.group(1) if opcode else ""
      calls = _CALLS.search(rest)
      keys = []
      if opcode in MOVES:
        keys.append(opcode)
      elif opcode == "fusion" and calls and roots.get(calls.group(1)) in MOVES:
        keys.append(f"fusion rooted in {roots[calls.group(1)]}")
      elif opcode == "custom-call":
        target = _TARGET.search(rest)
        keys.append(f"custom-call {target.group(1) if target else '?'}")
      if ".remat" in name:
        keys.append(f"rematerialized {opcode}")
      for key in keys:
        rows[key, where][0] += 1
        rows[key, where][1] += _shape_bytes(shape)
  return sorted(((k, w, n, b / 2**20) for (k, w), (n, b) in rows.items()), key=lambda r: -r[3])


def hlo_moves_table(rows) -> str:
  """``hlo_moves``' rows as a markdown table."""
  lines = ["| instruction | where | count | MB out |", "|---|---|---|---|"]
  lines += [f"| {k} | {w} | {n} | {mb:.1f} |" for k, w, n, mb in rows]
  return "\n".join(lines)


def kernel_profile(fn, args, *, reps: int = 5, sources: dict[str, str] | None = None
                   ) -> tuple[list[KernelTime], float]:
  """Where a call's device time goes: ``fn(*args)`` run ``reps`` times (after a warm-up call)
  under ``jax.profiler.trace``, every kernel's launches and device time per call, largest first,
  and the median wall ms of those calls. Kernels of one name (a Pallas kernel launched several
  times, or XLA fusions that share a name) are summed. The sum of the rows is the device's busy
  time; below the wall time by the gaps between launches. An XLA fusion's row names its output
  shape and the JAX op it came from (``hlo_sources(fn, args)``, or ``sources`` where ``fn`` is
  a closure around the jitted function, e.g. one that threads donated state), so that glue can
  be traced to its code."""
  jax.block_until_ready(fn(*args))
  walls = []
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - start)
    path = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    profile = jax.profiler.ProfileData.from_file(path)
  device = [p for p in profile.planes if p.name.startswith("/device:")][:1]
  planes = device or [p for p in profile.planes if p.name == "/host:CPU"]
  launches, ns = collections.Counter(), collections.Counter()
  for plane in planes:
    for name, duration in _profiled_events(plane):
      launches[name] += 1
      ns[name] += duration
  sources = hlo_sources(fn, args) if sources is None else sources
  rows = [KernelTime(name, launches[name] / reps, ns[name] / reps / 1e6, sources.get(name, ""))
          for name in ns]
  return sorted(rows, key=lambda r: -r.ms), 1e3 * statistics.median(walls)


def profile_table(rows: list[KernelTime], wall_ms: float, *, top: int = 25,
                  source_width: int = 90) -> str:
  """A markdown table of ``kernel_profile``'s rows (the ``top`` largest, the rest summed in one
  row), with each kernel's share of the device time and, for XLA ops, their source (shape and
  the tail of the JAX op name, ``source_width`` characters), then the device and wall totals."""
  busy = sum(r.ms for r in rows) or float("nan")
  lines = ["| kernel | launches | ms | share | source |", "|---|---|---|---|---|"]
  shown, rest = rows[:top], rows[top:]
  if rest:
    shown = shown + [KernelTime(f"({len(rest)} others)", sum(r.launches for r in rest),
                                sum(r.ms for r in rest))]

  def source(r):
    shape, _, op_name = r.source.partition("  ")
    room = max(0, source_width - len(shape) - 1)
    return f"{shape} {'...' + op_name[-room:] if len(op_name) > room else op_name}".strip()

  lines += [f"| {r.name[:60]} | {r.launches:g} | {r.ms:.3f} | {100 * r.ms / busy:.1f}% | "
            f"{source(r)} |" for r in shown]
  lines.append(f"| device busy / wall | {sum(r.launches for r in rows):g} | {busy:.3f} / "
               f"{wall_ms:.3f} | | |")
  return "\n".join(lines)


class Regions(NamedTuple):
  """One Mosaic GPU kernel run's named regions (``kernel_regions``), per warpgroup index: the
  clock cycles spent in each region's own code (without the regions nested in it) summed over
  its traces (one per program), keyed by the region's path (``outer/inner``) in order of first
  appearance; the number of traces; their summed span (first record to last); and the loop
  steps a trace (the most times a top-level region begins in one trace, on average)."""
  cycles: list[dict[str, float]]
  traces: list[int]
  span: list[float]
  steps: list[float]

  def per_chunk(self, cycles: float, wg: int) -> float:
    """``cycles`` summed over warpgroup ``wg``'s traces, per trace and loop step."""
    return cycles / max(self.traces[wg] * self.steps[wg], 1)


def mosaic_kernel_name(profiled: str) -> str:
  """A Mosaic GPU kernel's name as its region trace's file names it, from the profiler's name for
  it (``triadic_forward_mgpu_mosaic_gpu_kernel`` -> ``triadic_forward_mgpu``)."""
  return re.sub(r"(_mosaic_gpu)?(_kernel)?$", "", profiled)


def kernel_regions(path: str, warpgroups: int) -> Regions:
  """The Perfetto trace that Mosaic GPU's profiler writes for one kernel run
  (``triadic.pallas.mosaic.trace_regions``) summed by region path and warpgroup. Its events
  are Begin/End pairs per trace (thread id ``1 + block * warpgroups + warpgroup``) whose
  timestamps, within a trace, are SM clock cycles / 1000. A name repeated at the next level
  (a region reopened inside a nested jaxpr) counts once in the path."""
  with open(path) as f:
    events = json.load(f)["traceEvents"]
  by_trace = collections.defaultdict(list)
  for ev in events:
    by_trace[ev["tid"]].append(ev)
  cycles = [dict() for _ in range(warpgroups)]
  begins = [collections.Counter() for _ in range(warpgroups)]
  traces, span = [0] * warpgroups, [0.0] * warpgroups
  for tid, evs in by_trace.items():
    wg = (tid - 1) % warpgroups
    traces[wg] += 1
    span[wg] += 1e3 * (evs[-1]["ts"] - evs[0]["ts"])
    stack = []                                      # [path, start, nested cycles]
    for ev in evs:
      if ev["ph"] == "B":
        parent = stack[-1][0] if stack else ""
        repeat = parent.rpartition("/")[2] == ev["name"]
        name = parent if repeat else f"{parent}/{ev['name']}".lstrip("/")
        if not stack:
          begins[wg][name] += 1
        stack.append([name, ev["ts"], 0.0])
      else:
        name, start, nested = stack.pop()
        total = 1e3 * (ev["ts"] - start)
        cycles[wg][name] = cycles[wg].get(name, 0.0) + total - nested
        if stack:
          stack[-1][2] += total
  steps = [max(b.values(), default=0) / max(n, 1) for b, n in zip(begins, traces)]
  return Regions(cycles, traces, span, steps)


def regions_table(regions: Regions) -> str:
  """A markdown table of ``kernel_regions``: per region and warpgroup, the mean clock cycles per
  loop step (a chunk) and the share of the program's span; then what no region covers and the
  span itself."""
  wgs = range(len(regions.cycles))
  paths = list(dict.fromkeys(p for c in regions.cycles for p in c))
  head = "| region | " + " | ".join(f"wg{w} cycles / chunk | wg{w} share" for w in wgs) + " |"
  lines = [head, "|---|" + "---|---|" * len(wgs)]

  def row(label, values):
    cells = [f"{regions.per_chunk(value, w):.0f} | "
             f"{100 * value / (regions.span[w] or float('nan')):.1f}%"
             for w, value in zip(wgs, values)]
    lines.append(f"| {label} | " + " | ".join(cells) + " |")

  for p in paths:
    row(p, [regions.cycles[w].get(p, 0.0) for w in wgs])
  row("(no region)", [regions.span[w] - sum(regions.cycles[w].values()) for w in wgs])
  row("program span", regions.span)
  return "\n".join(lines)


def regions_plot(kernels: dict[str, Regions], path: str, title: str) -> str:
  """A PNG of ``kernel_regions`` results: per kernel (the dict's labels) and warpgroup, one
  horizontal bar of clock cycles a chunk split by region (each region's own cycles, a colour per
  region path), what no region covers in grey. Returns ``path``."""
  from matplotlib import colormaps          # only the --regions mode draws
  from matplotlib.figure import Figure
  from matplotlib.patches import Patch
  rows = [(f"{label} wg{w}", r, w) for label, r in kernels.items() for w in range(len(r.cycles))]
  paths = list(dict.fromkeys(p for _, r, w in rows for p in r.cycles[w]))
  palette = [*colormaps["tab20"].colors, *colormaps["tab20b"].colors]
  colours = {p: palette[i % len(palette)] for i, p in enumerate(paths)}
  fig = Figure(figsize=(11, 1.0 + 0.45 * len(rows)))
  ax = fig.subplots()
  for y, (_, r, w) in enumerate(rows):
    left = 0.0
    for p in paths:
      width = r.per_chunk(r.cycles[w].get(p, 0.0), w)
      ax.barh(y, width, left=left, color=colours[p])
      left += width
    ax.barh(y, r.per_chunk(r.span[w], w) - left, left=left, color="0.85")
  ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
  ax.invert_yaxis()
  ax.set(xlabel="SM clock cycles a chunk", title=title)
  handles = [Patch(color=colours[p], label=p) for p in paths]
  ax.legend(handles=handles + [Patch(color="0.85", label="(no region)")], fontsize=7,
            loc="center left", bbox_to_anchor=(1.01, 0.5))
  fig.savefig(path, format="png", dpi=120, bbox_inches="tight")
  return path


def is_oom(err: BaseException) -> bool:
  """Whether ``err`` (from compiling or running a jitted function) is the device running out of
  memory."""
  text = str(err)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Out of memory" in text


def variant_fields(variant: str) -> dict:
  """The ``triadic.pallas.common.Config`` fields to replace, as ``triadic_kernels.py
  --op-variants`` and ``merlin_ops.py --tiles`` write them: comma-joined, a bare name set True,
  name=N an int (0 or 1, or true or false, for a bool field) (e.g. ``fused_tail``,
  ``sequence_pieces=0,warmup_chunks=8``, ``token_major=0``, ``masks_in_prep=True``,
  ``block_v=32,num_warps=4``)."""
  bools = {f.name for f in dataclasses.fields(Config) if f.type in ("bool", bool)}
  words = {"true": True, "false": False}
  fields = {}
  for item in variant.split(","):
    name, _, value = item.partition("=")
    if not value:
      fields[name] = True
    elif name in bools:
      fields[name] = words[value.lower()] if value.lower() in words else bool(int(value))
    else:
      fields[name] = int(value)
  return fields
