"""Triadic linear attention: a 3-D recurrent state (E x D x V per head).

``triadic_gdn`` is the op (scan oracle, chunked JAX, Pallas kernels behind one ``impl`` switch);
``TriadicGDN`` is the Flax Linen layer. Processes on jaxlib 0.10's CPU backend call
``triadic.xla_flags.apply_cpu_workaround()`` before computing (the entry points do).
"""

from layers.gdn import DecayGate
from triadic.layer import TriadicGDN
from triadic.ops import triadic_gdn, triadic_gdn_step

__all__ = ["triadic_gdn", "triadic_gdn_step", "TriadicGDN", "DecayGate"]
