"""Evaluate a trained checkpoint, or count a config's parameters.

  python eval.py --workdir runs/mqar [--step N] [--config configs/mqar.py]
  python eval.py --workdir runs/niah --generate     # needles scored by greedy decoding
  python eval.py --count_params --config configs/lm_1p3b.py

Writes ``<workdir>/eval/*.json`` and PNG plots (MQAR accuracy by pairs, needle depth x length,
text perplexity by position). Without ``--config`` the run's own ``config.json`` is used.
``--generate`` (the same as ``--config.eval.mode=generate`` with ``--config``) decodes each needle's
value greedily from the prompt up to its query instead of teacher forcing; it writes
``niah_generate_step<N>.json`` and its own plots.
"""

import json

from absl import app, flags
from ml_collections import config_flags

from triadic.xla_flags import apply_cpu_workaround

apply_cpu_workaround()  # before the CPU backend starts

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (default: the workdir's).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A workdir written by train.py.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_COUNT = flags.DEFINE_bool("count_params", False,
                           "Print parameter counts and state bytes as one JSON line, and exit.")
_GENERATE = flags.DEFINE_bool(
    "generate", False, "Score by greedy generation (eval.mode='generate'; needle task only).")


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
  mode = "generate" if _GENERATE.value else None  # None: config.eval.mode
  print(json.dumps(eval_loop.evaluate(config, _WORKDIR.value, _STEP.value, mode=mode)))


if __name__ == "__main__":
  app.run(main)
