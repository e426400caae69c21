"""The triadic paper's 400M model: 24 layers, d_model 1024, 8 heads of 128, SwiGLU 2816, 32k
vocabulary, Triadic GDN with E = 8 (bf16 compute, fp32 params). Recipes in ``lm.paper_configs``.

Pretraining at 4k on a tokenized corpus (e.g. Fineweb-Edu's parquet files with Llama-2's
tokenizer.json), then the 64k context extension from its last checkpoint:

  python -m lm.text_prep --input='fineweb-edu/*.parquet' --out=data/fineweb --tokenizer=tokenizer.json
  python train.py --config configs/lm_400m.py --workdir runs/lm_400m --config.data.path=data/fineweb
  python train.py --config configs/lm_400m.py:text_64k --workdir runs/lm_400m_64k \
      --config.data.path=data/fineweb --config.init_from=runs/lm_400m
  python eval.py --workdir runs/lm_400m_64k

  python train.py --config configs/lm_400m.py:mqar --workdir runs/lm_400m_bench   # synthetic data
  python eval.py --count_params --config configs/lm_400m.py
"""

from lm.paper_configs import lm_config


def get_config(data: str = "text"):
  return lm_config(d_model=1024, num_heads=8, mlp_dim=2816, data=data or "text")
