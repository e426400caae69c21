"""Progress and metrics: a log line per interval, ``metrics.jsonl`` and TensorBoard (process 0)."""

from __future__ import annotations

import json
import os
import time

import jax
from absl import logging


def _duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class MetricsLogger:
  """Writes one JSON object per logged step and the TensorBoard scalars; prints progress lines.

  ``truncate(step)`` drops lines past ``step`` from metrics.jsonl, so that a run resumed from the
  checkpoint of ``step`` leaves the same file as an uninterrupted one.
  """

  def __init__(self, workdir: str, num_steps: int, tokens_per_step: int, flops_per_token: float,
               peak_flops: float):
    self.active = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.num_steps, self.tokens_per_step = num_steps, tokens_per_step
    self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
    self.writer = None
    if self.active:
      from tensorboardX import SummaryWriter
      self.writer = SummaryWriter(os.path.join(workdir, "tensorboard"))
    self.mark(0)

  def mark(self, step: int) -> None:
    """Start timing throughput from ``step`` (call after the first, compiling step)."""
    self.t0, self.step0 = time.perf_counter(), step

  def truncate(self, step: int) -> None:
    if not self.active or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(self.path, "w") as f:
      f.writelines(keep)

  def write(self, step: int, metrics: dict) -> None:
    """Log the metrics of ``step`` (floats) with throughput since the last mark."""
    elapsed = time.perf_counter() - self.t0
    steps = step - self.step0
    tokens_per_s = steps * self.tokens_per_step / elapsed if steps > 0 and elapsed > 0 else 0.0
    mfu = tokens_per_s * self.flops_per_token / self.peak_flops
    eta = (self.num_steps - step) * elapsed / steps if steps > 0 else 0.0
    record = {"step": step, **metrics, "tokens_per_s": tokens_per_s, "mfu": mfu}
    if not self.active:
      return
    logging.info("step %d/%d | loss %.4f | acc %.3f | %s tok/s | MFU %.1f%% | ETA %s", step,
                 self.num_steps, metrics["loss"], metrics.get("accuracy", float("nan")),
                 f"{tokens_per_s:,.0f}", 100 * mfu, _duration(eta))
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    for k, v in record.items():
      if k != "step":
        self.writer.add_scalar(f"train/{k}", v, step)

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()


def quiet_orbax() -> None:
  """Hide orbax's INFO chatter (one line per file written) so the progress lines stay readable."""
  import logging as pylogging

  class _Filter(pylogging.Filter):
    def filter(self, record):
      return record.levelno >= pylogging.WARNING or "/orbax/" not in record.pathname

  pylogging.getLogger("absl").addFilter(_Filter())
