"""The device mesh and how logical axis names map onto it.

The mesh has three axes, ``("data", "fsdp", "tensor")``, sized from ``config.mesh`` (one entry
may be -1: it takes the remaining devices). ``config.logical_axis_rules`` maps the logical names
the parameters carry (embed, heads, mlp, vocab, ...) to mesh axes. A dimension that the mesh
axes do not divide is replicated instead, so a small model still runs on a big mesh.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, ...]:
  """Resolve ``config.mesh`` (data, fsdp, tensor; one may be -1) against the device count."""
  sizes = [int(mesh_config[a]) for a in MESH_AXES]
  if sum(s == -1 for s in sizes) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"config.mesh sizes must be positive, with at most one -1, got "
                     f"{dict(zip(MESH_AXES, sizes))}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"config.mesh {dict(zip(MESH_AXES, sizes))} does not divide the "
                       f"{num_devices} devices")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"config.mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                     f"but {num_devices} are available")
  return tuple(sizes)


def make_mesh(mesh_config, devices=None) -> jax.sharding.Mesh:
  """The ("data", "fsdp", "tensor") mesh over all (or the given) devices.

  Axes are ``Auto``: shardings are given at the jit boundary and XLA (GSPMD) propagates them.
  """
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_config, len(devices))
  return jax.make_mesh(shape, MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def rules(config) -> tuple[tuple[str, object], ...]:
  """``config.logical_axis_rules`` as the tuple of pairs flax expects."""
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes)
               for name, axes in config.logical_axis_rules)


def _fit(spec: P, shape, mesh) -> P:
  """Drop the mesh axes of any dimension they do not divide (that dimension is replicated)."""
  fitted = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    size = math.prod(mesh.shape[a] for a in names)
    if names and dim % size:
      logging.info("dimension %d is not divisible by mesh axes %s (%d): replicated", dim, names, size)
      names = ()
    fitted.append(None if not names else names[0] if len(names) == 1 else names)
  return P(*fitted)


def tree_shardings(abstract_boxed, mesh, axis_rules):
  """NamedShardings for a tree whose leaves may be flax ``Partitioned`` boxes (logical names)."""
  logical = nn.get_partition_spec(abstract_boxed)
  specs = nn.logical_to_mesh(logical, axis_rules)
  shapes = jax.tree.map(lambda x: x.shape, nn.unbox(abstract_boxed))
  return jax.tree.map(lambda spec, shape: NamedSharding(mesh, _fit(spec, shape, mesh)), specs, shapes,
                      is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh) -> NamedSharding:
  """Rows of a batch are split over the data and fsdp axes; the sequence is not split."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local: dict, mesh) -> dict:
  """This process's rows (numpy) -> one global jax.Array per key, sharded over the batch axes."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local.items()}
