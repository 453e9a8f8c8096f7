"""Tables of accuracy: full CIFAR-10, the subset, threshold rules, the owners' exchange, the demo."""

from __future__ import annotations

import re
import statistics
from typing import Callable

from tables_common import RESULTS, final_accuracy, load, seed_gaps


def demo_presets() -> str:
  """The demo's preset and its variants: accuracy, the gap to dense of as many epochs, bytes."""
  runs = load(RESULTS / "demo_presets" / "runs.json")["runs"]
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
  runs = load(RESULTS / "demo_presets" / "budget.json")["runs"]
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


def _code_label(code: tuple) -> str:
  """The commits a run trained at (`accuracy.code_version`), or what their absence means."""
  return "+".join(code) if code else "a commit before runs recorded theirs"


def owners_accuracy() -> str:
  """The demo's preset with the owners' exchange, the all-gather and gTop-k: accuracy, bytes;
  then full CIFAR-10, the owners' DLGS against the all-gather's, paired by seed."""
  runs = load(RESULTS / "compare" / "owners" / "demo_accuracy.json")["runs"]
  lines = ["| run | final test accuracy | bytes a worker a step |", "|---|---|---|"]
  lines += [f"| `{run['command']}` | {100 * run['final_test_accuracy']:.1f}% | "
            f"{run['bytes_sent_per_step'] / 1e3:.0f} kB |" for run in runs]
  full = {(r["method"], r["density"], r["seed"]): r for r in load(
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
  runs = load(RESULTS / "accuracy_full" / "table" / "results.json")["results"]
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
    gaps = seed_gaps(seeds, dense)
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


def _seed_runs(folder: str) -> dict:
  """(method, seed) -> run of an accuracy merge's results.json."""
  return {(r["method"], r["seed"]): r for r in load(RESULTS / folder / "results.json")["results"]}


def _paired(runs: dict, method: str, measure: Callable) -> tuple[str, str]:
  """Method minus dense per seed, in points: (mean ± sd, the per-seed list)."""
  of = lambda name: {s: r for (m, s), r in runs.items() if m == name}  # noqa: E731
  gaps = seed_gaps(of(method), of("dense"), measure)
  mean = f"{statistics.mean(gaps):+.1f} ± {statistics.stdev(gaps):.1f}"
  return mean.replace("-", "−"), " / ".join(f"{g:+.1f}" for g in gaps).replace("-", "−")


def subset_budget() -> str:
  """The subset at 120 and 60 epochs: dense's accuracy, and DLGS-head's and Top-k's paired gaps."""
  final = lambda run: final_accuracy(run["summary"])  # noqa: E731
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
  rules = load(RESULTS / "accuracy_thresholds" / "results.json")["results"]
  planned = load(RESULTS / "accuracy_planned" / "results.json")["results"]
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
      gaps = seed_gaps(seeds, refresh)
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
