"""Every experiment of the project, one after the other: reduced for a quick look, or full.

    python experiments/run_suite.py            # reduced: minutes, writes under runs/suite/
    python experiments/run_suite.py --full     # the README's commands, writes experiments/results/
    python experiments/run_suite.py --only accuracy,cluster

Each step is the experiment's own entry point run as a subprocess (its command
is printed first, so any step can be rerun alone). The cluster benchmark needs
root and iproute2; without them it is skipped with the reason. A failed step
does not stop the others; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def steps(full: bool, out: Path) -> list[tuple[str, list[str]]]:
  """(name, argv after the interpreter) of every step."""
  e = "experiments/"
  if full:
    return [
        ("sparsify", [e + "bench_sparsify.py"]),
        ("planner", [e + "bench_planner.py"]),
        ("scaling", [e + "predict_scaling.py"]),
        ("ring", ["-m", "dlgs_jax.sim.ring", "--out-dir", e + "results/ring"]),
        ("cluster", [e + "bench_cluster.py", "--models", "resnet20,vgg16",
                     "--densities", "0.1,0.01"]),
        ("cluster_resnet50", [e + "bench_cluster.py", "--models", "resnet50", "--image-size",
                              "32", "--densities", "0.1,0.01",
                              "--methods", "dense,dlgs,dlgs-paper,lags,topk,gtopk,dgc,terngrad",
                              "--out-dir", e + "results/cluster_resnet50"]),
        ("cluster_resnet20", [e + "bench_cluster.py", "--models", "resnet20", "--densities",
                              "0.01", "--out-dir", e + "results/cluster_resnet20"]),
        ("cluster_overlap", [e + "overlap_probe.py"]),
        ("cluster_latency", [e + "latency_probe.py"]),
        ("cluster_compare", [e + "compare_cluster.py", "--model", "resnet20", "--density", "0.01",
                             "--methods", "dense,topk,gtopk,dlgs,dlgs-paper", "--plan-dir",
                             e + "results/cluster_resnet20", "--rounds", "40", "--steps", "3"]),
        ("cluster_compare_vgg16", [e + "compare_cluster.py", "--model", "vgg16", "--density",
                                   "0.01", "--methods", "dense,topk,lags,gtopk,dlgs,dlgs-paper",
                                   "--plan-dir", e + "results/cluster", "--rounds", "8",
                                   "--steps", "2", "--warmup", "2"]),
        ("cluster_compare_resnet50", [e + "compare_cluster.py", "--model", "resnet50",
                                      "--image-size", "32", "--density", "0.01", "--methods",
                                      "dense,topk,dlgs,dlgs-paper", "--plan-dir",
                                      e + "results/cluster_resnet50", "--rounds", "8",
                                      "--steps", "2", "--warmup", "2"]),
        ("cluster_compare_resnet50_gtopk", [e + "compare_cluster.py", "--model", "resnet50",
                                            "--image-size", "32", "--density", "0.01",
                                            "--methods", "dense,gtopk,dlgs-paper", "--plan-dir",
                                            e + "results/cluster_resnet50", "--rounds", "8",
                                            "--steps", "2", "--warmup", "2", "--out-dir",
                                            e + "results/compare/resnet50_gtopk"]),
        ("cluster_compare_resnet50_lags_gtopk", [
            e + "compare_cluster.py", "--model", "resnet50", "--image-size", "32", "--density",
            "0.01", "--methods", "dense,lags,gtopk,dlgs-paper", "--plan-dir",
            e + "results/cluster_resnet50", "--rounds", "6", "--steps", "2", "--warmup", "2",
            "--out-dir", e + "results/compare/resnet50_lags_gtopk"]),
        # Profile (update timed inside the step too) and paired run together: predictions
        # next to measurements.
        ("cluster_predict_resnet50_0.1", [e + "compare_cluster.py", "--model", "resnet50",
                                          "--image-size", "32", "--density", "0.1", "--methods",
                                          "dense,dlgs-paper,dgc,terngrad", "--rounds", "6",
                                          "--steps", "2", "--warmup", "2", "--profile",
                                          e + "results/compare/profile_resnet50_0.1.json",
                                          "--measure-profile"]),
        ("cluster_predict_resnet50_0.01", [
            e + "compare_cluster.py", "--model", "resnet50", "--image-size", "32", "--density",
            "0.01", "--methods", "dense,topk,dlgs,dlgs-paper", "--plan-dir",
            e + "results/cluster_resnet50", "--rounds", "8", "--steps", "2", "--warmup", "2",
            "--profile", e + "results/compare/profiled_resnet50_0.01/profile_resnet50_0.01.json",
            "--measure-profile", "--out-dir", e + "results/compare/profiled_resnet50_0.01"]),
        # The 2x target's models on a 10x slower link, with a profile of that link.
        ("cluster_predict_vgg16_100mbit", [
            e + "compare_cluster.py", "--model", "vgg16", "--density", "0.01", "--bandwidth",
            "100mbit", "--methods", "dense,topk,lags,gtopk,dlgs,dlgs-paper", "--plan-dir",
            e + "results/cluster", "--rounds", "6", "--steps", "2", "--warmup", "2",
            "--profile", e + "results/compare/vgg16_100mbit/profile_vgg16_0.01_100mbit.json",
            "--measure-profile", "--out-dir", e + "results/compare/vgg16_100mbit"]),
        ("cluster_predict_resnet20_100mbit", [
            e + "compare_cluster.py", "--model", "resnet20", "--density", "0.01", "--bandwidth",
            "100mbit", "--methods", "dense,topk,lags,gtopk,dlgs,dlgs-paper", "--plan-dir",
            e + "results/cluster_resnet20", "--rounds", "20", "--steps", "3", "--warmup", "2",
            "--profile",
            e + "results/compare/resnet20_100mbit/profile_resnet20_0.01_100mbit.json",
            "--measure-profile", "--out-dir", e + "results/compare/resnet20_100mbit"]),
        ("cluster_compare_resnet20_100mbit_topk", [
            e + "compare_cluster.py", "--model", "resnet20", "--density", "0.01", "--bandwidth",
            "100mbit", "--methods", "dense,topk,dlgs-paper", "--plan-dir",
            e + "results/cluster_resnet20", "--rounds", "60", "--steps", "3", "--warmup", "2",
            "--out-dir", e + "results/compare/resnet20_100mbit/topk_pair"]),
        ("cluster_predict_resnet20_perleaf", [
            e + "compare_cluster.py", "--model", "resnet20", "--density", "0.01", "--methods",
            "dense,lags,dgc,terngrad", "--rounds", "6", "--steps", "3", "--warmup", "1",
            "--profile", e + "results/compare/resnet20_perleaf/profile_resnet20_0.01.json",
            "--measure-profile", "--out-dir", e + "results/compare/resnet20_perleaf"]),
        ("cluster_update_program_resnet50", [
            e + "bench_cluster.py", "--models", "resnet50", "--image-size", "32", "--densities",
            "0.1", "--methods", "terngrad,dgc", "--steps", "5", "--warmup", "1",
            "--keep-profiles", "--out-dir", e + "results/compare/resnet50_update_program"]),
        ("accuracy", [e + "accuracy.py"]),
        ("accuracy_60ep", [e + "accuracy.py", "--methods", "dense,topk,lags,gtopk,dlgs,dlgs-head",
                           "--densities", "0.1", "--epochs", "60", "--out-dir",
                           e + "results/accuracy_60ep", "--runs-dir", "runs/accuracy_60ep"]),
        ("accuracy_60ep_seeds", [e + "accuracy.py", "--methods", "dense,topk,dlgs-head",
                                 "--densities", "0.1", "--epochs", "60", "--seeds", "0,1,2",
                                 "--out-dir", e + "results/accuracy_60ep_seeds",
                                 "--runs-dir", "runs/accuracy_60ep"]),
        ("accuracy_120ep", [e + "accuracy.py", "--methods", "dense,dlgs-head", "--densities",
                            "0.1", "--epochs", "120", "--seeds", "1",
                            "--out-dir", e + "results/accuracy_120ep",
                            "--runs-dir", "runs/accuracy_120ep"]),
    ]
  return [
      ("sparsify", [e + "bench_sparsify.py", "--models", "resnet20", "--repeats", "3",
                    "--out", str(out / "bench_sparsify.json")]),
      ("planner", [e + "bench_planner.py", "--layers", "59", "161", "--profiles", "2",
                   "--out", str(out / "bench_planner.json")]),
      ("scaling", [e + "predict_scaling.py", "--workers", "2,4,8", "--out-dir",
                   str(out / "scaling")]),
      ("ring", ["-m", "dlgs_jax.sim.ring", "--points", "41", "--out-dir", str(out / "ring")]),
      ("cluster", [e + "bench_cluster.py", "--quick", "--out-dir", str(out / "cluster")]),
      ("cluster_overlap", [e + "overlap_probe.py", "--rounds", "1", "--steps", "5",
                           "--out-dir", str(out / "overlap")]),
      ("cluster_latency", [e + "latency_probe.py", "--chains", "8,32", "--passes", "1",
                           "--repeats", "3", "--out-dir", str(out / "latency")]),
      ("cluster_compare", [e + "compare_cluster.py", "--model", "resnet20", "--methods",
                           "dense,dlgs-paper", "--rounds", "4", "--steps", "2", "--warmup", "1",
                           "--out-dir", str(out / "compare")]),
      ("accuracy", [e + "accuracy.py", "--quick", "--out-dir", str(out / "accuracy"),
                    "--runs-dir", str(out / "accuracy_runs")]),
  ]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--full", action="store_true",
                      help="full size (hours on a 2-core machine); default: reduced")
  parser.add_argument("--only", help="comma-separated step names to run")
  parser.add_argument("--out-dir", default=str(ROOT / "runs" / "suite"),
                      help="where the reduced suite writes (the full one writes the results "
                      "the README shows)")
  args = parser.parse_args(argv)
  out = Path(args.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  plan = steps(args.full, out)
  names = [name for name, _ in plan]
  if args.only:
    wanted = args.only.split(",")
    unknown = [w for w in wanted if w not in names]
    if unknown:
      parser.error(f"--only: unknown steps {unknown}; the steps are {names}")
    plan = [(name, argv) for name, argv in plan if name in wanted]

  from dlgs_jax import cluster
  outcomes = []
  for name, step_argv in plan:
    if name.startswith("cluster"):
      reason = cluster.unavailable_reason()
      if reason:
        print(f"== {name}: skipped: {reason}", flush=True)
        outcomes.append((name, "skipped", 0.0))
        continue
    print(f"== {name}: python {' '.join(step_argv)}", flush=True)
    started = time.time()
    status = subprocess.run([sys.executable, *step_argv], cwd=ROOT).returncode
    outcomes.append((name, "ok" if status == 0 else f"failed ({status})",
                     time.time() - started))
  print("\n| step | outcome | seconds |\n|---|---|---|")
  for name, outcome, seconds in outcomes:
    print(f"| {name} | {outcome} | {seconds:.0f} |")
  return 1 if any(o.startswith("failed") for _, o, _ in outcomes) else 0


if __name__ == "__main__":
  sys.exit(main())
