"""Run the Pallas kernels per (batch, head) shard under jit's SPMD partitioners (GSPMD and Shardy).

A ``pallas_call`` is opaque to XLA's partitioner: given sharded operands it gathers them and runs
the whole global-batch kernel on every device (no error, just no speed-up from data parallelism).
The recurrence couples tokens only, never batch rows or heads, so any sharding of B and H is
exact if every device runs the kernels on its own (B/b, H/h) slice. ``batch_head_partitioned``
wraps a function whose array operands and results all have leading (B, H) dimensions in
``jax.experimental.custom_partitioning`` that says exactly this:

* Shardy (the default partitioner): an einsum-like sharding rule in which every other factor
  (tokens, chunk, D, V, E) needs replication.
* GSPMD: ``infer_sharding_from_operands`` and ``partition`` give every operand and result the B and
  H mesh axes of the first operand and replicate the rest.

Either way ``partition`` lowers the same function on the local shapes. The wrapper is mesh
agnostic: it reads the mesh axes from the operands' shardings, never from a config. On one device
(or inside a fully manual ``shard_map``) ``custom_partitioning`` inlines the function, so the
unsharded program is exactly the unwrapped one. It has no batching rule: ``jax.vmap`` over a
wrapped function fails (the op takes its batch as B instead).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _leading_axes(sharding):
  """Mesh axes of dims 0 (B) and 1 (H) of a NamedSharding, or None if it is not one."""
  if not isinstance(sharding, NamedSharding):
    return None
  spec = tuple(sharding.spec) + (None, None)
  return spec[0], spec[1]


def _shardings(mesh, lead, shapes):
  """Every array in ``shapes`` sharded as ``lead`` on its two leading dims, replicated elsewhere."""
  return jax.tree.map(lambda s: NamedSharding(mesh, P(*lead, *(None,) * (len(s.shape) - 2))),
                      shapes)


def _layout(mesh, arg_shapes):
  """(mesh, (B axes, H axes)) taken from the first operand. Operands without a named sharding
  (no mesh known at lowering) fall back to replication over their devices: correct, unsharded."""
  first = jax.tree.leaves(arg_shapes)[0].sharding
  lead = _leading_axes(first)
  if lead is None or mesh.empty:
    devices = np.asarray(first._device_assignment)
    return Mesh(devices, ("devices",)), (None, None)
  return mesh, lead


def batch_head_partitioned(fun, *, n_static: int, rule: str, replicated: tuple[str, ...]):
  """``fun(*static, *arrays)`` as a custom-partitioned op that runs per (B, H) shard.

  fun: the first ``n_static`` arguments are static (hashable Python values); every array
    argument and every result has leading dims (B, H) and is independent across them.
  rule: Shardy's einsum-like rule over all operands and results, B and H named ``b h``.
  replicated: every other factor of ``rule`` (dims that must not be sharded).
  """
  wrapped = custom_partitioning(fun, static_argnums=tuple(range(n_static)))
  # Shardy's verifier wants the need-replication factors in factor order, i.e. in the order they
  # first appear in the rule; jax passes them through as given.
  order = list(dict.fromkeys(rule.replace("->", ",").replace(",", " ").split()))
  replicated = tuple(sorted(replicated, key=order.index))

  def infer_sharding_from_operands(*args):
    mesh, arg_shapes, result_shape = args[n_static:]
    mesh, lead = _layout(mesh, arg_shapes)
    return _shardings(mesh, lead, result_shape)

  def partition(*args):
    static = args[:n_static]
    mesh, arg_shapes, result_shape = args[n_static:]
    mesh, lead = _layout(mesh, arg_shapes)
    return (mesh, functools.partial(fun, *static), _shardings(mesh, lead, result_shape),
            _shardings(mesh, lead, arg_shapes))

  wrapped.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands,
                        sharding_rule=rule, need_replication_factors=replicated)
  return wrapped
