"""``gdn_inputs``' short convolutions, activations and L2 norms as one Pallas kernel.

XLA runs the width-W causal depthwise convolution over the fused projection z (B, T, C) and the
per-stream SiLU / softplus and L2 norms as several fusions with z-sized intermediates between
them, forward and backward. Here one program per (batch row, block of tokens, one head of one
stream) loads its channels of z at the W lags it reads, convolves, activates, normalises over the
head's channels (all inside the program) and writes the stream's output: z is read once and each
output written once.

Streams (``Stream``) lie side by side along C, in ``gdn_inputs``' order: q, k (SiLU, then L2 over
each head's D channels), v (SiLU), and for E > 1 k2, q2 (softplus in float32, then L2 over each
head's E channels; output float32). A head's width need not be a power of two (E = 3): the
program loads the next power of two of channels and masks the rest.

The backward recomputes the forward from z (nothing is saved but z): program (b, i, head) forms
dz on its token block as sum_l w[W-1-l] dy[t + l], so it recomputes dy on the block shifted by
each lag l (Triton cannot shift a tensor held in registers; the shifted loads come from cache),
and the per-channel kernel gradient sum_t dy[t] z[t - l] as one partial sum per program, reduced
over programs in JAX.

Loads and stores are masked per row (tokens before 0, past T, or in another document read as
zero), which on Triton is a pointer mask. Interpret mode (CPU) cannot read at a negative row, so
there z and the segment ids get W - 1 leading zero rows and the same kernels read them one block
of W - 1 rows later. Triton (GPU) and interpret mode only: Mosaic TPU has no masked pointer loads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from triadic.pallas.common import F32, Config, call

EPS = 1e-6  # as ``layers.blocks.l2norm``
ACTIVATIONS = ("silu", "softplus")


@dataclasses.dataclass(frozen=True)
class Stream:
  """One stream of z's channels: ``heads`` heads of ``width`` channels, activation ``act``,
  L2-normalised over each head's channels if ``norm``; output in ``dtype`` (None: z's)."""
  heads: int
  width: int
  act: str = "silu"
  norm: bool = True
  dtype: object = None

  def __post_init__(self):
    if self.act not in ACTIVATIONS:
      raise ValueError(f"Stream.act must be one of {ACTIVATIONS}, got {self.act!r}")


def default_config() -> Config:
  """Triton on a GPU, interpret mode elsewhere. Only the platform, interpret and num_warps of a
  ``Config`` are read here (its block_v fields belong to the triadic kernels)."""
  platform = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"
  return Config(platform, block_v=16, bwd_block_v=16)


def _pow2(n: int) -> int:
  return 1 << (n - 1).bit_length()


def _silu(y):
  return y * jax.nn.sigmoid(y)


def _softplus(y):
  return jnp.maximum(y, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(y)))


def _act_grad(y, act):
  s = jax.nn.sigmoid(y)
  return s * (1.0 + y * (1.0 - s)) if act == "silu" else s


class _Group:
  """Index arithmetic of one program: channels [c0, c0 + width) of batch row b, token block i
  (tokens t0 = i block_t ...). ``front``: the leading rows padded onto z and the segment ids
  (interpret mode only)."""

  def __init__(self, b, i, c0, stream, *, block_t, t_len, front, width):
    self.b, self.i, self.t0, self.c0, self.s = b, i, i * block_t, c0, stream
    self.bt, self.t_len, self.front, self.width = block_t, t_len, front, width
    self.np = _pow2(stream.width)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, self.np), 1)
    self.cmask = cols < stream.width

  def rows(self, shift):
    """(BT, 1) logical token index of the block shifted by ``shift`` rows."""
    return self.t0 + shift + jax.lax.broadcasted_iota(jnp.int32, (self.bt, 1), 0)

  def load_rows(self, ref, shift, other, channels=True, col0=None):
    """ref[b, t0 + shift + (0 .. BT), channels] (rows outside [0, T) read as ``other``): z's
    channels (past the leading pad rows), or with ``col0`` a stream's (unpadded) columns."""
    r = self.rows(shift)
    mask = (r >= 0) & (r < self.t_len)
    start = self.t0 + shift + (0 if col0 is not None else self.front)
    if channels:
      c0 = self.c0 if col0 is None else col0
      return plt.load(ref.at[self.b, pl.ds(start, self.bt), pl.ds(c0, self.np)],
                      mask=mask & self.cmask, other=other)
    return plt.load(ref.at[self.b, pl.ds(start, self.bt), pl.ds(0, 1)], mask=mask, other=other)

  def taps(self, w_ref):
    """The W kernel rows of these channels, each (1, np) float32."""
    return [plt.load(w_ref.at[pl.ds(w, 1), pl.ds(self.c0, self.np)], mask=self.cmask,
                     other=0.0).astype(F32) for w in range(self.width)]

  def conv(self, z_ref, taps, seg_ref, shift):
    """y on the block shifted by ``shift``, the lagged inputs x_l = z[t - l] (zero across a
    document start) and the segment ids of the block's rows (None without them)."""
    seg = None if seg_ref is None else self.load_rows(seg_ref, shift, -1, channels=False)
    xs = []
    for lag in range(self.width):
      x = self.load_rows(z_ref, shift - lag, 0.0).astype(F32)
      if seg is not None and lag:
        x = jnp.where(self.load_rows(seg_ref, shift - lag, -2, channels=False) == seg, x, 0.0)
      xs.append(x)
    y = sum(taps[self.width - 1 - lag] * xs[lag] for lag in range(self.width))
    return y, xs, seg

  def forward(self, y):
    """The stream's output o and the inverse norm r ((BT, 1); None without a norm)."""
    u = _silu(y) if self.s.act == "silu" else _softplus(y)
    if self.np != self.s.width:
      u = jnp.where(self.cmask, u, 0.0)
    if not self.s.norm:
      return u, None
    r = jax.lax.rsqrt(jnp.sum(u * u, axis=1, keepdims=True) + EPS)
    return u * r, r

  def backward(self, y, do):
    """dy from the output cotangent do (float32)."""
    o, r = self.forward(y)
    du = do if r is None else r * (do - o * jnp.sum(do * o, axis=1, keepdims=True))
    return du * _act_grad(y, self.s.act)

  def store(self, ref, val, col0):
    r = self.rows(0)
    mask = (r < self.t_len) & self.cmask
    plt.store(ref.at[self.b, pl.ds(self.t0, self.bt), pl.ds(col0, self.np)],
              val.astype(ref.dtype), mask=mask)


def _each_stream(streams, kw, body):
  """Run ``body(j, group, col0)`` in each program of stream j (grid axis 2 walks the streams'
  heads in order; col0 is the head's first column in the stream's output)."""
  b, i, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  g0 = c0 = 0
  for j, s in enumerate(streams):

    @pl.when((g >= g0) & (g < g0 + s.heads))
    def _(j=j, s=s, g0=g0, c0=c0):
      col0 = (g - g0) * s.width
      body(j, _Group(b, i, c0 + col0, s, **kw), col0)

    g0, c0 = g0 + s.heads, c0 + s.heads * s.width


def _fwd_kernel(z_ref, w_ref, *refs, streams, has_seg, **kw):
  seg_ref = refs[0] if has_seg else None
  out_refs = refs[1:] if has_seg else refs

  def body(j, grp, col0):
    y, _, _ = grp.conv(z_ref, grp.taps(w_ref), seg_ref, 0)
    grp.store(out_refs[j], grp.forward(y)[0], col0)

  _each_stream(streams, kw, body)


def _bwd_kernel(z_ref, w_ref, *refs, streams, has_seg, **kw):
  seg_ref = refs[0] if has_seg else None
  refs = refs[1:] if has_seg else refs
  do_refs, (dz_ref, dw_ref) = refs[:len(streams)], refs[len(streams):]
  width = kw["width"]

  def body(j, grp, col0):
    taps = grp.taps(w_ref)
    dz, seg0 = 0.0, None
    for shift in range(width):  # dz[t] = sum_l w[W-1-l] dy[t + l] (same document)
      y, xs, seg = grp.conv(z_ref, taps, seg_ref, shift)
      do = grp.load_rows(do_refs[j], shift, 0.0, col0=col0).astype(F32)
      dy = grp.backward(y, do)
      if shift == 0:
        seg0 = seg
        for lag in range(width):  # d w[W-1-lag] = sum_t dy[t] x_lag[t], this block's part
          part = jnp.sum(dy * xs[lag], axis=0, keepdims=True)
          plt.store(dw_ref.at[grp.b, grp.i, pl.ds(width - 1 - lag, 1), pl.ds(grp.c0, grp.np)],
                    part, mask=grp.cmask)
      term = taps[width - 1 - shift] * dy
      if seg0 is not None and shift:
        term = jnp.where(seg == seg0, term, 0.0)
      dz = dz + term
    grp.store(dz_ref, dz, grp.c0)

  _each_stream(streams, kw, body)


def _whole(shape):
  """A block that is the whole array: each program indexes it itself (masked pointer loads)."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _setup(z, kernel, segment_ids, streams, cfg, block_t):
  b, t, c = z.shape
  width = kernel.shape[0]
  if sum(s.heads * s.width for s in streams) != c or kernel.shape[1:] != (c,):
    raise ValueError(f"the streams' channels ({sum(s.heads * s.width for s in streams)}) must be "
                     f"z's ({c}) and the kernel's {kernel.shape[1:]}")
  if cfg.platform == "tpu":
    raise ValueError("fused_short_conv runs on Triton (gpu) or in interpret mode (cpu), not 'tpu'")
  front = 0 if cfg.platform == "gpu" and not cfg.interpret else width - 1
  pad = lambda x: jnp.pad(x, [(0, 0), (front, 0)] + [(0, 0)] * (x.ndim - 2)) if front else x
  args = [pad(z), kernel.astype(F32)]
  if segment_ids is not None:
    args.append(pad(segment_ids.astype(jnp.int32)[..., None]))
  grid = (b, pl.cdiv(t, block_t), sum(s.heads for s in streams))
  kw = dict(streams=tuple(streams), has_seg=segment_ids is not None, block_t=block_t, t_len=t,
            front=front, width=width)
  return args, grid, kw


def _forward(z, kernel, segment_ids, streams, cfg, block_t):
  args, grid, kw = _setup(z, kernel, segment_ids, streams, cfg, block_t)
  b, t = z.shape[:2]
  shapes = [jax.ShapeDtypeStruct((b, t, s.heads * s.width), s.dtype or z.dtype) for s in streams]
  outs = call(functools.partial(_fwd_kernel, **kw), cfg=cfg, grid=grid,
              in_specs=[_whole(x.shape) for x in args], out_specs=[_whole(x.shape) for x in shapes],
              out_shape=shapes, semantics=None, name="gdn_short_conv_fwd")(*args)
  return tuple(outs)


def _backward(z, kernel, segment_ids, douts, streams, cfg, block_t):
  args, grid, kw = _setup(z, kernel, segment_ids, streams, cfg, block_t)
  b, t, c = z.shape
  width = kernel.shape[0]
  shapes = [jax.ShapeDtypeStruct(z.shape, z.dtype),
            jax.ShapeDtypeStruct((b, grid[1], width, c), F32)]
  ins = [_whole(x.shape) for x in args + list(douts)]
  dz, dw = call(functools.partial(_bwd_kernel, **kw), cfg=cfg, grid=grid,
                in_specs=ins, out_specs=[_whole(x.shape) for x in shapes], out_shape=shapes,
                semantics=None, name="gdn_short_conv_bwd")(*args, *douts)
  return dz, jnp.sum(dw, axis=(0, 1)).astype(kernel.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused(z, kernel, segment_ids, streams, cfg, block_t, bwd_block_t):
  return _forward(z, kernel, segment_ids, streams, cfg, block_t)


def _fused_fwd(z, kernel, segment_ids, streams, cfg, block_t, bwd_block_t):
  return _forward(z, kernel, segment_ids, streams, cfg, block_t), (z, kernel, segment_ids)


def _fused_bwd(streams, cfg, block_t, bwd_block_t, saved, douts):
  z, kernel, segment_ids = saved
  dz, dw = _backward(z, kernel, segment_ids, douts, streams, cfg, bwd_block_t)
  return dz, dw, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_short_conv(z, kernel, streams, segment_ids=None, *, cfg: Config | None = None,
                     block_t: int = 64, bwd_block_t: int = 32):
  """Each stream's activated, normalised causal convolution of z, as ``gdn_inputs`` forms them.

  z (B, T, C) in the compute dtype; kernel (W, C) (one filter per channel, cast to float32);
  streams: ``Stream``s whose heads x width add up to C, in z's channel order; segment_ids (B, T):
  no output reads a token of an earlier document. Returns one (B, T, heads, width) array per
  stream. block_t / bwd_block_t: tokens per program of the forward / backward (powers of two).
  Differentiable in z and the kernel (``jax.custom_vjp``; the backward recomputes from z).
  """
  for name, bt in (("block_t", block_t), ("bwd_block_t", bwd_block_t)):
    if bt < 1 or bt & (bt - 1):
      raise ValueError(f"{name} must be a power of two, got {bt}")
  cfg = cfg or default_config()
  outs = _fused(z, kernel, segment_ids, tuple(streams), cfg, block_t, bwd_block_t)
  return tuple(o.reshape(z.shape[:2] + (s.heads, s.width)) for o, s in zip(outs, streams))
