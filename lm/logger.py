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

  ``truncate(step)`` drops lines past ``step`` (and any line torn by a kill) from metrics.jsonl, so
  that a run resumed from the checkpoint of ``step`` leaves the same file as an uninterrupted one. Both files are flushed at
  every write, so a killed run keeps every logged step. MFU is reported only with a known
  ``peak_flops`` (None: the device's peak is unknown, e.g. a CPU).
  """

  def __init__(self, workdir: str, num_steps: int, tokens_per_step: int, flops_per_token: float,
               peak_flops: float | None):
    self.active = jax.process_index() == 0
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.num_steps, self.tokens_per_step = num_steps, tokens_per_step
    self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
    self.writer = None
    if self.active:
      # tensorboardX's synchronous events writer: SummaryWriter queues events for a background
      # thread, so a flush does not guarantee they are on disk when the process is killed.
      from tensorboardX.event_file_writer import EventsWriter
      os.makedirs(os.path.join(workdir, "tensorboard"), exist_ok=True)
      self.writer = EventsWriter(os.path.join(workdir, "tensorboard", "events"))
    self.mark(0)

  def mark(self, step: int) -> None:
    """Start timing throughput from ``step`` (call after the first, compiling step)."""
    self.t0, self.step0 = time.perf_counter(), step

  def truncate(self, step: int) -> None:
    if not self.active or not os.path.exists(self.path):
      return
    keep = []
    with open(self.path) as f:
      for line in f:
        try:
          record = json.loads(line)
        except ValueError:  # a line torn by a killed process
          continue
        if record["step"] <= step:
          keep.append(json.dumps(record) + "\n")
    with open(self.path, "w") as f:
      f.writelines(keep)

  def write(self, step: int, metrics: dict) -> None:
    """Log the metrics of ``step`` (floats) with throughput since the last mark."""
    elapsed = time.perf_counter() - self.t0
    steps = step - self.step0
    tokens_per_s = steps * self.tokens_per_step / elapsed if steps > 0 and elapsed > 0 else 0.0
    eta = (self.num_steps - step) * elapsed / steps if steps > 0 else 0.0
    record = {"step": step, **metrics, "tokens_per_s": tokens_per_s}
    mfu = ""
    if self.peak_flops:
      record["mfu"] = tokens_per_s * self.flops_per_token / self.peak_flops
      mfu = f" | MFU {100 * record['mfu']:.1f}%"
    if not self.active:
      return
    logging.info("step %d/%d | loss %.4f | acc %.3f | %s tok/s%s | ETA %s", step,
                 self.num_steps, metrics["loss"], metrics.get("accuracy", float("nan")),
                 f"{tokens_per_s:,.0f}", mfu, _duration(eta))
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    from tensorboardX.proto import event_pb2
    from tensorboardX.summary import scalar
    for k, v in record.items():
      if k != "step":
        self.writer.write_event(event_pb2.Event(wall_time=time.time(), step=step,
                                                summary=scalar(f"train/{k}", v)))
    self.writer.flush()

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()


def quiet_cpu_startup() -> None:
  """On a CPU-only run, hide JAX's start-up lines about the backends it did not find (libtpu,
  CUDA, TPU metadata): they are expected there. Call from an entry point, before jax starts."""
  import logging as pylogging

  class _Filter(pylogging.Filter):
    def filter(self, record):
      text = record.getMessage()
      return not ("libtpu" in text or "Unable to initialize backend" in text
                  or "metadata" in text.lower() and "tpu" in text.lower())

  for name in ("absl", "jax._src.xla_bridge", "jax"):
    pylogging.getLogger(name).addFilter(_Filter())


def quiet_orbax() -> None:
  """Hide orbax's INFO chatter (one line per file written) so the progress lines stay readable,
  and its warning that an item directory has no step metadata (``lm.checkpoint`` reads the
  ``state`` item of a step directly, which never has that file)."""
  import logging as pylogging

  class _Filter(pylogging.Filter):
    def filter(self, record):
      if "/orbax/" not in record.pathname:
        return True
      if record.levelno < pylogging.WARNING:
        return False
      return not (record.levelno == pylogging.WARNING
                  and record.getMessage().startswith("Metadata file does not exist"))

  pylogging.getLogger("absl").addFilter(_Filter())
