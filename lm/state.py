"""The train state, the optimizer, and how both are laid out on the mesh.

``create`` builds everything the step needs without allocating anything: the abstract state
(``jax.eval_shape`` of the init), its shardings (from the params' logical axis names and the
config's rules), and a jitted init that materialises the state directly in those shardings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lm import sharding
from lm.model import LM, ModelConfig


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def schedule(t) -> optax.Schedule:
  """Linear warmup to ``train.learning_rate``, cosine decay to ``min_lr_ratio`` of it."""
  return optax.warmup_cosine_decay_schedule(
      0.0, t.learning_rate, t.warmup_steps, t.num_steps,
      end_value=t.learning_rate * t.min_lr_ratio)


def _decay_mask(params):
  """Weight decay on matrices (kernels, embeddings) only, not on norms, biases or gate constants."""
  def leaf(path, _):
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return keys[-1] in ("kernel", "embedding")
  return jax.tree_util.tree_map_with_path(leaf, params)


def optimizer(t) -> optax.GradientTransformation:
  """AdamW (betas 0.9 / 0.95, weight decay 0.1) after global-norm clipping (1.0)."""
  return optax.chain(
      optax.clip_by_global_norm(t.grad_clip),
      optax.adamw(schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=_decay_mask))


@dataclasses.dataclass
class Setup:
  model: LM
  tx: optax.GradientTransformation
  abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings
  shardings: TrainState  # NamedShardings
  init: Callable[[jax.Array], TrainState]  # rng -> sharded state


def create(cfg: ModelConfig, train_config, mesh, rules, seq_len: int) -> Setup:
  model = LM(cfg)
  tx = optimizer(train_config)

  def boxed_init(rng):
    params = model.init(rng, jnp.zeros((1, seq_len), jnp.int32))["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  with nn.logical_axis_rules(rules):
    abstract_boxed = jax.eval_shape(boxed_init, jax.random.key(0))
  shardings = sharding.tree_shardings(abstract_boxed, mesh, rules)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          nn.unbox(abstract_boxed), shardings)
  init = jax.jit(lambda rng: nn.unbox(boxed_init(rng)), out_shardings=shardings)
  return Setup(model, tx, abstract, shardings, init)


def loss_fn(model: LM, params, batch):
  """Weighted next-token cross-entropy and accuracy over positions with weight > 0."""
  logits = model.apply({"params": params}, batch["inputs"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  w = batch["weights"]
  denom = jnp.maximum(jnp.sum(w), 1e-9)
  correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
  return jnp.sum(ce * w) / denom, {"accuracy": jnp.sum(correct * w) / denom}


def make_train_step(model: LM, tx, train_config):
  """The pure step: (state, batch) -> (new state, metrics)."""
  lr = schedule(train_config)

  def train_step(state: TrainState, batch):
    (loss, aux), grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch), has_aux=True)(
        state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "learning_rate": lr(state.step), **aux}
    return TrainState(state.step + 1, params, opt_state), metrics

  return train_step


def jit_train_step(setup: Setup, train_config, mesh, rules):
  """``make_train_step`` jitted once: explicit in/out shardings, the state donated."""
  step = make_train_step(setup.model, setup.tx, train_config)

  def traced(state, batch):
    with nn.logical_axis_rules(rules):
      return step(state, batch)

  return jax.jit(traced, in_shardings=(setup.shardings, sharding.batch_sharding(mesh)),
                 out_shardings=(setup.shardings, sharding.replicated(mesh)), donate_argnums=0)
