"""Evaluate a checkpoint: restore its params onto the current mesh and run ``lm.evals``.

Only the params are read (not the optimizer), onto the shardings this mesh gives them, so a
checkpoint written on one mesh is evaluated on any other. ``config.eval.mode`` picks teacher-forced
scoring (one forward per example) or, for needle retrieval, greedy generation (``lm.generate``,
same params, prompts split over the mesh's batch axes when the batch size allows). ``count``
reports sizes without allocating the model.
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections
import numpy as np
from absl import logging

from lm import checkpoint, costs, data, evals, generate, sharding, state as state_lib
from lm.model import ModelConfig


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a training run saved in its workdir."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: pass --config, or a --workdir written by train.py")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def count(config) -> dict:
  """Parameter counts and per-sequence decode memory of ``config``'s model (nothing allocated)."""
  data.resolve_vocab_size(config.data)
  cfg = ModelConfig.from_config(config)
  return {**costs.count_params(cfg), **costs.state_bytes(cfg, config.data.seq_len),
          "flops_per_token": costs.flops_per_token(cfg, config.data.seq_len)}


def evaluate(config, workdir: str, step: int | None = None, mode: str | None = None) -> dict:
  """Restore ``step`` (default: latest) of ``workdir`` and run the evaluators of ``config.data``,
  in ``mode`` (default ``config.eval.mode``; "teacher_forced" for configs saved before it)."""
  mode = mode or config.eval.get("mode", "teacher_forced")
  evals.check_mode(config.data.name, mode)  # before anything is restored
  data.resolve_vocab_size(config.data)
  cfg = ModelConfig.from_config(config)
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.rules(config)
  setup = state_lib.create(cfg, config.train, mesh, rules, config.data.seq_len)
  step_dir = checkpoint.step_dir(workdir, step)
  abstract = setup.abstract_state.params
  checkpoint.check_matches(checkpoint.saved_param_shapes(step_dir), checkpoint.param_shapes(abstract),
                           str(step_dir))
  params = checkpoint.load_params(step_dir, abstract)
  logging.info("evaluating %s", step_dir)
  apply = jax.jit(lambda p, x, s: setup.model.apply({"params": p}, x, segment_ids=s))

  def logits_fn(inputs: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
    seg = None if segment_ids is None else np.asarray(segment_ids, np.int32)
    return np.asarray(apply(params, np.asarray(inputs, np.int32), seg))

  batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
  split = jax.process_count() == 1 and config.eval.batch_size % batch_shards == 0

  def generate_fn(prompts: np.ndarray, num_tokens: int) -> np.ndarray:
    """Greedy continuations (b, num_tokens) of prompts (b, p), under the params' shardings."""
    prompts = np.asarray(prompts, np.int32)
    if split:
      prompts = jax.device_put(prompts, sharding.batch_sharding(mesh))
    tokens = generate.generate({"params": params}, cfg, prompts, num_tokens, temperature=0.0)
    return np.asarray(tokens[:, prompts.shape[1]:])

  return evals.evaluate(config.data, logits_fn, workdir, step=int(step_dir.name),
                        batch_size=config.eval.batch_size, mode=mode, generate_fn=generate_fn)
