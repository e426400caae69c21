"""``TriadicGDN``: the triadic gated delta rule as its authors built the layer (docs/spec.md section 1).

x -> q, k, v (H x D, H x D, H x V) and k2, q2 (H x E) -> causal depthwise conv (width 4) on all
of them, SiLU on q, k, v -> q, k l2-normalised over D; k2, q2 = l2norm_E(softplus(.)) ->
per-slice decay g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(.) -> triadic_gdn ->
RMSNorm(o) * sigmoid(gate), the gate a rank-128 projection of x (x -> 128 -> H x V, with bias) ->
output projection. E = 1 drops k2/q2 (they are 1): Gated DeltaNet.

Parameters are separate kernels per stream so that a checkpoint of an E = 1 model maps onto an
E = 8 one by name: the q, k, v, gate, beta and output kernels carry over, the decay parameters
(shape (.., H, 1)) broadcast along E, and k2/q2 are new. The call concatenates them: q, k, v, k2,
q2 come from one matmul and one depthwise convolution, as in the paper (``layers.gdn.gdn_inputs``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from layers.blocks import check_sizes
from layers.gdn import A_MIN, gdn_cache, gdn_inputs, gdn_output
from triadic.ops import triadic_gdn, triadic_gdn_step
from layers.remat import saved_op


_SIZES = ("num_heads", "head_dim", "value_dim", "num_v_heads", "expand_e", "conv_width", "chunk_size")


class TriadicGDN(nn.Module):
  """Triadic Gated DeltaNet (``erase=True``) or Triadic sGLA (``erase=False``) mixer.

  Input and output (B, T, d_model). ``expand_e`` = E; E = 1 is Gated DeltaNet / Mamba-2's SSD core.
  ``gate_rank``: the output gate's rank (the authors' 128; 0: a full-rank gate, ``gdn_output``).
  ``a_min``: the decay's A ~ U(a_min, 16) at init (the authors' U(0, 16) by default; Mamba-2's
  U(1, 16) with 1.0).
  ``value_dim``: V, each state's value width (None: head_dim, the key width D).
  ``num_v_heads``: grouped value heads (FLA's GVA; None: num_heads), a multiple G of num_heads:
  num_v_heads states, each with its own v, decay and beta, the G of a group reading and writing
  with their key head's q, k (``gdn_inputs``).
  """

  num_heads: int
  head_dim: int
  value_dim: int | None = None
  num_v_heads: int | None = None
  expand_e: int = 1
  erase: bool = True
  conv_width: int = 4
  conv_impl: str = "auto"
  gate_rank: int = 128
  a_min: float = A_MIN
  impl: str = "auto"
  chunk_size: int = 64
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, cache: dict | None = None, segment_ids=None):
    """``(y, new_cache)``, x and y (B, T, d_model). ``segment_ids`` (B, T) (training only): packed
    documents, each computed as if it were its own row (``triadic_gdn``'s contract; the short
    convolutions do not reach across a document start).

    Training passes no cache and gets None back. With ``cache`` (from ``init_cache``, or returned by
    an earlier call) the layer continues a sequence: T > 1 runs the parallel form (chunked /
    Pallas) from the cached state (prefill), T = 1 the one-token recurrence (decode). Same
    parameters either way, so a trained checkpoint decodes.
    """
    check_sizes(self, *_SIZES)
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    (q, k, v, k2, q2, g, beta), conv = gdn_inputs(
        x, self.num_heads, self.head_dim, self.value_dim, self.expand_e, self.conv_width,
        a_min=self.a_min, conv_cache=None if cache is None else cache["conv"],
        segment_ids=segment_ids, num_v_heads=self.num_v_heads, conv_impl=self.conv_impl, **kw)
    ops = dict(erase=self.erase, impl=self.impl, chunk_size=self.chunk_size)
    if cache is None:
      op = lambda *z: triadic_gdn(*z[:-1], segment_ids=z[-1], **ops)[0]
      o = saved_op(op)(q, k, v, k2, q2, g, beta, segment_ids)  # named for remat="save_mixer_op"
      return gdn_output(o, x, self.gate_rank, **kw), None
    if x.shape[1] == 1:
      o, state = triadic_gdn_step(cache["state"], *(z[:, 0] for z in (q, k, v, k2, q2, g, beta)),
                                  erase=self.erase)
      o = o[:, None]
    else:
      o, state = triadic_gdn(q, k, v, k2, q2, g, beta, initial_state=cache["state"], **ops)
    return gdn_output(o, x, self.gate_rank, **kw), {"state": state, "conv": conv}

  def init_cache(self, batch: int, max_len: int | None = None) -> dict:
    """The empty decoding cache: the recurrent state (B, num_v_heads, E, D, V) float32 (zeros)
    and, per short convolution, its last conv_width - 1 inputs. ``max_len`` is unused (the cost
    is constant)."""
    del max_len
    check_sizes(self, *_SIZES)
    return gdn_cache(batch, self.num_heads, self.head_dim, self.value_dim, self.expand_e,
                     self.conv_width, self.dtype, num_v_heads=self.num_v_heads)
