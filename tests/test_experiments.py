"""The experiment reports (experiments/*.py) on hand-made evaluation results: the 50% crossing, the
upgrade's recovered fraction, and the tables and plots they write."""

import functools
import json
import math
import os

import numpy as np
import pytest
from absl import flags

from experiments import (common, equal_state, mqar_capacity, niah_aggregators, sweep, text_lm,
                         upgrade)


@pytest.fixture
def parsed_flags(tmp_path):
  fv = flags.FLAGS
  fv.unparse_flags()
  fv(["test", f"--workdir={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}", "--seeds=2",
      "--niah_config=configs/niah.py:cpu"])
  yield tmp_path
  fv.unparse_flags()


def test_crossing_interpolates_in_log2_pairs():
  pairs = [8, 16, 32, 64]
  assert mqar_capacity.crossing(pairs, [0.9, 0.7, 0.3, 0.1]) == pytest.approx(2 ** 4.5)
  assert mqar_capacity.crossing(pairs, [0.9, 0.5, 0.4, 0.1]) == pytest.approx(16)
  assert mqar_capacity.crossing(pairs, [0.4, 0.3, 0.2, 0.1]) == 0.0
  assert math.isinf(mqar_capacity.crossing(pairs, [1.0, 0.9, 0.8, 0.6]))


def _write_result(workdir: str, result: dict, config=None):
  os.makedirs(os.path.join(workdir, "eval"), exist_ok=True)
  with open(os.path.join(workdir, "eval", f"{result['task']}_step{result['step']}.json"), "w") as f:
    json.dump(result, f)
  if config is not None:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort())


def test_eval_result_takes_the_newest_teacher_forced_file(tmp_path):
  d = str(tmp_path)
  _write_result(d, {"task": "niah", "step": 5, "accuracy": 0.1})
  _write_result(d, {"task": "niah", "step": 40, "accuracy": 0.4})
  _write_result(d, {"task": "niah_generate", "step": 90, "accuracy": 0.9})
  assert sweep.eval_result(d)["step"] == 40
  assert sweep.eval_result(str(tmp_path / "missing")) is None


def test_niah_report_tables_and_plots(parsed_flags):
  runs = niah_aggregators.runs()
  assert len({r.name for r in runs}) == len(runs)
  depths, lengths = [0.0, 0.5, 1.0], [64, 128]
  results = {}
  for r in runs:  # accuracy rises with depth for vanilla, flat for the others
    acc = 0.9 if r.group["agg"] == "merlin" else 0.5
    grid = [[(d if r.group["agg"] == "vanilla" else acc)] * len(lengths) for d in depths]
    results[r.name] = {"task": "niah", "step": 10, "accuracy_grid": grid, "lengths": lengths,
                       "depths": depths}
  text = niah_aggregators.report(results, runs)
  assert "| merlin | 0.90 | 0.90 | 0.90 |" in text  # by length, then "all"
  assert "| vanilla | 0.00 | 0.50 | 1.00 |" in text  # by depth
  out = parsed_flags / "out"
  for name in ("niah_heatmaps.png", "niah_depth.png", "niah_seg_sweep.png", "niah_d_r_sweep.png",
               "niah_aggregators.json"):
    assert (out / name).stat().st_size > 0, name


def test_niah_report_of_a_sweep_without_main_runs(parsed_flags):
  """--sweeps d_r alone (one d_r, through a curriculum): the d_r table, no main tables or plots."""
  _parse(parsed_flags, "--seeds=1", "--sweeps=d_r", "--d_rs=64", "--curriculum=n4_len128")
  runs = niah_aggregators.runs()
  assert {r.group["d_r"] for r in runs} == {64} and len(runs) == 2
  results = {r.name: {"task": "niah", "step": 10, "lengths": [64], "depths": [0.0, 1.0],
                      "accuracy_grid": [[0.7]] * 2} for r in runs}
  text = niah_aggregators.report(results, runs)
  assert "| merlin | — | — | 0.70 | — |" in text and "By context length" not in text
  out = parsed_flags / "out"
  assert (out / "niah_d_r_sweep.png").exists() and not (out / "niah_heatmaps.png").exists()
  assert json.loads((out / "niah_aggregators.json").read_text())["d_r_sweep"]["values"] == [
      16, 32, 64, 128]


def test_upgrade_report_recovered_fraction(parsed_flags):
  parts = upgrade.quads()
  acc = {"small": 0.2, "continued": 0.3, "upgraded": 0.6, "big": 0.8}
  results = {q[k].name: {"task": "mqar", "step": 7, "accuracy": acc[k]}
             for per in parts.values() for q in per for k in q}
  text = upgrade.report(results, parts)
  # scratch gain 0.6, upgrade gain 0.3: half of it recovered, for each seed
  assert "| 0.60 | 0.30 | 0.50 / 0.50 |" in text
  summary = json.loads((parsed_flags / "out" / "upgrade.json").read_text())
  assert summary["triadic"]["recovered"] == pytest.approx([0.5, 0.5])


def test_niah_curriculum_chains_stages_and_reports_them(parsed_flags):
  fv = flags.FLAGS
  fv.unparse_flags()
  fv(["test", f"--workdir={parsed_flags / 'runs'}", f"--out={parsed_flags / 'out'}", "--seeds=1",
      "--niah_config=configs/niah.py:cpu", "--sweeps=main", "--curriculum=n4_len128,n8_len128",
      "--set=config.data.num_needles=16", "--stage_steps=7"])
  runs = niah_aggregators.runs()
  by_name = {r.name: r for r in runs}
  assert len(by_name) == len(runs) == 5 * 3  # five models, two stages and the task each
  finals = [r for r in runs if "stage" not in r.group]
  assert len(finals) == 5
  for final in finals:
    stage1 = by_name[final.after]
    stage0 = by_name[stage1.after]
    assert stage0.after is None and final.name.endswith("_after_n4_len128_n8_len128")
    assert (stage0.group["stage"], stage1.group["stage"]) == ("n4_len128", "n8_len128")
    # The stage's data overrides come after --set, so they win; the task keeps --set's.
    stage = tuple(f"--{x}" for x in niah_aggregators.STAGES["n4_len128"])
    assert stage0.overrides[-6:] == (*stage, "--config.train.num_steps=7")
    assert final.overrides[-1] == "--config.data.num_needles=16"
    assert stage0.overrides[:len(final.overrides)] == final.overrides
  acc = {"n4_len128": 0.8, "n8_len128": 0.6}
  results = {r.name: {"task": "niah", "step": 10, "lengths": [64], "depths": [0.0, 1.0],
                      "accuracy_grid": [[acc.get(r.group.get("stage"), 0.4)]] * 2}
             for r in runs}
  text = niah_aggregators.report(results, runs)
  assert "| merlin | 0.40 | 0.40 |" in text                # the main tables: the final runs
  assert "| model | n4_len128 | n8_len128 | the config's task |" in text
  assert "| meanpool | 0.80 | 0.60 | 0.40 |" in text
  fv(["test", f"--workdir={parsed_flags / 'runs'}", "--curriculum=n4_len128,easy"])
  with pytest.raises(ValueError, match="unknown stage.*easy"):
    niah_aggregators.runs()


def test_equal_state_runs_are_2x_and_4x_the_gdn_state(parsed_flags):
  runs = equal_state.runs()
  assert len({r.name for r in runs}) == len(runs) == 2 * 11  # gdn + 5 kinds at 2x and 4x, 2 seeds
  first = {r.group["variant"]: r for r in runs if r.group["seed"] == 0}
  states = {v: equal_state.state_size(common.run_config(r)) for v, r in first.items()}
  assert states["gdn"] == 4 * 16 * 16  # 4 heads of a 16 x 16 state
  for v, r in first.items():
    assert states[v] == r.group["multiple"] * states["gdn"], v
    assert r.group["multiple"] == (1 if v == "gdn" else int(v[-1]))
  # the gdn and triadic runs are experiments.mqar_capacity's (trained once in a shared workdir)
  capacity = {r.name: r for r in mqar_capacity.runs()}
  for v in ("gdn", "triadic_e2", "triadic_e4"):
    assert capacity[first[v].name].overrides == first[v].overrides
  cfg = common.run_config(first["grouped_values_x4"]).model
  assert (cfg.num_heads, cfg.num_v_heads, cfg.head_dim, cfg.value_dim, cfg.expand_e) == (4, 16, 16, 0, 1)
  table = equal_state.params_table(runs)
  assert "| gdn | 1x | 1024 | 93040 | 1.000 | 128 | — |" in table
  assert "| heads_x4 | 4x | 4096 | 223648 | 2.404 | 128 | none (< 1) |" in table
  assert "| head_dim_x2 | 2x | 2048 | 110448 | 1.187 | 128 | 89 |" in table


def test_equal_state_at_a_learning_rate_shares_the_capacity_sweeps_runs(parsed_flags):
  """--lr names every run as mqar_capacity --lrs does, so a runs.json of the capacity sweep at
  that rate supplies the gdn and triadic runs (--results_from checks config and overrides)."""
  flags.FLAGS["lr"].parse("0.003")
  runs = {r.group["variant"]: r for r in equal_state.runs() if r.group["seed"] == 1}
  assert runs["gdn"].name == "mqar_e1_lr3e-3_seed1"
  assert runs["heads_x4"].name == "mqar_heads_x4_lr3e-3_seed1"
  assert runs["heads_x4"].group["lr"] == 0.003
  assert "--config.train.learning_rate=3e-3" in runs["values_x2"].overrides
  for v, e in (("gdn", "1"), ("triadic_e4", "4")):
    capacity = mqar_capacity.capacity_run(e, 1, 3e-3)
    assert (runs[v].name, runs[v].overrides) == (capacity.name, capacity.overrides)


def test_equal_state_report_table_and_plot(parsed_flags):
  runs = equal_state.runs()
  pairs = [8, 16, 32]
  results = {}
  for r in runs:  # triadic keeps 0.9 up to more pairs, gdn falls at 16
    good = 3 if r.group["variant"].startswith("triadic") else 1
    acc = {str(p): (0.9 if i < good else 0.1) + 0.02 * r.group["seed"] for i, p in enumerate(pairs)}
    results[r.name] = {"task": "mqar", "step": 9, "accuracy_by_num_pairs": acc}
    _write_result(common.run_dir(r), results[r.name], common.run_config(r))
  text = equal_state.report(results, runs)
  assert "| gdn | 1x | 93040 | 1.000 | 0.91 ± 0.01 | 0.11 ± 0.01 | 0.11 ± 0.01 | 11 / 12 |" in text
  assert "| triadic_e4 | 4x | 98976 | 1.064 | 0.91 ± 0.01 | 0.91 ± 0.01 | 0.91 ± 0.01 | > 32 / > 32 |" \
      in text
  summary = json.loads((parsed_flags / "out" / "equal_state.json").read_text())
  assert list(summary["by_variant"])[:3] == ["gdn", "triadic_e2", "head_dim_x2"]
  assert summary["by_variant"]["heads_x2"]["non_embedding_params"] == 136576
  assert (parsed_flags / "out" / "equal_state.png").stat().st_size > 0


@pytest.mark.slow
def test_equal_state_trains_and_reports_a_grouped_values_run(parsed_flags, monkeypatch):
  """End to end: train.py + eval.py of one variant (a few steps of the CPU config), then the report.
  The sweep polls its processes every 0.1 s (its default, 5 s, is for hour-long runs: here it
  would wait up to 5 s after each of the two processes)."""
  monkeypatch.setattr(sweep, "run_sweep", functools.partial(sweep.run_sweep, poll_s=0.1))
  fv = flags.FLAGS
  fv.unparse_flags()
  fv(["test", f"--workdir={parsed_flags / 'runs'}", f"--out={parsed_flags / 'out'}",
      "--mqar_config=configs/mqar.py", "--mqar_seeds=1", "--variants=grouped_values",
      "--set=config.train.num_steps=2", "--set=config.train.warmup_steps=1",
      "--set=config.data.num_eval_examples=4",
      "--set=config.data.eval_settings=((64,2),(64,4))", "--parallel=1"])
  runs = [r for r in equal_state.runs() if r.group["variant"] == "grouped_values_x2"]
  results = common.run(runs)
  assert results[runs[0].name]["step"] == 2
  text = equal_state.report(results, runs)
  assert "| grouped_values_x2 | 2x |" in text and "| 2 | 4 |" in text


def _parse(tmp_path, *args):
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["test", f"--workdir={tmp_path / 'runs'}", f"--out={tmp_path / 'out'}",
               "--niah_config=configs/niah.py:cpu", *args])


def test_first_seed_shifts_every_experiments_seeds(parsed_flags):
  _parse(parsed_flags, "--seeds=1", "--first_seed=2", "--sweeps=main", "--e=1")
  niah = niah_aggregators.runs()
  assert {r.group["seed"] for r in niah} == {2} and len(niah) == 5
  assert all(r.name.endswith("_seed2") and "--config.seed=2" in r.overrides for r in niah)
  assert [r.name for r in mqar_capacity.runs()] == ["mqar_e1_seed2"]
  assert {q["upgraded"].name for per in upgrade.quads().values() for q in per} == {
      "up_mqar_e1_to_e8_seed2", "up_niah_single_to_merlin_seed2"}
  _parse(parsed_flags, "--seeds=2", "--mqar_seeds=3", "--first_seed=1", "--e=1")
  assert [r.group["seed"] for r in mqar_capacity.runs()] == [1, 2, 3]


def test_upgrade_needle_models_train_through_the_curriculum(parsed_flags):
  """With --curriculum the merlin upgrade's small and big models are experiment 2's models after
  its stages (the same runs that sweep trains), the continued and upgraded runs start from the
  small one's last stage, and ``runs`` schedules every stage once, before what follows it."""
  _parse(parsed_flags, "--seeds=1", "--parts=merlin", "--curriculum=n4_len128")
  (quad,) = upgrade.quads()["merlin"]
  needle = {r.name for r in niah_aggregators.runs()}
  assert quad["small"].name == "niah_single_seed0_after_n4_len128" in needle
  assert quad["big"].name in needle and quad["big"].name.endswith("_after_n4_len128")
  assert quad["continued"].after == quad["upgraded"].after == quad["small"].name
  order = [r.name for r in upgrade.runs(upgrade.quads())]
  assert len(order) == len(set(order)) == 6            # two stages each for small and big, 2 more
  for r in upgrade.runs(upgrade.quads()):
    assert r.after is None or order.index(r.after) < order.index(r.name), r.name


class _Finished:
  """A process that has exited 0 (sweep.run_sweep only polls it)."""
  returncode = 0

  def poll(self):
    return 0


def _seed_accuracy(name):
  return 0.5 + int(name.rsplit("_seed", 1)[1]) / 10


def _fake_launch(launched, accuracy=_seed_accuracy, envs=None):
  """sweep._launch without processes: eval.py writes an MQAR result whose accuracy is
  ``accuracy(run name)`` (default 0.5 + the run's seed / 10) at every number of pairs; each
  process's environment goes to ``envs``."""
  def launch(args, log_path, env):
    del log_path
    workdir = next(a.split("=", 1)[1] for a in args if a.startswith("--workdir="))
    launched.append((args[0], os.path.basename(workdir)))
    if envs is not None:
      envs.append(env)
    if args[0] == "eval.py":
      acc = accuracy(os.path.basename(workdir))
      _write_result(workdir, {"task": "mqar", "step": 3,
                              "accuracy_by_num_pairs": {"8": acc, "16": acc}})
    return _Finished()
  return launch


def test_results_from_reports_stored_runs_without_training_them(parsed_flags, monkeypatch):
  launched = []
  monkeypatch.setattr(sweep, "_launch", _fake_launch(launched))
  monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
  first = parsed_flags / "first"
  _parse(first, "--seeds=1", "--e=1,2", "--mqar_config=configs/mqar.py")
  common.run(mqar_capacity.runs())
  assert sorted(launched) == [("eval.py", "mqar_e1_seed0"), ("eval.py", "mqar_e2_seed0"),
                              ("train.py", "mqar_e1_seed0"), ("train.py", "mqar_e2_seed0")]
  stored = json.loads((first / "out" / "runs.json").read_text())
  assert [e["name"] for e in stored] == ["mqar_e1_seed0", "mqar_e2_seed0"]
  assert stored[0]["group"] == {"e": 1, "seed": 0} and stored[0]["result"]["step"] == 3

  # A fresh workdir: seed 0 comes from runs.json, only seed 1 trains; the
  # runs.json of its --out keeps another sweep's run.
  launched.clear()
  other = {"name": "other_sweep", "group": {}, "config": "c.py", "overrides": [], "result": {}}
  (parsed_flags / "out").mkdir()
  (parsed_flags / "out" / "runs.json").write_text(json.dumps([other]))
  _parse(parsed_flags, "--seeds=2", "--e=1,2", "--mqar_config=configs/mqar.py",
         f"--results_from={first / 'out' / 'runs.json'}")
  runs = mqar_capacity.runs()
  results = common.run(runs)
  assert {name for _, name in launched} == {"mqar_e1_seed1", "mqar_e2_seed1"}
  assert results["mqar_e1_seed0"] == stored[0]["result"]
  assert not (parsed_flags / "runs" / "mqar_e1_seed0").exists()
  text = mqar_capacity.report(results, runs)  # params from the config: no workdir for seed 0
  assert "| 1 | 1.000 | 0.55 ± 0.05 | 0.55 ± 0.05 |" in text
  written = json.loads((parsed_flags / "out" / "runs.json").read_text())
  assert [e["name"] for e in written] == ["other_sweep", *[r.name for r in runs]]

  _parse(parsed_flags, "--seeds=1", "--e=1", "--mqar_config=configs/mqar.py",
         "--set=config.train.num_steps=9", f"--results_from={first / 'out' / 'runs.json'}")
  with pytest.raises(ValueError, match="mqar_e1_seed0 was trained as"):
    common.run(mqar_capacity.runs())
  # A run that starts from a stored one needs that one's checkpoints.
  chain = [sweep.Run("a", "c.py"), sweep.Run("b", "c.py", after="a")]
  with pytest.raises(ValueError, match="'b' starts from 'a'.*no checkpoints"):
    sweep.run_sweep(chain, str(parsed_flags / "runs"), parallel=1, stored={"a": {"step": 1}})


def test_niah_merge_summary_joins_an_earlier_reports_seeds(parsed_flags):
  lengths, depths = [64, 128], [0.0, 1.0]

  def model(curriculum=True):  # seeds 0 and 1 (a file without "seeds"), overall 0.5 and 0.7
    m = {"grid_mean": [[0.6, 0.6], [0.6, 0.6]], "overall_per_seed": [0.5, 0.7],
         "by_length_per_seed": [[0.5, 0.5], [0.7, 0.7]],
         "by_depth_per_seed": [[0.4, 0.6], [0.8, 0.6]]}
    return {**m, "curriculum_overall": {"n4_len128": [0.0, 0.2], "final": [0.5, 0.7]}} \
        if curriculum else m
  old = {"lengths": lengths, "depths": depths, "vanilla": model(curriculum=False),
         **{a: model() for a in ("single", "position", "meanpool", "merlin")}}
  path = parsed_flags / "old.json"
  path.write_text(json.dumps(old))
  _parse(parsed_flags, "--seeds=1", "--first_seed=2", "--sweeps=main", "--curriculum=n4_len128",
         f"--merge_summary={path}")
  runs = niah_aggregators.runs()
  results = {r.name: {"task": "niah", "step": 10, "lengths": lengths, "depths": depths,
                      "accuracy_grid": [[0.1 if "stage" in r.group else 0.9] * 2] * 2}
             for r in runs}
  text = niah_aggregators.report(results, runs)
  assert f"Merged with {path} (main tables, heatmaps, depth plot, stage table)." in text
  assert f"Every model: seeds [0, 1] from {path}, [2] from this report's runs." in text
  assert "| merlin | 0.70 ± 0.20 | 0.70 ± 0.20 | 0.70 ± 0.20 |" in text  # 0.5, 0.7 and 0.9
  assert "| merlin | 0.70 ± 0.25 | 0.70 ± 0.15 |" in text                # by depth
  assert "| merlin | 0.10 ± 0.10 | 0.70 ± 0.20 |" in text                # stages: 0.0, 0.2, 0.1
  assert "| vanilla | 0.10 | 0.90 |" in text   # the file has no stage lists for it ...
  assert "this report's seeds only for vanilla" in text  # ... and the output says so
  summary = json.loads((parsed_flags / "out" / "niah_aggregators.json").read_text())
  assert summary["merlin"]["seeds"] == [0, 1, 2]
  assert summary["merlin"]["grid_mean"][1] == pytest.approx([0.7, 0.7])  # (2 x 0.6 + 0.9) / 3
  assert summary["merlin"]["overall_per_seed"] == pytest.approx([0.5, 0.7, 0.9])
  _parse(parsed_flags, "--seeds=1", "--first_seed=1", "--sweeps=main", "--curriculum=n4_len128",
         f"--merge_summary={path}")
  runs = niah_aggregators.runs()
  with pytest.raises(ValueError, match=r"already holds seed\(s\) \[1\]"):
    niah_aggregators.report({r.name: results[r.name.replace("seed1", "seed2")] for r in runs}, runs)


def test_lr_sweep_runs_are_named_by_their_learning_rate(parsed_flags):
  assert [mqar_capacity.lr_text(x) for x in ("1e-3", 0.001, "3e-4", 2.5e-3, "1e-2")] == [
      "1e-3", "1e-3", "3e-4", "2.5e-3", "1e-2"]
  _parse(parsed_flags, "--seeds=3", "--first_seed=1", "--e=1,4", "--lrs=1e-3,0.0003")
  assert [r.name for r in mqar_capacity.lr_runs()] == [
      "mqar_e1_lr1e-3_seed1", "mqar_e1_lr3e-4_seed1", "mqar_e4_lr1e-3_seed1",
      "mqar_e4_lr3e-4_seed1"]
  run = mqar_capacity.lr_runs()[1]
  assert run.group == {"e": 1, "lr": 3e-4, "seed": 1}
  assert common.run_config(run).train.learning_rate == pytest.approx(3e-4)
  # without a best lr per E (no --lrs, and what equal_state and upgrade share): today's names
  assert [r.name for r in mqar_capacity.runs()] == [f"mqar_e{e}_seed{s}" for e in (1, 4)
                                                    for s in (1, 2, 3)]
  assert [r.name for r in mqar_capacity.runs({4: 3e-4})] == [
      "mqar_e4_lr3e-4_seed1", "mqar_e4_lr3e-4_seed2", "mqar_e4_lr3e-4_seed3"]


def test_best_lr_is_the_highest_mean_accuracy_a_tie_to_the_smaller(parsed_flags):
  _parse(parsed_flags, "--seeds=1", "--e=1,2,4,8", "--lrs=3e-3,1e-3,3e-4")
  phase1 = mqar_capacity.lr_runs()
  acc = {1: {3e-3: (0.25, 0.75), 1e-3: (0.5, 0.5), 3e-4: (0.5, 0.25)},  # 1e-3 ties 3e-3: 1e-3
         2: {3e-3: (0.9, 0.8), 1e-3: (0.9, 0.1), 3e-4: (0.0, 0.0)},
         4: {3e-3: None, 1e-3: None, 3e-4: (0.1, 0.0)},                # failed runs do not count
         8: {3e-3: None, 1e-3: None, 3e-4: None}}
  results = {r.name: acc[r.group["e"]][r.group["lr"]] for r in phase1}
  results = {n: a and {"step": 3, "accuracy_by_num_pairs": {"8": a[0], "16": a[1]}}
             for n, a in results.items()}
  scores = mqar_capacity.lr_scores(results, phase1)
  assert list(scores[1]) == [3e-4, 1e-3, 3e-3]
  assert scores[2] == pytest.approx({3e-4: 0.0, 1e-3: 0.5, 3e-3: 0.85})
  assert mqar_capacity.best_lrs(scores) == {1: 1e-3, 2: 3e-3, 4: 3e-4}
  table = mqar_capacity.lr_table(scores)
  assert "| E | lr 3e-4 | lr 1e-3 | lr 3e-3 | best lr |" in table
  assert "| 4 | 0.050 | — | — | 3e-4 |" in table and "| 8 | — | — | — | — |" in table


def test_zoology_protocol_trains_the_best_lr_seeds_once(parsed_flags, monkeypatch, capsys):
  """Phase 1 at every lr (seed 0), phase 2 the other seeds at the best lr only, in one call;
  a re-run, or a new workdir with --results_from, trains nothing; --deterministic reaches every
  process's XLA_FLAGS."""
  launched, envs = [], []
  best = {"1": "3e-4", "2": "1e-3"}

  def accuracy(name):  # the best lr by E learns, the other not; seeds spread by 0.1
    e, lr, _ = name.removeprefix("mqar_e").split("_")
    return (0.6 if lr == "lr" + best[e] else 0.2) + _seed_accuracy(name) - 0.5

  monkeypatch.setattr(sweep, "_launch", _fake_launch(launched, accuracy, envs))
  monkeypatch.setattr(sweep.time, "sleep", lambda s: None)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  args = ("--seeds=3", "--e=1,2", "--lrs=1e-3,3e-4", "--mqar_config=configs/mqar.py",
          "--deterministic")
  _parse(parsed_flags, *args)
  mqar_capacity.main([])
  trained = [name for script, name in launched if script == "train.py"]
  phase1 = [f"mqar_e{e}_lr{lr}_seed0" for e in (1, 2) for lr in ("1e-3", "3e-4")]
  assert sorted(trained[:4]) == sorted(phase1)
  assert sorted(trained[4:]) == [f"mqar_e{e}_lr{best[e]}_seed{s}" for e in "12" for s in (1, 2)]
  assert {e["XLA_FLAGS"] for e in envs} == {
      "--xla_force_host_platform_device_count=1 --xla_gpu_deterministic_ops=true"}
  summary = json.loads((parsed_flags / "out" / "mqar_capacity.json").read_text())
  assert summary["lr_sweep"]["best"] == best
  assert summary["lr_sweep"]["scores"]["1"] == pytest.approx({"3e-4": 0.6, "1e-3": 0.2})
  per_seed = summary["by_e"]["2"]["accuracy_per_seed"]
  assert [[round(a, 6) for a in seed] for seed in per_seed] == [[0.6] * 2, [0.7] * 2, [0.8] * 2]
  stored = json.loads((parsed_flags / "out" / "runs.json").read_text())
  assert len(stored) == 4 + 4  # phase 1's runs and phase 2's
  text = capsys.readouterr().out
  assert "| 2 | 1e-3 | 1.028 | 0.70 ± 0.10 | 0.70 ± 0.10 | > 16 / > 16 / > 16 |" in text
  assert "| E | lr 3e-4 | lr 1e-3 | best lr |\n|---|---|---|---|\n| 1 | 0.600 | 0.200 | 3e-4 |\n" \
      "| 2 | 0.200 | 0.600 | 1e-3 |" in text

  launched.clear()
  mqar_capacity.main([])  # the same workdir: every run is done
  _parse(parsed_flags / "new", *args, f"--results_from={parsed_flags / 'out' / 'runs.json'}")
  mqar_capacity.main([])  # a fresh workdir: every run is stored
  assert launched == []
  assert json.loads((parsed_flags / "new" / "out" / "mqar_capacity.json").read_text()) == summary


def test_deadline_counts_from_the_scripts_start(parsed_flags, monkeypatch):
  """A second sweep of one script (--lrs' phase 2) gets what is left of --deadline_s."""
  calls = []
  monkeypatch.setattr(sweep, "run_sweep", lambda runs, root, **kw: calls.append(kw) or {})
  monkeypatch.setattr(common, "START", common.time.time() - 100)
  _parse(parsed_flags, "--deadline_s=300")
  common.run([])
  assert 199 < calls[0]["deadline_s"] <= 200 and calls[0]["deterministic"] is False


@pytest.fixture
def text_flags(tmp_path):
  """--data: a tiny corpus of vocab 4096 (the parameter counts read its dataset.json)."""
  from lm import text_prep
  rng = np.random.default_rng(0)
  text_prep.write_dataset(str(tmp_path / "corpus"), (("eval" if i % 2 else "train",
                                                      np.append(rng.integers(1, 4096, 40), 0))
                                                     for i in range(6)),
                          vocab_size=4096, eod_id=0)
  _parse(tmp_path, "--seeds=2", f"--data={tmp_path / 'corpus'}", "--text_config=configs/text.py")
  yield tmp_path
  flags.FLAGS.unparse_flags()


def test_text_lm_runs_train_at_4k_and_evaluate_at_16k(text_flags):
  _parse(text_flags, "--seeds=1", "--first_seed=1", f"--data={text_flags / 'corpus'}",
         "--mixers=gdn,triadic_e8,attention,hybrid", "--extend_steps=100")
  runs = text_lm.runs()
  assert [r.name for r in runs] == [
      "text_gdn_seed1", "text_triadic_e8_seed1", "text_attention_seed1", "text_hybrid_seed1",
      "text_gdn_ext_seed1", "text_triadic_e8_ext_seed1", "text_attention_ext_seed1",
      "text_hybrid_ext_seed1"]
  cfg = {r.name: common.run_config(r) for r in runs}
  for r in runs[:4]:
    c = cfg[r.name]
    assert r.config == "configs/text.py:gpu" and r.after is None and c.seed == 1
    assert (c.data.seq_len, c.data.eval_seq_len, c.data.path) == (4096, 16384,
                                                                  str(text_flags / "corpus"))
    assert (c.model.num_layers, c.model.d_model, c.train.batch_size) == (8, 512, 8)
  m = {r.group["mixer"]: cfg[r.name].model for r in runs[:4]}
  assert (m["gdn"].mixer, m["gdn"].expand_e) == ("triadic_gdn", 1)
  assert (m["triadic_e8"].mixer, m["triadic_e8"].expand_e) == ("triadic_gdn", 8)
  assert m["attention"].mixer == "attention" and m["gdn"].layer_pattern == ""
  assert m["hybrid"].layer_pattern.split(",") == ["triadic_gdn"] * 3 + ["attention"]
  for base, ext in zip(runs[:4], runs[4:]):
    c = cfg[ext.name]
    assert ext.after == base.name and ext.group["stage"] == "extended"
    assert (c.data.seq_len, c.data.eval_seq_len, c.train.batch_size) == (16384, 16384, 2)
    assert (c.train.num_steps, c.train.warmup_steps) == (100, 10)
    assert c.model.rope_base == (2e6 if base.group["mixer"] in ("attention", "hybrid") else 1e4)
  _parse(text_flags, "--mixers=mamba")
  with pytest.raises(ValueError, match="'mamba' is not one of"):
    text_lm.runs()


def test_text_lm_buckets_weigh_positions_by_their_tokens():
  assert text_lm.position_edges(16384) == [0, 256, 512, 1024, 2048, 4096, 8192, 16384]
  assert text_lm.position_edges(3000) == [0, 256, 512, 1024, 2048, 3000]
  result = {"perplexity_by_position": [math.e, math.e ** 2, None, 4.0],
            "tokens_by_position": [1, 3, 0, 2]}
  got = text_lm.bucketed(result, [0, 2, 3, 4])
  assert got[0] == pytest.approx(math.exp((1 + 3 * 2) / 4)) and math.isnan(got[1])
  assert got[2] == pytest.approx(4.0)


def _text_result(mixer: str, seed: int, context: int = 1024, train_len: int = 256) -> dict:
  """Perplexity 10 at every position, attention's doubling past ``train_len``; seed 1 adds 1."""
  ppl = [10.0 * (2 if mixer == "attention" and p >= train_len else 1) + seed
         for p in range(context)]
  return {"task": "text", "step": 7, "context": context, "perplexity": 12.0 + seed,
          "perplexity_by_position": ppl, "tokens_by_position": [4] * context}


def test_text_lm_report_table_plot_and_json(text_flags):
  _parse(text_flags, "--seeds=2", f"--data={text_flags / 'corpus'}", "--train_len=256",
         "--eval_len=1024", "--text_config=configs/text.py", "--mixers=gdn,attention")
  runs = text_lm.runs()
  results = {r.name: _text_result(r.group["mixer"], r.group["seed"]) for r in runs}
  results["text_gdn_seed1"] = None  # a failed run: gdn's mean is seed 0's
  text = text_lm.report(results, runs)
  assert (f"Corpus {text_flags / 'corpus'}; model 4 layers, d_model 128, 4 heads of 32, MLP 352, "
          "vocab 4096; 400 steps of 16 x 256 tokens; evaluated on windows of 1024") in text
  assert "| mixer | non-emb. params | all | 0–256 | 256–512 | 512–1k |" in text
  assert "| gdn | 1.4M | 12.00 | 10.00 | 10.00 | 10.00 |" in text
  assert ("| attention | 1.3M | 12.50 ± 0.50 | 10.50 ± 0.50 | 20.50 ± 0.50 | 20.50 ± 0.50 |"
          in text)
  assert "no result for ['text_gdn_seed1']" in text
  out = text_flags / "out"
  summary = json.loads((out / "text_lm.json").read_text())
  assert summary["train_len"] == 256 and summary["eval_len"] == 1024
  att = summary["by_mixer"]["attention"]
  assert att["seeds"] == [0, 1] and att["bucket_edges"] == [0, 256, 512, 1024]
  assert att["curve_perplexity_mean"][0] == pytest.approx(10.5)
  assert att["curve_perplexity_mean"][-1] == pytest.approx(20.5)
  assert summary["by_mixer"]["gdn"]["non_embedding_params"] > att["non_embedding_params"]
  assert (out / "text_lm.png").stat().st_size > 0
