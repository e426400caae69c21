"""Evaluate a checkpoint: restore its params onto the current mesh and run ``lm.evals``.

Only the params are read (not the optimizer), onto the shardings this mesh gives them, so a
checkpoint written on one mesh is evaluated on any other. ``config.eval.mode`` picks teacher-forced
scoring (one forward per example) or, for needle retrieval, greedy generation (``lm.generate``,
same params, prompts split over the mesh's batch axes when the batch size allows). ``count``
reports sizes without allocating the model.

The run's saved ``config.json`` is the reference: ``config_variant`` lists how a config differs
from it in the sections that change the scores (``data``, ``model``). A model change that changes
the maths (anything but ``MODEL_KEYS_SAME_MATH``) is refused unless allowed, since the saved
parameters were trained for the saved model; a differing config writes its results under
``<workdir>/variants/<tag>/eval/`` so that no config's results overwrite another's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import jax
import ml_collections
import numpy as np
from absl import logging

from lm import checkpoint, costs, data, evals, generate, sharding, state as state_lib
from lm.config import config_changes
from lm.model import ModelConfig


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a training run saved in its workdir."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: pass --config, or a --workdir written by train.py")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


class ModelChangeError(ValueError):
  """The config asks for another model than the checkpoint was trained as."""


# Model keys that select an implementation of the same function (kernels, tiles, what the backward
# keeps, how the loop over depth is compiled); every other model key changes it.
MODEL_KEYS_SAME_MATH = ("impl", "chunk_size", "attention_impl", "remat", "conv_impl",
                        "scan_unroll")


def config_variant(config, workdir: str, *, allow_model_change: bool = False) -> str | None:
  """None if ``config`` scores like the run's saved config; else a directory-safe tag naming the
  changed keys. ValueError for a model change that changes the maths, unless allowed."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    saved = json.load(f)
  changes = [c for c in config_changes(saved, config) if c.startswith(("data.", "model."))]
  if not changes:
    return None
  keys = [c.split(":", 1)[0] for c in changes]
  maths = [c for c, k in zip(changes, keys)
           if k.startswith("model.") and k.split(".", 1)[1] not in MODEL_KEYS_SAME_MATH]
  if maths and not allow_model_change:
    raise ModelChangeError(f"the config changes the model that {workdir} was trained as:\n  "
                     + "\n  ".join(maths) + "\nthe checkpoint's parameters belong to the saved "
                     "model (config.json); pass --allow_model_change to evaluate them this way "
                     "anyway")
  now = json.loads(config.to_json_best_effort())
  parts = []
  for k in keys:
    node = now
    for part in k.split("."):
      node = node.get(part, "absent") if isinstance(node, dict) else "absent"
    parts.append(f"{k}={node}")
  tag = re.sub(r"[^A-Za-z0-9_.=,-]+", "_", ",".join(parts))
  if len(tag) > 80:
    tag = tag[:64] + "-" + hashlib.sha1(tag.encode()).hexdigest()[:8]
  return tag


def count(config) -> dict:
  """Parameter counts and per-sequence decode memory of ``config``'s model (nothing allocated)."""
  data.resolve_vocab_size(config.data)
  cfg = ModelConfig.from_config(config)
  return {**costs.count_params(cfg), **costs.state_bytes(cfg, config.data.seq_len),
          "flops_per_token": costs.flops_per_token(cfg, config.data.seq_len)}


def evaluate(config, workdir: str, step: int | None = None, mode: str | None = None, *,
             allow_model_change: bool = False) -> dict:
  """Restore ``step`` (default: the newest that reads back) of ``workdir`` and run the evaluators
  of ``config.data``, in ``mode`` (default ``config.eval.mode``; "teacher_forced" for configs
  saved before it). A config that differs from the saved one writes under ``variants/<tag>/``
  (``config_variant``; a model change needs ``allow_model_change``)."""
  mode = mode or config.eval.get("mode", "teacher_forced")
  evals.check_mode(config.data.name, mode)  # before anything is restored
  variant = config_variant(config, workdir, allow_model_change=allow_model_change)
  out_root = workdir
  if variant is not None:
    out_root = os.path.join(workdir, "variants", variant)
    os.makedirs(out_root, exist_ok=True)
    with open(os.path.join(out_root, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
    logging.info("config differs from %s/config.json: results go to %s", workdir, out_root)
  data.resolve_vocab_size(config.data)
  cfg = ModelConfig.from_config(config)
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.rules(config)
  setup = state_lib.create(cfg, config.train, mesh, rules, config.data.seq_len)
  params, step_dir = checkpoint.load_newest_params(workdir, setup.abstract_state.params, step)
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

  return evals.evaluate(config.data, logits_fn, out_root, step=int(step_dir.name),
                        batch_size=config.eval.batch_size, mode=mode, generate_fn=generate_fn)
