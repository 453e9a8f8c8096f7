"""Accuracy of every method under the same training budget (the paper's Table 1, at our scale).

Trains the same model with the same epochs, batch, learning-rate schedule and
seed once per method and density with `dlgs-train` (one process, --workers
simulated CPU devices; each device is one data-parallel worker, so the
compressors see --workers different gradients exactly as on a cluster), then
collects each run's per-epoch test accuracy and loss.

    python experiments/accuracy.py                         # ResNet-20, 4 workers, 0.1 and 0.01
    python experiments/accuracy.py --quick                 # 2 epochs, dense and dlgs only
    python experiments/accuracy.py --data-dir ~/data/cifar-10-batches-py --epochs 140

Writes results.json, results.md and curves.png under --out-dir. A run whose
summary already exists with the same settings is reused (runs take minutes
each), unless --rerun. DLGS's layer grouping only changes how values are
packed into collectives, not which values are sent, so runs use the default
grouping; the timing benchmark (`bench_cluster.py`) uses planned groups.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from dlgs_jax.train import DENSITY_FREE, configurations, variant

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="resnet20")
  parser.add_argument("--methods", default="dense,topk,lags,gtopk,dlgs,dlgs-paper,"
                      "dlgs-whole1d,lags-whole1d,dlgs-head,lags-head",
                      help="dlgs-train methods, or a variant: dlgs-paper (the paper's fixed "
                      "threshold schedule, --refresh-below none), dlgs-whole1d / lags-whole1d "
                      "(biases and BatchNorm parameters sent whole, --min-ndim 2), dlgs-head / "
                      "lags-head (the classifier head sent whole, --send-whole head)")
  parser.add_argument("--densities", default="0.1,0.01")
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--epochs", type=int, default=20)
  parser.add_argument("--batch-size", type=int, default=32, help="examples per worker per step")
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--data-dir", help="full CIFAR-10 (cifar-10-batches-py/); default: the "
                      "embedded subset")
  parser.add_argument("--quick", action="store_true", help="2 epochs, dense and dlgs at 0.1")
  parser.add_argument("--rerun", action="store_true", help="train again even if a run exists")
  parser.add_argument("--out-dir", default=str(HERE / "results" / "accuracy"))
  parser.add_argument("--runs-dir", default=str(ROOT / "runs" / "accuracy"),
                      help="training work directories (checkpoints, full metrics)")
  args = parser.parse_args(argv)
  if args.quick:
    args.methods, args.densities, args.epochs = "dense,dlgs", "0.1", 2
  return args


def train_command(args, method, density, workdir):
  # Density-free methods (dense, terngrad) get no --density: their run, and so the
  # command that decides whether a finished run is reused, is the same for every density.
  density_flags = [] if method in DENSITY_FREE else ["--density", str(density)]
  method, extra = variant(method)
  command = [sys.executable, "-m", "dlgs_jax.train", "--model", args.model, "--method", method,
             *extra, *density_flags, "--epochs", str(args.epochs),
             "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(args.seed),
             "--local-devices", str(args.workers), "--workers", str(args.workers),
             "--workdir", str(workdir), "--check-every", "0", "--keep", "1"]
  if args.data_dir:
    command += ["--data-dir", args.data_dir]
  return command


def read_run(workdir: Path):
  """Per-epoch records and the summary of a finished run."""
  epochs = []
  with open(workdir / "metrics.jsonl") as f:
    for line in f:
      record = json.loads(line)
      if record.get("event") == "epoch_end":
        epochs.append({k: record[k] for k in ("epoch", "step", "test_accuracy", "test_loss",
                                              "train_loss", "train_accuracy") if k in record})
  summary = json.loads((workdir / "summary.json").read_text())
  return epochs, summary


def main(argv=None) -> int:
  args = parse_args(argv)
  out, runs = Path(args.out_dir), Path(args.runs_dir)
  out.mkdir(parents=True, exist_ok=True)
  methods = args.methods.split(",")
  densities = [float(d) for d in args.densities.split(",")]
  results = []
  for method, density in configurations(methods, densities):
    name = method if method in DENSITY_FREE else f"{method}_{density:g}"
    workdir = runs / f"{args.model}_{name}"
    command = train_command(args, method, density, workdir)
    settings_file = workdir / "accuracy_command.json"
    done = ((workdir / "summary.json").exists() and settings_file.exists()
            and json.loads(settings_file.read_text()) == command[1:])
    if args.rerun or not done:
      if workdir.exists():
        subprocess.run(["rm", "-rf", str(workdir)], check=True)
      workdir.mkdir(parents=True)
      settings_file.write_text(json.dumps(command[1:]))
      print(f"== {name}: {' '.join(command[1:])}", flush=True)
      started = time.time()
      status = subprocess.run(command, cwd=ROOT).returncode
      if status != 0:
        raise SystemExit(f"training {name} failed with status {status}")
      print(f"== {name}: {time.time() - started:.0f} s", flush=True)
    else:
      print(f"== {name}: reusing {workdir}", flush=True)
    epochs, summary = read_run(workdir)
    results.append({"method": method, "density": None if method in DENSITY_FREE else density,
                    "epochs": epochs, "summary": summary,
                    "command": "python -m dlgs_jax.train " + " ".join(command[3:])})
  meta = {"command": "python experiments/accuracy.py " + " ".join(
              sys.argv[1:] if argv is None else argv),
          "model": args.model, "workers": args.workers, "epochs": args.epochs,
          "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
          "data": args.data_dir or "embedded CIFAR-10 subset (3,805 train / 761 test)"}
  (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
  table = markdown(results)
  (out / "results.md").write_text(table + "\n")
  print(table)
  plot(results, meta, out / "curves.png")
  return 0


def markdown(results) -> str:
  dense = next((r for r in results if r["method"] == "dense"), None)
  lines = ["| method | density | final test acc | vs dense (points) | best test acc | final test "
           "loss | final train loss | MB sent/worker/step | minutes |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    last = r["epochs"][-1]
    s = r["summary"]
    delta = ((last["test_accuracy"] - dense["epochs"][-1]["test_accuracy"]) * 100
             if dense else None)
    # Dense transforms keep no traffic counter: theirs is the all-reduce's.
    sent = s.get("bytes_sent_per_step") or s.get("dense_bytes_per_step")
    lines.append(
        f"| {r['method']} | {'-' if r['density'] is None else format(r['density'], 'g')} | "
        f"{last['test_accuracy'] * 100:.1f}% | "
        f"{'' if delta is None else format(delta, '+.1f')} | "
        f"{max(e['test_accuracy'] for e in r['epochs']) * 100:.1f}% | "
        f"{last['test_loss']:.3f} | {last.get('train_loss', float('nan')):.3f} | "
        f"{'' if sent is None else format(sent / 1e6, '.3f')} | {s['seconds'] / 60:.1f} |")
  return "\n".join(lines)


def plot(results, meta, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  densities = sorted({r["density"] for r in results if r["density"] is not None}, reverse=True)
  densities = densities or [None]
  fig, axes = plt.subplots(2, len(densities), figsize=(5 * len(densities), 7), squeeze=False)
  for column, density in enumerate(densities):
    shown = [r for r in results if r["density"] in (density, None)]
    for r in shown:
      epochs = [e["epoch"] + 1 for e in r["epochs"]]
      style = {"color": "black", "linewidth": 2} if r["method"] == "dense" else {}
      axes[0][column].plot(epochs, [e["test_accuracy"] * 100 for e in r["epochs"]],
                           label=r["method"], **style)
      axes[1][column].plot(epochs, [e.get("train_loss", float("nan")) for e in r["epochs"]],
                           label=r["method"], **style)
    title = f"density {density:g}" if density is not None else ""
    axes[0][column].set_title(f"{meta['model']}, {meta['workers']} workers, {title}", fontsize=9)
    axes[0][column].set_ylabel("test accuracy (%)")
    axes[1][column].set_ylabel("train loss (epoch mean)")
    axes[1][column].set_xlabel("epoch")
    axes[0][column].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
