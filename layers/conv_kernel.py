"""The causal depthwise convolution of ``layers.blocks.causal_conv`` as Pallas kernels.

``causal_conv_pallas(x, kernel, segment_ids)`` computes, for x (B, T, C) and kernel (W, C),

    y_t = sum_w kernel[w] * x_{t - W + 1 + w} * same(t, t - W + 1 + w)

with x before the sequence start read as zero and, given ``segment_ids`` (B, T) (packed
documents), same(t, s) = [segment_ids_s == segment_ids_t] (else 1): an input of another document
counts as the causal padding's zero, exactly as ``causal_conv`` masks it. Differentiable in x
and kernel through a ``jax.custom_vjp`` whose backward is the second kernel.

Which implementation ``causal_conv`` runs is decided in one place, ``choose_impl``, which returns
the choice with its reason: "auto" is the kernels on a GPU where there is no cache (training, and
prefill without a cache), XLA's shifted slices elsewhere. On a CPU the kernels run only in
interpret mode, far slower than XLA, and decoding (a cache) is one token at a time, which the
kernels do not take.

Rounding: ``causal_conv``'s XLA form rounds the kernel to x's dtype and computes in it; the kernels
read the kernel in its own dtype (float32 parameters), accumulate in float32 and round y once to
x's dtype. In bf16 they are therefore the closer of the two to the exact function (the tests bound
both against a float64 oracle). dx is rounded once to x's dtype; dkernel is summed in float32 and
returned in the kernel's dtype.

Tiles (``Tiles``): program (b, i, j) of the forward computes rows i*block_t .. + block_t - 1 of
batch b for channels j*block_c .. + block_c - 1. Triton cannot shift a tensor held in registers,
so the W taps are W loads of the tile at row offsets -(W - 1) .. 0: the halo of W - 1 rows before
the block is the previous block's (cache hits). The rows are index arrays, clamped into [0, T)
on load and masked (rows before 0 and rows of another document read as zero, rows from T on are
not stored), rather than ``pl.ds`` windows, because interpret mode (``lax.dynamic_slice``) would
move a window that starts before row 0 instead of padding it. Channels are an iota, not clamped,
so Triton keeps them contiguous (vector loads); a ragged last channel block is masked on load and
store. Any T and C run; W is a Python loop (the taps are unrolled).

Backward: with g the cotangent of y and ok(s, lag) = [s + lag < T] same(s + lag, s),

    dx_s         = sum_w kernel[w] g_{s + lag_w} ok(s, lag_w)            lag_w = W - 1 - w
    dkernel[w]   = sum_{b, s} x_s g_{s + lag_w} ok(s, lag_w)

Program (b, p, j) walks ``bwd_steps`` tiles of ``bwd_block_t`` rows: for each it loads x once and
g at the W row offsets 0 .. W - 1 (the halo after the tile, cache hits), stores dx and accumulates
the W products behind dkernel in float32 registers, then writes its (W, block_c) float32 partial
sums; XLA sums the (B, P) partials of each channel, P = ceil(T / (bwd_steps bwd_block_t)), in a
fixed order (deterministic, no atomics).

Bytes from HBM (halos aside): forward x in, y out; backward x and g in, dx out, plus the partials
(B P W C float32). At B = 4, T = 4096, C = 6144 in bf16 one (B, T, C) array is 201 MB.

Sharding: forward and backward are each custom-partitioned (``layers.partition``) over B and C:
under jit with the batch and/or the channels sharded every device runs the kernels on its own
slice; T and W are replicated (a sharded T is gathered first).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from layers import partition
from layers.platform import default_platform

F32 = jnp.float32
IMPLS = ("auto", "xla", "pallas")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def choose_impl(impl: str, *, cache: bool, dtype, platform: str | None = None) -> tuple[str, str]:
  """(the implementation ``causal_conv`` runs, "xla" or "pallas"; why) for an ``impl`` request
  ("auto", "xla", "pallas"), with or without a ``cache`` (decoding), x's ``dtype`` and the
  platform (None: the default backend's). ValueError for an unknown impl, or for "pallas" with a
  dtype the kernels do not take."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  platform = platform or default_platform()
  if impl == "xla":
    return "xla", "impl='xla'"
  if cache:
    return "xla", f"impl={impl!r} with a cache (decoding): the kernels take no cache"
  if jnp.dtype(dtype) not in DTYPES:
    reason = f"the kernels take float32, bfloat16 or float16 x, got {jnp.dtype(dtype)}"
    if impl == "pallas":
      raise ValueError(f"impl='pallas': {reason}")
    return "xla", f"auto: {reason}"
  if impl == "pallas":
    mode = "Triton" if platform == "gpu" else f"interpret mode on {platform}"
    return "pallas", f"impl='pallas' ({mode})"
  if platform != "gpu":
    return "xla", f"auto on {platform}: the kernels run only in interpret mode there"
  return "pallas", "auto on gpu without a cache"


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Launch choices (powers of two but the steps and warps): the forward's rows and channels per
  program (``block_t``, ``block_c``) and warps; the backward's rows per step, steps per program
  and warps (``bwd_block_t``, ``bwd_steps``, ``bwd_num_warps``; it uses ``block_c`` too). Blocks
  larger than the array shrink to its next power of two.

  The defaults keep both kernels free of register spills on sm_90 (ptxas, as
  ``benchmarks/triton_registers.py --conv`` compiles them: about 90 registers a thread forward,
  120 backward, at 8 warps; 4 warps or wider tiles double that), with 16-byte vector loads and
  stores where C is a multiple of 8."""
  block_t: int = 64
  block_c: int = 128
  num_warps: int = 8
  bwd_block_t: int = 16
  bwd_steps: int = 16
  bwd_num_warps: int = 8

  def __post_init__(self):
    for name in ("block_t", "block_c", "bwd_block_t"):
      if not _is_pow2(getattr(self, name)):
        raise ValueError(f"Tiles.{name} must be a power of two, got {getattr(self, name)!r}")
    for name in ("num_warps", "bwd_steps", "bwd_num_warps"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Tiles.{name} must be a positive int, got {value!r}")

  def fit(self, t: int, c: int) -> "Tiles":
    """These tiles with each block at most the next power of two of its extent."""
    rows, cols = _next_pow2(t), _next_pow2(c)
    return dataclasses.replace(self, block_t=min(self.block_t, rows),
                               block_c=min(self.block_c, cols),
                               bwd_block_t=min(self.bwd_block_t, rows))


def _is_pow2(n) -> bool:
  return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def check_arguments(x, kernel, segment_ids) -> None:
  """TypeError / ValueError naming the first argument ``causal_conv_pallas`` cannot take."""
  for name, a in (("x", x), ("kernel", kernel)):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if jnp.dtype(a.dtype) not in DTYPES:
      raise TypeError(f"{name} must be float32, bfloat16 or float16, got {a.dtype}")
  if x.ndim != 3 or 0 in x.shape:
    raise ValueError(f"x must be (B, T, C) with no empty axis, got shape {x.shape}")
  if kernel.ndim != 2 or kernel.shape[0] < 1 or kernel.shape[1] != x.shape[2]:
    raise ValueError(f"kernel must be (width, C) with C = {x.shape[2]} (x's channels), got shape "
                     f"{kernel.shape}")
  if segment_ids is not None:
    if not hasattr(segment_ids, "shape") or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise TypeError("segment_ids must be an integer array (B, T), got "
                      f"{getattr(segment_ids, 'dtype', type(segment_ids).__name__)}")
    if tuple(segment_ids.shape) != tuple(x.shape[:2]):
      raise ValueError(f"segment_ids must be (B, T) = {tuple(x.shape[:2])}, got shape "
                       f"{tuple(segment_ids.shape)}")


def causal_conv_pallas(x: jax.Array, kernel: jax.Array, segment_ids: jax.Array | None = None, *,
                       platform: str | None = None, tiles: Tiles | None = None) -> jax.Array:
  """y (B, T, C) in x's dtype: the causal depthwise convolution of x (B, T, C) with ``kernel``
  (W, C), documents given by ``segment_ids`` (B, T) kept apart (the module docstring has the
  function, the tiles and the gradient).

  Differentiable in x and kernel (dkernel in kernel's dtype, summed in float32). ``platform``:
  "gpu" compiles the kernels with Triton, anything else runs them in interpret mode (None: the
  default backend's). ``tiles``: launch choices (None: ``Tiles()``).
  """
  check_arguments(x, kernel, segment_ids)
  tiles = Tiles() if tiles is None else tiles
  if not isinstance(tiles, Tiles):
    raise TypeError(f"tiles must be a Tiles or None, got {type(tiles).__name__}")
  platform = platform or default_platform()
  tiles = tiles.fit(x.shape[1], x.shape[2])
  documents = () if segment_ids is None else (segment_ids.astype(jnp.int32),)
  return _conv(tiles, platform, x, kernel, *documents)


# --- the kernels' pieces (traced inside the Pallas kernels) ---------------------------------


def _rows(start, n):
  """(n, 1) int32 row indices start .. start + n - 1."""
  return start + jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)


def _cols(j, n):
  """(1, n) int32 channel indices of channel block j."""
  return j * n + jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)


def _load(ref, b, rows, cols, valid, c):
  """ref[b, rows, cols] as float32, 0 where the (R, 1) ``valid`` is false or a channel is >= c.
  Rows are clamped into the array (no lane of any backend reads outside it); channels are masked
  (an unclamped iota stays contiguous for Triton)."""
  t = ref.shape[1]
  mask = valid & (cols < c)
  return plt.load(ref.at[b, jnp.clip(rows, 0, t - 1), cols], mask=mask, other=0).astype(F32)


def _segment(seg_ref, b, rows):
  """(R, 1) segment ids of the rows, clamped into [0, T)."""
  return seg_ref[b, jnp.clip(rows, 0, seg_ref.shape[1] - 1)]


def _taps(k_ref, cols, c):
  """The kernel's W rows for the tile's channels, each (1, N) float32 (0 beyond channel c)."""
  return [plt.load(k_ref.at[w, cols], mask=cols < c, other=0).astype(F32)
          for w in range(k_ref.shape[0])]


def _forward_kernel(x_ref, k_ref, *refs, block_t, block_c, documents):
  seg_ref, y_ref = refs if documents else (None, refs[0])
  t, c = x_ref.shape[1:]
  width = k_ref.shape[0]
  b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, cols = _rows(i * block_t, block_t), _cols(j, block_c)
  taps = _taps(k_ref, cols, c)
  seg = _segment(seg_ref, b, rows) if documents else None
  y = jnp.zeros((block_t, block_c), F32)
  for w in range(width):
    src = rows - (width - 1 - w)
    valid = src >= 0
    if documents and w < width - 1:
      valid = valid & (_segment(seg_ref, b, src) == seg)
    y = y + taps[w] * _load(x_ref, b, src, cols, valid, c)
  plt.store(y_ref.at[b, rows, cols], y.astype(y_ref.dtype), mask=(rows < t) & (cols < c))


def _backward_kernel(x_ref, k_ref, *refs, block_t, block_c, steps, documents):
  seg_ref, dy_ref, dx_ref, dk_ref = refs if documents else (None, *refs)
  t, c = x_ref.shape[1:]
  width = k_ref.shape[0]
  b, p, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = _cols(j, block_c)
  taps = _taps(k_ref, cols, c)
  start = p * (steps * block_t)

  def step(n, dk):
    rows = _rows(start + n * block_t, block_t)
    in_t = rows < t
    seg = _segment(seg_ref, b, rows) if documents else None
    x = _load(x_ref, b, rows, cols, in_t, c)
    dx = jnp.zeros((block_t, block_c), F32)
    new = []
    for w in range(width):  # x_s reaches y_{s + lag} through tap w
      dst = rows + (width - 1 - w)
      valid = dst < t
      if documents and w < width - 1:
        valid = valid & (_segment(seg_ref, b, dst) == seg)
      g = _load(dy_ref, b, dst, cols, valid, c)
      dx = dx + taps[w] * g
      new.append(dk[w] + x * g)
    plt.store(dx_ref.at[b, rows, cols], dx.astype(dx_ref.dtype), mask=in_t & (cols < c))
    return tuple(new)

  n_steps = jnp.minimum(steps, pl.cdiv(t - start, block_t))
  dk = jax.lax.fori_loop(0, n_steps, step,
                         tuple(jnp.zeros((block_t, block_c), F32) for _ in range(width)))
  for w in range(width):  # summed over the tile's rows once, after the walk
    plt.store(dk_ref.at[b, p, w, cols], jnp.sum(dk[w], axis=0, keepdims=True), mask=cols < c)


# --- the calls --------------------------------------------------------------------------------


def _call(body, platform: str, num_warps: int, grid, out_shape, name):
  """``pl.pallas_call`` over whole-array refs (the kernels index them): Triton with its launch
  parameters on "gpu" (one stage: the loads are not software-pipelined), else interpret mode."""
  kwargs = {}
  if platform == "gpu":
    kwargs["compiler_params"] = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  return pl.pallas_call(body, grid=grid, out_shape=out_shape, interpret=platform != "gpu",
                        name=name, **kwargs)


def _forward(tiles: Tiles, platform: str, x, kernel, *segment_ids):
  """The forward kernel: y (B, T, C) in x's dtype."""
  b, t, c = x.shape
  body = functools.partial(_forward_kernel, block_t=tiles.block_t, block_c=tiles.block_c,
                           documents=bool(segment_ids))
  grid = (b, pl.cdiv(t, tiles.block_t), pl.cdiv(c, tiles.block_c))
  return _call(body, platform, tiles.num_warps, grid, jax.ShapeDtypeStruct(x.shape, x.dtype),
               "causal_conv_forward")(x, kernel, *segment_ids)


def _backward(tiles: Tiles, platform: str, x, kernel, *rest):
  """The backward kernel on (x, kernel, [segment_ids,] dy): (dx (B, T, C) in x's dtype, dkernel
  partial sums (B, P, W, C) float32, P = ceil(T / (bwd_steps bwd_block_t)))."""
  b, t, c = x.shape
  width = kernel.shape[0]
  p = pl.cdiv(t, tiles.bwd_steps * tiles.bwd_block_t)
  body = functools.partial(_backward_kernel, block_t=tiles.bwd_block_t, block_c=tiles.block_c,
                           steps=tiles.bwd_steps, documents=len(rest) == 2)
  out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((b, p, width, c), F32))
  return _call(body, platform, tiles.bwd_num_warps, (b, p, pl.cdiv(c, tiles.block_c)), out_shape,
               "causal_conv_backward")(x, kernel, *rest)


# Per (B, C) shard under jit (``layers.partition``; C plays its "h"): T, W and the backward's
# partial-sum index n must not be sharded.
_REPLICATED = ("t", "w", "n")
_FORWARD = {False: partition.batch_head_partitioned(
                _forward, n_static=2, rule="b t h, w h -> b t h", replicated=_REPLICATED),
            True: partition.batch_head_partitioned(
                _forward, n_static=2, rule="b t h, w h, b t -> b t h", replicated=_REPLICATED)}
_BACKWARD = {False: partition.batch_head_partitioned(
                 _backward, n_static=2, rule="b t h, w h, b t h -> b t h, b n w h",
                 replicated=_REPLICATED),
             True: partition.batch_head_partitioned(
                 _backward, n_static=2, rule="b t h, w h, b t, b t h -> b t h, b n w h",
                 replicated=_REPLICATED)}


def _primal(tiles, platform, x, kernel, *segment_ids):
  return _FORWARD[bool(segment_ids)](tiles, platform, x, kernel, *segment_ids)


def _forward_rule(tiles, platform, x, kernel, *segment_ids):
  return _primal(tiles, platform, x, kernel, *segment_ids), (x, kernel, segment_ids)


def _backward_rule(tiles, platform, residuals, dy):
  x, kernel, segment_ids = residuals
  dx, dk = _BACKWARD[bool(segment_ids)](tiles, platform, x, kernel, *segment_ids,
                                        dy.astype(x.dtype))
  dk = jnp.sum(dk, axis=(0, 1)).astype(kernel.dtype)
  return (dx, dk) + tuple(None for _ in segment_ids)


_conv = jax.custom_vjp(_primal, nondiff_argnums=(0, 1))
_conv.defvjp(_forward_rule, _backward_rule)
