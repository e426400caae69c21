"""Multi-state linear attention and MERLIN segment aggregation (docs/spec.md section 2).

``multistate_attention`` is the op (scan oracle, chunk-parallel form and Pallas kernels behind
one ``impl`` switch); the aggregators turn small keys/queries into segment weights lam;
``MultiStateGDN`` and ``MultiStateMamba2`` are the Flax Linen mixers (``Mamba2`` the single-state
one); ``state_memory`` reports what the segments and their moments cost.
"""

from merlin.aggregators import meanpool_weights, merlin_weights, position_weights, vanilla_weights
from merlin.aggregator_layers import (AGGREGATORS, MeanpoolAggregator, MerlinAggregator,
                                      PositionAggregator, VanillaAggregator, make_aggregator)
from merlin.layers import MultiStateGDN, MultiStateMamba2
from merlin.mamba2 import Mamba2
from merlin.memory import StateMemory, state_memory
from merlin.moments import moment_scores
from merlin.ops import multistate_attention

__all__ = [
    "multistate_attention", "merlin_weights", "meanpool_weights", "position_weights",
    "vanilla_weights", "moment_scores", "AGGREGATORS", "make_aggregator", "VanillaAggregator",
    "PositionAggregator", "MeanpoolAggregator", "MerlinAggregator", "Mamba2", "MultiStateGDN",
    "MultiStateMamba2", "state_memory", "StateMemory",
]
