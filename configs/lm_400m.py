"""The triadic paper's 400M models: 24 layers, d_model 1024, 8 heads of 128, SwiGLU 2816, 32000
tokens; Triadic GDN with E = 8 by default, or Gated DeltaNet, or their Transformer baseline (GQA
with one key/value head, QK-norm, SwiGLU 3456). The config argument is ``DATA[,MODEL]``; recipes
and models in ``lm.paper_configs``.

Pretraining at 4k on a tokenized corpus (e.g. Fineweb-Edu's parquet files with Llama-2's
tokenizer.json), then the 64k context extension from its last checkpoint:

  python -m lm.text_prep --input='fineweb-edu/*.parquet' --out=data/fineweb --tokenizer=tokenizer.json
  python train.py --config configs/lm_400m.py --workdir runs/lm_400m --config.data.path=data/fineweb
  python train.py --config configs/lm_400m.py:text_64k --workdir runs/lm_400m_64k \
      --config.data.path=data/fineweb --config.init_from=runs/lm_400m
  python eval.py --workdir runs/lm_400m_64k

  python train.py --config configs/lm_400m.py:text,attention --workdir runs/lm_400m_attention \
      --config.data.path=data/fineweb
  python train.py --config configs/lm_400m.py:mqar --workdir runs/lm_400m_bench   # synthetic data
  python eval.py --count_params --config configs/lm_400m.py:text,gdn
"""

from lm.paper_configs import lm_config


def get_config(argument: str = "text"):
  return lm_config("400m", argument)
