"""Experiment 1: triadic capacity on MQAR. Trains configs/mqar_capacity.py at E = 1, 2, 4, 8, 16
(several seeds), evaluates each on 8..512 pairs, and reports the accuracy curves and, per E, the
number of pairs at which accuracy falls below 50%.

  python -m experiments.mqar_capacity --workdir runs/papers --parallel 10 --seeds 2
  python -m experiments.mqar_capacity --workdir runs/cpu_capacity --mqar_config configs/mqar.py \
      --parallel 2 --out docs/figures/cpu   # the CPU-sized version (vocab 64, up to 31 pairs)
  python -m experiments.mqar_capacity --workdir runs/papers --parallel 10 --seeds 3 \
      --results_from <an earlier --out>/runs.json   # seeds 0, 1 stored there: trains seed 2

Zoology's protocol (each model at its best learning rate), with --lrs: phase 1 trains every E at
every learning rate with the first seed; each E's best rate is the one whose run has the highest
mean accuracy over the evaluated numbers of pairs (``lr_score``; a tie goes to the smaller rate);
phase 2 then trains the other seeds at it, the phase-1 run being the first seed's. Runs are named
``mqar_e<E>_lr<lr>_seed<s>``. On the GPU, in two calls: phase 1 (15 runs; ``--seeds 1`` leaves
phase 2 nothing), then phase 2 (10 runs), given the first call's runs.json, so that it finds
phase 1 done:

  python -m experiments.mqar_capacity --workdir runs/papers --parallel 15 --seeds 1 \
      --lrs 1e-3,3e-3,1e-2 --deterministic --deadline_s 500 --out docs/figures/zoology
  python -m experiments.mqar_capacity --workdir runs/papers --parallel 10 --seeds 3 \
      --lrs 1e-3,3e-3,1e-2 --deterministic --deadline_s 500 --out docs/figures/zoology \
      --results_from docs/figures/zoology/runs.json

Writes mqar_capacity.{png,json} and runs.json (common.py) to --out (default <workdir>/figures;
the report's are docs/figures) and prints the markdown tables of docs/results.md.
"""

from __future__ import annotations

import math
import os

import numpy as np
from absl import app, flags
from matplotlib.figure import Figure

from experiments import common, sweep
from lm import eval_loop

CONFIG = "configs/mqar_capacity.py"
CONFIG_FLAG = flags.DEFINE_string("mqar_config", CONFIG, "The config of every run (configs/mqar.py: "
                                  "the CPU-sized version, up to 31 pairs).")
E_VALUES = flags.DEFINE_list("e", ["1", "2", "4", "8", "16"], "Values of E.")
MQAR_SEEDS = flags.DEFINE_integer("mqar_seeds", None, "Seeds of this sweep, from --first_seed on "
                                   "(default: --seeds).")
LRS = flags.DEFINE_list("lrs", [], "Learning rates to sweep per E (Zoology's protocol: the first "
                        "seed at each, the other seeds at the best); empty: the config's only.")


def seeds() -> range:
  return common.seeds(MQAR_SEEDS.value)


def mqar_run(stem: str, seed: int, *items: str, lr=None, **group) -> sweep.Run:
  """The run ``mqar_<stem>_seed<seed>``: --mqar_config with the overrides ``items`` (and --set),
  grouped by ``group`` and its seed; with ``lr``, ``mqar_<stem>_lr<lr>_seed<seed>`` at that
  learning rate (grouped by it too)."""
  if lr is not None:
    lr = lr_text(lr)
    stem, items = f"{stem}_lr{lr}", (*items, f"config.train.learning_rate={lr}")
    group = {**group, "lr": float(lr)}
  return sweep.Run(f"mqar_{stem}_seed{seed}", CONFIG_FLAG.value,
                   common.overrides(*items, f"config.seed={seed}"), group={**group, "seed": seed})


def lr_text(lr) -> str:
  """``lr`` as run names write it: 1e-3 (also for 0.001), 3e-4, 2.5e-3."""
  mantissa, exponent = f"{float(lr):e}".split("e")
  return f"{float(mantissa):g}e{int(exponent)}"


def capacity_run(e: str, seed: int, lr=None) -> sweep.Run:
  """E = ``e`` at ``seed``: ``mqar_e<e>_seed<seed>`` at the config's learning rate, or
  ``mqar_e<e>_lr<lr>_seed<seed>`` at ``lr``."""
  return mqar_run(f"e{e}", seed, f"config.model.expand_e={e}", lr=lr, e=int(e))


def runs(best: dict[int, float] | None = None) -> list[sweep.Run]:
  """Every E at every seed, at the config's learning rate or, given ``best`` ({E: lr},
  ``best_lrs``), at its E's (the Es in it only)."""
  if best is None:
    return [capacity_run(e, s) for e in E_VALUES.value for s in seeds()]
  return [capacity_run(e, s, best[int(e)]) for e in E_VALUES.value if int(e) in best
          for s in seeds()]


def lr_runs() -> list[sweep.Run]:
  """Phase 1 of --lrs: every E at every learning rate, the first seed only."""
  return [capacity_run(e, seeds()[0], lr) for e in E_VALUES.value for lr in LRS.value]


def lr_score(result: dict) -> float:
  """What the learning-rate sweep maximises: the mean accuracy over the evaluated numbers of
  pairs (so a rate that learns the long settings too wins over one that learns the short ones)."""
  return float(np.mean(list(result["accuracy_by_num_pairs"].values())))


def lr_scores(results: dict[str, dict | None], phase1: list[sweep.Run]) -> dict[int, dict]:
  """{E: {lr: lr_score}} over the phase-1 runs with a result, learning rates ascending."""
  scores: dict[int, dict] = {}
  for r in sorted(phase1, key=lambda r: r.group["lr"]):
    scores.setdefault(r.group["e"], {})
    if results[r.name]:
      scores[r.group["e"]][r.group["lr"]] = lr_score(results[r.name])
  return scores


def best_lrs(scores: dict[int, dict]) -> dict[int, float]:
  """{E: its best learning rate}: the highest score, a tie to the smaller rate; an E without a
  scored run has none."""
  return {e: max(s, key=lambda lr: (s[lr], -lr)) for e, s in scores.items() if s}


def crossing(pairs: list[int], acc: list[float], level: float = 0.5) -> float:
  """Pairs at which accuracy first falls below ``level``: interpolated linearly in log2(pairs)
  between the last setting at or above it and the next; 0 if the first is below, inf if none."""
  for i, a in enumerate(acc):
    if a < level:
      if i == 0:
        return 0.0
      x0, x1 = math.log2(pairs[i - 1]), math.log2(pairs[i])
      f = (acc[i - 1] - level) / (acc[i - 1] - a)
      return 2 ** (x0 + f * (x1 - x0))
  return math.inf


def non_embedding_params(run: sweep.Run) -> int:
  """From the config the run saved in its workdir, or, for a stored result whose workdir is gone
  (--results_from), the config it trains with."""
  saved = os.path.exists(os.path.join(common.run_dir(run), "config.json"))
  config = eval_loop.load_config(common.run_dir(run)) if saved else common.run_config(run)
  return eval_loop.count(config)["non_embedding"]


def _crossing_text(c: float, pairs: list[int]) -> str:
  return f"> {pairs[-1]}" if math.isinf(c) else (f"< {pairs[0]}" if c == 0 else f"{c:.0f}")


def plot_curves(ax, pairs: list[int], per_seed: dict, label=str) -> None:
  """Accuracy against pairs on ``ax``, one colour per key of ``per_seed`` (named ``label(key)``):
  the mean over seeds (thick) and each seed (thin), so that a seed stuck at chance shows as its
  own line instead of pulling a band down."""
  for key, accs in per_seed.items():
    accs = np.asarray(accs)
    line, = ax.plot(pairs, accs.mean(axis=0), "o-", lw=2, label=f"{label(key)} (mean of {len(accs)})")
    if len(accs) > 1:
      for a in accs:
        ax.plot(pairs, a, "-", color=line.get_color(), lw=0.8, alpha=0.45)
  ax.axhline(0.5, color="gray", lw=0.8, ls="--")
  ax.set_xscale("log", base=2)
  ax.set(xlabel="key-value pairs", ylabel="accuracy", ylim=(-0.03, 1.05))
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)


def plot(pairs: list[int], per_seed: dict[int, list[list[float]]],
         lrs: dict[int, float] | None = None) -> Figure:
  """Accuracy against pairs, one colour per E (``plot_curves``), labelled with its learning rate
  if given ``lrs``."""
  fig = Figure(figsize=(6.5, 4.2))
  ax = fig.subplots()
  label = (lambda e: f"E={e}, lr {lr_text(lrs[e])}") if lrs else (lambda e: f"E={e}")
  plot_curves(ax, pairs, dict(sorted(per_seed.items())), label=label)
  ax.set_title("MQAR accuracy by E (2 layers, 4 heads, d=16); thin: seeds")
  return fig


def curves(results: dict[str, dict | None], all_runs: list[sweep.Run], key: str):
  """``(pairs, {group[key]: summary})`` over the runs with a result: per value of ``key``, the
  accuracy per seed and its mean over seeds at every number of pairs, the 50% crossing per seed
  (``crossing``), the non-embedding parameter count and the steps the results come from."""
  by_key: dict = {}
  params = {}
  for r in all_runs:
    if results[r.name]:
      by_key.setdefault(r.group[key], []).append(results[r.name])
      params[r.group[key]] = non_embedding_params(r)
  if not by_key:
    raise RuntimeError("no run of the sweep has a result")
  pairs = sorted({int(k) for res in by_key.values() for k in res[0]["accuracy_by_num_pairs"]})
  summary = {}
  for k, res in by_key.items():
    accs = np.array([[r["accuracy_by_num_pairs"][str(p)] for p in pairs] for r in res])
    summary[k] = {"accuracy_mean": accs.mean(axis=0).tolist(), "accuracy_per_seed": accs.tolist(),
                  "pairs_at_50pct_per_seed": [crossing(pairs, list(a)) for a in accs],
                  "non_embedding_params": params[k], "steps": [r["step"] for r in res]}
  return pairs, summary


def accuracy_cells(s: dict, pairs: list[int]) -> list[str]:
  """The table cells of one ``curves`` summary: mean ± half-range per pairs, then the 50%
  crossing of every seed."""
  accs = np.asarray(s["accuracy_per_seed"])
  spread = (accs.max(axis=0) - accs.min(axis=0)) / 2
  return [*[common.fmt(m, d) for m, d in zip(accs.mean(axis=0), spread)],
          " / ".join(_crossing_text(c, pairs) for c in s["pairs_at_50pct_per_seed"])]


def lr_table(scores: dict[int, dict]) -> str:
  """The learning-rate sweep: ``lr_score`` per E and rate, and the rate each E won with."""
  lrs = sorted({lr for s in scores.values() for lr in s})
  best = best_lrs(scores)
  rows = [[str(e), *[f"{s[lr]:.3f}" if lr in s else "—" for lr in lrs],
           lr_text(best[e]) if e in best else "—"] for e, s in sorted(scores.items())]
  return common.markdown_table(["E", *[f"lr {lr_text(lr)}" for lr in lrs], "best lr"], rows)


def report(results: dict[str, dict | None], all_runs: list[sweep.Run],
           scores: dict[int, dict] | None = None) -> str:
  """The tables and plot of ``all_runs``; given ``scores`` (``lr_scores``; the runs are then at
  each E's best learning rate), an lr column and the learning-rate sweep's table too."""
  pairs, summary = curves(results, all_runs, "e")
  summary = dict(sorted(summary.items()))
  params = {e: s["non_embedding_params"] for e, s in summary.items()}
  base = params.get(1, min(params.values()))
  best = best_lrs(scores) if scores else {}
  rows = []
  for e, s in summary.items():
    s["params_ratio"] = params[e] / base
    lr = [lr_text(best[e])] if scores else []
    rows.append([str(e), *lr, f"{params[e] / base:.3f}", *accuracy_cells(s, pairs)])
  common.save(plot(pairs, {e: s["accuracy_per_seed"] for e, s in summary.items()}, best),
              "mqar_capacity.png")
  out = {"pairs": pairs, "by_e": summary}
  if scores:
    out["lr_sweep"] = {"criterion": "mean accuracy over the evaluated numbers of pairs, seed "
                                    f"{seeds()[0]}; a tie to the smaller lr",
                       "scores": {e: {lr_text(lr): v for lr, v in s.items()}
                                  for e, s in scores.items()},
                       "best": {e: lr_text(lr) for e, lr in best.items()}}
  common.write_json("mqar_capacity.json", out)
  header = ["E", *(["lr"] if scores else []), "non-emb. params vs E=1", *[str(p) for p in pairs],
            "pairs at 50% (per seed)"]
  text = common.markdown_table(header, rows) + "\n\n" + common.steps_note(results)
  if scores:
    text += (f"\n\nLearning rates (mean accuracy over pairs, seed {seeds()[0]}; best: the "
             "highest, a tie to the smaller):\n\n" + lr_table(scores))
  return text


def main(argv):
  del argv
  if not LRS.value:
    all_runs = runs()
    print(report(common.run(all_runs), all_runs))
    return
  phase1 = lr_runs()
  scores = lr_scores(common.run(phase1), phase1)
  final = runs(best_lrs(scores))  # the first seed's runs are phase 1's: done, not trained again
  print(report(common.run(final), final, scores))


if __name__ == "__main__":
  common.host_only()
  app.run(main)
