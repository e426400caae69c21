"""Byte-level language modelling on any text files: a small Triadic GDN (E = 4) LM.

  python train.py --config configs/text.py --workdir runs/text --config.data.text_glob='docs/**/*.md'
  python eval.py --workdir runs/text

Perplexity is reported per bucket of positions (does the model use long context?).
"""

from lm.config import base_config


def get_config():
  c = base_config("text")
  c.model.update(mixer="triadic_gdn", expand_e=4, num_layers=4, d_model=128, num_heads=4,
                 head_dim=32, mlp_dim=352)
  c.train.update(num_steps=2000, batch_size=16, learning_rate=2e-3, warmup_steps=100,
                 log_every=50, checkpoint_every=500)
  return c
