"""The training loop: set up mesh, state and data; restore or initialise; step; log; checkpoint.

A run never loses more than one checkpoint interval: it saves every ``train.checkpoint_every``
steps, at the end, and when preempted (SIGTERM; on several processes, JAX's preemption sync
point so that all of them save the same step). Restarting with the same workdir resumes from
the latest checkpoint (model, optimizer and data iterator) and continues the same loss curve.
Before any save, every step since the last check is checked for a finite loss and gradient, so a
NaN stops the run and the last checkpoint on disk is a good one.

An unreadable latest checkpoint is skipped for the newest intact one (``checkpoint.restore_newest``).
Each start writes ``config.json`` (the config in force) and ``config.<start step>.json`` (the
history); a resumed run whose config differs from the saved one logs every changed key.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Callable

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from lm import checkpoint, costs, data, init_from, logger, sharding, state as state_lib, train_step
from lm.config import config_changes, validate


class _Preemption:
  """Becomes true on SIGTERM (one process) or at JAX's preemption sync point (several)."""

  def __init__(self):
    self.event = threading.Event()
    self.multi = jax.process_count() > 1
    self.previous = None
    if not self.multi and threading.current_thread() is threading.main_thread():
      self.previous = signal.signal(signal.SIGTERM, lambda *_: self.event.set())

  def __call__(self, step: int) -> bool:
    if self.multi:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.event.is_set()

  def restore(self):
    if self.previous is not None:
      signal.signal(signal.SIGTERM, self.previous)


def _write_config(config, workdir: str, start: int) -> None:
  """config.json (the config in force) and config.<start>.json (one per start: the history)."""
  if jax.process_index() != 0:
    return
  text = config.to_json_best_effort(indent=2)
  path = os.path.join(workdir, "config.json")
  if start > 0 and os.path.exists(path):
    try:
      with open(path) as f:
        changes = config_changes(json.load(f), config)
    except ValueError as err:
      changes = [f"(the saved {path} is unreadable: {err})"]
    if changes:
      logging.warning("resuming %s at step %d with a changed config (history in config.<step>.json):"
                      "\n  %s", workdir, start, "\n  ".join(changes))
  for name in ("config.json", f"config.{start}.json"):
    with open(os.path.join(workdir, name), "w") as f:
      f.write(text)


def _last_record(workdir: str, step: int) -> dict:
  """The last metrics.jsonl record at or before ``step`` (just the step if there is none)."""
  last = {"step": step}
  path = os.path.join(workdir, "metrics.jsonl")
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip() and json.loads(line)["step"] <= step:
          last = json.loads(line)
  return last


def train(config, workdir: str, *, stop_at: Callable[[int], bool] | None = None) -> dict:
  """Train ``config`` in ``workdir``; returns the last logged metrics.

  ``stop_at(step)`` (for tests) acts like a preemption after that step.
  """
  cfg = validate(config, jax.process_count())
  mesh = sharding.make_mesh(config.mesh)
  batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
  t = config.train
  if t.batch_size % batch_shards:
    raise ValueError(f"train.batch_size ({t.batch_size}) must be a multiple of the data x fsdp "
                     f"mesh size ({batch_shards})")
  rules = sharding.rules(config)
  setup = state_lib.create(cfg, t, mesh, rules, config.data.seq_len)
  step_fn = train_step.jit_train_step(setup, t, mesh, rules)
  os.makedirs(workdir, exist_ok=True)

  iterator = data.make_train_iterator(config.data, seed=config.seed, global_batch_size=t.batch_size,
                                      process_index=jax.process_index(),
                                      process_count=jax.process_count())
  mngr = checkpoint.manager(workdir, t.keep_checkpoints)
  seq_len = config.data.seq_len
  peak = costs.peak_flops(jax.devices()[0].device_kind, t.peak_tflops)
  log = logger.MetricsLogger(workdir, t.num_steps, t.batch_size * seq_len,
                             costs.flops_per_token(cfg, seq_len),
                             None if peak is None else peak * jax.device_count())

  expected = checkpoint.param_shapes(setup.abstract_state.params)
  try:
    state, latest = checkpoint.restore_newest(mngr, setup.abstract_state, iterator, expected)
    if latest is None:
      state = setup.init(jax.random.key(config.seed))
      if config.init_from:
        params, _ = init_from.load(config.init_from, state.params, setup.shardings.params)
        state = state.replace(params=params)
  except BaseException:
    mngr.close()
    log.close()
    raise
  if latest is not None:
    log.truncate(latest)
    logging.info("resumed from step %d of %s", latest, mngr.directory)
    if latest >= t.num_steps:
      logging.warning("%s is already at step %d >= train.num_steps %d; nothing to do (raise "
                      "--config.train.num_steps to train further)", workdir, latest, t.num_steps)
      mngr.close()
      log.close()
      return _last_record(workdir, latest)
  else:
    log.truncate(0)
  start = int(jax.device_get(state.step))
  _write_config(config, workdir, start)
  preempted = _Preemption()

  pending: list[tuple[int, dict]] = []
  last = {}

  def check_and_log():
    """Fetch pending metrics; stop on a non-finite loss; log every ``log_every`` step."""
    nonlocal last
    for step, m in jax.device_get(pending):
      m = {k: float(v) for k, v in m.items()}
      if not (np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])):
        log.write(step, m)  # the failing step is in metrics.jsonl too
        mngr.wait_until_finished()
        good = mngr.latest_step()
        where = (f"The last good checkpoint is step {good} in {mngr.directory}." if good is not None
                 else f"No checkpoint saved yet (the first is due at step {t.checkpoint_every}).")
        raise FloatingPointError(
            f"loss is {m['loss']} (grad norm {m['grad_norm']}) at step {step}: stopping. {where}")
      if step % t.log_every == 0 or step == t.num_steps:
        log.write(step, m)
      last = {"step": step, **m}
    pending.clear()

  logging.info("training %s from step %d to %d on mesh %s", cfg.layers(), start, t.num_steps,
               dict(mesh.shape))
  try:
    for step in range(start + 1, t.num_steps + 1):
      batch = sharding.global_batch(next(iterator), mesh)
      state, metrics = step_fn(state, batch)
      pending.append((step, metrics))
      if step == start + 1:  # the first step compiles: time throughput from here on
        jax.block_until_ready(metrics)
        log.mark(step)
      stop = preempted(step) or (stop_at is not None and stop_at(step))
      save = stop or step % t.checkpoint_every == 0 or step == t.num_steps
      if save or step % t.log_every == 0:
        check_and_log()
      if save:
        checkpoint.save(mngr, step, state, iterator, force=True)
      if stop:
        logging.info("preempted: saved step %d, exiting", step)
        break
    check_and_log()
  finally:
    mngr.wait_until_finished()
    mngr.close()
    log.close()
    preempted.restore()
  return last
