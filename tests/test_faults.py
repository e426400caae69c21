"""Fault injection: a run killed (SIGKILL) at a random point or in the middle of a checkpoint save,
or whose newest checkpoint is damaged in any of the ways a crash or a full disk leaves it, resumes
from the newest intact checkpoint and ends with the same losses as an uninterrupted run. Also the
other failure paths of training and evaluation: NaN before the first checkpoint, init_from a
non-checkpoint, a rerun with a changed config or past num_steps, eval under another config.

Every case shares one uninterrupted baseline run (``baseline``, module scope); the kill cases run
the training in a subprocess (tests/train_util.py's ``fault_config``) that shares this process's
compilation cache.
"""

import glob
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from lm import checkpoint, eval_loop, logger, train_loop, train_step
from tests.train_util import fault_config, tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import triadic  # noqa: F401  (the XLA:CPU flag, as in conftest)
from lm import checkpoint, train_loop
from tests.train_util import fault_config
kill_at = int(os.environ.get("KILL_AT_SAVE", "0"))
if kill_at:
  real = checkpoint.save
  def save(mngr, step, *args, **kwargs):
    started = real(mngr, step, *args, **kwargs)
    if step == kill_at:  # the async write has started, not finished
      os.kill(os.getpid(), signal.SIGKILL)
    return started
  checkpoint.save = save
train_loop.train(fault_config(), sys.argv[1])
"""


def logged_losses(workdir):
  """{step: loss} of the TensorBoard events (TFRecord: length, crc, Event proto, crc)."""
  from tensorboardX.proto import event_pb2
  out = {}
  for path in glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")):
    data, i = open(path, "rb").read(), 0
    while i + 12 <= len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      out.update({event.step: v.simple_value for v in event.summary.value if v.tag == "train/loss"})
      i += 16 + n
  return out


def losses(workdir):
  """{step: loss} of metrics.jsonl (a line torn by a kill is skipped)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:
        continue
      out[record["step"]] = record["loss"]
  return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("baseline"))
  last = train_loop.train(fault_config(), workdir)
  assert last["step"] == 8
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "6", "8"]
  return workdir, losses(workdir)


def _copy(baseline, tmp_path):
  dst = str(tmp_path / "run")
  shutil.copytree(baseline[0], dst)
  return dst


def _child(workdir, **env):
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5", "PYTHONPATH": REPO, **env}
  return subprocess.Popen([sys.executable, "-c", _CHILD.format(repo=REPO), workdir], env=env,
                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


# ---------------------------------------------------------------------------------------------
# SIGKILL


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_save_resumes_on_the_same_curve(baseline, tmp_path):
  workdir = str(tmp_path / "run")
  proc = _child(workdir, KILL_AT_SAVE="6")
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == -signal.SIGKILL, err[-3000:]
  assert "6" not in os.listdir(os.path.join(workdir, "checkpoints"))  # killed before the commit
  last = train_loop.train(fault_config(), workdir)
  assert last["step"] == 8
  assert losses(workdir) == baseline[1]


@pytest.mark.slow
def test_sigkill_at_a_random_point_resumes_on_the_same_curve(baseline, tmp_path):
  """Killed at a random moment after the first logged step (seeded: reproducible)."""
  workdir = str(tmp_path / "run")
  proc = _child(workdir)
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 300
  while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    assert time.time() < deadline
    time.sleep(0.02)
  time.sleep(random.Random(20).uniform(0.0, 1.0))
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  # TensorBoard events are written through at each log: the killed run's hold every logged step.
  logged, events = losses(workdir), logged_losses(workdir)
  assert events and set(logged) - set(events) <= {max(logged)}  # killed between the two writes
  assert np.allclose([logged[k] for k in events], list(events.values()))
  last = train_loop.train(fault_config(), workdir)
  assert last["step"] == 8
  assert losses(workdir) == baseline[1]


def test_events_are_on_disk_at_each_log(tmp_path):
  log = logger.MetricsLogger(str(tmp_path), 10, 1, 1.0, None)
  for step in range(1, 4):
    log.write(step, {"loss": 1.5 / step})
    assert logged_losses(str(tmp_path)) == {s: pytest.approx(1.5 / s) for s in range(1, step + 1)}
  log.close()


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _data_files(step_dir):
  return [f for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
          if os.path.isfile(f)]


def _largest_data_file(step_dir):
  return max(_data_files(step_dir), key=os.path.getsize)


DAMAGE = {
    "data_file": lambda d: _truncate(_largest_data_file(d)),
    "metadata": lambda d: _truncate(os.path.join(d, "state", "_METADATA")),
    "manifest": lambda d: _truncate(os.path.join(d, "state", "manifest.ocdbt")),
    "iterator_json": lambda d: _truncate(glob.glob(os.path.join(d, "data", "*.json"))[0]),
    "missing_data_file": lambda d: os.remove(_largest_data_file(d)),
    "missing_state": lambda d: shutil.rmtree(os.path.join(d, "state")),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_latest_checkpoint_falls_back_to_the_newest_intact(baseline, tmp_path, damage,
                                                                   caplog):
  workdir = _copy(baseline, tmp_path)
  DAMAGE[damage](os.path.join(workdir, "checkpoints", "8"))
  last = train_loop.train(fault_config(), workdir)
  assert last["step"] == 8
  assert losses(workdir) == baseline[1]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "6", "8", "8.corrupt"]
  bad = os.path.join(workdir, "checkpoints", "8")
  assert any(bad in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records)


def test_two_damaged_checkpoints_fall_back_twice(baseline, tmp_path):
  workdir = _copy(baseline, tmp_path)
  for step in ("8", "6"):
    DAMAGE["manifest"](os.path.join(workdir, "checkpoints", step))
  assert train_loop.train(fault_config(), workdir)["step"] == 8
  assert losses(workdir) == baseline[1]


def test_no_intact_checkpoint_is_a_clear_error(baseline, tmp_path):
  workdir = _copy(baseline, tmp_path)
  for step in ("4", "6", "8"):
    DAMAGE["metadata"](os.path.join(workdir, "checkpoints", step))
  with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint in .* reads back(.|\n)*/8:"):
    train_loop.train(fault_config(), workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "6", "8"]  # untouched


def test_eval_falls_back_or_names_the_bad_step(baseline, tmp_path, caplog):
  workdir = _copy(baseline, tmp_path)
  # Every data file: eval restores the parameters only, and which file holds them (rather than
  # the optimizer state) is up to orbax's writers.
  for path in _data_files(os.path.join(workdir, "checkpoints", "8")):
    _truncate(path)
  config = eval_loop.load_config(workdir)
  assert eval_loop.evaluate(config, workdir)["step"] == 6
  assert any("checkpoints/8" in r.getMessage() for r in caplog.records)
  with pytest.raises(checkpoint.CheckpointError, match=r"checkpoints/8 \(step 8\) is unreadable.*--step"):
    eval_loop.evaluate(config, workdir, step=8)
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "8"))  # eval never moves anything


# ---------------------------------------------------------------------------------------------
# Reruns, NaN, init_from


def test_rerun_past_num_steps_does_nothing_and_says_so(baseline, tmp_path, caplog):
  workdir = _copy(baseline, tmp_path)
  for num_steps in (8, 5):
    c = fault_config()
    c.train.update(num_steps=num_steps, warmup_steps=1)
    last = train_loop.train(c, workdir)
    assert last["step"] == 8 and last["loss"] == baseline[1][8]
    assert any(f"already at step 8 >= train.num_steps {num_steps}; nothing to do" in r.getMessage()
               for r in caplog.records)
  assert losses(workdir) == baseline[1]


def test_rerun_with_a_changed_config_warns_and_keeps_the_history(baseline, tmp_path, caplog):
  workdir = _copy(baseline, tmp_path)
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  c = fault_config()
  c.train.log_every = 2  # a change that needs no new compilation
  train_loop.train(c, workdir)
  warning = [r.getMessage() for r in caplog.records if "changed config" in r.getMessage()]
  assert warning and "train.log_every: 1 -> 2" in warning[0]
  assert {"config.json", "config.0.json", "config.6.json"} <= set(os.listdir(workdir))
  with open(os.path.join(workdir, "config.0.json")) as f:
    assert json.load(f)["train"]["log_every"] == 1
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["train"]["log_every"] == 2


def test_nan_before_the_first_checkpoint_says_so_and_keeps_metrics(tmp_path, monkeypatch):
  c = fault_config()
  c.train.update(log_every=50, checkpoint_every=50, num_steps=60)
  real = train_step.loss_fn
  monkeypatch.setattr(train_step, "loss_fn",
                      lambda *a: (lambda l, aux: (l * np.nan, aux))(*real(*a)))
  with pytest.raises(FloatingPointError, match="at step 1: stopping. No checkpoint saved yet"):
    train_loop.train(c, str(tmp_path), stop_at=lambda step: step == 2)
  assert np.isnan(losses(tmp_path)[1])


@pytest.mark.parametrize("kind", ["text_file", "junk_dir", "empty_step"])
def test_init_from_a_non_checkpoint_is_a_clear_error(tmp_path, kind):
  path = tmp_path / "src"
  if kind == "text_file":
    path.write_text("hello")
  else:
    (path / ("7/state" if kind == "empty_step" else "junk")).mkdir(parents=True)
  c = tiny_config()
  c.init_from = str(path)
  with pytest.raises(ValueError, match=f"not a checkpoint: {path}"):
    train_loop.train(c, str(tmp_path / "run"))


# ---------------------------------------------------------------------------------------------
# Evaluation under another config


def test_eval_refuses_a_model_change_and_separates_other_configs(baseline, tmp_path):
  workdir = _copy(baseline, tmp_path)
  config = eval_loop.load_config(workdir)
  for key, value in (("mixer", "triadic_sgla"), ("dtype", "bfloat16")):
    other = eval_loop.load_config(workdir)
    other.model[key] = value
    with pytest.raises(eval_loop.ModelChangeError, match=f"model.{key}"):
      eval_loop.evaluate(other, workdir)
  default = eval_loop.evaluate(config, workdir)
  assert all(os.path.dirname(f) == os.path.join(workdir, "eval") for f in default["files"])
  fewer = eval_loop.load_config(workdir)
  fewer.data.num_eval_examples = 4
  fewer.model.impl = "scan"  # the same maths: allowed
  # A run saved before model.scan_unroll existed lacks the key; a config with it is allowed.
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  del saved["model"]["scan_unroll"]
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(saved, f)
  result = eval_loop.evaluate(fewer, workdir)
  variant = os.path.join(workdir, "variants",
                         "data.num_eval_examples=4,model.impl=scan,model.scan_unroll=1")
  assert all(f.startswith(variant) for f in result["files"])
  with open(os.path.join(workdir, "eval", "mqar_step8.json")) as f:
    assert json.load(f)["data_config"]["num_eval_examples"] == 8  # not overwritten
