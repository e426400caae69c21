"""Triadic capacity on MQAR (docs/results.md, experiment 1): the triadic paper's smallest model,
2 layers x 4 heads of dimension 16 (d_model 64), with E chosen on the command line.

  python train.py --config configs/mqar_capacity.py --workdir runs/cap_e4 --config.model.expand_e=4
  python -m experiments.mqar_capacity --workdir runs/capacity   # the whole sweep (E = 1..16)

Zoology-style data (keys and values drawn from disjoint halves of the vocabulary, queries at
power-law gaps, random filler), but sized so that E = 16's expected ~16x capacity (a head's
joint key has 16 E dimensions) is inside the sweep: 8 to 256 pairs at 4 tokens per pair (Zoology's
densest setting) in a 1024-token vocabulary (511 possible keys; with 2048 tokens a first run was
still at chance after 300 steps). Training mixes every setting uniformly, so a failure at many
pairs is a capacity limit rather than a length the model never saw. lr 1e-2 (at 3e-3 the small
CPU version stays at chance for longer). Tied embeddings: with a separate output head every model
stayed at chance (loss ln 512) for all 2000 steps of a first H200 run at this size, and on the CPU
(8 pairs, vocabulary 256, 1000 steps) the untied model stayed at chance while the tied one reached
0.81 (vocabulary 1024: 0.32 and rising at step 1000). ``impl="chunked"``: the Pallas kernels
unroll E, and at E = 16 their Triton compile took minutes per shape.
"""

from lm.config import base_config

SETTINGS = ((64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256))


def get_config():
  c = base_config("mqar")
  c.data.update(vocab_size=1024, train_settings=SETTINGS, train_mix=(), seq_len=1024,
                eval_settings=SETTINGS, num_eval_examples=256)
  c.model.update(mixer="triadic_gdn", expand_e=1, num_layers=2, d_model=64, num_heads=4,
                 head_dim=16, mlp_dim=128, chunk_size=64, impl="chunked",
                 tie_embeddings=True)
  c.train.update(num_steps=2000, batch_size=32, learning_rate=1e-2, warmup_steps=100,
                 log_every=100, checkpoint_every=500)
  c.eval.batch_size = 64
  return c
