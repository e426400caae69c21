"""The triadic paper's language-model sizes, shared by ``configs/lm_400m.py`` and ``lm_1p3b.py``.

24 layers, heads of 128, SwiGLU, bf16 compute. ``data`` picks the run:

- "text": pretraining on a tokenized corpus (``--config.data.path``, from ``python -m
  lm.text_prep`` or a Megatron .bin/.idx prefix) with the authors' 400M recipe: 4096-token
  context, 128 x 4096 = 524,288 tokens per step, 38,100 steps (20B tokens), lr 3e-4 after 1000
  warmup steps, cosine to 3e-5. The embedding has 32768 rows (Llama-2's 32000 tokens fit; a
  dataset with a larger vocabulary is an error at start-up).
- "text_64k": context extension from a pretrained checkpoint (``--config.init_from``): 65,536
  tokens per row, the same 524,288 tokens per step (8 rows), 2000 steps at lr 3e-5 (100 warmup,
  cosine to 3e-6). The papers give no schedule for this stage; these numbers are ours.
- "mqar": synthetic recall at 2048 tokens (no download; throughput runs).
"""

from lm.config import base_config

DATA = ("text", "text_64k", "mqar")


def lm_config(d_model: int, num_heads: int, mlp_dim: int, data: str = "text"):
  if data not in DATA:
    raise ValueError(f"config argument must be one of {DATA}, got {data!r}")
  c = base_config("mqar" if data == "mqar" else "text")
  c.data.vocab_size = 32768
  if data == "mqar":
    c.data.seq_len = 2048
    c.data.train_settings = ((2048, 64),)
    c.data.eval_settings = ((2048, 64), (2048, 128), (2048, 256))
  c.model.update(mixer="triadic_gdn", expand_e=8, num_layers=24, d_model=d_model,
                 num_heads=num_heads, head_dim=128, mlp_dim=mlp_dim, impl="auto", chunk_size=64,
                 dtype="bfloat16", remat="full")
  c.train.update(num_steps=50000, batch_size=256, learning_rate=3e-4, warmup_steps=2000,
                 log_every=10, checkpoint_every=1000)
  if data == "text":
    c.data.update(seq_len=4096, eval_seq_len=4096, eval_num_buckets=8)
    c.train.update(num_steps=38100, batch_size=128, learning_rate=3e-4, warmup_steps=1000,
                   min_lr_ratio=0.1)
  elif data == "text_64k":
    c.data.update(seq_len=65536, eval_seq_len=65536, eval_num_buckets=16, num_eval_examples=16)
    c.train.update(num_steps=2000, batch_size=8, learning_rate=3e-5, warmup_steps=100,
                   min_lr_ratio=0.1, checkpoint_every=250)
  c.eval.batch_size = 8 if data != "text_64k" else 1
  c.mesh.update(data=-1, fsdp=1, tensor=1)
  return c
