"""What every table module shares: where results live, model and link names, seeds' gaps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
MODELS = {"resnet50": "ResNet-50 (32x32)", "vgg16": "VGG16", "resnet20": "ResNet-20"}
LINKS = {"100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s"}


def load(path: Path) -> Optional[dict]:
  """A result JSON, or None where it has not been written."""
  return json.loads(path.read_text()) if path.is_file() else None


def final_accuracy(summary: dict) -> float:
  """A run summary's final test accuracy (a fraction)."""
  return summary["final_test_accuracy"]


def seed_gaps(seeds: dict, reference: dict, measure: Callable = final_accuracy) -> list[float]:
  """Points by which `measure` of each seed's run exceeds the reference's run of that seed."""
  return [100 * (measure(seeds[s]) - measure(reference[s])) for s in sorted(seeds)
          if s in reference]


def per_layer_named(method: str) -> str:
  """A row's method, with the per-layer adapted rule's old name "dlgs" called `dlgs-layer`."""
  return "dlgs-layer" if method == "dlgs" else method


def budget_named(run: Optional[dict]) -> Optional[dict]:
  """A cluster job with its "dlgs" called `dlgs-layer` where it ran a threshold per layer."""
  if run is None or run["methods"].get("dlgs", {}).get("budget", "layer") != "layer":
    return run
  return {**run, "methods": {per_layer_named(m): v for m, v in run["methods"].items()},
          "summary": [{**row, "method": per_layer_named(row["method"])} for row in run["summary"]],
          "wins": {per_layer_named(a): {per_layer_named(b): n for b, n in row.items()}
                   for a, row in run["wins"].items()}}
