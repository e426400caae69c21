"""What the tests and the benchmarks share (neither imports the other): the float64 NumPy oracles
of the triadic op (``testkit.triadic_reference``), its random inputs and pallas-vs-scan check
(``testkit.triadic``) and the error measure every bound is stated in (``rel_rms``)."""

from testkit.metrics import rel_rms

__all__ = ["rel_rms"]
