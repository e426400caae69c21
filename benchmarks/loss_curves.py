"""Whether the fast paths train the same model: one training run per variant of a config (same
seed, same batches, same initial parameters), each loss curve against the first variant's.

  PYTHONPATH=. python benchmarks/loss_curves.py                      # MQAR: chunked, scan, pallas
  PYTHONPATH=. python benchmarks/loss_curves.py --config configs/lm_400m.py:mqar --steps 300 \
      --set train.batch_size=16 --variants model.impl=chunked,model.remat=full "" model.remat=dots

A variant is a comma-joined list of ``key=value`` config assignments (the value a Python
literal, else a string), or ``""`` for the config as it is; ``--set`` applies to every variant
first. The first variant is the reference (on a GPU, ``model.impl=chunked`` is the plain-JAX
form of the op and ``""`` its default, the Pallas kernels). Each run is ``lm.train_loop.train``,
the loop ``train.py`` runs, in its own work directory, logging every ``--log-every`` steps; the
table reads each run's ``metrics.jsonl``.

Prints the machine and command, the losses at up to ten logged steps, and per variant the largest
and the mean absolute difference to the reference over every logged step; ``--out`` writes the
curves and their differences as a PNG. Training is chaotic: two correct paths drift apart by
their rounding over many steps, so a wrong gradient shows as a difference in the first logged
steps, orders of magnitude above the drift.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.train_step import assign, load_config  # noqa: E402  (applies the CPU workaround)

DEFAULT_VARIANTS = ("model.impl=chunked", "model.impl=scan", "model.impl=pallas")


def variant_config(spec: str, common: list[str], variant: str, steps: int, log_every: int):
  """The ConfigDict of one run: ``spec``'s config, ``common`` then ``variant``'s assignments, and
  ``steps`` steps logged every ``log_every``, with one checkpoint at the end."""
  config = load_config(spec)
  for assignment in common + [a for a in variant.split(",") if a]:
    assign(config, assignment)
  config.train.update(num_steps=steps, log_every=log_every, checkpoint_every=steps,
                      warmup_steps=min(config.train.warmup_steps, max(steps - 1, 0)))
  return config


def read_losses(workdir: str) -> dict[int, float]:
  """{step: loss} from a run's ``metrics.jsonl``."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def run_variants(args) -> dict[str, dict[int, float]]:
  from lm import train_loop
  root = args.workdir or tempfile.mkdtemp(prefix="loss_curves_")
  curves = {}
  for i, variant in enumerate(args.variants):
    workdir = os.path.join(root, f"run{i}")
    config = variant_config(args.config, args.set, variant, args.steps, args.log_every)
    print(f"# run {i}: {variant or '(the config as it is)'} -> {workdir}", flush=True)
    last = train_loop.train(config, workdir)
    curves[variant or "(as is)"] = read_losses(workdir)
    if last.get("step", 0) < args.steps:   # the loop saved and returned on a preemption signal
      print(f"# run {i} stopped at step {last.get('step', 0)} of {args.steps} (preempted): no "
            "further run starts, and the table compares the steps that every run logged",
            flush=True)
      break
  return curves


def shared_steps(curves: dict[str, dict[int, float]], name: str) -> list[int]:
  """The steps that both ``name``'s run and the reference (the first) logged, sorted."""
  return sorted(set(next(iter(curves.values()))) & set(curves[name]))


def differences(curves: dict[str, dict[int, float]]) -> dict[str, tuple[float, float]]:
  """Per variant after the first: (largest, mean) |loss - reference loss| over ``shared_steps``."""
  ref_name, *others = curves
  ref = curves[ref_name]
  out = {}
  for name in others:
    diffs = [abs(curves[name][s] - ref[s]) for s in shared_steps(curves, name)]
    out[name] = (max(diffs), sum(diffs) / len(diffs)) if diffs else (float("nan"),) * 2
  return out


def _span(steps: list[int]) -> str:
  return f"{steps[0]}-{steps[-1]} ({len(steps)})" if steps else "none"


def table(curves: dict[str, dict[int, float]], rows: int = 10) -> str:
  """Up to ``rows`` of the steps every run logged, then each variant's differences to the first
  over the steps both logged (each range is named, so a run cut short shows)."""
  names = list(curves)
  steps = sorted(set.intersection(*(set(c) for c in curves.values())))
  compared = (f"over steps {steps[0]}-{steps[-1]} ({len(steps)} logged by every run)" if steps
              else "no step logged by every run")
  if len(steps) > rows:
    steps = [steps[round(i * (len(steps) - 1) / (rows - 1))] for i in range(rows)]
  lines = ["| step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  lines += [f"| {s} | " + " | ".join(f"{curves[n][s]:.4f}" for n in names) + " |" for s in steps]
  lines += ["", compared, "",
            f"| against {names[0]} | steps (logged) | largest abs. difference | "
            "mean abs. difference |", "|---|---|---|---|"]
  lines += [f"| {n} | {_span(shared_steps(curves, n))} | {big:.2e} | {mean:.2e} |"
            for n, (big, mean) in differences(curves).items()]
  return "\n".join(lines)


def plot(curves: dict[str, dict[int, float]], path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ref_name = next(iter(curves))
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
  for name, curve in curves.items():
    steps = sorted(curve)
    line, = top.plot(steps, [curve[s] for s in steps], label=name)
    if name != ref_name:
      shared = shared_steps(curves, name)
      # Equal losses (a difference of 0) are drawn at 1e-8, the bottom of the log axis.
      bottom.plot(shared, [max(abs(curve[s] - curves[ref_name][s]), 1e-8) for s in shared],
                  color=line.get_color(), marker=".", label=name)
  top.set_ylabel("training loss")
  top.set_title(title)
  top.legend()
  bottom.set_yscale("log")
  bottom.set_ylabel(f"|loss - {ref_name}|")
  bottom.set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/mqar.py", help="path[:arg] of a get_config() file")
  p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                 help="comma-joined key=value assignments per run ('' the config as it is); "
                      "the first is the reference")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="an assignment for every run (repeatable)")
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--log-every", type=int, default=5)
  p.add_argument("--workdir", default=None, help="where the runs go (default: a temporary folder)")
  p.add_argument("--out", default=None, help="a PNG of the curves and their differences")
  args = p.parse_args(argv)
  if len(args.variants) < 2:
    p.error("--variants needs a reference and at least one more")
  if args.steps < 1 or args.log_every < 1:
    p.error("--steps and --log-every must be positive")

  from benchmarks.common import machine
  print("command: python benchmarks/loss_curves.py " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv))
  print(f"device: {machine()}")
  curves = run_variants(args)
  print(f"\n{args.config}, {args.steps} steps, loss logged every {args.log_every}\n")
  print(table(curves))
  if args.out:
    plot(curves, args.out, f"{args.config}: loss by variant")
    print(f"\nwrote {args.out}")
  return curves


if __name__ == "__main__":
  main()
