"""The shared skeleton of every config file in ``configs/`` and the start-up checks on it.

A config file calls ``base_config(data_name)``, then sets its sizes. ``validate`` runs before any
work: every bad value fails at start-up with a ValueError naming the key.
"""

from __future__ import annotations

import json

import ml_collections

from lm import data
from lm.model import ModelConfig

# Logical axis -> mesh axes. Params are fully sharded over "fsdp" along d_model and split over
# "tensor" along heads / MLP / vocab; activations are split over the batch axes.
LOGICAL_AXIS_RULES = [
    ("batch", ["data", "fsdp"]),
    ("embed", "fsdp"),
    ("embed_act", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("expand", None),
    ("moment", None),
    ("conv", None),
    ("gate_rank", None),
    ("layers", None),
]


def base_config(data_name: str) -> ml_collections.ConfigDict:
  """Every key the scripts read, with defaults for a tiny model on task ``data_name``."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.init_from = ""  # a checkpoint (workdir or step dir) to start a new model from

  c.data = data.default_config(data_name)

  c.model = ml_collections.ConfigDict(dict(
      mixer="triadic_gdn",  # attention | gdn | triadic_gdn | triadic_sgla | mamba2 | multistate_*
      layer_pattern="",  # e.g. "triadic_gdn,triadic_gdn,triadic_gdn,attention" (repeated)
      num_layers=2, d_model=64, num_heads=4, head_dim=16, num_kv_heads=0, mlp_dim=128,
      # attention: QK-norm (RMSNorm of queries and keys over head_dim), RoPE's base, RoPE
      # positions counted from each packed document's start (relative attention: rounding only)
      qk_norm=False, rope_base=10000.0, rope_per_document=True,
      expand_e=1,  # E of triadic_gdn / triadic_sgla
      # GDN / triadic state value width V (0: head_dim) and value heads (0: num_heads; a multiple:
      # grouped values, each key head's q, k shared by num_v_heads / num_heads value heads)
      value_dim=0, num_v_heads=0,
      aggregator="merlin", segment_len=64, max_segments=16, d_r=16,  # multi-state mixers
      state_dim=64,  # Mamba-2's N
      gate_rank=128,  # GDN-style mixers' output gate x -> gate_rank -> H x V (0: full rank)
      a_min=1e-6,  # GDN-style mixers' decay at init: A ~ U(a_min, 16) (1.0: Mamba-2's U(1, 16))
      conv_width=4, impl="auto", chunk_size=64, attention_impl="",
      conv_impl="auto",  # short convolutions: "xla", "pallas" or "auto" (the kernels on a GPU)
      dtype="float32",  # compute dtype; params stay float32
      remat="none",  # none | full | save_mixer_op | dots | dots_no_batch | save_mixer_op_and_dots
      scan_unroll=1,  # layer groups per iteration of the loop over depth (>= the groups: unrolled)
      tie_embeddings=False,  # the output head is the input embedding's transpose
      loss_chunk=1024,  # training loss: logits of this many tokens per row at a time (0: all)
  ))

  c.train = ml_collections.ConfigDict(dict(
      num_steps=1000, batch_size=32,
      learning_rate=3e-3, warmup_steps=100, min_lr_ratio=0.1,  # warmup + cosine to 10%
      b1=0.9, b2=0.95, adam_eps=1e-8, weight_decay=0.1, grad_clip=1.0,
      log_every=50, checkpoint_every=500, keep_checkpoints=3,
      peak_tflops=0.0,  # per device, for MFU; 0: lm.costs.PEAK_TFLOPS by device kind (none on CPU)
  ))
  c.eval = ml_collections.ConfigDict(dict(
      batch_size=64, step=-1,  # -1: the latest checkpoint
      mode="teacher_forced",  # or "generate": needles scored by greedy decoding (eval.py --generate)
  ))

  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  c.logical_axis_rules = [list(r) for r in LOGICAL_AXIS_RULES]
  return c


def validate(config, process_count: int = 1) -> ModelConfig:
  """Check ``config``; return the ModelConfig. Raises ValueError naming the first bad key.
  A text config's ``data.vocab_size`` of 0 is set from its dataset here."""
  data.resolve_vocab_size(config.data)
  cfg = ModelConfig.from_config(config)
  t = config.train
  for key in ("num_steps", "batch_size", "log_every", "checkpoint_every", "keep_checkpoints"):
    if not isinstance(t[key], int) or t[key] < 1:
      raise ValueError(f"train.{key} must be a positive int, got {t[key]!r}")
  if t.warmup_steps < 0 or t.learning_rate <= 0 or not 0 <= t.min_lr_ratio <= 1:
    raise ValueError(f"train.learning_rate must be > 0, train.warmup_steps >= 0 and "
                     f"train.min_lr_ratio in [0, 1]; got {t.learning_rate}, {t.warmup_steps}, "
                     f"{t.min_lr_ratio}")
  if t.warmup_steps >= t.num_steps:
    raise ValueError(f"train.warmup_steps ({t.warmup_steps}) must be less than train.num_steps "
                     f"({t.num_steps})")
  if t.batch_size % process_count:
    raise ValueError(f"train.batch_size ({t.batch_size}) must be a multiple of the number of "
                     f"processes ({process_count})")
  if cfg.max_len is not None and config.data.seq_len > cfg.max_len:
    raise ValueError(f"data.seq_len ({config.data.seq_len}) exceeds model.max_segments * "
                     f"model.segment_len = {cfg.max_segments} * {cfg.segment_len} = {cfg.max_len}")
  if cfg.max_len is not None:
    for where, length in eval_lengths(config.data):
      if length > cfg.max_len:
        raise ValueError(f"{where} = {length} exceeds what the model holds: model.max_segments * "
                         f"model.segment_len = {cfg.max_segments} * {cfg.segment_len} = "
                         f"{cfg.max_len}; raise model.max_segments or shorten {where}")
  if not isinstance(config.seed, int) or config.seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {config.seed!r}")
  return cfg


def eval_lengths(d) -> list[tuple[str, int]]:
  """(config key, sequence length) of every evaluation setting of data section ``d``."""
  if d.name == "mqar":
    return [(f"data.eval_settings[{i}] seq_len", int(s)) for i, (s, _) in enumerate(d.eval_settings)]
  if d.name == "niah":
    return [(f"data.eval_lengths[{i}]", int(n)) for i, n in enumerate(d.eval_lengths)]
  if d.name == "text":
    return [("data.eval_seq_len", int(d.get("eval_seq_len", 0) or d.seq_len))]
  return []


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def config_changes(saved: dict, config) -> list[str]:
  """``"key: saved -> now"`` for every key that differs between a saved config.json and ``config``."""
  old, new = _flat(saved), _flat(json.loads(config.to_json_best_effort()))
  return [f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}"
          for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
