"""The per-token recurrence of the triadic gated delta rule: the oracle every other impl is tested against.

Per batch row and head the state is S (E, D, V). For each token t (SPEC section 1):

    S_e <- exp(g_te) S_e
    r_t  = sum_e k2_te S_e^T k_t
    u_t  = beta_t (v_t - r_t)          (erase)     or     beta_t v_t     (no erase)
    S_e <- S_e + k2_te k_t u_t^T
    o_t  = scale sum_e q2_te S_e^T q_t
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def triadic_scan(q, k, v, k2, q2, g, beta, *, scale: float, initial_state: jax.Array, erase: bool):
  """``jax.lax.scan`` over tokens, float32 throughout. Shapes as ``triadic.triadic_gdn``."""
  f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # time-major
  xs = tuple(map(f32, (q, k, v, k2, q2, g, beta)))

  def step(state, x):
    q_t, k_t, v_t, k2_t, q2_t, g_t, beta_t = x  # (B,H,D) (B,H,D) (B,H,V) (B,H,E)x3 (B,H)
    state = state * jnp.exp(g_t)[..., None, None]
    r = jnp.einsum("bhe,bhd,bhedv->bhv", k2_t, k_t, state)
    u = beta_t[..., None] * ((v_t - r) if erase else v_t)
    state = state + jnp.einsum("bhe,bhd,bhv->bhedv", k2_t, k_t, u)
    o = scale * jnp.einsum("bhe,bhd,bhedv->bhv", q2_t, q_t, state)
    return state, o

  final_state, o = jax.lax.scan(step, initial_state.astype(jnp.float32), xs)
  return jnp.moveaxis(o, 0, 1), final_state
