"""What a run writes: per-step metrics (JSONL), hashes of its state, its closing report.

`MetricsLog` appends a record per step and per epoch; `tree_sha256` fingerprints the
trained state; the closing lines and a PNG of the curves are what a finished run
tells its user. The closing lines say how the run ended, what each worker sent
against a dense all-reduce, and where every file went; the figures themselves,
parameter hashes included, are in ``summary.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

CURVES = "curves.png"

# The files a run leaves in its workdir, with what each holds.
WORKDIR_FILES = (
    ("metrics.jsonl", "per step and per epoch"),
    (CURVES, "loss and accuracy per epoch"),
    ("summary.json", "every figure of the run, parameter hashes included"),
    ("config.json", "the resolved config: dlgs-train --config reruns it"),
    ("checkpoints/", "continue or extend with --resume"),
)


def tree_sha256(tree) -> str:
  """SHA-256 over the raw bytes, shapes and dtypes of a tree of host arrays."""
  import jax
  import numpy as np

  digest = hashlib.sha256()
  for leaf in jax.tree_util.tree_leaves(tree):
    leaf = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f"{leaf.dtype}{leaf.shape}".encode())
    digest.update(leaf.tobytes())
  return digest.hexdigest()


class MetricsLog:
  """JSONL metrics on process 0; on resume, records past the checkpoint are dropped."""

  def __init__(self, path: Path, enabled: bool, resume_step: int):
    self.path = path
    self.enabled = enabled
    self.file = None
    if not enabled:
      return
    kept = []
    if resume_step > 0 and path.exists():
      for line in path.read_text().splitlines():
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          continue  # a line cut short by a kill
        if record.get("step", 0) <= resume_step:
          kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))
    self.file = open(path, "a")

  def write(self, record: dict) -> None:
    if self.file:
      self.file.write(json.dumps(record) + "\n")
      self.file.flush()

  def close(self) -> None:
    if self.file:
      self.file.close()


def epoch_records(metrics_path: Path) -> list[dict]:
  """The ``epoch_end`` records of a run's ``metrics.jsonl``, one per epoch, in order.

  An epoch evaluated twice (a run ended mid-epoch, then extended) keeps its later record.
  """
  latest = {}
  for line in Path(metrics_path).read_text().splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue  # a line cut short by a kill
    if record.get("event") == "epoch_end":
      if record["epoch"] not in latest or record["step"] >= latest[record["epoch"]]["step"]:
        latest[record["epoch"]] = record
  return [latest[e] for e in sorted(latest)]


def draw_curves(records: list[dict], path: Path, title: str = "") -> bool:
  """Loss (left) and accuracy (right) per epoch, train and test, as a PNG.

  Args:
    records: ``epoch_end`` records (`epoch_records`).
    path: the PNG to write.
    title: the figure's title.

  Returns:
    Whether a PNG was written: not without an epoch or without matplotlib.
  """
  if not records:
    return False
  try:
    import matplotlib
  except ImportError:
    return False
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  epochs = [r["epoch"] + 1 for r in records]
  fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(9, 3.4))
  for ax, key, label in ((loss_ax, "loss", "loss"), (acc_ax, "accuracy", "accuracy")):
    for split, style in (("train", "-"), ("test", "-o")):
      values = [(e, r[f"{split}_{key}"]) for e, r in zip(epochs, records)
                if f"{split}_{key}" in r]
      if values:
        ax.plot(*zip(*values), style, markersize=3, label=split)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def traffic_line(summary: dict) -> str:
  """Bytes one worker sent per step against a dense float32 all-reduce of the same model."""
  sent, dense = summary.get("bytes_sent_per_step"), summary.get("dense_bytes_per_step")
  if not sent or not dense:
    return ""
  ratio = dense / sent
  compared = (f"{ratio:.0f}x less" if ratio >= 10 else f"{ratio:.1f}x less" if ratio >= 1.5
              else f"{ratio:.2f}x")
  return (f"traffic: each worker sent {_bytes(sent)} a step; a dense float32 all-reduce "
          f"sends {_bytes(dense)} ({compared})")


def closing_lines(summary: dict, workdir: Path, curves: bool) -> list[str]:
  """What a finished run prints last: its result, its traffic and its files."""
  minutes = summary["seconds"] / 60
  ended = "stopped" if summary.get("stopped_early") else "finished"
  head = (f"{ended}: {summary['steps_this_run']} steps in {minutes:.1f} min "
          f"(step {summary['steps']} of the run)")
  if summary.get("final_test_accuracy") is not None:
    head += (f"; test accuracy {summary['final_test_accuracy']:.1%}, "
             f"test loss {summary['final_test_loss']:.3f}")
  lines = [head]
  if traffic_line(summary):
    lines.append(traffic_line(summary))
  lines.append(f"wrote {workdir}/")
  for name, what in WORKDIR_FILES:
    if name != CURVES or curves:
      lines.append(f"  {name:<14} {what}")
  return lines


def _bytes(n: float) -> str:
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if n >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n:.0f} B"
