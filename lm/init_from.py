"""Start a new model from another model's checkpoint (``--config.init_from=<path>``).

This is how the papers grow models: a pretrained E = 1 model becomes an E = 8 one (the forget gate,
of shape (.., H, 1), is copied into every slice), and a single-state model becomes a multi-state one
(the shared parameters have the same names; the aggregator is new). Per parameter, by name:

- same shape in the source: copied;
- absent from the source: kept at its fresh initialisation;
- the source has size 1 along an axis where the target is larger: broadcast along it;
- any other shape difference: a ValueError naming the parameter.

Parameters of the source that the new model lacks are ignored (and logged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import logging

from lm import checkpoint


def broadcastable(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
  """True if ``src`` grows into ``dst`` by repeating along axes where it has size 1."""
  return len(src) == len(dst) and all(s == d or s == 1 for s, d in zip(src, dst))


def plan(source: dict[str, tuple], target: dict[str, tuple]) -> dict[str, list[str]]:
  """Classify every target parameter: copied / broadcast / new (and the source's unused ones)."""
  out = {"copied": [], "broadcast": [], "new": [], "unused": sorted(source.keys() - target.keys())}
  bad = []
  for name, shape in sorted(target.items()):
    if name not in source:
      out["new"].append(name)
    elif source[name] == shape:
      out["copied"].append(name)
    elif broadcastable(source[name], shape):
      out["broadcast"].append(name)
    else:
      bad.append(f"  {name}: source {source[name]} vs target {shape}")
  if bad:
    raise ValueError("init_from: these parameters have shapes that neither match nor broadcast "
                     "(only axes of size 1 in the source can grow):\n" + "\n".join(bad))
  return out


def load(path: str, params, shardings):
  """``params`` (a fresh init, sharded as ``shardings``) with the matching source params put in."""
  try:
    step_dir = checkpoint.step_dir(path)
    source_shapes = checkpoint.saved_param_shapes(step_dir)
  except checkpoint.CheckpointError as err:
    text = str(err) if str(err).startswith("not a checkpoint") else f"not a checkpoint: {path} ({err})"
    raise checkpoint.CheckpointError(f"init_from: {text}") from None
  except Exception as err:  # noqa: BLE001 - whatever orbax raises on a directory it cannot read
    raise checkpoint.CheckpointError(f"init_from: not a checkpoint: {path} "
                                     f"({checkpoint._why(err)})") from None
  target_shapes = checkpoint.param_shapes(params)
  p = plan(source_shapes, target_shapes)
  logging.info("init_from %s: %d copied, %d broadcast, %d new, %d unused", step_dir,
               len(p["copied"]), len(p["broadcast"]), len(p["new"]), len(p["unused"]))
  for kind in ("broadcast", "new", "unused"):
    for name in p[kind]:
      logging.info("init_from: %s %s", kind, name)

  # Restore the source params that the target uses, each replicated (they are re-sharded below).
  flat_target = {checkpoint._name(k): (k, v) for k, v in jax.tree_util.tree_leaves_with_path(params)}
  flat_shard = dict(zip(flat_target, jax.tree.leaves(shardings)))
  wanted = set(p["copied"]) | set(p["broadcast"])
  src_tree = ocp_abstract(step_dir, wanted, flat_shard, source_shapes)
  loaded = {checkpoint._name(k): v
            for k, v in jax.tree_util.tree_leaves_with_path(checkpoint.load_params(step_dir, src_tree))}

  def pick(path, fresh):
    name = checkpoint._name(path)
    if name not in loaded:
      return fresh
    value = jnp.broadcast_to(loaded[name], fresh.shape).astype(fresh.dtype)
    return jax.device_put(value, flat_shard[name])

  return jax.tree_util.tree_map_with_path(pick, params), p


def ocp_abstract(step_dir, wanted, flat_shard, source_shapes):
  """The nested tree of ShapeDtypeStructs for the ``wanted`` source params (partial restore)."""
  import orbax.checkpoint as ocp
  tree = ocp.PyTreeCheckpointer().metadata(step_dir / "state").item_metadata["params"]
  keep = {}
  for path, meta in jax.tree_util.tree_leaves_with_path(tree):
    name = checkpoint._name(path)
    if name not in wanted:
      continue
    node = keep
    keys = name.split("/")
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    mesh = flat_shard[name].mesh
    node[keys[-1]] = jax.ShapeDtypeStruct(
        source_shapes[name], meta.dtype,
        sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  return keep
