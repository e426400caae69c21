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

from triadic.pallas import chunk_prep, mosaic, mosaic_backward, pieces
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
  masks_in_prep: bool = False     # the prep kernel forms M, M' itself (``Config.masks_in_prep``)
  saves_masks: bool = False       # the forward keeps M', M for the split tail (Config.save_masks)
  drhs_in_reverse_pass: bool = False  # Config.drhs_in_reverse_pass, read by ``saves_drhs``

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

  def saves_drhs(self, erase: bool) -> bool:
    """Whether the reverse state pass writes A^T dU and dV = beta A^T dU for the chunk backward:
    the Mosaic pass forms A^T dU anyway and the Mosaic chunk backward reads both
    (``Config.drhs_in_reverse_pass``; erase only: without erase A^T dU is dU)."""
    return self.drhs_in_reverse_pass and self.saves_x(erase)

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
  masks_by = "masks M, M' in plain JAX"
  refused = (chunk_prep.masks_in_prep_supported(c, e, cfg) if cfg.masks_in_prep
             else "Config.masks_in_prep off")
  if refused is None:
    masks_by = "masks M, M' in the kernel, a slice at a time (Config.masks_in_prep)"
  elif cfg.masks_in_prep:
    masks_by += f" ({refused})"
  kernel = "" if refused is None else " (E-independent kernel)"
  prep = Stage("prep", base, "one program per chunk", f"{masks_by}{kernel}; {inverse}")

  st = state_tiles(cfg, d=d, vd=vd, c=c, e=e)
  state_reason = ((mosaic.supported(d, vd, c, e, dtype, st.block_v, st.forward_warpgroups)
                   or mosaic.supported(d, vd, c, e, dtype, st.block_v, st.reverse_warpgroups))
                  if cfg.mosaic_gpu else "Config.mosaic_gpu off")
  if state_reason is None:
    def mosaic_stage(name, wgs, copies, transposed):
      products = f"{e} x N = {st.block_v} products, " if wgs == 2 else ""
      return Stage(name, "mosaic_gpu" + interp,
                   f"block_v {st.block_v}, S_cat D x {e * st.block_v}, {wgs} warpgroup(s), "
                   f"{products}copies {copies}, {transposed} as transposed SMEM views",
                   "Config.mosaic_gpu; "
                   + _warpgroups_reason(cfg, wgs, d=d, vd=vd, c=c, e=e, bv=st.block_v))
    forward = mosaic_stage("forward", st.forward_warpgroups, "a chunk ahead", "K^T")
    forward = dataclasses.replace(   # the Triton / TPU pass writes U and the states regardless
        forward, tiles=forward.tiles + "; without gradients o and the final state only")
    bwd_states = mosaic_stage("backward_states", st.reverse_warpgroups, "at chunk start",
                              "K^T Q^T A^T P^T")
  else:
    tiles = f"block_v {cfg.block_v}, {loop}"
    forward = Stage("forward", base, tiles, state_reason)
    bwd_states = Stage("backward_states", base, tiles, state_reason)

  fused = (mosaic_backward.default_fused_tail(e) if cfg.fused_tail is None else cfg.fused_tail)
  # The split tail reads M', M; where the prep formed them in plain JAX the forward keeps them.
  if refused is None:
    keep = "M, M' formed again: the prep kernel formed its own"
  elif cfg.save_masks:
    keep = "M, M' kept from the forward: Config.save_masks"
  else:
    keep = "M, M' formed again: Config.save_masks off"
  grads_by = ("by the triadic_mask_grads kernel (Config.mask_grads_kernel)"
              if cfg.mask_grads_kernel else "in plain JAX")
  tail = ("fused tail" if fused else
          f"split tail between the mask work ({keep}; mask gradients {grads_by})")
  tail_reason = ("" if cfg.fused_tail is not None else
                 f"; tail fused iff E <= {mosaic_backward.FUSED_TAIL_MAX_E}")
  slice_wgs = mosaic_backward.slice_warpgroups(cfg.slice_warpgroups, d)
  items = ("unrolled" if mosaic_backward.unrolls_items(cfg.slice_unroll_max_e, e)
           else "a loop per piece")
  cb_reason = (mosaic_backward.supported(d, vd, c, e, dtype, warpgroups=slice_wgs)
               if cfg.mosaic_gpu_backward else "Config.mosaic_gpu_backward off")
  if cb_reason is None:
    wg_reason = ("" if slice_wgs == (cfg.slice_warpgroups or 2) else
                 "; one warpgroup: " + str(mosaic_backward.slice_warpgroups_supported(d)))
    chunk_bwd = Stage("chunk_gradients", "mosaic_gpu" + interp + " + triton tail",
                      f"slice kernel: {e} slice(s) in 64-row pieces ({items}), two slots, "
                      f"{slice_wgs} warpgroup(s), dq, dk partials in "
                      f"{'bf16' if cfg.partials_in_bf16 else 'float32'}, {tail}",
                      "Config.mosaic_gpu_backward" + tail_reason + wg_reason)
  else:
    chunk_bwd = Stage("chunk_gradients", base, f"bwd_block_v {cfg.bwd_block_v}", cb_reason)
  if state_reason is None and cb_reason is None and cfg.drhs_in_reverse_pass:
    bwd_states = dataclasses.replace(
        bwd_states, tiles=bwd_states.tiles + "; with erase also A^T dU and dV",
        reason=bwd_states.reason + "; the chunk backward reads A^T dU, dV: "
        "Config.drhs_in_reverse_pass")
  sizes = f"{cfg.platform}, {jnp.dtype(dtype).name}, D={d}, V={vd}, C={c}, E={e}"
  saves_masks = (cb_reason is None and not fused and refused is not None and cfg.save_masks)
  plan = Plan(sizes, prep, forward, bwd_states, chunk_bwd, masks_in_prep=refused is None,
              saves_masks=saves_masks, drhs_in_reverse_pass=cfg.drhs_in_reverse_pass)
  _log_once(plan)
  return plan


@functools.lru_cache(maxsize=None)
def _log_once(plan: Plan) -> None:
  log.info("%s", plan)


@dataclasses.dataclass(frozen=True)
class StateTiles:
  """The Mosaic state passes' value block and each pass's warpgroups."""
  block_v: int | None
  forward_warpgroups: int
  reverse_warpgroups: int


def state_tiles(cfg: Config, *, d: int, vd: int, c: int, e: int) -> StateTiles:
  """``Config.state_warpgroups`` 1 or 2 sets both passes (2 where ``mosaic.warpgroups_supported``
  takes it, else 1; block_v ``Config.state_block_v`` or ``mosaic.default_block_v`` for those
  warpgroups); None leaves block_v and each pass's warpgroups to
  ``mosaic.default_state_tiles``."""
  if cfg.state_warpgroups is None:
    bv, fwd, rev = mosaic.default_state_tiles(d, vd, c, e, cfg.state_block_v)
  else:
    fwd = rev = (2 if cfg.state_warpgroups == 2
                 and mosaic.warpgroups_supported(d, vd, c, e, cfg.state_block_v) is None else 1)
    bv = cfg.state_block_v or mosaic.default_block_v(d, vd, c, e, warpgroups=fwd)
  return StateTiles(bv, fwd, rev)


def _warpgroups_reason(cfg: Config, wgs: int, *, d: int, vd: int, c: int, e: int, bv: int) -> str:
  """Why a state pass runs ``wgs`` warpgroups, for the plan."""
  if cfg.state_warpgroups is not None:
    if wgs == cfg.state_warpgroups:
      return f"Config.state_warpgroups={wgs}"
    return "one warpgroup: " + str(mosaic.warpgroups_supported(d, vd, c, e, cfg.state_block_v))
  if wgs == 2:
    return "two warpgroups: one warpgroup's state would fill its registers"
  if d * e * bv < mosaic.STATE_BUDGET:
    return "one warpgroup: its state fits its registers"
  refused = mosaic.warpgroups_supported(d, vd, c, e, bv)
  if refused:
    return "one warpgroup: " + refused
  return (f"one warpgroup: at block_v {bv} two would run the forward's products over D as "
          f"{e} wgmmas of N = {bv}")


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a call's per-token operands (q, k, v, o, dO, dq, dk, dv) live while the kernels run:
  ``token_major``, the caller's (B, T, H, X) arrays read and written in place, or the
  (B*H, NC, C, X) relayout (``ops.kernel_layout``), with the reason."""
  token_major: bool
  reason: str

  def __str__(self) -> str:
    where = "(B, T, H, X), in place" if self.token_major else "(B*H, NC, C, X), relayouted"
    return f"per-token operands {where} ({self.reason})"


def layout(cfg: Config, plan: Plan, *, t: int, c: int, d: int, vd: int, padded_d: int,
           padded_vd: int) -> Layout:
  """The layout of a call over ``t`` tokens with (unpadded) D, V under ``cfg`` and its ``plan``:
  token-major (``Config.token_major``) where every stage reads it, else why not. Logged once
  per distinct answer."""
  if not cfg.token_major:
    choice = Layout(False, "Config.token_major off")
  elif not (plan.mosaic_state_kernels and plan.mosaic_chunk_gradients):
    choice = Layout(False, "token-major reads need the Mosaic GPU state passes and chunk "
                           "backward, which this plan does not run")
  elif t % c:
    choice = Layout(False, f"T = {t} is not a multiple of the chunk size {c} (the kernels copy "
                           "whole chunks)")
  elif (d, vd) != (padded_d, padded_vd):
    choice = Layout(False, f"D = {d}, V = {vd} are padded to {padded_d}, {padded_vd}")
  else:
    choice = Layout(True, "Config.token_major")
  _log_layout_once(plan.sizes, t, choice)
  return choice


@functools.lru_cache(maxsize=None)
def _log_layout_once(sizes: str, t: int, choice: Layout) -> None:
  log.info("triadic_pallas (%s, T=%d): %s", sizes, t, choice)


def sequence_pieces(cfg: Config, *, bh: int, nc: int, d: int, vd: int, c: int, e: int, dtype
                    ) -> pieces.Pieces:
  """How the state passes of a call with B*H = ``bh`` over ``nc`` chunks are cut
  (``Config.sequence_pieces``, ``pieces.choose``); its programs are bh times the forward state
  pass's value blocks. Logged once per distinct answer."""
  plan = resolve(cfg, d=d, vd=vd, c=c, e=e, dtype=dtype)
  bv = (state_tiles(cfg, d=d, vd=vd, c=c, e=e).block_v if plan.mosaic_state_kernels
        else cfg.block_v)
  choice = pieces.choose(cfg.sequence_pieces, cfg.warmup_chunks, programs=bh * max(1, vd // bv),
                         nc=nc)
  _log_pieces_once(plan.sizes, bh, nc, choice)
  return choice


@functools.lru_cache(maxsize=None)
def _log_pieces_once(sizes: str, bh: int, nc: int, choice: pieces.Pieces) -> None:
  log.info("triadic_pallas state passes (%s, B*H=%d, %d chunks): %s", sizes, bh, nc, choice)
