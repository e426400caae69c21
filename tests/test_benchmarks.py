"""The block and training-step benchmarks at tiny sizes: they run end to end on a CPU, and the
block benchmark's parts of the triadic layer compose to the layer's own output."""

from __future__ import annotations

import functools
import json
import re

import numpy as np
import pytest

from benchmarks import block
from benchmarks.common import is_oom, kernel_profile, kernel_regions, profile_table
from benchmarks.common import mosaic_kernel_name, regions_plot, regions_table


@pytest.mark.parametrize("e", [1, 3])
def test_triadic_parts_compose_to_the_layer(e):
  _, err = block.parts_setup(dict(block.TINY, batch=2), 37, e, impl="chunked", chunk=16)
  assert err < 1e-2


@pytest.mark.slow
def test_block_table_runs(capsys):
  block.main(["--tiny", "--T", "32", "--mixers", "attention,gdn,hybrid", "--hybrid-e", "2",
              "--no-parts", "--budget-s", "0", "--chunk", "16"])
  out = capsys.readouterr().out
  for row in ("| 32 | attention |", "| 32 | gdn |", "| 32 | hybrid |", "forward+backward ratios"):
    assert row in out
  assert "oom" not in out and "device: " in out and "command: " in out


def test_block_conv_formulations_agree(capsys):
  """``block.py --conv``: XLA's shifted slices, the depthwise lax.conv and the Pallas kernels
  (interpret mode) give the same output and gradients (to bf16 rounding), one row each."""
  import jax
  from layers.blocks import causal_conv
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 40, 12))
  w = jax.random.normal(jax.random.PRNGKey(1), (4, 12))
  np.testing.assert_allclose(block.depthwise_conv(x, w), causal_conv(x, w)[0], rtol=1e-5,
                             atol=1e-5)
  block.main(["--tiny", "--conv", "--T", "32", "--budget-s", "0"])
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 32 |")]
  assert len(rows) == 3 and all(float(r.split("|")[-2]) < 3e-2 for r in rows), rows
  assert "| pallas kernel |" in rows[2]


def test_kernel_profile_lists_the_ops_of_a_call():
  """Every op of a jitted call shows up once per call, whatever the number of calls profiled
  (on the CPU: the host's thunk events; on a GPU the same code reads the kernels)."""
  import jax
  import jax.numpy as jnp
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum(0) + jnp.exp(x).mean())
  rows, wall = kernel_profile(f, (jnp.ones((256, 256)),), reps=3)
  assert rows and wall > 0
  assert all(r.launches == 1 and r.ms >= 0 for r in rows), rows
  assert [r.ms for r in rows] == sorted((r.ms for r in rows), reverse=True)
  table = profile_table(rows, wall, top=1)
  assert table.count("\n") == len(["head", "rule", "top", "others", "total"]) - 1
  assert f"({len(rows) - 1} others)" in table
  # Each op names its source: its output shape and the JAX op of its name stack.
  sources = {r.name: r.source for r in rows}
  assert any("jit(<lambda>)/" in s for s in sources.values()), sources
  assert all(s.split()[0].startswith("f32[") for s in sources.values() if s), sources


def test_hlo_sources_name_the_ops():
  """Fusions without metadata of their own take their computation's; names are also keyed with
  '.' and '-' made '_', as the GPU names kernels."""
  import jax
  import jax.numpy as jnp
  from benchmarks.common import hlo_sources
  f = jax.jit(lambda x, y: jnp.sin(x * 2.0 + y).sum(1))
  sources = hlo_sources(f, (jnp.ones((8, 16)), jnp.ones((8, 16))))
  assert sources and all(isinstance(v, str) for v in sources.values())
  assert any("reduce_sum" in v for v in sources.values()), sources
  assert any(v.startswith("f32[8]") for v in sources.values()), sources
  dotted = [name for name in sources if "." in name]
  assert all(sources[name.replace(".", "_")] == sources[name] for name in dotted)
  assert hlo_sources(lambda x: x, (1.0,)) == {}


def test_hlo_moves_counts_copies_slices_custom_calls_and_remat_clones():
  """A hand-written module: a while body with a dynamic-update-slice fusion and a custom call, and
  a dynamic-update-slice in a command buffer the body calls; an entry copy and a rematerialized
  clone; and a compiled scan, whose stacked outputs are updated in its loop."""
  import jax
  import jax.numpy as jnp
  from benchmarks.common import hlo_moves, hlo_moves_table
  text = """HloModule m
%fused_dus (p0: bf16[4,8], p1: bf16[1,8], p2: s32[]) -> bf16[4,8] {
  ROOT %dus = bf16[4,8]{1,0} dynamic-update-slice(%p0, %p1, %p2, %p2)
}
%command_buffer (q0: bf16[4,8], q1: bf16[1,8], q2: s32[]) -> bf16[4,8] {
  ROOT %dus.1 = bf16[4,8]{1,0} dynamic-update-slice(%q0, %q1, %q2, %q2)
}
%body (arg: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %k = bf16[1,8]{1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2"
  %f = bf16[4,8]{1,0} fusion(%s, %k, %i), kind=kLoop, calls=%fused_dus
  %g = bf16[4,8]{1,0} call(%f, %k, %i), to_apply=%command_buffer
  ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%i, %g)
}
ENTRY %main (a: f32[16,16]) -> f32[16,16] {
  %w = (s32[], bf16[4,8]{1,0}) while(%init), condition=%cond, body=%body
  %c = f32[16,16]{1,0} copy(%a)
  ROOT %e.remat = f32[16,16]{1,0} exponential(%c)
}
"""
  rows = {(k, w): (n, mb) for k, w, n, mb in hlo_moves(text)}
  assert rows[("fusion rooted in dynamic-update-slice", "loop")][0] == 1
  assert rows[("custom-call mosaic_gpu_v2", "loop")] == (1, 16 / 2**20)
  assert rows[("copy", "once")] == (1, 1024 / 2**20)
  assert rows[("rematerialized exponential", "once")][0] == 1
  assert ("dynamic-update-slice", "once") not in rows      # inside a fusion: not its own row
  assert rows[("dynamic-update-slice", "loop")] == (1, 64 / 2**20)   # in the command buffer
  assert "| custom-call mosaic_gpu_v2 | loop | 1 |" in hlo_moves_table(hlo_moves(text))

  def f(x):
    return jax.lax.scan(lambda c, _: (jnp.sin(c), jnp.cos(c)), x, None, length=5)[1].sum()
  compiled = jax.jit(jax.grad(f)).lower(jnp.ones((64,))).compile().as_text()
  assert any(w == "loop" and "dynamic-update-slice" in k for k, w, _, _ in hlo_moves(compiled))


def test_kernel_regions_sum_each_regions_own_cycles(tmp_path):
  """A trace as Mosaic GPU's profiler writes it (two programs of two warpgroups, one loop step
  each; timestamps in clock cycles / 1000): each region's own cycles (without its nested
  regions) per warpgroup, a name reopened inside itself counted once, what no region covers, the
  per-step table and its PNG."""
  def trace(tid, marks):                  # marks: (name, "B" or "E", cycle)
    return [{"name": n, "ph": ph, "ts": 5.0 + c / 1e3, "pid": 1, "tid": tid} for n, ph, c in marks]

  wg0 = [("stage", "B", 0), ("wait k", "B", 10), ("wait k", "E", 40), ("stage", "B", 50),
         ("stage", "E", 60), ("stage", "E", 100), ("update", "B", 100), ("update", "E", 120)]
  wg1 = [("stage", "B", 0), ("stage", "E", 30), ("update", "B", 40), ("update", "E", 50)]
  events = trace(1, wg0) + trace(2, wg1) + trace(3, wg0) + trace(4, wg1)
  path = tmp_path / "kernel-1-trace.json"
  path.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))
  got = kernel_regions(str(path), warpgroups=2)
  assert got.traces == [2, 2] and got.steps == [1, 1]
  assert got.span == pytest.approx([240, 100])
  assert list(got.cycles[0]) == ["stage/wait k", "stage", "update"]
  assert got.cycles[0] == pytest.approx({"stage/wait k": 60, "stage": 140, "update": 40})
  assert got.cycles[1] == pytest.approx({"stage": 60, "update": 20})
  table = regions_table(got)
  assert "| stage/wait k | 30 | 25.0% | 0 | 0.0% |" in table
  assert "| stage | 70 | 58.3% | 30 | 60.0% |" in table
  assert "| (no region) | 0 | 0.0% | 10 | 20.0% |" in table
  assert "| program span | 120 | 100.0% | 50 | 100.0% |" in table
  png = regions_plot({"kernel": got}, str(tmp_path / "regions.png"), "two programs")
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  # the profiler's row of a kernel whose trace file is "triadic_forward_mgpu-<ns>-trace.json"
  assert mosaic_kernel_name("triadic_forward_mgpu_mosaic_gpu_kernel") == "triadic_forward_mgpu"
  assert mosaic_kernel_name("triadic_forward_mgpu_wg2_mosaic_gpu") == "triadic_forward_mgpu_wg2"


def test_is_oom():
  assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
  assert not is_oom(ValueError("bad shape"))


@pytest.mark.slow
def test_train_step_table_runs(capsys):
  from benchmarks import train_step
  train_step.main(["--tiny", "--mixers", "fla,gdn", "--steps", "1", "--warmup", "1",
                   "--remat", "save_mixer_op", "--in-process", "--profile", "--hlo"])
  out = capsys.readouterr().out
  assert "| gdn | save_mixer_op |" in out and "tokens/s" in out
  assert "## gdn: one training step by kernel" in out and "jit(traced)" in out
  assert "## gdn: the compiled step's data movement" in out and "| copy |" in out
  assert "| fla |" in out  # a measured row, or skipped with the reason when torch / fla are absent
  row = next(line for line in out.splitlines() if line.startswith("| gdn |"))
  assert re.search(r"\| [0-9.]+ \([0-9.]+ \+ [0-9.]+\) \|", row)  # first step (lower + compile)


def test_train_step_timeout_names_the_last_phase():
  from benchmarks import train_step
  stderr = ("noise\nPROGRESS state initialised; lowering the step\n"
            "PROGRESS lowered in 2.5 s; XLA compiling\n")
  assert train_step._last_progress(stderr) == " (last: lowered in 2.5 s; XLA compiling)"
  assert train_step._last_progress(stderr.encode()) == " (last: lowered in 2.5 s; XLA compiling)"
  assert train_step._last_progress(None) == ""


def test_train_step_config_overrides():
  from benchmarks import train_step
  from lm.config import eval_lengths, validate
  job = dict(config="configs/lm_400m.py:mqar", batch=3, seq=4096, steps=1, warmup=1, remat="dots",
             fla_remat=False, set=["model.d_r=32"], tiny=False, mixer="merlin")
  c = train_step.build_config(job)
  assert (c.model.mixer, c.model.aggregator, c.model.remat, c.model.d_r) == (
      "multistate_gdn", "merlin", "dots", 32)
  assert c.model.segment_len * c.model.max_segments >= 4096 and c.train.batch_size == 3
  tiny = train_step.build_config(dict(job, seq=64, tiny=True))  # its evaluations are longer
  assert max(n for _, n in eval_lengths(tiny.data)) > 64
  validate(tiny)  # raises unless the model holds the training and every evaluation length
  assert train_step.model_shape(dict(job, mixer="gdn"))["d_model"] == 1024
  with pytest.raises(ValueError, match="unknown mixer"):
    train_step.build_config(dict(job, mixer="mamba7"))


def test_merlin_ops_table_runs(capsys):
  """The multi-state op benchmark at tiny sizes: every impl, the single-state row, both tables;
  the pallas impl with the intra-chunk kernels and a row per ``--intra-forward`` and
  ``--intra-backward`` launch, whose output and gradients (the error columns) are the first
  impl's."""
  from benchmarks import merlin_ops
  merlin_ops.main(["--T", "80", "--H", "1", "--D", "16", "--V", "16", "--R", "8",
                   "--segment-len", "32", "--chunk", "16", "--impls", "chunked,pallas",
                   "--aggregators", "meanpool", "--repeats", "1", "--no-floors",
                   "--tiles", "intra_kernel=True,intra_backward_kernel=True",
                   "--intra-forward", "4,8", "--intra-backward", "4,16,8"])
  out = capsys.readouterr().out
  for row in ("multistate chunked |", "multistate pallas |", "gdn E=1 chunked |", "meanpool |",
              "fla log-linear", "multistate_attention plan: chunked"):
    assert row in out, row
  for name in ("multistate pallas |", "intra fwd 4,8 |", "intra bwd 4,16,8 |"):
    row = next(line for line in out.splitlines() if line.strip().startswith(name))
    errs = [float(x) for x in row.split("|")[-2:]]   # output, gradients: float32 here
    assert max(errs) < 1e-4, (name, errs)
  fl, by = merlin_ops.multistate_cost(1, 2048, 16, 128, 128, 128, 256, 64, aggregator="vanilla")
  gfl, gby = merlin_ops.multistate_cost(1, 2048, 16, 128, 128, 128, 2048, 64, aggregator="vanilla")
  assert fl > 2 * gfl and by > gby  # 8 segments: the stack's work dominates


def test_merlin_ops_query_walk_tiles(capsys):
  """``--tiles query_walk=True --no-backward`` times the erase forward by the query walk: the
  flag parses as a bool and the printed plan says the walk is on; ``--op-variants`` adds a
  pallas row per set, its fields over --tiles' config."""
  from benchmarks import merlin_ops
  assert merlin_ops.tiles_config("query_walk=True,block_v=16").query_walk is True
  assert merlin_ops.tiles_config("query_walk=False").query_walk is False
  walk = merlin_ops.tiles_config("query_walk=True")
  both = merlin_ops.tiles_config("block_v=8", base=walk)
  assert (both.query_walk, both.block_v) == (True, 8)
  assert merlin_ops.tiles_config("", base=walk) is walk
  merlin_ops.main(["--T", "80", "--H", "1", "--D", "16", "--V", "16", "--R", "8",
                   "--segment-len", "32", "--chunk", "16", "--impls", "pallas",
                   "--aggregators", "merlin", "--repeats", "1", "--no-floors", "--no-backward",
                   "--tiles", "query_walk=True", "--op-variants", "block_v=8"])
  out = capsys.readouterr().out
  assert "query walk): --tiles query_walk=True" in out
  assert "multistate pallas |" in out
  row = next(line for line in out.splitlines() if line.strip().startswith("pallas block_v=8 |"))
  assert float(row.split("|")[-2]) < 1e-5    # the same function as the first pallas row


def test_merlin_parts_table_runs(capsys):
  """The pallas op's parts table at a tiny size (interpret-mode kernels): one row per part, every
  cell a number or "-", and the glue the op less its parts."""
  from benchmarks import merlin_ops
  merlin_ops.main(["--parts", "--T", "80", "--H", "1", "--D", "16", "--V", "16", "--R", "8",
                   "--segment-len", "32", "--chunk", "16", "--repeats", "1"])
  out = capsys.readouterr().out
  assert "intra_chunk compiled: forward " in out and "plan: pallas" in out
  rows = {}
  for line in out.splitlines():
    cells = [x.strip() for x in line.strip().strip("|").split("|")]
    if line.startswith("| ") and cells[0] != "part":
      rows[cells[0].lstrip("- ")] = [np.nan if x == "-" else float(x) for x in cells[1:]]
  assert list(rows) == ["intra_chunk", "kernels fwd", "span maps", "state pass", "readout",
                        "kernels bwd", "span maps, Phi", "reverse pass", "chunk gradients",
                        "span sums", "glue", "op", "op, grads only"]
  assert all(len(r) == 7 for r in rows.values())
  assert np.isnan(rows["op, grads only"][0]) and rows["op, grads only"][1] > 0
  for name in ("intra_chunk", "kernels fwd", "op"):
    fwd, fb, floor_fwd, floor_fb = rows[name][:4]
    assert fwd > 0 and fb > 0 and floor_fwd > 0 and floor_fb > 0, name
  assert np.isnan(rows["kernels bwd"][0]) and rows["kernels bwd"][1] > 0
  parts = sum(rows[k][1] for k in ("intra_chunk", "kernels fwd", "kernels bwd", "glue"))
  assert abs(parts - rows["op"][1]) < 2e-3 + 1e-2 * rows["op"][1]  # rounded to 3 decimals
  assert rows["op"][6] == 100.0
  # the forward stages' FLOPs are the algorithm's, plus the UT inverse's block merges (C = 64:
  # 16 x 16 blocks into 32 x 32, then into 64 x 64; 2 C s^2 each), per chunk and head; with
  # erase, the span form maps the 144 - 32 visible pairs of finished states by 21 span
  # crossings (one (D, D) x (D, V) product each) instead of their chunk maps (two (C, D) x (D, V)
  # ones), and forms the 32 chunks' Phi and P (three (C, D) x (D, D) products each)
  for erase in (True, False):
    costs = merlin_ops.part_costs(1, 2048, 16, 128, 128, 256, 64, erase=erase, itemsize=2)
    fl, _ = merlin_ops.multistate_cost(1, 2048, 16, 128, 128, 128, 256, 64, erase=erase,
                                       aggregator="vanilla")
    fwd = ("intra_chunk", *(("span maps", "state pass") if erase else ("write pass",)),
           "readout")
    ut = 2 * 64 * (16 ** 2 + 32 ** 2) if erase else 0
    mm, cross = 2 * 64 * 128 * 128, 2 * 128 ** 3  # (C, D) x (D, V or D); (D, D) x (D, V)
    span = (21 * cross - 112 * 2 * mm + 32 * 3 * mm) if erase else 0
    assert sum(costs[k][0] for k in fwd) == fl + 16 * (32 * ut + span)


def test_kernels_of_the_op():
  """The resource report's kernels, from one lowering of the op's Hopper backward: every
  Pallas-Triton kernel once, with its TTIR and the num_warps / num_stages its custom call asks
  for; every Mosaic GPU kernel once, with its launch grid, threads and shared memory."""
  from benchmarks import triton_registers
  from triadic.pallas import mosaic, mosaic_backward
  from triadic.pallas import ops as pops
  for e, tail in ((1, "triadic_chunk_backward_tail_fused"), (4, "triadic_chunk_backward_tail_ut")):
    cfg = pops.default_config("gpu", e, 64, bh=2, hopper=True)
    assert cfg.mosaic_gpu and cfg.mosaic_gpu_backward
    kernels, mosaic_kernels = triton_registers.lowered_kernels(
        *triton_registers.triadic_grad(1, 128, 2, 64, 64, e, True, cfg))
    by_name = {k.name: k for k in kernels}
    assert len(by_name) == len(kernels)
    assert set(by_name) == {"triadic_chunk_prep", "triadic_ut_inverse", tail}
    for kernel in kernels:
      assert f"tt.func public @{kernel.name}(" in kernel.ttir
    tiles = mosaic_backward.TAIL_TILES[e <= mosaic_backward.FUSED_TAIL_MAX_E]
    assert (by_name[tail].num_warps, by_name[tail].num_stages) == (
        tiles["bwd_num_warps"], tiles["num_stages"])
    assert by_name["triadic_ut_inverse"].num_warps == 1

    assert len(set(mosaic_kernels)) == len(mosaic_kernels)
    assert {"triadic_forward_mgpu", "triadic_backward_states_mgpu",
            "triadic_chunk_backward_slices"} <= {k.name.removesuffix("_wg2")
                                                 for k in mosaic_kernels}
    forward = next(k for k in mosaic_kernels if k.name.startswith("triadic_forward_mgpu"))
    bv = 64 // forward.grid[0]                 # grid (V / block_v, B * H, 1): value blocks fastest
    assert forward.grid == (64 // bv, 2, 1) and forward.threads in (128, 256)
    # The forward's SMEM holds at least its bf16 state operand, D x E * block_v.
    assert mosaic.SMEM_LIMIT >= forward.smem >= 64 * e * bv * 2
    assert forward.blocks_per_sm == 233472 // (forward.smem + 1024) >= 1
    assert forward.waves(132) == pytest.approx(2 * 64 / bv / (132 * forward.blocks_per_sm))


def test_smem_count_of_the_two_warpgroup_passes():
  """``mosaic.smem_bytes_2wg`` is the shared memory the lowering asks for (``triton_registers``
  reads it from the Mosaic GPU module): the two-warpgroup state passes with erase and their
  saved extras (save_x, save_drhs), at E = 8 block_v 16 (the default reverse pass there), E = 8
  block_v 32 and E = 4 block_v 32."""
  from benchmarks import triton_registers
  from tests.test_mosaic_gpu import kernel_arg_specs
  from triadic.pallas import mosaic
  bh, nc, c, d, vd = 2, 2, 64, 128, 128
  for e, bv in ((8, 16), (8, 32), (4, 32)):
    args = kernel_arg_specs([(bh, nc, c, d)] * 2 + [(bh, nc, c, vd)], bh=bh, nc=nc, c=c, d=d,
                            vdim=vd, e=e)
    kw = dict(scale=1.0, erase=True, warpgroups=2, block_v=bv)
    for backward, fn in ((False, functools.partial(mosaic.state_pass, save_x=True, **kw)),
                         (True, functools.partial(mosaic.reverse_state_pass, save_drhs=True,
                                                  **kw))):
      _, (kernel,) = triton_registers.lowered_kernels(fn, args)
      assert kernel.smem == mosaic.smem_bytes_2wg(d, c, e, bv, backward), (e, bv, kernel.name)


def test_smem_of_the_lean_forward():
  """``triton_registers`` lowers the op's primal, whose one-warpgroup forward state pass asks for
  E * D * block_v bf16 less SMEM than the same pass with residuals (no chunk-start state buffer;
  E = 8, D = V = 128, block_v 16, the op's default there)."""
  from benchmarks import triton_registers
  from tests.test_mosaic_gpu import kernel_arg_specs
  from triadic.pallas import mosaic
  from triadic.pallas import ops as pops
  cfg = pops.default_config("gpu", 8, 128, bh=2, hopper=True)
  _, (primal,) = triton_registers.lowered_kernels(
      *triton_registers.triadic_primal(1, 128, 2, 128, 128, 8, True, cfg))
  assert primal.name == "triadic_forward_mgpu"
  bh, nc, c, d = 2, 2, 64, 128
  args = kernel_arg_specs([(bh, nc, c, d)] * 3, bh=bh, nc=nc, c=c, d=d, vdim=d, e=8)
  smem = {}
  for residuals in (False, True):
    fn = functools.partial(mosaic.state_pass, scale=1.0, erase=True, block_v=16,
                           residuals=residuals)
    _, (kernel,) = triton_registers.lowered_kernels(fn, args)
    smem[residuals] = kernel.smem
  assert smem[True] - smem[False] == 8 * 128 * 16 * 2
  assert primal.smem == smem[False]


def test_kernels_of_the_conv():
  """``triton_registers --conv``: the short convolution's two Triton kernels, each once, with the
  warps their custom calls ask for."""
  from benchmarks import triton_registers
  from layers.conv_kernel import Tiles
  for documents in (False, True):
    kernels, mosaic_kernels = triton_registers.lowered_kernels(
        *triton_registers.conv_grad(1, 64, 48, 4, documents))
    assert not mosaic_kernels
    assert {k.name: k.num_warps for k in kernels} == {
        "causal_conv_forward": Tiles().num_warps, "causal_conv_backward": Tiles().bwd_num_warps}


def test_parse_ptxas():
  from benchmarks.triton_registers import parse_ptxas
  report = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
            "ptxas info    : Function properties for k\n"
            "    1032 bytes stack frame, 1048 bytes spill stores, 1052 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers, 1032 bytes cumulative stack size\n")
  assert parse_ptxas(report) == (255, 1048, 1052)
  with pytest.raises(ValueError, match="no register"):
    parse_ptxas("ptxas info    : 0 bytes gmem\n")


def test_triton_registers_compiles_a_kernel():
  """With the triton package (an optional extra), a kernel compiles for sm_90a on this CPU."""
  pytest.importorskip("triton")
  from benchmarks import triton_registers
  from triadic.pallas import ops as pops
  cfg = pops.default_config("gpu", 1, 64, bh=2, hopper=True)
  kernels = triton_registers.triton_kernels(
      *triton_registers.triadic_grad(1, 128, 2, 64, 64, 1, True, cfg))
  use = triton_registers.usage(next(k for k in kernels if k.name == "triadic_chunk_prep"))
  assert 0 < use.registers <= 255 and use.shared > 0 and use.spill_stores >= 0


@pytest.mark.parametrize("mechanism", ["st.async", "push", "pull", "bulk", "local"])
def test_dsmem_exchange_kernels_lower_for_cuda(mechanism):
  """``dsmem_exchange.py``'s kernels (a cluster of 8 blocks, 16-column parts) pass the Mosaic GPU
  lowering; the expected sums are sum_s (s + 1) * sum_r (r + 1), or for ``local`` E (s + 1) *
  sum_r (r + 1)."""
  import jax
  from benchmarks import dsmem_exchange as dx
  fn = dx.exchange_kernel(mechanism, e=8, c=64, v=128, rounds=3, clusters=2)
  text = jax.jit(fn).trace().lower(lowering_platforms=("cuda",)).as_text()
  assert f"dsmem_{mechanism.replace('.', '_')}" in text
  want = dx.expected(mechanism, 8, 64, 128, 3, 2)[1, :, 5, 7]
  assert want.tolist() == ([8 * (s + 1) * 6 for s in range(8)] if mechanism == "local"
                           else [36 * 6] * 8)
  with pytest.raises(ValueError, match="mechanism"):
    dx.exchange_kernel("tma", e=8, c=64, v=128, rounds=3, clusters=2)
  if mechanism == "bulk":                    # 32-column parts: another swizzle for the copies
    fn = dx.exchange_kernel(mechanism, e=4, c=64, v=128, rounds=3, clusters=2)
    assert "cp.async.bulk.shared::cluster" in jax.jit(fn).trace().lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.slow
def test_loss_curves_of_pallas_and_chunked_agree_and_a_preempted_run_ends_the_sweep(
    tmp_path, capsys, monkeypatch):
  """The MQAR job's first training steps: the Pallas op (interpret mode) trains the model that the
  chunked op trains, to float32 rounding; a run with another learning rate is told apart. That
  run is stopped early by the loop (its preemption path, here ``stop_at``): it ends the sweep
  (the scan run after it never starts), and the table names the steps it compared, the steps
  every run logged and each run's own. (One sweep for both checks: each run is a compile.)"""
  from benchmarks import loss_curves
  from lm import train_loop
  real_train, calls = train_loop.train, []

  def train(config, workdir):
    calls.append(workdir)
    stop_at = (lambda step: step >= 4) if len(calls) == 3 else None
    return real_train(config, workdir, stop_at=stop_at)

  monkeypatch.setattr(train_loop, "train", train)
  changed = "model.impl=chunked,train.learning_rate=0.05"
  curves = loss_curves.main(["--steps", "6", "--log-every", "2", "--workdir", str(tmp_path),
                             "--out", str(tmp_path / "curves.png"), "--variants",
                             "model.impl=chunked", "model.impl=pallas", changed,
                             "model.impl=scan"])
  assert len(calls) == 3 and list(curves) == ["model.impl=chunked", "model.impl=pallas", changed]
  assert sorted(curves["model.impl=chunked"]) == sorted(curves["model.impl=pallas"]) == [2, 4, 6]
  assert sorted(curves[changed]) == [2, 4]
  diffs = loss_curves.differences(curves)
  assert diffs["model.impl=pallas"][0] < 1e-4   # over steps 2, 4 and 6
  assert diffs[changed][0] > 1e-2               # over steps 2 and 4 (0.27 at step 4)
  out = capsys.readouterr().out
  assert "| against model.impl=chunked |" in out and (tmp_path / "curves.png").stat().st_size > 0
  assert "# run 2 stopped at step 4 of 6 (preempted)" in out
  assert "over steps 2-4 (2 logged by every run)" in out
  assert "| model.impl=pallas | 2-6 (3) |" in out
  assert f"| {changed} | 2-4 (2) |" in out


def test_loss_curves_reject_a_variant_without_a_value():
  from benchmarks import loss_curves
  with pytest.raises(ValueError, match="key=value"):
    loss_curves.variant_config("configs/mqar.py", [], "model.impl", 2, 1)
