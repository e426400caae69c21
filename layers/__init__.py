"""Building blocks shared by the triadic, multi-state and LM code (neither method's own package).

``layers.blocks``: RMSNorm, ``dense`` (DenseGeneral with logical axis names), ShortConv (causal
depthwise convolution; ``causal_conv`` its pure function), ``Param`` (one named parameter, for
projections fused at call time), ``l2norm``, ``softplus_inverse``. ``layers.gdn``: the decay gate and the
Gated-DeltaNet input / output projections (``gdn_inputs``, ``gdn_output``, ``gdn_cache``).
``layers.remat``: ``saved_op``, which names a mixing op's forward for ``jax.checkpoint`` policies.
``layers.conv_kernel``: ``causal_conv``'s Pallas kernels and ``choose_impl``, which decides
between them and XLA. ``layers.partition``: ``batch_head_partitioned``, which runs a Pallas kernel
per (batch, head) shard under jit (custom_partitioning). ``layers.platform``: ``default_platform``,
the platform every op's Pallas kernels are built for.
"""

from layers.blocks import Param, RMSNorm, ShortConv, causal_conv, dense, l2norm, softplus_inverse
from layers.gdn import DecayGate, a_log_init, dt_bias_init, gdn_cache, gdn_inputs, gdn_output
from layers.remat import saved_op

__all__ = ["Param", "RMSNorm", "ShortConv", "causal_conv", "dense", "l2norm", "softplus_inverse",
           "DecayGate", "a_log_init", "dt_bias_init", "gdn_cache", "gdn_inputs", "gdn_output", "saved_op"]
