"""How the experiments' figures are finished: one title size, one legend, one resolution."""

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
