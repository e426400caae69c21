"""Packed documents (``segment_ids``): every op, impl, mixer and the LM against separate rows.

The contract: a row with segment_ids behaves exactly as if each of its documents were its own row
(``initial_state`` for the row's first document, the final state after its last token; MERLIN's
segments and lam's index counted from each document's start). The reference runs every document
alone (the scan, or the layer on the document's slice) and concatenates; values and the gradients
of every input (g included, params and the short convolutions' kernels for the layers) must agree.
Layouts include one-token documents, documents shorter than the convolution width, and documents
that cross chunk boundaries.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import merlin
import triadic
from lm.mixers import make_mixer
from lm.model import LM, ModelConfig
from layers.blocks import ShortConv
from testkit import rel_rms
from testkit.triadic import make_grad_inputs as make_inputs

jax.config.update("jax_default_matmul_precision", "highest")


def documents(t: int, lengths) -> np.ndarray:
  """Document ids (t,) from a cycle of document lengths (the last one cut at t)."""
  ids, d = [], 0
  while len(ids) < t:
    ids += [d] * lengths[d % len(lengths)]
    d += 1
  return np.asarray(ids[:t], np.int32)


# One-token documents, documents shorter than the conv width (4), ones that cross chunks of 16.
LAYOUTS = [(1, 2, 19, 1, 3, 7), (23, 1, 1, 9, 2)]


def rows_of(ids: np.ndarray):
  """(start, stop) of each document of a row."""
  cuts = np.flatnonzero(np.diff(ids)) + 1
  return list(zip([0, *cuts], [*cuts, len(ids)]))


def id_batch(b, t):
  return np.stack([documents(t, LAYOUTS[i % len(LAYOUTS)]) for i in range(b)])


class Unpacked:
  """Every document of packed rows ids (B, T) as its own row (zero-padded at its end), and back:
  the separate-rows reference as one batched call (padding after a document changes none of its
  outputs: every form is causal)."""

  def __init__(self, ids: np.ndarray):
    docs = [(r, s, z) for r in range(ids.shape[0]) for s, z in rows_of(ids[r])]
    self.width = max(z - s for _, s, z in docs)
    pos = np.arange(self.width)
    self.valid = np.stack([pos < z - s for _, s, z in docs])
    self.row = np.stack([np.full(self.width, r) for r, _, _ in docs])
    self.col = np.stack([np.minimum(s + pos, z - 1) for _, s, z in docs])
    self.first = np.asarray([s == 0 for _, s, _ in docs])  # the row's first document
    self.doc = np.zeros(ids.shape, np.int64)
    self.at = np.zeros(ids.shape, np.int64)
    for i, (r, s, z) in enumerate(docs):
      self.doc[r, s:z], self.at[r, s:z] = i, np.arange(z - s)
    self.last = np.asarray([z == ids.shape[1] for _, _, z in docs])

  def split(self, x):
    """(B, T, ...) -> (documents, width, ...), zeros after each document."""
    y = x[self.row, self.col]
    return jnp.where(self.valid.reshape(self.valid.shape + (1,) * (x.ndim - 2)), y, 0)

  def join(self, y):
    """(documents, width, ...) -> (B, T, ...)."""
    return y[self.doc, self.at]


def separate_triadic(args, ids, *, erase, chunk_size, impl="scan"):
  """o and the final state with every document of every row run alone by ``impl``."""
  u = Unpacked(ids)
  *xs, h0 = args
  init = jnp.where(u.first[:, None, None, None, None], h0[u.row[:, 0]], 0.0)
  o, state = triadic.triadic_gdn(*map(u.split, xs), initial_state=init, erase=erase, impl=impl,
                                 chunk_size=chunk_size)
  return u.join(o), state[u.last]


def grads_of(fn, args, do, ds):
  def loss(*a):
    o, s = fn(a)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * ds), (o, s)
  return jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True)(*args)


TRIADIC_CASES = [
    # b, t, h, d, v, e, chunk, erase, decay, dtype, impl
    pytest.param(2, 45, 2, 8, 6, 1, 16, True, 1.0, jnp.float32, "scan", id="scan-E1"),
    pytest.param(2, 45, 2, 8, 6, 3, 16, True, 1.0, jnp.float32, "chunked", id="chunked-E3"),
    pytest.param(2, 45, 1, 8, 5, 2, 16, False, 1.0, jnp.float32, "chunked", id="chunked-noerase"),
    pytest.param(2, 45, 1, 8, 6, 2, 16, True, 20.0, jnp.float32, "chunked", id="chunked-strong"),
    pytest.param(2, 45, 1, 8, 6, 2, 16, True, 1.0, jnp.bfloat16, "chunked", id="chunked-bf16"),
    pytest.param(2, 40, 1, 16, 16, 2, 16, True, 1.0, jnp.float32, "pallas", id="pallas-E2"),
]


@pytest.mark.parametrize("b,t,h,d,vdim,e,chunk,erase,decay,dtype,impl", TRIADIC_CASES)
def test_triadic_documents_match_separate_rows(b, t, h, d, vdim, e, chunk, erase, decay, dtype,
                                               impl):
  args, do, ds = make_inputs(1, b, t, h, d, vdim, e, decay=decay, dtype=dtype)
  ids = id_batch(b, t)
  packed = lambda a: triadic.triadic_gdn(*a[:7], initial_state=a[7], erase=erase, impl=impl,
                                         chunk_size=chunk, segment_ids=jnp.asarray(ids))
  f32 = [x.astype(jnp.float32) for x in args]
  ref = lambda a: separate_triadic(a, ids, erase=erase, chunk_size=chunk)
  grads, (o, s) = jax.jit(lambda *a: grads_of(packed, a, do, ds))(*args)
  ref_grads, (o_ref, s_ref) = jax.jit(lambda *a: grads_of(ref, a, do, ds))(*f32)
  bound = 2e-2 if dtype == jnp.bfloat16 else 1e-4
  assert rel_rms(o, o_ref) < bound, rel_rms(o, o_ref)
  assert rel_rms(s, s_ref) < bound, rel_rms(s, s_ref)
  starts = np.pad(np.diff(ids, axis=1) != 0, ((0, 0), (1, 0)))
  for name, got, want in zip(("q", "k", "v", "k2", "q2", "g", "beta", "h0"), grads, ref_grads):
    assert np.all(np.isfinite(np.asarray(got, np.float32))), name
    assert rel_rms(got, want) < 2 * bound, f"d{name}: {rel_rms(got, want):.2e}"
  # The g of a document's first token multiplies a zero state: its gradient is exactly zero.
  assert np.all(np.asarray(grads[5], np.float32)[starts] == 0)


def test_reset_error_is_at_float32_rounding_with_many_resets_per_chunk():
  """One-token documents everywhere (64 resets in one chunk: the chunk-local cumulative sum of g
  reaches 64 * RESET): the chunked form still agrees with separate rows to float32 rounding."""
  b, t, h, d, vdim, e = 1, 64, 1, 8, 4, 2
  args, _, _ = make_inputs(2, b, t, h, d, vdim, e, decay=1.0, dtype=jnp.float32)
  ids = np.stack([documents(t, (1,)), documents(t, (1, 2, 1, 5))])
  args = [jnp.concatenate([x, x]) for x in args]
  o, s = jax.jit(lambda *a: triadic.triadic_gdn(
      *a[:7], initial_state=a[7], impl="chunked", chunk_size=64, segment_ids=jnp.asarray(ids)))(*args)
  o_ref, s_ref = jax.jit(lambda *a: separate_triadic(a, ids, erase=True, chunk_size=64))(*args)
  assert rel_rms(o, o_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5, (rel_rms(o, o_ref), rel_rms(s, s_ref))


def test_no_change_of_id_is_no_segment_ids():
  args, _, _ = make_inputs(3, 2, 20, 1, 8, 4, 2, decay=1.0, dtype=jnp.float32)
  run = jax.jit(lambda a, s: triadic.triadic_gdn(*a[:7], initial_state=a[7], impl="chunked",
                                                 chunk_size=16, segment_ids=s))
  plain = run(args, None)
  same = run(args, jnp.full((2, 20), 7, jnp.int32))
  for a, b in zip(plain, same):
    np.testing.assert_array_equal(a, b)


def test_bad_segment_ids_name_the_argument():
  args, _, _ = make_inputs(3, 2, 20, 1, 8, 4, 2, decay=1.0, dtype=jnp.float32)
  with pytest.raises(ValueError, match="segment_ids must have shape"):
    triadic.triadic_gdn(*args[:7], segment_ids=jnp.zeros((2, 19), jnp.int32))
  with pytest.raises(TypeError, match="segment_ids must be an integer"):
    triadic.triadic_gdn(*args[:7], segment_ids=jnp.zeros((2, 20), jnp.float32))


def multistate_inputs(seed, b, t, h, d, vdim, n):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  xs = [unit(rng.normal(size=(b, t, h, d))), unit(rng.normal(size=(b, t, h, d))),
        rng.normal(size=(b, t, h, vdim)), -rng.uniform(0.01, 1.0, size=(b, t, h)),
        rng.uniform(0.1, 0.9, size=(b, t, h)), rng.uniform(0.2, 1.5, size=(b, t, h, n))]
  return [jnp.asarray(x, jnp.float32) for x in xs], jnp.asarray(rng.normal(size=(b, t, h, vdim)),
                                                                jnp.float32)


@pytest.mark.parametrize("impl,erase,seg,chunk", [("scan", True, 4, 4), ("chunked", True, 8, 4),
                                                  ("chunked", False, 4, 4),
                                                  ("chunked", True, 16, 16)])
def test_multistate_documents_match_separate_rows(impl, erase, seg, chunk):
  b, t, h, d, vdim = 2, 45, 2, 6, 5
  n = -(-t // seg)
  args, do = multistate_inputs(4, b, t, h, d, vdim, n)
  ids = id_batch(b, t)

  def packed(a):
    return merlin.multistate_attention(*a, segment_len=seg, erase=erase, impl=impl,
                                       chunk_size=chunk, segment_ids=jnp.asarray(ids)), jnp.zeros(())

  u = Unpacked(ids)

  def separate(a):
    o = merlin.multistate_attention(*map(u.split, a), segment_len=seg, erase=erase, impl="scan")
    return u.join(o), jnp.zeros(())

  grads, (o, _) = jax.jit(lambda *a: grads_of(packed, a, do, 0.0))(*args)
  ref_grads, (o_ref, _) = jax.jit(lambda *a: grads_of(separate, a, do, 0.0))(*args)
  assert rel_rms(o, o_ref) < 1e-5, rel_rms(o, o_ref)
  for name, got, want in zip(("q", "k", "v", "g", "beta", "lam"), grads, ref_grads):
    assert rel_rms(got, want) < 1e-4, f"d{name}: {rel_rms(got, want):.2e}"


@pytest.mark.parametrize("kind", ["meanpool", "merlin", "position"])
def test_aggregators_count_segments_from_each_document(kind):
  b, t, h, r, seg, n = 2, 30, 2, 3, 4, 8
  rng = np.random.default_rng(5)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  qr, kr, p, gamma = f(b, t, h, r), f(b, t, h, r), f(b, t, h, n), jax.nn.sigmoid(f(b, t, h))
  tau = jnp.asarray([1.0, 2.0])
  common = dict(segment_len=seg, max_segments=n)

  def lam(x, ids):
    q_, k_, p_, g_ = x
    if kind == "position":
      return merlin.position_weights(p_, segment_len=seg, segment_ids=ids)
    if kind == "meanpool":
      return merlin.meanpool_weights(q_, k_, tau, segment_ids=ids, **common)
    return merlin.merlin_weights(q_, k_, g_, tau, 2 * tau, segment_ids=ids, **common)

  ids = id_batch(b, t)
  u = Unpacked(ids)
  got = lam((qr, kr, p, gamma), jnp.asarray(ids))
  want = u.join(lam(tuple(map(u.split, (qr, kr, p, gamma))), None))
  np.testing.assert_allclose(got, want, atol=1e-6)


MODEL = 16


def layer_config(mixer):
  # attention with QK-norm and per-document RoPE positions, as the paper configs have it
  return ModelConfig(vocab_size=32, num_layers=1, d_model=MODEL, num_heads=2, head_dim=8,
                     mlp_dim=32, mixer=mixer, expand_e=2, impl="chunked", chunk_size=4,
                     segment_len=4, max_segments=12, d_r=3, state_dim=6, qk_norm=True)


@pytest.mark.parametrize("mixer", ["attention", "triadic_gdn", "mamba2", "multistate_gdn",
                                   "multistate_mamba2"])  # gdn, triadic_sgla: triadic_gdn's module
def test_every_mixer_with_documents_matches_separate_rows(mixer):
  """Values and every parameter's gradient (the short convolutions' kernels included) of each
  mixer on packed rows equal those of the documents run as separate rows."""
  b, t = 2, 30
  layer = make_mixer(mixer, layer_config(mixer))
  x = jax.random.normal(jax.random.key(0), (b, t, MODEL))
  dy = jax.random.normal(jax.random.key(1), (b, t, MODEL))
  params = jax.jit(layer.init)(jax.random.key(2), x)
  ids = id_batch(b, t)
  u = Unpacked(ids)

  def packed(p):
    return jnp.sum(layer.apply(p, x, segment_ids=jnp.asarray(ids))[0] * dy)

  def separate(p):
    return jnp.sum(u.join(layer.apply(p, u.split(x))[0]) * dy)

  (value, got), (ref, want) = (jax.jit(jax.value_and_grad(f))(params) for f in (packed, separate))
  assert abs(value - ref) < 1e-4 * abs(ref)
  flat_got = jax.tree_util.tree_leaves_with_path(got)
  for (path, g), w in zip(flat_got, jax.tree.leaves(want)):
    assert rel_rms(g, w) < 1e-4, (jax.tree_util.keystr(path), rel_rms(g, w))
  names = [jax.tree_util.keystr(p) for p, _ in flat_got]
  assert mixer == "attention" or any("conv" in n for n in names)


def test_short_conv_masks_the_previous_document():
  conv = ShortConv(4, names=("c",))
  x = jax.random.normal(jax.random.key(0), (1, 6, 3))
  params = conv.init(jax.random.key(1), x)
  ids = jnp.asarray([[0, 0, 0, 1, 1, 2]])
  y, _ = conv.apply(params, x, segment_ids=ids)
  u = Unpacked(np.asarray(ids))
  np.testing.assert_allclose(y, u.join(conv.apply(params, u.split(x))[0]), atol=1e-6)


def test_lm_with_documents_matches_separate_rows():
  cfg = ModelConfig(vocab_size=32, num_layers=2, d_model=MODEL, num_heads=2, head_dim=8,
                    mlp_dim=32, layer_pattern="attention,triadic_gdn",
                    expand_e=2, impl="chunked", chunk_size=4, segment_len=4, max_segments=12,
                    d_r=3)
  model = LM(cfg)
  tokens = jax.random.randint(jax.random.key(0), (2, 30), 0, 32)
  params = jax.jit(model.init)(jax.random.key(1), tokens)
  ids = id_batch(2, 30)
  u = Unpacked(ids)
  logits = jax.jit(lambda p: model.apply(p, tokens, segment_ids=jnp.asarray(ids)))(params)
  assert rel_rms(logits, u.join(jax.jit(model.apply)(params, u.split(tokens)))) < 1e-5
