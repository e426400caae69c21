"""Run the Pallas kernels per (batch, head) shard under jit's SPMD partitioners (GSPMD and Shardy).

A ``pallas_call`` is opaque to XLA's partitioner: given sharded operands it gathers them and runs
the whole global-batch kernel on every device (no error, just no speed-up from data parallelism).
The recurrence couples tokens only, never batch rows or heads, so any sharding of B and H is
exact if every device runs the kernels on its own (B/b, H/h) slice. ``batch_head_partitioned``
wraps a function whose array operands and results all have a B and an H dimension in
``jax.experimental.custom_partitioning`` that says exactly this (the dims are named ``b`` and ``h``
in its rule, wherever they sit: leading in the kernels' (B, H, ...) layouts, first and third in
the caller's (B, T, H, X)):

* Shardy (the default partitioner): an einsum-like sharding rule in which every other factor
  (tokens, chunk, D, V, E) needs replication.
* GSPMD: ``infer_sharding_from_operands`` and ``partition`` give every operand and result the B and
  H mesh axes of the first operand on its b and h dims and replicate the rest.

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


def _factors(rule: str) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
  """The factor names of every operand and every result of a Shardy rule "b h n, b t h -> ..."."""
  split = lambda side: [tuple(dims.split()) for dims in side.split(",")]
  operands, results = rule.split("->")
  return split(operands), split(results)


def _spec(factors, lead):
  """The PartitionSpec of an array with these factor names: B's mesh axes on ``b``, H's on
  ``h``, every other dim replicated."""
  return P(*(lead[0] if f == "b" else lead[1] if f == "h" else None for f in factors))


def _leading_axes(sharding, factors):
  """Mesh axes of the dims named b (B) and h (H) of a NamedSharding, or None if it is not one."""
  if not isinstance(sharding, NamedSharding):
    return None
  spec = tuple(sharding.spec) + (None,) * len(factors)
  return spec[factors.index("b")], spec[factors.index("h")]


def _shardings(mesh, lead, shapes, factors):
  """Every array in ``shapes`` (in the order of ``factors``, one name tuple per array) sharded as
  ``lead`` on its b and h dims, replicated elsewhere."""
  leaves, tree = jax.tree.flatten(shapes)
  return jax.tree.unflatten(tree, [NamedSharding(mesh, _spec(f, lead))
                                   for f, _ in zip(factors, leaves, strict=True)])


def _layout(mesh, arg_shapes, factors):
  """(mesh, (B axes, H axes)) taken from the first operand. Operands without a named sharding
  (no mesh known at lowering) fall back to replication over their devices: correct, unsharded."""
  first = jax.tree.leaves(arg_shapes)[0].sharding
  lead = _leading_axes(first, factors[0])
  if lead is None or mesh.empty:
    devices = np.asarray(first._device_assignment)
    return Mesh(devices, ("devices",)), (None, None)
  return mesh, lead


def batch_head_partitioned(fun, *, n_static: int, rule: str, replicated: tuple[str, ...]):
  """``fun(*static, *arrays)`` as a custom-partitioned op that runs per (B, H) shard.

  fun: the first ``n_static`` arguments are static (hashable Python values); every array
    argument and every result has a B and an H dim and is independent across them.
  rule: Shardy's einsum-like rule over all operands and results, B and H named ``b`` and ``h``
    (anywhere in each array's dims: the GSPMD shardings are built from the same names).
  replicated: the factors that must not be sharded (those absent from ``rule`` are ignored).
  """
  wrapped = custom_partitioning(fun, static_argnums=tuple(range(n_static)))
  operand_factors, result_factors = _factors(rule)
  # Shardy's verifier wants the need-replication factors in factor order, i.e. in the order they
  # first appear in the rule; jax passes them through as given.
  order = list(dict.fromkeys(rule.replace("->", ",").replace(",", " ").split()))
  replicated = tuple(sorted((f for f in replicated if f in order), key=order.index))

  def infer_sharding_from_operands(*args):
    mesh, arg_shapes, result_shape = args[n_static:]
    mesh, lead = _layout(mesh, arg_shapes, operand_factors)
    return _shardings(mesh, lead, result_shape, result_factors)

  def partition(*args):
    static = args[:n_static]
    mesh, arg_shapes, result_shape = args[n_static:]
    mesh, lead = _layout(mesh, arg_shapes, operand_factors)
    return (mesh, functools.partial(fun, *static),
            _shardings(mesh, lead, result_shape, result_factors),
            _shardings(mesh, lead, arg_shapes, operand_factors))

  wrapped.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands,
                        sharding_rule=rule, need_replication_factors=replicated)
  return wrapped
