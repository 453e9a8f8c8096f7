"""The experiments' figures: one title size, one legend, one resolution, and shared plots."""

from __future__ import annotations

from pathlib import Path


def finish(fig, ax, path: Path, title: str, *, legend_size: int = 7) -> None:
  """Titles `ax`, adds its legend, writes `fig` to `path` as a PNG and closes it.

  Args:
    fig: a matplotlib figure.
    ax: the axes that get the title and the legend (None: neither).
    path: where the PNG goes.
    title: the axes' title ('' for none).
    legend_size: the legend's font size.
  """
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  if ax is not None:
    if title:
      ax.set_title(title, fontsize=9)
    ax.legend(fontsize=legend_size)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def speedup_grid(predictions, labels, path: Path, title: str) -> None:
  """Predicted speedup over dense against workers, one panel per model and link.

  Args:
    predictions: `planning.scaling.Prediction`s (their `method` is the label).
    labels: the methods or configurations to draw, in legend order.
    path: where the PNG goes.
    title: the figure's title.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  models = list(dict.fromkeys(p.model for p in predictions))
  bandwidths = list(dict.fromkeys(p.bandwidth_bits for p in predictions))
  fig, axes = plt.subplots(len(models), len(bandwidths), squeeze=False,
                           figsize=(4 * len(bandwidths), 3 * len(models)), sharex=True)
  for r, model in enumerate(models):
    for c, bits in enumerate(bandwidths):
      ax = axes[r, c]
      for label in labels:
        pts = [p for p in predictions
               if p.model == model and p.bandwidth_bits == bits and p.method == label]
        ax.plot([p.workers for p in pts], [p.speedup_vs_dense for p in pts], marker="o",
                markersize=3, label=label)
      ax.set_xscale("log", base=2)
      ax.axhline(1.0, color="0.7", linewidth=0.8)
      ax.set_title(f"{model}, {bits / 1e9:g} Gb/s", fontsize=9)
      if c == 0:
        ax.set_ylabel("speedup over dense")
      if r == len(models) - 1:
        ax.set_xlabel("workers P")
  axes[0, 0].legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
