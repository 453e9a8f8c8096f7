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
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
# The Markdown files that hold rendered tables.
FILES = ("README.md", "docs/results.md", "docs/choosing.md", "docs/hsdp.md",
         "docs/getting_started.md", "experiments/README.md")
BLOCK = re.compile(r"(<!-- table: ([\w-]+) -->\n)(.*?)(<!-- end table -->)", re.S)

MODELS = {"resnet50": "ResNet-50 (32x32)", "vgg16": "VGG16", "resnet20": "ResNet-20"}
LINKS = {"100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s"}
# The cluster rows, in the order the README reads them (link first, then model).
CLUSTER_ROWS = [(model, link) for link in ("100mbit", "1gbit")
                for model in ("resnet50", "vgg16", "resnet20")]
# Results written while DLGS's default was a threshold per layer (the adapted rule) call
# that "dlgs"; the tables name it `dlgs-layer`, its name since the default became one
# threshold per message. A cluster job records each DLGS method's budget since; one
# that does not ran "dlgs" per layer (`_budget_named`, `_per_layer`).
SPARSE = (("dlgs", "DLGS"), ("dlgs-layer", "DLGS per layer"), ("dlgs-paper", "DLGS, paper's rule"),
          ("topk", "Top-k"), ("lags", "LAGS"), ("gtopk", "gTop-k"))


def _load(path: Path) -> Optional[dict]:
  return json.loads(path.read_text()) if path.is_file() else None


def _final(summary: dict) -> float:
  return summary["final_test_accuracy"]


def _gaps(seeds: dict, reference: dict, measure: Callable = _final) -> list[float]:
  """Points by which `measure` of each seed's run exceeds the reference's run of that seed."""
  return [100 * (measure(seeds[s]) - measure(reference[s])) for s in sorted(seeds)
          if s in reference]


def _per_layer(method: str) -> str:
  """A row's method, with the per-layer adapted rule's old name "dlgs" called `dlgs-layer`."""
  return "dlgs-layer" if method == "dlgs" else method


def _budget_named(run: Optional[dict]) -> Optional[dict]:
  """A cluster job with its "dlgs" called `dlgs-layer` where it ran a threshold per layer."""
  if run is None or run["methods"].get("dlgs", {}).get("budget", "layer") != "layer":
    return run
  return {**run, "methods": {_per_layer(m): v for m, v in run["methods"].items()},
          "summary": [{**row, "method": _per_layer(row["method"])} for row in run["summary"]],
          "wins": {_per_layer(a): {_per_layer(b): n for b, n in row.items()}
                   for a, row in run["wins"].items()}}


def cluster_runs(model: str, link: str) -> tuple[Optional[dict], Optional[dict]]:
  """The paired cluster job of a row, and the job that ran LAGS and gTop-k where it is another."""
  base = RESULTS / "compare" / "batched"
  main = _load(base / f"{model}_{link}" / f"compare_{model}_0.01.json")
  extra = _load(base / f"{model}_{link}_lags_gtopk" / f"compare_{model}_0.01.json")
  return _budget_named(main), _budget_named(extra)


def _summary(run: Optional[dict], method: str) -> Optional[dict]:
  if run is None:
    return None
  return next((row for row in run["summary"] if row["method"] == method), None)


def _speedups(model: str, link: str) -> dict[str, tuple[dict, dict, bool]]:
  """Method -> (its summary row, its job, whether that job is the row's second one)."""
  main, extra = cluster_runs(model, link)
  out = {}
  for method, _ in SPARSE:
    row = _summary(main, method)
    if row is not None:
      out[method] = (row, main, False)
    elif _summary(extra, method) is not None:
      out[method] = (_summary(extra, method), extra, True)
  return out


def _flat(run: dict) -> str:
  # Runs that record no layout predate flat buffers.
  return " †" if run.get("layout") == "flat buffers per group" else ""


def _best(found: dict) -> float:
  return max(row["speedup"] for row, _, _ in found.values())


def _cell(found: dict, method: str, detail: bool) -> str:
  if method not in found:
    return "-"
  row, run, second = found[method]
  text = f"{row['speedup']:.2f}x"
  if row["speedup"] == _best(found):
    text = f"**{text}**"
  if detail:
    rounds = len(run["round_orders"])
    if method.startswith("dlgs"):
      text += f" ({row['speedup_min']:.2f}-{row['speedup_max']:.2f})"
    text += f" {row['faster_than_reference']}/{rounds}" + (" *" if second else "")
  return text


def speedups(commands: bool = False) -> str:
  """Speedup over dense per model, link and method; the row's fastest in bold."""
  head = "| model | link | " + " | ".join(name for _, name in SPARSE)
  lines = [head + (" | command |" if commands else " |"),
           "|---" * (2 + len(SPARSE) + commands) + "|"]
  first = True
  for model, link in CLUSTER_ROWS:
    found = _speedups(model, link)
    if not found:
      continue
    cells = [MODELS[model], LINKS[link] + _flat(cluster_runs(model, link)[0])]
    cells += [_cell(found, method, detail=False) for method, _ in SPARSE]
    if commands:
      steps = [f"compare_batched_{model}_{link}"] + (
          [f"compare_batched_{model}_{link}_lags_gtopk"] if cluster_runs(model, link)[1] else [])
      prefix = "python experiments/run_suite.py --full" if first else "..."
      cells.append(f"`{prefix} --only {','.join(steps)}`")
      first = False
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _leaves(model: str) -> int:
  from dlgs_jax.workload import models  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  return len(jax.tree_util.tree_leaves(models.param_shapes(model)))


def _number(x: float) -> str:
  return f"{x:.1f}".rstrip("0").rstrip(".")


def cluster_report() -> str:
  """The report's cluster table: speedups with their range and rounds, and DLGS's own columns."""
  lines = ["| model | link | dense step | `dlgs` | `dlgs-layer` | `dlgs-paper` | Top-k | LAGS "
           "| gTop-k | `dlgs-layer` exact | `dlgs-layer` − `dlgs-paper` |", "|---" * 11 + "|"]
  for link in ("1gbit", "100mbit"):
    for model in ("vgg16", "resnet20", "resnet50"):
      main, _ = cluster_runs(model, link)
      if main is None:
        continue
      found = _speedups(model, link)
      dense = main["methods"]["dense"]["median"]
      cells = [MODELS[model], LINKS[link] + _flat(main), f"{dense * 1e3:.0f} ms"]
      cells += [_cell(found, method, detail=True) for method, _ in SPARSE]
      dlgs, paper = main["methods"].get("dlgs-layer"), main["methods"].get("dlgs-paper")
      cells.append(f"{_number(dlgs['exact_leaves'])} of {_leaves(model)}" if dlgs else "-")
      if dlgs and paper:
        rounds = len(main["round_orders"])
        cells.append(f"{(dlgs['median'] / paper['median'] - 1) * 100:+.1f}%, "
                     f"{main['wins']['dlgs-layer']['dlgs-paper']}/{rounds}")
      else:
        cells.append("-")
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


MESSAGE_METHODS = (("topk", "Top-k"), ("dlgs-layer", "`dlgs-layer`"),
                   ("dlgs-message", "`dlgs-message`"), ("dlgs-paper", "`dlgs-paper`"),
                   ("dlgs-paper-message", "`dlgs-paper-message`"))


def cluster_message() -> str:
  """The budget per message against the budget per layer and Top-k, one paired job per model."""
  lines = ["| model | link | dense step | " + " | ".join(name for _, name in MESSAGE_METHODS)
           + " | rounds ahead of Top-k, per message: default / paper's rule |",
           "|---" * (4 + len(MESSAGE_METHODS)) + "|"]
  for model in ("vgg16", "resnet20"):
    run = _budget_named(_load(RESULTS / "compare" / "message" / f"{model}_100mbit"
                              / f"compare_{model}_0.01.json"))
    if run is None:
      continue
    cells = [MODELS[model], LINKS["100mbit"], f"{run['methods']['dense']['median'] * 1e3:.0f} ms"]
    for method, _ in MESSAGE_METHODS:
      row = _summary(run, method)
      cells.append(f"{row['median'] * 1e3:.1f} ms, {row['speedup']:.2f}x")
    wins = run["wins"]
    cells.append(f"{wins['dlgs-message']['topk']} / {wins['dlgs-paper-message']['topk']} "
                 f"of {len(run['round_orders'])}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def update_kernels() -> str:
  """Kernels a compiled update launches / its conditionals, over dense's, and compile seconds."""
  run = _load(RESULTS / "update_programs" / "cpu.json")
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
  run = _load(RESULTS / "update_programs" / "cpu_passes.json")
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


def demo_presets() -> str:
  """The demo's preset and its variants: accuracy, the gap to dense of as many epochs, bytes."""
  runs = _load(RESULTS / "demo_presets" / "runs.json")["runs"]
  epochs = lambda run: int((re.findall(r"--epochs (\d+)", run["flags"]) or ["10"])[0])  # noqa: E731
  dense = {epochs(run): run for run in runs if "--method dense" in run["flags"]}
  lines = ["| run | final test accuracy | − dense, as many epochs (points) | bytes / dense's |",
           "|---|---|---|---|"]
  for run in runs:
    reference = dense.get(epochs(run))
    if reference is None or reference is run:
      gap, ratio = "", "1" if reference is run else ""
    else:
      gap = f"{100 * (run['final_test_accuracy'] - reference['final_test_accuracy']):+.1f}"
      ratio = f"1/{reference['bytes_sent_per_step'] / run['bytes_sent_per_step']:.1f}"
    lines.append(f"| `{run['command']}` | {100 * run['final_test_accuracy']:.1f}% | {gap} "
                 f"| {ratio} |")
  return "\n".join(lines)


def demo_budget() -> str:
  """The demo's preset per budget, dense and Top-k: each seed, and the gap to dense paired by seed."""
  runs = _load(RESULTS / "demo_presets" / "budget.json")["runs"]
  seeds = sorted({run["seed"] for run in runs})
  by = {(run["name"], run["seed"]): run for run in runs}
  names = list(dict.fromkeys(run["name"] for run in runs))
  lines = ["| run | " + " | ".join(f"seed {s}" for s in seeds)
           + " | − dense, paired (points) | bytes / dense's |",
           "|---|" + "---|" * len(seeds) + "---|---|"]
  for name in names:
    mine = [by.get((name, s)) for s in seeds]
    cells = [f"{100 * r['final_test_accuracy']:.1f}%" if r else "" for r in mine]
    pairs = [(r, by.get(("dense", s))) for r, s in zip(mine, seeds)]
    gaps = [100 * (r["final_test_accuracy"] - d["final_test_accuracy"]) for r, d in pairs
            if r and d]
    gap = ratio = ""
    if name != "dense" and gaps:
      gap = f"{statistics.mean(gaps):+.1f}" + (f" ± {statistics.stdev(gaps):.1f}"
                                                 if len(gaps) > 1 else " (one seed)")
      first = next((r, d) for r, d in pairs if r and d)
      ratio = f"1/{first[1]['bytes_sent_per_step'] / first[0]['bytes_sent_per_step']:.1f}"
    flags = mine[0]["flags"] if mine[0] else next(r for r in mine if r)["flags"]
    lines.append(f"| `{flags}` | " + " | ".join(cells) + f" | {gap.replace('-', '−')} | "
                 f"{ratio or ('1' if name == 'dense' else '')} |")
  return "\n".join(lines)


METHOD_NAMES = {"dlgs": "DLGS", "gtopk": "gTop-k", "topk": "Top-k", "lags": "LAGS",
                "dlgs-owners": "DLGS owners", "topk-owners": "Top-k owners"}
# The report's rows of the predicted scaling: (model, link in Gbit/s).
SCALING_ROWS = (("resnet20", 1), ("vgg16", 10), ("resnet50", 10), ("resnet50", 25))
NODE_ROWS = (("vgg16", 10, 2), ("vgg16", 10, 16), ("resnet50", 10, 16), ("resnet50", 100, 16))
NODE_COLUMNS = ("dense two-level bf16", "dlgs flat", "dlgs two-level", "gtopk flat",
                "dlgs-owners flat", "dlgs-owners two-level")


def _by_row(path: Path) -> dict:
  rows = {}
  for p in _load(path)["predictions"]:
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


def owners_cluster() -> str:
  """The owners' exchange against the all-gather on the emulated cluster, paired, per P."""
  lines = ["| P | method | median step ms | speedup over dense (range) | kB sent a worker | "
           "rounds ahead of its all-gather twin |", "|---|---|---|---|---|---|"]
  for folder in ("resnet20_100mbit", "resnet20_100mbit_p8"):
    run = _load(RESULTS / "compare" / "owners" / folder / "compare_resnet20_0.01.json")
    for row in run["summary"]:
      method = row["method"]
      if method == "dense":
        continue
      twin = method.removesuffix("-owners")
      ahead = (f"{run['wins'][method][twin]} of {run['rounds']}" if twin != method else "")
      lines.append(f"| {run['workers']} | {method} | {row['median'] * 1e3:.1f} | "
                   f"{row['speedup']:.2f}x ({row['speedup_min']:.2f}-{row['speedup_max']:.2f}) | "
                   f"{row['bytes_sent'] / 1e3:.0f} | {ahead} |")
  return "\n".join(lines)


def _code_label(code: tuple) -> str:
  """The commits a run trained at (`accuracy.code_version`), or what their absence means."""
  return "+".join(code) if code else "a commit before runs recorded theirs"


def owners_accuracy() -> str:
  """The demo's preset with the owners' exchange, the all-gather and gTop-k: accuracy, bytes;
  then full CIFAR-10, the owners' DLGS against the all-gather's, paired by seed."""
  runs = _load(RESULTS / "compare" / "owners" / "demo_accuracy.json")["runs"]
  lines = ["| run | final test accuracy | bytes a worker a step |", "|---|---|---|"]
  lines += [f"| `{run['command']}` | {100 * run['final_test_accuracy']:.1f}% | "
            f"{run['bytes_sent_per_step'] / 1e3:.0f} kB |" for run in runs]
  full = {(r["method"], r["density"], r["seed"]): r for r in _load(
      RESULTS / "accuracy_full" / "table" / "results.json")["results"]}
  for (method, density, seed), run in sorted(full.items()):
    if method != "dlgs-owners" or ("dlgs-layer", density, seed) not in full:
      continue
    other = full[("dlgs-layer", density, seed)]
    summary, twin = run["summary"], other["summary"]
    gap = 100 * (summary["final_test_accuracy"] - twin["final_test_accuracy"])
    codes = [tuple(r.get("code") or ()) for r in (other, run)]
    # A gap between runs of different code mixes the method with the code's changes.
    code = "" if codes[0] == codes[1] else (
        f"; dlgs-layer trained at {_code_label(codes[0])}, dlgs-owners at "
        f"{_code_label(codes[1])}")
    lines.append(f"| full CIFAR-10, ResNet-20, {density:g}, seed {seed}: dlgs-owners against "
                 f"dlgs-layer ({100 * twin['final_test_accuracy']:.2f}%, paired gap "
                 f"{gap:+.2f} points{code}) | {100 * summary['final_test_accuracy']:.2f}% | "
                 f"{summary['bytes_sent_per_step'] / 1e3:.0f} kB (dlgs-layer "
                 f"{twin['bytes_sent_per_step'] / 1e3:.0f} kB) |".replace("+-", "-"))
  return "\n".join(lines)


# The full-CIFAR table's rows: (label, method or variant, density).
FULL_CIFAR_ROWS = (
    ("dense", "dense", None),
    ("DLGS, default: a threshold per message", "dlgs-message", 0.1),
    ("DLGS, default, density 0.01", "dlgs-message", 0.01),
    ("DLGS, per message, aimed at all of k (`dlgs-spend`)", "dlgs-spend", 0.1),
    ("DLGS, per message, aimed at all of k, density 0.01", "dlgs-spend", 0.01),
    ("Top-k", "topk", 0.1), ("Top-k, density 0.01", "topk", 0.01), ("LAGS", "lags", 0.1),
    ("DLGS, a threshold per layer (`dlgs-layer`)", "dlgs-layer", 0.1),
    ("DLGS, a threshold per layer, density 0.01", "dlgs-layer", 0.01),
    ("DLGS, paper's rule", "dlgs-paper", 0.1),
    ("DLGS, paper's rule, density 0.01", "dlgs-paper", 0.01),
    ("DLGS, paper's rule, head whole", "dlgs-paper-head", 0.1),
    ("DLGS, paper's rule, head whole, density 0.01", "dlgs-paper-head", 0.01),
    ("DLGS per layer, the owners' exchange", "dlgs-owners", 0.1))


def full_cifar() -> str:
  """Full CIFAR-10 per method and seed, the paired gap to dense, bytes and DLGS's thresholds."""
  runs = _load(RESULTS / "accuracy_full" / "table" / "results.json")["results"]
  by = {(r["method"], r["density"], r["seed"]): r["summary"] for r in runs}
  dense = {seed: summary for (m, _, seed), summary in by.items() if m == "dense"}
  lines = ["| method | seed 0 | seed 1 | seed 2 | − dense, paired (points) | MB a worker sends "
           "per step | exact thresholds, leaves | sent / k (sd over steps) |",
           "|---|---|---|---|---|---|---|---|"]
  for label, method, density in FULL_CIFAR_ROWS:
    seeds = {seed: summary for (m, d, seed), summary in by.items()
             if m == method and d == density}
    if not seeds:  # a row appears once its run has landed
      continue
    cells = [f"{100 * seeds[s]['final_test_accuracy']:.1f}%" if s in seeds else ""
             for s in (0, 1, 2)]
    gaps = _gaps(seeds, dense)
    gap = (f"{statistics.mean(gaps):+.1f} ± {statistics.stdev(gaps):.1f}" if len(gaps) > 1
           else f"{gaps[0]:+.1f} (one seed)" if gaps else "").replace("-", "−")
    gap = "" if method == "dense" else gap
    any_run = next(iter(seeds.values()))
    stats = any_run.get("threshold_stats") or {}
    exact = (f"{100 * statistics.mean(seeds[s]['threshold_stats']['exact_share'] for s in seeds):.1f}%"
             if stats else "")
    sent = ""
    if stats:
      sent = (f"{statistics.mean(seeds[s]['threshold_stats']['sent_over_k_mean'] for s in seeds):.2f}"
              f" ({statistics.mean(seeds[s]['threshold_stats']['sent_over_k_sd'] for s in seeds):.2f})")
    lines.append(f"| {label} | " + " | ".join(cells) + f" | {gap} | "
                 f"{any_run['bytes_sent_per_step'] / 1e6:.3f} | {exact} | {sent} |")
  return "\n".join(lines)


def cpu_floor(name: str = "cpu_flat") -> str:
  """Each update's ms and its median ratio to the memory floor on one CPU core, DLGS over LAGS."""
  rows = _load(RESULTS / "gpu_check" / f"{name}.json")["rows"]
  found = {(r["model"], _per_layer(r["method"]), r["grouping"]): r for r in rows}
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


# The timeline model's check: (configuration, its paired cluster job under results/compare/).
TIMELINE_CHECKS = (
    ("ResNet-50 (32x32), 0.01, 1 Gbit/s", "profiled_resnet50_0.01/compare_resnet50_0.01.json"),
    ("VGG16, 0.01, 100 Mbit/s", "vgg16_100mbit/compare_vgg16_0.01.json"),
    ("ResNet-20, 0.01, 100 Mbit/s", "resnet20_100mbit/compare_resnet20_0.01.json"),
    ("ResNet-20, 0.01, 1 Gbit/s", "resnet20_perleaf/compare_resnet20_0.01.json"),
    ("ResNet-50 (32x32), 0.1, 1 Gbit/s", "compare_resnet50_0.1.json"),
)


def timeline_check() -> str:
  """Per cluster job, how many methods' measured steps the timeline model predicts within 15%."""
  lines = ["| configuration: methods | within 15% | errors |", "|---|---|---|"]
  for label, path in TIMELINE_CHECKS:
    rows = [r for r in _load(RESULTS / "compare" / path)["summary"]
            if r.get("prediction_error") is not None]
    errors = [round(100 * r["prediction_error"]) for r in rows]
    within = sum(abs(r["prediction_error"]) <= 0.15 for r in rows)
    shown = ", ".join(f"**{e:+d}**" if abs(e) > 15 else f"{e:+d}" for e in errors)
    lines.append(f"| {label}: {', '.join(r['method'] for r in rows)} | {within} of {len(rows)} "
                 f"| {shown.replace('-', '−')}% |")
  return "\n".join(lines)


def h200_update() -> str:
  """One H200, the engine before flat buffers: each update's ms / floor ratio, DLGS's kernels."""
  base = RESULTS / "gpu_check"
  runs = [_load(base / f"{name}.json") for name in ("h200", "h200_resnet50_dlgs", "h200_vgg16_0.1")]
  found = {(r["model"], r["density"], _per_layer(r["method"])): r for run in runs
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


def _megabytes(x: float) -> str:
  return f"{x / 1e6:.1f}" if x >= 1e7 else f"{x / 1e6:.2f}"


def nodes_measured() -> str:
  """2 nodes x 2 devices: speedup over flat dense, and (1 Gbit/s) MB a step leaving a node."""
  lines = ["| model | link | dense two-level | DLGS | DLGS two-level | gTop-k |",
           "|---|---|---|---|---|---|"]
  for model in ("vgg16", "resnet50"):
    for link in ("1gbit", "100mbit"):
      run = _load(RESULTS / "nodes" / f"measured_{link}" / f"compare_{model}_0.01.json")
      speed = {r["method"]: r["speedup"] for r in run["summary"]}
      best = max(speed.values())
      cells = []
      for method in ("dense@2l", "dlgs", "dlgs@2l", "gtopk"):
        text = f"{speed[method]:.2f}x"
        cell = f"**{text}**" if speed[method] == best else text
        sent = run["methods"][method]
        if link == "1gbit" and "interface_bytes_per_process" in sent:
          cell += (f"; {_megabytes(sent['model_bytes_per_process'])} / "
                   f"{_megabytes(sent['interface_bytes_per_process'])}")
        cells.append(cell)
      lines.append(f"| {MODELS[model]} | {LINKS[link]} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _seed_runs(folder: str) -> dict:
  """(method, seed) -> run of an accuracy merge's results.json."""
  return {(r["method"], r["seed"]): r for r in _load(RESULTS / folder / "results.json")["results"]}


def _paired(runs: dict, method: str, measure: Callable) -> tuple[str, str]:
  """Method minus dense per seed, in points: (mean ± sd, the per-seed list)."""
  of = lambda name: {s: r for (m, s), r in runs.items() if m == name}  # noqa: E731
  gaps = _gaps(of(method), of("dense"), measure)
  mean = f"{statistics.mean(gaps):+.1f} ± {statistics.stdev(gaps):.1f}"
  return mean.replace("-", "−"), " / ".join(f"{g:+.1f}" for g in gaps).replace("-", "−")


def subset_budget() -> str:
  """The subset at 120 and 60 epochs: dense's accuracy, and DLGS-head's and Top-k's paired gaps."""
  final = lambda run: _final(run["summary"])  # noqa: E731
  last12 = lambda run: statistics.mean(e["test_accuracy"] for e in run["epochs"][-12:])  # noqa: E731

  def dense(runs):
    accs = [100 * final(r) for (m, _), r in sorted(runs.items()) if m == "dense"]
    return f"{statistics.mean(accs):.1f} ± {statistics.stdev(accs):.1f}%"

  long, short = _seed_runs("accuracy_120ep_seeds"), _seed_runs("accuracy_60ep_seeds")
  head, per_seed = _paired(long, "dlgs-head", final)
  lines = ["| budget | seeds | dense | DLGS-head − dense | Top-k − dense | results |",
           "|---|---|---|---|---|---|",
           f"| 120 epochs | 0-3 | {dense(long)} | {head} ({per_seed}) | - | "
           "`accuracy_120ep_seeds/` |",
           f"| 120 epochs, mean of the last 12 epochs | 0-3 | | "
           f"{_paired(long, 'dlgs-head', last12)[0]} | - | same |",
           f"| 60 epochs | 0-2 | {dense(short)} | {_paired(short, 'dlgs-head', final)[0]} | "
           f"{_paired(short, 'topk', final)[0]} | `accuracy_60ep_seeds/` |"]
  return "\n".join(lines)


def _share_range(values: list) -> str:
  low, high = f"{100 * min(values):.1f}", f"{100 * max(values):.1f}"
  return f"{low}%" if low == high else f"{low}-{high}%"


def threshold_rules() -> str:
  """The subset at 20 epochs: each threshold rule's accuracy, its gap to the refresh rule, stats."""
  rules = _load(RESULTS / "accuracy_thresholds" / "results.json")["results"]
  planned = _load(RESULTS / "accuracy_planned" / "results.json")["results"]
  runs = {(r["method"], r["density"], r["seed"]): r["summary"] for r in rules}
  runs.update({("dlgs-layer", r["density"], r["seed"]): r["summary"] for r in planned})
  lines = ["| density | rule | groups | final accuracy | − refresh rule, paired | exact, leaves "
           "| exact, values | sent / k |", "|---|---|---|---|---|---|---|---|"]
  for density in (0.1, 0.01):
    refresh = {s: x for (m, d, s), x in runs.items() if m == "dlgs-refresh" and d == density}
    for method, label, groups in (("dlgs-layer", "adapted, per layer", "one"),
                                  ("dlgs-refresh", "refresh rule", "per leaf"),
                                  ("dlgs-paper", "paper's rule", "per leaf")):
      seeds = {s: x for (m, d, s), x in runs.items() if m == method and d == density}
      accs = [100 * x["final_test_accuracy"] for _, x in sorted(seeds.items())]
      gaps = _gaps(seeds, refresh)
      gap = "-"
      if method != "dlgs-refresh":
        detail = (" / ".join(f"{g:+.1f}" for g in gaps) if len(gaps) <= 3
                  else f"{len(gaps)} seeds")
        gap = f"{statistics.mean(gaps):+.1f} ({detail})".replace("-", "−")
      stats = [x["threshold_stats"] for x in seeds.values() if x.get("threshold_stats")]
      leaves = _share_range([t["exact_share"] for t in stats])
      # The paper's rule recomputes every leaf on the same step: its values share is its leaves'.
      values = ([t["exact_values_share"] for t in stats] if method == "dlgs-layer"
                else [t["exact_share"] for t in stats] if method == "dlgs-paper" else [])
      shown = f"{100 * statistics.mean(values):.1f}%" if values else "-"
      sent = statistics.mean(t["sent_over_k_mean"] for t in stats)
      lines.append(f"| {density:g} | {label} | {groups} | {statistics.mean(accs):.1f} ± "
                   f"{statistics.stdev(accs):.1f}% | {gap} | {leaves} | {shown} | {sent:.2f} |")
  return "\n".join(lines)


def hsdp_memory() -> str:
  """Per device: the step's state (memory analysis) and bytes between nodes, sliced or not."""
  rows = _load(RESULTS / "hsdp" / "resnet20_memory.json")["rows"]
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
  run = _load(RESULTS / "hsdp" / "manual.json")
  lines = ["| shard_map | all-gathers | all-reduces | HLO instructions | temporaries |",
           "|---|---|---|---|---|"]
  for key, label in (("partial_manual", 'manual over "data" only'),
                     ("full_manual", "manual over both axes (used)")):
    row = run[key]
    lines.append(f"| {label} | {row['collectives']['all-gather']} | "
                 f"{row['collectives']['all-reduce']} | {row['instructions']:,} | "
                 f"{row['temporaries'] / 1e6:.2f} MB |")
  return "\n".join(lines)


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
    "predicted-scaling": predicted_scaling,
    "predicted-nodes": predicted_nodes,
    "owners-crossover": owners_crossover,
    "owners-cluster": owners_cluster,
    "owners-accuracy": owners_accuracy,
    "full-cifar": full_cifar,
    "cpu-floor": cpu_floor,
    "cpu-floor-small-pages": lambda: cpu_floor("cpu_flat_small_pages"),
    "cpu-floor-huge-pages": lambda: cpu_floor("cpu_flat_huge_pages"),
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
