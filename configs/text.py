"""A small Triadic GDN (E = 4) language model on a tokenized text corpus, trainable on a CPU; with
the argument ``gpu`` (``configs/text.py:gpu``) an 8-layer d_model-512 one (E = 8, 28M to 30M
non-embedding parameters) that trains at 4k tokens in a few minutes on one H200.

Prepare a corpus (here the Python standard library's top-level modules, present wherever Python
is; a byte-level BPE of 4096 tokens is trained on them), train, evaluate:

  python -m lm.text_prep --input="$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/*.py" --out=data/pystdlib --vocab_size=4096 --eval_fraction=0.05
  python train.py --config configs/text.py --workdir runs/text --config.data.path=data/pystdlib
  python eval.py --workdir runs/text

Documents are packed into rows of data.seq_len tokens; each is its own sequence (states reset,
attention and convolutions masked, no loss on a document's first token). The evaluation reports
loss, perplexity and bits per byte overall and by position in the document (eval/*.json, *.png).
The ``gpu`` size wants a larger corpus than the top-level modules (1.3M tokens, 9 held-out
documents): experiments/text_lm.py prepares the whole standard library (9.4M tokens).
"""

from lm.config import base_config


def get_config(size: str = ""):
  if size not in ("", "cpu", "gpu"):
    raise ValueError(f"configs/text.py takes '' (or cpu) or gpu, got {size!r}")
  c = base_config("text")
  if size == "gpu":
    # bfloat16 and full remat like lm.paper_configs: attention's 4k x 4k scores of 8 layers
    # would otherwise be held for the backward pass; eval batches of 2 rows keep the score
    # matrices of a 16k evaluation small.
    c.model.update(mixer="triadic_gdn", expand_e=8, num_layers=8, d_model=512, num_heads=8,
                   head_dim=64, mlp_dim=1408, qk_norm=True, dtype="bfloat16", remat="full")
    c.data.update(seq_len=4096, eval_num_buckets=8)
    c.train.update(num_steps=1500, batch_size=8, learning_rate=1e-3, warmup_steps=150,
                   log_every=50, checkpoint_every=500)
    c.eval.batch_size = 2
    return c
  # Full-rank output gate (gate_rank=0): at d_model 128 a rank-128 gate is no factorisation.
  c.model.update(mixer="triadic_gdn", expand_e=4, num_layers=4, d_model=128, num_heads=4,
                 head_dim=32, mlp_dim=352, gate_rank=0)
  c.train.update(num_steps=400, batch_size=16, learning_rate=2e-3, warmup_steps=40,
                 log_every=20, checkpoint_every=200)
  return c
