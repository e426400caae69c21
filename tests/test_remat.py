"""Remat policies (``model.remat``): every policy computes the same gradients, "save_mixer_op"
really keeps the mixing op's forward (it is not run again in the backward), and ``saved_op`` is
the identity on values and gradients."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.model import LM, REMAT_POLICIES, ModelConfig
from testkit import rel_rms
from layers.remat import saved_op


def _model(mixer, remat):
  return LM(ModelConfig(vocab_size=16, num_layers=1, d_model=32, num_heads=2, head_dim=8,
                        mlp_dim=32, mixer=mixer, expand_e=3, remat=remat, impl="chunked",
                        chunk_size=8))


def _tokens():
  return jax.random.randint(jax.random.key(1), (2, 13), 0, 16)


def _grad_fn(mixer, remat):
  model = _model(mixer, remat)
  tokens = _tokens()
  loss = lambda p: jnp.mean(jax.nn.log_softmax(model.apply({"params": p}, tokens))[..., 0])
  return jax.grad(loss)


def _params(mixer, shapes_only=False):
  """The params every policy's gradient is taken at (remat changes no parameter)."""
  init, args = _model(mixer, "none").init, (jax.random.key(0), _tokens())
  return (jax.eval_shape(init, *args) if shapes_only else jax.jit(init)(*args))["params"]


@pytest.mark.parametrize("mixer, policies", [
    ("triadic_gdn", ("full", "save_mixer_op", "save_mixer_op_and_dots")),
    ("attention", ("save_mixer_op",))])
def test_policies_give_the_gradients_of_no_remat(mixer, policies):
  """The policies that name the op (jax's own dots policies need no test of ours)."""
  assert set(policies) <= set(REMAT_POLICIES)
  params = _params(mixer)
  want = jax.jit(_grad_fn(mixer, "none"))(params)
  for remat in policies:
    got = jax.jit(_grad_fn(mixer, remat))(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert rel_rms(a, b) < 1e-5, remat


@pytest.mark.parametrize("mixer, pattern", [("triadic_gdn", r"\bcumsum\["), ("attention", r"= exp\b")])
def test_save_mixer_op_does_not_run_the_op_forward_again(mixer, pattern):
  """The op's own primitives (the chunked op's cumulative log decay; attention's softmax exp)
  appear once per forward: "full" remat runs the forward twice, "save_mixer_op" once, like no remat."""
  params = _params(mixer, shapes_only=True)  # tracing needs the shapes only

  def count(remat):
    return len(re.findall(pattern, str(jax.make_jaxpr(_grad_fn(mixer, remat))(params))))

  none, full, saved = count("none"), count("full"), count("save_mixer_op")
  assert full > none, (none, full)
  assert saved == none, (none, saved)


def test_bool_remat_and_bad_names():
  assert _model("gdn", True).cfg.remat_name() == "full"
  assert _model("gdn", False).cfg.remat_name() == "none"
  with pytest.raises(ValueError, match="model.remat must be one of"):
    _model("gdn", "everything")


def test_saved_op_keeps_values_and_gradients():
  fn = lambda a, b: (jnp.sin(a) * b, jnp.cos(a @ b))
  a, b = jax.random.normal(jax.random.key(0), (2, 3, 3))
  loss = lambda f: lambda a, b: sum(jnp.sum(z ** 2) for z in f(a, b))
  np.testing.assert_allclose(saved_op(fn)(a, b)[1], fn(a, b)[1])
  for g1, g2 in zip(jax.grad(loss(saved_op(fn)), (0, 1))(a, b), jax.grad(loss(fn), (0, 1))(a, b)):
    np.testing.assert_allclose(g1, g2, rtol=1e-6)
