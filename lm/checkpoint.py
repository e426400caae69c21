"""Checkpoints with orbax: the train state and the data iterator, saved together per step.

``manager`` is an async ``CheckpointManager`` under ``<workdir>/checkpoints`` that keeps the last
k steps; the state is item ``state`` (a PyTree save: step, params, optimizer) and the grain
iterator is item ``data``. ``saved_param_shapes`` and ``load_params`` read one item of one step
directly, without the manager, so that eval and ``init_from`` need no data handler and never
read the optimizer state.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from etils import epath

from lm import data


def absolute(path) -> str:
  """Local paths made absolute (orbax needs it: a relative step dir loses its metadata); URLs as is."""
  path = str(path)
  return path if "://" in path else os.path.abspath(path)


def manager(workdir: str, keep: int, *, read_only: bool = False) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                         read_only=read_only, create=not read_only)
  return ocp.CheckpointManager(os.path.join(absolute(workdir), "checkpoints"), options=options)


def save(mngr: ocp.CheckpointManager, step: int, state, iterator, *, force: bool = False) -> bool:
  """Start an async save of ``state`` and the data ``iterator`` at ``step``."""
  return mngr.save(step, force=force, args=ocp.args.Composite(
      state=ocp.args.PyTreeSave(state), data=data.iterator_checkpoint_args(iterator, save=True)))


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state, iterator):
  """Restore the state (onto the shardings of ``abstract_state``) and the iterator in place."""
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(abstract_state,
                                   restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state)),
      data=data.iterator_checkpoint_args(iterator, save=False)))
  return restored["state"]


def step_dir(path: str, step: int | None = None) -> epath.Path:
  """A step directory from a workdir, its ``checkpoints`` folder or a step folder itself."""
  path = epath.Path(absolute(path))
  if (path / "state").exists():
    return path
  root = path / "checkpoints" if (path / "checkpoints").exists() else path
  steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []
  if not steps:
    raise FileNotFoundError(f"no checkpoint found at {path} (expected <workdir>/checkpoints/<step>/state)")
  if step is None:
    return root / str(steps[-1])
  if step not in steps:
    raise FileNotFoundError(f"no checkpoint of step {step} at {root}; saved steps: {steps}")
  return root / str(step)


def saved_param_shapes(path: epath.Path) -> dict[str, tuple[int, ...]]:
  """``{"layers/block0/mixer/q_proj/kernel": shape, ...}`` of the params saved in a step dir."""
  tree = ocp.PyTreeCheckpointer().metadata(path / "state").item_metadata["params"]
  return {_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def param_shapes(params) -> dict[str, tuple[int, ...]]:
  return {_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(params)}


def _name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def check_matches(saved: dict, expected: dict, where: str) -> None:
  """Raise a ValueError naming every parameter that is missing, extra or of another shape."""
  problems = [f"  {n}: missing from the checkpoint (model wants {expected[n]})"
              for n in sorted(expected.keys() - saved.keys())]
  problems += [f"  {n}: in the checkpoint {saved[n]} but not in this model"
               for n in sorted(saved.keys() - expected.keys())]
  problems += [f"  {n}: checkpoint {saved[n]} vs model {expected[n]}"
               for n in sorted(saved.keys() & expected.keys()) if saved[n] != expected[n]]
  if problems:
    shown = "\n".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
    raise ValueError(f"the checkpoint at {where} does not match the model of this config "
                     f"({len(problems)} parameters differ):\n{shown}\n"
                     f"Use another --workdir, or --config.init_from to start a new model from it.")


def load_params(path: epath.Path, abstract_params):
  """Restore only the params of a step dir onto ``abstract_params`` (ShapeDtypeStructs with shardings)."""
  target = {"params": abstract_params}
  restored = ocp.PyTreeCheckpointer().restore(
      path / "state", args=ocp.args.PyTreeRestore(
          target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
  return restored["params"]
