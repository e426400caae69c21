"""Triadic linear attention: a 3-D recurrent state (E x D x V per head).

``triadic_gdn`` is the op (scan oracle, chunked JAX, Pallas kernels behind one ``impl`` switch);
``TriadicGDN`` is the Flax Linen layer.
"""

from triadic import _xla_cpu

_xla_cpu.apply()

from layers.gdn import DecayGate  # noqa: E402
from triadic.layer import TriadicGDN  # noqa: E402
from triadic.ops import triadic_gdn, triadic_gdn_step  # noqa: E402

__all__ = ["triadic_gdn", "triadic_gdn_step", "TriadicGDN", "DecayGate"]
