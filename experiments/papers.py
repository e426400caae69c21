"""All three experiments of docs/results.md in one sweep (runs shared between them are trained
once), then their three reports.

  python -m experiments.papers --workdir runs/papers --parallel 16 --seeds 2

Flags of the three modules apply (--e, --sweeps, --segments, --d_rs, --parts, --cont_steps), and
the sweep's flags of experiments/common.py (--first_seed, --results_from; one runs.json for all).
"""

from __future__ import annotations

from absl import app

from experiments import common, mqar_capacity, niah_aggregators, upgrade


def main(argv):
  del argv
  parts = upgrade.quads()
  lists = [niah_aggregators.runs()[:5], mqar_capacity.runs(), niah_aggregators.runs()[5:],
           [q[k] for per in parts.values() for q in per for k in q]]
  runs = list({r.name: r for rs in lists for r in rs}.values())
  results = common.run(runs)
  for title, text in (("MQAR capacity", lambda: mqar_capacity.report(results, mqar_capacity.runs())),
                      ("NIAH aggregators",
                       lambda: niah_aggregators.report(results, niah_aggregators.runs())),
                      ("Upgrades", lambda: upgrade.report(results, parts))):
    print(f"\n## {title}\n")
    try:
      print(text())
    except Exception as e:  # one report failing must not hide the others
      print(f"report failed: {e!r}")


if __name__ == "__main__":
  common.host_only()
  app.run(main)
