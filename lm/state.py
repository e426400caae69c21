"""The train state, the optimizer, and how both are laid out on the mesh (the step itself:
``lm.train_step``).

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
  """Weight decay on matrices (kernels: projections, short convolutions, the head; embeddings)
  only, not on vectors: norm scales, biases, A_log, dt_bias and the other per-head constants. The
  triadic authors decay exactly their parameters of two or more dimensions, the same split (their
  convolution weights are (channels, width) matrices too)."""
  def leaf(path, _):
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return keys[-1] in ("kernel", "embedding")
  return jax.tree_util.tree_map_with_path(leaf, params)


def optimizer(t) -> optax.GradientTransformation:
  """AdamW (``train.b1``, ``b2``, ``adam_eps``, ``weight_decay`` on matrices only) after
  global-norm clipping at ``train.grad_clip``. A config saved without ``adam_eps`` gets optax's
  default, 1e-8."""
  return optax.chain(
      optax.clip_by_global_norm(t.grad_clip),
      optax.adamw(schedule(t), b1=t.b1, b2=t.b2, eps=t.get("adam_eps", 1e-8),
                  weight_decay=t.weight_decay, mask=_decay_mask))


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
