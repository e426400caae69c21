"""multistate_attention against an independent float64 NumPy loop, the triadic op, and itself.

Error bounds (relative RMS, ||a - b|| / ||b||): float32 outputs 1e-5 and gradients 1e-4 (chunked
vs scan do the same float32 math in a different order); bfloat16 inputs 2e-2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import triadic
from merlin import multistate_attention
from testkit import rel_rms as rel

B, T, H, D, V, L, N = 2, 37, 2, 8, 6, 8, 6  # 37 tokens: 4 full segments and a partial fifth


def make_inputs(seed, t=T, n=N, g_scale=0.5):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(ks[0], (B, t, H, D)))
  k = unit(jax.random.normal(ks[1], (B, t, H, D)))
  v = jax.random.normal(ks[2], (B, t, H, V))
  g = -g_scale * jax.random.uniform(ks[3], (B, t, H))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, t, H)))
  lam = jax.random.uniform(ks[5], (B, t, H, n), minval=0.1, maxval=2.0)
  return q, k, v, g, beta, lam


def numpy_loop(q, k, v, g, beta, lam, segment_len, erase, scale):
  """docs/spec.md section 2 written out token by token in float64, one (batch, head) at a time."""
  q, k, v, g, beta, lam = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, lam))
  b, t, h, d = q.shape
  n = lam.shape[-1]
  o = np.zeros(v.shape)
  for bi in range(b):
    for hi in range(h):
      states = np.zeros((n, d, v.shape[-1]))
      for ti in range(t):
        kt, seg = k[bi, ti, hi], ti // segment_len
        for i in range(n):
          states[i] *= np.exp(g[bi, ti, hi])
          if erase:
            states[i] -= beta[bi, ti, hi] * np.outer(kt, kt @ states[i])
        states[seg] += beta[bi, ti, hi] * np.outer(kt, v[bi, ti, hi])
        o[bi, ti, hi] = scale * sum(lam[bi, ti, hi, i] * states[i].T @ q[bi, ti, hi]
                                    for i in range(seg + 1))
  return o


@pytest.mark.parametrize("erase", [True, False])
def test_matches_numpy_loop(erase):
  q, k, v, g, beta, lam = make_inputs(0)
  want = numpy_loop(q, k, v, g, beta, lam, L, erase, D ** -0.5)
  # Entries for segments not yet started are ignored, even if they are NaN.
  future = np.arange(N)[None, :] > (np.arange(T) // L)[:, None]
  lam_nan = jnp.where(future[None, :, None, :], jnp.nan, lam)
  # chunk 2, 4, 8: four, two and one chunks a segment (a span of the chunked form)
  for impl, chunk in (("scan", None), ("chunked", 2), ("chunked", 4), ("chunked", 8),
                      ("auto", None)):
    got = multistate_attention(q, k, v, g, beta, lam_nan, segment_len=L, erase=erase, impl=impl,
                               chunk_size=chunk)
    assert got.shape == (B, T, H, V) and got.dtype == jnp.float32
    assert rel(got, want) < 1e-5, (impl, chunk)


def test_bfloat16_inputs():
  q, k, v, g, beta, lam = make_inputs(1)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  want = numpy_loop(q, k, v, g, beta, lam, L, True, 0.5)
  got = multistate_attention(q, k, v, g, beta, lam, segment_len=L, scale=0.5, chunk_size=4)
  assert got.dtype == jnp.bfloat16
  assert rel(got, want) < 2e-2


@pytest.mark.parametrize("erase", [True, False])
@pytest.mark.parametrize("triadic_impl", ["scan", "chunked"])
def test_lam_one_is_single_state(erase, triadic_impl):
  """lam = 1 sums the segment states back into Gated DeltaNet (erase) / Mamba-2's SSD (no erase)."""
  q, k, v, g, beta, _ = make_inputs(2)
  ones = jnp.ones((B, T, H, 1))
  want, _ = triadic.triadic_gdn(q, k, v, ones, ones, g[..., None], beta, erase=erase,
                                impl=triadic_impl, chunk_size=8)
  lam = jnp.ones((B, T, H, N))
  for impl in ("scan", "chunked"):
    got = multistate_attention(q, k, v, g, beta, lam, segment_len=L, erase=erase, impl=impl,
                               chunk_size=4)
    assert rel(got, want) < 1e-5, impl


@pytest.mark.parametrize("chunk", [2, 4])
@pytest.mark.parametrize("erase", [True, False])
def test_chunked_gradients_match_scan(erase, chunk):
  args = make_inputs(3, t=21, n=3)
  cot = jax.random.normal(jax.random.PRNGKey(9), (B, 21, H, V))

  def loss(impl):
    f = lambda *a: jnp.sum(cot * multistate_attention(*a, segment_len=L, erase=erase, impl=impl,
                                                       chunk_size=chunk))
    return jax.jit(jax.grad(f, argnums=tuple(range(6))))(*args)

  for name, got, want in zip("q k v g beta lam".split(), loss("chunked"), loss("scan")):
    assert rel(got, want) < 1e-4, name
    assert np.linalg.norm(np.asarray(want)) > 0, name


@pytest.mark.parametrize("chunk", [4, 8])
def test_strong_decay_stays_finite(chunk):
  """Exponents are later-minus-earlier differences: g = -30 per token overflows nothing, also in
  a span's walked query and composite map (chunk 4: two chunks a segment)."""
  q, k, v, _, beta, lam = make_inputs(4, t=19, n=3)
  g = -30.0 * jnp.ones((B, 19, H))
  want = numpy_loop(q, k, v, g, beta, lam, L, True, D ** -0.5)
  f = lambda g: multistate_attention(q, k, v, g, beta, lam, segment_len=L, chunk_size=chunk)
  assert rel(f(g), want) < 1e-5
  grad = jax.grad(lambda g: jnp.sum(f(g)))(g)
  assert np.all(np.isfinite(np.asarray(grad)))


def test_bad_input_raises():
  q, k, v, g, beta, lam = make_inputs(5)
  call = lambda **kw: multistate_attention(
      kw.get("q", q), k, kw.get("v", v), kw.get("g", g), beta, kw.get("lam", lam),
      segment_len=kw.get("segment_len", L), impl=kw.get("impl", "auto"),
      chunk_size=kw.get("chunk_size"))
  with pytest.raises(ValueError, match="T must be <="):
    call(lam=lam[..., :4])  # 37 tokens need 5 segments of 8
  with pytest.raises(ValueError, match="chunk_size must be a positive int dividing segment_len"):
    call(chunk_size=3)
  with pytest.raises(ValueError, match="lam must have shape"):
    call(lam=lam[:, :5])
  with pytest.raises(ValueError, match="v must have shape"):
    call(v=v[:, :, :1])
  with pytest.raises(ValueError, match="g must have rank 3"):
    call(g=g[..., None])
  with pytest.raises(ValueError, match="g is a log decay"):
    call(g=-g)
  with pytest.raises(ValueError, match="impl must be one of"):
    call(impl="triton")
  with pytest.raises(ValueError, match="segment_len must be a positive int"):
    call(segment_len=0)
