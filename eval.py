"""Evaluate a trained checkpoint, or count a config's parameters.

  python eval.py --workdir runs/mqar [--step N] [--config.data.num_eval_examples=256 ...]
  python eval.py --workdir runs/niah --generate     # needles scored by greedy decoding
  python eval.py --count_params --config configs/lm_1p3b.py

Writes ``<workdir>/eval/*.json`` and PNG plots (MQAR accuracy by pairs, needle depth x length,
text perplexity by position bucket). The config is the run's own ``<workdir>/config.json`` unless
``--config`` names another (a Python config file, or a config.json); ``--config.X=value``
overrides apply on top of either. A config whose data or model section differs from the run's
writes under ``<workdir>/variants/<changed keys>/eval/`` instead; a model change that changes the
maths (mixer, dtype, sizes; not impl or chunk_size) is refused without ``--allow_model_change``.
``--generate`` (the same as ``--config.eval.mode=generate``) decodes each needle's value greedily
from the prompt up to its query instead of teacher forcing; it writes
``niah_generate_step<N>.json`` and its own plots. Without ``--step`` an unreadable newest
checkpoint is skipped (with a warning) for the newest one that reads back.
"""

import json
import os
import sys

from absl import app, flags

from lm import cli
from triadic.xla_flags import apply_cpu_workaround

apply_cpu_workaround()  # before the CPU backend starts

_SAVED = os.path.join(cli.prescan(sys.argv, workdir="")["workdir"] or "", "config.json")
_CONFIG = cli.define_config("eval.py", default=_SAVED if os.path.isfile(_SAVED) else None,
                            help_string="Config file or config.json (default: the workdir's).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A workdir written by train.py.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest readable one).")
_COUNT = flags.DEFINE_bool("count_params", False,
                           "Print parameter counts and state bytes as one JSON line, and exit.")
_GENERATE = flags.DEFINE_bool(
    "generate", False, "Score by greedy generation (eval.mode='generate'; needle task only).")
_ALLOW = flags.DEFINE_bool("allow_model_change", False,
                           "Evaluate the checkpoint under a model section that differs from the "
                           "run's saved config.")


def main(argv):
  del argv
  from lm import logger
  logger.quiet_cpu_startup()
  from lm import checkpoint, eval_loop
  logger.quiet_orbax()
  config = _CONFIG.value
  if config is None:
    if not _WORKDIR.value:
      raise app.UsageError("give --workdir (a training run) or --config")
    raise app.UsageError(f"{os.path.join(_WORKDIR.value, 'config.json')} not found: is "
                         f"{_WORKDIR.value} a workdir written by train.py? Else pass --config")
  if _COUNT.value:
    print(json.dumps(eval_loop.count(config)))
    return
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required to evaluate")
  mode = "generate" if _GENERATE.value else None  # None: config.eval.mode
  try:
    result = eval_loop.evaluate(config, _WORKDIR.value, _STEP.value, mode=mode,
                                allow_model_change=_ALLOW.value)
  except (checkpoint.CheckpointError, eval_loop.ModelChangeError, FileNotFoundError) as err:
    print(f"eval.py: error: {err}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
