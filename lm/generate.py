"""Autoregressive generation from the decoder LM: one prefill of the prompt, then constant-cost
decoding steps inside ``lax.scan`` (the whole thing is one jitted function).

The prompt runs through ``LM(tokens, cache)`` in the parallel form (chunked / Pallas for the
recurrent mixers, one masked attention for attention layers) and leaves a cache; each new token is
then one ``LM(token, cache)`` call: the recurrent step for linear-attention layers, a KV-cache read
for attention layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.model import LM, ModelConfig


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
  """Token ids (B,) from logits (B, vocab): argmax when ``temperature == 0``, else a draw from
  softmax(logits / temperature) restricted to the ``top_k`` largest logits (all if top_k == 0)."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if 0 < top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(params, model, prompt: jax.Array, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0) -> jax.Array:
  """Continue ``prompt`` (B, P) int32 by ``max_new_tokens`` tokens; returns (B, P + max_new_tokens).

  Args:
    params: the model's variables ({"params": ...}) or just the params tree.
    model: an ``LM`` or its ``ModelConfig``.
    prompt: (B, P) token ids, P >= 1.
    max_new_tokens: how many tokens to add (>= 0).
    temperature: softmax temperature; 0 is greedy (argmax).
    top_k: sample among the k most likely tokens only (0: all).
    seed: the PRNG seed; the same seed gives the same tokens.
  """
  cfg = model.cfg if isinstance(model, LM) else model
  if not isinstance(cfg, ModelConfig):
    raise TypeError(f"model must be an LM or a ModelConfig, got {type(model).__name__}")
  prompt = jnp.asarray(prompt)
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must have shape (B, P) with P >= 1, got {prompt.shape}")
  if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
  if temperature < 0 or not isinstance(top_k, int) or top_k < 0:
    raise ValueError(f"temperature must be >= 0 and top_k a non-negative int, got {temperature!r}, "
                     f"{top_k!r}")
  # The model reads the prompt and every new token but the last (which is only sampled).
  seen = prompt.shape[1] + max_new_tokens - 1
  if cfg.max_len is not None and seen > cfg.max_len:
    raise ValueError(f"prompt + max_new_tokens - 1 = {seen} tokens exceed the model's max_len "
                     f"{cfg.max_len} (max_segments * segment_len)")
  if max_new_tokens == 0:
    return prompt.astype(jnp.int32)
  variables = params if "params" in params else {"params": params}
  return _generate(variables, prompt.astype(jnp.int32), jnp.asarray(seed, jnp.uint32), cfg=cfg,
                   max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=top_k)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "temperature", "top_k"))
def _generate(variables, prompt, seed, *, cfg, max_new_tokens, temperature, top_k):
  model = LM(cfg)
  batch, p = prompt.shape
  key = jax.random.key(seed)
  cache = model.init_cache(batch, p + max_new_tokens - 1)  # the tokens the model reads
  logits, cache = model.apply(variables, prompt, cache)
  first = sample(logits[:, -1], jax.random.fold_in(key, 0), temperature, top_k)

  def step(carry, i):
    token, cache = carry
    logits, cache = model.apply(variables, token[:, None], cache)
    token = sample(logits[:, -1], jax.random.fold_in(key, i), temperature, top_k)
    return (token, cache), token

  _, rest = jax.lax.scan(step, (first, cache), jnp.arange(1, max_new_tokens))
  return jnp.concatenate([prompt, first[:, None], rest.T], axis=1)
