"""Evaluators: MQAR accuracy by number of pairs, needle accuracy by length x depth, text
perplexity by position bucket. Each writes ``workdir/eval/<task>_step<step>.json`` and PNG plots.

Two modes (``config.eval.mode``): "teacher_forced" scores the argmax of one forward over each
example; "generate" (needle retrieval only) feeds the prompt up to the query and scores the greedy
continuation, written as ``<task>_generate_step<step>.json``. For greedy decoding the two agree
exactly: every teacher-forced argmax of the answer is right iff generation reproduces it.

The model enters only as ``logits_fn(inputs int32 (b, t)) -> logits (b, t, vocab)`` (text:
``logits_fn(inputs, segment_ids)``, packed documents) or
``generate_fn(prompts int32 (b, p), num_tokens) -> tokens int32 (b, num_tokens)``, so this module
knows nothing of Flax, meshes or checkpoints. Evaluation sets come from ``lm.data`` and depend on
``data.eval_seed`` only, so runs with different training seeds meet the same examples.
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
GenerateFn = Callable[[np.ndarray, int], np.ndarray]

MODES = ("teacher_forced", "generate")


def _score(logits_fn: LogitsFn, examples: dict, batch_size: int, pbar) -> tuple:
  """Greedy predictions and per-position negative log-likelihood of the targets, (n, t) each.

  Every call gets exactly ``batch_size`` rows (the last batch is filled with padding rows whose
  results are dropped), so a jitted ``logits_fn`` compiles once per sequence length.
  """
  inputs, targets = examples["inputs"], examples["targets"]
  segments = examples.get("segment_ids")
  pad = lambda x: np.pad(x, ((0, batch_size - len(x)), (0, 0)), constant_values=data.PAD)
  preds, nll = [], []
  for i in range(0, len(inputs), batch_size):
    rows = inputs[i:i + batch_size]
    b = len(rows)
    batch = pad(rows)
    logits = np.asarray(logits_fn(batch) if segments is None else
                        logits_fn(batch, pad(segments[i:i + batch_size])), np.float32)
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


def _generate(generate_fn: GenerateFn, prompts: np.ndarray, num_tokens: int, batch_size: int,
              pbar) -> np.ndarray:
  """Greedy continuations (n, num_tokens) of prompts (n, p), ``batch_size`` rows per call (the
  last batch filled with padding rows whose results are dropped: one compile per prompt length)."""
  out = []
  for i in range(0, len(prompts), batch_size):
    rows = prompts[i:i + batch_size]
    b = len(rows)
    batch = np.pad(rows, ((0, batch_size - b), (0, 0)), constant_values=data.PAD)
    tokens = np.asarray(generate_fn(batch, num_tokens))
    if tokens.shape != (batch_size, num_tokens):
      raise ValueError(f"generate_fn must map prompts {batch.shape} and num_tokens={num_tokens} "
                       f"to tokens of shape ({batch_size}, {num_tokens}); got {tokens.shape}")
    out.append(tokens[:b])
    pbar.update(b)
  return np.concatenate(out)


def _answer_span(examples: dict, where: str) -> tuple[int, int]:
  """(start, stop): the positions with weight > 0, one contiguous span shared by every row."""
  w = examples["weights"] > 0
  pos = np.flatnonzero(w[0])
  if not len(pos) or (w != w[0]).any() or pos[-1] - pos[0] + 1 != len(pos):
    raise ValueError(f"{where}: scoring by generation needs one contiguous answer span at the same "
                     f"positions in every example")
  return int(pos[0]), int(pos[-1]) + 1


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


def _niah_grid(c: ml_collections.ConfigDict, name: str, cell: Callable) -> dict:
  """``cell(examples, label, pbar) -> exact-match accuracy`` of every (length, depth) cell, as the
  grid [depth][length] and its means."""
  lengths, depths = list(c.eval_lengths), list(c.eval_depths)
  grid = np.zeros((len(depths), len(lengths)))
  with _progress(grid.size * c.num_eval_examples, name) as pbar:
    for j in range(len(lengths)):
      for i in range(len(depths)):
        label = f"niah cell (length {lengths[j]}, depth {depths[i]})"
        grid[i, j] = cell(data.niah_eval_set(c, j, i), label, pbar)
  return _niah_metrics(grid, lengths, depths)


def eval_niah(c: ml_collections.ConfigDict, logits_fn: LogitsFn, batch_size: int) -> dict:
  """Exact-match accuracy (every value token right) per context length x needle depth cell,
  and its means by depth (the recency-bias picture) and by length."""

  def cell(ex, label, pbar):
    preds, _ = _score(logits_fn, ex, batch_size, pbar)
    return ((preds == ex["targets"]) | (ex["weights"] == 0)).all(axis=1).mean()

  return _niah_grid(c, "niah", cell)


def eval_niah_generate(c: ml_collections.ConfigDict, generate_fn: GenerateFn,
                       batch_size: int) -> dict:
  """``eval_niah``'s exact-match grid, scored by generation: the prompt is each example's inputs
  up to and including the last key token of the query (the position that predicts the first value
  token), and the value_len greedily generated tokens must equal the value."""

  def cell(ex, label, pbar):
    start, stop = _answer_span(ex, label)
    got = _generate(generate_fn, ex["inputs"][:, :start + 1], stop - start, batch_size, pbar)
    return (got == ex["targets"][:, start:stop]).all(axis=1).mean()

  return _niah_grid(c, "niah generate", cell)


def _niah_metrics(grid: np.ndarray, lengths: list, depths: list) -> dict:
  return {"accuracy": float(grid.mean()), "lengths": lengths, "depths": depths,
          "accuracy_grid": grid.tolist(),  # [depth][length]
          "accuracy_by_depth": grid.mean(axis=1).tolist(),
          "accuracy_by_length": grid.mean(axis=0).tolist()}


def _text_scores(nll, w, nbytes) -> dict:
  """Loss per token, perplexity and bits per byte of the scored tokens (weights w)."""
  tokens = float(w.sum())
  out = {"tokens": int(tokens), "loss": float((nll * w).sum() / max(tokens, 1.0))}
  out["perplexity"] = float(np.exp(out["loss"]))
  if nbytes is not None:
    total = float((nbytes * w).sum())
    out["bytes"] = int(total)
    out["bits_per_byte"] = float((nll * w).sum() / (np.log(2) * total)) if total else None
  return out


def eval_text(c: ml_collections.ConfigDict, logits_fn: LogitsFn, batch_size: int) -> dict:
  """Held-out documents packed into windows of eval_seq_len: loss per token (nats), perplexity and
  bits per byte (total nats / (ln 2 * total UTF-8 bytes of the scored targets): comparable across
  tokenizers), overall and per bucket of positions, a token's position being how many earlier
  tokens of its own document it sees (the context it has, up to the window length). Per position
  too, with the scored tokens at each (so that other buckets can be formed from it).

  Scored: every target of the same document as its input (weights 1), the end-of-document token
  included (0 bytes: its nats count against the document's bytes); not a document's first token
  predicted from the previous one. Bits per byte needs the dataset's per-token byte lengths
  (``lm.text_prep`` writes them; a Megatron corpus has none, so it is left out there).
  """
  ex = data.text_eval_set(c)
  with _progress(len(ex["inputs"]), "text") as pbar:
    _, nll = _score(logits_fn, ex, batch_size, pbar)
  w, pos, nbytes = ex["weights"], ex["positions"], ex.get("target_bytes")
  length = nll.shape[1]
  buckets = np.array_split(np.arange(length), min(c.eval_num_buckets, length))
  edges = [int(b[0]) for b in buckets] + [length]
  by_bucket = [_text_scores(nll, w * ((pos >= lo) & (pos < hi)), nbytes)
               for lo, hi in zip(edges[:-1], edges[1:])]
  nats = np.bincount(pos.ravel(), weights=(nll * w).ravel(), minlength=length)
  counts = np.bincount(pos.ravel(), weights=w.ravel(), minlength=length)
  per_position = [float(a / n) if n else None for a, n in zip(nats, counts)]
  return {**_text_scores(nll, w, nbytes), "windows": int(nll.shape[0]), "context": length,
          "bucket_edges": edges, "by_bucket": by_bucket,
          "nll_by_bucket": [b["loss"] if b["tokens"] else None for b in by_bucket],
          "perplexity_by_bucket": [b["perplexity"] if b["tokens"] else None for b in by_bucket],
          "bits_per_byte_by_bucket": [b.get("bits_per_byte") for b in by_bucket],
          "perplexity_by_position": [None if x is None else float(np.exp(x)) for x in per_position],
          "tokens_by_position": [int(n) for n in counts]}


_EVALUATORS = {"mqar": eval_mqar, "niah": eval_niah, "text": eval_text}
_GENERATE_EVALUATORS = {"niah": eval_niah_generate}  # tasks with one answer span per example
GENERATE_TASKS = tuple(_GENERATE_EVALUATORS)


def check_mode(task: str, mode: str) -> None:
  """ValueError naming ``eval.mode`` unless ``mode`` is known and task ``task`` supports it."""
  if mode not in MODES:
    raise ValueError(f"eval.mode must be one of {MODES}; got {mode!r}")
  if mode == "generate" and task not in GENERATE_TASKS:
    why = {"mqar": "its queries are interleaved with the context, each scored in place",
           "text": "perplexity scores every position, not one answer"}.get(task, "")
    raise ValueError(f"eval.mode='generate' (eval.py --generate) is not supported for "
                     f"data.name={task!r}{': ' + why if why else ''}; it supports "
                     f"{GENERATE_TASKS}. Use eval.mode='teacher_forced'.")


def _plot(name: str, m: dict, out: epath.Path, step: int) -> list[str]:
  if m.get("mode") == "generate":
    grid = np.asarray(m["accuracy_grid"])
    return [plots.heatmap(out / f"{name}_generate_heatmap_step{step}.png", grid, m["lengths"],
                          m["depths"], f"needle accuracy (greedy generation), step {step}"),
            plots.depth_curve(out / f"{name}_generate_depth_step{step}.png", m["depths"], grid,
                              m["lengths"], f"needle accuracy by depth (generation), step {step}")]
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
  nan = lambda xs: np.asarray([np.nan if x is None else x for x in xs], np.float64)
  return [plots.perplexity_curve(out / f"text_perplexity_step{step}.png",
                                 nan(m["perplexity_by_position"]), m["bucket_edges"],
                                 nan(m["perplexity_by_bucket"]),
                                 f"perplexity by position in the document, step {step}")]


def evaluate(data_config: ml_collections.ConfigDict, logits_fn: LogitsFn | None, workdir: str, *,
             step: int, batch_size: int, write: bool = True, mode: str = "teacher_forced",
             generate_fn: GenerateFn | None = None) -> dict:
  """Runs the evaluator of ``data_config.name`` and returns its metrics.

  ``mode="teacher_forced"``: ``logits_fn(inputs int32 (batch_size, t)) -> (batch_size, t,
  vocab)``; calls of one evaluation setting share t, different settings may differ.
  ``mode="generate"`` (tasks in ``GENERATE_TASKS``): ``generate_fn(prompts int32 (batch_size, p),
  num_tokens) -> greedy continuations int32 (batch_size, num_tokens)``; logits_fn is unused.
  With ``write`` (on one process of a multi-host job, say), writes
  ``workdir/eval/<name>_step<step>.json`` (``<name>_generate_step<step>.json`` when generating)
  and the PNG plots; the returned dict lists them under ``files``.
  """
  if data_config.name not in _EVALUATORS:
    raise ValueError(f"data.name must be one of {sorted(_EVALUATORS)}; got {data_config.name!r}")
  check_mode(data_config.name, mode)
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1; got {batch_size}")
  if data_config.get("num_eval_examples", 1) < 1:
    raise ValueError(f"data.num_eval_examples must be >= 1; got {data_config.num_eval_examples}")
  name = data_config.name
  if mode == "generate":
    if generate_fn is None:
      raise ValueError("eval.mode='generate' needs a generate_fn")
    scores = _GENERATE_EVALUATORS[name](data_config, generate_fn, batch_size)
  else:
    if logits_fn is None:
      raise ValueError("eval.mode='teacher_forced' needs a logits_fn")
    scores = _EVALUATORS[name](data_config, logits_fn, batch_size)
  metrics = {"task": name, "mode": mode, "step": int(step), **scores}
  if write:
    out = epath.Path(workdir) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}{'_generate' if mode == 'generate' else ''}_step{step}.json"
    files = [str(path), *_plot(name, metrics, out, step)]
    metrics["files"] = files
    record = {**metrics, "data_config": data_config.to_dict()}
    path.write_text(json.dumps(record, indent=1, default=str))
  return metrics
