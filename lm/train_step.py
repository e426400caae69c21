"""The training step: the loss, the pure step (state, batch) -> (new state, metrics), and the step
jitted with explicit shardings over the mesh."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lm import sharding
from lm.model import LM
from lm.state import Setup, TrainState, schedule


def loss_fn(model: LM, params, batch):
  """Weighted next-token cross-entropy and accuracy over positions with weight > 0. A batch with
  ``segment_ids`` (packed documents) runs each document as its own sequence; its ``weights`` are
  already 0 where a target opens the next document (``lm.data``)."""
  logits = model.apply({"params": params}, batch["inputs"], segment_ids=batch.get("segment_ids"))
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
