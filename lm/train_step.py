"""The training step: the loss, the pure step (state, batch) -> (new state, metrics), and the step
jitted with explicit shardings over the mesh."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lm import sharding
from lm.model import LM, head_logits
from lm.state import Setup, TrainState, schedule


def loss_fn(model: LM, params, batch):
  """Weighted next-token cross-entropy and accuracy over positions with weight > 0. A batch with
  ``segment_ids`` (packed documents) runs each document as its own sequence; its ``weights`` are
  already 0 where a target opens the next document (``lm.data``).

  With ``model.loss_chunk`` = c > 0 and sequences longer than c, the (B, T, vocab) float32 logits
  are never materialised at once: ``chunked_cross_entropy`` computes them c tokens per row at a
  time and recomputes each chunk's in the backward pass. Same loss and gradients either way.
  """
  cfg = model.cfg
  w = batch["weights"]
  denom = jnp.maximum(jnp.sum(w), 1e-9)
  segment_ids = batch.get("segment_ids")
  if cfg.loss_chunk and batch["inputs"].shape[1] > cfg.loss_chunk:
    hidden = model.apply({"params": params}, batch["inputs"], segment_ids=segment_ids, head=False)
    weight = params["embed"]["embedding"] if cfg.tie_embeddings else params["head"]["kernel"]
    ce, correct = chunked_cross_entropy(lambda h: head_logits(cfg, weight, h), hidden,
                                        batch["targets"], w, cfg.loss_chunk)
    return ce / denom, {"accuracy": correct / denom}
  logits = model.apply({"params": params}, batch["inputs"], segment_ids=segment_ids)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
  return jnp.sum(ce * w) / denom, {"accuracy": jnp.sum(correct * w) / denom}


def chunked_cross_entropy(logits_fn, hidden, targets, weights, chunk: int):
  """(sum of weights * cross-entropy, sum of weights * [argmax == target]) over (B, T) tokens.

  ``logits_fn``: hidden (B, c, d) -> float32 logits (B, c, vocab). The sequence is cut into chunks
  of ``chunk`` tokens (the last one zero-padded, with weight 0), scanned one at a time under
  ``jax.checkpoint``: the backward pass recomputes a chunk's logits instead of keeping them, so
  the loss holds B x chunk x vocab float32 logits at a time, not B x T x vocab. The batch axis
  stays whole in every chunk (its data-parallel sharding is untouched).
  """
  b, t, d = hidden.shape
  n = -(-t // chunk)
  pad = n * chunk - t
  if pad:
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    weights = jnp.pad(weights, ((0, 0), (0, pad)))
  split = lambda z: jnp.moveaxis(z.reshape((b, n, chunk) + z.shape[2:]), 1, 0)  # (n, B, c, ...)

  @jax.checkpoint
  def one(h, y, w):
    logits = logits_fn(h)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
    return jnp.sum(ce * w), jnp.sum(jax.lax.stop_gradient(correct) * w)

  def body(carry, xs):
    ce, correct = one(*xs)
    return (carry[0] + ce, carry[1] + correct), None

  zero = jnp.zeros((), jnp.float32)
  (ce, correct), _ = jax.lax.scan(body, (zero, zero), (split(hidden), split(targets), split(weights)))
  return ce, correct


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
