"""The triadic paper's 1.3B model: 24 layers, d_model 2048, 16 heads of 128, SwiGLU 5504, 32k
vocabulary, Triadic GDN with E = 8 (bf16 compute, fp32 params). Recipes in ``lm.paper_configs``
(the 400M schedule; the paper trains this size on 65B tokens: raise train.num_steps to 124,000).

  python train.py --config configs/lm_1p3b.py --workdir runs/lm_1p3b --config.data.path=data/fineweb
  python train.py --config configs/lm_1p3b.py:text_64k --workdir runs/lm_1p3b_64k \
      --config.data.path=data/fineweb --config.init_from=runs/lm_1p3b
  python train.py --config configs/lm_1p3b.py:mqar --workdir runs/lm_1p3b_bench   # synthetic data
  python eval.py --count_params --config configs/lm_1p3b.py
"""

from lm.paper_configs import lm_config


def get_config(data: str = "text"):
  return lm_config(d_model=2048, num_heads=16, mlp_dim=5504, data=data or "text")
