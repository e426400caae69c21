"""A process-wide workaround for an XLA:CPU miscompile in jaxlib 0.10 (imported by ``triadic``).

With jaxlib 0.10.x on CPU, XLA's YNNPACK fusions return garbage (inf / NaN / 1e14, varying from
run to run, so likely uninitialised memory) for the chunked op when the sequence fits in one chunk
and only its output is used, e.g. ``jax.jit(lambda *a: triadic_gdn(*a)[0])`` at T <= 64: the eager
result and the same program with ``--xla_cpu_experimental_ynn_fusion_type=`` are correct (seen on
2026-12-01; ``tests/test_triadic_ops.py::test_jit_of_the_output_alone`` catches it). So, unless
the user set that flag themselves, it is added to XLA_FLAGS before the CPU backend starts. XLA
reads the flags when the backend is created, so this must run before the first computation; if the
backend is already up, a warning says how to set it by hand. GPU and TPU compiles ignore the flag.
Other jaxlib versions are left alone (the flag may not exist there; an unknown flag is fatal).
"""

from __future__ import annotations

import os
import warnings

import jaxlib
from jax._src import xla_bridge

FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def apply() -> None:
  if not jaxlib.__version__.startswith("0.10."):
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_cpu_experimental_ynn_fusion_type" in flags:
    return  # the user chose
  if xla_bridge.backends_are_initialized():
    warnings.warn(f"triadic: jaxlib {jaxlib.__version__}'s CPU backend started before triadic was "
                  f"imported; set XLA_FLAGS={FLAG} yourself to avoid an XLA:CPU miscompile "
                  f"(see triadic/_xla_cpu.py)", stacklevel=3)
    return
  os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
