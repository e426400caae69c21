"""Needle retrieval scored by greedy generation (eval.mode="generate") == teacher-forced exact
match, cell by cell, for real models; the files it writes; tasks that cannot generate say so."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import data, eval_loop, evals, generate as generate_lib, train_loop
from lm.model import LM, ModelConfig
from tests.train_util import tiny_config


def niah_config():
  c = data.default_config("niah")
  c.vocab_size = data.NIAH_SPECIAL + 3 * 2  # two value tokens: exact match by chance is 1/4
  c.num_needles = 2
  c.eval_lengths, c.eval_depths = (20, 32), (0.0, 0.5, 1.0)
  c.num_eval_examples = 8
  return c


def value_biased_model(cfg: ModelConfig, seed: int):
  """A random LM whose head can only pick one of the two value tokens (which one depends on the
  sign of the final hidden state along a random direction): accuracy far from 0 and from 1."""
  model = LM(cfg)
  variables = nn.unbox(jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32)))
  _, _, values = data.niah_layout(cfg.vocab_size)
  w = 10.0 * jax.random.normal(jax.random.key(seed + 1), (cfg.d_model,))
  kernel = jnp.zeros((cfg.d_model, cfg.vocab_size)).at[:, values.start].set(w)
  kernel = kernel.at[:, values.start + 1].set(-w)
  variables["params"]["head"]["kernel"] = kernel
  return model, variables


MODELS = {
    "triadic_gdn_e2": dict(mixer="triadic_gdn", expand_e=2),
    # the authors' Transformer baseline's attention: GQA, QK-norm
    "attention_qk_norm": dict(mixer="attention", num_kv_heads=1, qk_norm=True),
    # segments of 8, 4 of them: max_len 32 = the longest needle context (generation's bound)
    "multistate_gdn_merlin": dict(mixer="multistate_gdn", aggregator="merlin", segment_len=8,
                                  max_segments=4, d_r=4),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generation_scores_equal_teacher_forced_scores_per_cell(name, tmp_path):
  c = niah_config()
  cfg = ModelConfig(vocab_size=c.vocab_size, num_layers=2, d_model=16, num_heads=2, head_dim=8,
                    mlp_dim=32, impl="chunked", chunk_size=8, **MODELS[name])
  model, variables = value_biased_model(cfg, seed=0)
  apply = jax.jit(model.apply)
  logits_fn = lambda x: np.asarray(apply(variables, x))

  def generate_fn(prompts, num_tokens):
    return np.asarray(generate_lib.generate(variables, cfg, prompts, num_tokens,
                                            temperature=0.0))[:, prompts.shape[1]:]

  kw = dict(step=3, batch_size=5)  # 8 examples per cell: one full batch and one padded
  forced = evals.evaluate(c, logits_fn, str(tmp_path), **kw)
  generated = evals.evaluate(c, None, str(tmp_path), mode="generate", generate_fn=generate_fn, **kw)
  assert forced["mode"] == "teacher_forced" and generated["mode"] == "generate"
  assert generated["accuracy_grid"] == forced["accuracy_grid"]
  assert 0.0 < generated["accuracy"] < 1.0  # not trivially equal
  out = tmp_path / "eval"
  record = json.loads((out / "niah_generate_step3.json").read_text())
  assert record["mode"] == "generate" and record["accuracy_grid"] == forced["accuracy_grid"]
  assert json.loads((out / "niah_step3.json").read_text())["mode"] == "teacher_forced"
  assert sorted(p.name for p in out.glob("*generate*.png")) == [
      "niah_generate_depth_step3.png", "niah_generate_heatmap_step3.png"]
  assert sorted(generated["files"]) == sorted(str(out / f) for f in [
      "niah_generate_step3.json", "niah_generate_depth_step3.png",
      "niah_generate_heatmap_step3.png"])


def test_eval_loop_generates_under_the_restored_params(tmp_path):
  """Train a tiny needle model, then eval.py's path in both modes: the same grid."""
  c = tiny_config("gdn")
  c.data = niah_config()
  c.data.update(seq_len=24, train_min_len=20, worker_threads=1, eval_lengths=(24,),
                eval_depths=(0.0, 1.0), num_eval_examples=4)
  c.train.update(num_steps=2, checkpoint_every=2)
  c.eval.batch_size = 4
  train_loop.train(c, str(tmp_path))
  forced = eval_loop.evaluate(c, str(tmp_path))
  c.eval.mode = "generate"
  generated = eval_loop.evaluate(c, str(tmp_path))
  assert generated["mode"] == "generate" and generated["step"] == 2
  assert generated["accuracy_grid"] == forced["accuracy_grid"]
  assert os.path.exists(tmp_path / "eval" / "niah_generate_step2.json")


def test_tasks_without_an_answer_span_refuse_generation(tmp_path):
  mqar = data.default_config("mqar")
  with pytest.raises(ValueError, match=r"eval.mode='generate' .*data.name='mqar'.*interleaved"):
    evals.evaluate(mqar, None, "", step=0, batch_size=4, write=False, mode="generate",
                   generate_fn=lambda p, n: np.zeros((len(p), n), np.int32))
  with pytest.raises(ValueError, match="eval.mode must be one of"):
    evals.evaluate(mqar, lambda x: x, "", step=0, batch_size=4, write=False, mode="sample")
  # eval.py's path refuses before looking for a checkpoint
  c = tiny_config()
  c.eval.mode = "generate"
  with pytest.raises(ValueError, match="eval.mode='generate'"):
    eval_loop.evaluate(c, str(tmp_path / "no_such_run"))
  with pytest.raises(ValueError, match="needs a generate_fn"):
    evals.evaluate(niah_config(), None, "", step=0, batch_size=4, write=False, mode="generate")
