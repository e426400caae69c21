"""Evaluate a trained checkpoint, or count a config's parameters.

  python eval.py --workdir runs/mqar [--step N] [--config configs/mqar.py]
  python eval.py --count_params --config configs/lm_1p3b.py

Writes ``<workdir>/eval/*.json`` and PNG plots (MQAR accuracy by pairs, needle depth x length,
text perplexity by position). Without ``--config`` the run's own ``config.json`` is used.
"""

import json

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (default: the workdir's).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A workdir written by train.py.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_COUNT = flags.DEFINE_bool("count_params", False,
                           "Print parameter counts and state bytes as one JSON line, and exit.")


def main(argv):
  del argv
  from lm import eval_loop, logger
  logger.quiet_orbax()
  config = _CONFIG.value
  if config is None:
    if not _WORKDIR.value:
      raise app.UsageError("give --workdir (a training run) or --config")
    config = eval_loop.load_config(_WORKDIR.value)
  if _COUNT.value:
    print(json.dumps(eval_loop.count(config)))
    return
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required to evaluate")
  print(json.dumps(eval_loop.evaluate(config, _WORKDIR.value, _STEP.value)))


if __name__ == "__main__":
  app.run(main)
