"""Pallas kernels for the chunked triadic recurrence (GPU Triton, TPU Mosaic, interpret on CPU)."""
