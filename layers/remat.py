"""Naming a sequence-mixing op's forward for ``jax.checkpoint`` policies.

``saved_op(fn)`` computes ``fn`` unchanged, but tags its output and the residuals its backward
needs with ``checkpoint_name`` (default name ``"mixer_op"``). Under a remat policy that saves that
name (``jax.checkpoint_policies.save_only_these_names("mixer_op")``) the backward pass then reuses
the forward's results instead of running the op's forward again; every other policy (and no
remat at all) is unaffected, because a name is the identity outside a checkpoint.

The residuals are those of ``jax.vjp(fn, ...)``: for an op with its own ``custom_vjp`` (the Pallas
kernels, cuDNN attention) exactly what its forward rule saves; for plain JAX the linearisation's.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

MIXER_OP = "mixer_op"


def saved_op(fn: Callable, name: str = MIXER_OP) -> Callable:
  """``fn`` (positional array arguments -> arrays) with its output and backward residuals named
  ``name``; same values and gradients as ``fn``."""

  @jax.custom_vjp
  def op(*args):
    return fn(*args)

  def fwd(*args):
    out, vjp = jax.vjp(fn, *args)  # vjp is a pytree (jax.tree_util.Partial) of the residuals
    tag = lambda z: jax.tree.map(lambda x: checkpoint_name(x, name), z)
    return tag(out), tag(vjp)

  def bwd(vjp, cotangent):
    return vjp(cotangent)

  op.defvjp(fwd, bwd)
  return op
