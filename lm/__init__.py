"""What both methods share: decoder LM, attention baseline, data (grain), sharding, training loop."""
