"""Recurrent inference: prefill T tokens then k one-token steps == the parallel forward over T + k
tokens (each decodable mixer and the LM, float32), and generation (deterministic, greedy = argmax)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm.attention import Attention
from lm.generate import generate
from lm import mixers
from lm.model import LM, ModelConfig
from merlin import Mamba2, MultiStateGDN, MultiStateMamba2, make_aggregator, merlin_weights
from testkit import rel_rms
from triadic import TriadicGDN


def prefill_then_steps(model, variables, x, prompt_len):
  """Output of ``model`` over x (B, T, ...) as prefill of x[:, :prompt_len] then one-token steps."""
  apply = jax.jit(model.apply)  # one compile for the prefill, one for the step
  cache = model.init_cache(x.shape[0], x.shape[1])
  y, cache = apply(variables, x[:, :prompt_len], cache)
  ys = [y]
  for i in range(prompt_len, x.shape[1]):
    y, cache = apply(variables, x[:, i:i + 1], cache)
    ys.append(y)
  return jnp.concatenate(ys, axis=1)


LAYERS = {
    "gdn": lambda: TriadicGDN(2, 8, expand_e=1, erase=True, impl="chunked", chunk_size=8),
    "triadic_gdn_e3": lambda: TriadicGDN(2, 8, expand_e=3, erase=True, impl="chunked", chunk_size=8),
    "triadic_sgla_e2": lambda: TriadicGDN(2, 8, value_dim=4, expand_e=2, erase=False, impl="chunked",
                                          chunk_size=8),
    # grouped value heads: 2 value heads per key head, each with its own state
    "triadic_gdn_e2_grouped_values": lambda: TriadicGDN(2, 8, value_dim=4, num_v_heads=4, expand_e=2,
                                                        impl="chunked", chunk_size=8),
    "attention_gqa": lambda: Attention(4, 8, num_kv_heads=2),
    # the cache path normalises the new queries and keys and uses the layer's RoPE base
    "attention_qk_norm": lambda: Attention(4, 8, num_kv_heads=2, qk_norm=True, rope_base=500.0),
    "mamba2": lambda: Mamba2(2, 8, state_dim=4, impl="chunked", chunk_size=8),
    # segments of 4: the prompt of 11 ends mid-segment (and mid-chunk), decoding crosses into a new one
    "multistate_gdn_merlin": lambda: MultiStateGDN(2, 8, aggregator="merlin", segment_len=4,
                                                   max_segments=4, d_r=4, impl="chunked"),
    "multistate_sgla_position": lambda: MultiStateGDN(2, 8, aggregator="position", erase=False,
                                                      segment_len=4, max_segments=4, d_r=4),
    "multistate_mamba2_meanpool": lambda: MultiStateMamba2(2, 8, state_dim=4, aggregator="meanpool",
                                                           segment_len=4, max_segments=4, d_r=4),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_prefill_then_decode_equals_parallel_forward(name):
  model = LAYERS[name]()
  x = jax.random.normal(jax.random.key(0), (2, 14, 16))
  variables = jax.jit(model.init)(jax.random.key(1), x)
  full, _ = jax.jit(model.apply)(variables, x)
  got = prefill_then_steps(model, variables, x, prompt_len=11)  # 11 = mid-chunk (C = 8)
  assert rel_rms(got, full) < 1e-5


@pytest.mark.parametrize("kind", ["merlin", "position"])
def test_aggregator_step_weights_equal_the_parallel_weights_at_every_position(kind):
  """Token by token from the running moments (no old token revisited) == merlin_weights & co."""
  agg = make_aggregator(kind, num_heads=2, segment_len=3, max_segments=4, d_r=4, groups=2)
  x = jax.random.normal(jax.random.key(4), (2, 11, 16))
  variables = jax.jit(agg.init)(jax.random.key(5), x)
  full, _ = jax.jit(agg.apply)(variables, x)
  step = jax.jit(lambda v, xt, c, pos: agg.apply(v, xt, c, pos))
  cache, got = agg.init_cache(2), []
  for t in range(x.shape[1]):
    lam, cache = step(variables, x[:, t:t + 1], cache, jnp.int32(t))
    got.append(lam)
  np.testing.assert_allclose(jnp.concatenate(got, axis=1), full, rtol=1e-5, atol=1e-6)
  if kind == "merlin":  # and the layer's weights are merlin_weights of its own k', q'
    p = nn.unbox(variables)["params"]
    proj = lambda name: jnp.einsum("btd,dhr->bthr", x, p[name]["kernel"])
    l2 = lambda z: z / jnp.sqrt(jnp.sum(z * z, -1, keepdims=True) + 1e-6)
    gamma = jax.nn.sigmoid(jnp.einsum("btd,dh->bth", x, p["gamma_proj"]["kernel"])
                           + p["gamma_proj"]["bias"])
    want = merlin_weights(l2(proj("qr_proj")), l2(proj("kr_proj")), gamma,
                          jnp.exp(p["log_tau_mu"]), jnp.exp(p["log_tau_sigma"]), segment_len=3,
                          max_segments=4)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), want, rtol=1e-5, atol=1e-6)


def test_multistate_prefill_must_start_the_sequence():
  model = MultiStateGDN(2, 8, aggregator="vanilla", segment_len=4, max_segments=4, d_r=4)
  x = jnp.ones((1, 6, 16))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  cache = {**model.init_cache(1), "length": jnp.int32(2)}
  with pytest.raises(ValueError, match="must start the sequence"):
    model.apply(variables, x, cache)


def test_decode_uses_the_training_parameters():
  """The cached path creates no parameter the training forward lacks (checkpoints decode)."""
  model = TriadicGDN(2, 8, expand_e=2, impl="chunked", chunk_size=8)
  x = jnp.ones((1, 5, 16))
  train = jax.eval_shape(model.init, jax.random.key(0), x)
  decode = jax.eval_shape(model.init, jax.random.key(0), x, model.init_cache(1, 5))
  assert jax.tree.map(jnp.shape, decode) == jax.tree.map(jnp.shape, train)


def small(**kw):
  base = dict(vocab_size=32, num_layers=2, d_model=16, num_heads=2, head_dim=8, mlp_dim=32,
              impl="chunked", chunk_size=8, expand_e=2)
  return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("cfg", [small(layer_pattern="triadic_sgla,attention", num_layers=4),
                                 small(layer_pattern="gdn,attention", qk_norm=True),
                                 small(layer_pattern="multistate_gdn,mamba2", segment_len=4,
                                       max_segments=4, d_r=4, state_dim=4)],
                         ids=["triadic_hybrid", "gdn_qk_norm_hybrid", "multistate_hybrid"])
def test_lm_prefill_then_decode_equals_parallel_forward(cfg):
  model = LM(cfg)
  tokens = jax.random.randint(jax.random.key(2), (2, 13), 0, cfg.vocab_size)
  variables = jax.jit(model.init)(jax.random.key(0), tokens)
  full = jax.jit(model.apply)(variables, tokens)
  got = prefill_then_steps(model, variables, tokens, prompt_len=10)
  assert rel_rms(got, full) < 1e-5


def test_generate_is_deterministic_and_greedy_is_the_argmax():
  cfg = small(layer_pattern="gdn,attention", num_layers=2)
  model = LM(cfg)
  prompt = jax.random.randint(jax.random.key(3), (2, 5), 0, cfg.vocab_size)
  variables = jax.jit(model.init)(jax.random.key(0), prompt)
  a = generate(variables, cfg, prompt, 6, temperature=1.0, top_k=5, seed=7)
  b = generate(variables, model, prompt, 6, temperature=1.0, top_k=5, seed=7)
  c = generate(variables["params"], cfg, prompt, 6, temperature=1.0, seed=8)
  assert a.shape == (2, 11) and a.dtype == jnp.int32
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a[:, :5], prompt)
  assert not np.array_equal(a, c)  # another seed (and no top-k) draws other tokens
  greedy = generate(variables, cfg, prompt, 6, temperature=0.0)
  # each greedy token is the argmax of the parallel forward over its prefix (causal: one forward)
  logits = jax.jit(model.apply)(variables, greedy)
  np.testing.assert_array_equal(greedy[:, 5:], jnp.argmax(logits[:, 4:-1], axis=-1))


def test_unknown_mixers_are_named():
  with pytest.raises(ValueError, match="unknown mixer 'retnet'; known mixers: \\('attention'"):
    mixers.get("retnet")


def test_generate_may_fill_a_multistate_model_to_max_len():
  """The last new token is sampled, never read: prompt + new - 1 <= max_len is the bound."""
  cfg = small(mixer="multistate_gdn", aggregator="vanilla", segment_len=4, max_segments=2, d_r=4,
              num_layers=1)
  prompt = jnp.ones((1, 6), jnp.int32)
  variables = jax.jit(LM(cfg).init)(jax.random.key(0), prompt)
  assert generate(variables, cfg, prompt, 3, temperature=0.0).shape == (1, 9)  # reads 8 tokens
  with pytest.raises(ValueError, match="prompt \\+ max_new_tokens - 1 = 9 tokens exceed"):
    generate(variables, cfg, prompt, 4, temperature=0.0)
