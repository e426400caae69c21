"""Running a script on several fake CPU devices, outside the calling (pytest) process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_on_four_devices(script: str, timeout: float) -> dict:
  """Run ``script`` (Python source) in a subprocess with 4 fake CPU devices, so that the device
  count flag does not reach the calling process; returns the JSON of its last "RESULT " line."""
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
  return json.loads(line[len("RESULT "):])
