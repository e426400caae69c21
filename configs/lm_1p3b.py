"""The triadic paper's 1.3B models: 24 layers, d_model 2048, 16 heads of 128, SwiGLU 5504, 32000
tokens; Triadic GDN with E = 8 by default, or Gated DeltaNet, or their Transformer baseline (GQA
with two key/value heads, QK-norm, SwiGLU 6784). The config argument is ``DATA[,MODEL]``; recipes
and models in ``lm.paper_configs``.

  python train.py --config configs/lm_1p3b.py --workdir runs/lm_1p3b --config.data.path=data/fineweb
  python train.py --config configs/lm_1p3b.py:text_64k --workdir runs/lm_1p3b_64k \
      --config.data.path=data/fineweb --config.init_from=runs/lm_1p3b
  python train.py --config configs/lm_1p3b.py:mqar --workdir runs/lm_1p3b_bench   # synthetic data
  python eval.py --count_params --config configs/lm_1p3b.py:text,attention
"""

from lm.paper_configs import lm_config


def get_config(argument: str = "text"):
  return lm_config("1p3b", argument)
