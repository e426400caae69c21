"""One decoder block of the triadic paper's 1.3B model, forward and forward+backward, per mixer.

The paper's measure: one block (pre-RMSNorm mixer + SwiGLU MLP, residuals) of d_model 2048, 16
heads of 128, SwiGLU 5504, batch 4, T from 2k to 64k tokens, bf16. The block is exactly what
``lm.model`` builds for one layer (``lm.model.Group`` of one ``Block``: float32 residual stream,
float32 parameters, bf16 compute), so the projections, short convolutions, norms and the MLP are
all in the time.

  PYTHONPATH=. python benchmarks/block.py                                   # T 2k..64k (GPU)
  PYTHONPATH=. python benchmarks/block.py --T 2048,4096,8192                # one part of it
  PYTHONPATH=. python benchmarks/block.py --T 16384,32768,65536 --no-parts  # the other
  PYTHONPATH=. python benchmarks/block.py --mixers gdn,triadic8 --T 4096 --parts-T 4096
  PYTHONPATH=. python benchmarks/block.py --tiny                            # CPU smoke test
  PYTHONPATH=. python benchmarks/block.py --profile --mixers gdn,triadic8 --T 4096  # by kernel
  PYTHONPATH=. python benchmarks/block.py --conv --T 4096,16384       # the short convolution alone

Mixers: ``attention`` (``jax.nn.dot_product_attention``, implementation "cudnn" on GPU, "xla"
elsewhere), ``gdn`` (triadic E = 1), ``triadicE`` for E = 2, 4, 8 (``triadic2`` ...), and
``hybrid``: the average per block of the 3:1 pattern (three triadic blocks of ``--hybrid-e``, one
attention block), computed from the two measured single blocks as (3 x triadic + attention) / 4,
not timed as a group. Each time is the median of several calls after a warm-up (fewer at large T).
A case that does not fit in device memory prints ``oom`` in its cell.

Then a breakdown of the triadic layer (the mixer alone, without the block's norms and MLP) at
``--parts-T``: input projections (every matmul of x except the output gate's), short convolutions
+ activations + norms + gates, the op, and the output side (gate projection, RMSNorm-gate, output
projection), each its own jitted function on the same inputs, so the glue around the op is visible.
The composition of the parts is checked against the layer's own output.

Prints the machine (``jax.devices()[0].device_kind``) and the command first. Needs jax, flax,
optax and numpy only (no grain, no ml_collections).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The E = 8 block's f+b at T = 65536 needs about 57 GB of XLA temporaries: more than JAX's
# default pool (75% of the card) leaves beside the inputs on an 80 GB H100.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from triadic.xla_flags import apply_cpu_workaround  # noqa: E402

apply_cpu_workaround()  # before the CPU backend starts

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import is_oom, kernel_profile, machine, median_ms, profile_table  # noqa: E402
from lm.mixers import make_mixer  # noqa: E402
from lm.model import Group, ModelConfig  # noqa: E402
from layers.blocks import RMSNorm, causal_conv, l2norm  # noqa: E402
from layers.conv_kernel import causal_conv_pallas  # noqa: E402
from triadic.ops import triadic_gdn  # noqa: E402

PAPER = dict(d_model=2048, num_heads=16, head_dim=128, mlp_dim=5504, batch=4)
TINY = dict(d_model=64, num_heads=2, head_dim=16, mlp_dim=128, batch=1)
DEFAULT_T = "2048,4096,8192,16384,32768,65536"
DEFAULT_MIXERS = "attention,gdn,triadic2,triadic4,triadic8,hybrid"


XLA_CONV = "-xlaconv"  # mixer-name suffix: the short convolutions as XLA's shifted slices


def mixer_kind(name: str) -> tuple[str, int, str]:
  """Benchmark mixer name -> (lm mixer, E, model.conv_impl): a name ending in ``XLA_CONV``
  (e.g. gdn-xlaconv) runs the layer's short convolutions in XLA, else "auto" (the Pallas
  kernels on a GPU), so the two time side by side in one table."""
  conv = "xla" if name.endswith(XLA_CONV) else "auto"
  base = name[:-len(XLA_CONV)] if conv == "xla" else name
  if base == "attention" and conv == "auto":
    return "attention", 1, conv
  if base == "gdn":
    return "gdn", 1, conv
  if base.startswith("triadic") and base[len("triadic"):].isdigit():
    return "triadic_gdn", int(base[len("triadic"):]), conv
  raise ValueError(f"--mixers: unknown mixer {name!r}; use attention, gdn, triadicE (E an int) "
                   f"or hybrid, the recurrent ones optionally ending in {XLA_CONV}")


def model_config(shape: dict, mixer: str, e: int, *, impl: str, chunk: int,
                 conv_impl: str = "auto") -> ModelConfig:
  attention_impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
  return ModelConfig(vocab_size=256, num_layers=1, d_model=shape["d_model"],
                     num_heads=shape["num_heads"], head_dim=shape["head_dim"],
                     mlp_dim=shape["mlp_dim"], mixer=mixer, expand_e=e, impl=impl,
                     chunk_size=chunk, attention_impl=attention_impl, dtype="bfloat16",
                     conv_impl=conv_impl)


def _normal(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _cotangent(fn, *args, key=jax.random.PRNGKey(7)):
  """Random cotangents with the structure, shapes and dtypes of ``fn(*args)``."""
  out = jax.eval_shape(fn, *args)
  leaves, tree = jax.tree.flatten(out)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(tree, [_normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def fwd_and_fwdbwd(fn):
  """(forward, forward+backward) jitted: fn(*args) and the vjp of every argument at a given
  cotangent (the backward of a training step through fn)."""
  fwd = jax.jit(fn)

  def grads(args, ct):
    _, vjp = jax.vjp(fn, *args)
    return vjp(ct)

  return fwd, jax.jit(grads)


def time_pair(fn, args, budget_s):
  """(fwd ms, f+b ms), each a float or "oom"; other errors propagate."""
  fwd, fb = fwd_and_fwdbwd(fn)
  out = []
  for f, a in ((fwd, args), (fb, (args, _cotangent(fn, *args)))):
    try:
      out.append(median_ms(f, a, budget_s=budget_s))
    except Exception as err:  # noqa: BLE001  (jax raises several types for an OOM)
      if not is_oom(err):
        raise
      out.append("oom")
    gc.collect()
  return tuple(out)


def block_fn(cfg: ModelConfig):
  """(params, x) -> x of one block, and its parameters (float32, from the model's own init)."""
  group = Group(cfg)
  x0 = jnp.zeros((1, 64, cfg.d_model), jnp.float32)
  params = jax.jit(lambda k: group.init(k, x0, None)["params"])(jax.random.PRNGKey(0))
  params = nn.unbox(params)
  return lambda p, x: group.apply({"params": p}, x, None)[0], params


def fmt(x, width=9, digits=2):
  if isinstance(x, str):
    return f"{x:>{width}}"
  return f"{x:>{width}.{digits}f}"


def ratio(a, b):
  return a / b if isinstance(a, float) and isinstance(b, float) else "-"


def run_blocks(args, shape, ts, names):
  """The block table: one row per (T, mixer)."""
  singles = [n for n in names if n != "hybrid"]
  if "hybrid" in names:
    for n in ("attention", f"triadic{args.hybrid_e}"):
      if n not in singles:
        singles.append(n)
  built = {}
  for n in singles:
    kind, e, conv = mixer_kind(n)
    built[n] = block_fn(model_config(shape, kind, e, impl=args.impl, chunk=args.chunk,
                                     conv_impl=conv))
  b, d = shape["batch"], shape["d_model"]
  results = {}
  print("\n| T | mixer | fwd ms | f+b ms | f+b / gdn | f+b / attention |")
  print("|---|---|---|---|---|---|", flush=True)
  for t in ts:
    x = _normal(jax.random.PRNGKey(t), (b, t, d), jnp.float32)
    budget = args.budget_s
    for n in singles:
      fn, params = built[n]
      results[t, n] = time_pair(fn, (params, x), budget)
    if "hybrid" in names:
      tri, att = results[t, f"triadic{args.hybrid_e}"], results[t, "attention"]
      results[t, "hybrid"] = tuple(
          (3 * a + c) / 4 if isinstance(a, float) and isinstance(c, float) else "oom"
          for a, c in zip(tri, att))
    for n in names:
      fw, fb = results[t, n]
      gdn = results.get((t, "gdn"), ("-", "-"))[1]
      att = results.get((t, "attention"), ("-", "-"))[1]
      print(f"| {t} | {n} | {fmt(fw)} | {fmt(fb)} | {fmt(ratio(fb, gdn), 6)}x | "
            f"{fmt(ratio(fb, att), 6)}x |", flush=True)
    del x
    gc.collect()
  return results


def profile_blocks(shape, t, names, *, impl, chunk, reps=3):
  """Per mixer, one block's forward+backward at T = t under the JAX profiler: device ms by
  kernel and XLA fusion (``common.kernel_profile``), so the glue around each mixer's op shows."""
  x = _normal(jax.random.PRNGKey(t), (shape["batch"], t, shape["d_model"]), jnp.float32)
  for n in names:
    kind, e, conv = mixer_kind(n)
    fn, params = block_fn(model_config(shape, kind, e, impl=impl, chunk=chunk, conv_impl=conv))
    fb = fwd_and_fwdbwd(fn)[1]
    rows, wall = kernel_profile(fb, ((params, x), _cotangent(fn, params, x)), reps=reps)
    print(f"\n## {n} block f+b, T = {t}, batch {shape['batch']}\n")
    print(profile_table(rows, wall), flush=True)


def depthwise_conv(x, kernel):
  """``layers.blocks.causal_conv`` without a cache or documents, as one depthwise
  ``lax.conv_general_dilated`` (cuDNN on a GPU): x (B, T, C), kernel (width, C)."""
  width, channels = kernel.shape
  return jax.lax.conv_general_dilated(
      x, kernel.astype(x.dtype)[:, None, :], window_strides=(1,), padding=[(width - 1, 0)],
      dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=channels)


def run_conv(shape, ts, budget_s):
  """The GDN layer's short convolution alone (q, k, v: 3 x H x D channels, width 4, bf16),
  forward and forward+backward (gradients of x and the kernel), as XLA's shifted slices
  (``causal_conv(impl="xla")``, XLA's autodiff; the reference row), as one depthwise convolution
  (``depthwise_conv``) and as the Pallas kernels (``layers.conv_kernel``: Triton on a GPU,
  interpret mode elsewhere), on the same inputs, with the largest relative difference of their
  outputs and gradients from the reference's."""
  channels = 3 * shape["num_heads"] * shape["head_dim"]
  print(f"\nshort convolution, {channels} channels, width 4, batch {shape['batch']}, bf16; "
        f"f+b: the gradients of x and the kernel")
  print("| T | formulation | fwd ms | f+b ms | max rel diff |\n|---|---|---|---|---|")
  forms = {"shifted slices (causal_conv)": lambda x, w: causal_conv(x, w, impl="xla")[0],
           "depthwise lax.conv": depthwise_conv,
           "pallas kernel": causal_conv_pallas}
  for t in ts:
    x = _normal(jax.random.PRNGKey(t), (shape["batch"], t, channels), jnp.bfloat16)
    w = _normal(jax.random.PRNGKey(1), (4, channels), jnp.float32)
    ct = _normal(jax.random.PRNGKey(2), x.shape, jnp.bfloat16)
    outs = {}
    for name, fn in forms.items():
      fwd, fb = fwd_and_fwdbwd(fn)
      outs[name] = (fwd(x, w), *fb((x, w), ct))
      times = (median_ms(fwd, (x, w), budget_s=budget_s),
               median_ms(fb, ((x, w), ct), budget_s=budget_s))
      ref = outs[next(iter(forms))]
      diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                       / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-30))
                 for a, b in zip(outs[name], ref))
      print(f"| {t} | {name} | {fmt(times[0])} | {fmt(times[1])} | {diff:.1e} |", flush=True)


def summary(results, ts, names):
  """f+b ratios pivoted: rows T, columns mixer / gdn and attention / mixer."""
  others = [n for n in names if n != "gdn"]
  head = "| T | " + " | ".join(f"{n} / gdn" for n in others if n != "attention")
  head += " | " + " | ".join(f"attention / {n}" for n in names if n != "attention") + " |"
  cols = head.count("|") - 1
  print("\nforward+backward ratios\n" + head + "\n" + "|---" * cols + "|")
  for t in ts:
    fb = {n: results[t, n][1] for n in names}
    cells = [fmt(ratio(fb[n], fb.get("gdn", "-")), 5) for n in others if n != "attention"]
    cells += [fmt(ratio(fb.get("attention", "-"), fb[n]), 5) for n in names if n != "attention"]
    print(f"| {t} | " + " | ".join(c + "x" for c in cells) + " |")


# --- the triadic layer by parts -------------------------------------------------------------


def _proj(x, kernel, dt):
  """DenseGeneral's product: x (B, T, d_model) against kernel (d_model, *features), in dt."""
  return jax.lax.dot_general(x.astype(dt), kernel.astype(dt), (((x.ndim - 1,), (0,)), ((), ())))


def triadic_parts(cfg: ModelConfig, e: int):
  """The four parts of ``triadic.TriadicGDN`` (erase=True; ``layers.gdn`` holds its input and
  output sides) as functions of its parameters:
  projections (p, x) -> z; glue (p, z) -> op inputs; op (inputs) -> o; output (p, o, x) -> y."""
  dt, w = cfg.compute_dtype, cfg.conv_width
  streams = ("q", "k", "v") + (("k2", "q2") if e > 1 else ())

  def projections(p, x):
    """One matmul over the concatenated q, k, v (k2, q2) kernels, as ``gdn_inputs``."""
    w_in = jnp.concatenate([p[f"{s}_proj"]["kernel"].reshape(x.shape[-1], -1) for s in streams], -1)
    return {"qkv": _proj(x, w_in, dt), "a": _proj(x, p["decay"]["a_proj"]["kernel"], dt),
            "beta": _proj(x, p["beta_proj"]["kernel"], dt)}

  def glue(p, z):
    kernels = [p[f"{s}_conv"]["kernel"] for s in streams]
    w_conv = jnp.concatenate([c.reshape(w, -1) for c in kernels], -1)
    y = causal_conv(z["qkv"], w_conv)[0]
    parts = jnp.split(y, np.cumsum([math.prod(c.shape[1:]) for c in kernels])[:-1], axis=-1)
    y = {s: part.reshape(y.shape[:2] + c.shape[1:]) for s, part, c in zip(streams, parts, kernels)}
    q, k = l2norm(jax.nn.silu(y["q"])), l2norm(jax.nn.silu(y["k"]))
    v = jax.nn.silu(y["v"])
    if e > 1:
      k2 = l2norm(jax.nn.softplus(y["k2"].astype(jnp.float32)))
      q2 = l2norm(jax.nn.softplus(y["q2"].astype(jnp.float32)))
    else:
      k2 = q2 = jnp.ones(q.shape[:3] + (1,), jnp.float32)
    decay = p["decay"]
    a = z["a"].astype(jnp.float32) + decay["dt_bias"].astype(jnp.float32)
    g = -jnp.exp(decay["A_log"].astype(jnp.float32)) * jax.nn.softplus(a)
    beta = jax.nn.sigmoid(z["beta"].astype(jnp.float32))
    return q, k, v, k2.astype(q.dtype), q2.astype(q.dtype), g, beta

  def op(q, k, v, k2, q2, g, beta):
    return triadic_gdn(q, k, v, k2, q2, g, beta, erase=True, impl=cfg.impl,
                       chunk_size=cfg.chunk_size)[0]

  def output(p, o, x):
    if "gate_proj" in p:  # gate_rank = 0
      gate = _proj(x, p["gate_proj"]["kernel"], dt)
    else:
      gate = _proj(_proj(x, p["gate_down"]["kernel"], dt), p["gate_up"]["kernel"], dt)
      gate = gate + p["gate_up"]["bias"].astype(dt)
    o = RMSNorm(names=("head_dim",), dtype=dt).apply({"params": p["o_norm"]}, o)
    o = o * jax.nn.sigmoid(gate)
    kernel = p["out_proj"]["kernel"].astype(dt)
    return jax.lax.dot_general(o.astype(dt), kernel, (((2, 3), (0, 1)), ((), ())))

  return projections, glue, op, output


def parts_setup(shape, t, e, *, impl="auto", chunk=64):
  """The layer's parameters, input x (B, t, d_model) bf16, each part's input, and the relative
  RMS distance between the composed parts and the layer's own output (which must be ~0)."""
  kind = "gdn" if e == 1 else "triadic_gdn"
  cfg = model_config(shape, kind, e, impl=impl, chunk=chunk)
  mixer = make_mixer(kind, cfg, dtype=cfg.compute_dtype)
  x = _normal(jax.random.PRNGKey(1), (shape["batch"], t, shape["d_model"]), cfg.compute_dtype)
  x0 = x[:, :64]
  p = nn.unbox(jax.jit(lambda k: mixer.init(k, x0)["params"])(jax.random.PRNGKey(0)))
  whole = lambda p, x: mixer.apply({"params": p}, x)[0]
  projections, glue, op, output = triadic_parts(cfg, e)
  z = jax.jit(projections)(p, x)
  inputs = tuple(jax.jit(glue)(p, z))
  o = jax.jit(op)(*inputs)
  composed = np.asarray(jax.jit(output)(p, o, x), np.float64)
  ref = np.asarray(jax.jit(whole)(p, x), np.float64)
  err = float(np.linalg.norm(composed - ref) / max(np.linalg.norm(ref), 1e-30))
  rows = [("projections", projections, (p, x)), ("conv+act+norms+gates", glue, (p, z)),
          ("op", op, inputs), ("output gate+norm+proj", output, (p, o, x)),
          ("mixer (whole)", whole, (p, x))]
  return rows, err


def run_parts(args, shape, t, e):
  """Rows of the breakdown table for the triadic layer at E = e, T = t."""
  rows, err = parts_setup(shape, t, e, impl=args.impl, chunk=args.chunk)
  if not err < 1e-2:
    raise AssertionError(f"the parts of the E = {e} layer compose to a different output than the "
                         f"layer (rel-RMS {err:.2e}): benchmarks/block.py's triadic_parts no "
                         f"longer matches triadic/layer.py")
  times = {}
  for name, fn, fargs in rows:
    times[name] = time_pair(fn, fargs, args.budget_s)
  parts = [r[0] for r in rows[:4]]
  total = tuple(sum(times[n][i] for n in parts) if all(isinstance(times[n][i], float) for n in parts)
                else "-" for i in range(2))
  whole_fb = times["mixer (whole)"][1]
  for name in parts + ["sum of parts", "mixer (whole)"]:
    fw, fb = total if name == "sum of parts" else times[name]
    share = ratio(fb, whole_fb)
    share = f"{100 * share:5.1f}%" if isinstance(share, float) else "-"
    print(f"| {t} | {e} | {name} | {fmt(fw)} | {fmt(fb)} | {share} |", flush=True)
  print(f"(E = {e}: the composed parts match the layer's output to rel-RMS {err:.1e})")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--T", default=None, help=f"comma-separated sequence lengths (default {DEFAULT_T})")
  p.add_argument("--mixers", default=DEFAULT_MIXERS,
                 help="comma-separated: attention, gdn, triadic2/4/8 (any E), hybrid")
  p.add_argument("--hybrid-e", type=int, default=8, help="E of the hybrid's triadic blocks")
  p.add_argument("--batch", type=int, default=None, help="default 4 (1 with --tiny)")
  p.add_argument("--impl", default="auto", help="triadic op impl (auto: Pallas on GPU)")
  p.add_argument("--chunk", type=int, default=64)
  p.add_argument("--budget-s", type=float, default=0.5,
                 help="time spent repeating each measurement (3 to 20 calls)")
  p.add_argument("--parts-T", type=int, default=None, help="T of the breakdown (default 4096)")
  p.add_argument("--parts-E", default="1,8", help="E values of the breakdown")
  p.add_argument("--no-parts", action="store_true", help="skip the breakdown")
  p.add_argument("--profile", action="store_true",
                 help="instead of the tables: each mixer's block forward+backward at the first T "
                 "under the JAX profiler, device ms by kernel and XLA fusion")
  p.add_argument("--conv", action="store_true",
                 help="instead of the tables: the GDN layer's short convolution alone at each T, "
                 "as XLA's shifted slices, one depthwise lax.conv and the Pallas kernels")
  p.add_argument("--tiny", action="store_true",
                 help="d_model 64, 2 heads of 16, MLP 128, batch 1, T 64,128: a CPU check")
  args = p.parse_args(argv)
  shape = dict(TINY if args.tiny else PAPER)
  if args.batch:
    shape["batch"] = args.batch
  ts = [int(t) for t in (args.T or ("64,128" if args.tiny else DEFAULT_T)).split(",")]
  names = [n.strip() for n in args.mixers.split(",") if n.strip()]
  for n in names:
    if n != "hybrid":
      mixer_kind(n)
  parts_t = args.parts_T or (128 if args.tiny else 4096)

  print(f"command: {' '.join(['python'] + sys.argv)}")
  print(f"device: {jax.devices()[0].device_kind} | {machine()}")
  print(f"block: d_model {shape['d_model']}, {shape['num_heads']} heads of {shape['head_dim']}, "
        f"SwiGLU {shape['mlp_dim']}, batch {shape['batch']}, bf16 compute, float32 params and "
        f"residual; triadic impl {args.impl}, chunk {args.chunk}; attention "
        f"{'cudnn' if jax.default_backend() == 'gpu' else 'xla'}. Median ms.")
  if args.conv:
    run_conv(shape, ts, args.budget_s)
    return
  if args.profile:
    profile_blocks(shape, ts[0], [n for n in names if n != "hybrid"], impl=args.impl,
                   chunk=args.chunk)
    return
  if "hybrid" in names:
    print(f"hybrid = average per block of 3 x triadic{args.hybrid_e} + 1 x attention, from the "
          f"measured single blocks")
  results = run_blocks(args, shape, ts, names)
  summary(results, ts, names)
  if not args.no_parts:
    print(f"\ntriadic layer by parts (mixer only), T = {parts_t}, batch {shape['batch']}; share of "
          f"the whole layer's f+b")
    print("| T | E | part | fwd ms | f+b ms | share |\n|---|---|---|---|---|---|")
    for e in (int(v) for v in args.parts_E.split(",")):
      run_parts(args, shape, parts_t, e)


if __name__ == "__main__":
  main()
