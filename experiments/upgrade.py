"""Experiment 3: upgrade a trained model instead of training the bigger one from scratch.

triadic: the E = 1 MQAR models of experiment 1 continue as E = 8 (``init_from``: the forget gate
is copied into every slice, the second key/query projections start fresh) for ``--cont_steps``,
against the same E = 1 models continued as E = 1 for as long. merlin: experiment 2's single-state
GDN continues as multi-state merlin, against it continued single-state; with ``--curriculum``
both needle models train through its stages first, as in experiment 2, and the continued runs
train on the final task.

  python -m experiments.upgrade --workdir runs/papers --parallel 8 --seeds 2

The from-scratch gain is (big model from scratch) - (small model from scratch), both from
experiments 1 and 2 (the same workdir: their runs are reused, or trained here if missing); the
upgrade's gain is (upgraded) - (small model continued). The report gives their ratio, the
fraction of the from-scratch gain that the upgrade recovers. Writes upgrade.{png,json} and
runs.json to --out. With ``--results_from`` (experiments/common.py), a run that starts from a
stored one still needs that one's checkpoints in --workdir.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags
from matplotlib.figure import Figure

from experiments import common, mqar_capacity, niah_aggregators, sweep

PARTS = flags.DEFINE_list("parts", ["triadic", "merlin"], "Which upgrades to run.")
CONT_STEPS = flags.DEFINE_integer("cont_steps", 500, "Steps of continued training.")
UPGRADE_SEEDS = flags.DEFINE_integer("upgrade_seeds", None, "Seeds, from --first_seed on "
                                     "(default: --seeds).")


def _cont(*items: str) -> tuple[str, ...]:
  steps = CONT_STEPS.value
  return common.overrides(*items, f"config.train.num_steps={steps}",
                          f"config.train.warmup_steps={max(1, steps // 10)}")


def quads() -> dict[str, list[dict[str, sweep.Run]]]:
  """Per part and seed: the small and big models from scratch, the small one continued, and
  the upgraded one."""
  out = {}
  for s in common.seeds(UPGRADE_SEEDS.value):
    if "triadic" in PARTS.value:
      small = sweep.Run(f"mqar_e1_seed{s}", mqar_capacity.CONFIG_FLAG.value,
                        common.overrides("config.model.expand_e=1", f"config.seed={s}"),
                        group={"e": 1, "seed": s})
      big = sweep.Run(f"mqar_e8_seed{s}", mqar_capacity.CONFIG_FLAG.value,
                      common.overrides("config.model.expand_e=8", f"config.seed={s}"),
                      group={"e": 8, "seed": s})
      out.setdefault("triadic", []).append({
          "small": small, "big": big,
          "continued": sweep.Run(f"up_mqar_e1_cont_seed{s}", mqar_capacity.CONFIG_FLAG.value,
                                 _cont("config.model.expand_e=1", f"config.seed={s}"),
                                 after=small.name),
          "upgraded": sweep.Run(f"up_mqar_e1_to_e8_seed{s}", mqar_capacity.CONFIG_FLAG.value,
                                _cont("config.model.expand_e=8", f"config.seed={s}"),
                                after=small.name)})
    if "merlin" in PARTS.value:
      small, big = (needle_chain(agg, s)[-1] for agg in ("single", "merlin"))
      out.setdefault("merlin", []).append({
          "small": small, "big": big,
          "continued": sweep.Run(f"up_niah_single_cont_seed{s}", niah_aggregators.CONFIG.value,
                                 _cont(*niah_aggregators.items("single", seed=s)),
                                 after=small.name),
          "upgraded": sweep.Run(f"up_niah_single_to_merlin_seed{s}", niah_aggregators.CONFIG.value,
                                _cont(*niah_aggregators.items("merlin", seed=s)),
                                after=small.name)})
  return out


def needle_chain(agg: str, seed: int) -> list[sweep.Run]:
  """Experiment 2's needle model ``agg`` ("single" or an aggregator) of ``seed`` as that sweep
  trains it: through the ``--curriculum`` stages, the last run the model an upgrade compares or
  starts from (just that run without stages)."""
  return niah_aggregators.curriculum(niah_aggregators._run(agg, seed=seed))


def runs(parts: dict) -> list[sweep.Run]:
  """Every run of the quads, after the curriculum stages that their needle models train through
  first; each once."""
  out = {}
  for part, per_seed in parts.items():
    for q in per_seed:
      for role, r in q.items():
        if part == "merlin" and role in ("small", "big"):
          out.update((x.name, x) for x in needle_chain(r.group["agg"], r.group["seed"])[:-1])
        out[r.name] = r
  return list(out.values())


def _accuracy(res: dict) -> float:
  return float(res["accuracy"])


def report(results: dict[str, dict | None], parts: dict) -> str:
  rows, summary = [], {}
  fig = Figure(figsize=(5.8, 3.8))
  ax = fig.subplots()
  roles = ("small", "continued", "upgraded", "big")
  for part, per_seed in parts.items():
    accs = {k: [] for k in roles}
    for q in per_seed:
      if all(results.get(q[k].name) for k in roles):
        for k in roles:
          accs[k].append(_accuracy(results[q[k].name]))
    if not accs["small"]:
      continue
    a = {k: np.asarray(v) for k, v in accs.items()}
    scratch_gain, upgrade_gain = a["big"] - a["small"], a["upgraded"] - a["continued"]
    recovered = upgrade_gain / np.where(scratch_gain == 0, np.nan, scratch_gain)
    summary[part] = {**{k: v.tolist() for k, v in a.items()}, "recovered": recovered.tolist()}
    names = {"triadic": ("E=1", "E=8"), "merlin": ("single-state", "merlin")}[part]
    rows.append([part, *[common.fmt(*common.mean_spread(list(a[k]))) for k in roles],
                 common.fmt(*common.mean_spread(list(scratch_gain))),
                 common.fmt(*common.mean_spread(list(upgrade_gain))),
                 " / ".join(f"{x:.2f}" for x in recovered)])
    x = np.arange(len(roles)) + (0.2 if part == "merlin" else -0.2)
    ax.bar(x, [a[k].mean() for k in roles], width=0.4, label=f"{part} ({names[0]} -> {names[1]})")
  if not rows:
    return "no upgrade has all four results yet"
  ax.set_xticks(range(len(roles)), ["small\n(scratch)", "small\ncontinued", "upgraded",
                                    "big\n(scratch)"])
  ax.set(ylabel="accuracy (all settings)", ylim=(0, 1.05), title="upgrading a trained model")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y")
  common.save(fig, "upgrade.png")
  common.write_json("upgrade.json", summary)
  header = ["upgrade", "small (scratch)", "small continued", "upgraded", "big (scratch)",
            "scratch gain", "upgrade gain", "recovered (per seed)"]
  return common.markdown_table(header, rows) + "\n\n" + common.steps_note(results)


def main(argv):
  del argv
  parts = quads()
  print(report(common.run(runs(parts)), parts))


if __name__ == "__main__":
  common.host_only()
  app.run(main)
