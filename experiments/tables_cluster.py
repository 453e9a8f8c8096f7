"""Tables of the cluster runs: speedups, the measured step, messages, the timeline's checks, nodes."""

from __future__ import annotations

from typing import Optional

from compare_cluster import sign_test
from tables_common import LINKS, MODELS, RESULTS, budget_named, load


# The cluster rows, in the order the README reads them (link first, then model).
CLUSTER_ROWS = [(model, link) for link in ("100mbit", "1gbit")
                for model in ("resnet50", "vgg16", "resnet20")]


# Results written while DLGS's default was a threshold per layer (the adapted rule) call
# that "dlgs"; the tables name it `dlgs-layer`, its name since the default became one
# threshold per message. A cluster job records each DLGS method's budget since; one
# that does not ran "dlgs" per layer (`budget_named`, `per_layer_named`).
SPARSE = (("dlgs", "DLGS"), ("dlgs-layer", "DLGS per layer"), ("dlgs-paper", "DLGS, paper's rule"),
          ("topk", "Top-k"), ("lags", "LAGS"), ("gtopk", "gTop-k"))


def cluster_runs(model: str, link: str) -> tuple[Optional[dict], Optional[dict]]:
  """The paired cluster job of a row, and the job that ran LAGS and gTop-k where it is another."""
  base = RESULTS / "compare" / "batched"
  main = load(base / f"{model}_{link}" / f"compare_{model}_0.01.json")
  extra = load(base / f"{model}_{link}_lags_gtopk" / f"compare_{model}_0.01.json")
  return budget_named(main), budget_named(extra)


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
    run = budget_named(load(RESULTS / "compare" / "message" / f"{model}_100mbit"
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


def topk_pair() -> str:
  """ResNet-20 at 100 Mbit/s on flat buffers: Top-k against both DLGS rules, one long paired job."""
  run = budget_named(load(RESULTS / "compare" / "resnet20_100mbit" / "topk_pair_flat"
                          / "compare_resnet20_0.01.json"))
  wins, rounds = run["wins"], len(run["round_orders"])
  lines = ["| method | median step | speedup over dense | rounds ahead of Top-k | sign test p |",
           "|---|---|---|---|---|"]
  for method, name in (("dense", "dense"), ("topk", "Top-k"), ("dlgs", "DLGS, default"),
                       ("dlgs-paper", "DLGS, paper's rule")):
    row = _summary(run, method)
    ahead, p = "", ""
    if method.startswith("dlgs"):
      ahead = f"{wins[method]['topk']} of {rounds}"
      p = f"{sign_test(wins[method]['topk'], wins['topk'][method]):.1g}"
    lines.append(f"| {name} | {row['median'] * 1e3:.1f} ms | {row['speedup']:.2f}x | {ahead} | {p} |")
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
    rows = [r for r in load(RESULTS / "compare" / path)["summary"]
            if r.get("prediction_error") is not None]
    errors = [round(100 * r["prediction_error"]) for r in rows]
    within = sum(abs(r["prediction_error"]) <= 0.15 for r in rows)
    shown = ", ".join(f"**{e:+d}**" if abs(e) > 15 else f"{e:+d}" for e in errors)
    lines.append(f"| {label}: {', '.join(r['method'] for r in rows)} | {within} of {len(rows)} "
                 f"| {shown.replace('-', '−')}% |")
  return "\n".join(lines)


def _megabytes(x: float) -> str:
  return f"{x / 1e6:.1f}" if x >= 1e7 else f"{x / 1e6:.2f}"


def nodes_measured() -> str:
  """2 nodes x 2 devices: speedup over flat dense, and (1 Gbit/s) MB a step leaving a node."""
  lines = ["| model | link | dense two-level | DLGS | DLGS two-level | gTop-k |",
           "|---|---|---|---|---|---|"]
  for model in ("vgg16", "resnet50"):
    for link in ("1gbit", "100mbit"):
      run = load(RESULTS / "nodes" / f"measured_{link}" / f"compare_{model}_0.01.json")
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


def owners_cluster() -> str:
  """The owners' exchange against the all-gather on the emulated cluster, paired, per P."""
  lines = ["| P | method | median step ms | speedup over dense (range) | kB sent a worker | "
           "rounds ahead of its all-gather twin |", "|---|---|---|---|---|---|"]
  for folder in ("resnet20_100mbit", "resnet20_100mbit_p8"):
    run = load(RESULTS / "compare" / "owners" / folder / "compare_resnet20_0.01.json")
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
