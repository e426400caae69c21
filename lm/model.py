"""The decoder language model: embedding, N blocks of (mixer + SwiGLU MLP, pre-RMSNorm), final
norm, untied head.

The mixer of each layer comes from ``ModelConfig.layers()``: ``mixer`` for every layer, or a
``layer_pattern`` repeated over the depth (e.g. three triadic layers then one attention layer).
One repetition of the pattern is a ``Group``; the groups are stacked with ``nn.scan`` (parameters
get a leading ``layers`` axis), so compile time does not grow with depth and ``remat`` bounds the
activation memory. ``scan_unroll`` groups run per iteration of that loop; at the number of groups
the loop is unrolled: the backward's saved residuals are then each its own buffer instead of a
slice of one array stacked over the groups, which XLA on a GPU copies into the stack after every
custom kernel (Pallas, cuBLAS) that writes one. Unrolled, XLA also schedules the whole depth at
once, which holds more memory; where the saved residuals (``remat``) no longer fit beside that,
XLA's own rematerialisation has to search the unrolled graph and compiles take many minutes, so
unroll where the residuals take well under the device's memory (benchmarks/train_step.py
``--set model.scan_unroll=N`` shows both). Compile time grows with it, and an unrolled compile
near the memory limit is not predictable: the same step has compiled in under a minute on one
machine and not within minutes on another (benchmarks/RESULTS.md), so the default is the loop.
The parameters are the same either way.

``remat`` names what the backward pass may keep from the forward (``REMAT_POLICIES``): "none"
(no rematerialisation: everything is kept), "full" (only each group's input is kept; the whole
forward is recomputed), "save_mixer_op" (the sequence-mixing op's output and backward residuals
are kept: the triadic / GDN / attention kernels' forward is not run again; projections, short
convolutions, norms and the MLP are), "dots" / "dots_no_batch" (matmul outputs kept: all of them,
or those without batch dimensions, i.e. the projections and the MLP), "save_mixer_op_and_dots"
(both of the last two: only elementwise work is recomputed). True / False mean "full" / "none".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from layers.blocks import Param, RMSNorm, dense, dense_kernel_init
from layers.conv_kernel import IMPLS as CONV_IMPLS
from layers.remat import MIXER_OP
from lm import mixers

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

_SAVE_OP = jax.checkpoint_policies.save_only_these_names(MIXER_OP)
_DOTS_NO_BATCH = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
# remat name -> jax.checkpoint policy ("none": no jax.checkpoint at all; "full": its default policy,
# which saves nothing but the inputs)
REMAT_POLICIES = {
    "none": None,
    "full": None,
    "save_mixer_op": _SAVE_OP,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": _DOTS_NO_BATCH,
    "save_mixer_op_and_dots": jax.checkpoint_policies.save_from_both_policies(_SAVE_OP, _DOTS_NO_BATCH),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Every number that shapes the model; built from ``config.model`` and ``config.data``."""

  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  head_dim: int
  mlp_dim: int
  mixer: str = "triadic_gdn"
  value_dim: int = 0  # GDN-style mixers' state value width V (0: head_dim, the key width D)
  num_v_heads: int = 0  # GDN-style mixers' value heads, a multiple of num_heads (0: num_heads)
  layer_pattern: str = ""
  num_kv_heads: int = 0
  qk_norm: bool = False  # attention: RMSNorm over head_dim of queries and keys, before RoPE
  rope_base: float = 10000.0  # attention: RoPE's base
  rope_per_document: bool = True  # attention: RoPE positions restart at each document start
  expand_e: int = 1
  aggregator: str = "merlin"
  segment_len: int = 256
  max_segments: int = 64
  d_r: int = 128
  state_dim: int = 64
  conv_width: int = 4
  gate_rank: int = 128  # GDN-style mixers' output gate: x -> rank -> H x V (0: full rank)
  a_min: float = 1e-6  # GDN-style mixers' decay at init: A ~ U(a_min, 16)
  impl: str = "auto"
  conv_impl: str = "auto"  # the short convolutions: layers.blocks.causal_conv's impl
  chunk_size: int = 64
  attention_impl: str | None = None
  dtype: str = "float32"
  remat: bool | str = "none"  # a key of REMAT_POLICIES (True / False: "full" / "none")
  scan_unroll: int = 1  # layer groups per iteration of the scan over depth (module docstring)
  tie_embeddings: bool = False  # logits from the input embedding (no separate head)
  loss_chunk: int = 1024  # training loss over chunks of this many tokens per row (0: all at once)

  @classmethod
  def from_config(cls, config) -> "ModelConfig":
    """Read ``config.model`` (+ ``config.data.vocab_size``), ignoring keys the model does not use."""
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in config.model.items() if k in names}
    kw["vocab_size"] = config.data.vocab_size
    if kw.get("attention_impl") == "":
      kw["attention_impl"] = None
    return cls(**kw)

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "d_model", "num_heads", "head_dim", "mlp_dim",
                 "expand_e", "segment_len", "max_segments", "d_r", "state_dim", "conv_width",
                 "chunk_size", "scan_unroll"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{name} must be a positive int, got {value!r}")
    if not isinstance(self.a_min, (int, float)) or not 0 < self.a_min < 16:
      raise ValueError(f"model.a_min must be a number in (0, 16) (A ~ U(a_min, 16) at init), got "
                       f"{self.a_min!r}")
    for name in ("qk_norm", "rope_per_document"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"model.{name} must be a bool, got {getattr(self, name)!r}")
    if not isinstance(self.rope_base, (int, float)) or isinstance(self.rope_base, bool) \
        or not self.rope_base > 1:
      raise ValueError(f"model.rope_base must be a number > 1, got {self.rope_base!r}")
    if not isinstance(self.gate_rank, int) or self.gate_rank < 0:
      raise ValueError(f"model.gate_rank must be a non-negative int (0: a full-rank output gate), "
                       f"got {self.gate_rank!r}")
    if self.remat_name() not in REMAT_POLICIES:
      raise ValueError(f"model.remat must be one of {tuple(REMAT_POLICIES)} (or a bool), got "
                       f"{self.remat!r}")
    if self.conv_impl not in CONV_IMPLS:
      raise ValueError(f"model.conv_impl must be one of {CONV_IMPLS}, got {self.conv_impl!r}")
    if self.dtype not in DTYPES:
      raise ValueError(f"model.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
    pattern = self.pattern()
    for m in pattern:
      if m not in mixers.MIXERS:
        where = "model.layer_pattern" if self.layer_pattern else "model.mixer"
        raise ValueError(f"{where} names unknown mixer {m!r}; known mixers: {tuple(mixers.MIXERS)}")
    if self.num_layers % len(pattern):
      raise ValueError(f"model.num_layers ({self.num_layers}) must be a multiple of the length of "
                       f"model.layer_pattern {pattern} ({len(pattern)})")
    for name in ("value_dim", "num_v_heads"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"model.{name} must be a non-negative int (0: the default), got {value!r}")
      ignored = [m for m in pattern if name not in mixers.get(m).fields]
      if value and ignored:
        raise ValueError(f"model.{name} is set but mixer(s) {ignored} do not read it")
    if self.num_v_heads % self.num_heads:
      raise ValueError(f"model.num_v_heads ({self.num_v_heads}) must be a multiple of "
                       f"model.num_heads ({self.num_heads})")
    if not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
      raise ValueError(f"model.loss_chunk must be a non-negative int (0: no chunking), got "
                       f"{self.loss_chunk!r}")
    kvh = self.num_kv_heads or self.num_heads
    if "attention" in pattern and self.num_heads % kvh:
      raise ValueError(f"model.num_kv_heads ({kvh}) must divide model.num_heads ({self.num_heads})")

  def remat_name(self) -> str:
    """``remat`` as a key of REMAT_POLICIES."""
    if isinstance(self.remat, bool):
      return "full" if self.remat else "none"
    return self.remat

  def pattern(self) -> tuple[str, ...]:
    """The mixers of one repeating group of layers."""
    if self.layer_pattern:
      return tuple(m.strip() for m in self.layer_pattern.split(",") if m.strip())
    return (self.mixer,)

  def layers(self) -> tuple[str, ...]:
    """The mixer of every layer, bottom to top."""
    return self.pattern() * (self.num_layers // len(self.pattern()))

  @property
  def max_len(self) -> int | None:
    """The longest sequence the model accepts (multi-state mixers hold max_segments segments)."""
    limits = [n for n in (mixers.get(m).max_len(self) for m in self.pattern()) if n is not None]
    return min(limits, default=None)

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]


class Mlp(nn.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  hidden: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=self.dtype)
    gate = dense(self.hidden, ("embed", "mlp"), name="gate", **kw)(x)
    up = dense(self.hidden, ("embed", "mlp"), name="up", **kw)(x)
    return dense(x.shape[-1], ("mlp", "embed"), name="down", **kw)(jax.nn.silu(gate) * up)


class Block(nn.Module):
  """``x + mixer(norm(x))`` then ``x + mlp(norm(x))``."""

  cfg: ModelConfig
  mixer: str

  @nn.compact
  def __call__(self, x, cache=None, segment_ids=None):
    """``(x, new_cache)``: the mixer's convention (cache None in training; see ``LM.__call__``)."""
    dt = self.cfg.compute_dtype
    x = nn.with_logical_constraint(x, ("batch", None, "embed_act"))
    h = RMSNorm(dtype=dt, name="mixer_norm")(x)
    mixer = mixers.make_mixer(self.mixer, self.cfg, dtype=dt, name="mixer")
    y, cache = mixer(h, cache) if segment_ids is None else mixer(h, cache, segment_ids=segment_ids)
    x = x + y.astype(x.dtype)
    h = RMSNorm(dtype=dt, name="mlp_norm")(x)
    x = x + Mlp(self.cfg.mlp_dim, dtype=dt, name="mlp")(h).astype(x.dtype)
    return x, cache


class Group(nn.Module):
  """One repetition of the layer pattern (the body of the scan over depth)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, cache, segment_ids=None):
    """(x, None) -> (x, None) for training; (x, {block_i: cache}) -> (x, new caches) to decode."""
    new = {}
    for i, mixer in enumerate(self.cfg.pattern()):
      name = f"block{i}"
      x, new[name] = Block(self.cfg, mixer, name=name)(x, None if cache is None else cache[name],
                                                       segment_ids)
    return x, None if cache is None else new


def head_logits(cfg: ModelConfig, weight: jax.Array, x: jax.Array) -> jax.Array:
  """float32 logits (..., vocab) of final-normed hidden states x (..., d_model).

  ``weight``: the head kernel params["head"]["kernel"] (d_model, vocab), in the compute dtype, or
  with ``cfg.tie_embeddings`` the input table params["embed"]["embedding"] (vocab, d_model), read
  in float32 against x rounded to the compute dtype (``nn.Embed.attend``'s product).
  """
  dt = cfg.compute_dtype
  if cfg.tie_embeddings:
    return jnp.dot(x.astype(dt).astype(jnp.float32), weight.astype(jnp.float32).T)
  logits = jax.lax.dot_general(x.astype(dt), weight.astype(dt), (((x.ndim - 1,), (0,)), ((), ())))
  return logits.astype(jnp.float32)


class LM(nn.Module):
  """Decoder LM: int32 tokens (B, T) -> float32 logits (B, T, vocab_size)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, cache: dict | None = None, segment_ids=None, *,
               head: bool = True):
    """Logits (B, T, vocab) for tokens (B, T): the training forward.

    ``segment_ids`` (B, T) int32 (packed documents, the document index of each token in its row):
    every token sees only its own document: attention is masked, recurrent states reset and short
    convolutions do not reach into the previous document.

    ``head=False`` returns the final-normed hidden states (B, T, d_model) instead, for a loss that
    applies the output head itself (``head_logits``) a chunk of tokens at a time.

    With ``cache`` (``init_cache``, or returned by the previous call) the tokens continue the cached
    sequence and the result is ``(logits, new_cache)``: a prompt (prefill, the parallel form) or one
    token (decode, the recurrent step / KV cache). The parameters are the training forward's.
    """
    cfg = self.cfg
    if tokens.ndim != 2:
      raise ValueError(f"tokens must have shape (B, T), got shape {tokens.shape}")
    if segment_ids is not None and cache is not None:
      raise ValueError("segment_ids applies to the training forward; a cache continues one document")
    if segment_ids is not None and segment_ids.shape != tokens.shape:
      raise ValueError(f"segment_ids must have the shape of tokens {tokens.shape}, got "
                       f"{segment_ids.shape}")
    if cfg.max_len is not None and tokens.shape[1] > cfg.max_len:
      raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_segments * "
                       f"model.segment_len = {cfg.max_segments} * {cfg.segment_len} = {cfg.max_len}")
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, name="embed",
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(0.02), ("vocab", "embed")))
    x = embed(tokens).astype(jnp.float32)  # the residual stream stays float32
    remat = cfg.remat_name()
    group = Group if remat == "none" else nn.remat(Group, prevent_cse=False,
                                                    policy=REMAT_POLICIES[remat])
    stack = nn.scan(group, variable_axes={"params": 0}, split_rngs={"params": True},
                    in_axes=(0, nn.broadcast), length=cfg.num_layers // len(cfg.pattern()),
                    unroll=min(cfg.scan_unroll, cfg.num_layers // len(cfg.pattern())),
                    metadata_params={nn.PARTITION_NAME: "layers"})
    x, cache = stack(cfg, name="layers")(x, cache, segment_ids)
    x = RMSNorm(dtype=cfg.compute_dtype, name="final_norm")(x)
    if cfg.tie_embeddings:
      weight = embed.embedding
    else:  # the kernel of dense(vocab_size, ("embed", "vocab"), name="head")
      weight = Param((cfg.d_model, cfg.vocab_size), dense_kernel_init(), ("embed", "vocab"),
                     name="head")()
    if not head:
      return x if cache is None else (x, cache)
    logits = head_logits(cfg, weight, x)
    return logits if cache is None else (logits, cache)

  def init_cache(self, batch: int, max_len: int) -> dict:
    """The empty decoding cache for ``batch`` sequences of up to ``max_len`` tokens (prompt +
    generated): {block_i: that mixer's cache}, each leaf with a leading axis over the layer groups
    (the ``layers`` axis of the parameters)."""
    cfg = self.cfg
    groups = cfg.num_layers // len(cfg.pattern())
    one = {f"block{i}": mixers.mixer_cache(m, cfg, batch, max_len, cfg.compute_dtype)
           for i, m in enumerate(cfg.pattern())}
    return jax.tree.map(lambda z: jnp.broadcast_to(z, (groups,) + z.shape), one)
