"""The triadic paper's language models and recipes (the authors' trainer,
OliverSieberling/TriadicLinearAttention, ``config/``), shared by ``configs/lm_400m.py`` and
``lm_1p3b.py``.

24 layers, heads of 128, SwiGLU, an untied head, Llama-2's 32000-token vocabulary, bf16 compute.
The config argument is ``DATA[,MODEL]`` (``configs/lm_400m.py:text_64k,attention``).

MODEL (``MODELS``):

- "triadic_gdn" (the default): Triadic GDN, E = 8 (``--config.model.expand_e`` for E = 2, 4).
- "gdn": Gated DeltaNet (E = 1).
- "attention": their Transformer baseline: GQA with 8 query heads per key/value head, QK-norm,
  RoPE restarting at every document, and a wider SwiGLU that brings it to the recurrent models'
  parameter count.

DATA (``DATA``):

- "text": pretraining on a tokenized corpus (``--config.data.path``, from ``python -m
  lm.text_prep`` or a Megatron .bin/.idx prefix) at 4096 tokens: 400M 128 rows per step (524,288
  tokens) for 38,100 steps (20B tokens), 1.3B 256 rows (1,048,576 tokens) for 62,000 steps (65B);
  lr 3e-4 after 1000 warmup steps, cosine to 3e-5.
- "text_64k": context extension from a pretrained checkpoint (``--config.init_from``): rows of
  65,536 tokens, the pretraining's tokens per step (400M 8 rows, 1.3B 16), 5 tokens per parameter
  (400M 3815 steps, 1.3B 6500), lr 1e-4 with 10% warmup, cosine to 1e-5; attention's RoPE base
  rises to 2M.
- "mqar": synthetic recall at 2048 tokens (no download; throughput runs).

Every recipe: AdamW (0.9, 0.95, eps 1e-10), weight decay 0.1 on matrices only, gradients clipped
at 1.0.
"""

from lm.config import base_config

DATA = ("text", "text_64k", "mqar")
MODELS = ("triadic_gdn", "gdn", "attention")

# d_model, heads, SwiGLU width (recurrent / attention), pretraining rows per step and steps,
# extension rows per step and steps
SIZES = {
    "400m": dict(d_model=1024, num_heads=8, mlp_dim=2816, attention_mlp_dim=3456, rows=128,
                 steps=38100, rows_64k=8, steps_64k=3815),
    "1p3b": dict(d_model=2048, num_heads=16, mlp_dim=5504, attention_mlp_dim=6784, rows=256,
                 steps=62000, rows_64k=16, steps_64k=6500),
}


def parse_argument(argument: str) -> tuple[str, str]:
  """(data, model) of a config argument ``DATA[,MODEL]``; ValueError naming the known values."""
  data, _, model = (argument or "text").partition(",")
  data, model = data.strip() or "text", model.strip() or "triadic_gdn"
  if data not in DATA:
    raise ValueError(f"config argument DATA[,MODEL]: DATA must be one of {DATA}, got {data!r}")
  if model not in MODELS:
    raise ValueError(f"config argument DATA[,MODEL]: MODEL must be one of {MODELS}, got {model!r}")
  return data, model


def lm_config(size: str, argument: str = "text"):
  """The config of model ``size`` (a key of ``SIZES``) for ``argument`` = ``DATA[,MODEL]``."""
  if size not in SIZES:
    raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
  s = SIZES[size]
  data, model = parse_argument(argument)
  c = base_config("mqar" if data == "mqar" else "text")
  c.data.vocab_size = 32000
  if data == "mqar":
    c.data.seq_len = 2048
    c.data.train_settings = ((2048, 64),)
    c.data.eval_settings = ((2048, 64), (2048, 128), (2048, 256))
  c.model.update(mixer=model, expand_e=8 if model == "triadic_gdn" else 1, num_layers=24,
                 d_model=s["d_model"], num_heads=s["num_heads"], head_dim=128,
                 mlp_dim=s["mlp_dim"], impl="auto", chunk_size=64, dtype="bfloat16",
                 remat="full", qk_norm=True, rope_per_document=True)
  if model == "attention":
    c.model.update(num_kv_heads=s["num_heads"] // 8, mlp_dim=s["attention_mlp_dim"])
  c.train.update(b1=0.9, b2=0.95, adam_eps=1e-10, weight_decay=0.1, grad_clip=1.0,
                 min_lr_ratio=0.1, log_every=10, checkpoint_every=1000)
  if data == "mqar":
    c.train.update(num_steps=50000, batch_size=256, learning_rate=3e-4, warmup_steps=2000)
  elif data == "text":
    c.data.update(seq_len=4096, eval_seq_len=4096, eval_num_buckets=8)
    c.train.update(num_steps=s["steps"], batch_size=s["rows"], learning_rate=3e-4,
                   warmup_steps=1000)
  else:
    c.data.update(seq_len=65536, eval_seq_len=65536, eval_num_buckets=16, num_eval_examples=16)
    c.train.update(num_steps=s["steps_64k"], batch_size=s["rows_64k"], learning_rate=1e-4,
                   warmup_steps=s["steps_64k"] // 10, checkpoint_every=250)
    c.model.rope_base = 2e6
  c.eval.batch_size = 8 if data != "text_64k" else 1
  c.mesh.update(data=-1, fsdp=1, tensor=1)
  return c
