"""The tables the README, the docs and the report share, rendered from the result JSONs.

A rendered table sits in a Markdown file between ``<!-- table: NAME -->`` and
``<!-- end table -->``; NAME is one of `TABLES`. This script rewrites every
such block from the JSONs under ``experiments/results/``, so a number is
written once, by the run that measured it:

    python experiments/render.py           # rewrite the blocks
    python experiments/render.py --check   # exit 1 naming each block that differs

``tests/experiments/test_render.py`` runs the check, so a table edited by hand
or a result rerun without rendering fails the suite.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Callable

from tables_accuracy import (demo_budget, demo_presets, full_cifar, owners_accuracy,
                             subset_budget, threshold_rules)
from tables_cluster import (cluster_message, cluster_report, nodes_measured, owners_cluster,
                            speedups, timeline_check, topk_pair)
from tables_common import ROOT
from tables_cost import (cpu_floor, h200_update, hsdp_manual, hsdp_memory, update_kernels,
                         update_passes)
from tables_scaling import owners_crossover, predicted_nodes, predicted_scaling

# The Markdown files that hold rendered tables.
FILES = ("README.md", "docs/results.md", "docs/choosing.md", "docs/hsdp.md",
         "docs/getting_started.md", "experiments/README.md")
BLOCK = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- end table -->)", re.S)

# Each table's function lives with the kind of result it renders, as the report's
# sections do: tables_cluster (sections 1, 3 and 6's measured runs), tables_accuracy
# (2, 6's owners, 9), tables_cost (4, 6's HSDP), tables_scaling (6's predictions).
TABLES: dict[str, Callable[[], str]] = {
    "hsdp-memory": hsdp_memory,
    "hsdp-manual": hsdp_manual,
    "demo-presets": demo_presets,
    "demo-budget": demo_budget,
    "update-kernels": update_kernels,
    "update-passes": update_passes,
    "cluster-speedups": speedups,
    "cluster-speedups-commands": lambda: speedups(commands=True),
    "cluster-report": cluster_report,
    "cluster-message": cluster_message,
    "topk-pair": topk_pair,
    "predicted-scaling": predicted_scaling,
    "predicted-nodes": predicted_nodes,
    "owners-crossover": owners_crossover,
    "owners-cluster": owners_cluster,
    "owners-accuracy": owners_accuracy,
    "full-cifar": full_cifar,
    "cpu-floor": cpu_floor,
    "cpu-floor-small-pages": lambda: cpu_floor("cpu_flat_small_pages"),
    "cpu-floor-huge-pages": lambda: cpu_floor("cpu_flat_huge_pages"),
    "cpu-floor-quiet": lambda: cpu_floor("cpu_quiet_summed"),
    "cpu-floor-kept": lambda: cpu_floor("cpu_quiet_kept"),
    "cpu-floor-quiet-thp": lambda: cpu_floor("cpu_quiet_thp"),
    "cpu-floor-summed": lambda: cpu_floor("cpu_donated_summed"),
    "cpu-floor-written": lambda: cpu_floor("cpu_donated_written"),
    "timeline-check": timeline_check,
    "h200-update": h200_update,
    "nodes-measured": nodes_measured,
    "subset-budget": subset_budget,
    "threshold-rules": threshold_rules,
}


def render(text: str, where: str = "") -> tuple[str, list[str]]:
  """`text` with every table block rendered anew, and the names of the blocks that changed.

  Raises:
    ValueError: for a block naming no table of `TABLES`.
  """
  changed = []

  def one(match):
    name = match.group(2)
    if name not in TABLES:
      raise ValueError(f"{where}: '<!-- table: {name} -->' names no table; choose one of "
                       f"{sorted(TABLES)}")
    body = TABLES[name]() + "\n"
    if body != match.group(3):
      changed.append(name)
    return match.group(1) + body + match.group(4)

  return BLOCK.sub(one, text), changed


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 if a block differs from its JSON")
  args = parser.parse_args(argv)
  stale = []
  for name in FILES:
    path = ROOT / name
    text, changed = render(path.read_text(), name)
    stale += [f"{name}: {table}" for table in changed]
    if changed and not args.check:
      path.write_text(text)
  if args.check and stale:
    print("rendered tables differ from their JSON (run python experiments/render.py): "
          + "; ".join(stale), file=sys.stderr)
    return 1
  print("\n".join(stale) if stale else "every table matches its JSON")
  return 0


if __name__ == "__main__":
  sys.exit(main())
