"""Which implementation ``multistate_attention`` runs, with its tiles and the reason: one place.

``resolve`` maps the requested impl ("auto", "pallas", "chunked", "scan"), the platform and the
sizes to a ``Plan``. "auto" is the Pallas kernels on GPU wherever they take the sizes and the
chunk-parallel JAX form elsewhere: on CPU the kernels run only in interpret mode (far slower than
XLA), and the TPU structure's kernels (``tpu.py``) are checked in interpret mode and to lower for
a TPU, never run on one. An explicit "pallas" that the kernels cannot take is a ValueError giving
the reason. ``str(plan)`` is one line; ``multistate_attention`` logs each distinct plan once (logger
``merlin.pallas``) and ``explain`` returns it for given sizes without running anything.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

from layers.platform import default_platform
from triadic.pallas.common import Config

log = logging.getLogger("merlin.pallas")

CHUNK_SIZES = (16, 32, 64, 128)
# The Config fields that group the Triton kernels' programs (1: one chunk or state a program)
GROUPS = ("read_chunks", "forward_states", "reverse_states")
MAX_D = 256


@dataclasses.dataclass(frozen=True)
class Plan:
  """impl ("scan", "chunked" or "pallas"), chunk_size (None for the scan), the kernels' launch
  ``config`` (pallas only: block_v the forward state pass's value columns per program, num_warps
  its and the readout's warps, bwd_block_v the value columns of the readout and of the backward's
  kernels (reverse state pass, chunk gradients), bwd_num_warps the backward kernels' warps,
  query_walk the erase forward's readout where no gradient is taken, intra_kernel the intra-chunk
  part's forward by a kernel, intra_backward_kernel its backward by one; read_chunks,
  forward_states, reverse_states the chunks or states a program of the readout and chunk
  gradients, or of the state passes, takes, named where above 1) and why this impl runs."""
  impl: str
  chunk_size: int | None
  reason: str
  config: Config | None = None

  def __str__(self) -> str:
    tiles = ""
    if self.config is not None:
      cfg = self.config
      if cfg.chunk_grid:  # Mosaic TPU: no warps
        tiles = f", tpu block_v {cfg.block_v}, bwd_block_v {cfg.bwd_block_v}, chunks on the grid"
      else:
        tiles = (f", {cfg.platform} block_v {cfg.block_v} at {cfg.num_warps} warps, "
                 f"bwd_block_v {cfg.bwd_block_v} at {cfg.bwd_num_warps} warps")
      groups = [f"{name} {getattr(cfg, name)}" for name in GROUPS if getattr(cfg, name) > 1]
      tiles += ((", " + ", ".join(groups) if groups else "")
                + (", erase forward-only by the query walk" if cfg.query_walk else "")
                + (", intra-chunk part's forward by a kernel" if cfg.intra_kernel else "")
                + (", its backward by a kernel" if cfg.intra_backward_kernel else ""))
    return f"multistate_attention plan: {self.impl} (chunk {self.chunk_size}{tiles}): {self.reason}"


def default_config(platform: str) -> Config:
  """GPU: the forward state pass at 32 value columns a program (a (D, 32) float32 state, 16 KiB at
  D = 128) and 4 warps; the readout (at 4 warps) and the backward's kernels (reverse state pass,
  chunk gradients) at 128 columns (``bwd_block_v``: all of V = 128), the backward's at 8 warps
  (the span kernels, which carry a D x D float32 matrix, at ``kernels.SQUARE_WARPS``). A
  reverse-pass program reads each later span's map U and walked queries P for its value block,
  so one block of all V columns reads them once where two blocks of 64 read them twice; at 8
  warps the reverse pass and the chunk gradients spill no registers (benchmarks/triton_registers.py
  --merlin, which also lists the intra-chunk kernels'). That launch measured faster than 64
  columns at 4 warps at T = 16384 and at the 400M training shape, and 8 warps at 64 columns
  slower than both (benchmarks/RESULTS.md); the forward's state pass measured the same at 8
  warps or 64 columns.
  Where no gradient is taken, the erase forward reads the states by the query walk
  (``Config.query_walk``), whose memory grows with T, where the span stack's grows with T^2; and
  the intra-chunk part runs as one forward kernel (``Config.intra_kernel``, launched as
  ``merlin.pallas.intra`` says), faster than the plain-JAX part (benchmarks/RESULTS.md). A
  differentiated call runs the span form's forward regardless, as the backward needs the span
  stack; its intra-chunk kernel also writes A for the part's pullback
  (``merlin.chunked.intra_chunk_pullback``), so that the float32 products of the plain-JAX part
  are neither formed forward nor kept, and that pullback runs as one kernel too
  (``Config.intra_backward_kernel``), reading the op's layout and writing its gradients in it,
  faster than the plain-JAX pullback (benchmarks/RESULTS.md).
  TPU (Mosaic, ``tpu.py``): 128 columns (Mosaic's lane tile; the whole V where it is narrower),
  the intra-chunk part in plain JAX and no query walk (those kernels are Triton's).
  The GPU default runs one chunk or one state a program (``Config.read_chunks``,
  ``forward_states``, ``reverse_states`` 1); the groups are options (benchmarks/RESULTS.md
  says which launches are timed): at D = V = 128 a group of two fits the registers for the
  readout at 8 warps, the finished reads and (at 64 columns) the reverse pass, and a group of
  four for the forward state pass (benchmarks/triton_registers.py --merlin).
  CPU (interpret): 16 columns, so small test shapes still run several value blocks (the
  intra-chunk kernels' own launches aside), and groups of two chunks and states, so that the
  tests run the grouped programs."""
  if platform == "gpu":
    return Config("gpu", block_v=32, num_warps=4, bwd_block_v=128, bwd_num_warps=8,
                  query_walk=True, intra_kernel=True, intra_backward_kernel=True)
  if platform == "tpu":
    return Config("tpu", block_v=128, bwd_block_v=128)
  return Config("cpu", block_v=16, bwd_block_v=16, read_chunks=2, reverse_states=2,
                forward_states=2)


def unsupported(platform: str, d: int, segment_len: int, chunk_size: int | None,
                documents: bool) -> str | None:
  """Why the kernels cannot run this call, or None if they can."""
  if documents:
    return "segment_ids (packed documents) run in the chunked form"
  c = chunk_size or math.gcd(segment_len, 64)
  if c not in CHUNK_SIZES:
    what = "chunk_size" if chunk_size else f"gcd(segment_len = {segment_len}, 64)"
    return f"{what} must be one of {CHUNK_SIZES} for impl='pallas', got {c}"
  if d > MAX_D:
    return f"q/k last dim D must be <= {MAX_D} for impl='pallas', got {d}"
  return None


def resolve(impl: str, *, d: int, segment_len: int, chunk_size: int | None, documents: bool,
            platform: str | None = None, config: Config | None = None) -> Plan:
  """The plan for an ``impl`` request ("auto", "scan", "chunked", "pallas") at these sizes."""
  platform = platform or default_platform()
  default_chunk = chunk_size or math.gcd(segment_len, 64)
  if impl == "scan":
    return _logged(Plan("scan", None, "impl='scan' (the oracle)"))
  if impl == "chunked":
    return _logged(Plan("chunked", default_chunk, "impl='chunked'"))
  why_not = unsupported(platform, d, segment_len, chunk_size, documents)
  if impl == "pallas" and why_not:
    raise ValueError(why_not)
  if impl == "auto" and why_not:
    return _logged(Plan("chunked", default_chunk, f"auto: {why_not}"))
  if impl == "auto" and platform == "cpu":
    return _logged(Plan("chunked", default_chunk,
                        "auto on cpu: the kernels run only in interpret mode there"))
  if impl == "auto" and platform == "tpu":
    return _logged(Plan("chunked", default_chunk, "auto on tpu: the Mosaic TPU kernels are "
                        "checked in interpret mode and to lower, never timed on a TPU"))
  config = config or default_config(platform)
  triton_only = [name for name in ("query_walk", "intra_kernel", "intra_backward_kernel")
                 if getattr(config, name)]
  if config.chunk_grid and triton_only:
    raise ValueError(f"config: {', '.join(triton_only)} are Triton (GPU) kernels; the TPU "
                     "structure (platform 'tpu') runs the span forward and the intra-chunk part "
                     "in plain JAX: set them False")
  grouped = [name for name in GROUPS if getattr(config, name) > 1]
  if config.chunk_grid and grouped:
    raise ValueError(f"config: {', '.join(grouped)} group the Triton (GPU) kernels' programs; "
                     "the TPU structure (platform 'tpu') walks one chunk or state a grid step: "
                     "set them to 1")
  reason = "impl='pallas'" if impl == "pallas" else "auto on gpu"
  return _logged(Plan("pallas", default_chunk, reason, config))


def explain(d: int, segment_len: int, *, chunk_size: int | None = None, documents: bool = False,
            impl: str = "auto", platform: str | None = None) -> Plan:
  """The plan ``multistate_attention`` follows for these sizes (``resolve``)."""
  return resolve(impl, d=d, segment_len=segment_len, chunk_size=chunk_size, documents=documents,
                 platform=platform)


def _logged(plan: Plan) -> Plan:
  _log_once(plan)
  return plan


@functools.lru_cache(maxsize=None)
def _log_once(plan: Plan) -> None:
  log.info("%s", plan)
