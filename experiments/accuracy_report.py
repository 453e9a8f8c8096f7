"""The accuracy runs' report: results.json, the Markdown tables and the curves (`write_report`).

`accuracy.py` trains the runs and calls `write_report`; the tables here read
only the runs' records: final accuracy and bytes per configuration, seeds side
by side, the gaps paired by seed against a base method, DLGS's thresholds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_report(results, meta, out: Path, versus=()):
  """results.json, results.md (printed too) and curves.png under out.

  Args:
    results: the runs.
    meta: their settings.
    out: the folder.
    versus: (A, B) method pairs whose paired gaps the table adds.

  Raises:
    SystemExit: a method of `versus` has no run, before anything is written.
  """
  for pair in versus:
    missing = [m for m in pair if not any(r["method"] == m for r in results)]
    if missing:
      raise SystemExit(f"--versus {':'.join(pair)}: no run of {', '.join(missing)} here; "
                       f"the runs are of {', '.join(sorted({r['method'] for r in results}))}")
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
  table = markdown(results)
  if len(meta["seeds"]) > 1 and any(r["method"] == "dense" for r in results):
    table += "\n\n" + markdown_paired_gaps(results)
  for a, b in versus:
    table += "\n\n" + markdown_paired_gaps(results, base=b, only=(a,))
  if any("threshold_stats" in r["summary"] for r in results):
    table += "\n\n" + markdown_thresholds(results)
  (out / "results.md").write_text(table + "\n")
  print(table)
  plot(results, meta, out / "curves.png")


def markdown_thresholds(results) -> str:
  """DLGS's thresholds per configuration: exact share, values sent against k (means over seeds)."""
  lines = ["| method | density | seeds | exact thresholds | values under an exact threshold | "
           "sent / k: mean | sd over steps | 10th-90th percentile |",
           "|---|---|---|---|---|---|---|---|"]
  for (method, density), runs in by_configuration(results).items():
    stats = [r["summary"]["threshold_stats"] for r in runs if "threshold_stats" in r["summary"]]
    if not stats:
      continue
    mean = lambda key: np.mean([s[key] for s in stats])  # noqa: E731
    values = [s.get("exact_values_share") for s in stats]
    values = f"{np.mean(values):.1%}" if None not in values else "-"
    lines.append(f"| {method} | {density:g} | {len(stats)} | {mean('exact_share'):.1%} | "
                 f"{values} | {mean('sent_over_k_mean'):.2f} | {mean('sent_over_k_sd'):.2f} | "
                 f"{mean('sent_over_k_p10'):.2f}-{mean('sent_over_k_p90'):.2f} |")
  return "\n".join(lines)


def final_accuracy(run) -> float:
  """Test accuracy after the last epoch, in percent."""
  return run["epochs"][-1]["test_accuracy"] * 100


def bytes_sent(summary):
  """Bytes one worker sends per step; dense transforms keep no traffic counter, so
  theirs is the all-reduce's. None when the run recorded neither."""
  return summary.get("bytes_sent_per_step") or summary.get("dense_bytes_per_step")


def step_seconds(runs) -> str:
  """The runs' median step time in seconds (their mean), as a table cell.

  Not their wall time: a resumed run's summary times only its last process, and a
  run that shared the machine for a while would look slower than it is. Empty
  where a run timed no step (a resume with nothing left to run).
  """
  times = [r["summary"].get("median_step_time") for r in runs]
  return "" if None in times else f"{np.mean(times):.3f}"


def by_configuration(results) -> dict:
  """Runs grouped by (method, density), in the order they were run, seeds in order."""
  groups = {}
  for r in results:
    groups.setdefault((r["method"], r["density"]), []).append(r)
  return groups


def mean_sd(values, decimals: int = 1, sign: str = "", unit: str = "") -> str:
  """`values`' mean ± sample sd, or the one value alone (one seed has no spread).

  Args:
    values: the numbers, one a seed.
    decimals: decimals of the mean and the sd.
    sign: "+" to sign the mean (a gap), "" for a level.
    unit: appended, e.g. "%".

  Returns:
    e.g. "+0.47 ± 0.46", "89.6 ± 0.1%" or "-0.3".
  """
  mean = f"{np.mean(values):{sign}.{decimals}f}"
  if len(values) < 2:
    return mean + unit
  return f"{mean} ± {np.std(values, ddof=1):.{decimals}f}{unit}"


def markdown(results) -> str:
  """The results table: one row per run, or with several seeds one row per configuration."""
  if len({r.get("seed", 0) for r in results}) > 1:
    return markdown_seeds(results)
  dense = next((r for r in results if r["method"] == "dense"), None)
  lines = ["| method | density | final test acc | vs dense (points) | best test acc | final test "
           "loss | final train loss | MB sent/worker/step | median s/step |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    last = r["epochs"][-1]
    s = r["summary"]
    delta = final_accuracy(r) - final_accuracy(dense) if dense else None
    sent = bytes_sent(s)
    lines.append(
        f"| {r['method']} | {'-' if r['density'] is None else format(r['density'], 'g')} | "
        f"{final_accuracy(r):.1f}% | "
        f"{'' if delta is None else format(delta, '+.1f')} | "
        f"{max(e['test_accuracy'] for e in r['epochs']) * 100:.1f}% | "
        f"{last['test_loss']:.3f} | {last.get('train_loss', float('nan')):.3f} | "
        f"{'' if sent is None else format(sent / 1e6, '.3f')} | {step_seconds([r])} |")
  return "\n".join(lines)


def markdown_seeds(results) -> str:
  """Mean and sample standard deviation over seeds, and the paired gap to dense.

  The gap to dense is taken seed by seed (same initialisation and data order)
  before averaging, which removes the part of the seed-to-seed spread that both
  runs share.
  """
  dense = {r["seed"]: final_accuracy(r) for r in results if r["method"] == "dense"}
  lines = ["| method | density | seeds | final test acc (mean ± sd) | per seed | vs dense, paired "
           "(points, mean ± sd) | final test loss | final train loss | MB sent/worker/step | "
           "median s/step |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for (method, density), runs in by_configuration(results).items():
    accuracies = [final_accuracy(r) for r in runs]
    paired = [r for r in runs if r["seed"] in dense]
    gaps = mean_sd([final_accuracy(r) - dense[r["seed"]] for r in paired], sign="+") \
        if paired else ""
    if 0 < len(paired) < len(runs):  # only the seeds dense also ran are paired
      gaps += f" (seed {','.join(str(r['seed']) for r in paired)} only)"
    sent = [bytes_sent(r["summary"]) for r in runs]
    lines.append(
        f"| {method} | {'-' if density is None else format(density, 'g')} | "
        f"{','.join(str(r['seed']) for r in runs)} | {mean_sd(accuracies, unit='%')} | "
        f"{' / '.join(f'{a:.1f}' for a in accuracies)} | "
        f"{gaps} | "
        f"{np.mean([r['epochs'][-1]['test_loss'] for r in runs]):.3f} | "
        f"{np.mean([r['epochs'][-1].get('train_loss', np.nan) for r in runs]):.3f} | "
        f"{'' if None in sent else format(np.mean(sent) / 1e6, '.3f')} | "
        f"{step_seconds(runs)} |")
  return "\n".join(lines)


def paired_gaps(results, tail: int, base: str = "dense", only=None) -> dict:
  """Per configuration other than `base`: its gap to `base` seed by seed, in points.

  Args:
    results: runs of several seeds, `base` among them.
    tail: how many final epochs the "tail" measure averages.
    base: the method compared against. A run is paired with `base`'s run of the
      same seed and density (dense has no density: it pairs with every one).
    only: the methods to compare with `base` (default: every other one).

  Returns:
    {(method, density): {"final" | "tail" | "best": [gap per seed]}} over the seeds
    that have a `base` run; "final" is the last epoch's test accuracy, "tail" the mean
    over the last `tail` epochs, "best" the best epoch's.
  """
  def measures(run):
    accuracy = np.array([e["test_accuracy"] for e in run["epochs"]]) * 100
    return {"final": final_accuracy(run), "tail": accuracy[-tail:].mean(),
            "best": accuracy.max()}

  bases = {(r["seed"], r["density"]): measures(r) for r in results if r["method"] == base}
  gaps = {}
  for configuration, runs in by_configuration(results).items():
    if configuration[0] == base or (only is not None and configuration[0] not in only):
      continue
    per_seed = [(measures(r), bases.get((r["seed"], r["density"]), bases.get((r["seed"], None))))
                for r in runs]
    per_seed = [(own, other) for own, other in per_seed if other is not None]
    if not per_seed:
      continue
    gaps[configuration] = {name: [own[name] - other[name] for own, other in per_seed]
                           for name in ("final", "tail", "best")}
  return gaps


def markdown_paired_gaps(results, base: str = "dense", only=None) -> str:
  """Paired gaps to `base` under three measures of the test accuracy, seed by seed.

  The final epoch's accuracy on a small test set moves by about a point between
  neighbouring epochs, as much as the gaps being measured; the mean over the
  last tenth of the epochs and the best epoch say how much of a gap is that noise.
  Gaps have two decimals, so that one read against a bar such as 0.5 is not
  rounded onto it. Arguments as `paired_gaps`; with one seed the mean has no spread.
  """
  tail = max(1, len(results[0]["epochs"]) // 10)
  names = {"final": "final test accuracy", "tail": f"mean of the last {tail} epochs",
           "best": "best test accuracy"}
  lines = ["| method | density | measure | gap per seed (points) | gap, mean ± sd |",
           "|---|---|---|---|---|"]
  for (method, density), gaps in paired_gaps(results, tail, base, only).items():
    label = method if base == "dense" else f"{method} − {base}"
    for name, values in gaps.items():
      one = "" if len(values) > 1 else " (one seed)"
      lines.append(f"| {label} | {'-' if density is None else format(density, 'g')} | "
                   f"{names[name]} | {' / '.join(f'{v:+.2f}' for v in values)} | "
                   f"{mean_sd(values, 2, sign='+')}{one} |")
  return "\n".join(lines)


def plot(results, meta, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  densities = sorted({r["density"] for r in results if r["density"] is not None}, reverse=True)
  densities = densities or [None]
  # A third row where DLGS ran: how much its thresholds let through, against k.
  sent = any("sent_over_k_by_epoch" in r["summary"].get("threshold_stats", {}) for r in results)
  rows = 3 if sent else 2
  fig, axes = plt.subplots(rows, len(densities), figsize=(5 * len(densities), 3.5 * rows),
                           squeeze=False)
  for column, density in enumerate(densities):
    for (method, run_density), runs in by_configuration(results).items():
      if run_density not in (density, None):
        continue
      # Seeds of one configuration share the epoch count: the curves are their mean.
      epochs = [e["epoch"] + 1 for e in runs[0]["epochs"]]
      accuracy = np.mean([[e["test_accuracy"] * 100 for e in r["epochs"]] for r in runs], axis=0)
      train_loss = np.mean([[e.get("train_loss", np.nan) for e in r["epochs"]] for r in runs],
                           axis=0)
      label = method if len(runs) == 1 else f"{method} (mean of {len(runs)} seeds)"
      style = {"color": "black", "linewidth": 2} if method == "dense" else {}
      axes[0][column].plot(epochs, accuracy, label=label, **style)
      axes[1][column].plot(epochs, train_loss, label=label, **style)
      curves = [r["summary"].get("threshold_stats", {}).get("sent_over_k_by_epoch")
                for r in runs]
      if sent and all(curves):
        axes[2][column].plot(range(1, len(curves[0]) + 1), np.mean(curves, axis=0), label=label)
    title = f"density {density:g}" if density is not None else ""
    axes[0][column].set_title(f"{meta['model']}, {meta['workers']} workers, {title}", fontsize=9)
    axes[0][column].set_ylabel("test accuracy (%)")
    axes[1][column].set_ylabel("train loss (epoch mean)")
    axes[rows - 1][column].set_xlabel("epoch")
    if sent:
      axes[2][column].set_ylabel("values sent / k (epoch mean)")
      axes[2][column].axhline(1.0, color="grey", linewidth=0.8)
      axes[2][column].set_ylim(bottom=0)  # how far below k a rule falls is the point
    axes[0][column].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
