"""Public chunk GDN kernels (PyTorch) timed on the same inputs as ours, in the same process.

The peers are FLA's Triton ``chunk_gated_delta_rule`` (``flash-linear-attention`` / ``fla-core``)
and FlashQLA's fused Hopper kernels (``flash-qla`` + ``tilelang``). Each is optional: a peer whose
package does not import is reported as missing, never an error. Inputs come from the JAX arrays
through DLPack, so both sides read the same numbers.

FLA 0.6 would route grad-free bf16 calls to FlashQLA when it is importable; ``FLA_FLASH_QLA=0``
is set before importing it so that the "fla" row is always FLA's own Triton path.

Beside those GDN kernels (E = 1), the triadic paper's authors' own kernels run at every E
(``AUTHORS``: ``cute-triadic-gdn``, CuTe DSL, Hopper only, D = V = 128, E in {1, 2, 4, 8, 12,
16}; it needs ``nvidia-cutlass-dsl`` 4.7.1: ``pack_authors.sh`` packs both for the GPU machine
and says how to install them there). ``time_authors`` times them on the same inputs as our
triadic op.
"""

from __future__ import annotations

import argparse
import os
import statistics

PEERS = ("fla", "flashqla")
AUTHORS = "cute-triadic-gdn"
AUTHORS_E = (1, 2, 4, 8, 12, 16)


def _torch():
  try:
    import torch
  except ImportError:
    return None
  return torch if torch.cuda.is_available() else None


def peer_fn(name: str):
  """(the peer's ``chunk_gated_delta_rule``, None) or (None, why it is missing)."""
  if _torch() is None:
    return None, "torch with CUDA not importable"
  try:
    if name == "fla":
      os.environ["FLA_FLASH_QLA"] = "0"
      from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    elif name == "flashqla":
      from flash_qla import chunk_gated_delta_rule
    else:
      raise ValueError(f"peer must be one of {PEERS}, got {name!r}")
  except ImportError as err:
    return None, f"{type(err).__name__}: {err}"[:200]
  return chunk_gated_delta_rule, None


def _time_cuda(torch, fn, reps: int) -> float:
  """Median ms of ``fn()`` over ``reps`` calls after two warm-ups, by CUDA events."""
  for _ in range(2):
    fn()
  torch.cuda.synchronize()
  times = []
  for _ in range(reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end))
  return statistics.median(times)


def time_gdn_peers(q, k, v, g, beta, reps: int, peers=PEERS) -> dict:
  """{peer: (fwd ms, fwd+bwd ms) or reason string} for Gated DeltaNet on JAX inputs q, k (B, T,
  H, D), v (B, T, H, V) in bf16, g (B, T, H) log decay and beta (B, T, H) float32."""
  torch = _torch()
  out = {}
  for name in peers:
    fn, why = peer_fn(name)
    if fn is None:
      out[name] = why
      continue
    qt, kt, vt = (torch.from_dlpack(x).clone() for x in (q, k, v))
    gt = torch.from_dlpack(g).float().clone()
    bt = torch.from_dlpack(beta).to(qt.dtype).clone()
    scale = q.shape[-1] ** -0.5
    try:
      with torch.no_grad():
        fwd = _time_cuda(torch, lambda: fn(qt, kt, vt, gt, bt, scale=scale), reps)
      leaves = [x.detach().requires_grad_(True) for x in (qt, kt, vt, gt, bt)]
      do = torch.ones_like(vt)

      def fwd_bwd():
        o = fn(*leaves, scale=scale)[0]
        o.backward(do)

      fb = _time_cuda(torch, fwd_bwd, reps)
      out[name] = (fwd, fb)
    except Exception as err:  # a peer that fails on this shape is reported, not fatal
      out[name] = f"{type(err).__name__}: {err}"[:200]
    torch.cuda.empty_cache()
  return out


def authors_fn():
  """(the authors' ``chunk_gdn_joint``, None) or (None, why it is missing)."""
  # torch is imported first (``_torch``): cutlass appends a folder with its own torch.py to
  # sys.path.
  if _torch() is None:
    return None, "torch with CUDA not importable"
  try:
    from cute_triadic_gdn import chunk_gdn_joint
  except ImportError as err:
    return None, f"{type(err).__name__}: {err}"[:200]
  return chunk_gdn_joint, None


def _authors_call(q, k, v, k2, q2, g, beta):
  """(the authors' function, its torch inputs in the dtypes their contract asks: q, k, v bf16,
  k2, q2, g, beta float32), or (None, why they cannot run on these inputs)."""
  fn, why = authors_fn()
  if fn is None:
    return None, why
  e = k2.shape[-1]
  if e not in AUTHORS_E or q.shape[-1] != 128 or v.shape[-1] != 128 or q.shape[1] % 64:
    return None, (f"E={e}, D={q.shape[-1]}, V={v.shape[-1]}, T={q.shape[1]}: outside their "
                  "kernels' sizes")
  torch = _torch()
  return fn, ([torch.from_dlpack(x).to(torch.bfloat16).contiguous() for x in (q, k, v)]
              + [torch.from_dlpack(x).float().contiguous() for x in (k2, q2, g, beta)])


def _authors_backward(fn, inputs, scale):
  """A call of the authors' forward+backward on leaf copies of ``inputs``, pulling ones back
  through o (they have no final-state output)."""
  torch = _torch()
  leaves = [x.detach().requires_grad_(True) for x in inputs]
  do = torch.ones_like(leaves[2])
  return lambda: fn(*leaves, scale=scale).backward(do)


def time_authors(q, k, v, k2, q2, g, beta, reps: int):
  """(fwd ms, fwd+bwd ms) or the reason string, of the authors' triadic kernels on the JAX inputs
  of our op: q, k (B, T, H, 128), v (B, T, H, 128) in bf16, k2, q2, g (B, T, H, E), beta (B, T,
  H). Their contract asks k2, q2, g and beta in float32 and T a multiple of 64. The forward is
  timed without gradients (their plain autograd function then saves nothing, as our primal);
  the forward+backward pulls back ones through o (they have no final-state output)."""
  fn, inputs = _authors_call(q, k, v, k2, q2, g, beta)
  if fn is None:
    return inputs
  torch = _torch()
  scale = q.shape[-1] ** -0.5
  try:
    with torch.no_grad():
      fwd = _time_cuda(torch, lambda: fn(*inputs, scale=scale), reps)
    fb = _time_cuda(torch, _authors_backward(fn, inputs, scale), reps)
  except Exception as err:  # reported, not fatal
    return f"{type(err).__name__}: {err}"[:200]
  finally:
    torch.cuda.empty_cache()
  return fwd, fb


def authors_kernels(q, k, v, k2, q2, g, beta, reps: int = 5):
  """The authors' forward+backward under the PyTorch profiler, on the inputs of ``time_authors``:
  [(kernel, launches per call, device ms per call)], longest first, or the reason string."""
  fn, inputs = _authors_call(q, k, v, k2, q2, g, beta)
  if fn is None:
    return inputs
  torch = _torch()
  from torch.profiler import ProfilerActivity, profile
  step = _authors_backward(fn, inputs, q.shape[-1] ** -0.5)
  try:
    for _ in range(2):
      step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
      for _ in range(reps):
        step()
      torch.cuda.synchronize()
  except Exception as err:  # reported, not fatal
    return f"{type(err).__name__}: {err}"[:200]
  rows = [(e.key, e.count / reps, e.device_time_total / 1e3 / reps)
          for e in prof.key_averages() if e.device_time_total > 0]
  return sorted(rows, key=lambda r: -r[2])


def warm(shapes, h=16, d=128, peers=PEERS) -> None:
  """Compile each peer's forward and backward at every (B, T) of ``shapes`` (random bf16 inputs,
  one call each) so that a later run in the same TileLang / Triton caches times, not compiles."""
  torch = _torch()
  if torch is None:
    print("# warm: torch with CUDA not importable")
    return
  for name in peers:
    fn, why = peer_fn(name)
    if fn is None:
      print(f"# warm {name}: missing ({why})")
      continue
    for b, t in shapes:
      gen = torch.Generator(device="cuda").manual_seed(0)
      rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)
      unit = lambda x: x / x.norm(dim=-1, keepdim=True)
      q, k = (unit(rnd(b, t, h, d)).bfloat16().requires_grad_(True) for _ in range(2))
      v = rnd(b, t, h, d).bfloat16().requires_grad_(True)
      g = (-0.1 * torch.nn.functional.softplus(rnd(b, t, h))).requires_grad_(True)
      beta = torch.sigmoid(rnd(b, t, h)).bfloat16().requires_grad_(True)
      fn(q, k, v, g, beta, scale=d ** -0.5)[0].backward(torch.ones_like(v))
      torch.cuda.synchronize()
      print(f"# warm {name}: B={b} T={t} compiled")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description="compile the peers' kernels (fills their caches)")
  parser.add_argument("--warm", type=int, nargs="+", required=True, metavar="T",
                      help="sequence lengths; B = 32768 // T")
  warm([(max(1, 32768 // t), t) for t in parser.parse_args().warm])
