"""The Pallas kernels behind ``multistate_attention(..., impl="pallas")`` (``ops.py``), and the
one place that decides which impl runs (``plan.py``)."""
