"""The triadic paper's 1.3B model: 24 layers, d_model 2048, 16 heads of 128, SwiGLU 5504, 32k
vocabulary, Triadic GDN with E = 8 (bf16 compute, fp32 params).

  python train.py --config configs/lm_1p3b.py --workdir runs/lm_1p3b --config.data.text_glob='corpus/*.txt'
  python eval.py --count_params --config configs/lm_1p3b.py
"""

from lm.paper_configs import lm_config


def get_config(data: str = "text"):
  return lm_config(d_model=2048, num_heads=16, mlp_dim=5504, data=data or "text")
