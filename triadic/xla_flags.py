"""A process-wide workaround for an XLA:CPU miscompile in jaxlib 0.10, for entry points to call.

With jaxlib 0.10.x on CPU, XLA's YNNPACK fusions return garbage (inf / NaN / 1e14, varying from
run to run, so likely uninitialised memory) for the chunked op when the sequence fits in one chunk
and only its output is used, e.g. ``jax.jit(lambda *a: triadic_gdn(*a)[0])`` at T <= 64: the eager
result and the same program with ``--xla_cpu_experimental_ynn_fusion_type=`` are correct
(``tests/test_triadic_ops.py::test_jit_of_the_output_alone`` catches it).

``apply_cpu_workaround()`` adds that flag to XLA_FLAGS unless the user set it. XLA reads the flags
when the backend is created, so a process calls it before its first computation (train.py,
eval.py, the benchmark scripts and tests/conftest.py do, first thing); if the backend is already
up, a warning says how to set it by hand. Importing ``triadic`` changes nothing: a library does
not set process-wide state. GPU and TPU compiles ignore the flag. Other jaxlib versions are left
alone (the flag may not exist there; an unknown flag is fatal).
"""

from __future__ import annotations

import os
import warnings

import jaxlib
from jax._src import xla_bridge

FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def apply_cpu_workaround() -> None:
  """Add ``FLAG`` to XLA_FLAGS on jaxlib 0.10 (see the module docstring)."""
  if not jaxlib.__version__.startswith("0.10."):
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_experimental_ynn_fusion_type" in flags:
    return  # the user chose
  if xla_bridge.backends_are_initialized():
    warnings.warn(f"triadic: jaxlib {jaxlib.__version__}'s CPU backend started before "
                  f"apply_cpu_workaround(); set XLA_FLAGS={FLAG} yourself to avoid an XLA:CPU "
                  f"miscompile (see triadic/xla_flags.py)", stacklevel=2)
    return
  os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
