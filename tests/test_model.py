"""The LM, its mixers, config checks, init_from planning and parameter counts (no training)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import costs, init_from, mixers, sharding
from lm.config import base_config, validate
from lm.model import LM, ModelConfig
from testkit import rel_rms


def small(**kw):
  base = dict(vocab_size=64, num_layers=2, d_model=32, num_heads=4, head_dim=8, mlp_dim=64,
              impl="scan", segment_len=8, max_segments=4, d_r=4, state_dim=8)
  return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("mixer", sorted(mixers.MIXERS))
def test_every_mixer_gives_finite_logits_and_is_causal(mixer):
  cfg = small(mixer=mixer, expand_e=2)
  model = LM(cfg)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
  params = jax.jit(model.init)(jax.random.key(0), tokens)
  apply = jax.jit(model.apply)
  logits = apply(params, tokens)
  assert logits.shape == (2, 16, 64) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 64)  # the future must not leak back
  np.testing.assert_allclose(apply(params, changed)[:, :10], logits[:, :10], atol=1e-5)


def test_tied_embeddings_read_the_logits_off_the_input_table():
  cfg = small(mixer="gdn", tie_embeddings=True)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
  params = nn.unbox(jax.jit(LM(cfg).init)(jax.random.key(0), tokens)["params"])
  assert "head" not in params
  untied = costs.count_params(small(mixer="gdn"))
  assert costs.count_params(cfg)["total"] == untied["total"] - 64 * 32
  # Scaling one token's embedding row scales that token's logit everywhere (and only its own).
  doubled = {**params, "embed": {"embedding": params["embed"]["embedding"].at[5].multiply(2.0)}}
  other = jnp.array([[1, 2, 3, 4]])  # inputs without token 5: the hidden states do not change
  apply = jax.jit(LM(cfg).apply)
  a = apply({"params": params}, other)
  b = apply({"params": doubled}, other)
  np.testing.assert_allclose(b[..., 5], 2 * a[..., 5], rtol=1e-5)
  np.testing.assert_allclose(np.delete(np.asarray(b), 5, -1), np.delete(np.asarray(a), 5, -1))


def test_hybrid_pattern_stacks_groups_with_a_layers_axis():
  cfg = small(layer_pattern="gdn,gdn,gdn,attention", num_layers=8)
  assert cfg.layers() == ("gdn", "gdn", "gdn", "attention") * 2
  params = costs.param_shapes(cfg)
  assert set(params["layers"]) == {"block0", "block1", "block2", "block3"}
  assert params["layers"]["block3"]["mixer"]["q_proj"]["kernel"].shape == (2, 32, 4, 8)
  assert "decay" in params["layers"]["block0"]["mixer"]


def test_unrolled_depth_gives_the_same_model_without_stacked_residuals():
  """``scan_unroll``: the same parameters and gradients unrolled or not; fully unrolled, the
  compiled backward has no dynamic-update-slice into an array stacked over the 3 layers."""
  import re
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
  grads, stacked = {}, {}
  for unroll in (1, 3):
    model = LM(small(mixer="gdn", impl="chunked", num_layers=3, remat="save_mixer_op_and_dots",
                     scan_unroll=unroll))
    params = jax.jit(model.init)(jax.random.key(0), tokens)
    grad = jax.jit(jax.grad(lambda p: jnp.mean(model.apply(p, tokens) ** 2)))
    grads[unroll] = grad(params)
    hlo = grad.lower(params).compile().as_text()
    stacked[unroll] = len(re.findall(r"= \w+\[3,[^=]*dynamic-update-slice\(", hlo))
  for a, b in zip(jax.tree.leaves(grads[3]), jax.tree.leaves(grads[1])):
    assert rel_rms(a, b) < 1e-4    # float32 rounding: XLA fuses the unrolled body differently
  assert stacked[1] > 0 and stacked[3] == 0, stacked


def test_params_carry_logical_axis_names():
  import flax.linen as nn
  cfg = small(mixer="triadic_gdn", expand_e=4)
  boxed = jax.eval_shape(LM(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  specs = nn.get_partition_spec(boxed)["params"]
  assert tuple(specs["embed"]["embedding"]) == ("vocab", "embed")
  assert tuple(specs["layers"]["block0"]["mixer"]["k2_proj"]["kernel"]) == (
      "layers", "embed", "heads", "expand")
  assert tuple(specs["layers"]["block0"]["mlp"]["down"]["kernel"]) == ("layers", "mlp", "embed")


@pytest.mark.parametrize("change, message", [
    (dict(mixer="transformer"), "model.mixer names unknown mixer 'transformer'"),
    (dict(layer_pattern="gdn,attention,gdn"), "multiple of the length of model.layer_pattern"),
    (dict(d_model=0), "model.d_model must be a positive int"),
    (dict(dtype="float8"), "model.dtype must be one of"),
    (dict(mixer="attention", num_kv_heads=3), "num_kv_heads (3) must divide"),
    (dict(gate_rank=-1), "model.gate_rank must be a non-negative int"),
    (dict(scan_unroll=0), "model.scan_unroll must be a positive int"),
    (dict(mixer="gdn", num_v_heads=6), "model.num_v_heads (6) must be a multiple of model.num_heads (4)"),
    (dict(mixer="gdn", value_dim=-1), "model.value_dim must be a non-negative int"),
    (dict(mixer="attention", value_dim=8), "model.value_dim is set but mixer(s)"),
])
def test_bad_model_values_are_named(change, message):
  c = base_config("mqar")
  c.model.update(**change)
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    validate(c)


def test_sequence_longer_than_the_segments_is_an_error():
  c = base_config("mqar")
  c.model.update(mixer="multistate_gdn", segment_len=8, max_segments=4)
  with pytest.raises(ValueError, match=r"data.seq_len \(64\) exceeds model.max_segments \* "
                                       r"model.segment_len = 4 \* 8 = 32"):
    validate(c)
  with pytest.raises(ValueError, match="sequence length 40 exceeds"):
    LM(small(mixer="multistate_gdn")).init(jax.random.key(0), jnp.zeros((1, 40), jnp.int32))


def test_bad_train_values_are_named():
  c = base_config("mqar")
  c.train.warmup_steps = c.train.num_steps
  with pytest.raises(ValueError, match="train.warmup_steps"):
    validate(c)
  c = base_config("mqar")
  c.train.batch_size = 3
  with pytest.raises(ValueError, match="train.batch_size"):
    validate(c, process_count=2)


def test_mesh_shape_fills_minus_one_and_names_bad_sizes():
  assert sharding.mesh_shape(dict(data=-1, fsdp=1, tensor=2), 8) == (4, 1, 2)
  with pytest.raises(ValueError, match="needs 6 devices, but 8 are available"):
    sharding.mesh_shape(dict(data=3, fsdp=1, tensor=2), 8)
  with pytest.raises(ValueError, match="at most one -1"):
    sharding.mesh_shape(dict(data=-1, fsdp=-1, tensor=1), 8)


def test_init_from_plan_copies_broadcasts_and_rejects():
  source = {"a/kernel": (4, 2, 1), "b": (3,), "gone": (2,)}
  target = {"a/kernel": (4, 2, 8), "b": (3,), "new": (5,)}
  plan = init_from.plan(source, target)
  assert plan == {"copied": ["b"], "broadcast": ["a/kernel"], "new": ["new"], "unused": ["gone"]}
  with pytest.raises(ValueError, match=r"b: source \(3,\) vs target \(4,\)"):
    init_from.plan({"b": (3,)}, {"b": (4,)})


def paper(size, model, **kw):
  """The ModelConfig of ``configs/lm_{size}.py:text,{model}``."""
  from lm.paper_configs import lm_config
  config = lm_config(size, f"text,{model}")
  config.model.update(kw)
  return ModelConfig.from_config(config)


def authors_count(d_model, heads, mlp, e=1, vocab=32000, layers=24, rank=128, d=128, kv_heads=0):
  """(total, not weight-decayed) parameter counts of the authors' GPT
  (OliverSieberling/TriadicLinearAttention, model.py). Per layer, Triadic GDN (``kv_heads=0``):
  qkv_proj + its conv (width 4), gate_proj (decay, beta, gate input), A_log, decay_bias, gate_out
  (with bias), o_norm, o_proj; or their attention (``kv_heads`` > 0): in_proj (q, k, v), o_proj,
  q_norm, k_norm; then two RMSNorms and the SwiGLU; and the embedding, an untied head, the final
  norm. Their optimizer decays the parameters of two or more dimensions, the rest (norms, A_log,
  decay_bias, gate_out's bias) not."""
  if kv_heads:
    layer = d_model * (heads + 2 * kv_heads) * d + heads * d * d_model
    vectors = 2 * d
  else:
    qkv = 3 * heads * d + (2 * heads * e if e > 1 else 0)
    layer = (d_model * qkv + 4 * qkv + d_model * (heads * e + heads + rank) + rank * heads * d
             + heads * d * d_model)
    vectors = 2 * heads * e + heads * d + d
  vectors += 2 * d_model
  layer += vectors + 3 * d_model * mlp
  return layers * layer + 2 * vocab * d_model + d_model, layers * vectors + d_model


# configs/lm_400m.py and lm_1p3b.py against the authors' config/*.py: gdn_*, triadic_gdn_e8_*,
# transformer_* (GQA-8, the wider SwiGLU); the totals are docs/results.md's table.
PAPER_SIZES = [
    ("400m", "gdn", {}, dict(d_model=1024, heads=8, mlp=2816), 380_875_136),
    ("400m", "triadic_gdn", {}, dict(d_model=1024, heads=8, mlp=2816, e=8), 385_412_096),
    ("400m", "attention", {}, dict(d_model=1024, heads=8, mlp=3456, kv_heads=1), 377_019_392),
    ("1p3b", "gdn", {}, dict(d_model=2048, heads=16, mlp=5504), 1_360_221_952),
    ("1p3b", "triadic_gdn", {"expand_e": 2}, dict(d_model=2048, heads=16, mlp=5504, e=2),
     1_364_161_024),
    ("1p3b", "triadic_gdn", {}, dict(d_model=2048, heads=16, mlp=5504, e=8), 1_378_339_840),
    ("1p3b", "attention", {}, dict(d_model=2048, heads=16, mlp=6784, kv_heads=2), 1_358_012_416),
]


@pytest.mark.parametrize("size,model,kw,theirs,total", PAPER_SIZES,
                         ids=[f"{s}-{m}{kw.get('expand_e', '')}" for s, m, kw, _, _ in PAPER_SIZES])
def test_paper_configs_have_the_authors_parameters(size, model, kw, theirs, total):
  """Parameter for parameter: the total, and the part that gets no weight decay."""
  from lm.state import _decay_mask
  cfg = paper(size, model, **kw)
  params = costs.param_shapes(cfg)
  count = lambda keep: sum(x.size for x, k in zip(jax.tree.leaves(params),
                                                  jax.tree.leaves(_decay_mask(params))) if keep(k))
  want_total, want_vectors = authors_count(**theirs)
  assert costs.count_params(cfg)["total"] == want_total == total
  assert count(lambda decayed: not decayed) == want_vectors


def test_e8_adds_about_1p2_percent_at_400m():
  e1, e8 = (costs.count_params(paper("400m", m))["total"] for m in ("gdn", "triadic_gdn"))
  extra = e8 / e1 - 1  # the paper: "about 1.2%"
  assert 0.010 < extra < 0.014, extra


def test_mqar_scale_cost_of_e16():
  """Triadic's extra parameters per layer at MQAR scale (2 layers, 4 heads, D = 16, d_model 64):
  k2 and q2 projections (2 d H E) with their convolutions (2 x 4 H E), and E - 1 more decay
  columns (d H + 2 H each). The paper quotes ~8% of non-embedding parameters; with this model
  (SwiGLU 128, vocab 8192, untied head) the share is larger, see the test's assertion."""
  def count(e):
    return costs.count_params(ModelConfig(vocab_size=8192, num_layers=2, d_model=64, num_heads=4,
                                          head_dim=16, mlp_dim=128, expand_e=e))
  e1, e16 = count(1), count(16)
  d, h, e = 64, 4, 16
  per_layer = 2 * d * h * e + 2 * 4 * h * e + (e - 1) * (d * h + 2 * h)
  assert e16["total"] - e1["total"] == 2 * per_layer
  without_head = e1["non_embedding"] - 8192 * 64
  share = 2 * per_layer / without_head
  assert 0.2 < share < 0.3, share  # ~26% of the blocks' parameters; 4% with the head counted


def test_state_bytes_of_a_triadic_layer():
  cfg = small(mixer="triadic_gdn", expand_e=2, num_layers=1, layer_pattern="")
  conv = 3 * (4 * 8 * 3 + 2 * 4 * 2)
  assert costs.state_bytes(cfg, 16)["recurrent_state"] == 4 * (4 * 2 * 8 * 8 + conv)


# sha256 (first 16 hex digits) of the sorted "path:shape" lines of each mixer's parameter tree in
# a tiny LM: checkpoints and init_from load by these names, so a refactor must keep them. The
# GDN-style mixers' entries changed deliberately with the rank-128 output gate (gate_down, gate_up
# instead of gate_proj); model.gate_rank=0 gives the earlier trees (FULL_RANK_GATE_DIGESTS).
PARAM_TREE_DIGESTS = {
    ("attention", ""): "93aa946aa21f5c87",
    ("gdn", ""): "3138f64faf03b506",
    ("triadic_gdn", ""): "dacb6958bd2b79a4",
    ("triadic_sgla", ""): "dacb6958bd2b79a4",
    ("mamba2", ""): "f2c04c2db1291cb2",
    ("multistate_gdn", "vanilla"): "3138f64faf03b506",
    ("multistate_gdn", "position"): "4a287496f0b31bb1",
    ("multistate_gdn", "meanpool"): "783ff7201c38aa40",
    ("multistate_gdn", "merlin"): "902579c8170ea89a",
    ("multistate_mamba2", "vanilla"): "f2c04c2db1291cb2",
    ("multistate_mamba2", "position"): "ca752ceeedaf1b31",
    ("multistate_mamba2", "meanpool"): "040eb67c8f9ae955",
    ("multistate_mamba2", "merlin"): "e511d39df0682ac9",
}


FULL_RANK_GATE_DIGESTS = {
    ("gdn", ""): "b4a0aef4652686d1",
    ("triadic_gdn", ""): "e8a83a14383c1941",
    ("multistate_gdn", "merlin"): "af9437ef9345464e",
}


def _tree_digest(mixer, aggregator, **kw):
  import hashlib

  cfg = ModelConfig(vocab_size=32, num_layers=2, d_model=16, num_heads=2, head_dim=8, mlp_dim=32,
                    mixer=mixer, aggregator=aggregator or "merlin", expand_e=4, segment_len=8,
                    max_segments=4, d_r=4, state_dim=8, **kw)
  leaves = jax.tree_util.tree_flatten_with_path(costs.param_shapes(cfg))[0]
  lines = sorted(f"{jax.tree_util.keystr(path)}:{tuple(x.shape)}" for path, x in leaves)
  return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16], "\n".join(lines)


@pytest.mark.parametrize("mixer,aggregator", sorted(PARAM_TREE_DIGESTS))
def test_parameter_names_and_shapes_are_pinned(mixer, aggregator):
  digest, lines = _tree_digest(mixer, aggregator)
  assert digest == PARAM_TREE_DIGESTS[mixer, aggregator], lines


@pytest.mark.parametrize("mixer,aggregator", sorted(FULL_RANK_GATE_DIGESTS))
def test_full_rank_gate_keeps_the_earlier_parameter_trees(mixer, aggregator):
  digest, lines = _tree_digest(mixer, aggregator, gate_rank=0)
  assert digest == FULL_RANK_GATE_DIGESTS[mixer, aggregator], lines
