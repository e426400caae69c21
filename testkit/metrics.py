"""The error measure every test bound and benchmark check is stated in."""

from __future__ import annotations

import numpy as np


def rel_rms(a, b) -> float:
  """Relative RMS error ||a - b|| / ||b||, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
