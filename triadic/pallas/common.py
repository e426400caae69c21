"""What every triadic kernel shares: the platform switch, the matmul helper and per-slice loads.

Kernels see the chunked, head-major layout (BH, NC, C, X) built by ``triadic.pallas.ops``: every
block covers whole trailing dimensions, which Mosaic TPU needs (tiles are (8, 128) or the full
dimension) and which keeps Triton's power-of-two tensors to C, D, V, BV. The GPU kernels also
take the per-token operands q, k, v, dO in the caller's (B, T, H, X) layout (``heads=H``,
``check_heads``; ``Config.token_major``): chunk n of row i = b * H + h is then the strided block
of tokens n*C.. at batch b, head h.

Platforms differ in what a block is. On Triton (GPU) a block is a pointer into global memory: a
block may span the whole sequence and the kernel walks it (the state-passing loop does so). On
Mosaic TPU every block is copied into VMEM (16-64 MiB per core) and double-buffered by the
pipeline, so no block may grow with T: the sequential chunk walk is then a grid axis ("arbitrary"
semantics) with one chunk per block and the carried state in VMEM scratch (``recurrent.py``).
``Config.platform`` picks the structure; ``Config.interpret`` runs either on a CPU.

Per-token, per-slice quantities (k2, q2, gc) arrive as (C, E) tiles. Triton cannot slice a
tensor held in registers, so a slice e is loaded from the ref as a (C, 1) column (``col``) or, from
the transposed (E, C) copy, as a (1, C) row (``row``); a scalar such as gc at the chunk's last
token is a (1, 1) load. Everything then stays two-dimensional, the only shapes Mosaic handles well.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

F32 = jnp.float32
PLATFORMS = ("gpu", "tpu", "cpu")


@dataclasses.dataclass(frozen=True)
class Config:
  """How to launch: platform ("gpu" Triton, "tpu" Mosaic, "cpu" interpret) and tile choices.

  The platform fixes the kernels' structure: "gpu" and "cpu" run the state-passing kernels as one
  program per value block looping over all chunks; "tpu" puts the chunks on the grid
  (``chunk_grid``). ``interpret=True`` runs the platform's kernels in Pallas interpret mode (on
  any backend), which is how a CPU tests the TPU structure; it is always on for "cpu". A
  ``pltpu.InterpretParams`` instead selects TPU interpret mode (simulated VMEM and DMAs,
  NaN-filled uninitialised scratch, "parallel" grid axes in random order given a seed), for direct
  kernel calls only: its callbacks cannot pass the ``custom_partitioning`` around
  ``triadic_pallas``.
  block_v: value columns per program of the recurrent kernels (the state tile is E x D x block_v
  float32; on TPU a multiple of 128 or the whole V). bwd_block_v: value columns per step of the
  chunk-parallel backward's inner loop.
  mosaic_gpu: run the two state-passing kernels as Mosaic GPU (Hopper wgmma) kernels
  (``mosaic.py``, their own block_v) wherever ``mosaic.supported`` takes the sizes (bf16, C = 64,
  ...), the Triton ones elsewhere. On by default on Hopper GPUs; on "cpu" it selects Mosaic GPU
  interpret mode (how the tests run them).
  mosaic_gpu_backward: also run the chunk-parallel backward's E-dependent part as the Mosaic GPU
  slice kernel (``mosaic_backward.py``), where ``mosaic_backward.supported`` takes the sizes. On
  by default on Hopper GPUs.
  fused_tail: with ``mosaic_gpu_backward``, whether that backward's tail is one kernel with the
  mask work inside (None: ``mosaic_backward.default_fused_tail``, small E).
  slice_warpgroups: the slice kernel's warpgroups: 1, or 2 (D = 128 only: each owns one 64-row
  piece of the state and half the live registers). None: 2 where D = 128, else 1
  (``mosaic_backward.slice_warpgroups``).
  state_warpgroups: with ``mosaic_gpu``, the Mosaic state passes' warpgroups: 1, or 2 for both
  passes (D = 128 only: each holds 64 rows of the state, so that E * block_v = 256 fits the
  registers; where ``mosaic.warpgroups_supported`` refuses, 1, as the plan says); None: per pass,
  two where one warpgroup's state would fill its registers (``mosaic.default_state_tiles``).
  state_block_v: with ``mosaic_gpu``, the Mosaic state passes' value block (None:
  ``mosaic.default_block_v`` for their warpgroups; one that ``mosaic.supported`` refuses sends
  them to Triton, as the plan says). Wider blocks read K, Q, A, P fewer times over, with fewer
  programs.
  ut_kernel: take the prep's UT inverse A = (I + L)^-1 by a kernel, one program per chunk
  (``chunk_prep.unit_lower_inverse_kernel``), instead of the plain-JAX blocked substitution (GPU
  structure only; on by default on GPUs).
  masks_in_prep: the prep kernel forms the decay masks M, M' itself from k2, q2 and gc (one
  slice's C x C decay tile at a time) instead of reading them from the plain-JAX masks, so they
  never pass through HBM; for small E (GPU structure only: ``chunk_prep.masks_in_prep_supported``).
  token_major: keep the op's per-token operands q, k, v and o (and dO, dq, dk, dv) in the
  caller's (B, T, H, X) layout: the kernels read and write them in place (strided TMA boxes,
  block index maps) instead of the op relayouting them to (B*H, NC, C, X) and back. Taken where
  every stage can (the Mosaic GPU state passes and chunk backward, T a multiple of the chunk,
  D and V powers of two); ``plan.layout`` says why not elsewhere.
  On by default: it measured faster at every E on the H200 (benchmarks/RESULTS.md); False keeps
  the relayout everywhere.
  save_masks: keep the decay masks M' and M (erase) from the forward for the backward where the
  backward's tail would form them again in plain JAX (the split tail, ``Plan.saves_masks``; the
  prep then formed them in plain JAX too, so keeping them moves no extra bytes: they stay
  alive until the backward, 2 C^2 float32 a chunk). False recomputes them.
  drhs_in_reverse_pass: the Mosaic reverse state pass also writes A^T dU, which it forms for the
  state gradient anyway, and dV = beta A^T dU, which the Mosaic chunk backward then reads instead
  of forming them in XLA (erase only; ``Plan.saves_drhs``). False forms them in XLA.
  partials_in_bf16: the Mosaic slice kernel hands its dq, dk partials (the state terms, summed
  in float32) to the tail in bf16, rounded once, instead of float32: half their bytes written and
  read (the tail adds the UT and mask terms in float32 and rounds dq, dk to bf16 again). False
  keeps them float32.
  slice_unroll_max_e: up to this E the Mosaic slice kernel's state items (a slice's 64-row piece
  of S_e and dS_e) are unrolled; above it they run as a loop per piece, which keeps the compiler
  from holding several items' values in registers at once (None: ``mosaic_backward.UNROLL_MAX_E``).
  mask_grads_kernel: the split tail's per-slice mask gradients (dk2, dq2, d gc from dM', dM) by
  the kernel ``masks.mask_grads_kernel`` (one program per chunk, one exponential per (token,
  token, slice) shared by the four sums, no cross-thread reductions) instead of plain JAX, where
  XLA takes each of the four sums with its own exponentials (Mosaic GPU chunk backward only).
  query_walk: MERLIN's forward-only readout in the erase mode (``merlin.pallas.kernels``,
  ``walk_readout``): where no gradient is taken, each chunk's walked query moves back through
  the span maps and reads only the segments' end states, so the forward stores each chunk's
  current state and each segment's end state instead of every finished state at every span
  start (the span stack, (B*H, NS (NS - 1) / 2, D, V)). A differentiated call runs the span
  form's forward regardless, as the backward needs the span stack. On in the GPU default
  (``merlin.pallas.plan.default_config``).
  intra_kernel: MERLIN's intra-chunk part's forward (``merlin.chunked.intra_chunk``: the UT
  transform, Uv, W, Qe, Kw, the chunk decay and P Uv) by a Triton kernel, one program per
  (batch*head, chunk), reading q, k, v, beta and g's chunk-local cumulative sum in the caller's
  layout (``merlin.pallas.intra``), instead of plain float32 JAX over all chunks; where a
  gradient is taken it also writes A for the part's pullback (``merlin.pallas.ops.intra_stage``).
  On in the GPU default (``merlin.pallas.plan.default_config``).
  intra_backward_kernel: that part's pullback (``merlin.chunked.intra_chunk_pullback``) by a
  Triton kernel, one program per (batch*head, chunk), reading the inputs and the residuals and
  writing dq, dk, dv, dgc, dbeta in the caller's layout (``merlin.pallas.intra``), instead of
  plain float32 JAX over all chunks. On in the GPU default.
  read_chunks: MERLIN's span readout and chunk gradients (``merlin.pallas.kernels``): the
  chunks of one span a program takes (``kernels.read_group``: where this does not divide the
  chunks of a segment and of the sequence, their common divisor), so that it reads each
  finished state once for all of them. 1: a program per chunk.
  reverse_states: MERLIN's erase reverse state pass: the finished states' gradients a program
  carries (a group of consecutive segments), so that it reads each later span's map, walked
  queries and dO once for all of them. 1: a program per state.
  forward_states: the same for MERLIN's erase forward state pass (each later span's map read
  once for the group's states).
  sequence_pieces: cut the sequence into this many pieces for the state passes, each started
  from a warm-up over the ``warmup_chunks`` chunks before it (``pieces.py``; exact to far below
  rounding, and taken only when every window decays enough): 1 none, 0 as many (2, 4 or 8) as
  keep the programs within the device's multiprocessors, n >= 2 exactly n.
  """
  platform: str
  block_v: int
  bwd_block_v: int
  num_warps: int = 4
  num_stages: int = 2
  bwd_num_warps: int = 8
  interpret: bool | pltpu.InterpretParams = False
  mosaic_gpu: bool = False
  mosaic_gpu_backward: bool = False
  fused_tail: bool | None = None
  slice_warpgroups: int | None = None
  state_warpgroups: int | None = None
  state_block_v: int | None = None
  sequence_pieces: int = 1
  warmup_chunks: int = 16
  ut_kernel: bool = False
  masks_in_prep: bool = False
  token_major: bool = True
  save_masks: bool = True
  drhs_in_reverse_pass: bool = True
  partials_in_bf16: bool = True
  slice_unroll_max_e: int | None = None
  mask_grads_kernel: bool = False
  query_walk: bool = False
  intra_kernel: bool = False
  intra_backward_kernel: bool = False
  read_chunks: int = 1
  reverse_states: int = 1
  forward_states: int = 1

  def __post_init__(self):
    if self.platform not in PLATFORMS:
      raise ValueError(f"platform must be one of {PLATFORMS}, got {self.platform!r}")
    if self.slice_warpgroups not in (None, 1, 2):
      raise ValueError(f"slice_warpgroups must be None, 1 or 2, got {self.slice_warpgroups!r}")
    if self.state_warpgroups not in (None, 1, 2):
      raise ValueError(f"state_warpgroups must be None, 1 or 2, got {self.state_warpgroups!r}")
    if not isinstance(self.sequence_pieces, int) or self.sequence_pieces < 0:
      raise ValueError("sequence_pieces must be an int >= 0 (1: none, 0: by the device), got "
                       f"{self.sequence_pieces!r}")
    for name in ("masks_in_prep", "token_major", "save_masks", "drhs_in_reverse_pass",
                 "partials_in_bf16", "mask_grads_kernel", "query_walk", "intra_kernel",
                 "intra_backward_kernel"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
    if self.slice_unroll_max_e is not None and (not isinstance(self.slice_unroll_max_e, int)
                                                or self.slice_unroll_max_e < 0):
      raise ValueError("slice_unroll_max_e must be None (mosaic_backward.UNROLL_MAX_E) or an int "
                       f">= 0, got {self.slice_unroll_max_e!r}")
    for name in ("read_chunks", "reverse_states", "forward_states"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not isinstance(self.warmup_chunks, int) or self.warmup_chunks < 1:
      raise ValueError(f"warmup_chunks must be an int >= 1, got {self.warmup_chunks!r}")
    if self.platform == "cpu" and not self.interpret:
      object.__setattr__(self, "interpret", True)
    if (self.mosaic_gpu or self.mosaic_gpu_backward) and self.platform == "tpu":
      raise ValueError("mosaic_gpu=True needs platform 'gpu' (or 'cpu' to interpret), got 'tpu'")

  @property
  def chunk_grid(self) -> bool:
    """Whether the state-passing kernels take the chunk axis as a grid axis (TPU: blocks live in
    VMEM, one chunk each) instead of looping over whole-sequence blocks (Triton: blocks are
    pointers into HBM)."""
    return self.platform == "tpu"

  @property
  def f32_precision(self):
    """Precision of the float32-only matmuls (UT inverse, its gradient). Triton's IEEE float32
    dot runs on the FMA units, many times slower than the tensor cores; TF32x3 runs on the
    tensor cores at float32-level accuracy (three TF32 products)."""
    if self.platform == "gpu":
      return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return jax.lax.Precision.HIGHEST


def call(kernel, *, cfg: Config, grid, in_specs, out_specs, out_shape, semantics, name,
         num_warps=None, scratch_shapes=()):
  """``pl.pallas_call`` with the platform's compiler parameters.

  semantics: one of "parallel"/"arbitrary" per grid axis (TPU only; Triton programs are
  independent by construction). scratch_shapes: per-program scratch buffers (``pltpu.VMEM``;
  TPU structure only), which persist across the grid's sequential ("arbitrary") steps.
  """
  kwargs = {}
  if cfg.platform == "gpu":
    kwargs["compiler_params"] = plt.CompilerParams(
        num_warps=num_warps or cfg.num_warps, num_stages=cfg.num_stages)
  elif cfg.platform == "tpu":
    kwargs["compiler_params"] = pltpu.CompilerParams(dimension_semantics=semantics)
  if scratch_shapes:
    kwargs["scratch_shapes"] = scratch_shapes
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=cfg.interpret, name=name, **kwargs)


def check_heads(heads: int, bh: int, nc: int, c: int, **arrays) -> None:
  """The checks of the caller's (B, T, H, X) layout (a kernel's ``heads=H``): every named array
  is (B, T, H, X) with T = NC * C (kernels copy whole chunks: no padding, no partial box) and
  B * H = BH, the leading dim of the kernel's other (BH, NC, ...) operands. Program / row i of
  those reads batch b = i // H, head h = i % H."""
  if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
    raise ValueError(f"heads must be a positive int (H of the (B, T, H, X) layout), got {heads!r}")
  for name, x in arrays.items():
    if x.ndim != 4 or x.shape[2] != heads:
      raise ValueError(f"{name}: with heads={heads} expected (B, T, {heads}, X), got {x.shape}")
    b, t = x.shape[:2]
    if t % c:
      raise ValueError(f"{name}: T = {t} must be a multiple of the chunk size C = {c} with heads "
                       "(pad T, or use the (BH, NC, C, X) layout)")
    if (b * heads, t) != (bh, nc * c):
      raise ValueError(f"{name}: (B * H, T) = ({b * heads}, {t}) does not match the other "
                       f"operands' (BH, NC * C) = ({bh}, {nc * c})")


def chunk_block(*shape: int):
  """The BlockSpec of program (i, j)'s ``shape`` block of a (B*H, NC, *shape) array, for a
  (B*H, NC) grid: row i, chunk j, the two squeezed."""
  return pl.BlockSpec((None, None, *shape), lambda i, j: (i, j) + (0,) * len(shape))


def token_block(c: int, x: int, heads: int):
  """The BlockSpec of chunk j's (C, X) block of head i % H, batch i // H of a caller-layout
  (B, T, H, X) array, for a (B*H, NC) grid (i, j): the head dim squeezed, a strided block."""
  return pl.BlockSpec((None, c, None, x), lambda i, j: (i // heads, j, i % heads, 0))


def du_dtype(dtype, erase: bool):
  """The dtype the reverse state passes store dU in: the inputs' ``dtype`` with erase, where its
  every later use is a matmul operand in that dtype (A^T dU, dA, the tails' products over V), so
  that a wider dU would only cost bytes; float32 without erase, where dv = beta dU directly."""
  return jnp.dtype(dtype) if erase else jnp.dtype(F32)


def token_major(x, b: int, h: int):
  """(B*H, NC, C, X) -> (B, T, H, X), T = NC * C: the kernel layout back to the caller's (a
  copy)."""
  return jnp.swapaxes(x.reshape(b, h, -1, x.shape[-1]), 1, 2)


def head_major(x, c: int):
  """(B, T, H, X) -> (B*H, NC, C, X), T = NC * C: the caller's layout to the kernels' (a copy;
  ``token_major`` is its inverse)."""
  b, t, h, xd = x.shape
  return jnp.einsum("bnchx->bhncx", x.reshape(b, t // c, c, h, xd)).reshape(b * h, t // c, c, xd)


def mm(a, b, dtype, *, ta=False, tb=False, precision=None):
  """a @ b (a^T if ta, b^T if tb) with operands cast to ``dtype``, float32 accumulation.

  float32 operands use full precision (Triton's default for float32 is TF32, which loses ~3
  digits and would break the float32 bounds of the tests); bf16 operands use the tensor cores.
  ``precision`` overrides the float32 choice (``Config.f32_precision``).
  """
  dims = (((0,) if ta else (1,)), ((1,) if tb else (0,)))
  if dtype == F32:
    prec = jax.lax.Precision.HIGHEST if precision is None else precision
  else:
    prec = jax.lax.Precision.DEFAULT
  return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (dims, ((), ())),
                             precision=prec, preferred_element_type=F32)


def masks(c):
  """(causal s <= t, strict s < t, t index, s index) over a C x C chunk, t the row."""
  t = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  s = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  return s <= t, s < t, t, s


def decay_mask(gt, gs, causal):
  """exp(gc_t - gc_s) where s <= t, else 0: gt (C, 1), gs (1, C). Masked before ``exp``, so
  nothing overflows for any g <= 0."""
  return jnp.where(causal, jnp.exp(jnp.where(causal, gt - gs, 0.0)), 0.0)


def col(ref, e, *lead):
  """Slice e of a (..., C, E) ref as a (C, 1) float32 column."""
  return ref[(*lead, slice(None), pl.ds(e, 1))].astype(F32)


def row(ref, e, *lead):
  """Slice e of a (..., E, C) ref as a (1, C) float32 row."""
  return ref[(*lead, pl.ds(e, 1), slice(None))].astype(F32)


def last(ref, e, c, *lead):
  """Entry (C - 1, e) of a (..., C, E) ref as a (1, 1) float32 array: gc at the chunk's end."""
  return ref[(*lead, pl.ds(c - 1, 1), pl.ds(e, 1))].astype(F32)


def over_value_blocks(vd, bv, body, carry):
  """carry after ``body(cols, carry)`` for the value blocks of ``bv`` of V = ``vd`` columns in
  order: one call with all columns where V is one block, else a ``lax.fori_loop`` over ``pl.ds``
  blocks, which Triton pipelines and which keeps the compiler from interleaving the blocks and so
  holding several blocks' tiles at once (registers)."""
  if vd == bv:
    return body(slice(None), carry)
  return jax.lax.fori_loop(0, vd // bv, lambda j, cr: body(pl.ds(j * bv, bv), cr), carry)


def rowsum(x):
  return jnp.sum(x, axis=1, keepdims=True)


def col_plus_row(col_part, row_part):
  """A per-token (..., C, E) gradient from its column (..., C, E) and row (..., E, C) parts, as
  the kernels that sum over both orientations of a token pair write them."""
  return col_part + jnp.swapaxes(row_part, -1, -2)


def colsum(x):
  return jnp.sum(x, axis=0, keepdims=True)


def total(x):
  """Sum of a 2-D array as (1, 1) (Triton reduces one axis at a time)."""
  return colsum(rowsum(x))
