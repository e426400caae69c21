"""What the experiment scripts share: flags, the sweep call, result tables and plot helpers."""

from __future__ import annotations

import json
import os

import numpy as np
from absl import flags, logging
from etils import epath
from matplotlib.figure import Figure
from ml_collections import config_flags

from experiments import sweep

WORKDIR = flags.DEFINE_string("workdir", None, "Root directory of the sweep's runs.", required=True)
OUT = flags.DEFINE_string("out", None, "Where the report's PNG plots and JSON go (default: "
                          "<workdir>/figures; the committed figures are docs/figures).")
PARALLEL = flags.DEFINE_integer("parallel", 4, "Runs trained at the same time.")
SEEDS = flags.DEFINE_integer("seeds", 2, "Training seeds per setting (0, 1, ...).")
DEADLINE = flags.DEFINE_float("deadline_s", None, "Stop training at this many seconds and "
                              "evaluate what exists (each result names its step).")
REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Only rebuild the report from --workdir.")
SET = flags.DEFINE_multi_string("set", [], "Extra override for every run, e.g. "
                                "--set=config.train.num_steps=50 (a quick smoke test).")


def overrides(*items: str) -> tuple[str, ...]:
  """``--config.*`` arguments from "key=value" items plus every ``--set``."""
  return tuple(f"--{x}" for x in (*items, *SET.value))


def run(runs: list[sweep.Run]) -> dict[str, dict | None]:
  """Train + evaluate ``runs`` under --workdir (or only read them back with --report_only)."""
  if REPORT_ONLY.value:
    return {r.name: sweep.eval_result(run_dir(r)) for r in runs}
  return sweep.run_sweep(runs, WORKDIR.value, parallel=PARALLEL.value, deadline_s=DEADLINE.value)


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
