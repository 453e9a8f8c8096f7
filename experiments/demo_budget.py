"""The demo's preset under a budget per layer and per message, against dense and Top-k.

Each run is ``python -m dlgs_jax.cli.demo FLAGS --seed S --workdir
runs/demo_budget/NAME_sS`` (SmallCNN, the embedded subset, 4 simulated
workers, density 0.01, 10 epochs); a run whose workdir already holds a
finished summary is read, not trained again. The flags name every setting
that differs between the runs, so they mean the same whatever the preset.

    python experiments/demo_budget.py [--seeds 0 1] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# (name, flags): a budget per layer (the paper's), per message (one message for
# SmallCNN: the planner's "single", which the transform's buckets equal here).
RUNS = (
    ("dense", "--method dense"),
    ("topk", "--method topk"),
    ("dlgs-layer", "--budget layer"),
    ("dlgs-message", "--budget message --planner single"),
    ("dlgs-paper-message", "--budget message --planner single --refresh-below none"),
    ("dlgs-message-0.025", "--budget message --planner single --density 0.025"),
)
RUNS_DIR = Path("runs/demo_budget")


def run_one(name: str, flags: str, seed: int) -> dict:
  """Trains (unless finished already) and reads one run's summary."""
  workdir = RUNS_DIR / f"{name}_s{seed}"
  command = [sys.executable, "-m", "dlgs_jax.cli.demo", *flags.split(), "--seed", str(seed),
             "--workdir", str(workdir)]
  summary_file = workdir / "summary.json"
  if not summary_file.exists():
    print(f"== {name} seed {seed}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True)
  summary = json.loads(summary_file.read_text())
  return {"name": name, "flags": flags, "seed": seed,
          "command": f"python -m dlgs_jax.cli.demo {flags} --seed {seed}",
          "final_test_accuracy": summary["final_test_accuracy"],
          "bytes_sent_per_step": summary["bytes_sent_per_step"],
          "plan_groups": summary.get("plan_groups"),
          "train_seconds": round(summary["seconds"], 1)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
  parser.add_argument("--only", nargs="*", help="run names to run (default: all)")
  parser.add_argument("--out", type=Path,
                      default=Path("experiments/results/demo_presets/budget.json"))
  args = parser.parse_args(argv)
  runs = [run_one(name, flags, seed) for seed in args.seeds for name, flags in RUNS
          if not args.only or name in args.only]
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps({
      "what": "the demo's preset (SmallCNN, embedded subset, 4 simulated workers, batch 32, "
              "lr 0.05, density 0.01, 10 epochs) under each budget, dense and Top-k",
      "command": "python experiments/demo_budget.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv),
      "commit": commit, "written": time.strftime("%Y-%m-%d"),
      "machine": {"platform": platform.platform(), "cpus": len(os.sched_getaffinity(0)),
                  "note": "the project's 2-core VM, with full CIFAR-10 runs beside it: "
                          "train_seconds are upper bounds"},
      "runs": runs}, indent=1) + "\n")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
