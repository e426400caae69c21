"""The state passes over pieces of the sequence, for calls whose programs cannot fill the GPU.

A state pass runs one program per (batch*head, value block), each a chain of NC dependent chunk
steps. When those programs are fewer than the device's multiprocessors (B = 1 at long T), the
sequence is cut into P pieces of L = NC / P chunks and the pass runs P times the programs, each L
steps long: the inputs reshape (B*H, NC, ...) -> (B*H*P, L, ...) without a copy.

A piece's start state is the state after the W chunks before it, computed from zero by a short
pass over those windows (``warm-up``); whatever the state held before the window is dropped. The
dropped part reaches the piece multiplied by the window's transitions, and each token's
transition has norm at most

  max_e alpha_te * max(1, |1 - beta_t ||k2_t||^2 ||k_t||^2|)

on the stacked E x D state (decay diag(alpha), then the erase I - beta u u^T with u = k2 (x) k;
without erase only the decay). So the dropped part is at most exp(sum of ``token_log_bound`` over
the window) of the dropped state's norm; with unit keys and beta in [0, 1] that is the window's
decay, exp(sum_t max_e g_te). When every window of the call is below exp(``LOG_TOL``) the pieces
are exact to far below float32 rounding; when any window decays less, the call runs the plain
pass (``jax.lax.cond``: both are compiled, the data picks). FlashQLA's intra-sequence context
parallelism rests on the same decay argument.

The reverse pass is the same with each window after its piece (the transposed transitions have
the same norms): the window's pass from a zero gradient gives the gradient at the piece's end.
Slices whose state stays zero (k2 = 0 at every token and a zero start, e.g. E padded to a power
of two) are left out of the max over e.

With the caller's (B, T, H, X) layout (``heads``, ``plan.layout``) q, k, v, o and dO stay whole:
the Mosaic passes read piece p's chunks in place (their ``pieces``), and only the warm-up windows
are relayouted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

F32 = jnp.float32
LOG_TOL = -20.0          # log of the largest factor a dropped state may reach a piece with
DEFAULT_SMS = 132        # an H100 / H200, when the device does not say


@dataclasses.dataclass(frozen=True)
class Pieces:
  """How a call's state passes run: ``count`` pieces of ``length`` chunks, each started from a
  warm-up over the ``warmup`` chunks before it (count 1: the plain pass), and why."""
  count: int
  length: int
  warmup: int
  reason: str

  def __str__(self) -> str:
    if self.count == 1:
      return f"one piece ({self.reason})"
    return (f"{self.count} pieces of {self.length} chunks, {self.warmup}-chunk warm-ups, when "
            f"every window decays below exp({LOG_TOL:g}) ({self.reason})")


def device_sms() -> int:
  """The default device's multiprocessor count (``core_count``), else ``DEFAULT_SMS``."""
  return int(getattr(jax.devices()[0], "core_count", 0) or DEFAULT_SMS)


def choose(requested: int, warmup: int, *, programs: int, nc: int, sms: int | None = None
           ) -> Pieces:
  """The pieces for ``programs`` (B*H*value blocks) state-pass programs over ``nc`` chunks.
  ``requested``: 1 none; n >= 2 exactly n; 0 the most of (8, 4, 2) that keep programs * P
  within the device's multiprocessors. A piece must be at least ``warmup`` chunks long and P must
  divide nc; otherwise one piece, with the reason."""
  if requested == 1:
    return Pieces(1, nc, 0, "Config.sequence_pieces = 1")
  if requested >= 2:
    candidates, why = (requested,), f"Config.sequence_pieces = {requested}"
  else:
    sms = sms or device_sms()
    candidates = tuple(p for p in (8, 4, 2) if programs * p <= sms)
    why = f"{programs} programs for {sms} multiprocessors"
    if not candidates:
      return Pieces(1, nc, 0, why + ": they fill the device")
  for p in candidates:
    if nc % p == 0 and nc // p >= warmup:
      return Pieces(p, nc // p, warmup, why)
  return Pieces(1, nc, 0, f"{why}: no piece count in {candidates} divides {nc} chunks into "
                          f"pieces of at least {warmup}")


def token_log_bound(k_sq, k2, g, beta, live, *, erase):
  """(BH, NC, C) log of each token's transition-norm bound (module docstring). k_sq (BH,NC,C) the
  keys' squared norms ``key_norms``, k2 / g (BH,NC,C,E), beta (BH,NC,C,1); ``live`` (BH, E)
  marks the slices whose state can be nonzero (the others are left out of the max over e)."""
  decay = jnp.max(jnp.where(live[:, None, None, :], g.astype(F32), -jnp.inf), axis=-1)
  decay = jnp.maximum(decay, -1e30)                       # no live slice: no state at all
  if not erase:
    return decay
  u2 = k_sq * jnp.sum(jnp.square(k2.astype(F32)), -1)
  return decay + jnp.log(jnp.maximum(1.0, jnp.abs(1.0 - beta[..., 0].astype(F32) * u2)))


def key_norms(k, heads=None, c=None):
  """(BH, NC, C) float32 squared norms of the keys k (BH, NC, C, D), or of k (B, T, H, D) in the
  caller's layout with ``heads=H`` and chunk ``c`` (the norms are relayouted, not k)."""
  k_sq = jnp.sum(jnp.square(k.astype(F32)), -1)
  if heads is None:
    return k_sq
  b, t = k_sq.shape[:2]
  return jnp.swapaxes(k_sq, 1, 2).reshape(b * heads, t // c, c)


def _live(writes, start):
  """(BH, E): slices written at some token (``writes`` (BH,NC,C,E) nonzero) or started nonzero
  (``start`` (BH,E,D,V))."""
  return jnp.any(writes != 0, axis=(1, 2)) | jnp.any(start != 0, axis=(2, 3))


def _window_index(starts, w):
  """(len(starts), w) chunk indices of the windows [s, s + w); ``starts`` an arithmetic range,
  built from iotas (a custom_partitioning body may close over no array constants)."""
  first, n = starts.start, len(starts)
  return first + starts.step * jnp.arange(n)[:, None] + jnp.arange(w)[None, :]


def _windows(x, starts, w):
  """x (BH, NC, ...) -> (BH * len(starts), w, ...): chunks [s, s + w) for each start s."""
  y = x[:, _window_index(starts, w)]
  return y.reshape(y.shape[0] * y.shape[1], *y.shape[2:])


def _token_windows(x, starts, w, c):
  """x (B, T, H, X) in the caller's layout -> (B * H * len(starts), w, C, X): ``_windows`` of its
  (B*H, NC, C, X) relayout, taken without relayouting the rest of x."""
  b, t, h, xd = x.shape
  y = x.reshape(b, t // c, c, h, xd)[:, _window_index(starts, w)]   # (B, n, w, C, H, X)
  return jnp.moveaxis(y, 4, 1).reshape(b * h * len(starts), w, c, xd)


def _pieces(x, n):
  """(BH, NC, ...) -> (BH * n, NC / n, ...), a reshape."""
  return x.reshape(x.shape[0] * n, x.shape[1] // n, *x.shape[2:])


def _whole(x, n):
  """(BH * n, L, ...) -> (BH, n * L, ...), a reshape."""
  return x.reshape(x.shape[0] // n, n * x.shape[1], *x.shape[2:])


def _fits(log_bound, starts, w):
  """Whether every window [s, s + w) of chunks has a summed log bound below LOG_TOL."""
  per_chunk = jnp.sum(log_bound, axis=-1)                                    # (BH, NC)
  return jnp.all(jnp.sum(per_chunk[:, _window_index(starts, w)], axis=-1) <= LOG_TOL)


def window_starts(pieces: Pieces, *, reverse: bool) -> range:
  """The first chunk of each warm-up window: the ``warmup`` chunks before pieces 1 .. n-1, or
  (``reverse``) after pieces 0 .. n-2."""
  step, w = pieces.length, pieces.warmup
  last = pieces.count * step
  return range(step, last, step) if reverse else range(step - w, last - w, step)


def _over_pieces(fn, pieces: Pieces, ins, boundary, live, bound_inputs, *, reverse, kw,
                 heads=None, token_outputs=()):
  """``fn`` (a state pass whose last result is the state, or gradient, at the far end from
  ``boundary``) over ``pieces``, or over the whole sequence where a window decays too little.
  ``boundary``: h0 (forward) or dht (``reverse``); ``bound_inputs``: (k, k2, g, beta) for
  ``token_log_bound`` (k's squared norms by ``key_norms``). With ``heads`` (``fn`` a Mosaic pass
  with ``heads``) the first three of ``ins`` and the results at the indices ``token_outputs`` are
  in the caller's (B, T, H, X) layout: the pieces read and write them in place (``fn``'s
  ``pieces``), the warm-ups a relayout of their windows."""
  n, w = pieces.count, pieces.warmup
  if n == 1:
    return fn(*ins, boundary, **kw)
  starts = window_starts(pieces, reverse=reverse)
  tok = 0 if heads is None else 3
  c = ins[tok].shape[2]                                   # k2 / q2 (BH, NC, C, E) after them

  def split(ins, boundary):
    bh, shape = boundary.shape[0], boundary.shape[1:]
    zero = jnp.zeros((bh * (n - 1),) + shape, boundary.dtype)
    windows = ([_token_windows(x, starts, w, c) for x in ins[:tok]]
               + [_windows(x, starts, w) for x in ins[tok:]])
    warm_kw = kw if heads is None else {**kw, "heads": None}
    warm = fn(*windows, zero, **warm_kw)[-1].reshape(bh, n - 1, *shape)
    ends = [warm, boundary[:, None]] if reverse else [boundary[:, None], warm]
    piece_kw = kw if heads is None else {**kw, "pieces": n}
    outs = fn(*ins[:tok], *(_pieces(x, n) for x in ins[tok:]),
              jnp.concatenate(ends, 1).reshape(-1, *shape).astype(boundary.dtype), **piece_kw)
    far = outs[-1].reshape(bh, n, *outs[-1].shape[1:])[:, 0 if reverse else -1]
    whole = [x if j in token_outputs and heads is not None else _whole(x, n)
             for j, x in enumerate(outs[:-1])]
    return (*whole, far)

  k, *rest = bound_inputs
  ok = _fits(token_log_bound(key_norms(k, heads, c), *rest, live, erase=kw["erase"]), starts, w)
  return jax.lax.cond(ok, split, lambda ins, boundary: fn(*ins, boundary, **kw), ins, boundary)


def state_pass(fn, pieces: Pieces, q, k, v, k2, q2, gc, beta, a, p, h0, g, *, scale, erase,
               heads=None):
  """``fn`` (a forward state pass: ``recurrent.state_pass`` / ``mosaic.state_pass`` operands and
  results, or o and the final state alone: ``mosaic.state_pass(residuals=False)``, whose warm-ups
  then store nothing but their end states either) over ``pieces``, each started from the state
  that a pass over the ``warmup`` chunks before it brings from zero, or over the whole sequence
  where a window decays too little. ``g`` is the per-token log decay (BH, NC, C, E). ``heads``: q,
  k, v and o in the caller's (B, T, H, X) layout (``fn`` takes ``heads`` and ``pieces``:
  ``mosaic.state_pass``)."""
  return _over_pieces(fn, pieces, (q, k, v, k2, q2, gc, beta, a, p), h0, _live(k2, h0),
                      (k, k2, g, beta), reverse=False, kw=dict(scale=scale, erase=erase),
                      heads=heads, token_outputs=(0,))


def reverse_state_pass(fn, pieces: Pieces, q, k, do, k2, q2, gc, beta, a, p, dht, g, *, scale,
                       erase, heads=None, token_outputs=()):
  """``fn`` (a reverse state pass) over ``pieces``, each started from the gradient that a pass
  over the ``warmup`` chunks after it brings back from zero, or over the whole sequence where a
  window decays too little. ``heads``: q, k, dO in the caller's layout, as ``state_pass``, and
  so are the results at the indices ``token_outputs`` (dV of ``mosaic.reverse_state_pass``'
  ``save_drhs``)."""
  live = _live(k2, dht) | _live(q2, dht)   # a gradient slice is written through q2 and k2
  return _over_pieces(fn, pieces, (q, k, do, k2, q2, gc, beta, a, p), dht, live,
                      (k, k2, g, beta), reverse=True, kw=dict(scale=scale, erase=erase),
                      heads=heads, token_outputs=token_outputs)
