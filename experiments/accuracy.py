"""Accuracy of every method under the same training budget (the paper's Table 1, at our scale).

Trains the same model with the same epochs, batch, learning-rate schedule and
seed once per method, density and seed with `dlgs-train` (one process, --workers
simulated CPU devices; each device is one data-parallel worker, so the
compressors see --workers different gradients exactly as on a cluster), then
collects each run's per-epoch test accuracy and loss.

    python experiments/accuracy.py                         # ResNet-20, 4 workers, 0.1 and 0.01
    python experiments/accuracy.py --quick                 # 2 epochs, dense and dlgs only
    python experiments/accuracy.py --data-dir ~/data/cifar-10-batches-bin --epochs 140
    python experiments/accuracy.py --methods dense,dlgs-head --densities 0.1 --seeds 0,1,2
    python experiments/accuracy.py --methods dense,dlgs,dlgs@2l --densities 0.1 --node-size 2
    python experiments/accuracy.py --merge a/results.json,b/results.json --out-dir both
    python experiments/accuracy.py --simulate --methods dense,dlgs --densities 0.01  # one GPU

Writes results.json, results.md and curves.png under --out-dir; each run in
results.json names the code it trained with (`code_version`: the commit, and
whether dlgs_jax/ differed from it), so a table can say which code it shows. A run whose
summary already exists with the same settings is reused (runs take minutes
each), and one interrupted after an epoch's checkpoint is resumed, unless
--rerun; one made by another command stops the script before any training,
unless --rerun. A run that a signal stops keeps its checkpoint and ends the
script with an error, writing no table (its epochs so far are no result).
Runs use one group per leaf unless --plan-dir gives planned groups: DLGS
recomputes a group's thresholds together, so the grouping changes how often
thresholds are exact (the timing benchmarks use planned groups). A name
ending in @2l trains that method in two levels (`compress.hierarchical`): the
--workers devices as nodes of --node-size, dense inside a node, the method
between nodes.
With several seeds the table gives each configuration's mean and sample
standard deviation, and its gap to dense taken seed by seed; --versus A:B adds
A's gap to B the same way (e.g. dlgs-paper:dlgs, the two threshold rules).
--merge joins the results.json of runs made separately (e.g. one seed per job)
into one table and one figure, without training; it refuses files whose
settings differ.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from dlgs_jax.cli.train import method_flags
from dlgs_jax.compress.selection import num_to_keep
from dlgs_jax.workload import models
from dlgs_jax.compress.hierarchical import slice_shape
from dlgs_jax.compress.rules import AdaptedReuse
from dlgs_jax.compress.methods import base_method, configurations, density_free
from dlgs_jax.training.bench.benchmark import exchange_of

from accuracy_report import write_report

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
                      "lags-head (the classifier head sent whole, --send-whole head), "
                      "dlgs-paper-head (both)")
  parser.add_argument("--densities", default="0.1,0.01")
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--simulate", action="store_true",
                      help="run the --workers workers on one device (dlgs-train "
                      "--simulate-workers: one GPU) instead of as many CPU devices")
  parser.add_argument("--epochs", type=int, default=20)
  parser.add_argument("--batch-size", type=int, default=32, help="examples per worker per step")
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--seeds", "--seed", default="0",
                      help="comma-separated seeds; with several, every configuration is "
                      "trained once per seed and the table gives mean and spread")
  parser.add_argument("--data-dir", help="full CIFAR-10 (cifar-10-batches-bin/ or -py/); default: the "
                      "embedded subset")
  parser.add_argument("--plan-dir", help="train with bench_cluster.py's plans from this directory "
                      "(plan_<model>_<method>_<density>.json, where one exists; a variant "
                      "without one takes its base method's): the planned groups instead of one "
                      "group per leaf")
  parser.add_argument("--node-size", type=int, default=2,
                      help="devices per node of the methods named with @2l (two-level)")
  parser.add_argument("--quick", action="store_true", help="2 epochs, dense and dlgs at 0.1")
  parser.add_argument("--rerun", action="store_true", help="train again even if a run exists")
  parser.add_argument("--out-dir", default=str(HERE / "results" / "accuracy"))
  parser.add_argument("--runs-dir", default=str(ROOT / "runs" / "accuracy"),
                      help="training work directories (checkpoints, full metrics)")
  parser.add_argument("--merge", help="comma-separated results.json files to join into one "
                      "table and figure under --out-dir; trains nothing, and the training "
                      "flags are ignored")
  parser.add_argument("--versus", default="",
                      help="comma-separated A:B method pairs: the table also gives A's gap to "
                      "B, paired by seed and density (e.g. dlgs-paper:dlgs)")
  args = parser.parse_args(argv)
  args.versus = [tuple(pair.split(":")) for pair in args.versus.split(",") if pair]
  for pair in args.versus:
    if len(pair) != 2 or not all(pair) or pair[0] == pair[1]:
      parser.error(f"--versus {':'.join(pair)!r} is invalid: give two different methods as A:B")
  if args.merge:
    args.merge = [Path(path) for path in args.merge.split(",")]
    return args
  if args.quick:
    args.methods, args.densities, args.epochs = "dense,dlgs", "0.1", 2
  for pair in args.versus:
    missing = [m for m in pair if m not in args.methods.split(",")]
    if missing:
      parser.error(f"--versus {':'.join(pair)!r} is invalid: {', '.join(missing)} is not "
                   f"among --methods {args.methods}")
  try:
    args.seeds = [int(seed) for seed in args.seeds.split(",")]
  except ValueError:
    parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
  if len(set(args.seeds)) != len(args.seeds):
    parser.error(f"--seeds repeats a seed: {args.seeds}")
  return args


def run_dir(runs: Path, model: str, name: str, seed: int) -> Path:
  """Work directory of one run. Seed 0 keeps the single-seed layout, so its runs are reused."""
  return runs / f"{model}_{name}" if seed == 0 else runs / f"seed{seed}" / f"{model}_{name}"


def free(name: str) -> bool:
  """Whether a compared name (a method, a variant, either with @2l) takes no density."""
  return density_free(exchange_of(name)[0])


def train_command(args, name, density, seed, workdir):
  # Density-free methods (dense, terngrad) get no --density: their run, and so the
  # command that decides whether a finished run is reused, is the same for every density.
  method, two_level = exchange_of(name)
  density_flags = [] if density_free(method) else ["--density", str(density)]
  command = [sys.executable, "-m", "dlgs_jax.cli.train", "--model", args.model,
             *method_flags(method), *density_flags, "--epochs", str(args.epochs),
             "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(seed),
             *(["--simulate-workers", str(args.workers)] if args.simulate else
               ["--local-devices", str(args.workers), "--workers", str(args.workers)]),
             "--workdir", str(workdir), "--check-every", "0", "--keep", "1"]
  if args.data_dir:
    command += ["--data-dir", args.data_dir]
  if two_level:
    command += ["--node-size", str(args.node_size)]
  if args.plan_dir:
    from dlgs_jax.planning.pricing import plan_file

    plan = plan_file(args.plan_dir, args.model, name, density)
    if not plan.exists():  # a variant groups its messages as its base method does
      plan = plan_file(args.plan_dir, args.model, name.replace(method, base_method(method), 1),
                       density)
    if plan.exists():
      command += ["--plan", str(plan)]
  return command


def read_run(workdir: Path, model: str, density, fast_size: int = 1):
  """Per-epoch records and the summary of a finished run (with `threshold_stats` for DLGS)."""
  epochs, steps = [], []
  with open(workdir / "metrics.jsonl") as f:
    for line in f:
      record = json.loads(line)
      if record.get("event") == "epoch_end":
        epochs.append({k: record[k] for k in ("epoch", "step", "test_accuracy", "test_loss",
                                              "train_loss", "train_accuracy") if k in record})
      elif "event" not in record and "exact" in record:
        steps.append(record)
  summary = json.loads((workdir / "summary.json").read_text())
  if density is not None and summary.get("method") == "dlgs" and steps:
    method = json.loads((workdir / "config.json").read_text())["method"]
    # A message budget selects each message as one: no leaf is exact on every step.
    few_exact = (method.get("refresh_below") is not None and method.get("candidates", 1) > 1
                 and method.get("budget", "layer") == "layer")  # no key: a run before budgets
    summary["threshold_stats"] = threshold_stats(
        steps, model, density, fast_size, one_group=summary.get("plan_groups") == 1,
        few_exact=few_exact)
  return epochs, summary


def threshold_stats(steps, model: str, density: float, fast_size: int = 1, *,
                    one_group: bool = False, few_exact: bool = False) -> dict:
  """Share of thresholds computed exactly, and values sent per step against k (sum of k_l).

  ``sent_over_k_by_epoch`` is the mean per epoch (steps without an epoch count as epoch 0).

  Per step the metrics hold one worker's values sent and leaves recomputed; in
  two levels (`fast_size` devices per node) a worker selects on its 1/fast_size
  slice of each leaf, with that slice's k. With the whole model in one group
  the leaves counted also tell how many values were under an exact threshold
  (`exact_values_share`): the group recomputed, or only the leaves of
  k < `rules.AdaptedReuse().exact_below_k` did (`few_exact`: adapted thresholds).
  """
  sizes = [math.prod(slice_shape(leaf.shape, fast_size))
           for leaf in jax.tree_util.tree_leaves(models.param_shapes(model))]
  ks = [num_to_keep(density, size) for size in sizes]
  k = sum(ks)
  sent = np.array([step["selected"] for step in steps]) / k
  leaves = np.array([step["exact"] for step in steps])
  exact = leaves / len(sizes)
  values_share = None
  if one_group:
    few = [kl < AdaptedReuse().exact_below_k for kl in ks] if few_exact else [False] * len(ks)
    regrouped = (leaves - sum(few)) / (len(sizes) - sum(few))  # steps the group recomputed
    few_values = sum(size for size, f in zip(sizes, few) if f) / sum(sizes)
    values_share = float(np.mean(regrouped + (1 - regrouped) * few_values))
  epochs = np.array([step.get("epoch", 0) for step in steps])
  by_epoch = [float(sent[epochs == e].mean()) for e in np.unique(epochs)]
  return {"exact_share": float(exact.mean()), "exact_values_share": values_share,
          "sent_over_k_mean": float(sent.mean()), "sent_over_k_by_epoch": by_epoch,
          "sent_over_k_sd": float(sent.std()),
          "sent_over_k_p10": float(np.percentile(sent, 10)),
          "sent_over_k_p90": float(np.percentile(sent, 90))}


# The settings that must agree for runs to be compared in one table.
# A plan (`plan_dir`) groups one method's messages: part of that method's row, not of
# the settings every row shares.
MERGE_KEYS = ("model", "workers", "epochs", "batch_size", "lr", "data", "node_size")


def merge_results(paths):
  """Joins results.json files of runs made separately into one (meta, results).

  Args:
    paths: results.json files written by this script.

  Returns:
    (meta, results): the first file's settings with every file's seeds, and the
    runs ordered by seed, each seed's configurations in the order they were run.

  Raises:
    SystemExit: naming the file and the setting, where a file is missing, its
      settings differ from the first file's, a run stopped before its last step,
      or a (method, density, seed) run appears twice (nothing would say which
      one the table shows).
  """
  if len(paths) < 2:
    raise SystemExit(f"--merge needs at least two results.json files, got {len(paths)}")
  meta, results, seen = None, [], {}
  for path in paths:
    if not path.is_file():
      raise SystemExit(f"--merge: no such file {path}")
    loaded = json.loads(path.read_text())
    if meta is None:
      meta = {key: loaded["meta"].get(key) for key in MERGE_KEYS}
    for key in MERGE_KEYS:
      if loaded["meta"].get(key) != meta[key]:
        raise SystemExit(f"--merge: {path} has {key}={loaded['meta'].get(key)!r}, "
                         f"{paths[0]} has {meta[key]!r}; runs with different settings "
                         f"are not one comparison")
    for run in loaded["results"]:
      key = (run["method"], run["density"], run.get("seed", 0))
      if run["summary"].get("stopped_early"):
        raise SystemExit(f"--merge: {path} holds {key[0]} density {key[1]} seed {key[2]} "
                         f"stopped before its last step; resume it and write its file again")
      if key in seen:
        raise SystemExit(f"--merge: {key[0]} density {key[1]} seed {key[2]} is in both "
                         f"{seen[key]} and {path}")
      seen[key] = path
      results.append(dict(run, seed=key[2]))
  results.sort(key=lambda run: run["seed"])  # stable: each seed keeps its run order
  meta["seeds"] = sorted({run["seed"] for run in results})
  meta["merged"] = [str(path) for path in paths]
  return meta, results


def main(argv=None) -> int:
  args = parse_args(argv)
  out, runs = Path(args.out_dir), Path(args.runs_dir)
  command = "python experiments/accuracy.py " + " ".join(sys.argv[1:] if argv is None else argv)
  if args.merge:
    meta, results = merge_results(args.merge)
    write_report(results, dict(meta, command=command), out, args.versus)
    return 0
  out.mkdir(parents=True, exist_ok=True)
  methods = args.methods.split(",")
  densities = [float(d) for d in args.densities.split(",")]
  if args.simulate and any(exchange_of(m)[1] for m in methods):
    raise SystemExit("--simulate runs every worker on one device: a two-level (@2l) method "
                     "needs devices as nodes; drop --simulate or the @2l methods")
  plan = []
  for seed, (method, density) in ((seed, configuration) for seed in args.seeds
                                  for configuration in configurations(
                                      methods, densities, base=lambda n: exchange_of(n)[0])):
    name = method if free(method) else f"{method}_{density:g}"
    workdir = run_dir(runs, args.model, name, seed)
    plan.append((seed, method, density, name, workdir,
                 train_command(args, method, density, seed, workdir)))
  if not args.rerun:
    refuse_to_overwrite(plan)
  results = []
  for seed, method, density, name, workdir, command in plan:
    label = name if len(args.seeds) == 1 else f"{name} seed {seed}"
    settings_file = workdir / "accuracy_command.json"
    ours = recorded_command(workdir) == command[1:]
    done = ours and finished(workdir)
    if args.rerun or not done:
      if not args.rerun and ours and (workdir / "checkpoints").is_dir():
        # An interrupted run of this command (killed, or stopped by a signal with
        # a checkpoint and a summary of its steps so far): continue it.
        run_command = command + ["--resume"]
        print(f"== {label}: resuming {workdir}", flush=True)
      else:
        run_command = command
        if workdir.exists():
          subprocess.run(["rm", "-rf", str(workdir)], check=True)
        workdir.mkdir(parents=True)
        settings_file.write_text(json.dumps(command[1:]))
        print(f"== {label}: {' '.join(command[1:])}", flush=True)
      record_code(workdir)
      started = time.time()
      status = subprocess.run(run_command, cwd=ROOT).returncode
      if status != 0:
        raise SystemExit(f"training {label} failed with status {status}")
      if not finished(workdir):
        # A stop signal (or --stop-after) ends training with status 0 and a
        # checkpoint; its epochs so far are no result.
        raise SystemExit(f"training {label} stopped before its last step; its checkpoint "
                         f"is kept in {workdir}: run the same command to resume it")
      print(f"== {label}: {time.time() - started:.0f} s", flush=True)
    else:
      print(f"== {label}: reusing {workdir}", flush=True)
    epochs, summary = read_run(workdir, args.model, None if free(method) else density,
                               args.node_size if exchange_of(method)[1] else 1)
    results.append({"method": method, "density": None if free(method) else density,
                    "seed": seed, "epochs": epochs, "summary": summary,
                    "code": recorded_code(workdir),
                    "command": "python -m dlgs_jax.cli.train " + " ".join(command[3:])})
  meta = {"command": command,
          "model": args.model, "workers": args.workers, "simulated": args.simulate,
          "epochs": args.epochs,
          "batch_size": args.batch_size, "lr": args.lr, "seeds": args.seeds,
          "plan_dir": args.plan_dir,
          "node_size": args.node_size if any(exchange_of(m)[1] for m in methods) else None,
          "data": args.data_dir or "embedded CIFAR-10 subset (3,805 train / 761 test)"}
  write_report(results, meta, out, args.versus)
  return 0


def refuse_to_overwrite(plan) -> None:
  """Stops, before any training, where a finished run was made by another command.

  Retraining would delete it; a changed flag or a --runs-dir spelled another
  way (absolute against relative) is enough to differ.

  Args:
    plan: (seed, method, density, name, workdir, command) of every run.

  Raises:
    SystemExit: naming the first such run directory.
  """
  for *_, workdir, command in plan:
    if not (workdir / "summary.json").exists():
      continue
    recorded = recorded_command(workdir)
    if recorded != command[1:]:
      raise SystemExit(f"{workdir} holds a finished run of another command "
                       f"({' '.join(recorded or ['unrecorded'])}); give --rerun to train it "
                       f"again, or another --runs-dir")


def finished(workdir: Path) -> bool:
  """Whether a run directory holds a run that reached its last step."""
  summary = workdir / "summary.json"
  return summary.exists() and not json.loads(summary.read_text()).get("stopped_early")


def code_version() -> str:
  """The commit the package's code is at, "+changes" where dlgs_jax/ differs from it."""
  def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

  head = git("rev-parse", "--short", "HEAD") or "unknown"
  return head + ("+changes" if git("status", "--porcelain", "--", "dlgs_jax") else "")


def record_code(workdir: Path) -> None:
  """Adds the code a run trains with to its directory's list (a resumed run may add another)."""
  versions, now = recorded_code(workdir) or [], code_version()
  if now not in versions:
    (workdir / "code.json").write_text(json.dumps(versions + [now]))


def recorded_code(workdir: Path):
  """The code versions a run directory trained with (`code_version`, in order), or None."""
  path = workdir / "code.json"
  return json.loads(path.read_text()) if path.exists() else None


def recorded_command(workdir: Path):
  """The training command a run directory records (argv after the interpreter), or None."""
  settings_file = workdir / "accuracy_command.json"
  return json.loads(settings_file.read_text()) if settings_file.exists() else None


if __name__ == "__main__":
  sys.exit(main())
