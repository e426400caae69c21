"""A tiny config shared by the training tests (small enough for a 2-core CPU)."""

from lm.config import base_config


def tiny_config(mixer="gdn", **model):
  c = base_config("mqar")
  c.data.train_settings = ((32, 4),)
  c.data.seq_len = 32
  c.data.eval_settings = ((32, 2), (32, 4))
  c.data.num_eval_examples = 8
  c.data.worker_threads = 1
  c.model.update(mixer=mixer, num_layers=2, d_model=32, num_heads=4, head_dim=8, mlp_dim=64,
                 **model)
  c.train.update(num_steps=6, batch_size=8, warmup_steps=1, log_every=1, checkpoint_every=3)
  c.eval.batch_size = 8
  return c


def distributed_config(data=1, tensor=1):
  """tiny_config with 3 steps and a checkpoint at the last, on a data x tensor mesh: the
  sharded and multi-process runs of tests/test_train_distributed.py and their reference."""
  c = tiny_config()
  c.train.num_steps, c.train.checkpoint_every = 3, 3
  c.mesh.update(data=data, tensor=tensor)
  return c


def fault_config():
  """tiny_config with 8 steps and a checkpoint every 2 (the last 3 kept: steps 4, 6, 8): the
  fault-injection tests kill and corrupt runs of it."""
  c = tiny_config()
  c.train.update(num_steps=8, checkpoint_every=2, keep_checkpoints=3, log_every=1)
  return c
