"""Decoding cost against context length: per-step latency and cache bytes of every mixer.

One decoder LM shape for all mixers; each row times the jitted one-token step
``LM.apply(variables, token (B, 1), cache) -> (logits, cache)`` (greedy: the argmax is the next
token; the cache is donated) at a context of ``context`` tokens, and reports the bytes of that
cache per sequence. Attention's KV cache, and the time to read it, grow with the context; the
recurrent mixers' state does not.

  PYTHONPATH=. python3 benchmarks/decode.py                  # GPU: 1k..64k, bf16, 1024-wide layers
  PYTHONPATH=. python3 benchmarks/decode.py --mixers attention,gdn --contexts 1024,65536
  PYTHONPATH=. python3 benchmarks/decode.py --small --contexts 1024,4096   # a quick smoke run
  python benchmarks/decode.py                                # CPU: a small shape, float32

No prompt is prefilled: the cache of a context is built directly (``LM.init_cache(B, context)``,
every float leaf random in its dtype, every length counter at ``context - n`` where n = warm-up +
timed steps), so the n steps fill it to exactly ``context`` tokens: the KV buffer holds
``context`` positions and every step of attention reads all of them. Multi-state mixers
(``multistate_gdn``, MERLIN aggregator) hold ``--max_segments`` segments of ``--segment_len``
tokens (default 4096 x ceil(max context / 4096) = 16 at 64k). Parameters are cast to the compute
dtype (as for serving). ``ms/step`` is the median of ``--steps`` timed steps after ``--warmup``
(block_until_ready on each); one step emits one token for each of the B sequences. ``cache
MiB/seq`` is the sum of the cache leaves' nbytes / B; ``costs`` is ``lm.costs.state_bytes``
(recurrent state + KV cache at ``context``) for comparison.

Mixers: attention, gdn, triadic_gdn_e<E>, multistate_gdn (and mamba2, multistate_mamba2,
triadic_sgla_e<E>). On a CPU shared with other jobs, pin one core for stable numbers:

  XLA_FLAGS="--xla_cpu_multi_thread_eigen=false" taskset -c 0 python benchmarks/decode.py
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from triadic.xla_flags import apply_cpu_workaround  # noqa: E402

apply_cpu_workaround()  # before the CPU backend starts

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import machine  # noqa: E402
from lm import costs  # noqa: E402
from lm.mixers import MIXERS  # noqa: E402
from lm.model import LM, ModelConfig  # noqa: E402

DEFAULT_MIXERS = "attention,gdn,triadic_gdn_e2,triadic_gdn_e4,triadic_gdn_e8,multistate_gdn"
CONTEXTS = "1024,2048,4096,8192,16384,32768,65536"
# The model shape per backend: a layer of the 400M model (1024 wide, 8 heads of 128) on a GPU, a
# small one that finishes in a couple of minutes on a 2-core CPU.
SHAPES = {
    "gpu": dict(d_model=1024, num_heads=8, head_dim=128, mlp_dim=2816, num_layers=4,
                vocab_size=32768, batch=8, dtype="bfloat16", d_r=128, steps=20, warmup=3),
    "cpu": dict(d_model=256, num_heads=4, head_dim=64, mlp_dim=512, num_layers=2, vocab_size=512,
                batch=1, dtype="float32", d_r=32, steps=10, warmup=2),
}


def parse_mixer(name: str) -> tuple[str, int]:
  """'triadic_gdn_e8' -> ('triadic_gdn', 8); 'gdn' -> ('gdn', 1)."""
  m = re.fullmatch(r"(.+)_e(\d+)", name)
  mixer, e = (m.group(1), int(m.group(2))) if m else (name, 1)
  if mixer not in MIXERS:
    raise ValueError(f"--mixers names unknown mixer {name!r}; known: {tuple(MIXERS)} (triadic ones with "
                     f"an _e<E> suffix, e.g. triadic_gdn_e8)")
  return mixer, e


def model_config(args, mixer: str, e: int) -> ModelConfig:
  return ModelConfig(vocab_size=args.vocab_size, num_layers=args.num_layers, d_model=args.d_model,
                     num_heads=args.num_heads, head_dim=args.head_dim, mlp_dim=args.mlp_dim,
                     mixer=mixer, expand_e=e, aggregator="merlin", segment_len=args.segment_len,
                     max_segments=args.max_segments, d_r=args.d_r, dtype=args.dtype)


def init_variables(model: LM, batch: int, dtype):
  """Random parameters (created by the decoding path: the same tree as training's), cast to
  ``dtype``."""
  token = jnp.zeros((batch, 1), jnp.int32)
  variables = jax.jit(model.init)(jax.random.key(0), token, model.init_cache(batch, 8))
  cast = lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p
  return jax.tree.map(cast, nn.unbox(variables))


@jax.jit
def fill(cache, key, length):
  """``cache`` with every float leaf random (0.1 x standard normal, its dtype) and every length
  counter set to ``length``: the cache of a sequence of ``length`` tokens, without a prefill."""
  leaves, tree = jax.tree_util.tree_flatten_with_path(cache)
  out = []
  for i, (path, x) in enumerate(leaves):
    if getattr(path[-1], "key", None) == "length":
      out.append(jnp.full_like(x, length))
    elif jnp.issubdtype(x.dtype, jnp.floating):
      out.append((0.1 * jax.random.normal(jax.random.fold_in(key, i), x.shape)).astype(x.dtype))
    else:
      out.append(x)
  return jax.tree_util.tree_unflatten(tree, out)


def make_step(model: LM):
  """The jitted greedy decoding step (variables, token (B, 1), cache) -> (next token, cache)."""
  def step(variables, token, cache):
    logits, cache = model.apply(variables, token, cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache
  return jax.jit(step, donate_argnums=2)


def measure(step, variables, model: LM, batch: int, context: int, warmup: int, steps: int):
  """(median ms per step, cache bytes per sequence) at ``context`` tokens."""
  n = warmup + steps
  cache = fill(model.init_cache(batch, context), jax.random.key(context), jnp.int32(context - n))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(cache)) / batch
  token = jnp.ones((batch, 1), jnp.int32)
  times = []
  for i in range(n):
    start = time.perf_counter()
    token, cache = step(variables, token, cache)
    jax.block_until_ready((token, cache))
    if i >= warmup:
      times.append(time.perf_counter() - start)
  del cache
  return 1e3 * statistics.median(times), nbytes


def main(argv=None):
  small = "--small" in (sys.argv[1:] if argv is None else argv)
  d = SHAPES["gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") and not small else "cpu"]
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--small", action="store_true", help="the CPU defaults on any backend")
  ap.add_argument("--mixers", default=DEFAULT_MIXERS, help="comma-separated, see above")
  ap.add_argument("--contexts", default=CONTEXTS, help="comma-separated context lengths")
  for name in ("d_model", "num_heads", "head_dim", "mlp_dim", "num_layers", "vocab_size", "batch",
               "d_r", "steps", "warmup"):
    ap.add_argument(f"--{name}", type=int, default=d[name], help=f"default here: {d[name]}")
  ap.add_argument("--dtype", default=d["dtype"], choices=("float32", "bfloat16", "float16"))
  ap.add_argument("--segment_len", type=int, default=4096, help="multi-state segment length L")
  ap.add_argument("--max_segments", type=int, default=0,
                  help="multi-state N; 0: ceil(max context / segment_len)")
  args = ap.parse_args(argv)

  contexts = [int(c) for c in args.contexts.split(",")]
  if min(contexts) <= args.warmup + args.steps:
    raise ValueError(f"--contexts must all exceed --warmup + --steps = {args.warmup + args.steps}, "
                     f"got {contexts}")
  args.max_segments = args.max_segments or -(-max(contexts) // args.segment_len)
  mixers = [parse_mixer(m) for m in args.mixers.split(",")]
  print(f"# {machine()} | {datetime.datetime.now():%Y-%m-%d %H:%M}")
  print(f"# {args.num_layers} layers, d_model {args.d_model}, {args.num_heads} heads x "
        f"{args.head_dim}, MLP {args.mlp_dim}, vocab {args.vocab_size}, B = {args.batch}, "
        f"{args.dtype} (params too); multi-state: MERLIN, L = {args.segment_len} x N = "
        f"{args.max_segments}, d_r = {args.d_r}; median of {args.steps} steps after {args.warmup}")
  print("| mixer | context | ms/step | / attention | cache MiB/seq | / attention | costs MiB/seq |")
  print("|---|---|---|---|---|---|---|")
  attention = {}
  for mixer, e in mixers:
    label = f"{mixer} E={e}" if mixer in ("triadic_gdn", "triadic_sgla") else mixer
    cfg = model_config(args, mixer, e)
    if cfg.max_len is not None and max(contexts) > cfg.max_len:
      raise ValueError(f"context {max(contexts)} exceeds --max_segments x --segment_len = "
                       f"{cfg.max_len} for {mixer}")
    model = LM(cfg)
    variables = init_variables(model, args.batch, cfg.compute_dtype)
    step = make_step(model)
    for context in contexts:
      ms, nbytes = measure(step, variables, model, args.batch, context, args.warmup, args.steps)
      predicted = sum(costs.state_bytes(cfg, context).values())
      if mixer == "attention":
        attention[context] = (ms, nbytes)
      ratio = lambda x, j: f"{x / attention[context][j]:.3f}" if context in attention else "-"
      print(f"| {label} | {context} | {ms:.3f} | {ratio(ms, 0)} | {nbytes / 2 ** 20:.3f} "
            f"| {ratio(nbytes, 1)} | {predicted / 2 ** 20:.3f} |", flush=True)
    del variables, step


if __name__ == "__main__":
  main()
