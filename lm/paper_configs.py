"""The triadic paper's language-model sizes, shared by ``configs/lm_400m.py`` and ``lm_1p3b.py``.

24 layers, heads of 128, SwiGLU, a 32k vocabulary, bf16 compute. ``data`` picks the task:
"text" (byte-level files, the embedding still has 32k rows) or "mqar" (synthetic recall at
2048 tokens: needs no download, used for throughput runs).
"""

from lm.config import base_config


def lm_config(d_model: int, num_heads: int, mlp_dim: int, data: str = "text"):
  c = base_config(data)
  c.data.vocab_size = 32768
  c.data.seq_len = 2048
  if data == "mqar":
    c.data.train_settings = ((2048, 64),)
    c.data.eval_settings = ((2048, 64), (2048, 128), (2048, 256))
  elif data == "text":
    c.data.eval_seq_len = 2048
  c.model.update(mixer="triadic_gdn", expand_e=8, num_layers=24, d_model=d_model,
                 num_heads=num_heads, head_dim=128, mlp_dim=mlp_dim, impl="auto", chunk_size=64,
                 dtype="bfloat16", remat="full")
  c.train.update(num_steps=50000, batch_size=256, learning_rate=3e-4, warmup_steps=2000,
                 log_every=10, checkpoint_every=1000)
  c.eval.batch_size = 8
  c.mesh.update(data=-1, fsdp=1, tensor=1)
  return c
