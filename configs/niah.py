"""Needle in a haystack for the multi-state models: a 2-layer multi-state Gated DeltaNet with the
MERLIN aggregator (segments of 32 tokens, up to 8 of them), trained on needles in contexts of up
to 128 tokens and evaluated up to 256.

  python train.py --config configs/niah.py --workdir runs/niah
  python eval.py --workdir runs/niah

Other aggregators: ``--config.model.aggregator=vanilla|position|meanpool``; the single-state
baseline: ``--config.model.mixer=gdn``.
"""

from lm.config import base_config


def get_config():
  c = base_config("niah")
  c.model.update(mixer="multistate_gdn", aggregator="merlin", segment_len=32, max_segments=8,
                 d_r=16, num_layers=2, d_model=64, num_heads=4, head_dim=16, mlp_dim=128)
  c.train.update(num_steps=1000, batch_size=32, learning_rate=3e-3, warmup_steps=50,
                 log_every=50, checkpoint_every=250)
  return c
