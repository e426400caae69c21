"""Multi-state linear attention and MERLIN segment aggregation (ops, aggregators, Flax layers)."""
