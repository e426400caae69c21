"""Training end to end on a tiny config: train, checkpoint, resume exactly, preempt, evaluate,
init_from, mismatching checkpoints and the NaN guard."""

import json
import os
import signal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import eval_loop, state as state_lib, train_loop, train_step
from lm.config import base_config
from lm.model import LM, ModelConfig
from tests.train_util import tiny_config


def losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def test_train_checkpoint_evaluate(tmp_path, monkeypatch):
  """The README's flow, with a relative --workdir as a user would type it."""
  c = tiny_config()
  monkeypatch.chdir(tmp_path.parent)
  last = train_loop.train(c, tmp_path.name)
  assert last["step"] == 6 and np.isfinite(last["loss"])
  assert sorted(losses(tmp_path)) == [1, 2, 3, 4, 5, 6]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]
  assert (tmp_path / "tensorboard").is_dir()
  result = eval_loop.evaluate(eval_loop.load_config(tmp_path.name), tmp_path.name)
  assert result["step"] == 6
  assert any(f.endswith(".png") for f in os.listdir(tmp_path / "eval"))


def test_preempted_run_resumes_on_the_same_curve(tmp_path):
  """SIGTERM after step 2 saves step 3 and stops; the restart continues to the identical curve."""
  c = tiny_config()
  c.train.checkpoint_every = 100  # only the preemption and the end save
  straight = train_loop.train(c, str(tmp_path / "a"))

  def sigterm_at_2(step):
    if step == 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return False

  stopped = train_loop.train(c, str(tmp_path / "b"), stop_at=sigterm_at_2)
  assert stopped["step"] == 3
  assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["3"]
  resumed = train_loop.train(c, str(tmp_path / "b"))
  assert resumed["step"] == straight["step"] == 6
  assert losses(tmp_path / "b") == losses(tmp_path / "a")


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
  train_loop.train(tiny_config(), str(tmp_path))
  other = tiny_config(mixer="triadic_gdn", expand_e=4)
  with pytest.raises(ValueError, match=r"does not match the model(.|\n)*k2_proj/kernel: missing"):
    train_loop.train(other, str(tmp_path))


def test_init_from_e1_to_e8(tmp_path):
  src = tiny_config(mixer="triadic_gdn", expand_e=1)
  src.train.num_steps = 3
  train_loop.train(src, str(tmp_path / "e1"))
  dst = tiny_config(mixer="triadic_gdn", expand_e=8)
  dst.train.num_steps = 2
  dst.init_from = str(tmp_path / "e1")
  import jax
  from lm import checkpoint, init_from, sharding
  from lm.config import validate
  mesh = sharding.make_mesh(dst.mesh)
  setup = state_lib.create(validate(dst), dst.train, mesh, sharding.rules(dst), 32)
  fresh = setup.init(jax.random.key(0)).params
  params, plan = init_from.load(dst.init_from, fresh, setup.shardings.params)
  source = checkpoint.load_params(checkpoint.step_dir(str(tmp_path / "e1")),
                                  state_lib.create(validate(src), src.train, mesh,
                                                   sharding.rules(src), 32).abstract_state.params)
  mixer, src_mixer = params["layers"]["block0"]["mixer"], source["layers"]["block0"]["mixer"]
  for name in ("q_proj", "gate_down", "gate_up"):  # the low-rank output gate carries over by name
    np.testing.assert_array_equal(mixer[name]["kernel"], src_mixer[name]["kernel"])
  a_log = np.asarray(mixer["decay"]["A_log"])
  assert a_log.shape == (2, 4, 8)
  np.testing.assert_array_equal(a_log, np.broadcast_to(src_mixer["decay"]["A_log"], (2, 4, 8)))
  assert "layers/block0/mixer/k2_proj/kernel" in plan["new"]
  assert "layers/block0/mixer/decay/a_proj/kernel" in plan["broadcast"]
  # And through the training loop: it starts from the source and trains.
  assert np.isfinite(train_loop.train(dst, str(tmp_path / "e8"))["loss"])


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
  c = tiny_config()
  c.train.num_steps, c.train.checkpoint_every = 6, 2
  stop_after_2 = lambda step: step == 2
  train_loop.train(c, str(tmp_path), stop_at=stop_after_2)
  real = train_step.loss_fn
  monkeypatch.setattr(train_step, "loss_fn",
                      lambda *a: (lambda l, aux: (l * np.nan, aux))(*real(*a)))
  with pytest.raises(FloatingPointError, match="at step 3: stopping. The last good checkpoint is step 2"):
    train_loop.train(c, str(tmp_path))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_equals_the_plain_loss_and_holds_one_chunk_of_logits(tied):
  """loss_chunk = 8 over 37 tokens (4 chunks and a padded one) == the loss over all logits at once:
  loss, accuracy and every gradient (packed documents included); and the backward pass never holds
  the (B, T, vocab) logits."""
  import dataclasses

  import flax.linen as nn
  import jax
  import jax.extend.core
  import jax.numpy as jnp

  from lm.model import LM, ModelConfig, head_logits
  from testkit import rel_rms

  cfg = ModelConfig(vocab_size=96, num_layers=1, d_model=16, num_heads=2, head_dim=8, mlp_dim=32,
                    mixer="gdn", impl="chunked", chunk_size=8, tie_embeddings=tied, loss_chunk=8)
  b, t = 2, 37
  keys = jax.random.split(jax.random.key(0), 4)
  tokens = jax.random.randint(keys[0], (b, t), 0, cfg.vocab_size)
  batch = {"inputs": tokens, "targets": jax.random.randint(keys[1], (b, t), 0, cfg.vocab_size),
           "weights": (jax.random.uniform(keys[2], (b, t)) < 0.7).astype(jnp.float32),
           "segment_ids": (jnp.arange(t)[None] >= jnp.array([[20], [9]])).astype(jnp.int32)}
  params = nn.unbox(jax.jit(LM(cfg).init)(keys[3], tokens)["params"])
  # the head of the chunked loss is the model's own
  hidden = jax.jit(lambda p: LM(cfg).apply({"params": p}, tokens, head=False))(params)
  weight = params["embed"]["embedding"] if tied else params["head"]["kernel"]
  np.testing.assert_array_equal(jax.jit(lambda w, h: head_logits(cfg, w, h))(weight, hidden),
                                jax.jit(LM(cfg).apply)({"params": params}, tokens))

  def value_and_grad(c):
    fn = lambda p: train_step.loss_fn(LM(c), p, batch)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(params), fn

  plain = dataclasses.replace(cfg, loss_chunk=0)
  ((loss, aux), grads), chunked_fn = value_and_grad(cfg)
  ((want, want_aux), want_grads), plain_fn = value_and_grad(plain)
  assert abs(float(loss) / float(want) - 1) < 1e-6
  assert float(aux["accuracy"]) == float(want_aux["accuracy"])
  for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    assert rel_rms(g, h) < 1e-5

  def logit_sizes(jaxpr):  # sizes of every array with a vocabulary axis, nested jaxprs included
    for eqn in jaxpr.eqns:
      yield from (v.aval.size for v in eqn.outvars
                  if cfg.vocab_size in getattr(v.aval, "shape", ()))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from logit_sizes(sub)

  for fn, most in ((chunked_fn, b * 8 * cfg.vocab_size), (plain_fn, None)):
    biggest = max(logit_sizes(jax.make_jaxpr(jax.grad(lambda p: fn(p)[0]))(params).jaxpr))
    if most:  # one chunk of logits (and the head's weight and gradient, d_model x vocab)
      assert biggest <= max(most, cfg.d_model * cfg.vocab_size), biggest
    else:  # the plain loss: all of them
      assert biggest == b * t * cfg.vocab_size


@pytest.mark.parametrize("mixer", ["attention", "triadic_gdn", "mamba2", "multistate_gdn"])
def test_weight_decay_shrinks_matrices_and_leaves_vectors(mixer):
  """One AdamW step on zero gradients: every kernel and embedding shrinks by lr * weight_decay;
  norm scales, biases, A_log, dt_bias and the other per-head constants do not move."""
  cfg = ModelConfig(vocab_size=32, num_layers=2, d_model=16, num_heads=2, head_dim=8, mlp_dim=32,
                    mixer=mixer, expand_e=2, segment_len=8, max_segments=2, d_r=4, state_dim=4,
                    qk_norm=True)
  init = jax.jit(LM(cfg).init)
  params = nn.unbox(init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  t = base_config("mqar").train
  t.update(warmup_steps=0, num_steps=10, learning_rate=0.5, weight_decay=0.1)
  tx = state_lib.optimizer(t)

  @jax.jit
  def zero_gradient_update(params):
    return tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)[0]

  updates = zero_gradient_update(params)
  vectors = set()
  for (path, p), u in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(updates)):
    name = path[-1].key
    if name in ("kernel", "embedding"):
      np.testing.assert_allclose(u, -0.5 * 0.1 * p, rtol=1e-6, atol=1e-8)
    else:
      assert not np.any(u), jax.tree_util.keystr(path)
      vectors.add(name)
  assert vectors >= {"scale"}  # every mixer has norms
  assert mixer == "attention" or {"A_log", "dt_bias"} <= vectors
