"""Inspecting traced Pallas calls without running them: their names, grids, blocks and VMEM."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def pallas_calls(jaxpr):
  """Every pallas_call equation in a jaxpr, nested ones (jit, custom_vjp, custom_partitioning)
  included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
      continue
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from pallas_calls(sub)


def vmem_bytes(shape, dtype):
  """Bytes of a VMEM buffer: the last two dims padded to Mosaic's (8 * packing, 128) tiles."""
  itemsize = jnp.dtype(dtype).itemsize
  shape = (1,) * max(0, 2 - len(shape)) + tuple(shape)
  sub = 8 * (4 // itemsize)
  padded = (*shape[:-2], -(-shape[-2] // sub) * sub, -(-shape[-1] // 128) * 128)
  return int(np.prod(padded)) * itemsize


def kernel_blocks(traced):
  """Per pallas_call of a traced program: (name, grid, block shapes, estimated VMEM bytes per
  program: every block twice for the pipeline's double buffering, plus scratch)."""
  out = []
  for eqn in pallas_calls(traced.jaxpr.jaxpr):
    gm = eqn.params["grid_mapping"]
    shapes = [tuple(bm.ref_aval.shape) for bm in gm.block_mappings]
    vmem = sum(2 * vmem_bytes(shape, bm.array_aval.dtype)
               for shape, bm in zip(shapes, gm.block_mappings))
    vmem += sum(vmem_bytes(a.shape, a.dtype) for a in gm.scratch_avals)
    out.append((eqn.params["name"], tuple(gm.grid), shapes, vmem))
  return out
