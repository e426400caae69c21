"""Hopper (Mosaic GPU) state-passing kernels: drop-in replacements for ``recurrent.state_pass`` and
``recurrent.reverse_state_pass`` (same operands, same outputs), for bf16 inputs.

Why this structure. The Triton kernel keeps E separate D x BV float32 state tiles and does 3E
small matmuls (N = BV = 16..32) per chunk, so its cost grows with E. Here one program
(grid (B*H, V / BV), one warpgroup) holds all E slices of its D x BV state tile side by side as
ONE D x (E*BV) float32 array in the WGMMA register layout, "S_cat" (column block e = S_e[:, value
block]). Every E-dependent matmul is then one wgmma with N = E*BV (128 or 256 at E = 8), and
E = 1 vs E = 8 differ mostly in the width of those wgmmas. Per chunk (C = 64 tokens), with the
per-row factors fe = beta k2 a, fq = q2 a, fw = k2 b (a = exp(gc), b = exp(gc_C - gc)) and
lam = exp(gc_C) precomputed in plain JAX (O(T E), ``_factors``):

  forward   R = K S_cat,  Y = Q S_cat                            (C x D) @ (D x E*BV)
            rhs = beta V - sum_e diag(fe_e) R[:, e]              (beta V without erase)
            U = A rhs;  o = scale (sum_e diag(fq_e) Y[:, e] + P U)
            S_cat <- lam_cat * S_cat + K^T [diag(fw_e) U]_e      (D x C) @ (C x E*BV)
  backward  dU = scale P^T dO + sum_e diag(fw_e) (K dS_cat)[:, e]
            dS_cat <- lam_cat * dS_cat + Q^T [scale diag(fq_e) dO]_e - K^T [diag(fe_e) A^T dU]_e

How the pieces are done, and why (what the CPU interpreter and the Mosaic GPU lowering accept):

* Every wgmma operand is in SMEM (the interpreter takes no register operand), bf16, f32
  accumulation, the accumulator a scoped ``plgpu.ACC``. Both operands of one wgmma must share a
  swizzle (a lowering rule): K, Q and S_cat use the swizzle of an E*BV-wide bf16 row ("swizzle N");
  A, P, rhs, U, K^T, Q^T and the [.]_e operands use the swizzle of a BV-wide row ("swizzle V"),
  so that the [.]_e operands are written one BV-wide column block at a time, each block a whole
  column of SMEM tiles.
* No transposed SMEM operand: the interpreter cannot apply ``plgpu.transpose_ref``. K^T, Q^T, A^T
  and P^T therefore come pre-transposed from plain JAX (and A, P are cast to bf16 there, as
  ``recurrent.mm`` casts them anyway). On hardware ``transpose_ref`` would save reading K (and Q in
  the backward) twice.
* The e-reduction (sum over column blocks) is done in registers: static column slices of the
  WGMMA-layout accumulator (BV a multiple of 8), each scaled by a row vector (layout WGMMA row,
  i.e. ``Layout.WGMMA.reduce(1)``) broadcast along the columns. lam is a per-column vector
  (``Layout.WGMMA.reduce(0)``) repeated BV times per block.
* The state update: on hardware, ``pl.run_state`` with ``plgpu.ACC.init(lam * S)`` accumulates
  K^T W into the carried state's own registers. The interpreter runs no ``run_state`` and no store
  into an accumulator, so interpret mode computes K^T W in a fresh accumulator and adds it (same
  values). Likewise ``plgpu.layout_cast`` is skipped in interpret mode (it has no CPU rule).
* One warpgroup. Each chunk input has its own SMEM buffer and barrier (``_Inputs``), and every
  input is waited for where it is first read, not all at the chunk's top. The forward pass
  starts its copies one chunk ahead: chunk n + 1's copy of an input starts as soon as every warp
  is done with chunk n's (after the ``commit_smem`` that follows its last reader: K after R, A
  after U, Q and P after the output, V after rhs, lam after the decay), so each wait finds its
  data landed; K^T is read only by the state update at the chunk's end, so its copy starts at
  the chunk's top; the row factors are read until the chunk's end and needed again at its start,
  so they have two buffers (the loop step's parity); without erase K and A are not loaded. The
  reverse pass starts its copies at each chunk's top (Q^T, K^T, read only by its final state
  update, after the others), which measured as fast or faster than starting them a chunk ahead
  (benchmarks/RESULTS.md). No warp specialisation. Outputs leave by TMA smem -> gmem. Ordering
  rules kept by hand (the interpreter does not check them): ``commit_smem`` (fence + warpgroup
  barrier) after every register -> SMEM store that a wgmma or TMA reads, and between a buffer's
  last reader and the copy that refills it; ``wgmma_wait(0)`` before the copies that refill
  what the previous state update read; ``wait_smem_to_gmem(0, wait_read_only=True)`` (also a
  warpgroup barrier) before the per-chunk output buffers are rewritten; no copy is in flight
  when the loop's SMEM scope ends (the next-chunk copies are under ``pl.when``).
* SMEM scopes: the chunk loop's buffers live in one ``run_scoped``; the (D, E*BV) float32 buffer
  for the initial / final state in separate scopes before and after it (together they exceed the
  227 KiB at D = 64, E*BV = 256).
* Registers: the state is D * E * BV / 128 float32 registers per thread, plus a C x E*BV
  accumulator while R or Y is reduced. ``default_block_v`` keeps (D + C) * E * BV <= 192 * 128
  (BV = 32 below E = 4 at D = 64...). D = 128 with E * BV = 256 would need the state split over
  two warpgroups (M = D = 2 x 64), which these kernels do not do (``supported`` says so).
* The initial / final state is moved once per program in the "cat" layout (BH, V/BV, D, E*BV),
  rearranged in plain JAX (state-sized, once); the per-chunk states are written directly in
  recurrent.py's (BH, NC, E, D, V) layout from an (E, D, BV) SMEM buffer.
* float32 inputs are not supported (use the Triton path): wgmma on float32 would be TF32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
BF16 = jnp.bfloat16
BLOCK_VS = (16, 32, 64)
MAX_N = 256                 # wgmma N limit: E * BV
REG_BUDGET = 192 * 128      # (D + C) * E * BV: default block_v choice (state + one C x E*BV acc)
STATE_BUDGET = 128 * 128    # D * E * BV: hard limit, the state alone at 128 registers a thread
CAT_BARRIER = 9             # barriers 0..8: the chunk inputs (the factors take two); 9: h0 / dht


def _interpret_params(interpret):
  """``interpret=True`` means Mosaic GPU interpret mode (simulated SMEM, TMA, barriers)."""
  if interpret is True:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
  return interpret


def interpret_available() -> bool:
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: F401
  except ImportError:
    return False
  return True


def sizes_reason(d: int, vd: int, c: int, e: int, dtype, bv: int | None, block_vs,
                 what: str) -> str | None:
  """The checks every Mosaic GPU kernel here shares (dtype, chunk, D, value block, wgmma N), or
  None. ``what`` names the kernel in the message."""
  if jnp.dtype(dtype) != jnp.dtype(BF16):
    return (f"{what} take bfloat16 inputs only (wgmma on float32 would be TF32; use the Triton "
            f"path), got {jnp.dtype(dtype).name}")
  if c != 64:
    return f"{what} need chunk size 64, got {c}"
  if d not in (64, 128):
    return f"{what} need D in (64, 128), got {d}"
  if bv is None:
    return f"{what}: no value block in {block_vs} divides V={vd} and fits on chip at D={d}, E={e}"
  if bv not in block_vs or vd % bv:
    return f"V={vd} must be a multiple of block_v={bv} in {block_vs}"
  if e * bv > MAX_N:
    return f"E * block_v must be <= {MAX_N}, got {e} * {bv}"
  return None


def supported(d: int, vd: int, c: int, e: int, dtype, block_v: int | None = None) -> str | None:
  """Why these kernels cannot take these sizes, or None if they can."""
  bv = block_v or default_block_v(d, vd, c, e)
  reason = sizes_reason(d, vd, c, e, dtype, bv, BLOCK_VS, "the Mosaic GPU state kernels")
  if reason:
    return reason
  if (e * bv) % 32:
    return f"E * block_v must be a multiple of 32 (a warpgroup-wide load of lam), got {e} * {bv}"
  if d * e * bv > STATE_BUDGET:
    return (f"D * E * block_v = {d * e * bv} > {STATE_BUDGET}: the state would not fit one "
            "warpgroup's registers (two warpgroups not implemented)")
  return None


def default_block_v(d: int, vd: int, c: int, e: int) -> int | None:
  """The widest BV in (32, 16) dividing V with E * BV <= 256, a multiple of 32, and the state plus
  one C x E*BV accumulator within REG_BUDGET floats (the rest of the register file for temps)."""
  for bv in (32, 16):
    if (vd % bv == 0 and e * bv <= MAX_N and (e * bv) % 32 == 0
        and (d + c) * e * bv <= REG_BUDGET):
      return bv
  return None


# ------------------------------------------------------------------------------------------------
# Plain-JAX preparation (O(T E) work, plus transposed / bf16 copies of K, Q, A, P).


def _factors(gc_col, k2_col, q2_col, beta_col):
  """Per-row factors as (BH, NC, 3E + 1, C) float32 rows [fe (E), fq (E), fw (E), beta] and the
  per-chunk decay lam (BH, NC, E)."""
  a = jnp.exp(gc_col)
  gl = gc_col[:, :, -1:, :]
  b = jnp.exp(gl - gc_col)
  beta = beta_col.astype(F32)
  fe = beta * k2_col * a
  fq = q2_col * a
  fw = k2_col * b
  rows = jnp.concatenate([fe, fq, fw, beta], axis=-1)          # (BH, NC, C, 3E + 1)
  return jnp.swapaxes(rows, -1, -2), jnp.exp(gl[:, :, 0, :])


def _lam_cat(lam, bv):
  """(BH, NC, E) -> (BH, NC, E * BV): lam_e repeated over its column block."""
  return jnp.repeat(lam, bv, axis=-1)


def _to_cat(x, bv):
  """(BH, E, D, V) -> (BH, V / BV, D, E * BV): column block e of value block j is x[:, e, :, j]."""
  bh, e, d, vd = x.shape
  x = x.reshape(bh, e, d, vd // bv, bv)
  return jnp.transpose(x, (0, 3, 2, 1, 4)).reshape(bh, vd // bv, d, e * bv)


def _from_cat(x, e):
  bh, nv, d, n = x.shape
  bv = n // e
  x = x.reshape(bh, nv, d, e, bv)
  return jnp.transpose(x, (0, 3, 2, 1, 4)).reshape(bh, e, d, nv * bv)


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def _prologue(q, vd, k2_col, q2_col, gc_col, beta_col, block_v):
  """Shapes, the checked value block and the row factors: (bh, nc, c, d, e, bv, f, lam_cat)."""
  bh, nc, c, d = q.shape
  e_dim = k2_col.shape[-1]
  bv = block_v or default_block_v(d, vd, c, e_dim)
  reason = supported(d, vd, c, e_dim, q.dtype, bv)
  if reason:
    raise ValueError(reason)
  f, lam = _factors(gc_col, k2_col, q2_col, beta_col)
  return bh, nc, c, d, e_dim, bv, f, _lam_cat(lam, bv)


# ------------------------------------------------------------------------------------------------
# Kernel helpers.


def _smem(shape, dtype, swizzle=None):
  if swizzle is None:
    return plgpu.SMEM(shape, dtype)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)),
                                              plgpu.SwizzleTransform(swizzle)))


def _swizzle(cols, dtype=BF16):
  return plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)


class _Ops:
  """Layout casts, matmuls and row / column broadcasts, with the interpret-mode substitutes."""

  def __init__(self, interpret):
    self.interpret = bool(interpret)

  def cast(self, x, layout):
    return x if self.interpret else plgpu.layout_cast(x, layout)

  def acc(self, x):
    return self.cast(x, plgpu.Layout.WGMMA)

  def rowvec(self, ref, idx, cols):
    """Row factor ref[idx] (length M) broadcast to (M, cols) in the WGMMA layout."""
    vec = self.cast(ref[idx], plgpu.Layout.WGMMA.reduce(1))
    return lax.broadcast_in_dim(vec, (vec.shape[0], cols), [0])

  def colvec(self, ref, rows):
    """Column factor ref[...] (length N) broadcast to (rows, N) in the WGMMA layout."""
    vec = self.cast(ref[...], plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(vec, (rows, vec.shape[0]), [1])

  def mm(self, a_ref, b_ref):
    """a @ b, float32 accumulation, both operands SMEM refs."""
    m, n = a_ref.shape[0], b_ref.shape[1]

    def body(acc):
      plgpu.wgmma(acc, a_ref, b_ref)
      return acc[...]

    return pl.run_scoped(body, plgpu.ACC((m, n), F32))

  def mm_add(self, init, pairs):
    """init + sum of a @ b over (a_ref, b_ref) pairs. On hardware the wgmmas accumulate into
    init's registers (``run_state`` with ``ACC.init``); the interpreter has neither, so there a
    fresh accumulator is added."""
    if self.interpret:
      m, n = init.shape

      def body(acc):
        for a_ref, b_ref in pairs:
          plgpu.wgmma(acc, a_ref, b_ref)
        return acc[...]

      return init + pl.run_scoped(body, plgpu.ACC((m, n), F32))

    def body(acc):
      for a_ref, b_ref in pairs:
        plgpu.wgmma(acc, a_ref, b_ref)

    return pl.run_state(body)(plgpu.ACC.init(self.acc(init)))


def _load(pairs, bars, first=0):
  """Start the TMA copies (src gmem ref, dst smem ref), one barrier each from slot ``first``."""
  for slot, (src, dst) in enumerate(pairs, first):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[slot])


def _wait(n, bars, first=0):
  for slot in range(first, first + n):
    plgpu.barrier_wait(bars.at[slot])


def _store_blocks(x, ref, e_dim, bv, dtype):
  """ref[e] = x[:, e-th column block] for each e (ref (E, rows, BV))."""
  for e in range(e_dim):
    ref[e] = x[:, e * bv:(e + 1) * bv].astype(dtype)


class _Inputs:
  """A state pass's per-chunk inputs: each a TMA copy gmem -> its own SMEM buffer, with its own
  barrier, so that each is waited for where it is first read. ``start`` begins a loop step's
  copies, ``start_next`` the next step's (the forward pass: into the buffer its last reader has
  just released). ``copies`` maps a name to (chunk -> gmem ref, smem ref, barrier slot); a name in
  ``double`` has two SMEM buffers and two barriers (slots b, b + 1), picked by the parity of the
  loop step, for inputs that are read until the chunk's end and needed again at its start.

  ``order(step)`` is the chunk that loop step ``step`` works on (reversed in the backward pass).
  Each barrier has at most one copy in flight and is waited once per copy, in issue order."""

  def __init__(self, bars, copies, *, order, nc, double=()):
    self.bars, self.copies, self.double, self.order, self.nc = bars, copies, double, order, nc

  @classmethod
  def of(cls, bars, inputs, *, row, cols, value, **kw):
    """From (name, gmem ref, smem ref) triples, barrier slots in their order (two for a ``double``
    one): every input is copied whole per chunk of its (BH, NC, ...) ref at ``row``, except
    ``value``, whose value block ``cols`` is copied."""
    copies, slot = {}, 0
    for name, gmem, smem in inputs:
      if name == value:
        src = lambda n, g=gmem: g.at[row, n, :, cols]
      else:
        src = lambda n, g=gmem: g.at[row, n]
      copies[name] = (src, smem, slot)
      slot += 2 if name in kw.get("double", ()) else 1
    return cls(bars, copies, **kw)

  def _slot(self, name, step):
    src, dst, bar = self.copies[name]
    if name in self.double:
      parity = step % 2
      return src, dst.at[parity], bar + parity
    return src, dst, bar

  def ref(self, name, step):
    return self._slot(name, step)[1]

  def start(self, names, step):
    for name in names:
      src, dst, bar = self._slot(name, step)
      plgpu.copy_gmem_to_smem(src(self.order(step)), dst, self.bars.at[bar])

  def start_next(self, names, step):
    """Start step + 1's copies of ``names`` (none after the last step). Every thread must be done
    with the buffers (a ``commit_smem``, i.e. a warpgroup barrier, after their last reads)."""
    @pl.when(step + 1 < self.nc)
    def _():
      self.start(names, step + 1)

  def wait(self, name, step):
    plgpu.barrier_wait(self.bars.at[self._slot(name, step)[2]])


def _begin_chunk(carry, carry_s, out_s):
  """Write the carried (D, E*BV) state as the chunk's bf16 wgmma operand (``carry_s``) and into
  the per-chunk output buffer ``out_s`` (E, D, BV), which ``_publish_chunk`` stores after the next
  ``commit_smem``. The previous chunk's TMA stores must have read the output buffers (waited
  here), and its last wgmma (the state update, which read ``carry_s``) must be complete: the
  caller's ``plgpu.wgmma_wait(0)``, which also frees the buffers that update read."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  carry_s[...] = carry.astype(BF16)
  e_dim, _, bv = out_s.shape
  _store_blocks(carry, out_s, e_dim, bv, out_s.dtype)


def _publish_chunk(out_s, out_at):
  """Start the TMA stores of the per-chunk state output (after a ``commit_smem``)."""
  for e in range(out_s.shape[0]):
    plgpu.copy_smem_to_gmem(out_s.at[e], out_at(e))


def _load_cat(ops, src, cat, barrier):
  """The carried (D, E*BV) float32 state from gmem, through a scoped SMEM buffer."""
  def body(cat_s):
    plgpu.copy_gmem_to_smem(src, cat_s, barrier)
    plgpu.barrier_wait(barrier)
    return ops.acc(cat_s[...])
  return pl.run_scoped(body, cat)


def _store_cat(x, dst, cat):
  def body(cat_s):
    cat_s[...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(cat_s, dst)
    plgpu.wait_smem_to_gmem(0)
  pl.run_scoped(body, cat)


def _chunk_loop(chunk, nc, init, scratch, prologue):
  """fori_loop over the chunks inside one SMEM scope (``scratch``), after ``prologue(*refs)`` (the
  first chunk's copies); the scope is released before the final state's buffer is allocated (the
  two do not fit together at D * E * BV = 64 * 256)."""
  def body(*refs):
    prologue(*refs)
    out = lax.fori_loop(0, nc, lambda n, s: chunk(n, s, *refs), init)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    return out
  return pl.run_scoped(body, *scratch)


def _compiler_params():
  return plgpu.CompilerParams()


# ------------------------------------------------------------------------------------------------
# Forward.


def _forward_kernel(q_g, k_g, kt_g, v_g, a_g, p_g, f_g, lam_g, h0_g, *outs_and_bars, scratch,
                    cat, nc, e_dim, bv, scale, erase, save_x, interpret):
  if save_x:
    o_g, u_g, x_g, st_g, ht_g, bars = outs_and_bars
  else:
    o_g, u_g, st_g, ht_g, bars = outs_and_bars
  ops = _Ops(interpret)
  i, j = lax.axis_index("bh"), lax.axis_index("v")
  cols = pl.ds(j * bv, bv)
  erase_rows, read_rows, write_rows, beta_row = 0, e_dim, 2 * e_dim, 3 * e_dim
  x_rows = 3 * e_dim + 1              # save_x: c = k2 a (E rows) after beta
  state0 = _load_cat(ops, h0_g.at[i, j], cat, bars.at[CAT_BARRIER])

  def copies(q_s, k_s, kt_s, v_s, a_s, p_s, f_s, lam_s):
    return _Inputs.of(bars, [("q", q_g, q_s), ("k", k_g, k_s), ("kt", kt_g, kt_s), ("v", v_g, v_s),
                             ("a", a_g, a_s), ("p", p_g, p_s), ("lam", lam_g, lam_s),
                             ("f", f_g, f_s)],
                      row=i, cols=cols, value="v", double=("f",), order=lambda n: n, nc=nc)

  # K and A only enter through the erase term.
  first = ("q", "k", "v", "a", "p", "lam", "f") if erase else ("q", "v", "p", "lam", "f")

  def prologue(*refs):
    copies(*refs[:8]).start(first, 0)

  def chunk(n, s, q_s, k_s, kt_s, v_s, a_s, p_s, f2_s, lam_s, state_bf16_s, w_s, rhs_bf16_s,
            u_bf16_s, o_s, u_s, st_s, *x_out):
    ins = copies(q_s, k_s, kt_s, v_s, a_s, p_s, f2_s, lam_s)
    f_s = ins.ref("f", n)
    d = q_s.shape[1]
    plgpu.wgmma_wait(0)                   # the previous state update has read S_cat, K^T
    _begin_chunk(s, state_bf16_s, st_s)
    ins.wait("lam", n)
    decayed = ops.colvec(lam_s, d) * s
    plgpu.commit_smem()
    _publish_chunk(st_s, lambda e: st_g.at[i, n, e, :, cols])
    ins.start_next(("lam",), n)
    ins.start(("kt",), n)                 # read only by the state update at the chunk's end

    ins.wait("f", n)
    ins.wait("v", n)
    beta = ops.rowvec(f_s, beta_row, bv)
    if erase:
      ins.wait("k", n)
      r = ops.mm(k_s, state_bf16_s)
      if save_x:
        # X = V - sum_e diag(c_e) R_e, which the chunk-parallel backward reads; rhs = beta X.
        x = ops.acc(v_s[...].astype(F32))
        for e in range(e_dim):
          x = x - ops.rowvec(f_s, x_rows + e, bv) * r[:, e * bv:(e + 1) * bv]
        x_out[0][...] = x.astype(x_out[0].dtype)
        rhs = beta * x
      else:
        rhs = beta * ops.acc(v_s[...].astype(F32))
        for e in range(e_dim):
          rhs = rhs - ops.rowvec(f_s, erase_rows + e, bv) * r[:, e * bv:(e + 1) * bv]
      rhs_bf16_s[...] = rhs.astype(BF16)
      plgpu.commit_smem()
      ins.start_next(("k", "v"), n)
      if save_x:
        plgpu.copy_smem_to_gmem(x_out[0], x_g.at[i, n, :, cols])
      ins.wait("a", n)
      u = ops.mm(a_s, rhs_bf16_s)
    else:
      u = beta * ops.acc(v_s[...].astype(F32))
    u_s[...] = u
    u_bf16_s[...] = u.astype(BF16)
    for e in range(e_dim):
      w_s[:, e * bv:(e + 1) * bv] = (ops.rowvec(f_s, write_rows + e, bv) * u).astype(BF16)
    plgpu.commit_smem()
    ins.start_next(("a",) if erase else ("v",), n)
    plgpu.copy_smem_to_gmem(u_s, u_g.at[i, n, :, cols])

    ins.wait("q", n)
    y = ops.mm(q_s, state_bf16_s)
    ins.wait("p", n)
    out = ops.mm(p_s, u_bf16_s)
    for e in range(e_dim):
      out = out + ops.rowvec(f_s, read_rows + e, bv) * y[:, e * bv:(e + 1) * bv]
    o_s[...] = (scale * out).astype(o_s.dtype)
    plgpu.commit_smem()
    ins.start_next(("q", "p", "f"), n)
    plgpu.copy_smem_to_gmem(o_s, o_g.at[i, n, :, cols])

    ins.wait("kt", n)
    return ops.mm_add(decayed, [(kt_s, w_s)])

  state = _chunk_loop(chunk, nc, state0, scratch, prologue)
  _store_cat(state, ht_g.at[i, j], cat)


def state_pass(q, k, v, k2_col, q2_col, gc_col, beta_col, a, p, h0, *, scale, erase, block_v=None,
               save_x=False, interpret=False):
  """Chunk loop forward (``recurrent.state_pass`` without ``cfg``). Returns o (BH,NC,C,V) in q's
  dtype, U (BH,NC,C,V) float32, chunk-start states (BH,NC,E,D,V) in q's dtype, final state
  (BH,E,D,V) float32. ``save_x`` (erase only): also X = V - sum_e diag(k2_e exp(gc_e)) K S_e
  (BH,NC,C,V) in q's dtype, after U: the chunk-parallel backward's ``x``."""
  vd = v.shape[-1]
  bh, nc, c, d, e_dim, bv, f, lam_cat = _prologue(q, vd, k2_col, q2_col, gc_col, beta_col, block_v)
  save_x = bool(save_x and erase)
  if save_x:
    f = jnp.concatenate([f, _t(k2_col * jnp.exp(gc_col))], axis=2)   # rows [.., beta, c (E)]
  n_rows = f.shape[2]
  n_cat = e_dim * bv
  ins = (q, k, _t(k), v, a.astype(BF16), p.astype(BF16), f, lam_cat, _to_cat(h0.astype(F32), bv))
  sw_n, sw_v = _swizzle(n_cat), _swizzle(bv)
  scratch = [
      _smem((c, d), BF16, sw_n),          # q
      _smem((c, d), BF16, sw_n),          # k
      _smem((d, c), BF16, sw_v),          # k^T
      _smem((c, bv), BF16, sw_v),         # v block
      _smem((c, c), BF16, sw_v),          # A
      _smem((c, c), BF16, sw_v),          # P
      _smem((2, n_rows, c), F32),         # row factors (two chunks' buffers)
      _smem((n_cat,), F32),               # lam_cat
      _smem((d, n_cat), BF16, sw_n),      # S_cat (bf16 operand)
      _smem((c, n_cat), BF16, sw_v),      # W = [diag(fw_e) U]_e
      _smem((c, bv), BF16, sw_v),         # rhs (bf16 operand)
      _smem((c, bv), BF16, sw_v),         # U (bf16 operand)
      _smem((c, bv), q.dtype, sw_v),      # o
      _smem((c, bv), F32, _swizzle(bv, F32)),             # U
      _smem((e_dim, d, bv), q.dtype, sw_v),               # chunk-start state
  ] + ([_smem((c, bv), q.dtype, sw_v)] if save_x else [])   # X
  cat = _smem((d, n_cat), F32, _swizzle(n_cat, F32))     # initial / final state (cat layout)
  kernel = functools.partial(_forward_kernel, scratch=scratch, cat=cat, nc=nc, e_dim=e_dim,
                             bv=bv, scale=scale, erase=erase, save_x=save_x,
                             interpret=bool(interpret))
  per_chunk = lambda dt: jax.ShapeDtypeStruct((bh, nc, c, vd), dt)
  *outs, ht = plgpu.kernel(
      kernel,
      out_type=[per_chunk(q.dtype), per_chunk(F32)] + ([per_chunk(q.dtype)] if save_x else []) + [
          jax.ShapeDtypeStruct((bh, nc, e_dim, d, vd), q.dtype),
          jax.ShapeDtypeStruct((bh, vd // bv, d, n_cat), F32)],
      scratch_types=[plgpu.Barrier(num_barriers=CAT_BARRIER + 1)], grid=(bh, vd // bv),
      grid_names=("bh", "v"),
      compiler_params=_compiler_params(),
      interpret=_interpret_params(interpret), kernel_name="triadic_forward_mgpu",
  )(*ins)
  return (*outs, _from_cat(ht, e_dim))


# ------------------------------------------------------------------------------------------------
# Backward state pass.


def _backward_kernel(k_g, kt_g, qt_g, do_g, at_g, pt_g, f_g, lam_g, dht_g,
                     du_g, dst_g, dh0_g, bars, *, scratch, cat, nc, e_dim, bv, scale, erase,
                     interpret):
  ops = _Ops(interpret)
  i, j = lax.axis_index("bh"), lax.axis_index("v")
  cols = pl.ds(j * bv, bv)
  erase_rows, read_rows, write_rows = 0, e_dim, 2 * e_dim
  dstate0 = _load_cat(ops, dht_g.at[i, j], cat, bars.at[CAT_BARRIER])

  def copies(k_s, kt_s, qt_s, do_s, at_s, pt_s, f_s, lam_s):
    return _Inputs.of(bars, [("k", k_g, k_s), ("kt", kt_g, kt_s), ("qt", qt_g, qt_s),
                             ("do", do_g, do_s), ("at", at_g, at_s), ("pt", pt_g, pt_s),
                             ("lam", lam_g, lam_s), ("f", f_g, f_s)],
                      row=i, cols=cols, value="do", order=lambda step: nc - 1 - step, nc=nc)

  first = ("k", "do", "pt", "lam", "f") + (("at",) if erase else ())
  at_end = ("qt", "kt") if erase else ("qt",)      # read only by the state update at the end

  def chunk(step, ds, k_s, kt_s, qt_s, do_s, at_s, pt_s, f_s, lam_s, state_bf16_s, x_s, z_s,
            u_bf16_s, u_s, st_s):
    ins = copies(k_s, kt_s, qt_s, do_s, at_s, pt_s, f_s, lam_s)
    n = nc - 1 - step
    d = k_s.shape[1]
    plgpu.wgmma_wait(0)                   # the previous state update has read dS_cat, K^T, Q^T
    plgpu.commit_smem()
    ins.start(first, step)
    _begin_chunk(ds, state_bf16_s, st_s)
    ins.wait("lam", step)
    decayed = ops.colvec(lam_s, d) * ds
    plgpu.commit_smem()
    _publish_chunk(st_s, lambda e: dst_g.at[i, n, e, :, cols])
    ins.start(at_end, step)

    ins.wait("k", step)
    r = ops.mm(k_s, state_bf16_s)
    ins.wait("pt", step)
    ins.wait("do", step)
    du = scale * ops.mm(pt_s, do_s)
    ins.wait("f", step)
    for e in range(e_dim):
      du = du + ops.rowvec(f_s, write_rows + e, bv) * r[:, e * bv:(e + 1) * bv]
    u_s[...] = du
    do = ops.acc(do_s[...].astype(F32))
    for e in range(e_dim):
      x_s[:, e * bv:(e + 1) * bv] = (scale * ops.rowvec(f_s, read_rows + e, bv) * do).astype(BF16)
    pairs = [(qt_s, x_s)]
    if erase:
      u_bf16_s[...] = du.astype(BF16)
      plgpu.commit_smem()
      ins.wait("at", step)
      drhs = ops.mm(at_s, u_bf16_s)
      for e in range(e_dim):
        z_s[:, e * bv:(e + 1) * bv] = (-ops.rowvec(f_s, erase_rows + e, bv) * drhs).astype(BF16)
      pairs.append((kt_s, z_s))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(u_s, du_g.at[i, n, :, cols])
    ins.wait("qt", step)
    if erase:
      ins.wait("kt", step)
    return ops.mm_add(decayed, pairs)

  dstate = _chunk_loop(chunk, nc, dstate0, scratch, lambda *refs: None)
  _store_cat(dstate, dh0_g.at[i, j], cat)


def reverse_state_pass(q, k, do, k2_col, q2_col, gc_col, beta_col, a, p, dht, *, scale, erase,
                       block_v=None, interpret=False):
  """Reverse chunk loop (``recurrent.reverse_state_pass`` without ``cfg``). Returns dU (BH,NC,C,V)
  float32, chunk-end state gradients (BH,NC,E,D,V) in q's dtype, gradient of the initial state
  (BH,E,D,V) float32."""
  vd = do.shape[-1]
  bh, nc, c, d, e_dim, bv, f, lam_cat = _prologue(q, vd, k2_col, q2_col, gc_col, beta_col, block_v)
  n_cat = e_dim * bv
  ins = (k, _t(k), _t(q), do.astype(q.dtype), _t(a).astype(BF16), _t(p).astype(BF16), f,
         lam_cat, _to_cat(dht.astype(F32), bv))
  sw_n, sw_v = _swizzle(n_cat), _swizzle(bv)
  scratch = [
      _smem((c, d), BF16, sw_n),          # k
      _smem((d, c), BF16, sw_v),          # k^T
      _smem((d, c), BF16, sw_v),          # q^T
      _smem((c, bv), BF16, sw_v),         # dO block
      _smem((c, c), BF16, sw_v),          # A^T
      _smem((c, c), BF16, sw_v),          # P^T
      _smem((3 * e_dim + 1, c), F32),     # row factors
      _smem((n_cat,), F32),               # lam_cat
      _smem((d, n_cat), BF16, sw_n),      # dS_cat (bf16 operand)
      _smem((c, n_cat), BF16, sw_v),      # X = [scale diag(fq_e) dO]_e
      _smem((c, n_cat), BF16, sw_v),      # Z = [-diag(fe_e) A^T dU]_e
      _smem((c, bv), BF16, sw_v),         # dU (bf16 operand)
      _smem((c, bv), F32, _swizzle(bv, F32)),             # dU
      _smem((e_dim, d, bv), q.dtype, sw_v),               # chunk-end state gradient
  ]
  cat = _smem((d, n_cat), F32, _swizzle(n_cat, F32))     # dht / dh0 (cat layout)
  kernel = functools.partial(_backward_kernel, scratch=scratch, cat=cat, nc=nc, e_dim=e_dim,
                             bv=bv, scale=scale, erase=erase, interpret=bool(interpret))
  du, dstates, dh0 = plgpu.kernel(
      kernel,
      out_type=[jax.ShapeDtypeStruct((bh, nc, c, vd), F32),
                jax.ShapeDtypeStruct((bh, nc, e_dim, d, vd), q.dtype),
                jax.ShapeDtypeStruct((bh, vd // bv, d, n_cat), F32)],
      scratch_types=[plgpu.Barrier(num_barriers=CAT_BARRIER + 1)], grid=(bh, vd // bv),
      grid_names=("bh", "v"),
      compiler_params=_compiler_params(),
      interpret=_interpret_params(interpret), kernel_name="triadic_backward_states_mgpu",
  )(*ins)
  return du, dstates, _from_cat(dh0, e_dim)
