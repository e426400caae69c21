"""Experiment 1: triadic capacity on MQAR. Trains configs/mqar_capacity.py at E = 1, 2, 4, 8, 16
(several seeds), evaluates each on 8..512 pairs, and reports the accuracy curves and, per E, the
number of pairs at which accuracy falls below 50%.

  python -m experiments.mqar_capacity --workdir runs/papers --parallel 10 --seeds 2
  python -m experiments.mqar_capacity --workdir runs/cpu_capacity --mqar_config configs/mqar.py \
      --parallel 2 --out docs/figures/cpu   # the CPU-sized version (vocab 64, up to 31 pairs)

Writes mqar_capacity.{png,json} to --out (default <workdir>/figures; the report's are docs/figures)
and prints the markdown table of docs/results.md.
"""

from __future__ import annotations

import math

import numpy as np
from absl import app, flags
from matplotlib.figure import Figure

from experiments import common, sweep
from lm import eval_loop

CONFIG = "configs/mqar_capacity.py"
CONFIG_FLAG = flags.DEFINE_string("mqar_config", CONFIG, "The config of every run (configs/mqar.py: "
                                  "the CPU-sized version, up to 31 pairs).")
E_VALUES = flags.DEFINE_list("e", ["1", "2", "4", "8", "16"], "Values of E.")
MQAR_SEEDS = flags.DEFINE_integer("mqar_seeds", None, "Seeds of this sweep (default: --seeds).")


def runs() -> list[sweep.Run]:
  return [sweep.Run(f"mqar_e{e}_seed{s}", CONFIG_FLAG.value,
                    common.overrides(f"config.model.expand_e={e}", f"config.seed={s}"),
                    group={"e": int(e), "seed": s})
          for e in E_VALUES.value for s in range(MQAR_SEEDS.value or common.SEEDS.value)]


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
  """From the config the run saved in its workdir."""
  return eval_loop.count(eval_loop.load_config(common.run_dir(run)))["non_embedding"]


def _crossing_text(c: float, pairs: list[int]) -> str:
  return f"> {pairs[-1]}" if math.isinf(c) else (f"< {pairs[0]}" if c == 0 else f"{c:.0f}")


def plot(pairs: list[int], per_seed: dict[int, list[list[float]]]) -> Figure:
  """Accuracy against pairs, one colour per E: the mean over seeds (thick) and each seed (thin),
  so that a seed stuck at chance shows as its own line instead of pulling a band down."""
  fig = Figure(figsize=(6.5, 4.2))
  ax = fig.subplots()
  for e in sorted(per_seed):
    accs = np.asarray(per_seed[e])
    line, = ax.plot(pairs, accs.mean(axis=0), "o-", lw=2, label=f"E={e} (mean of {len(accs)})")
    if len(accs) > 1:
      for a in accs:
        ax.plot(pairs, a, "-", color=line.get_color(), lw=0.8, alpha=0.45)
  ax.axhline(0.5, color="gray", lw=0.8, ls="--")
  ax.set_xscale("log", base=2)
  ax.set(xlabel="key-value pairs", ylabel="accuracy",
         ylim=(-0.03, 1.05), title="MQAR accuracy by E (2 layers, 4 heads, d=16); thin: seeds")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return fig


def report(results: dict[str, dict | None], all_runs: list[sweep.Run]) -> str:
  by_e: dict[int, list[dict]] = {}
  params = {}
  for r in all_runs:
    if results[r.name]:
      by_e.setdefault(r.group["e"], []).append(results[r.name])
      params[r.group["e"]] = non_embedding_params(r)
  if not by_e:
    raise RuntimeError("no run of the sweep has a result")
  pairs = sorted({int(k) for res in by_e.values() for k in res[0]["accuracy_by_num_pairs"]})
  base = params.get(1, min(params.values()))
  summary, rows = {}, []
  for e in sorted(by_e):
    accs = np.array([[res["accuracy_by_num_pairs"][str(p)] for p in pairs] for res in by_e[e]])
    cross = [crossing(pairs, list(a)) for a in accs]
    mean = accs.mean(axis=0)
    summary[e] = {"accuracy_mean": mean.tolist(), "accuracy_per_seed": accs.tolist(),
                  "pairs_at_50pct_per_seed": cross, "non_embedding_params": params[e],
                  "params_ratio": params[e] / base, "steps": [res["step"] for res in by_e[e]]}
    spread = (accs.max(axis=0) - accs.min(axis=0)) / 2
    rows.append([str(e), f"{params[e] / base:.3f}",
                 *[common.fmt(m, s) for m, s in zip(mean, spread)],
                 " / ".join(_crossing_text(c, pairs) for c in cross)])
  common.save(plot(pairs, {e: summary[e]["accuracy_per_seed"] for e in summary}),
              "mqar_capacity.png")
  common.write_json("mqar_capacity.json", {"pairs": pairs, "by_e": summary})
  header = ["E", "non-emb. params vs E=1", *[str(p) for p in pairs], "pairs at 50% (per seed)"]
  return (common.markdown_table(header, rows) + "\n\n" + common.steps_note(results))


def main(argv):
  del argv
  all_runs = runs()
  print(report(common.run(all_runs), all_runs))


if __name__ == "__main__":
  app.run(main)
