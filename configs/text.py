"""A small Triadic GDN (E = 4) language model on a tokenized text corpus, trainable on a CPU.

Prepare a corpus (here the Python standard library's top-level modules, present wherever Python
is; a byte-level BPE of 4096 tokens is trained on them), train, evaluate:

  python -m lm.text_prep --input="$(python -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/*.py" --out=data/pystdlib --vocab_size=4096 --eval_fraction=0.05
  python train.py --config configs/text.py --workdir runs/text --config.data.path=data/pystdlib
  python eval.py --workdir runs/text

Documents are packed into rows of data.seq_len tokens; each is its own sequence (states reset,
attention and convolutions masked, no loss on a document's first token). The evaluation reports
loss, perplexity and bits per byte overall and by position in the document (eval/*.json, *.png).
"""

from lm.config import base_config


def get_config():
  c = base_config("text")
  # Full-rank output gate (gate_rank=0): at d_model 128 a rank-128 gate is no factorisation.
  c.model.update(mixer="triadic_gdn", expand_e=4, num_layers=4, d_model=128, num_heads=4,
                 head_dim=32, mlp_dim=352, gate_rank=0)
  c.train.update(num_steps=400, batch_size=16, learning_rate=2e-3, warmup_steps=40,
                 log_every=20, checkpoint_every=200)
  return c
