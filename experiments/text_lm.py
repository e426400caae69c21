"""Real text (docs/results.md, section 5): a small LM, Gated DeltaNet (E = 1) vs Triadic GDN
(E = 8) vs attention (and optionally the 3:1 triadic / attention hybrid), perplexity by position
in the document: the triadic paper's main plot, at a size that trains in a few GPU minutes. Every
run is --text_config (configs/text.py:gpu: 8 layers, d_model 512) with its mixer, the same size and
budget, trained at --train_len and evaluated on windows of --eval_len (data.eval_seq_len), so
that the curve covers positions past the training length. With --extend_steps, each run is then
trained on at --eval_len from its final checkpoint (the paper's context extension; attention's
RoPE base raised to 2M as lm.paper_configs does) and evaluated again.

Corpus: the Python standard library (every module and test, site-packages left out; 9.4M tokens
of a byte-level BPE of 4096, 88 held-out documents), prepared on a machine with ``tokenizers``:

  S=$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))'); mkdir -p /tmp/pystdlib
  (cd "$S" && find . -name '*.py' -not -path './site-packages/*' -print0 | tar --null -cf - -T -) \
      | tar -xf - -C /tmp/pystdlib
  python -m lm.text_prep --input='/tmp/pystdlib/**/*.py' --out=data/pystdlib_all \
      --vocab_size=4096 --eval_fraction=0.05
  python -m experiments.text_lm --workdir runs/text_lm --parallel 3 --seeds 1 --deadline_s 480 \
      --out docs/figures/text_lm

Runs are named ``text_<mixer>_seed<s>`` (``text_<mixer>_ext_seed<s>`` extended). Writes
text_lm.{png,json} and runs.json (experiments/common.py) to --out and prints the markdown table:
perplexity per bucket of positions (powers of two), mean ± half-range over seeds.
"""

from __future__ import annotations

import math
import os

import numpy as np
from absl import app, flags
from matplotlib.figure import Figure

from experiments import common, sweep
from lm import data, eval_loop

TEXT_CONFIG = flags.DEFINE_string("text_config", "configs/text.py:gpu", "The config of every run "
                                  "(configs/text.py: the CPU-sized one).")
DATA = flags.DEFINE_string("data", "data/pystdlib_all", "A corpus written by lm.text_prep.")
TRAIN_LEN = flags.DEFINE_integer("train_len", 4096, "Training sequence length (data.seq_len).")
EVAL_LEN = flags.DEFINE_integer("eval_len", 16384, "Evaluation window (data.eval_seq_len).")
MIXERS = flags.DEFINE_list("mixers", ["gdn", "triadic_e8", "attention"], "Which of gdn, "
                           "triadic_e8, attention, hybrid to train.")
EXTEND_STEPS = flags.DEFINE_integer("extend_steps", 0, "If > 0, also train every run on this many "
                                    "steps at --eval_len from its final checkpoint (same tokens "
                                    "per step) and evaluate that too.")

HYBRID = ",".join(["triadic_gdn"] * 3 + ["attention"])
MIXER_ITEMS = {  # mixer -> model overrides
    "gdn": ("config.model.mixer=triadic_gdn", "config.model.expand_e=1"),
    "triadic_e8": ("config.model.mixer=triadic_gdn", "config.model.expand_e=8"),
    "attention": ("config.model.mixer=attention", "config.model.expand_e=1"),
    "hybrid": ("config.model.mixer=triadic_gdn", "config.model.expand_e=8",
               f"config.model.layer_pattern={HYBRID}"),
}
EXTENDED_ROPE_BASE = 2e6  # lm.paper_configs' 64k extension


def text_run(mixer: str, seed: int) -> sweep.Run:
  """``mixer`` trained at --train_len, evaluated at --eval_len."""
  if mixer not in MIXER_ITEMS:
    raise ValueError(f"--mixers: {mixer!r} is not one of {sorted(MIXER_ITEMS)}")
  items = (f"config.data.path={DATA.value}", f"config.data.seq_len={TRAIN_LEN.value}",
           f"config.data.eval_seq_len={EVAL_LEN.value}", *MIXER_ITEMS[mixer], f"config.seed={seed}")
  return sweep.Run(f"text_{mixer}_seed{seed}", TEXT_CONFIG.value, common.overrides(*items),
                   group={"mixer": mixer, "stage": "4k", "seed": seed})


def extended_run(base: sweep.Run) -> sweep.Run:
  """``base`` trained on --extend_steps steps at --eval_len from its final checkpoint, with as many
  tokens per step (fewer rows) and a tenth of the steps as warmup."""
  rows = common.run_config(base).train.batch_size * TRAIN_LEN.value // EVAL_LEN.value
  steps = EXTEND_STEPS.value
  items = [f"config.data.seq_len={EVAL_LEN.value}", f"config.train.batch_size={max(1, rows)}",
           f"config.train.num_steps={steps}", f"config.train.warmup_steps={max(1, steps // 10)}",
           f"config.train.checkpoint_every={steps}"]
  if base.group["mixer"] in ("attention", "hybrid"):
    items.append(f"config.model.rope_base={EXTENDED_ROPE_BASE}")
  g = base.group
  return sweep.Run(f"text_{g['mixer']}_ext_seed{g['seed']}", base.config,
                   (*base.overrides, *(f"--{x}" for x in items)), after=base.name,
                   group={**g, "stage": "extended"})


def runs() -> list[sweep.Run]:
  """Every --mixers mixer at every seed, then (with --extend_steps) each one extended."""
  base = [text_run(m, s) for m in MIXERS.value for s in common.seeds()]
  return base + ([extended_run(r) for r in base] if EXTEND_STEPS.value > 0 else [])


def label(r: sweep.Run) -> str:
  return r.group["mixer"] + (" (extended)" if r.group["stage"] == "extended" else "")


def non_embedding_params(r: sweep.Run) -> int:
  saved = os.path.exists(os.path.join(common.run_dir(r), "config.json"))
  config = eval_loop.load_config(common.run_dir(r)) if saved else common.run_config(r)
  return eval_loop.count(config)["non_embedding"]


def position_edges(context: int, first: int = 256) -> list[int]:
  """Bucket edges 0, first, 2 first, 4 first, ... up to ``context`` (its own last edge)."""
  edges = [0] + [first << k for k in range(max(0, int(math.log2(context / first)) + 1))]
  return [e for e in edges if e < context] + [context]


def bucketed(result: dict, edges: list[int]) -> list[float]:
  """Perplexity of the scored tokens in each bucket [lo, hi) of positions, from the result's
  per-position perplexity and token counts (nan where a bucket has none)."""
  ppl = np.array([np.nan if p is None else p for p in result["perplexity_by_position"]])
  n = np.asarray(result["tokens_by_position"], np.float64)
  nll = np.where(n > 0, np.log(np.where(np.isnan(ppl), 1.0, ppl)), 0.0)
  out = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    total = n[lo:hi].sum()
    out.append(float(np.exp((nll[lo:hi] * n[lo:hi]).sum() / total)) if total else float("nan"))
  return out


def curve_edges(context: int, num: int = 48) -> list[int]:
  """Log-spaced bins of positions for the plot: 0, 1, 2, ... growing to ``context``."""
  return sorted({0, *np.unique(np.geomspace(1, context, num).astype(int)).tolist(), context})


def summarise(results: dict[str, dict | None], all_runs: list[sweep.Run]) -> dict:
  """{label: summary} over the runs with a result: per seed, the overall perplexity, perplexity
  per bucket (``position_edges``) and per plot bin (``curve_edges``); their means over seeds; the
  non-embedding parameters and the steps the results come from."""
  by_label: dict = {}
  for r in all_runs:
    if results[r.name]:
      by_label.setdefault(label(r), []).append((r, results[r.name]))
  if not by_label:
    raise RuntimeError("no run of the sweep has a result")
  context = max(res["context"] for pairs in by_label.values() for _, res in pairs)
  edges, bins = position_edges(context), curve_edges(context)
  out = {}
  for key, pairs in by_label.items():
    buckets = np.array([bucketed(res, edges) for _, res in pairs])
    curves = np.array([bucketed(res, bins) for _, res in pairs])
    out[key] = {"non_embedding_params": non_embedding_params(pairs[0][0]),
                "seeds": [r.group["seed"] for r, _ in pairs],
                "steps": [res["step"] for _, res in pairs],
                "perplexity_per_seed": [res["perplexity"] for _, res in pairs],
                "bucket_edges": edges, "bucket_perplexity_per_seed": buckets.tolist(),
                "bucket_perplexity_mean": buckets.mean(axis=0).tolist(),
                "curve_edges": bins, "curve_perplexity_mean": curves.mean(axis=0).tolist()}
  return out


def plot(summary: dict, train_len: int, title: str) -> Figure:
  """Perplexity against position (log x and y: attention past its training length would
  otherwise flatten the rest), one line per mixer, the mean over seeds of each plot bin, drawn at
  the bin's geometric centre; a dashed line at the training length."""
  fig = Figure(figsize=(7, 4.3))
  ax = fig.subplots()
  for key, s in summary.items():
    e = np.asarray(s["curve_edges"], np.float64)
    centre = np.sqrt(np.maximum(e[:-1], 0.5) * e[1:])
    n = len(s["seeds"])
    ax.plot(centre, s["curve_perplexity_mean"], "-", lw=1.8, label=f"{key} (mean of {n})")
  ax.axvline(train_len, color="gray", lw=0.8, ls="--")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set(xlabel="position in the document (tokens of context)", ylabel="perplexity", title=title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return fig


def _k(n: int) -> str:
  return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def report(results: dict[str, dict | None], all_runs: list[sweep.Run]) -> str:
  """The plot, JSON and table of ``all_runs``; the text names the corpus and the size."""
  summary = summarise(results, all_runs)
  config = common.run_config(all_runs[0])
  data.resolve_vocab_size(config.data)
  m = config.model
  size = (f"{m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads of {m.head_dim}, "
          f"MLP {m.mlp_dim}, vocab {config.data.vocab_size}; "
          f"{config.train.num_steps} steps of {config.train.batch_size} x {TRAIN_LEN.value} tokens")
  corpus = config.data.path
  common.save(plot(summary, TRAIN_LEN.value, f"{os.path.basename(corpus)}: perplexity by position "
                   f"(trained at {_k(TRAIN_LEN.value)})"), "text_lm.png")
  common.write_json("text_lm.json", {"corpus": corpus, "config": all_runs[0].config, "size": size,
                                     "train_len": TRAIN_LEN.value, "eval_len": EVAL_LEN.value,
                                     "by_mixer": summary})
  edges = next(iter(summary.values()))["bucket_edges"]
  header = ["mixer", "non-emb. params", "all", *[f"{_k(lo)}–{_k(hi)}"
                                                 for lo, hi in zip(edges[:-1], edges[1:])]]
  rows = []
  for key, s in summary.items():
    b = np.asarray(s["bucket_perplexity_per_seed"])
    cells = [common.fmt(*common.mean_spread(list(col[~np.isnan(col)]))) for col in b.T]
    rows.append([key, f"{s['non_embedding_params'] / 1e6:.1f}M",
                 common.fmt(*common.mean_spread(s["perplexity_per_seed"])), *cells])
  return (f"Corpus {corpus}; model {size}; evaluated on windows of {EVAL_LEN.value} tokens.\n\n"
          + common.markdown_table(header, rows) + "\n\n" + common.steps_note(results))


def main(argv):
  del argv
  all_runs = runs()
  print(report(common.run(all_runs), all_runs))


if __name__ == "__main__":
  common.host_only()
  app.run(main)
