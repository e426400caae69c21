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
