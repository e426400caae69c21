"""How much recurrent state a multi-state layer keeps: the states and the segment moments.

Per segment and head a state is D x V numbers; per segment and moment group MERLIN keeps the mean
(R) and the second moment (R^2) of its small keys, Meanpool only the mean, Position and Vanilla
nothing. ``moment_overhead`` is the moments' size relative to the states'.
"""

from __future__ import annotations

import dataclasses

MOMENT_SIZES = {"merlin": lambda r: r + r * r, "meanpool": lambda r: r,
                "position": lambda r: 0, "vanilla": lambda r: 0}


@dataclasses.dataclass(frozen=True)
class StateMemory:
  """Bytes of recurrent state for ``num_segments`` segments (per head and per layer)."""

  state_bytes_per_head: int
  moment_bytes_per_head: float  # the layer's moments spread over its heads
  state_bytes_per_layer: int
  moment_bytes_per_layer: int
  num_segments: int

  @property
  def moment_overhead(self) -> float:
    """Moment bytes / state bytes (0.126 means the moments add 12.6%)."""
    return self.moment_bytes_per_layer / self.state_bytes_per_layer

  @property
  def total_bytes_per_layer(self) -> int:
    return self.state_bytes_per_layer + self.moment_bytes_per_layer

  def __str__(self) -> str:
    mib = lambda x: f"{x / 2 ** 20:.3f} MiB"
    return (f"{self.num_segments} segment(s): states {mib(self.state_bytes_per_layer)} + moments "
            f"{mib(self.moment_bytes_per_layer)} per layer (+{100 * self.moment_overhead:.1f}%); "
            f"per head {mib(self.state_bytes_per_head)} + {mib(self.moment_bytes_per_head)}")


def state_memory(num_heads: int, key_dim: int, value_dim: int, d_r: int, *,
                 moment_groups: int | None = None, aggregator: str = "merlin",
                 num_segments: int = 1, bytes_per_value: int = 4) -> StateMemory:
  """Recurrent-state and moment bytes of a multi-state layer.

  Args:
    num_heads, key_dim, value_dim: H heads of D x V states (Mamba-2: D = state_dim, V = head_dim).
    d_r: R, the size of the aggregator's small keys.
    moment_groups: how many k' groups keep moments: H (per head, default) or 1 (Mamba-2).
    aggregator: "merlin" (R + R^2), "meanpool" (R), "position" or "vanilla" (none).
    num_segments: segments held (max_segments for the worst case; 1 for the per-segment cost).
    bytes_per_value: 4 for float32 states.
  """
  if aggregator not in MOMENT_SIZES:
    raise ValueError(f"aggregator must be one of {tuple(MOMENT_SIZES)}, got {aggregator!r}")
  for name, value in (("num_heads", num_heads), ("key_dim", key_dim), ("value_dim", value_dim),
                      ("num_segments", num_segments), ("bytes_per_value", bytes_per_value)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  groups = num_heads if moment_groups is None else moment_groups
  if groups not in (1, num_heads):
    raise ValueError(f"moment_groups must be 1 or num_heads = {num_heads}, got {moment_groups!r}")
  per_segment = bytes_per_value * num_segments
  state_head = key_dim * value_dim * per_segment
  moments = groups * MOMENT_SIZES[aggregator](d_r) * per_segment
  return StateMemory(state_bytes_per_head=state_head, moment_bytes_per_head=moments / num_heads,
                     state_bytes_per_layer=num_heads * state_head, moment_bytes_per_layer=moments,
                     num_segments=num_segments)
