"""Train a language model of this repository.

  python train.py --config configs/mqar.py --workdir runs/mqar [--config.train.num_steps=200 ...]

Run again with the same workdir to resume from its latest checkpoint. On several hosts, launch
one process per host with ``--distributed`` (``jax.distributed.initialize()`` reads the cluster
from the environment: SLURM, TPU pods, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID).
"""

from absl import app, flags, logging

from lm import cli
from triadic.xla_flags import apply_cpu_workaround

apply_cpu_workaround()  # before the CPU backend starts

_CONFIG = cli.define_config("train.py", default=cli.repo_default("configs/mqar.py"),
                            help_string="Config file (a Python config file or a config.json).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and plots go here.",
                               required=True)
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() first.")


def main(argv):
  del argv
  from lm import logger
  logger.quiet_cpu_startup()
  import jax
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  from lm import train_loop
  logger.quiet_orbax()
  logging.info("devices: %s (process %d of %d)", jax.devices(), jax.process_index(),
               jax.process_count())
  train_loop.train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
