"""Checkpoints with orbax: the train state and the data iterator, saved together per step.

``manager`` is an async ``CheckpointManager`` under ``<workdir>/checkpoints`` that keeps the last
k steps; the state is item ``state`` (a PyTree save: step, params, optimizer) and the grain
iterator is item ``data``. ``saved_param_shapes`` and ``load_params`` read one item of one step
directly, without the manager, so that eval and ``init_from`` need no data handler and never
read the optimizer state.

A step that cannot be read (a truncated or missing file, bad JSON, a TensorStore error) is never
fatal while an older one is intact: ``restore_newest`` (training) and ``load_newest_params``
(eval) log a warning naming the step directory and the error, then try the next older step.
Training moves an unreadable step aside to ``<step>.corrupt`` once it has resumed from an older
one, because it will write that step number again (orbax refuses to overwrite it); nothing is
ever deleted.
"""

from __future__ import annotations

import os

import jax
from absl import logging
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


class CheckpointError(ValueError):
  """A path that is not a checkpoint, or a checkpoint that cannot be read."""


def _why(err: BaseException) -> str:
  """``Type: first line of the message`` (orbax / TensorStore messages run to many lines)."""
  lines = str(err).strip().splitlines()
  first = lines[0] if lines else ""
  return f"{type(err).__name__}: {first[:300]}"


def _steps(root: epath.Path) -> list[int]:
  if not root.is_dir():
    return []
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def step_dirs(path: str) -> list[epath.Path]:
  """Every step directory at ``path`` (a workdir, its ``checkpoints`` folder or a step folder),
  newest first. CheckpointError("not a checkpoint: PATH") if there is none."""
  path = epath.Path(absolute(path))
  if path.is_dir() and (path / "state").is_dir():
    return [path]
  root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
  steps = _steps(root)
  if not steps:
    raise CheckpointError(f"not a checkpoint: {path} (expected a workdir with "
                          f"checkpoints/<step>/state, or a step directory)")
  return [root / str(s) for s in reversed(steps)]


def step_dir(path: str, step: int | None = None) -> epath.Path:
  """A step directory from a workdir, its ``checkpoints`` folder or a step folder itself."""
  dirs = step_dirs(path)
  if step is None:
    return dirs[0]
  by_step = {int(d.name): d for d in dirs if d.name.isdigit()}
  if step not in by_step:
    raise FileNotFoundError(f"no checkpoint of step {step} at {dirs[0].parent}; saved steps: "
                            f"{sorted(by_step)}")
  return by_step[step]


def _move_aside(path: epath.Path) -> epath.Path:
  target, i = path.parent / f"{path.name}.corrupt", 1
  while target.exists():
    target, i = path.parent / f"{path.name}.corrupt.{i}", i + 1
  path.rename(target)
  return target


def restore_newest(mngr: ocp.CheckpointManager, abstract_state, iterator, expected_shapes: dict,
                   *, move_aside: bool = True):
  """(state, step) from the newest step of ``mngr`` that reads back, or (None, None) if none is saved.

  A step whose files fail to read is skipped with a warning; if an older one restores, the bad
  ones are moved aside (``move_aside``, process 0). A step whose parameters do not match
  ``expected_shapes`` is another model, not damage: ``check_matches`` raises. If no step reads,
  CheckpointError names every one and why.
  """
  bad = []
  for step in sorted(mngr.all_steps(), reverse=True):
    path = epath.Path(mngr.directory) / str(step)
    try:
      shapes = saved_param_shapes(path)
    except Exception as err:  # noqa: BLE001 - orbax / TensorStore / JSON errors alike
      bad.append((path, _why(err)))
      logging.warning("checkpoint %s is unreadable (%s); trying the previous step", path, bad[-1][1])
      continue
    check_matches(shapes, expected_shapes, str(path))
    try:
      state = restore(mngr, step, abstract_state, iterator)
    except Exception as err:  # noqa: BLE001
      bad.append((path, _why(err)))
      logging.warning("checkpoint %s is unreadable (%s); trying the previous step", path, bad[-1][1])
      continue
    if bad and move_aside:
      if jax.process_index() == 0:
        for p, _ in bad:
          logging.warning("moved the unreadable checkpoint %s aside to %s", p, _move_aside(p))
      if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("lm.checkpoint: unreadable steps moved aside")
      mngr.reload()
    if bad:
      logging.warning("resumed from step %d, the newest intact checkpoint", step)
    return state, step
  if bad:
    raise CheckpointError("no checkpoint in %s reads back:\n%s\nMove them away to start again." % (
        mngr.directory, "\n".join(f"  {p}: {why}" for p, why in bad)))
  return None, None


def load_newest_params(path: str, abstract_params, step: int | None = None):
  """(params, step dir) of ``step`` at ``path``, or of the newest step that reads back.

  With ``step`` an unreadable checkpoint is a CheckpointError naming it; without, each unreadable
  step is skipped with a warning. A parameter-shape mismatch always raises (``check_matches``).
  """
  dirs = [step_dir(path, step)] if step is not None else step_dirs(path)
  expected = param_shapes(abstract_params)
  bad = []
  for d in dirs:
    try:
      shapes = saved_param_shapes(d)
    except Exception as err:  # noqa: BLE001
      bad.append((d, _why(err)))
    else:
      check_matches(shapes, expected, str(d))
      try:
        return load_params(d, abstract_params), d
      except Exception as err:  # noqa: BLE001
        bad.append((d, _why(err)))
    if step is not None:
      raise CheckpointError(f"checkpoint {d} (step {step}) is unreadable: {bad[-1][1]}; pass "
                            f"another --step (saved: {[int(x.name) for x in step_dirs(path)]})")
    logging.warning("checkpoint %s is unreadable (%s); trying the previous step", d, bad[-1][1])
  raise CheckpointError("no checkpoint at %s reads back:\n%s" % (
      path, "\n".join(f"  {p}: {why}" for p, why in bad)))


def saved_param_shapes(path: epath.Path) -> dict[str, tuple[int, ...]]:
  """``{"layers/block0/mixer/q_proj/kernel": shape, ...}`` of the params saved in a step dir."""
  if not (path / "state").is_dir():
    raise CheckpointError(f"not a checkpoint: {path} (no state/ directory)")
  metadata = ocp.PyTreeCheckpointer().metadata(path / "state")
  tree = None if metadata is None or metadata.item_metadata is None else metadata.item_metadata
  if tree is None or "params" not in tree:
    raise CheckpointError(f"checkpoint {path} has no readable parameter metadata "
                          f"(state/_METADATA missing or damaged)")
  tree = tree["params"]
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
