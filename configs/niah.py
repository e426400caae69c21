"""Needle retrieval for the multi-state models (docs/results.md, experiment 2): a 2-layer
multi-state Gated DeltaNet (4 heads of 16) with segments of 64 tokens (16 of them), trained on
contexts of 96 to 1024 tokens that hold 8 needles each, evaluated at 256/512/1024 by needle depth.

  python train.py --config configs/niah.py --workdir runs/niah
  python eval.py --workdir runs/niah [--generate]
  python -m experiments.niah_aggregators --workdir runs/papers   # the whole comparison

Other aggregators: ``--config.model.aggregator=vanilla|position|meanpool``; the single-state
baseline: ``--config.model.mixer=gdn``. ``configs/niah.py:cpu`` is a CPU-sized version (segments
of 32, contexts up to 256, 4 needles) that learns in a few minutes.

The MERLIN paper's setting (16k tokens, segments of 256, at most 64) scaled to what trains in a
few GPU minutes: 1024 tokens, segments of 64, at most 16. With 8 needles (2-token keys ->
2-token values) the 16 x 16 state of a head is busy but not over-full; the filler is random
tokens from their own range (``lm.data.niah_example``). Tied embeddings, as in
configs/mqar_capacity.py.

Training signal: each training example ends with queries for 4 of its 8 needles
(``data.train_num_queries``; evaluation asks one, the needle at the cell's depth), and training
lengths are log-uniform over [96, 1024] (``data.train_lengths``; a third of the examples are
shorter than 200 tokens). One query per example scores 2 tokens of a 1024-token example, too
little signal at this size; asking all 8 lets a model answer the last query by elimination
instead of by its key. Runs and results: docs/results.md, section 2.
"""

from lm.config import base_config


def get_config(size: str = ""):
  if size not in ("", "cpu"):
    raise ValueError(f"configs/niah.py takes '' or 'cpu' after the colon, got {size!r}")
  c = base_config("niah")
  # Full-rank output gate (gate_rank=0): at d_model 64 the authors' rank-128 gate would be the
  # larger matrix, not a low-rank one. Decay at init A ~ U(1, 16) (a_min=1): with the authors'
  # U(0, 16) this task trains far slower at this size (docs/results.md).
  c.model.update(mixer="multistate_gdn", aggregator="merlin", segment_len=64, max_segments=16,
                 d_r=16, num_layers=2, d_model=64, num_heads=4, head_dim=16, mlp_dim=128,
                 tie_embeddings=True, gate_rank=0, a_min=1.0)
  c.data.update(seq_len=1024, train_min_len=96, train_lengths="log_uniform", num_needles=8,
                train_num_queries=4, eval_lengths=(256, 512, 1024), num_eval_examples=64)
  c.train.update(num_steps=1500, batch_size=32, learning_rate=3e-3, warmup_steps=100,
                 log_every=100, checkpoint_every=500)
  c.eval.batch_size = 64
  if size == "cpu":
    c.model.update(segment_len=32, max_segments=8)
    c.data.update(seq_len=128, train_min_len=32, train_lengths="uniform", num_needles=4,
                  train_num_queries=1, eval_lengths=(64, 128, 256), num_eval_examples=32)
    c.train.update(num_steps=1000, batch_size=32, log_every=50, checkpoint_every=250)
  return c
