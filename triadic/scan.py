"""The per-token recurrence of the triadic gated delta rule: the oracle every other impl is tested against.

Per batch row and head the state is S (E, D, V). For each token t (docs/spec.md section 1):

    S_e <- exp(g_te) S_e
    r_t  = sum_e k2_te S_e^T k_t
    u_t  = beta_t (v_t - r_t)          (erase)     or     beta_t v_t     (no erase)
    S_e <- S_e + k2_te k_t u_t^T
    o_t  = scale sum_e q2_te S_e^T q_t

``token_step`` is that one step; the scan runs it over T, and decoding runs it once per new token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_step(state, q, k, v, k2, q2, g, beta, *, scale: float, erase: bool):
  """One token, float32: state (B,H,E,D,V); q, k (B,H,D); v (B,H,V); k2, q2, g (B,H,E); beta (B,H)."""
  state = state * jnp.exp(g)[..., None, None]
  r = jnp.einsum("bhe,bhd,bhedv->bhv", k2, k, state)
  u = beta[..., None] * ((v - r) if erase else v)
  state = state + jnp.einsum("bhe,bhd,bhv->bhedv", k2, k, u)
  o = scale * jnp.einsum("bhe,bhd,bhedv->bhv", q2, q, state)
  return o, state


def triadic_scan(q, k, v, k2, q2, g, beta, *, scale: float, initial_state: jax.Array, erase: bool):
  """``jax.lax.scan`` of ``token_step`` over tokens. Shapes as ``triadic.triadic_gdn``."""
  time_major = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)

  def step(state, xs):
    o, state = token_step(state, *xs, scale=scale, erase=erase)
    return state, o

  final_state, o = jax.lax.scan(step, initial_state.astype(jnp.float32),
                                tuple(map(time_major, (q, k, v, k2, q2, g, beta))))
  return jnp.moveaxis(o, 0, 1), final_state
