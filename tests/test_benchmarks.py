"""The block and training-step benchmarks at tiny sizes: they run end to end on a CPU, and the
block benchmark's parts of the triadic layer compose to the layer's own output."""

from __future__ import annotations

import pytest

from benchmarks import block
from benchmarks.common import is_oom


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


def test_is_oom():
  assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
  assert not is_oom(ValueError("bad shape"))
