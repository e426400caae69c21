"""Run a set of train.py + eval.py jobs side by side, then hand their evaluation results back.

Each ``Run`` is one ``python train.py --config <config> --workdir <root>/<name> <overrides>``
followed by ``python eval.py --workdir <root>/<name>``, in its own process, logging to
``<root>/<name>/{train,eval}.log``. Up to ``parallel`` runs go at once (small models leave a GPU
mostly idle, so several share one; each process gets an equal slice of its memory). A run that
names another in ``after`` starts from that run's final checkpoint (``--config.init_from``) once
it has finished.

Re-running the same sweep resumes it: finished runs (their eval JSON exists) are skipped and
unfinished ones resume from their last checkpoint (train.py does that by itself). With a
``deadline_s``, runs still training at the deadline get SIGTERM, which makes train.py save and
exit (the preemption path), and are evaluated at the step they reached; the report says which
step each result comes from. Runs finished elsewhere (under a workdir that is gone) come in as
``stored`` results: they are not trained, and a run that starts from one of them needs that
run's checkpoints under ``root`` all the same.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import signal
import subprocess
import sys
import time

from absl import logging

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Run:
  """One training run: ``name`` (its sub-directory), a config file and ``--config.*`` overrides."""
  name: str
  config: str
  overrides: tuple[str, ...] = ()
  after: str | None = None  # start from this run's final checkpoint (init_from)
  group: dict = dataclasses.field(default_factory=dict, compare=False)  # labels for the report


def eval_result(workdir: str) -> dict | None:
  """The newest teacher-forced evaluation JSON in ``workdir/eval`` (None if there is none)."""
  files = [f for f in glob.glob(os.path.join(workdir, "eval", "*_step*.json"))
           if "_generate_" not in os.path.basename(f)]
  if not files:
    return None
  newest = max(files, key=lambda f: int(f.rsplit("_step", 1)[1].split(".")[0]))
  with open(newest) as f:
    return json.load(f)


def _last_step(workdir: str) -> int:
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = f.read().splitlines()
    return json.loads(lines[-1])["step"] if lines else 0
  except (OSError, ValueError, KeyError):
    return 0


def _env(parallel: int, deterministic: bool = False) -> dict:
  env = dict(os.environ)
  if deterministic:
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS"),
                                            "--xla_gpu_deterministic_ops=true") if f)
  # Each process also needs memory outside its pool (CUDA context, cuBLAS workspaces): at 0.9 /
  # 15 on an 80 GB card, 12 of 15 runs could not start cuBLASLt ("BlasLt is unavailable").
  fraction = 0.75 if parallel <= 1 else min(0.75, 0.6 / parallel)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{fraction:.3f}")
  env.setdefault("PYTHONUNBUFFERED", "1")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
  return env


def _launch(args: list[str], log_path: str, env: dict) -> subprocess.Popen:
  log = open(log_path, "a")
  return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                          env=env)


def run_sweep(runs: list[Run], root: str, *, parallel: int, deadline_s: float | None = None,
              stored: dict[str, dict] | None = None, deterministic: bool = False,
              poll_s: float = 5.0, log_every_s: float = 30.0) -> dict[str, dict | None]:
  """Train and evaluate every run but those with a result in ``stored`` (returned as given);
  returns {name: evaluation dict, or None if it failed}. ``deterministic`` adds
  --xla_gpu_deterministic_ops=true to the processes' XLA_FLAGS."""
  names = [r.name for r in runs]
  if len(set(names)) != len(names):
    raise ValueError(f"run names must be unique, got {names}")
  by_name = {r.name: r for r in runs}
  for r in runs:
    if r.after is not None and r.after not in by_name:
      raise ValueError(f"run {r.name!r}: after={r.after!r} is not a run of this sweep")
  if parallel < 1:
    raise ValueError(f"parallel must be >= 1, got {parallel}")
  root = os.path.abspath(root)
  env = _env(parallel, deterministic)
  start = time.time()
  stored = stored or {}
  done = set(stored) | {r.name for r in runs if eval_result(os.path.join(root, r.name)) is not None}
  failed: set[str] = set()
  waiting = [r for r in runs if r.name not in done]
  for r in waiting:
    if r.after in stored and not os.path.isdir(os.path.join(root, r.after, "checkpoints")):
      raise ValueError(f"run {r.name!r} starts from {r.after!r}, which has a stored result but "
                       f"no checkpoints under {root}: leave {r.after!r} out of the stored "
                       "results to train both")
  active: dict[str, tuple[str, subprocess.Popen]] = {}  # name -> (phase, process)
  stopping = False
  last_log = 0.0

  def workdir(r):
    return os.path.join(root, r.name)

  def start_eval(r):
    active[r.name] = ("eval", _launch(["eval.py", f"--workdir={workdir(r)}"],
                                      os.path.join(workdir(r), "eval.log"), env))

  while waiting or active:
    now = time.time() - start
    if deadline_s is not None and now > deadline_s and not stopping:
      stopping = True
      logging.warning("deadline of %.0f s reached: stopping the runs still training", deadline_s)
      for phase, proc in active.values():
        if phase == "train":
          proc.send_signal(signal.SIGTERM)
    for name, (phase, proc) in list(active.items()):
      if proc.poll() is None:
        continue
      del active[name]
      r = by_name[name]
      if proc.returncode != 0 and not (phase == "train" and stopping and _last_step(workdir(r))):
        logging.error("%s: %s failed (exit %d), see %s/%s.log", name, phase, proc.returncode,
                      workdir(r), phase)
        failed.add(name)
      elif phase == "train":
        start_eval(r)
      else:
        done.add(name)
        res = eval_result(workdir(r))
        headline = {k: res[k] for k in ("accuracy", "accuracy_by_num_pairs", "accuracy_by_depth",
                                        "accuracy_by_length", "perplexity") if k in res}
        logging.info("%s: step %d %s", name, res["step"], json.dumps(headline))
    for r in list(waiting):
      if len(active) >= parallel:
        break
      if r.after in failed:
        waiting.remove(r)
        failed.add(r.name)
        continue
      if r.after is not None and r.after not in done:
        continue
      if stopping:  # past the deadline: evaluate what exists, start nothing new
        waiting.remove(r)
        if os.path.exists(os.path.join(workdir(r), "metrics.jsonl")):
          start_eval(r)
        else:
          failed.add(r.name)
        continue
      waiting.remove(r)
      os.makedirs(workdir(r), exist_ok=True)
      args = ["train.py", f"--config={r.config}", f"--workdir={workdir(r)}", *r.overrides]
      if r.after is not None:
        args.append(f"--config.init_from={workdir(by_name[r.after])}")
      active[r.name] = ("train", _launch(args, os.path.join(workdir(r), "train.log"), env))
    if now - last_log >= log_every_s or not (waiting or active):
      last_log = now
      busy = ", ".join(f"{n}:{p}@{_last_step(workdir(by_name[n]))}" for n, (p, _) in active.items())
      logging.info("[%4.0f s] done %d/%d, failed %d, waiting %d; running: %s", now, len(done),
                   len(runs), len(failed), len(waiting), busy or "-")
    if waiting or active:
      time.sleep(poll_s)
  return {r.name: stored[r.name] if r.name in stored else
          (eval_result(workdir(r)) if r.name in done else None) for r in runs}
