"""``triadic_pallas``: the Pallas kernels behind ``triadic_gdn(..., impl="pallas")``.

Pipeline (forward): ``chunk_prep`` (parallel over chunks: gc, A, P; the masks M, M' in plain JAX,
``masks.py``, or in the prep kernel: ``Config.masks_in_prep``) -> the forward state pass (chunk
loop per value block; saves chunk-start states and U, which a call without gradients does not
need: there the Mosaic forward state pass writes o and the final state only). Backward
(``jax.custom_vjp``): the reverse state pass (chunk-end state gradients and dU) -> the
chunk-parallel backward (every input gradient). Only the inputs, gc, A (float32 for the
UT-transform gradient, and a copy in the inputs' dtype for the matmuls that take it), P, U and the
chunk-start states are kept from the forward (and X = V - sum_e diag(c_e) K S_e where the Hopper
backward reads it: ``Plan.saves_x``; M and M' where its split tail reads them:
``Plan.saves_masks``); K K^T and Q K^T are recomputed, and M, M' elsewhere. What passes between
kernels in float32 is only what some float32 arithmetic reads: U, dU (with erase) and P are stored
in the inputs' dtype, since their every use is a matmul operand in it. Which kernel runs each
stage is decided in one place, ``plan.resolve`` (``explain`` shows it for given sizes).
When the state passes' programs cannot fill the GPU (B = 1 at long T), ``Config.sequence_pieces``
runs them over pieces of the sequence, each started from a short warm-up pass (``pieces.py``,
``plan.sequence_pieces``; exact to far below rounding, and only where every window decays enough).

Layout: (B, T, H, X) -> (B, H, NC, C, X) with T zero-padded to NC*C (padded tokens have k = q = v =
beta = k2 = q2 = 0 and g = 0, so they leave the state alone); the kernels see (B*H, NC, C, X).
With ``Config.token_major`` (the default; ``plan.layout`` says where it applies: the Mosaic GPU
kernels, T a multiple of C, no padding of D and V) q, k, v and o, dO, dq, dk, dv are not
relayouted: every kernel that reads or writes them takes them in the caller's (B, T, H, X)
(``heads=H``; the state passes over pieces too), and only the small per-token E-wide operands
(k2, q2, g, beta) are.
D and V are zero-padded to a power of two (Triton tensors are powers of two; zero rows/columns of
the state stay zero), E likewise.
The platform is the default backend's: Triton on GPU, Mosaic on TPU, ``interpret=True`` on CPU.
On Hopper GPUs the two state-passing kernels are Mosaic GPU (wgmma) kernels instead
(``mosaic.py``, ``Config.mosaic_gpu``, on by default there for the sizes it takes: bf16, C = 64,
D in (64, 128)), and so is the chunk-parallel backward's E-dependent part
(``mosaic_backward.py``, ``Config.mosaic_gpu_backward``). Everything else stays Triton. The tests
run both in Mosaic GPU interpret mode on the CPU, where the kernels are host callbacks and the op
skips its custom_partitioning wrapper (``_sharded``).
The platform also fixes the state-passing kernels' structure (``recurrent.py``): on Triton one
program per value block loops over whole-sequence blocks (blocks are pointers); on Mosaic TPU the
chunks are a sequential grid axis, every block one chunk, the state in VMEM scratch (blocks are
VMEM copies, so none may grow with T). On CPU the loop structure runs in interpret mode unless a
``Config("tpu", ..., interpret=True)`` asks for the TPU one (the tests run both).

Sharding: the forward (outputs and residuals) and the backward are each one custom-partitioned
function (``partition.batch_head_partitioned``) whose operands and results all keep (B, H) as
leading dims, merged to B*H only inside. Under jit with B and/or H sharded on any mesh axes, each
device then runs the kernels on its own (B/b, H/h) slice instead of gathering the global batch.
Their operands and results are passed by name; one table (``_DIMS``) gives every name its dims,
and the partitioning rules are built from it (``_signatures``, ``_Stage``). What the backward
keeps from the forward is ``Residuals``.
The ``jax.custom_vjp`` stays outside them (custom_partitioning defines no derivative).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from layers import partition
from layers.platform import default_platform
from triadic.pallas import backward as bwd_kernels
from triadic.pallas import mosaic, mosaic_backward, pieces, recurrent
from triadic.pallas import plan as plan_lib
from triadic.pallas.chunk_prep import chunk_prep
from triadic.pallas.common import F32, PLATFORMS, Config

CHUNK_SIZES = (16, 32, 64, 128)
MAX_D = 256
MASK_GRADS_KERNEL_MIN_E = 8   # the Hopper default takes ``Config.mask_grads_kernel`` from this E


def unsupported(d: int, vd: int, chunk_size: int) -> str | None:
  """Why the kernels cannot take these sizes, or None if they can."""
  if chunk_size not in CHUNK_SIZES:
    return f"chunk_size must be one of {CHUNK_SIZES} for impl='pallas', got {chunk_size}"
  if d % 16 or d > MAX_D:
    return f"q/k last dim D must be a multiple of 16 and <= {MAX_D} for impl='pallas', got {d}"
  if vd % 16:
    return f"v last dim V must be a multiple of 16 for impl='pallas', got {vd}"
  return None


def is_hopper() -> bool:
  """Whether the default device is an NVIDIA Hopper GPU (compute capability 9.x)."""
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def default_config(platform: str, e: int, vd: int, bh: int | None = None, *,
                   hopper: bool | None = None) -> Config:
  """Tile choices per platform, which also fixes the recurrent kernels' structure (``Config``).

  GPU (Triton, chunk loop inside the kernel over whole-sequence blocks): block_v 32 (16 for
  E >= 8, the state tile is E*D*block_v float32 in registers), and the prep's UT inverse by its
  one-warp kernel (``ut_kernel``; faster than the plain-JAX substitution: benchmarks/RESULTS.md).
  On Hopper: the Mosaic GPU kernels, and the state passes cut into pieces of the sequence where
  their programs (``bh`` = B*H times the value blocks) cannot fill the device
  (``sequence_pieces=0``); at E = 1, where those programs would fill at most half the device,
  64-column state blocks (``state_block_v``):
  each chunk's K, Q, A, P are then read half as often and the pieces give the programs back
  (faster at B = 1, T = 65536, slower in the forward at B = 2, T = 16384, where 32-column blocks
  fill the device: benchmarks/RESULTS.md); from E = ``MASK_GRADS_KERNEL_MIN_E`` the split
  tail's mask gradients by their kernel (``mask_grads_kernel``; faster than XLA's fusions at
  E = 8, slower at E = 4). TPU (Mosaic, chunks on the grid, one chunk per VMEM block, state in
  VMEM scratch): whole V per program (Mosaic tiles are (8, 128) or the full dimension; at
  D = V = 128, C = 64, E = 8 a program's double-buffered blocks and state scratch take about
  3.6 MiB of VMEM, whatever T). CPU (interpret mode, the GPU
  structure): 16, so that small test shapes still run several value blocks. ``hopper``: take the
  GPU's Hopper defaults or not (None: whether the default device is a Hopper GPU), so that a
  machine without one can lower them."""
  if platform not in PLATFORMS:
    raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
  if platform == "gpu":
    hopper = is_hopper() if hopper is None else hopper
    wide = (hopper and e == 1 and bh is not None and vd % 64 == 0
            and 2 * bh * (vd // 32) <= pieces.device_sms())
    return Config("gpu", block_v=16 if e >= 8 else 32, bwd_block_v=32, mosaic_gpu=hopper,
                  mosaic_gpu_backward=hopper, sequence_pieces=0 if hopper else 1,
                  state_block_v=64 if wide else None, ut_kernel=True,
                  mask_grads_kernel=hopper and e >= MASK_GRADS_KERNEL_MIN_E)
  if platform == "tpu":
    return Config("tpu", block_v=vd, bwd_block_v=vd)
  return Config("cpu", block_v=16, bwd_block_v=16)


def pow2(n: int, least: int = 1) -> int:
  return max(least, 1 << (n - 1).bit_length())


def kernel_layout(x, nc, c, width=None):
  """(B, T, H, X) -> (B, H, NC, C, X'), zero-padded in T (and in X up to width)."""
  b, t, h = x.shape[:3]
  x = x if x.ndim == 4 else x[..., None]
  pad_x = 0 if width is None else width - x.shape[-1]
  x = jnp.pad(x, ((0, 0), (0, nc * c - t), (0, 0), (0, pad_x)))
  return jnp.moveaxis(x, 2, 1).reshape(b, h, nc, c, x.shape[-1])


def _rows(x):
  return jnp.swapaxes(x, -1, -2)


def _merge(x):
  """(B, H, ...) -> (B*H, ...): the kernels' layout (a bitcast, no copy)."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _split(x, b, h):
  """(B*H, ...) -> (B, H, ...), so that every partitioned operand and result shards on B and H."""
  return x.reshape(b, h, *x.shape[1:])


class Residuals(NamedTuple):
  """What the backward keeps from the forward besides the inputs it reads back (``_READ_BACK``),
  each with leading (B, H) (shapes below after those). K K^T and Q K^T are recomputed instead,
  and so are M, M' where the plan does not keep them (``_OPTIONAL``). Field names are also the
  operand names of the partitioned functions (``_DIMS``)."""
  gc_col: jax.Array            # (NC, C, E) float32: the log decay summed within each chunk
  gc_row: jax.Array            # (NC, E, C) float32: gc transposed
  a: jax.Array                 # (NC, C, C) float32: the UT transform A (``chunk_prep``)
  p: jax.Array                 # (NC, C, C) in q's dtype: the intra-chunk read P
  a_operand: jax.Array         # (NC, C, C) in q's dtype: A as the passes' and A^T dU's operand
  u: jax.Array                 # (NC, C, V) in q's dtype: U from the forward state pass
  states: jax.Array            # (NC, E, D, V) in q's dtype: every chunk's start state
  x: jax.Array | None = None   # (NC, C, V) in q's dtype where ``Plan.saves_x``, else None
  mq: jax.Array | None = None  # (NC, C, C) float32: M' where ``Plan.saves_masks``, else None
  m: jax.Array | None = None   # (NC, C, C) float32: M likewise, with erase


# Every array operand and result of the partitioned forward and backward by name, with its dims
# in Shardy's notation; the rules (``_rule``) are built from this table and the name lists of
# ``_signatures``, and the arrays are passed by the same names. All lead with b h (B and H, which
# may be sharded on any mesh axes: ``partition.batch_head_partitioned``). Every other factor must
# be whole on every device (the recurrence runs along n and c): n the chunk axis, c the token in
# a chunk (s the second one, of A and P), d, v, e the padded D, V, E, one the size-1 axis of beta.
# ``d<name>``, a gradient or cotangent, has the dims of ``<name>``.
_DIMS = {
    # the op's inputs, in the kernel layout, and the initial state
    "q": "b h n c d", "k": "b h n c d", "v": "b h n c v", "k2": "b h n c e",
    "q2": "b h n c e", "g": "b h n c e", "beta": "b h n c one", "h0": "b h e d v",
    # its outputs: o and the final state
    "o": "b h n c v", "ht": "b h e d v",
    # the residuals (``Residuals``)
    "gc_col": "b h n c e", "gc_row": "b h n e c", "a": "b h n c s", "p": "b h n c s",
    "a_operand": "b h n c s",
    "u": "b h n c v", "states": "b h n e d v", "x": "b h n c v", "mq": "b h n c s",
    "m": "b h n c s",
}
# With ``Plan``'s token-major layout (``plan.layout``) q, k, v, o and their gradients stay in the
# caller's (B, T, H, X): t the token axis, whole on every device like n and c.
_TOKEN_MAJOR_DIMS = {"q": "b t h d", "k": "b t h d", "v": "b t h v", "o": "b t h v"}
assert all(dims.startswith("b h ") for dims in _DIMS.values())
assert set(Residuals._fields) <= set(_DIMS)
_REPLICATED = tuple(dict.fromkeys(f for table in (_DIMS, _TOKEN_MAJOR_DIMS)
                                  for dims in table.values() for f in dims.split()
                                  if f not in ("b", "h")))

_INPUTS = ("q", "k", "v", "k2", "q2", "g", "beta", "h0")   # of ``_core`` and the forward
_READ_BACK = ("q", "k", "v", "k2", "q2", "beta")           # the inputs the backward reads
_OPTIONAL = ("x", "mq", "m")   # the residuals a plan may keep or not (``_saved``), in this order


def _dims(name: str, token_major: bool = False) -> str:
  base = name if name in _DIMS else name.removeprefix("d")
  return (_TOKEN_MAJOR_DIMS if token_major and base in _TOKEN_MAJOR_DIMS else _DIMS)[base]


def _rule(operands, results, token_major: bool = False) -> str:
  """Shardy's einsum-like rule of a function of the named operands to the named results (q, k,
  v, o and their gradients token-major where ``token_major``)."""
  dims = lambda names: ", ".join(_dims(name, token_major) for name in names)
  return f"{dims(operands)} -> {dims(results)}"


def _signatures(saved: tuple[str, ...], lean: bool = False):
  """((operands, results), (operands, results)): the names, in order, of the partitioned forward
  and backward, keeping the ``saved`` ones of the optional residuals (``_OPTIONAL``, ``_saved``).
  They come last in the forward's results and in the backward's operands, so that the variants
  differ only by that tail. ``lean``: the forward of a call no backward follows
  (``_core``'s primal), whose results are o and ht alone (``saved`` empty)."""
  if lean and saved:
    raise ValueError(f"a lean forward keeps no residuals, got saved={saved!r}")
  residuals = tuple(name for name in Residuals._fields if name not in _OPTIONAL)
  forward = (_INPUTS, ("o", "ht") if lean else ("o", "ht", *residuals, *saved))
  backward = ((*_READ_BACK, *residuals, "do", "dht", *saved), tuple("d" + n for n in _INPUTS))
  return forward, backward


def _plan(cfg, q, v, k2):
  """The plan for kernel operands q, v (either layout) and k2 (BH, NC, C, E)."""
  return plan_lib.resolve(cfg, d=q.shape[-1], vd=v.shape[-1], c=k2.shape[-2], e=k2.shape[-1],
                          dtype=q.dtype)


def state_pass_kernels(cfg, q, v, k2, save_x=False, heads=None, save_drhs=False,
                       residuals=True):
  """The plan's state-passing kernels, as (forward, backward) functions of
  ``recurrent.state_pass``'s operands: ``mosaic`` (Hopper wgmma) or ``recurrent`` (Triton / TPU /
  interpret). ``save_x``: the forward also returns X after U (the Mosaic forward only: pass
  ``Plan.saves_x``); ``save_drhs``: the backward also returns A^T dU and dV after dU (the Mosaic
  reverse pass only: pass ``Plan.saves_drhs``). ``heads``: the Mosaic kernels' per-token
  operands are token-major (``plan.layout``). ``residuals=False``: the forward returns o and the
  final state only (``_core``'s primal): the Mosaic forward then writes nothing else; the
  Triton / TPU one still writes U and the chunk-start states, which are dropped."""
  if _plan(cfg, q, v, k2).mosaic_state_kernels:
    sizes = dict(d=q.shape[-1], vd=v.shape[-1], c=k2.shape[-2], e=k2.shape[-1])
    tiles = plan_lib.state_tiles(cfg, **sizes)
    kw = dict(interpret=cfg.platform == "cpu", block_v=tiles.block_v)
    if heads is not None:
      kw["heads"] = heads
    return (functools.partial(mosaic.state_pass, save_x=save_x, residuals=residuals,
                              warpgroups=tiles.forward_warpgroups, **kw),
            functools.partial(mosaic.reverse_state_pass, warpgroups=tiles.reverse_warpgroups,
                              save_drhs=save_drhs, **kw))
  forward = functools.partial(recurrent.state_pass, cfg=cfg)
  return (forward if residuals else functools.partial(_outputs_only, forward),
          functools.partial(recurrent.reverse_state_pass, cfg=cfg))


def _outputs_only(forward, *args, **kw):
  """(o, ht) of a forward state pass that also returns residuals (U, the chunk-start states)."""
  o, *_, ht = forward(*args, **kw)
  return o, ht


def sequence_pieces(cfg, q, v, k2) -> pieces.Pieces:
  """The plan's pieces of the sequence for the state passes (``plan.sequence_pieces``), on the
  kernels' (B*H, NC, C, X) operands."""
  return plan_lib.sequence_pieces(cfg, bh=k2.shape[0], nc=k2.shape[1], d=q.shape[-1],
                                  vd=v.shape[-1], c=k2.shape[-2], e=k2.shape[-1], dtype=q.dtype)


def chunk_gradients_kernel(cfg, q, v, k2, heads=None):
  """The plan's chunk-parallel backward: ``mosaic_backward`` (the slice kernel with
  ``cfg.slice_warpgroups``, ``cfg.fused_tail``, ``cfg.partials_in_bf16``,
  ``cfg.slice_unroll_max_e``, ``cfg.mask_grads_kernel``; ``heads``: token-major per-token
  operands) or ``backward.chunk_gradients``."""
  plan = _plan(cfg, q, v, k2)
  if plan.mosaic_chunk_gradients:
    return functools.partial(
        mosaic_backward.chunk_gradients, interpret=cfg.platform == "cpu",
        slice_warpgroups=mosaic_backward.slice_warpgroups(cfg.slice_warpgroups, q.shape[-1]),
        fused_tail=cfg.fused_tail, partials_in_bf16=cfg.partials_in_bf16,
        slice_unroll_max_e=cfg.slice_unroll_max_e, mask_grads_kernel=cfg.mask_grads_kernel,
        **({} if heads is None else {"heads": heads}))
  return functools.partial(bwd_kernels.chunk_gradients, cfg=cfg)


def _forward(scale, erase, cfg, heads, *, saved, q, k, v, k2, q2, g, beta, h0, lean=False):
  """Forward kernels on (B, H, NC, C, X) operands and h0 (B, H, E, D, V), or with ``heads`` q,
  k, v in the caller's (B, T, H, X) (``plan.layout``): chunk prep, then the forward state pass
  (over pieces of the sequence where the plan says). Returns o (in q's layout), the final state
  ht and the ``Residuals`` fields by name, all with leading (B, H); of the optional ones
  (``_OPTIONAL``) only the ``saved`` ones. ``lean`` (a call no backward follows,
  ``_core``'s primal): o and ht alone, by a forward state pass that writes nothing else."""
  b, h = k2.shape[:2]
  tok = _merge if heads is None else (lambda x: x)      # the per-token operands' layout
  q, k, v, k2, q2, g, beta, h0 = (tok(q), tok(k), tok(v), *map(_merge, (k2, q2, g, beta, h0)))
  prep = chunk_prep(q, k, k2_col=k2, q2_col=q2, g_col=g, beta_col=beta, erase=erase, cfg=cfg,
                    heads=heads, masks_in_kernel=_plan(cfg, q, v, k2).masks_in_prep)
  forward = state_pass_kernels(cfg, q, v, k2, save_x="x" in saved, heads=heads,
                               residuals=not lean)[0]
  outs = pieces.state_pass(
      forward, sequence_pieces(cfg, q, v, k2), q=q, k=k, v=v, k2=k2, q2=q2, gc=prep.gc_col,
      beta=beta, a=prep.a_operand, p=prep.p, h0=h0, g=g, scale=scale, erase=erase, heads=heads)
  if lean:
    o, ht = outs
    return {"o": o if heads is not None else _split(o, b, h), "ht": _split(ht, b, h)}
  o, u, *x, states, ht = outs
  kept = dict(x=x[0] if x else None, mq=prep.mq, m=prep.m)
  residuals = Residuals(**prep._asdict() | {name: kept[name] if name in saved else None
                                             for name in _OPTIONAL}, u=u, states=states)
  o = o if heads is not None else _split(o, b, h)
  return {"o": o, **{name: None if y is None else _split(y, b, h)
                     for name, y in dict(ht=ht, **residuals._asdict()).items()}}


def _backward(scale, erase, cfg, heads, *, q, k, v, k2, q2, beta, gc_col, gc_row, a, p,
              a_operand, u, states, do, dht, x=None, mq=None, m=None):
  """Backward kernels on the inputs read back, the ``Residuals`` fields and the cotangents (do,
  dht), all with leading (B, H), or with ``heads`` q, k, v and do in the caller's (B, T, H, X):
  the reverse state pass (chunk-end state gradients and dU), then the chunk-parallel backward.
  Returns the gradients ``d<input>`` of the eight ``_forward`` inputs by name, in their dtypes
  and layouts."""
  b, h = k2.shape[:2]
  dtypes = (q.dtype, k.dtype, v.dtype, k2.dtype, q2.dtype, beta.dtype)
  tok = _merge if heads is None else (lambda x: x)      # the per-token operands' layout
  q, k, v = map(tok, (q, k, v))
  k2, q2, beta, gc_col, gc_row, a, p, a_operand, u, states = map(
      _merge, (k2, q2, beta, gc_col, gc_row, a, p, a_operand, u, states))
  do, dht = tok(do), _merge(dht)
  # Only the Mosaic chunk-parallel backward takes X (``Plan.saves_x``), the masks
  # (``Plan.saves_masks``), A's operand copy and A^T dU, dV from the reverse pass
  # (``Plan.saves_drhs``).
  mosaic_only = {name: _merge(y) for name, y in dict(x=x, mq=mq, m=m).items() if y is not None}
  plan = _plan(cfg, q, v, k2)
  if plan.mosaic_chunk_gradients:
    mosaic_only["a_operand"] = a_operand
  save_drhs = plan.saves_drhs(erase)
  backward = state_pass_kernels(cfg, q, do, k2, heads=heads, save_drhs=save_drhs)[1]
  g = gc_col - jnp.pad(gc_col[:, :, :-1], ((0, 0), (0, 0), (1, 0), (0, 0)))  # per-token decay
  du, *rhs_grads, dstates, dh0 = pieces.reverse_state_pass(
      backward, sequence_pieces(cfg, q, do, k2), q=q, k=k, do=do.astype(q.dtype), k2=k2, q2=q2,
      gc=gc_col, beta=beta, a=a_operand, p=p, dht=dht.astype(F32), g=g, scale=scale,
      erase=erase, heads=heads, token_outputs=(2,) if save_drhs else ())
  if save_drhs:
    mosaic_only["drhs"], mosaic_only["dv"] = rhs_grads
  chunk_gradients = chunk_gradients_kernel(cfg, q, v, k2, heads=heads)
  dq, dk, dv, dk2, dq2, dgc, dbeta = chunk_gradients(
      q=q, k=k, v=v, do=do, u=u, du=du, states=states, dstates=dstates, k2_col=k2,
      k2_row=_rows(k2), q2_col=q2, gc_col=gc_col, gc_row=gc_row, beta_col=beta, a=a,
      **mosaic_only, scale=scale, erase=erase)
  dg = jnp.flip(jnp.cumsum(jnp.flip(dgc, 2), axis=2), 2)  # gc is a cumsum over the chunk axis
  dq, dk, dv, dk2, dq2, dbeta = (y.astype(dt) for y, dt in zip((dq, dk, dv, dk2, dq2, dbeta),
                                                                 dtypes))
  per_token = {"dq": dq, "dk": dk, "dv": dv}
  if heads is None:
    per_token = {name: _split(y, b, h) for name, y in per_token.items()}
  rest = {"dk2": dk2, "dq2": dq2, "dg": dg, "dbeta": dbeta, "dh0": dh0}
  return {**per_token, **{name: _split(y, b, h) for name, y in rest.items()}}


class _Stage:
  """``fn(scale, erase, cfg, heads, **arrays)`` -> arrays by name, as custom_partitioning sees
  it: flat operands and results in the order of the ``operands`` and ``results`` names, and the
  Shardy rule built from the same names (``_rule``; q, k, v, o and their gradients token-major
  where ``token_major``, i.e. the stage is called with ``heads``). Called with the operands by
  name, it returns the results by name; ``partitioned=False`` runs the flat function as it is."""

  def __init__(self, fn, operands, results, *, partitioned: bool, token_major: bool):
    self.operands, self.results, self.token_major = operands, results, token_major
    self.rule = _rule(operands, results, token_major)

    def flat(scale, erase, cfg, heads, *arrays):
      out = fn(scale, erase, cfg, heads, **dict(zip(operands, arrays, strict=True)))
      out = {name: y for name, y in out.items() if y is not None}
      if set(out) != set(results):
        raise AssertionError(f"{fn} returned {sorted(out)}, its rule names {sorted(results)}")
      return tuple(out[name] for name in results)

    self._flat = (partition.batch_head_partitioned(flat, n_static=4, rule=self.rule,
                                                   replicated=_REPLICATED)
                  if partitioned else flat)

  def __call__(self, scale, erase, cfg, heads, **arrays) -> dict:
    if set(arrays) != set(self.operands):
      raise TypeError(f"operands {sorted(arrays)}, expected {sorted(self.operands)}")
    if (heads is not None) != self.token_major:
      raise TypeError(f"heads={heads!r} for a stage with token_major={self.token_major}")
    out = self._flat(scale, erase, cfg, heads, *(arrays[name] for name in self.operands))
    return dict(zip(self.results, out, strict=True))


@functools.cache
def _make_stages(saved: tuple[str, ...], partitioned: bool, token_major: bool, lean: bool = False
                 ) -> tuple[_Stage, _Stage]:
  (fwd_operands, fwd_results), (bwd_operands, bwd_results) = _signatures(saved, lean)
  kw = dict(partitioned=partitioned, token_major=token_major)
  return (_Stage(functools.partial(_forward, saved=saved, lean=lean), fwd_operands, fwd_results,
                 **kw),
          _Stage(_backward, bwd_operands, bwd_results, **kw))


def _stages(cfg, saved: tuple[str, ...], heads, lean: bool = False) -> tuple[_Stage, _Stage]:
  """The forward and backward, the forward keeping the ``saved`` optional residuals
  (``_saved``), or with ``lean`` none at all (o and ht only: ``_core``'s primal), token-major
  or not (``heads``): custom-partitioned (their rules with those results), or the plain
  functions when the kernels run as host callbacks (Mosaic GPU interpret mode on a CPU), which
  custom_partitioning cannot lower. On one device the two compile to the same program."""
  host_callbacks = (cfg.mosaic_gpu or cfg.mosaic_gpu_backward) and cfg.platform == "cpu"
  return _make_stages(saved, not host_callbacks, heads is not None, lean)


def _saved(cfg, q, v, k2, erase) -> tuple[str, ...]:
  """The optional residuals (``_OPTIONAL``) the plan keeps for the (B, H, NC, C, X) operands: X
  (``Plan.saves_x``), M' and, with erase, M (``Plan.saves_masks``)."""
  plan = _plan(cfg, q, v, k2)
  masks = ("mq", "m") if erase else ("mq",)
  return ("x",) * plan.saves_x(erase) + masks * plan.saves_masks


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _core(q, k, v, k2, q2, g, beta, h0, scale, erase, cfg, heads):
  # Not differentiated: nothing needs any residual (the forward state pass writes o and ht only).
  out = _stages(cfg, (), heads, lean=True)[0](scale, erase, cfg, heads, q=q, k=k, v=v, k2=k2,
                                              q2=q2, g=g, beta=beta, h0=h0)
  return out["o"], out["ht"]


def _core_fwd(q, k, v, k2, q2, g, beta, h0, scale, erase, cfg, heads):
  """(o, ht) and, for ``_core_bwd``, the inputs it reads back by name and the ``Residuals``."""
  forward = _stages(cfg, _saved(cfg, q, v, k2, erase), heads)[0]
  out = forward(scale, erase, cfg, heads, q=q, k=k, v=v, k2=k2, q2=q2, g=g, beta=beta, h0=h0)
  read_back = {"q": q, "k": k, "v": v, "k2": k2, "q2": q2, "beta": beta}
  residuals = Residuals(**{name: out.get(name) for name in Residuals._fields})
  return (out["o"], out["ht"]), (read_back, residuals)


def _core_bwd(scale, erase, cfg, heads, saved, cotangents):
  """The gradients of ``_core``'s eight array inputs, in its order, by the backward that takes
  the optional residuals the forward saved."""
  read_back, residuals = saved
  do, dht = cotangents
  backward = _stages(cfg, tuple(n for n in _OPTIONAL if getattr(residuals, n) is not None),
                     heads)[1]
  arrays = {name: y for name, y in residuals._asdict().items() if y is not None}
  grads = backward(scale, erase, cfg, heads, **read_back, **arrays, do=do, dht=dht)
  return tuple(grads["d" + name] for name in _INPUTS)


_core.defvjp(_core_fwd, _core_bwd)


def explain(d: int, vd: int, e: int, chunk_size: int, dtype, *, platform: str | None = None,
            config: Config | None = None, bh: int | None = None) -> plan_lib.Plan:
  """The kernel plan ``triadic_pallas`` follows for these sizes (before padding) and input
  dtype: per stage the backend, tiles and reason (``plan.resolve``); ``bh`` (B*H) where the
  default config depends on it (``default_config``). Raises ValueError for sizes the kernels
  cannot take."""
  reason = unsupported(d, vd, chunk_size)
  if reason:
    raise ValueError(reason)
  dp, vp, ep = pow2(d, 16), pow2(vd, 16), pow2(e)
  cfg = config or default_config(platform or default_platform(), ep, vp, bh=bh)
  return plan_lib.resolve(cfg, d=dp, vd=vp, c=chunk_size, e=ep, dtype=dtype)


def explain_layout(b: int, t: int, h: int, d: int, vd: int, e: int, chunk_size: int, dtype, *,
                   platform: str | None = None, config: Config | None = None) -> plan_lib.Layout:
  """Where ``triadic_pallas`` keeps the per-token operands of a (B, T, H, .) call: the caller's
  layout read in place, or the (B*H, NC, C, X) relayout, with the reason (``plan.layout``)."""
  return _layout(b, t, h, d, vd, e, chunk_size, dtype, platform, config)[0]


def _layout(b, t, h, d, vd, e, c, dtype, platform, config):
  """(``plan.Layout``, the Config) of a call: ``explain_layout``."""
  reason = unsupported(d, vd, c)
  if reason:
    raise ValueError(reason)
  dp, vp, ep = pow2(d, 16), pow2(vd, 16), pow2(e)
  cfg = config or default_config(platform or default_platform(), ep, vp, bh=b * h)
  plan = plan_lib.resolve(cfg, d=dp, vd=vp, c=c, e=ep, dtype=dtype)
  return plan_lib.layout(cfg, plan, t=t, c=c, d=d, vd=vd, padded_d=dp, padded_vd=vp), cfg


def triadic_pallas(q, k, v, k2, q2, g, beta, *, scale: float, initial_state: jax.Array,
                   erase: bool, chunk_size: int, platform: str | None = None,
                   config: Config | None = None):
  """Triadic gated delta rule by Pallas kernels. Shapes and result as ``triadic.triadic_gdn``.

  platform: "gpu", "tpu" or "cpu" (interpret); default from ``jax.default_backend()``. Passing it
  explicitly lets a CPU machine lower the GPU or TPU kernels. Raises ValueError for sizes the
  kernels cannot take (``unsupported``). q, k, v stay in their (B, T, H, X) layout where
  ``explain_layout`` says so (``Config.token_major``), else they are relayouted for the kernels.
  """
  b, t, h, d = q.shape
  vd, e = v.shape[-1], k2.shape[-1]
  dtype = q.dtype
  c = chunk_size
  layout, cfg = _layout(b, t, h, d, vd, e, c, dtype, platform, config)
  dp, vp, ep = pow2(d, 16), pow2(vd, 16), pow2(e)
  nc = -(-t // c)
  ch = functools.partial(kernel_layout, nc=nc, c=c)
  pad_state = ((0, 0), (0, 0), (0, ep - e), (0, dp - d), (0, vp - vd))
  h0 = jnp.pad(initial_state.astype(F32), pad_state)
  if layout.token_major:
    heads, qkv = h, (q, k.astype(dtype), v.astype(dtype))
  else:
    heads, qkv = None, (ch(q, width=dp), ch(k.astype(dtype), width=dp),
                        ch(v.astype(dtype), width=vp))
  o, ht = _core(*qkv, ch(k2.astype(F32), width=ep), ch(q2.astype(F32), width=ep),
                ch(g.astype(F32), width=ep), ch(beta.astype(F32)), h0, float(scale), bool(erase),
                cfg, heads)
  ht = ht[:, :, :e, :d, :vd]
  if layout.token_major:
    return o, ht
  o = o.reshape(b, h, nc * c, vp)[:, :, :t, :vd]
  return jnp.moveaxis(o, 1, 2), ht
