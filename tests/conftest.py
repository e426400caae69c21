"""Import triadic before any test computes: it sets an XLA:CPU flag that must precede the CPU
backend's start (see triadic/_xla_cpu.py)."""

import triadic  # noqa: F401
