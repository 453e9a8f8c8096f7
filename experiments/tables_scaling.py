"""Tables of predicted scaling: many workers, nodes, the owners' crossover."""

from __future__ import annotations

from pathlib import Path

from tables_common import MODELS, RESULTS, load


METHOD_NAMES = {"dlgs": "DLGS", "gtopk": "gTop-k", "topk": "Top-k", "lags": "LAGS",
                "dlgs-owners": "DLGS owners", "topk-owners": "Top-k owners"}


# The report's rows of the predicted scaling: (model, link in Gbit/s).
SCALING_ROWS = (("resnet20", 1), ("vgg16", 10), ("resnet50", 10), ("resnet50", 25))


NODE_ROWS = (("vgg16", 10, 2), ("vgg16", 10, 16), ("resnet50", 10, 16), ("resnet50", 100, 16))


NODE_COLUMNS = ("dense two-level bf16", "dlgs flat", "dlgs two-level", "gtopk flat",
                "dlgs-owners flat", "dlgs-owners two-level")


def _by_row(path: Path) -> dict:
  rows = {}
  for p in load(path)["predictions"]:
    rows.setdefault((p["model"], p["bandwidth_bits"] / 1e9, p["workers"]), {})[p["method"]] = p
  return rows


def predicted_scaling() -> str:
  """The predicted speedup over dense at P = 4, 16, 64: the fastest method, and DLGS if not it."""
  rows = _by_row(RESULTS / "scaling" / "scaling_density0.01.json")
  lines = ["| model | link | P = 4 | P = 16 | P = 64 |", "|---|---|---|---|---|"]
  for model, gbit in SCALING_ROWS:
    cells = []
    for workers in (4, 16, 64):
      found = rows[(model, gbit, workers)]
      best = max(found.values(), key=lambda p: p["speedup_vs_dense"])
      cell = f"{METHOD_NAMES.get(best['method'], best['method'])} {best['speedup_vs_dense']:.2f}x"
      if best["method"] != "dlgs":
        cell += f" (DLGS {found['dlgs']['speedup_vs_dense']:.2f}x)"
      cells.append(cell)
    lines.append(f"| {MODELS[model].split(' ')[0]} | {gbit:g} Gb/s | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def predicted_nodes() -> str:
  """Nodes of 8 GPUs: speedup over flat dense of each exchange, the row's fastest in bold."""
  rows = _by_row(RESULTS / "nodes" / "nodes_local8_density0.01.json")
  names = [" ".join(METHOD_NAMES.get(w, w) for w in c.split()) for c in NODE_COLUMNS]
  lines = ["| model | link | nodes x 8 | " + " | ".join(names) + " |",
           "|---|---|---|" + "---|" * len(NODE_COLUMNS)]
  for model, gbit, nodes in NODE_ROWS:
    found = rows[(model, gbit, nodes * 8)]
    fastest = max(found[c]["speedup_vs_dense"] for c in NODE_COLUMNS)
    cells = [(f"**{found[c]['speedup_vs_dense']:.2f}x**" if found[c]["speedup_vs_dense"] == fastest
              else f"{found[c]['speedup_vs_dense']:.2f}x") for c in NODE_COLUMNS]
    lines.append(f"| {MODELS[model].split(' ')[0]} | {gbit:g} Gb/s | {nodes} | "
                 + " | ".join(cells) + " |")
  return "\n".join(lines)


def owners_crossover() -> str:
  """Each exchange's ms for one VGG16 message at 0.01 on 10 Gbit/s, by P (`planning.choice`)."""
  from dlgs_jax.planning import choice  # pylint: disable=g-import-not-at-top
  from dlgs_jax.workload import models  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  size = sum(int(x.size) for x in jax.tree_util.tree_leaves(models.param_shapes("vgg16")))
  return choice.crossover_table(size, 0.01, (4, 16, 64, 256), (10e9,), 25e-6)
