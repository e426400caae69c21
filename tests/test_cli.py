"""Start-up errors of the entry points and the config checks: one line for an unknown key or a
missing config file, checks against the data (vocab_size, multi-state capacity), MFU only for a
known device peak, one accounting of the decode state, the experiments' --out default."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from lm import costs, logger, text_prep
from lm.config import base_config, validate
from lm.model import ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, cwd=REPO):
  return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": REPO}, timeout=120)


def test_unknown_config_key_is_one_line_with_the_suggestion(tmp_path):
  r = _run(["train.py", f"--workdir={tmp_path}", "--config.train.num_stepz=3"])
  assert r.returncode == 2
  assert r.stderr.strip().count("\n") == 0, r.stderr
  assert 'Did you mean "num_steps"' in r.stderr


def test_config_file_not_found_from_another_directory(tmp_path):
  r = _run([os.path.join(REPO, "train.py"), f"--workdir={tmp_path / 'w'}",
            "--config=configs/mqar.py"], cwd=tmp_path)
  assert r.returncode == 2
  assert "configs/mqar.py not found relative to the current directory" in r.stderr
  assert os.path.join(REPO, "configs", "mqar.py") in r.stderr


def test_eval_takes_a_saved_config_json_with_overrides(tmp_path):
  """--config W/config.json loads (through lm/saved_config.py) and --config.X applies on top;
  --count_params needs no checkpoint."""
  config = base_config("mqar")
  (tmp_path / "config.json").write_text(config.to_json_best_effort())
  r = _run(["eval.py", f"--config={tmp_path / 'config.json'}", "--config.model.num_layers=4",
            "--count_params"])
  assert r.returncode == 0, r.stderr[-2000:]
  config.model.num_layers = 4
  from lm import eval_loop
  assert r.stdout.strip().endswith("}")
  import json
  assert json.loads(r.stdout.strip().splitlines()[-1])["total"] == eval_loop.count(config)["total"]


def test_text_vocab_smaller_than_the_dataset_is_a_startup_error(tmp_path):
  docs = [np.array([5, 200, 7, 0]), np.array([9, 255, 0]), np.array([3, 0])]
  text_prep.write_dataset(str(tmp_path / "text"), (("eval" if i == 2 else "train", d)
                                                   for i, d in enumerate(docs)),
                          vocab_size=256, eod_id=0)
  c = base_config("text")
  c.data.path = str(tmp_path / "text")
  c.data.vocab_size = 64
  with pytest.raises(ValueError, match=r"data.vocab_size=64 is smaller than the vocabulary"):
    validate(c)


def test_multistate_eval_lengths_past_capacity_are_a_startup_error():
  c = base_config("niah")
  c.model.update(mixer="multistate_gdn", segment_len=16, max_segments=8)  # holds 128
  c.data.update(seq_len=128, eval_lengths=(64, 128, 256))
  with pytest.raises(ValueError, match=r"data.eval_lengths\[2\] = 256 exceeds .* = 128"):
    validate(c)
  c.data.eval_lengths = (64, 128)
  validate(c)


def test_mfu_only_where_the_peak_is_known(tmp_path, caplog):
  assert costs.peak_flops("cpu") is None
  assert costs.peak_flops("NVIDIA H200") == costs.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert costs.peak_flops("cpu", 100.0) == 100e12
  import logging
  # The absl logger's own level too: parsing absl flags (another test's train.py-style run in
  # this process) sets it from --verbosity, which the root level does not override.
  caplog.set_level(logging.INFO)
  caplog.set_level(logging.INFO, logger="absl")
  log = logger.MetricsLogger(str(tmp_path), 10, 1, 1.0, costs.peak_flops(jax.devices()[0].device_kind))
  log.write(1, {"loss": 1.0})
  log.close()
  line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1/10")][0]
  assert "MFU" not in line
  assert "mfu" not in open(tmp_path / "metrics.jsonl").read()


@pytest.mark.parametrize("mixer,aggregator", [("multistate_gdn", "merlin"),
                                              ("multistate_gdn", "meanpool"),
                                              ("multistate_mamba2", "position"),
                                              ("multistate_mamba2", "merlin")])
def test_decode_state_bytes_are_one_accounting(mixer, aggregator):
  """lm.costs (the cache itself), the layer's state_memory and the cache's moments agree."""
  from lm.mixers import make_mixer
  from merlin.memory import MOMENT_SIZES
  cfg = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, head_dim=8, mlp_dim=64,
                    mixer=mixer, aggregator=aggregator, segment_len=8, max_segments=4, d_r=4,
                    state_dim=8)
  layer = make_mixer(mixer, cfg, parent=None)
  cache = jax.eval_shape(lambda: layer.init_cache(1, 32))
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  memory = layer.state_memory()
  assert nbytes(cache["moments"]) == memory.moment_bytes_per_layer
  groups = 2 if mixer == "multistate_gdn" else 1
  assert memory.moment_bytes_per_layer == 4 * 4 * groups * MOMENT_SIZES[aggregator](4)
  assert nbytes(cache["state"]) == memory.state_bytes_per_layer
  conv = nbytes(cache["conv"])
  assert costs.state_bytes(cfg, 32)["recurrent_state"] == memory.total_bytes_per_layer + conv


def test_experiments_write_into_the_workdir_by_default(tmp_path):
  from absl import flags
  from experiments import common
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["prog", f"--workdir={tmp_path}"])
  try:
    assert str(common.out_dir()) == os.path.join(str(tmp_path), "figures")
  finally:
    flags.FLAGS.unparse_flags()


def test_quiet_cpu_startup_drops_the_backend_probe_lines(caplog):
  import logging
  caplog.set_level(logging.INFO)
  logger.quiet_cpu_startup()
  probe = logging.getLogger("jax._src.xla_bridge")
  probe.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
  probe.info("devices found")
  messages = [r.getMessage() for r in caplog.records]
  assert "devices found" in messages and not any("libtpu" in m for m in messages)
