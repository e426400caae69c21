"""Experiment 2: MERLIN on needle retrieval. Trains configs/niah.py's multi-state Gated DeltaNet
with each aggregator (vanilla, position, meanpool, merlin) and the single-state GDN, then sweeps
the segment length (the config's / 4 .. x 2, every aggregator) and merlin's d_r (16..128).

  python -m experiments.niah_aggregators --workdir runs/papers --parallel 8 --seeds 2

``--sweeps`` picks parts: main (aggregators at the config's segment length, every seed),
segment, d_r (seed 0). Writes niah_*.png, niah_aggregators.json and runs.json to --out (default
<workdir>/figures; the report's are docs/figures) and prints the markdown tables. Without main
runs (``--sweeps d_r`` or ``segment`` alone) the report has only the sweeps' tables and plots,
and its niah_aggregators.json only theirs: such a sweep wants an --out of its own.

``--curriculum`` trains every model on easier versions of the task first (``STAGES``, in the order
given), each stage starting from the last one's checkpoint (``init_from``, fresh optimizer), and
then on the config's own task, which is what the tables report; a table of the accuracy after each
stage comes with them. Each stage has the config's step budget (``--stage_steps``: another).
The GPU-sized curriculum (4 needles, then 8, then the config's 8 needles at up to 1024 tokens;
docs/results.md, section 2), and its CPU-sized check (the CPU config asked for 8 needles, 4
first):

  python -m experiments.niah_aggregators --workdir runs/papers --parallel 10 --seeds 2 \
      --sweeps main --curriculum n4_len128,n8_len128 --stage_steps 500 \
      --set config.train.num_steps=1000 --deadline_s 520
  python -m experiments.niah_aggregators --workdir runs/cpu_curriculum --parallel 2 --seeds 1 \
      --niah_config configs/niah.py:cpu --sweeps main --curriculum n4_len128 \
      --set config.data.num_needles=8 --set config.data.train_min_len=64

Seeds can come a few at a time: ``--first_seed`` shifts them (``--seeds 1 --first_seed 2``
is seed 2 alone), and ``--merge_summary`` joins the seeds of an earlier report's
niah_aggregators.json to this report's in the main tables, heatmaps, depth plot and stage table
(``merge_summary``; the output says which seeds came from the file). The GPU curriculum's third
seed beside the two of docs/figures/gpu_curriculum:

  python -m experiments.niah_aggregators --workdir runs/papers --parallel 5 --seeds 1 \
      --first_seed 2 --sweeps main --curriculum n4_len128,n8_len128 --stage_steps 500 \
      --set config.train.num_steps=1000 --deadline_s 470 \
      --merge_summary docs/figures/gpu_curriculum/niah_aggregators.json \
      --out docs/figures/gpu_curriculum

A sweep with an earlier runs.json of its own takes ``--results_from`` instead (every
experiment has it: experiments/common.py), which keeps every run's own result.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import numpy as np
from absl import app, flags
from etils import epath
from matplotlib.figure import Figure

from experiments import common, sweep

CONFIG = flags.DEFINE_string("niah_config", "configs/niah.py", "The config of every run "
                              "(configs/niah.py:cpu: the CPU-sized version).")
AGGREGATORS = ("vanilla", "position", "meanpool", "merlin")
SEGMENT_FRACTIONS = (4, 2, 1, 0.5)  # the swept segment lengths: the config's / these (64..512 at 256)
D_RS = (16, 32, 64, 128)
SWEEPS = flags.DEFINE_list("sweeps", ["main", "segment", "d_r"], "Parts to run.")
SEGMENT_SWEEP = flags.DEFINE_list("segments", [], "Segment lengths swept (default: the config's "
                                  "segment_len / 4, / 2, x 1, x 2; the paper's 64..512 at 256).")
DR_SWEEP = flags.DEFINE_list("d_rs", [str(r) for r in D_RS], "d_r values swept.")
# Easier versions of the task (data overrides only, so the model, its segments and max_segments
# stay those of the config and every stage's checkpoint loads into the next). One query per
# example: asking every needle teaches answering the last by elimination (docs/results.md).
STAGES = {
    "n4_len128": ("config.data.num_needles=4", "config.data.seq_len=128",
                  "config.data.train_min_len=32", "config.data.train_lengths=uniform",
                  "config.data.train_num_queries=1"),
    "n8_len128": ("config.data.num_needles=8", "config.data.seq_len=128",
                  "config.data.train_min_len=64", "config.data.train_lengths=uniform",
                  "config.data.train_num_queries=1"),
}
CURRICULUM = flags.DEFINE_list("curriculum", [], "Stages trained before the config's task, in "
                               f"order, each from the last's checkpoint: any of {list(STAGES)}.")
STAGE_STEPS = flags.DEFINE_integer("stage_steps", None, "Training steps of each curriculum stage "
                                   "(default: the config's).")
MERGE_SUMMARY = flags.DEFINE_string("merge_summary", None, "An earlier report's "
                                    "niah_aggregators.json, of the same command at other seeds: "
                                    "its seeds join this report's (merge_summary).")


def _config():
  """(segment_len, longest context) of the --config file."""
  path, _, arg = CONFIG.value.partition(":")
  spec = importlib.util.spec_from_file_location("niah_config", os.path.join(sweep.REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(arg) if arg else module.get_config()
  return c.model.segment_len, max(c.data.seq_len, *c.data.eval_lengths)


def segments() -> list[int]:
  seg, _ = _config()
  return [int(s) for s in SEGMENT_SWEEP.value] or [int(seg / f) for f in SEGMENT_FRACTIONS]


def items(agg: str, seg: int | None = None, d_r: int = 16, seed: int = 0) -> tuple[str, ...]:
  """The config overrides ("key=value") of one model: ``agg`` an aggregator or "single"."""
  default, max_len = _config()
  seg = seg or default
  if agg == "single":
    return ("config.model.mixer=gdn", f"config.seed={seed}")
  return (f"config.model.aggregator={agg}", f"config.model.segment_len={seg}",
          f"config.model.max_segments={-(-max_len // seg)}", f"config.model.d_r={d_r}",
          f"config.seed={seed}")


def _run(agg: str, seg: int | None = None, d_r: int = 16, seed: int = 0) -> sweep.Run:
  seg = seg or _config()[0]
  name = (f"niah_single_seed{seed}" if agg == "single"
          else f"niah_{agg}_L{seg}_r{d_r}_seed{seed}")
  return sweep.Run(name, CONFIG.value, common.overrides(*items(agg, seg, d_r, seed)),
                   group={"agg": agg, "seg": 0 if agg == "single" else seg,
                          "d_r": 0 if agg == "single" else d_r, "seed": seed})


def curriculum(r: sweep.Run) -> list[sweep.Run]:
  """``r`` after the ``--curriculum`` stages: one run per stage (its data overrides after ``r``'s,
  so they win over ``--set``; group["stage"] names it), each from the previous one's checkpoint,
  then ``r``'s own task from the last stage's, under a name of its own. Just [r] without
  stages."""
  unknown = [x for x in CURRICULUM.value if x not in STAGES]
  if unknown:
    raise ValueError(f"--curriculum: unknown stage(s) {unknown}; known: {list(STAGES)}")
  steps = () if STAGE_STEPS.value is None else (f"config.train.num_steps={STAGE_STEPS.value}",)
  out, prev = [], None
  for i, stage in enumerate(CURRICULUM.value):
    out.append(sweep.Run(f"{r.name}_stage{i}_{stage}", r.config,
                         r.overrides + tuple(f"--{x}" for x in (*STAGES[stage], *steps)),
                         after=prev, group={**r.group, "stage": stage}))
    prev = out[-1].name
  if prev is None:
    return [r]
  return out + [dataclasses.replace(r, name=f"{r.name}_after_{'_'.join(CURRICULUM.value)}",
                                    after=prev)]


def runs() -> list[sweep.Run]:
  out = []
  if "main" in SWEEPS.value:
    out += [_run(a, seed=s) for s in common.seeds() for a in ("single", *AGGREGATORS)]
  if "segment" in SWEEPS.value:
    default = _config()[0]
    out += [_run(a, seg) for seg in segments() if seg != default for a in AGGREGATORS]
  if "d_r" in SWEEPS.value:
    out += [_run("merlin", d_r=r) for r in D_RS if r != 16 and str(r) in DR_SWEEP.value]
  out = [x for r in out for x in curriculum(r)]
  return list({r.name: r for r in out}.values())


def _label(agg: str) -> str:
  return "single-state GDN" if agg == "single" else agg


def _main_cell(g: dict, agg: str, segment: int) -> bool:
  """Whether a run's group belongs to model ``agg`` of the main comparison: the config's
  segment length and d_r 16 (the single-state model has neither)."""
  return g["agg"] == agg and g["seg"] in (0, segment) and g["d_r"] in (0, 16)


def _model_summary(grids: np.ndarray, seeds: list[int]) -> dict:
  """One model's entry of niah_aggregators.json from its accuracy grids [seed, depth, length]."""
  return {"seeds": seeds, "grid_mean": grids.mean(0).tolist(),
          "overall_per_seed": grids.mean((1, 2)).tolist(),
          "by_length_per_seed": grids.mean(1).tolist(), "by_depth_per_seed": grids.mean(2).tolist()}


def report(results: dict[str, dict | None], all_runs: list[sweep.Run]) -> str:
  got = [(r.group, results[r.name]) for r in all_runs if results[r.name]]
  staged = [(g, res) for g, res in got if "stage" in g]   # curriculum stages, reported apart
  got = [(g, res) for g, res in got if "stage" not in g]
  if not got:
    raise RuntimeError("no run of the sweep has a result")
  first = got[0][1]
  segment = _config()[0]
  lengths, depths = first["lengths"], first["depths"]
  sections, summary = [], {}
  stages = list(dict.fromkeys(g["stage"] for g, _ in staged))

  def cells(pred):
    return [np.asarray(res["accuracy_grid"]) for g, res in got if pred(g)]

  def overall(runs):
    return [float(np.mean(res["accuracy_grid"])) for _, res in runs]

  # Main comparison: accuracy by length and by depth, mean over seeds.
  for a in ("single", *AGGREGATORS):
    final = [(g, res) for g, res in got if _main_cell(g, a, segment)]
    if not final:
      continue
    summary[a] = _model_summary(np.stack([res["accuracy_grid"] for _, res in final]),
                                [g["seed"] for g, _ in final])
    if staged:
      summary[a]["curriculum_overall"] = {
          **{st: overall([(g, res) for g, res in staged
                          if _main_cell(g, a, segment) and g["stage"] == st]) for st in stages},
          "final": overall(final)}
  if MERGE_SUMMARY.value:
    sections.append(merge_summary(summary, MERGE_SUMMARY.value, lengths, depths))
  main = [a for a in ("single", *AGGREGATORS) if a in summary]
  if main:  # none in a report of the segment or d_r sweep alone
    sections += _main_report(summary, main, lengths, depths, segment)
    if staged:
      sections.append(_stage_table(summary, main, stages))

  # Segment-length sweep (seed 0) and d_r sweep.
  for key, values, default, fixed, name in (
      ("seg", sorted(set(segments()) | {segment}), segment, {"d_r": 16}, "segment length"),
      ("d_r", D_RS, 16, {"seg": segment}, "d_r")):
    aggs = AGGREGATORS if key == "seg" else ("merlin",)
    table, curves = [], {}
    for a in aggs:
      accs = []
      for v in values:
        grids = cells(lambda g, a=a, v=v: g["agg"] == a and g[key] == v and g["seed"] == 0
                      and all(g[k] == x for k, x in fixed.items()))
        accs.append(float(grids[0].mean()) if grids else float("nan"))
      if not all(np.isnan(accs)):
        curves[a] = accs
        table.append([a, *[common.fmt(x, 0) for x in accs]])
    if all(np.isnan(x) for acc in curves.values() for v, x in zip(values, acc) if v != default):
      continue  # nothing swept: at most the main runs' value
    summary[f"{key}_sweep"] = {"values": list(values), "accuracy": curves}
    fig = Figure(figsize=(5.5, 3.8))
    ax = fig.subplots()
    for a, accs in curves.items():
      ax.plot(values, accs, "o-", label=a)
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.set(xlabel=name, ylabel="exact-match accuracy (all cells)", ylim=(-0.03, 1.05),
           title=f"needle accuracy by {name} (seed 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    common.save(fig, f"niah_{key}_sweep.png")
    sections.append(f"By {name} (seed 0, all cells):\n\n" + common.markdown_table(
        ["aggregator", *[str(v) for v in values]], table))
  common.write_json("niah_aggregators.json", {"lengths": lengths, "depths": depths, **summary})
  return "\n\n".join(sections) + "\n\n" + common.steps_note(results)


def _main_report(summary: dict, main: list[str], lengths: list, depths: list,
                 segment: int) -> list[str]:
  """The main comparison of the models ``main`` (keys of ``summary``): writes the heatmaps and
  the depth plot, returns the tables by context length and by needle depth."""
  rows_len, rows_depth = [], []
  fig = Figure(figsize=(6.5, 4.2))
  ax = fig.subplots()
  hfig = Figure(figsize=(3.2 * len(main), 3.0))
  hax = hfig.subplots(1, len(main), squeeze=False)[0]
  for i, a in enumerate(main):
    s = summary[a]
    by_len, by_depth = np.asarray(s["by_length_per_seed"]), np.asarray(s["by_depth_per_seed"])
    grid = np.asarray(s["grid_mean"])
    rows_len.append([_label(a), *[common.fmt(*common.mean_spread(list(c))) for c in by_len.T],
                     common.fmt(*common.mean_spread(s["overall_per_seed"]))])
    rows_depth.append([_label(a), *[common.fmt(*common.mean_spread(list(c)))
                                    for c in by_depth.T]])
    ax.plot(depths, by_depth.mean(0), "o-", label=_label(a))
    im = hax[i].imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for (y, x), v in np.ndenumerate(grid):
      hax[i].text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=7)
    hax[i].set_xticks(range(len(lengths)), [str(n) for n in lengths])
    hax[i].set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths] if i == 0 else [])
    hax[i].set(title=_label(a), xlabel="context length", ylabel="needle depth" if i == 0 else "")
  hfig.colorbar(im, ax=list(hax), label="accuracy")
  common.save(hfig, "niah_heatmaps.png")
  ax.set(xlabel="needle depth (0 = start of context, 1 = next to the query)",
         ylabel="exact-match accuracy", ylim=(-0.03, 1.05),
         title=f"needle accuracy by depth (segment {segment}, mean over lengths)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  common.save(fig, "niah_depth.png")
  sections = [f"By context length (segment {segment}, d_r 16):\n\n" + common.markdown_table(
      ["model", *[str(n) for n in lengths], "all"], rows_len)]
  sections.append("By needle depth (mean over lengths):\n\n" + common.markdown_table(
      ["model", *[f"{d:.2f}" for d in depths]], rows_depth))
  return sections


def _stage_table(summary: dict, models: list[str], stages: list[str]) -> str:
  """Overall accuracy (mean ± half the range over seeds) after each curriculum stage and after
  the config's own task, per model at the config's segment length and d_r 16. Each stage's
  evaluation is the config's (the same lengths and depths; its own number of needles)."""
  rows = [[_label(a), *[common.fmt(*common.mean_spread(summary[a].get("curriculum_overall", {})
                                                       .get(st, []))) for st in (*stages, "final")]]
          for a in models]
  return ("After each curriculum stage (all cells; each stage evaluated on its own task):\n\n"
          + common.markdown_table(["model", *stages, "the config's task"], rows))


_PER_SEED = ("overall_per_seed", "by_length_per_seed", "by_depth_per_seed")


def merge_summary(summary: dict, path: str, lengths: list, depths: list) -> str:
  """Puts the seeds of ``path``, an earlier report's niah_aggregators.json from the same command,
  into ``summary`` (this report's, the same layout) in place, ahead of this report's own: the
  per-seed lists are joined and grid_mean is averaged weighted by the seeds behind each. A model
  only there enters as it is. A file without "seeds" holds seeds 0, 1, ... (reports before
  --first_seed existed ran those). The stage lists ("curriculum_overall") join where both have
  the same stages; where the file has none, the stage table keeps this report's seeds only;
  other stages are another experiment (an error). The segment and d_r sweeps are not merged.
  Returns the note saying which seeds came from where."""
  old = json.loads(epath.Path(path).read_text())
  if (old["lengths"], old["depths"]) != (lengths, depths):
    raise ValueError(f"{path}: lengths {old['lengths']} and depths {old['depths']} differ from "
                     f"this report's {lengths} and {depths}")
  notes, unstaged, staged = {}, [], False
  for a in ("single", *AGGREGATORS):
    o, s = old.get(a), summary.get(a)
    if o is None:
      if s is not None:
        notes[a] = f"seeds {s['seeds']} from this report's runs, none from {path}"
      continue
    seeds = o.get("seeds", list(range(len(o["overall_per_seed"]))))
    if s is None:
      summary[a] = {**o, "seeds": seeds}
      notes[a] = f"seeds {seeds} from {path}, none from this report"
      continue
    if set(seeds) & set(s["seeds"]):
      raise ValueError(f"{path} already holds seed(s) {sorted(set(seeds) & set(s['seeds']))} "
                       f"of {a}")
    theirs, mine = o.get("curriculum_overall"), s.get("curriculum_overall")
    if theirs is None and mine is not None:
      unstaged.append(_label(a))
    elif list(theirs or {}) != list(mine or {}):
      raise ValueError(f"{path}: {a} has curriculum stages {list(theirs or {})}, this report "
                       f"{list(mine or {})}")
    elif mine:
      s["curriculum_overall"] = {st: theirs[st] + mine[st] for st in mine}
      staged = True
    n, m = len(seeds), len(s["seeds"])
    notes[a] = f"seeds {seeds} from {path}, {s['seeds']} from this report's runs"
    s["grid_mean"] = ((n * np.asarray(o["grid_mean"]) + m * np.asarray(s["grid_mean"]))
                      / (n + m)).tolist()
    s.update({k: o[k] + s[k] for k in _PER_SEED})
    s["seeds"] = seeds + s["seeds"]
  if len(set(notes.values())) == 1:
    text = "Every model: " + next(iter(notes.values()))
  else:
    text = "; ".join(f"{_label(a)}: {t}" for a, t in notes.items())
  text = (f"Merged with {path} (main tables, heatmaps, depth plot"
          f"{', stage table' if staged else ''}). {text}. The steps note at the end is of this "
          "report's runs only.")
  if unstaged:
    text += (f" The stage table holds this report's seeds only for {', '.join(unstaged)}: "
             f"{path} has no stage lists for them.")
  return text


def main(argv):
  del argv
  all_runs = runs()
  print(report(common.run(all_runs), all_runs))


if __name__ == "__main__":
  common.host_only()
  app.run(main)
