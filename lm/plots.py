"""PNG plots of the evaluation results: MQAR accuracy curve, NIAH heatmap and depth curve, text
perplexity by position.

Figures are built with matplotlib's object API on the Agg canvas (``matplotlib.figure.Figure``),
so nothing touches pyplot's global state or needs a display, and they are written through
``etils.epath`` so a workdir on a bucket (``gs://...``) works like a local one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from etils import epath
from matplotlib.figure import Figure


def _save(fig: Figure, path: epath.PathLike) -> str:
  path = epath.Path(path)
  with path.open("wb") as f:
    fig.savefig(f, format="png", dpi=120, bbox_inches="tight")
  return str(path)


def accuracy_curve(path: epath.PathLike, num_pairs: Sequence[int], accuracy: Sequence[float],
                   seq_lens: Sequence[int], title: str) -> str:
  """MQAR accuracy against the number of key-value pairs (log2 axis), points labelled by length."""
  fig = Figure(figsize=(5.5, 3.8))
  ax = fig.subplots()
  order = np.argsort(num_pairs, kind="stable")
  x, y = np.asarray(num_pairs)[order], np.asarray(accuracy)[order]
  ax.plot(x, y, "o-")
  for xi, yi, s in zip(x, y, np.asarray(seq_lens)[order]):
    ax.annotate(f"T={s}", (xi, yi), textcoords="offset points", xytext=(0, 6), ha="center",
                fontsize=7)
  ax.set_xscale("log", base=2)
  ax.set(xlabel="key-value pairs", ylabel="accuracy", ylim=(-0.03, 1.08), title=title)
  ax.grid(alpha=0.3)
  return _save(fig, path)


def heatmap(path: epath.PathLike, grid: np.ndarray, lengths: Sequence[int],
            depths: Sequence[float], title: str) -> str:
  """Accuracy over needle depth (rows, 0 at the top) x context length (columns), annotated."""
  grid = np.asarray(grid, np.float64)
  fig = Figure(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.55 * len(depths)))
  ax = fig.subplots()
  im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
  for (i, j), v in np.ndenumerate(grid):
    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
  ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
  ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
  ax.set(xlabel="context length", ylabel="needle depth", title=title)
  fig.colorbar(im, ax=ax, label="accuracy")
  return _save(fig, path)


def depth_curve(path: epath.PathLike, depths: Sequence[float], grid: np.ndarray,
                lengths: Sequence[int], title: str) -> str:
  """Accuracy against needle depth: one thin line per context length, their mean in bold."""
  grid = np.asarray(grid, np.float64)
  fig = Figure(figsize=(5.5, 3.8))
  ax = fig.subplots()
  for n, row in zip(lengths, grid.T):
    ax.plot(depths, row, ".-", alpha=0.5, lw=1, label=f"T={n}")
  ax.plot(depths, grid.mean(axis=1), "ko-", lw=2, label="mean")
  ax.set(xlabel="needle depth (0 = start, 1 = next to the query)", ylabel="accuracy",
         ylim=(-0.03, 1.05), title=title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  return _save(fig, path)


def perplexity_curve(path: epath.PathLike, position_ppl: np.ndarray, bucket_edges: Sequence[int],
                     bucket_ppl: Sequence[float], title: str) -> str:
  """Perplexity per position (faint) and per position bucket (steps), log y axis."""
  fig = Figure(figsize=(5.5, 3.8))
  ax = fig.subplots()
  ax.plot(np.arange(len(position_ppl)), position_ppl, lw=0.8, alpha=0.35, label="per position")
  ax.stairs(bucket_ppl, bucket_edges, baseline=None, lw=2, label="per bucket")
  ax.set_yscale("log")
  ax.set(xlabel="position", ylabel="perplexity", title=title)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7)
  return _save(fig, path)
