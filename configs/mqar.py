"""MQAR, the default job: a 2-layer Triadic GDN (4 heads of 16, E = 4) on multi-query associative
recall; trains and evaluates on a CPU in a few minutes.

  python train.py --config configs/mqar.py --workdir runs/mqar
  python eval.py --workdir runs/mqar

Another mixer or E: ``--config.model.mixer=gdn``, ``--config.model.expand_e=16``.
"""

from lm.config import base_config


def get_config():
  c = base_config("mqar")
  c.model.update(mixer="triadic_gdn", expand_e=4, num_layers=2, d_model=64, num_heads=4,
                 head_dim=16, mlp_dim=128)
  c.train.update(num_steps=400, batch_size=32, learning_rate=3e-3, warmup_steps=50,
                 log_every=50, checkpoint_every=200)
  return c
