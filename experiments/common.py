"""What the experiment scripts share: flags, the sweep call, result tables and plot helpers.

A --workdir may not outlive the machine it ran on, so every sweep leaves its results in --out
too: ``runs.json``, for each run with a result its name, group, config, overrides and evaluation
dict (no checkpoints; sweeps sharing an --out share it). Passed to ``--results_from``, the runs
named there are done (not trained again) and their results enter the report as if they had run
now. So a sweep can grow a seed at a time: after ``--seeds 2``, ``--seeds 3 --results_from
<out>/runs.json`` trains seed 2 only and reports all three (and its runs.json holds them
all). ``--first_seed`` shifts the seeds (``--seeds 1 --first_seed 2``: seed 2 alone).

XLA's GPU reductions and scatter-adds are not bit-deterministic, so two GPU runs of one seed
differ; ``--deterministic`` gives every run ``--xla_gpu_deterministic_ops=true`` so that a seed
names a result (the flag does nothing on the CPU).
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import flags, logging
from etils import epath
from matplotlib.figure import Figure
from ml_collections import config_flags

from experiments import sweep

START = time.time()  # --deadline_s counts from here (the script's imports)

WORKDIR = flags.DEFINE_string("workdir", None, "Root directory of the sweep's runs.", required=True)
OUT = flags.DEFINE_string("out", None, "Where the report's PNG plots and JSON go (default: "
                          "<workdir>/figures; the committed figures are docs/figures).")
PARALLEL = flags.DEFINE_integer("parallel", 4, "Runs trained at the same time.")
SEEDS = flags.DEFINE_integer("seeds", 2, "Training seeds per setting (from --first_seed on).")
FIRST_SEED = flags.DEFINE_integer("first_seed", 0, "The first training seed: the runs are "
                                  "seeds first_seed .. first_seed + seeds - 1.")
RESULTS_FROM = flags.DEFINE_list("results_from", [], "runs.json files of earlier sweeps (their "
                                 "--out dirs): the runs named there are done, not trained again, "
                                 "and their results enter the report.")
DEADLINE = flags.DEFINE_float("deadline_s", None, "Stop training this many seconds after the "
                              "script started and evaluate what exists (each result names its "
                              "step); a script that sweeps twice gives the second what is left.")
DETERMINISTIC = flags.DEFINE_bool("deterministic", False, "Train and evaluate with XLA_FLAGS "
                                  "--xla_gpu_deterministic_ops=true (GPU runs of a seed agree).")
REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Only rebuild the report from --workdir.")
SET = flags.DEFINE_multi_string("set", [], "Extra override for every run, e.g. "
                                "--set=config.train.num_steps=50 (a quick smoke test).")


def host_only() -> None:
  """Keep the sweep's own process (it launches runs, counts parameters, plots) off the
  accelerator: a JAX GPU client preallocates 75% of the card, which the runs' pools need."""
  jax.config.update("jax_platforms", "cpu")


def overrides(*items: str) -> tuple[str, ...]:
  """``--config.*`` arguments from "key=value" items plus every ``--set``."""
  return tuple(f"--{x}" for x in (*items, *SET.value))


def seeds(count: int | None = None) -> range:
  """``count`` (default --seeds) training seeds from --first_seed on."""
  return range(FIRST_SEED.value, FIRST_SEED.value + (count or SEEDS.value))


def run(runs: list[sweep.Run]) -> dict[str, dict | None]:
  """Train + evaluate ``runs`` under --workdir (or only read them back with --report_only), the
  ones in --results_from excepted (their stored results are taken); writes ``runs.json``."""
  stored = stored_results(runs)
  if REPORT_ONLY.value:
    results = {r.name: stored.get(r.name) or sweep.eval_result(run_dir(r)) for r in runs}
  else:
    deadline = None if DEADLINE.value is None else DEADLINE.value - (time.time() - START)
    results = sweep.run_sweep(runs, WORKDIR.value, parallel=PARALLEL.value, deadline_s=deadline,
                              stored=stored, deterministic=DETERMINISTIC.value)
  write_runs(runs, results)
  return results


def write_runs(runs: list[sweep.Run], results: dict[str, dict | None]) -> None:
  """Writes the ``runs`` with a result to --out's runs.json, in place of the entries of every
  run of this sweep; other sweeps' runs written to the same --out stay."""
  path = out_path("runs.json")
  kept = json.loads(path.read_text()) if path.exists() else []
  kept = [e for e in kept if e["name"] not in results]
  write_json("runs.json", kept + [{"name": r.name, "group": r.group, "config": r.config,
                                   "overrides": list(r.overrides), "result": results[r.name]}
                                  for r in runs if results[r.name]])


def stored_results(runs: list[sweep.Run]) -> dict[str, dict]:
  """{name: result} of the ``runs`` found in the --results_from files (a later file wins). A run
  stored with another config or other overrides than this sweep's is an error, not a result."""
  by_name = {r.name: r for r in runs}
  out = {}
  for path in RESULTS_FROM.value:
    for entry in json.loads(epath.Path(path).read_text()):
      r = by_name.get(entry["name"])
      if r is None:
        continue
      if (entry["config"], entry["overrides"]) != (r.config, list(r.overrides)):
        raise ValueError(f"{path}: run {r.name} was trained as {entry['config']} "
                         f"{entry['overrides']}, this sweep's is {r.config} {list(r.overrides)}")
      out[r.name] = entry["result"]
  return out


def run_config(r: sweep.Run):
  """The config ``r`` trains with: its config file and overrides, parsed as train.py parses them."""
  argv = ["run_config", *r.overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", r.config, flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config


def run_dir(r: sweep.Run) -> str:
  return os.path.join(WORKDIR.value, r.name)


def out_dir() -> epath.Path:
  """--out, or <workdir>/figures: a run never writes into the committed docs/figures unasked."""
  return epath.Path(OUT.value or os.path.join(WORKDIR.value, "figures"))


def out_path(name: str) -> epath.Path:
  out = out_dir()
  out.mkdir(parents=True, exist_ok=True)
  return out / name


def write_json(name: str, obj) -> str:
  path = out_path(name)
  path.write_text(json.dumps(obj, indent=1, default=float))
  return str(path)


def save(fig: Figure, name: str) -> str:
  path = out_path(name)
  with path.open("wb") as f:
    fig.savefig(f, format="png", dpi=120, bbox_inches="tight")
  logging.info("wrote %s", path)
  return str(path)


def mean_spread(values: list[float]) -> tuple[float, float]:
  """Mean and half the range (max - min) / 2 over seeds; nan for none."""
  if not values:
    return float("nan"), float("nan")
  v = np.asarray(values, np.float64)
  return float(v.mean()), float((v.max() - v.min()) / 2)


def fmt(mean: float, spread: float) -> str:
  if np.isnan(mean):
    return "—"
  return f"{mean:.2f}" + (f" ± {spread:.2f}" if spread > 0.005 else "")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def steps_note(results: dict[str, dict | None]) -> str:
  """Which step every result comes from (runs stopped by a deadline stop early)."""
  steps = sorted({r["step"] for r in results.values() if r})
  missing = [n for n, r in results.items() if r is None]
  note = f"results from step(s) {steps}"
  return note + (f"; no result for {missing}" if missing else "")
