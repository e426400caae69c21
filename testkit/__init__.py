"""What the tests and the benchmarks share (neither imports the other): the float64 NumPy oracles
of the triadic op (``testkit.triadic_reference``), its random inputs and pallas-vs-scan check
(``testkit.triadic``), the error measure every bound is stated in (``rel_rms``) and the run of a
script on fake CPU devices in a subprocess (``testkit.devices``)."""

from testkit.metrics import rel_rms

__all__ = ["rel_rms"]
