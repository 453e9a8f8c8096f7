"""Tables of what an update costs: kernels, passes over the model, time against its floor, HSDP's memory."""

from __future__ import annotations


from tables_common import MODELS, RESULTS, load, per_layer_named


def update_kernels() -> str:
  """Kernels a compiled update launches / its conditionals, over dense's, and compile seconds."""
  run = load(RESULTS / "update_programs" / "cpu.json")
  columns = [("topk", "Top-k"), ("lags", "LAGS"),
             ("dlgs, one group", "`dlgs`, one group"), ("dlgs, buckets", "`dlgs`, buckets"),
             ("dlgs-paper, one group", "`dlgs-paper`, one group"),
             ("dlgs-paper, buckets", "`dlgs-paper`, buckets"),
             ("dlgs-layer, one group", "`dlgs-layer`, one group"),
             ("dlgs-layer, buckets", "`dlgs-layer`, buckets"),
             ("dlgs-paper-message, buckets", "`dlgs-paper-message`, buckets")]
  lines = ["| model (dense) | " + " | ".join(name for _, name in columns) + " |",
           "|---" * (1 + len(columns)) + "|"]
  for model in dict.fromkeys(row["model"] for row in run["rows"]):
    rows = {row["method"]: row for row in run["rows"] if row["model"] == model}
    dense = rows["dense"]["kernels"]
    name = MODELS[model].split(" (")[0]  # leaf shapes only: no image size
    cells = [f"{name} ({dense} / {rows['dense']['conditionals']})"]
    for method, _ in columns:
      row = rows[method]
      over = row["kernels"] - dense
      text = f"{row['kernels']} / {row['conditionals']} ({over:+d})"
      if method.startswith("dlgs") and over <= 40:
        text = f"**{text}**"
      cells.append(f"{text}, {row['compile_s']} s")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def update_passes() -> str:
  """Passes a compiled update makes over the model's float32 values, outside its conditional."""
  run = load(RESULTS / "update_programs" / "cpu.json")
  columns = [("dense", "dense"), ("topk", "Top-k"), ("lags", "LAGS"),
             ("dlgs", "`dlgs`"), ("dlgs-paper", "`dlgs-paper`"), ("dlgs-layer", "`dlgs-layer`")]
  lines = ["| model | grouping | " + " | ".join(name for _, name in columns) + " |",
           "|---" * (2 + len(columns)) + "|"]
  for model in dict.fromkeys(row["model"] for row in run["rows"]):
    rows = {row["method"]: row for row in run["rows"] if row["model"] == model}
    name = MODELS[model].split(" (")[0]
    for grouping in ("one group", "buckets"):
      cells = [name, grouping]
      for method, _ in columns:
        row = rows.get(f"{method}, {grouping}") or (rows.get(method) if grouping == "one group"
                                                     else None)
        cells.append(f"{row['passes']:.1f}" if row else "")
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def cpu_floor(name: str = "cpu_flat") -> str:
  """Each update's ms and its median ratio to the memory floor on one CPU core, DLGS over LAGS."""
  rows = load(RESULTS / "gpu_check" / f"{name}.json")["rows"]
  found = {(r["model"], per_layer_named(r["method"]), r["grouping"]): r for r in rows}
  cell = lambda r: f"{r['update_ms']:.1f} / {r['over_floor']:.1f}x" if r else ""  # noqa: E731
  dlgs = [m for m in ("dlgs-message", "dlgs-paper", "dlgs-layer")
          if any(method == m for _, method, _ in found)]
  names = {"dlgs-message": "DLGS, default", "dlgs-paper": "DLGS, paper's rule",
           "dlgs-layer": "DLGS, per layer"}
  lines = ["| model | grouping | dense | Top-k | LAGS | " + " | ".join(names[m] for m in dlgs)
           + " | DLGS / LAGS |", "|---" * (6 + len(dlgs)) + "|"]
  for model in ("vgg16", "resnet50"):
    for grouping, label in (("one group", "one group"), ("default", "buckets")):
      alone = grouping == "one group"
      lags = found[(model, "lags", grouping)]
      rows = [found.get((model, m, grouping)) for m in dlgs]
      lines.append(
          f"| {MODELS[model].split(' ')[0]} | {label} | "
          f"{cell(found.get((model, 'dense', '-')) if alone else None)} | "
          f"{cell(found.get((model, 'topk', '-')) if alone else None)} | {cell(lags)} | "
          + " | ".join(cell(r) for r in rows) + " | "
          + ", ".join(f"{r['update_ms'] / lags['update_ms']:.2f}" for r in rows if r) + " |")
  return "\n".join(lines)


def h200_update() -> str:
  """One H200, the engine before flat buffers: each update's ms / floor ratio, DLGS's kernels."""
  base = RESULTS / "gpu_check"
  runs = [load(base / f"{name}.json") for name in ("h200", "h200_resnet50_dlgs", "h200_vgg16_0.1")]
  found = {(r["model"], r["density"], per_layer_named(r["method"])): r for run in runs
           for r in run["rows"] if r["grouping"] in ("-", "one group")}
  models = runs[0]["models"]
  cell = lambda r: f"{r['update_ms']:.2f} / {r['over_floor']:.1f}x"  # noqa: E731
  lines = ["| model (fwd+bwd), density | Top-k | gTop-k | LAGS | DLGS, paper's rule | DLGS, per "
           "layer | DLGS kernels, paper / per layer |", "|---|---|---|---|---|---|---|"]
  for model, density in (("vgg16", 0.01), ("vgg16", 0.1), ("resnet50", 0.01)):
    rows = [found[(model, density, m)]
            for m in ("topk", "gtopk", "lags", "dlgs-paper", "dlgs-layer")]
    name = MODELS[model].split(" ")[0]
    step = models[model]
    label = (f"{name}, b {step['forward_backward_batch']} ({step['forward_backward_ms']:.2f} ms), "
             f"{density:g}" if density == 0.01 else f"{name}, {density:g}")
    lines.append(f"| {label} | " + " | ".join(cell(r) for r in rows)
                 + f" | {rows[3]['kernels']} / {rows[4]['kernels']} |")
  return "\n".join(lines)


def hsdp_memory() -> str:
  """Per device: the step's state (memory analysis) and bytes between nodes, sliced or not."""
  rows = load(RESULTS / "hsdp" / "resnet20_memory.json")["rows"]
  lines = ["| nodes x devices | state, replicated | two-level | sliced | sliced / replicated | "
           "kB between nodes, sliced | flat DLGS among the nodes | sliced / flat |",
           "|---|---|---|---|---|---|---|---|"]
  for row in rows:
    among = row["flat_among_nodes"]
    sent = (f"{row['sliced']['bytes_sent'] / 1e3:.1f} | {among['bytes_sent'] / 1e3:.1f} | "
            f"{row['bytes_share']:.2f}" if among else "- | - | -")
    lines.append(f"| {row['nodes']} x {row['fsdp']} | {row['replicated']['state'] / 1e6:.2f} MB"
                 f" | {row['two_level']['state'] / 1e6:.2f} MB | "
                 f"{row['sliced']['state'] / 1e6:.2f} MB | {row['state_share']:.3f} | {sent} |")
  return "\n".join(lines)


def hsdp_manual() -> str:
  """DLGS's update on sliced gradients, manual over the node axis only or over both."""
  run = load(RESULTS / "hsdp" / "manual.json")
  lines = ["| shard_map | all-gathers | all-reduces | HLO instructions | temporaries |",
           "|---|---|---|---|---|"]
  for key, label in (("partial_manual", 'manual over "data" only'),
                     ("full_manual", "manual over both axes (used)")):
    row = run[key]
    lines.append(f"| {label} | {row['collectives']['all-gather']} | "
                 f"{row['collectives']['all-reduce']} | {row['instructions']:,} | "
                 f"{row['temporaries'] / 1e6:.2f} MB |")
  return "\n".join(lines)
