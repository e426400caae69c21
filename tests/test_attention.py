"""The attention baseline's QK-norm and RoPE: the layer against a direct computation, RoPE
positions counted from each packed document's start, and the model fields' checks. (Decoding
against the parallel forward: tests/test_decode.py; packed rows against separate rows:
tests/test_documents.py.)"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import attention
from lm.attention import Attention, rotary
from lm.model import ModelConfig
from testkit import rel_rms
from triadic.ops import document_positions

jax.config.update("jax_default_matmul_precision", "highest")


def test_document_positions_count_from_each_document_start():
  ids = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2], [7, 3, 3, 3, 3, 3, 5, 5]])
  np.testing.assert_array_equal(document_positions(ids),
                                [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 1]])


def test_rotary_at_document_positions_equals_each_document_alone():
  x = jax.random.normal(jax.random.key(0), (1, 9, 2, 8))
  ids = jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
  got = rotary(x, 500.0, positions=document_positions(ids))
  want = jnp.concatenate([rotary(x[:, :4], 500.0), rotary(x[:, 4:], 500.0)], axis=1)
  np.testing.assert_array_equal(got, want)
  assert not np.allclose(got, rotary(x, 500.0), atol=1e-3)  # the second document moved
  with pytest.raises(ValueError, match="positions must have shape"):
    rotary(x, positions=jnp.zeros((1, 8), jnp.int32))


def reference(params, x, h, kvh, d, base, eps=1e-6):
  """QK-normed (per-channel scale), rotated, causal GQA attention, written out directly."""
  p = params["params"]
  q = jnp.einsum("btc,chd->bthd", x, p["q_proj"]["kernel"])
  k = jnp.einsum("btc,chd->bthd", x, p["k_proj"]["kernel"])
  v = jnp.einsum("btc,chd->bthd", x, p["v_proj"]["kernel"])
  norm = lambda z, s: z * jax.lax.rsqrt(jnp.mean(z * z, -1, keepdims=True) + eps) * s
  q, k = norm(q, p["q_norm"]["scale"]), norm(k, p["k_norm"]["scale"])
  q, k = rotary(q, base), jnp.repeat(rotary(k, base), h // kvh, axis=2)
  v = jnp.repeat(v, h // kvh, axis=2)
  t = x.shape[1]
  s = jnp.einsum("bthd,bshd->bhts", q, k) * d ** -0.5
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)
  return jnp.einsum("bthd,hdc->btc", o, p["out_proj"]["kernel"])


def test_qk_norm_attention_equals_the_direct_computation():
  """Non-unit norm scales: RMSNorm before RoPE is not RoPE before RMSNorm."""
  h, kvh, d, base = 4, 2, 8, 300.0
  layer = Attention(h, d, num_kv_heads=kvh, qk_norm=True, rope_base=base, implementation="xla")
  x = jax.random.normal(jax.random.key(0), (2, 11, 16))
  params = nn.unbox(layer.init(jax.random.key(1), x))
  for i, name in enumerate(("q_norm", "k_norm")):
    assert params["params"][name]["scale"].shape == (d,)
    params["params"][name]["scale"] = 1.0 + jax.random.normal(jax.random.key(5 + i), (d,))
  got, _ = layer.apply(params, x)
  assert rel_rms(got, reference(params, x, h, kvh, d, base)) < 1e-5


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_the_scores_independent_of_the_scale_of_q_and_k(qk_norm):
  layer = Attention(2, 8, qk_norm=qk_norm, implementation="xla")
  x = jax.random.normal(jax.random.key(0), (1, 7, 16))
  params = nn.unbox(layer.init(jax.random.key(1), x))
  scaled = jax.tree_util.tree_map_with_path(
      lambda path, w: 30.0 * w if "q_proj" in jax.tree_util.keystr(path)
      or "k_proj" in jax.tree_util.keystr(path) else w, params)
  same = rel_rms(layer.apply(scaled, x)[0], layer.apply(params, x)[0]) < 1e-5
  assert same == qk_norm


@pytest.mark.parametrize("per_document", [True, False])
def test_rope_positions_restart_at_each_document_start(per_document, monkeypatch):
  seen = []

  def recording_rotary(x, base=attention.ROPE_BASE, offset=0, positions=None):
    seen.append(None if positions is None else np.asarray(positions))
    return rotary(x, base, offset, positions)

  monkeypatch.setattr(attention, "rotary", recording_rotary)
  layer = Attention(2, 8, rope_per_document=per_document, implementation="xla")
  x = jax.random.normal(jax.random.key(0), (2, 6, 16))
  ids = jnp.asarray([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 2]])
  params = layer.init(jax.random.key(1), x)
  seen.clear()
  layer.apply(params, x, segment_ids=ids)
  want = [[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 0]] if per_document else None
  assert len(seen) == 2  # queries and keys
  for positions in seen:
    if want is None:
      assert positions is None  # 0..T-1
    else:
      np.testing.assert_array_equal(positions, want)


@pytest.mark.parametrize("field,value,message", [
    ("qk_norm", 1, "model.qk_norm must be a bool"),
    ("rope_per_document", "yes", "model.rope_per_document must be a bool"),
    ("rope_base", 0.5, "model.rope_base must be a number > 1"),
])
def test_bad_attention_fields_are_named(field, value, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig(vocab_size=32, num_layers=1, d_model=16, num_heads=2, head_dim=8, mlp_dim=32,
                mixer="attention", **{field: value})
