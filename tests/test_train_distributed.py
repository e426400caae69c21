"""The sharded step on 8 fake CPU devices (data x tensor) and a two-process jax.distributed run
both give the loss of one device. The sharded and distributed runs are subprocesses so their
flags stay out of pytest; the one-device reference (this process's own single CPU device, the
same tiny config, steps and XLA flags) trains here, before the subprocesses."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.train_util import distributed_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json, sys, jax
    if {coordinator!r}:
      jax.distributed.initialize({coordinator!r}, num_processes=2, process_id={process_id})
    from lm import train_loop
    from tests.train_util import distributed_config
    last = train_loop.train(distributed_config(data={data}, tensor={tensor}), {workdir!r})
    print("RESULT", json.dumps(last))
""")


def run(tmp_path, name, *, devices=1, data=1, tensor=1, coordinator="", process_id=0, wait=True):
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
  code = SCRIPT.format(coordinator=coordinator, process_id=process_id, data=data, tensor=tensor,
                       workdir=str(tmp_path / name))
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  return proc if not wait else result(proc)


def result(proc):
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
  return json.loads(line[len("RESULT "):])


def test_sharded_step_and_two_processes_match_one_device(tmp_path):
  """One reference run on one device; the sharded run (8 devices, data 4 x tensor 2) gives its loss
  and gradient norm; two jax.distributed processes (data 2) agree with each other and with it."""
  import jax
  from lm import train_loop
  assert jax.device_count() == 1
  one = train_loop.train(distributed_config(), str(tmp_path / "one"))
  eight = run(tmp_path, "eight", devices=8, data=4, tensor=2)
  assert eight["step"] == one["step"] == 3
  assert eight["loss"] == pytest.approx(one["loss"], rel=1e-5)
  assert eight["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  coord = f"127.0.0.1:{port}"
  procs = [run(tmp_path, "multi", devices=1, data=2, coordinator=coord, process_id=i, wait=False)
           for i in range(2)]
  a, b = [result(p) for p in procs]
  assert a["step"] == b["step"] == 3
  assert a["loss"] == b["loss"]
  assert a["loss"] == pytest.approx(one["loss"], rel=1e-5)
