"""Test-process set-up, before any test computes.

- ``apply_cpu_workaround()``: an XLA:CPU flag that must precede the CPU backend's start (see
  triadic/xla_flags.py).
- XLA:CPU compiles without LLVM's optimisations (``--xla_backend_optimization_level=0``; the HLO
  passes, fusion included, still run), emits its fusions as LLVM IR directly instead of through
  the MLIR fusion emitters (``--xla_cpu_use_fusion_emitters=false``: compiles take less than
  half the CPU time) and codegens each program in one piece
  (``--xla_cpu_parallel_codegen_split_count=1``: the per-split threads only contend with the
  other xdist worker for the 2 cores): the suite's programs are small and mostly run a few
  times, so compiling is most of its time on the 2-core CI machine. Every bound holds with and
  without the flags; they are set on jaxlib 0.10.x only, where they were measured.
- Compiled programs go to a persistent compilation cache private to this process (one per xdist
  worker, so no two processes write one file; removed at exit): many tests compile the same
  program again (every ``train_loop.train`` call builds its own jitted step; the preemption test
  trains three times). The flags' and the cache's effect on the suite's time:
  benchmarks/RESULTS.md ("Test suite on the 2-core CPU").
- The Mosaic GPU interpreter runs a kernel of several threads (two warpgroups) by handing each
  thread's body, one jaxpr for the whole kernel, to ``thread_map._run_jaxpr``, which traces,
  lowers and compiles it again for every thread of every grid point (a fresh ``jax.jit`` each
  call: nothing cached). ``_compile_thread_bodies_once`` has it compile each body once and run
  that executable for every thread and grid point: the same program on the same operands, so
  the kernels compute what they did. Without that private function (another JAX) it does
  nothing.
- The Mosaic GPU interpreter simulates SMEM, TMA copies, barriers and wgmma in host callbacks
  (``gpu_callbacks``) that work on numpy: reads and writes of its simulated memory, allocation
  keys, indices. ``io_callback`` hands each callback its operands as jax Arrays (a
  ``device_put`` of every operand) and the callbacks build their results, and take their
  integers apart, with eager jax.numpy ops (``jnp.array`` of a list of ints, ``int`` of each
  element of a jax Array): dispatch overhead that was most of the interpreted kernels' time.
  ``_numpy_interpreter_callbacks`` hands those callbacks (and only those) numpy copies of their
  operands and has their ``jnp.array`` / ``jnp.int32`` be numpy's: the same values in and out,
  the same simulated memory, so the kernels compute the same bits (the heads-layout tests
  still compare outputs bit for bit against the default layout's). Without the private
  functions it does nothing.
- Python's cyclic garbage collector runs less often (``gc.set_threshold``, below): tracing and
  lowering allocate millions of short-lived objects, and at the default thresholds (700, 10, 10)
  a full collection, over the process's whole heap (JAX, jaxprs, caches: about 0.25 s each),
  could follow every 70,000 net allocations. On twelve of the longest tests in one process the
  collector took 7.8 of about 90 CPU-seconds (6.4 in 25 full collections); at (10,000, 20, 20)
  2.5 (1.3 in 6). Only when the collector runs changes; full collections still run.
- The files that hold the longest tests are collected first (``FIRST``, longest single test
  first), so that pytest-xdist hands them out at the start and its two workers finish together,
  instead of one of them starting a 30-50 s test when the other has nothing left; with its
  worksteal scheduling (pyproject.toml) a worker that runs out takes the other's queued tests.

Subprocesses started by tests (tests/test_train_distributed.py) inherit XLA_FLAGS."""

import atexit
import functools
import gc
import os
import shutil
import tempfile
import threading
from importlib.metadata import version

# The three compile-time flags, where they were measured (jaxlib 0.10.x: the CI's): XLA aborts on
# a flag it does not know, and another jaxlib may have dropped one.
if version("jaxlib").startswith("0.10."):
  os.environ["XLA_FLAGS"] = " ".join(
      (os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
       "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")).strip()

import jax  # noqa: E402

from triadic.xla_flags import apply_cpu_workaround  # noqa: E402

apply_cpu_workaround()


def _compile_thread_bodies_once():
  """The module docstring's third point: each thread body compiled once, then run."""
  try:
    from jax._src.pallas.mosaic.interpret import thread_map
  except ImportError:
    return
  if not callable(getattr(thread_map, "_run_jaxpr", None)):
    return

  def run(jaxpr, consts, *args):
    jax.core.eval_jaxpr(jaxpr, consts, *args)

  @functools.lru_cache(maxsize=8)
  def compiled(jaxpr, const_avals, arg_avals):
    return jax.jit(run, static_argnums=0).trace(jaxpr, list(const_avals), *arg_avals).lower(
        ).compile()

  lock = threading.Lock()   # the kernel's threads ask at once: one compiles, the others wait
  aval = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)

  def run_jaxpr(jaxpr, consts, *args):
    with lock:
      executable = compiled(jaxpr, tuple(map(aval, consts)), tuple(map(aval, args)))
    executable(list(consts), *args)

  thread_map._run_jaxpr = run_jaxpr


_compile_thread_bodies_once()


def _numpy_interpreter_callbacks():
  """The Mosaic GPU interpreter's callbacks on numpy (the module docstring)."""
  try:
    import numpy as np
    from jax._src import callback as callback_lib
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  except ImportError:
    return
  impl = getattr(callback_lib, "io_callback_impl", None)
  jnp = getattr(gpu_callbacks, "jnp", None)
  if not callable(impl) or jnp is None:
    return

  class NumpyArrays:
    """``gpu_callbacks``' ``jnp``: ``array`` and ``int32`` numpy's, every other name jnp's."""
    array = staticmethod(np.array)
    int32 = np.int32

    def __getattr__(self, name):
      return getattr(jnp, name)

  def io_callback_impl(*args, callback, **params):
    func = callback.callback_func
    if getattr(getattr(func, "func", func), "__module__", None) != gpu_callbacks.__name__:
      return impl(*args, callback=callback, **params)
    # Copies: an operand may be a view of a buffer that XLA reuses after the callback.
    return jax.tree.map(np.asarray, callback(*(np.array(x) for x in args)))

  gpu_callbacks.jnp = NumpyArrays()
  callback_lib.io_callback_impl = io_callback_impl


_numpy_interpreter_callbacks()

# The garbage collector (the module docstring): generation 0 collected every 10,000 net
# allocations (not 700), a full collection after 20 x 20 of those (not 10 x 10).
gc.set_threshold(10_000, 20, 20)

_CACHE = tempfile.mkdtemp(prefix="jax_test_cache_")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


FIRST = ("test_train_distributed.py", "test_pieces.py", "test_mosaic_gpu.py", "test_experiments.py",
         "test_benchmarks.py", "test_triadic_pallas.py", "test_train.py", "test_text.py",
         "test_remat.py", "test_model.py", "test_faults.py", "test_merlin_pallas.py",
         "test_merlin_tpu.py", "test_generate_eval.py", "test_mosaic_gpu_backward.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))   # stable within a file
