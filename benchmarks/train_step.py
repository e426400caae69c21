"""Training throughput: tokens/s, step time and peak device memory of the project's real train step
per mixer, and FLA's ``GatedDeltaNetForCausalLM`` at the same shape in the same run.

  PYTHONPATH=. python benchmarks/train_step.py                                    # 400M, 16 x 2048
  PYTHONPATH=. python benchmarks/train_step.py --mixers gdn,fla --remat none
  PYTHONPATH=. python benchmarks/train_step.py --config configs/lm_1p3b.py:mqar --batch 8 --seq 4096 --mixers gdn,triadic8,attention,merlin
  PYTHONPATH=. python benchmarks/train_step.py --tiny --mixers gdn,attention      # CPU smoke test
  PYTHONPATH=. python benchmarks/train_step.py --mixers gdn,triadic8 --profile    # by kernel
  PYTHONPATH=. python benchmarks/train_step.py --mixers gdn --hlo                 # copies etc.

Each model runs in its own subprocess (so every peak-memory figure is that model's alone, and JAX
and PyTorch never share the device): build the config (``--config``, the model's mixer, ``--batch``,
``--seq``, ``--remat``, ``--set key=value``), then ``lm.state.create`` and ``lm.train_step.
jit_train_step`` (the step ``train.py`` runs: loss, gradients, clipping, AdamW, donated state) on
one fixed synthetic batch of random tokens (every position weighted). The step is lowered and
compiled ahead of time (both timed: the "first step" column is their sum and the first step's
run; PyTorch's first step includes its kernels' compiles), then ``--warmup`` untimed steps and
``--steps`` timed steps, each waited for; the median step time gives tokens/s. A child reports
its phases on stderr, so a row that timed out says which it had reached (lowering, XLA's compile,
running).
Peak memory is ``jax.devices()[0].memory_stats()["peak_bytes_in_use"]`` (PyTorch:
``torch.cuda.max_memory_allocated``); none on a CPU. ``--profile`` (our models): after the timed
steps, a few more under the JAX profiler, and each model's step by kernel and XLA fusion
(``common.kernel_profile``, with each fusion's source) below the table. ``--hlo`` (our models):
where the compiled step moves data instead of computing (``common.hlo_moves``: copies, dynamic
slices and updates, custom calls, instructions XLA rematerialized), inside the loop over layers
or once.

Mixers: ``gdn``, ``triadicE`` (Triadic GDN, E = 2, 4, 8, ...), ``attention`` (cuDNN on GPU),
``merlin`` (multi-state GDN with the MERLIN aggregator, segments of 256), and ``fla``: FLA's Gated
DeltaNet LM (``fla.models.GatedDeltaNetForCausalLM``, when torch and flash-linear-attention import)
with our shape: vocabulary, d_model, layers, heads, head dim (keys and values, ``expand_v=1``), MLP
size, untied head, short convolutions and the output gate; float32 parameters under bf16 autocast,
fused AdamW (betas 0.9 / 0.95, weight decay 0.1), gradient clipping at 1.0, FLA's fused
cross-entropy, no gradient checkpointing (``--fla-remat`` turns HF's on). Without torch/FLA the row
says why. Parameter counts are printed for every model.

Our models need jax, flax, optax, ml_collections and grain (``lm.config`` imports ``lm.data``).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from triadic.xla_flags import apply_cpu_workaround  # noqa: E402

apply_cpu_workaround()  # before the CPU backend starts

RESULT = "RESULT "
PROGRESS = "PROGRESS "
TINY_MODEL = dict(num_layers=2, d_model=64, num_heads=2, head_dim=16, mlp_dim=128)
MERLIN_SEGMENT = 256


def load_config(spec: str):
  """``path/to/config.py[:arg]`` -> the ConfigDict of its ``get_config(arg)``."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("bench_config", os.path.join(ROOT, path)
                                                       if not os.path.isabs(path) else path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def assign(config, assignment: str):
  """``a.b=value`` (value a Python literal, else a string) on a ConfigDict."""
  key, eq, text = assignment.partition("=")
  if not eq:
    raise ValueError(f"expected key=value, got {assignment!r}")
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text
  *parents, last = key.split(".")
  node = config
  for name in parents:
    node = node[name]
  node[last] = value


def build_config(job: dict):
  """The job's ConfigDict: the config file, the mixer, batch, sequence, remat and overrides."""
  config = load_config(job["config"])
  c = config
  if job["tiny"]:
    c.model.update(TINY_MODEL)
    c.data.vocab_size = 256
  c.data.seq_len = job["seq"]
  c.train.batch_size = job["batch"]
  c.train.num_steps = max(c.train.num_steps, c.train.warmup_steps + 1)
  mixer = job["mixer"]
  if mixer == "gdn":
    c.model.mixer = "gdn"
  elif mixer == "attention":
    c.model.mixer = "attention"
    import jax
    c.model.attention_impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
  elif mixer == "merlin":
    # Segments for the longest sequence the config holds: training's and every evaluation's.
    from lm.config import eval_lengths
    longest = max([job["seq"]] + [n for _, n in eval_lengths(c.data)])
    segment = 32 if job["tiny"] else MERLIN_SEGMENT
    c.model.update(mixer="multistate_gdn", aggregator="merlin", segment_len=segment,
                   max_segments=max(1, math.ceil(longest / segment)))
  elif mixer.startswith("triadic") and mixer[len("triadic"):].isdigit():
    c.model.update(mixer="triadic_gdn", expand_e=int(mixer[len("triadic"):]))
  else:
    raise ValueError(f"--mixers: unknown mixer {mixer!r}; use gdn, triadicE, attention, merlin, fla")
  if job["remat"]:
    c.model.remat = job["remat"]
  for assignment in job["set"]:
    assign(c, assignment)
  return config


def model_shape(job: dict) -> dict:
  """vocab, d_model, layers, heads, head dim and MLP size of the job's config."""
  c = load_config(job["config"])
  m = dict(c.model)
  if job["tiny"]:
    m.update(TINY_MODEL)
  shape = dict(vocab_size=256 if job["tiny"] else c.data.vocab_size, num_layers=m["num_layers"],
               d_model=m["d_model"], num_heads=m["num_heads"], head_dim=m["head_dim"],
               mlp_dim=m["mlp_dim"], conv_width=m["conv_width"])
  for assignment in job["set"]:  # model overrides that change the shape
    key, _, text = assignment.partition("=")
    if key.startswith("model.") and key[6:] in shape:
      shape[key[6:]] = ast.literal_eval(text)
  return shape


def _peak_bytes(device):
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return (stats or {}).get("peak_bytes_in_use")


def timed_steps(run, warmup: int, steps: int):
  """(seconds of the first call, seconds of each call after ``warmup``) of ``run()``, which must
  return only once its step has finished on the device."""
  times, first = [], None
  for i in range(warmup + steps):
    start = time.perf_counter()
    run()
    took = time.perf_counter() - start
    first = took if i == 0 else first
    if i >= warmup:
      times.append(took)
  return first, times


def progress(message: str) -> None:
  """A child's phase, on stderr: a timed-out child's row says the last one it reached."""
  print(PROGRESS + message, file=sys.stderr, flush=True)


def run_ours(job: dict) -> dict:
  import jax
  import numpy as np

  from lm import costs, sharding, state as state_lib, train_step as train_step_lib
  from lm.config import validate

  config = build_config(job)
  cfg = validate(config)
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.rules(config)
  t = config.train
  setup = state_lib.create(cfg, t, mesh, rules, job["seq"])
  step = train_step_lib.jit_train_step(setup, t, mesh, rules)
  state = setup.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.data.vocab_size, (job["batch"], job["seq"] + 1), dtype=np.int32)
  batch = sharding.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                                 "weights": np.ones((job["batch"], job["seq"]), np.float32)}, mesh)
  carry = {"state": state}
  progress("state initialised; lowering the step")
  start = time.perf_counter()
  lowered = step.lower(state, batch)
  lower_s = time.perf_counter() - start
  progress(f"lowered in {lower_s:.1f} s; XLA compiling")
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  progress(f"lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s; running")

  def run():
    carry["state"], carry["metrics"] = compiled(carry["state"], batch)
    jax.block_until_ready(carry["metrics"])

  first, times = timed_steps(run, job["warmup"], job["steps"])
  first += lower_s + compile_s
  metrics = carry["metrics"]
  counts = costs.count_params(cfg)
  profile = moves = None
  if job.get("profile") or job.get("hlo"):
    from benchmarks.common import (hlo_moves, hlo_moves_table, hlo_sources, kernel_profile,
                                   profile_table)
    text = compiled.as_text()
  if job.get("profile"):
    # The step donates its state: profile a closure that threads it, with the step's sources.
    rows, wall = kernel_profile(run, (), reps=3, sources=hlo_sources(step, (), text))
    profile = profile_table(rows, wall)
  if job.get("hlo"):
    moves = hlo_moves_table(hlo_moves(text))
  return dict(step_s=statistics.median(times), first_step_s=first, lower_s=lower_s,
              compile_s=compile_s, profile=profile, hlo=moves,
              peak_bytes=_peak_bytes(jax.devices()[0]), loss=float(metrics["loss"]),
              params=counts["total"], non_embedding=counts["non_embedding"],
              mixers=",".join(sorted(set(cfg.layers()))), remat=cfg.remat_name(),
              device=jax.devices()[0].device_kind)


def run_fla(job: dict) -> dict:
  try:
    import torch
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
  except Exception as err:  # noqa: BLE001  (any import failure means: no FLA row)
    return dict(skipped=f"torch / fla not importable: {type(err).__name__}: {err}")
  if not torch.cuda.is_available():
    return dict(skipped="torch sees no CUDA device")
  s = model_shape(job)
  fcfg = GatedDeltaNetConfig(
      attn_mode="chunk", hidden_size=s["d_model"], num_hidden_layers=s["num_layers"],
      num_heads=s["num_heads"], head_dim=s["head_dim"], expand_v=1.0,
      intermediate_size=s["mlp_dim"], vocab_size=s["vocab_size"], use_gate=True,
      use_short_conv=True, conv_size=s["conv_width"], tie_word_embeddings=False,
      max_position_embeddings=job["seq"], fuse_cross_entropy=True, fuse_norm=True,
      fuse_swiglu=True, use_cache=False)
  device = torch.device("cuda")
  model = GatedDeltaNetForCausalLM(fcfg).to(device)
  if job["fla_remat"]:
    model.gradient_checkpointing_enable()
  model.train()
  params = sum(p.numel() for p in model.parameters())
  embedding = model.get_input_embeddings().weight.numel()
  opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                          fused=True)
  gen = torch.Generator(device="cpu").manual_seed(0)
  ids = torch.randint(0, s["vocab_size"], (job["batch"], job["seq"]), generator=gen).to(device)
  torch.cuda.reset_peak_memory_stats()

  def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
      loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  out = {}

  def run():
    out["loss"] = step()
    torch.cuda.synchronize()

  torch.cuda.synchronize()
  first, times = timed_steps(run, job["warmup"], job["steps"])
  loss = out["loss"]
  import fla
  return dict(step_s=statistics.median(times), first_step_s=first,
              peak_bytes=torch.cuda.max_memory_allocated(), loss=float(loss.item()),
              params=params, non_embedding=params - embedding, mixers="fla gated_deltanet",
              remat="hf" if job["fla_remat"] else "none",
              device=torch.cuda.get_device_name(), versions=f"torch {torch.__version__}, "
              f"fla {getattr(fla, '__version__', '?')}")


def child(job: dict) -> None:
  try:
    result = run_fla(job) if job["mixer"] == "fla" else run_ours(job)
  except Exception as err:  # noqa: BLE001  (reported in the table, the other rows still run)
    text = f"{type(err).__name__}: {err}"
    oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
    result = dict(error="oom" if oom else text[:2000])
  print(RESULT + json.dumps(result), flush=True)


def run_job(job: dict, in_process: bool, timeout: int) -> dict:
  if in_process:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      child(job)
    lines = out.getvalue().splitlines()
  else:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as err:
      return dict(error=f"timed out after {timeout} s{_last_progress(err.stderr)}")
    lines = proc.stdout.splitlines()
    if not any(line.startswith(RESULT) for line in lines):
      return dict(error=f"exit {proc.returncode}: {proc.stderr[-1500:]}")
  return json.loads([line for line in lines if line.startswith(RESULT)][-1][len(RESULT):])


def _last_progress(stderr) -> str:
  """' (last: <the child's last phase>)', or '' if it reported none."""
  if isinstance(stderr, bytes):
    stderr = stderr.decode(errors="replace")
  phases = [line[len(PROGRESS):] for line in (stderr or "").splitlines()
            if line.startswith(PROGRESS)]
  return f" (last: {phases[-1]})" if phases else ""


def _first_step(r: dict) -> str:
  """Seconds to the first step's end; for our models with JAX's lowering and XLA's compile."""
  split = f" ({r['lower_s']:.1f} + {r['compile_s']:.1f})" if "compile_s" in r else ""
  return f"{r['first_step_s']:.1f}{split}"


def _gib(x):
  return "-" if x is None else f"{x / 2 ** 30:.1f}"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/lm_400m.py:mqar",
                 help="comma-separated config files (path[:arg]), each a table")
  p.add_argument("--mixers", default="gdn,triadic8,attention,merlin,fla")
  p.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; 2 tiny)")
  p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; 64 tiny)")
  p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 tiny)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
  p.add_argument("--remat", default="", help="model.remat for our models (default: the config's); "
                 "none | full | save_mixer_op | dots | dots_no_batch | save_mixer_op_and_dots")
  p.add_argument("--fla-remat", action="store_true", help="gradient checkpointing for FLA's model")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override for our models, e.g. --set model.d_r=128 (repeatable)")
  p.add_argument("--tiny", action="store_true", help="2 layers of d_model 64, vocab 256: CPU check")
  p.add_argument("--in-process", action="store_true",
                 help="run every model in this process (peak memory is then cumulative)")
  p.add_argument("--timeout", type=int, default=480, help="seconds per model")
  p.add_argument("--profile", action="store_true",
                 help="also each of our models' step by kernel and XLA fusion (JAX profiler)")
  p.add_argument("--hlo", action="store_true",
                 help="also each of our models' compiled step's data movement: copies, "
                      "dynamic (update) slices, custom calls, rematerialized instructions")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    child(json.loads(args.child))
    return
  batch = args.batch or (2 if args.tiny else 16)
  seq = args.seq or (64 if args.tiny else 2048)
  steps = args.steps or (2 if args.tiny else 10)
  mixers = [m.strip() for m in args.mixers.split(",") if m.strip()]
  print(f"command: {' '.join(['python'] + sys.argv)}")
  for spec in args.config.split(","):
    base = dict(config=spec, batch=batch, seq=seq, steps=steps, warmup=args.warmup,
                remat=args.remat, fla_remat=args.fla_remat, set=args.set, tiny=args.tiny,
                profile=args.profile, hlo=args.hlo)
    shape = model_shape(dict(base, mixer="gdn"))
    print(f"\n{spec}: {shape}; batch {batch} x {seq} tokens; {steps} timed steps after "
          f"{args.warmup}")
    print("| model | remat | params | non-emb. | step ms | tokens/s | vs fla | peak GiB | "
          "first step s (lower + compile) | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results = {}
    for m in (["fla"] if "fla" in mixers else []) + [m for m in mixers if m != "fla"]:
      r = results[m] = run_job(dict(base, mixer=m), args.in_process, args.timeout)
      if "skipped" in r or "error" in r:
        print(f"| {m} | - | - | - | {r.get('error', 'skipped')} | - | - | - | - | - |  "
              f"{r.get('skipped', '')}", flush=True)
        continue
      tps = batch * seq / r["step_s"]
      fla = results.get("fla", {})
      vs = f"{tps / (batch * seq / fla['step_s']):.2f}x" if "step_s" in fla else "-"
      print(f"| {m} | {r['remat']} | {r['params'] / 1e6:.1f}M | {r['non_embedding'] / 1e6:.1f}M | "
            f"{1e3 * r['step_s']:.1f} | {tps / 1e3:.1f}k | {vs} | {_gib(r['peak_bytes'])} | "
            f"{_first_step(r)} | {r['loss']:.3f} |", flush=True)
    for m, r in results.items():
      if r.get("profile"):
        print(f"\n## {m}: one training step by kernel\n\n{r['profile']}", flush=True)
      if r.get("hlo"):
        print(f"\n## {m}: the compiled step's data movement\n\n{r['hlo']}", flush=True)
    devices = {r["device"] for r in results.values() if "device" in r}
    print(f"device: {', '.join(sorted(devices))}" + "".join(
        f"; {r['versions']}" for r in results.values() if "versions" in r))


if __name__ == "__main__":
  main()
