"""Segment moments and aggregator weights against float64 NumPy loops over the sets J of docs/spec.md section 2.

Bounds: float32 scores and weights within 1e-5 relative RMS of the float64 loop (both the scan and
the parallel moments); gradients of the two implementations within 1e-4 of each other.
The parallel form's second moments of finished segments run a block of queries at a time: its
scores and gradients match the scan's with several blocks, and its compiled temporary memory at
a long T stays far below the (B, T, G, N, R) product that a single block would hold.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import merlin.moments
from merlin import meanpool_weights, merlin_weights, moment_scores, position_weights
from testkit import rel_rms as rel

B, T, H, R, L, N = 2, 29, 3, 5, 6, 7  # 29 tokens: 4 full segments of 6 and a partial fifth
IMPLS = ["scan", "parallel"]


def numpy_scores(qr, kr, segment_len, n):
  """r_mu, r_sigma (B, T, G, N) from the definition: moments over J = {j <= t : s(j) = i}."""
  qr, kr = np.asarray(qr, np.float64), np.asarray(kr, np.float64)
  b, t, grp, _ = qr.shape
  r_mu, r_sigma = np.zeros((b, t, grp, n)), np.zeros((b, t, grp, n))
  for bi in range(b):
    for gi in range(grp):
      for ti in range(t):
        for i in range(ti // segment_len + 1):
          keys = kr[bi, [j for j in range(ti + 1) if j // segment_len == i], gi]
          mu, sigma = keys.mean(0), keys.T @ keys / len(keys)
          qt = qr[bi, ti, gi]
          r_mu[bi, ti, gi, i] = mu @ qt
          r_sigma[bi, ti, gi, i] = qt @ sigma @ qt - (mu @ qt) ** 2
  return r_mu, r_sigma


def numpy_softmax(x, mask):
  x = np.where(mask, x, -np.inf)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def make_inputs(seed, groups=H):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  qr = jax.random.normal(ks[0], (B, T, groups, R))
  kr = jax.random.normal(ks[1], (B, T, groups, R))
  gamma = jax.nn.sigmoid(jax.random.normal(ks[2], (B, T, H)))
  tau_mu = jnp.exp(jax.random.normal(ks[3], (H,)) * 0.3)
  tau_sigma = jnp.exp(jax.random.normal(ks[4], (H,)) * 0.3) * 0.3
  return qr, kr, gamma, tau_mu, tau_sigma


VISIBLE = (np.arange(N)[None, :] <= (np.arange(T) // L)[:, None])[None, :, None, :]  # (1, T, 1, N)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("groups", [H, 1])
def test_scores_match_numpy(impl, groups):
  qr, kr, *_ = make_inputs(0, groups)
  want_mu, want_sigma = numpy_scores(qr, kr, L, N)
  got_mu, got_sigma = moment_scores(qr, kr, segment_len=L, num_segments=N, impl=impl)
  assert got_mu.shape == got_sigma.shape == (B, T, groups, N)
  assert rel(got_mu, want_mu) < 1e-5 and rel(got_sigma, want_sigma) < 1e-5
  hidden = np.broadcast_to(~VISIBLE, got_mu.shape)
  assert np.all(np.asarray(got_mu)[hidden] == 0) and np.all(np.asarray(got_sigma)[hidden] == 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("groups", [H, 1])
def test_weights_match_numpy(impl, groups):
  qr, kr, gamma, tau_mu, tau_sigma = make_inputs(1, groups)
  r_mu, r_sigma = numpy_scores(qr, kr, L, N)
  tau_mu_, tau_sigma_ = (np.asarray(x, np.float64)[:, None] for x in (tau_mu, tau_sigma))
  soft_mu = numpy_softmax(tau_mu_ * r_mu, VISIBLE)
  soft_sigma = numpy_softmax(tau_sigma_ * r_sigma, VISIBLE)
  gam = np.asarray(gamma, np.float64)[..., None]
  want = {"meanpool": soft_mu, "merlin": gam * soft_mu + (1 - gam) * soft_sigma}
  got = {"meanpool": meanpool_weights(qr, kr, tau_mu, segment_len=L, max_segments=N, impl=impl),
         "merlin": merlin_weights(qr, kr, gamma, tau_mu, tau_sigma, segment_len=L, max_segments=N,
                                  impl=impl)}
  for name in want:
    assert got[name].shape == (B, T, H, N), name
    assert rel(got[name], want[name]) < 1e-5, name
    np.testing.assert_allclose(np.asarray(got[name]).sum(-1), 1.0, rtol=1e-5)


def test_position_weights_match_numpy():
  p = jax.random.normal(jax.random.PRNGKey(2), (B, T, H, N)) * 2
  pn = np.asarray(p, np.float64)
  want = np.zeros((B, T, H, N))
  for ti in range(T):
    for i in range(ti // L + 1):
      want[:, ti, :, i] = np.log1p(np.exp(pn[:, ti, :, ti // L - i]))
  assert rel(position_weights(p, segment_len=L), want) < 1e-6


def test_identical_keys_have_zero_variance():
  """A segment whose keys are all equal has r_sigma = 0 for every query, finished or current.

  r_sigma = q'^T Sigma q' - r_mu^2 is a difference of two terms of size up to |q'|^2 |k'|^2, so
  float32 leaves a few ulps of that scale (seen: 1.4e-7 of it, 1.1e-5 absolute, on an AMD EPYC
  CPU where an absolute 1e-5 bound failed): the bound is 8 float32 epsilons of it per token."""
  qr, kr, *_ = make_inputs(3)
  kr = kr.at[:, L:2 * L].set(kr[:, L:L + 1])  # segment 1: L copies of one key
  scale = np.sum(np.asarray(qr[:, L:]) ** 2, -1) * np.sum(np.asarray(kr[:, L:L + 1]) ** 2, -1)
  for impl in IMPLS:
    _, r_sigma = moment_scores(qr, kr, segment_len=L, num_segments=N, impl=impl)
    bound = 8 * np.finfo(np.float32).eps * scale
    assert np.all(np.abs(np.asarray(r_sigma[:, L:, :, 1])) <= bound), impl
    assert np.abs(np.asarray(r_sigma[:, 2 * L:, :, 0])).min() > 1e-4, impl  # segment 0 is spread


@pytest.mark.parametrize("impl", IMPLS)
def test_permuting_a_finished_segment_leaves_later_weights(impl):
  qr, kr, gamma, tau_mu, tau_sigma = make_inputs(4)
  perm = np.r_[np.arange(L), L + np.random.default_rng(0).permutation(L), np.arange(2 * L, T)]
  kw = dict(segment_len=L, max_segments=N, impl=impl)
  before = merlin_weights(qr, kr, gamma, tau_mu, tau_sigma, **kw)
  after = merlin_weights(qr[:, perm], kr[:, perm], gamma, tau_mu, tau_sigma, **kw)
  np.testing.assert_allclose(after[:, 2 * L:], before[:, 2 * L:], rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(after[:, L:2 * L] - before[:, L:2 * L])).max() > 1e-4  # causal inside


def test_parallel_and_scan_gradients_agree():
  qr, kr, gamma, tau_mu, tau_sigma = make_inputs(5)
  cot = jax.random.normal(jax.random.PRNGKey(6), (B, T, H, N))
  grads = {}
  for impl in IMPLS:
    f = lambda *a: jnp.sum(cot * merlin_weights(*a, segment_len=L, max_segments=N, impl=impl))
    grads[impl] = jax.grad(f, argnums=tuple(range(5)))(qr, kr, gamma, tau_mu, tau_sigma)
  for name, a, b in zip("qr kr gamma tau_mu tau_sigma".split(), grads["parallel"], grads["scan"]):
    assert rel(a, b) < 1e-4, name


@pytest.mark.parametrize("groups", [H, 1])
@pytest.mark.parametrize("block_elements", [None, 200])
def test_blocked_parallel_matches_scan(groups, block_elements, monkeypatch):
  """moment_scores, parallel against scan: scores and gradients (both inputs, both outputs).
  The default makes one block at these sizes; 200 elements a block of B * G * 5 * R a token (5
  segments used) are blocks of 4 tokens at G = 1 (neither dividing T nor aligned with the
  segments) and of 1 token at G = 3."""
  if block_elements is not None:
    monkeypatch.setattr(merlin.moments, "BLOCK_ELEMENTS", block_elements)
  ks = jax.random.split(jax.random.PRNGKey(8), 4)
  qr, kr = (jax.random.normal(k, (B, T, groups, R)) for k in ks[:2])
  cots = [jax.random.normal(k, (B, T, groups, N)) for k in ks[2:]]
  got, grads = {}, {}
  for impl in IMPLS:
    f = lambda q, k: moment_scores(q, k, segment_len=L, num_segments=N, impl=impl)
    got[impl] = f(qr, kr)
    loss = lambda q, k: sum(jnp.sum(c * x) for c, x in zip(cots, f(q, k)))
    grads[impl] = jax.grad(loss, argnums=(0, 1))(qr, kr)
  for name, a, b in zip(["r_mu", "r_sigma", "d qr", "d kr"], got["parallel"] + grads["parallel"],
                        got["scan"] + grads["scan"]):
    assert rel(a, b) < (1e-5 if name.startswith("r_") else 1e-4), name


def test_parallel_memory_is_linear_in_t():
  """At B = 1, T = 65536, G = 2, N = 256, R = 128 the (B, T, G, N, R) product q_t^T M2_i is 17 GB;
  the compiled forward and gradient keep temporaries under a tenth of it (one block of the product
  and a few (B, T, G, N) arrays). Compiled from shapes only: nothing runs."""
  b, t, grp, n, r = 1, 65536, 2, 256, 128
  x = jax.ShapeDtypeStruct((b, t, grp, r), jnp.float32)
  f = lambda q, k: moment_scores(q, k, segment_len=t // n, num_segments=n, impl="parallel")
  loss = lambda q, k: sum(jnp.sum(y) for y in f(q, k))
  product = b * t * grp * n * r * 4
  for fn in (f, jax.grad(loss, argnums=(0, 1))):
    temp = jax.jit(fn).lower(x, x).compile().memory_analysis().temp_size_in_bytes
    assert temp < product / 10, (fn, temp, product)


def test_bad_input_raises():
  qr, kr, gamma, tau_mu, tau_sigma = make_inputs(7)
  kw = dict(segment_len=L, max_segments=N)
  with pytest.raises(ValueError, match="T must be <= max_segments"):
    merlin_weights(qr, kr, gamma, tau_mu, tau_sigma, segment_len=L, max_segments=4)
  with pytest.raises(ValueError, match="kr must have the shape of qr"):
    meanpool_weights(qr, kr[..., :2], tau_mu, **kw)
  with pytest.raises(ValueError, match="gamma must have shape"):
    merlin_weights(qr, kr, gamma[..., :1], tau_mu, tau_sigma, **kw)
  with pytest.raises(ValueError, match="tau_sigma must have shape"):
    merlin_weights(qr, kr, gamma, tau_mu, tau_sigma[:2], **kw)
  with pytest.raises(ValueError, match="H = 2 heads"):
    meanpool_weights(qr, kr, tau_mu[:2], **kw)
  with pytest.raises(ValueError, match="impl must be one of"):
    meanpool_weights(qr, kr, tau_mu, impl="chunked", **kw)
  with pytest.raises(ValueError, match="T must be <= p.shape"):
    position_weights(jnp.zeros((B, T, H, 4)), segment_len=L)
