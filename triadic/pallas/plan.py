"""Which kernel runs each stage of ``triadic_pallas``, with its tiles and the reason: one place.

``resolve`` turns a launch ``Config`` and the call's sizes into a ``Plan``: for each of the four
stages (prep, forward state pass, backward state pass, chunk-parallel backward) the backend that
runs it, its tile choices, and why (the Config asked for it, or the reason a faster kernel cannot
take these sizes: dtype, E, D, chunk). ``triadic_pallas`` follows the plan it resolves and logs
each distinct plan once (logger ``triadic.pallas``); ``explain`` gives the same plan for sizes
without running anything, which the benchmark prints beside its timings.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax.numpy as jnp

from triadic.pallas import mosaic, mosaic_backward, pieces
from triadic.pallas.common import Config

log = logging.getLogger("triadic.pallas")


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage's choice: ``backend`` ("triton", "mosaic_tpu", "mosaic_gpu", with "/interpret" on
  a CPU), ``tiles`` (a short description) and ``reason``."""
  name: str
  backend: str
  tiles: str
  reason: str


@dataclasses.dataclass(frozen=True)
class Plan:
  """The resolved stages for one set of sizes; ``str(plan)`` is a small table."""
  sizes: str
  prep: Stage
  forward: Stage
  backward_states: Stage
  chunk_gradients: Stage

  @property
  def stages(self) -> tuple[Stage, ...]:
    return (self.prep, self.forward, self.backward_states, self.chunk_gradients)

  @property
  def mosaic_state_kernels(self) -> bool:
    return self.forward.backend.startswith("mosaic_gpu")

  @property
  def mosaic_chunk_gradients(self) -> bool:
    return self.chunk_gradients.backend.startswith("mosaic_gpu")

  def saves_x(self, erase: bool) -> bool:
    """Whether the forward state pass saves X for the backward: the Mosaic chunk backward reads
    it, and the Mosaic forward forms it anyway (erase only; without erase X = V)."""
    return erase and self.mosaic_chunk_gradients and self.mosaic_state_kernels

  def __str__(self) -> str:
    rows = [f"triadic_pallas plan ({self.sizes}):"]
    rows += [f"  {s.name:<16} {s.backend:<36} {s.tiles:<42} {s.reason}" for s in self.stages]
    return "\n".join(rows)


def _base(cfg: Config) -> str:
  """The platform's own Pallas backend: Mosaic TPU for the TPU structure, else Triton."""
  name = "mosaic_tpu" if cfg.chunk_grid else "triton"
  return name + ("/interpret" if cfg.platform == "cpu" else "")


def resolve(cfg: Config, *, d: int, vd: int, c: int, e: int, dtype) -> Plan:
  """The plan for (padded) sizes D, V, chunk C, E and the inputs' dtype under ``cfg``."""
  base = _base(cfg)
  interp = "/interpret" if cfg.platform == "cpu" else ""
  loop = "chunks on the grid, state in VMEM" if cfg.chunk_grid else "chunk loop per value block"
  inverse = "UT inverse kernel (Config.ut_kernel)" if cfg.ut_kernel else "UT inverse in plain JAX"
  prep = Stage("prep", base, "one program per chunk",
               f"masks M, M' in plain JAX (E-independent kernel); {inverse}")

  state_wgs = state_warpgroups(cfg, d=d, vd=vd, c=c, e=e)
  state_reason = (mosaic.supported(d, vd, c, e, dtype, block_v=cfg.state_block_v,
                                   warpgroups=state_wgs)
                  if cfg.mosaic_gpu else "Config.mosaic_gpu off")
  if state_reason is None:
    bv = state_block_v(cfg, d=d, vd=vd, c=c, e=e)
    wg_reason = ("" if state_wgs == cfg.state_warpgroups else "; one warpgroup: "
                 + str(mosaic.warpgroups_supported(d, vd, c, e, cfg.state_block_v)))
    tiles = f"block_v {bv}, S_cat D x {e * bv}, {state_wgs} warpgroup(s), copies "
    forward = Stage("forward", "mosaic_gpu" + interp, tiles + "a chunk ahead",
                    "Config.mosaic_gpu" + wg_reason)
    bwd_states = Stage("backward_states", "mosaic_gpu" + interp, tiles + "at chunk start",
                       "Config.mosaic_gpu" + wg_reason)
  else:
    tiles = f"block_v {cfg.block_v}, {loop}"
    forward = Stage("forward", base, tiles, state_reason)
    bwd_states = Stage("backward_states", base, tiles, state_reason)

  fused = (mosaic_backward.default_fused_tail(e) if cfg.fused_tail is None else cfg.fused_tail)
  tail = "fused tail" if fused else "tail between JAX mask work"
  tail_reason = ("" if cfg.fused_tail is not None else
                 f"; tail fused iff E <= {mosaic_backward.FUSED_TAIL_MAX_E}")
  slice_wgs = mosaic_backward.slice_warpgroups(cfg.slice_warpgroups, d)
  per = cfg.slice_chunks_per_program
  cb_reason = (mosaic_backward.supported(d, vd, c, e, dtype, warpgroups=slice_wgs,
                                         chunks_per_program=per)
               if cfg.mosaic_gpu_backward else "Config.mosaic_gpu_backward off")
  if cb_reason is None:
    wg_reason = ("" if slice_wgs == (cfg.slice_warpgroups or 2) else
                 "; one warpgroup: " + str(mosaic_backward.slice_warpgroups_supported(d)))
    chunk_bwd = Stage("chunk_gradients", "mosaic_gpu" + interp + " + triton tail",
                      f"slice kernel: {e} slice(s) in 64-row pieces, two slots, {slice_wgs} "
                      f"warpgroup(s), {per} chunk(s) per program, {tail}",
                      "Config.mosaic_gpu_backward" + tail_reason + wg_reason)
  else:
    chunk_bwd = Stage("chunk_gradients", base, f"bwd_block_v {cfg.bwd_block_v}", cb_reason)
  sizes = f"{cfg.platform}, {jnp.dtype(dtype).name}, D={d}, V={vd}, C={c}, E={e}"
  plan = Plan(sizes, prep, forward, bwd_states, chunk_bwd)
  _log_once(plan)
  return plan


@functools.lru_cache(maxsize=None)
def _log_once(plan: Plan) -> None:
  log.info("%s", plan)


def state_warpgroups(cfg: Config, *, d: int, vd: int, c: int, e: int) -> int:
  """The Mosaic state passes' warpgroups: ``Config.state_warpgroups`` where
  ``mosaic.warpgroups_supported`` takes it, else 1."""
  if cfg.state_warpgroups == 2 and mosaic.warpgroups_supported(d, vd, c, e,
                                                               cfg.state_block_v) is None:
    return 2
  return 1


def state_block_v(cfg: Config, *, d: int, vd: int, c: int, e: int) -> int | None:
  """The Mosaic state passes' value block: ``Config.state_block_v`` or ``mosaic.default_block_v``
  for their warpgroups."""
  return cfg.state_block_v or mosaic.default_block_v(
      d, vd, c, e, warpgroups=state_warpgroups(cfg, d=d, vd=vd, c=c, e=e))


def sequence_pieces(cfg: Config, *, bh: int, nc: int, d: int, vd: int, c: int, e: int, dtype
                    ) -> pieces.Pieces:
  """How the state passes of a call with B*H = ``bh`` over ``nc`` chunks are cut
  (``Config.sequence_pieces``, ``pieces.choose``); its programs are bh times the forward state
  pass's value blocks. Logged once per distinct answer."""
  plan = resolve(cfg, d=d, vd=vd, c=c, e=e, dtype=dtype)
  bv = state_block_v(cfg, d=d, vd=vd, c=c, e=e) if plan.mosaic_state_kernels else cfg.block_v
  choice = pieces.choose(cfg.sequence_pieces, cfg.warmup_chunks, programs=bh * max(1, vd // bv),
                         nc=nc)
  _log_pieces_once(plan.sizes, bh, nc, choice)
  return choice


@functools.lru_cache(maxsize=None)
def _log_pieces_once(sizes: str, bh: int, nc: int, choice: pieces.Pieces) -> None:
  log.info("triadic_pallas state passes (%s, B*H=%d, %d chunks): %s", sizes, bh, nc, choice)
