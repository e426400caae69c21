"""Evaluators: MQAR accuracy by number of pairs, needle accuracy by length x depth, text
perplexity by position bucket. Each writes ``workdir/eval/<task>_step<step>.json`` and PNG plots.

The model enters only as ``logits_fn(inputs int32 (b, t)) -> logits (b, t, vocab)``, so this
module knows nothing of Flax, meshes or checkpoints. Evaluation sets come from ``lm.data`` and
depend on ``data.eval_seed`` only, so runs with different training seeds meet the same examples.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import ml_collections
import numpy as np
from etils import epath
from scipy.special import logsumexp
from tqdm.auto import tqdm

from lm import data, plots

LogitsFn = Callable[[np.ndarray], np.ndarray]


def _score(logits_fn: LogitsFn, examples: dict, batch_size: int, pbar) -> tuple:
  """Greedy predictions and per-position negative log-likelihood of the targets, (n, t) each.

  Every call gets exactly ``batch_size`` rows (the last batch is filled with padding rows whose
  results are dropped), so a jitted ``logits_fn`` compiles once per sequence length.
  """
  inputs, targets = examples["inputs"], examples["targets"]
  preds, nll = [], []
  for i in range(0, len(inputs), batch_size):
    rows = inputs[i:i + batch_size]
    b = len(rows)
    batch = np.pad(rows, ((0, batch_size - b), (0, 0)), constant_values=data.PAD)
    logits = np.asarray(logits_fn(batch), np.float32)
    if logits.ndim != 3 or logits.shape[:2] != batch.shape or logits.shape[2] <= targets.max():
      raise ValueError(f"logits_fn must map int32 inputs {batch.shape} to logits of shape "
                       f"(b, t, vocab) = ({batch_size}, {batch.shape[1]}, >= "
                       f"{targets.max() + 1}); got {logits.shape}")
    logits = logits[:b]
    tgt = targets[i:i + b]
    preds.append(logits.argmax(-1))
    picked = np.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
    nll.append(logsumexp(logits, axis=-1) - picked)
    pbar.update(b)
  return np.concatenate(preds), np.concatenate(nll)


def _progress(total: int, name: str):
  return tqdm(total=total, desc=f"eval {name}", unit="ex", leave=False, mininterval=2.0)


def eval_mqar(c: ml_collections.ConfigDict, logits_fn: LogitsFn, batch_size: int) -> dict:
  """Accuracy on the queries of every ``data.eval_settings`` (seq_len, num_pairs), Zoology's metric:
  the fraction of answer positions whose argmax is the queried key's value."""
  settings = []
  with _progress(len(c.eval_settings) * c.num_eval_examples, "mqar") as pbar:
    for i, (seq_len, num_pairs) in enumerate(c.eval_settings):
      ex = data.mqar_eval_set(c, i)
      preds, _ = _score(logits_fn, ex, batch_size, pbar)
      w = ex["weights"] > 0
      correct = int((preds == ex["targets"])[w].sum())
      settings.append({"seq_len": int(seq_len), "num_pairs": int(num_pairs),
                       "accuracy": correct / int(w.sum()), "correct": correct,
                       "queries": int(w.sum())})
  by_pairs = {}
  for k in sorted({s["num_pairs"] for s in settings}):
    same = [s for s in settings if s["num_pairs"] == k]
    by_pairs[str(k)] = sum(s["correct"] for s in same) / sum(s["queries"] for s in same)
  return {"accuracy": sum(s["correct"] for s in settings) / sum(s["queries"] for s in settings),
          "accuracy_by_num_pairs": by_pairs, "settings": settings}


def eval_niah(c: ml_collections.ConfigDict, logits_fn: LogitsFn, batch_size: int) -> dict:
  """Exact-match accuracy (every value token right) per context length x needle depth cell,
  and its means by depth (the recency-bias picture) and by length."""
  lengths, depths = list(c.eval_lengths), list(c.eval_depths)
  grid = np.zeros((len(depths), len(lengths)))
  with _progress(grid.size * c.num_eval_examples, "niah") as pbar:
    for j in range(len(lengths)):
      for i in range(len(depths)):
        ex = data.niah_eval_set(c, j, i)
        preds, _ = _score(logits_fn, ex, batch_size, pbar)
        hit = (preds == ex["targets"]) | (ex["weights"] == 0)
        grid[i, j] = hit.all(axis=1).mean()
  return {"accuracy": float(grid.mean()), "lengths": lengths, "depths": depths,
          "accuracy_grid": grid.tolist(),  # [depth][length]
          "accuracy_by_depth": grid.mean(axis=1).tolist(),
          "accuracy_by_length": grid.mean(axis=0).tolist()}


def eval_text(c: ml_collections.ConfigDict, logits_fn: LogitsFn, batch_size: int) -> dict:
  """Perplexity of held-out byte windows, overall and per bucket of positions."""
  ex = data.text_eval_set(c)
  with _progress(len(ex["inputs"]), "text") as pbar:
    _, nll = _score(logits_fn, ex, batch_size, pbar)
  per_position = nll.mean(axis=0)
  buckets = np.array_split(np.arange(nll.shape[1]), min(c.eval_num_buckets, nll.shape[1]))
  bucket_nll = [float(per_position[b].mean()) for b in buckets]
  return {"perplexity": float(np.exp(nll.mean())), "bits_per_byte": float(nll.mean() / np.log(2)),
          "windows": int(nll.shape[0]),
          "bucket_edges": [int(b[0]) for b in buckets] + [int(nll.shape[1])],
          "nll_by_bucket": bucket_nll, "perplexity_by_bucket": np.exp(bucket_nll).tolist(),
          "perplexity_by_position": np.exp(per_position).tolist()}


_EVALUATORS = {"mqar": eval_mqar, "niah": eval_niah, "text": eval_text}


def _plot(name: str, m: dict, out: epath.Path, step: int) -> list[str]:
  if name == "mqar":
    s = m["settings"]
    return [plots.accuracy_curve(out / f"mqar_accuracy_step{step}.png",
                                 [x["num_pairs"] for x in s], [x["accuracy"] for x in s],
                                 [x["seq_len"] for x in s], f"MQAR accuracy, step {step}")]
  if name == "niah":
    grid = np.asarray(m["accuracy_grid"])
    return [plots.heatmap(out / f"niah_heatmap_step{step}.png", grid, m["lengths"], m["depths"],
                          f"needle accuracy, step {step}"),
            plots.depth_curve(out / f"niah_depth_step{step}.png", m["depths"], grid,
                              m["lengths"], f"needle accuracy by depth, step {step}")]
  return [plots.perplexity_curve(out / f"text_perplexity_step{step}.png",
                                 np.asarray(m["perplexity_by_position"]), m["bucket_edges"],
                                 m["perplexity_by_bucket"], f"perplexity by position, step {step}")]


def evaluate(data_config: ml_collections.ConfigDict, logits_fn: LogitsFn, workdir: str, *,
             step: int, batch_size: int, write: bool = True) -> dict:
  """Runs the evaluator of ``data_config.name`` and returns its metrics.

  ``logits_fn(inputs int32 (batch_size, t)) -> (batch_size, t, vocab)``; calls of one
  evaluation setting share t, different settings may differ. With ``write`` (on one process of
  a multi-host job, say), writes ``workdir/eval/<name>_step<step>.json`` and the PNG plots; the
  returned dict lists them under ``files``.
  """
  if data_config.name not in _EVALUATORS:
    raise ValueError(f"data.name must be one of {sorted(_EVALUATORS)}; got {data_config.name!r}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1; got {batch_size}")
  if data_config.get("num_eval_examples", 1) < 1:
    raise ValueError(f"data.num_eval_examples must be >= 1; got {data_config.num_eval_examples}")
  name = data_config.name
  metrics = {"task": name, "step": int(step), **_EVALUATORS[name](data_config, logits_fn,
                                                                 batch_size)}
  if write:
    out = epath.Path(workdir) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}_step{step}.json"
    files = [str(path), *_plot(name, metrics, out, step)]
    metrics["files"] = files
    record = {**metrics, "data_config": data_config.to_dict()}
    path.write_text(json.dumps(record, indent=1, default=str))
  return metrics
