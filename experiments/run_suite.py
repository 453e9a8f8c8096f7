"""Every experiment of the project, one after the other: reduced for a quick look, or full.

    python experiments/run_suite.py            # reduced: minutes, writes under runs/suite/
    python experiments/run_suite.py --full     # the README's commands, writes experiments/results/
    python experiments/run_suite.py --only accuracy,cluster

Each step is the experiment's own entry point run as a subprocess (its command
and the section of experiments/README.md it feeds are printed first, so any
step can be rerun alone). The cluster benchmark needs
root and iproute2; without them it is skipped with the reason. A failed step
does not stop the others; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Steps that build the emulated cluster (skipped where it cannot be built).
CLUSTER_STEPS = ("cluster", "compare", "predict", "update_program", "overlap")
# Environment a step adds to this process's: XLA's CPU scheduler told to interleave;
# four simulated devices in one process.
# XLA:GPU without CUDA graphs: each kernel launched on its own, nothing to rebuild per call.
NO_GRAPHS = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
STEP_ENV = {"overlap_interleaved": {
    "XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=false"},
    "in_process_resnet20": {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    "gpu_profile_no_graphs": NO_GRAPHS, "gpu_check_no_graphs": NO_GRAPHS}
ROOT = HERE.parent
# The official binary CIFAR-10, beside the repository.
FULL_CIFAR10 = "../shared/data/cifar-10-batches-bin"
# The report's section each step feeds, by the start of the step's name; the first
# that matches counts.
SECTIONS = (
    ("accuracy_nodes", 6), ("accuracy", 2), ("budget_share", 2),
    ("compare", 1), ("in_process", 1), ("cluster_compare", 1),
    ("predict", 3), ("update_program", 3), ("cluster_overlap", 7), ("cluster_latency", 7),
    ("cluster", 3),
    ("sparsify", 4), ("gpu", 4),
    ("planner", 5),
    ("nodes", 6), ("scaling", 6), ("hsdp", 6),
    ("overlap", 7),
    ("ring", 8),
)


def section_of(name: str) -> int:
  """The number of the section of experiments/README.md that step `name` feeds."""
  for prefix, section in SECTIONS:
    if name.startswith(prefix):
      return section
  raise KeyError(f"step {name!r} feeds no section of the report; add it to SECTIONS")


def compare(model: str, density: float, methods: str, rounds: int, steps: int, *extra: str,
            warmup=2, plans: str = "", bandwidth: str = "") -> list[str]:
  """A paired run: `compare_cluster.py` with the settings every report command shares."""
  e = "experiments/"
  image = ["--image-size", "32"] if model == "resnet50" else []
  link = ["--bandwidth", bandwidth] if bandwidth else []
  plan_dir = ["--plan-dir", e + "results/" + plans] if plans else []
  warm = ["--warmup", str(warmup)] if warmup is not None else []
  return [e + "compare_cluster.py", "--model", model, *image, "--density", f"{density:g}", *link,
          "--methods", methods, *plan_dir, "--rounds", str(rounds), "--steps", str(steps),
          *warm, *extra]


def full_steps() -> list[tuple[str, list[str]]]:
  """The commands behind experiments/README.md, in its order."""
  e, r = "experiments/", "experiments/results/"
  profiled = lambda d, name: ["--profile", f"{r}compare/{d}/{name}", "--measure-profile",  # noqa: E731
                              "--out-dir", f"{r}compare/{d}"]
  accuracy_120 = [(f"accuracy_120ep_seed{seed}", [
      e + "accuracy.py", "--methods", "dense,dlgs-head", "--densities", "0.1", "--epochs", "120",
      "--seeds", str(seed), "--out-dir", f"runs/accuracy_120ep_seed{seed}",
      "--runs-dir", "runs/accuracy_120ep"]) for seed in range(4)]
  # Full CIFAR-10, ResNet-20, the paper's density: one run per step, so each lands on its own.
  # First the five methods on two seeds (DLGS a threshold per layer, the paper's budget,
  # its default when they ran); then a third seed, the head sent whole (both densities),
  # 0.01, the owners' exchange against the all-gather's DLGS (seed 0), the budget per
  # message, the default since, and that budget re-aimed at all of k (`dlgs-spend`).
  full_runs = ([(m, 0.1, s) for s in (0, 1)
                for m in ("dense", "dlgs-paper", "dlgs-layer", "topk", "lags")]
               + [(m, 0.1, 2) for m in ("dense", "dlgs-paper", "dlgs-layer")]
               + [("dlgs-paper-head", d, s) for d in (0.1, 0.01) for s in (0, 1)]
               + [(m, 0.01, s) for s in (0, 1) for m in ("dlgs-paper", "dlgs-layer", "topk")]
               + [("dlgs-owners", 0.1, 0)]
               + [("dlgs-message", d, s) for d in (0.01, 0.1) for s in (0, 1)]
               + [("dlgs-spend", d, s) for d in (0.01, 0.1) for s in (0, 1)])
  # The message budget on the planned messages of the cluster benchmark (one for
  # ResNet-20 at both densities), copied into plans/ under each variant's name.
  planned = {m: ["--plan-dir", f"{r}accuracy_full/plans"] for m in ("dlgs-message", "dlgs-spend")}
  # A run's name is its step's (after "accuracy_full_") and its results folder's.
  named = [(f"{m}{'' if d == 0.1 else f'_{d:g}'}_seed{s}", m, d, s) for m, d, s in full_runs]
  accuracy_full = [(f"accuracy_full_{name}", [
      e + "accuracy.py", "--methods", m, "--densities", f"{d:g}", "--epochs", "30",
      "--seeds", str(s), "--data-dir", FULL_CIFAR10, "--out-dir", f"{r}accuracy_full/{name}",
      "--runs-dir", "runs/accuracy_full", *planned.get(m, [])]) for name, m, d, s in named]
  # The table of the runs that have landed: means, gaps to dense paired by seed, curves,
  # the two threshold rules paired (the default rule is decided on it), and, once it has
  # landed, the head sent whole against the paper's rule (the head's default).
  landed = sorted(str(p.relative_to(ROOT)) for p in (ROOT / r / "accuracy_full").glob(
      "*_seed*/results.json"))
  versus = "dlgs-paper:dlgs-layer" + (",dlgs-paper-head:dlgs-paper" if any(
      "/dlgs-paper-head_seed" in p for p in landed) else "") + (
      ",dlgs-message:dlgs-layer,dlgs-message:topk" if any("/dlgs-message_" in p for p in landed)
      else "") + (",dlgs-spend:dlgs-message,dlgs-spend:topk" if any(
          "/dlgs-spend_" in p for p in landed) else "")
  return [
      *accuracy_full,
      ("accuracy_full_table", [e + "accuracy.py", "--merge", ",".join(landed), "--out-dir",
                               r + "accuracy_full/table", "--versus", versus]),
      ("compare_resnet50", compare("resnet50", 0.01, "dense,topk,dlgs,dlgs-paper", 8, 2,
                                   plans="cluster_resnet50")),
      ("compare_resnet50_lags_gtopk", compare(
          "resnet50", 0.01, "dense,lags,gtopk,dlgs-paper", 6, 2, "--out-dir",
          r + "compare/resnet50_lags_gtopk", plans="cluster_resnet50")),
      ("compare_vgg16", compare("vgg16", 0.01, "dense,topk,lags,gtopk,dlgs,dlgs-paper", 8, 2,
                                plans="cluster")),
      ("compare_resnet20", compare("resnet20", 0.01, "dense,topk,gtopk,dlgs,dlgs-paper", 40, 3,
                                   warmup=None, plans="cluster_resnet20")),
      ("compare_vgg16_100mbit", compare(
          "vgg16", 0.01, "dense,topk,lags,gtopk,dlgs,dlgs-paper", 6, 2,
          *profiled("vgg16_100mbit", "profile_vgg16_0.01_100mbit.json"), plans="cluster",
          bandwidth="100mbit")),
      ("compare_resnet20_100mbit", compare(
          "resnet20", 0.01, "dense,topk,lags,gtopk,dlgs,dlgs-paper", 20, 3,
          *profiled("resnet20_100mbit", "profile_resnet20_0.01_100mbit.json"),
          plans="cluster_resnet20", bandwidth="100mbit")),
      ("compare_resnet20_100mbit_topk", compare(
          "resnet20", 0.01, "dense,topk,dlgs-paper", 60, 3, "--out-dir",
          r + "compare/resnet20_100mbit/topk_pair", plans="cluster_resnet20", bandwidth="100mbit")),
      # The same pair on flat buffers, both DLGS rules, long enough for a 2-3% difference.
      ("compare_resnet20_100mbit_topk_flat", compare(
          "resnet20", 0.01, "dense,topk,dlgs,dlgs-paper", 100, 3, "--out-dir",
          r + "compare/resnet20_100mbit/topk_pair_flat", plans="cluster_resnet20",
          bandwidth="100mbit")),
      *[(f"compare_batched_{model}_{link or '1gbit'}", compare(
          model, 0.01, "dense,topk,lags,gtopk,dlgs,dlgs-layer,dlgs-paper", rounds, steps,
          "--out-dir",
          f"{r}compare/batched/{model}_{link or '1gbit'}", plans=plans, bandwidth=link))
        for model, plans, rounds, steps in [("resnet20", "cluster_resnet20", 20, 3),
                                            ("vgg16", "cluster", 6, 2)]
        for link in ["", "100mbit"]],
      # The budget per message against the budget per layer and Top-k, every method
      # one message (the plans' grouping; the message variants have none and send one).
      *[(f"compare_message_{model}_100mbit", compare(
          model, 0.01, "dense,topk,dlgs-layer,dlgs-message,dlgs-paper,dlgs-paper-message", rounds,
          steps, "--out-dir", f"{r}compare/message/{model}_100mbit", plans=plans,
          bandwidth="100mbit"))
        for model, plans, rounds, steps in [("resnet20", "cluster_resnet20", 20, 3),
                                            ("vgg16", "cluster", 6, 2)]],
      # Four ResNet-50 processes fit the VM's 24 GiB with four methods each, two
      # of them compiling at a time (six methods ran out of memory).
      *[(f"compare_batched_resnet50_{link or '1gbit'}{suffix}", compare(
          "resnet50", 0.01, methods, 4, 2, "--compile-slots", "2", "--out-dir",
          f"{r}compare/batched/resnet50_{link or '1gbit'}{suffix}", warmup=1,
          plans="cluster_resnet50", bandwidth=link))
        for link in ["", "100mbit"]
        for suffix, methods in [("", "dense,topk,dlgs,dlgs-paper"),
                                ("_lags_gtopk", "dense,lags,gtopk,dlgs")]],
      *[(f"nodes_measured_{model}_{link}", compare(
          model, 0.01, "dense,dense@2l,dlgs,dlgs@2l,gtopk", 4, 2 if model == "resnet50" else 3,
          "--workers", "2", "--local-devices", "2", "--out-dir",
          f"{r}nodes/measured_{link}", bandwidth=link))
        for model, links in [("resnet20", ["1gbit", "100mbit"]), ("vgg16", ["1gbit", "100mbit"]),
                             ("resnet50", ["1gbit", "100mbit"])]
        for link in links],
      ("in_process_resnet20", [
          "-m", "dlgs_jax.cli.benchmark", "--model", "resnet20", "--compare", "dlgs,dlgs-paper",
          "--density", "0.01", "--rounds", "20", "--steps", "3", "--warmup", "2", "--out",
          r + "compare/batched/resnet20_in_process/compare_resnet20_0.01.json"]),
      ("compare_resnet50_0.1", compare("resnet50", 0.1, "dense,lags,dlgs,dlgs-paper", 6, 2,
                                       "--out-dir", r + "compare/leafwise_resnet50_0.1",
                                       plans="cluster_resnet50")),
      *accuracy_120,
      ("accuracy_120ep_seeds", [e + "accuracy.py", "--merge", ",".join(
          f"runs/accuracy_120ep_seed{seed}/results.json" for seed in range(4)),
          "--out-dir", r + "accuracy_120ep_seeds"]),
      ("accuracy_60ep_seeds", [e + "accuracy.py", "--methods", "dense,topk,dlgs-head",
                               "--densities", "0.1", "--epochs", "60", "--seeds", "0,1,2",
                               "--out-dir", r + "accuracy_60ep_seeds",
                               "--runs-dir", "runs/accuracy_60ep"]),
      *[(f"accuracy_thresholds_seed{seed}", [
          e + "accuracy.py", "--methods", "dlgs-adapt,dlgs-refresh,dlgs-paper", "--densities",
          "0.1,0.01", "--seeds", str(seed), "--out-dir",
          f"runs/acc_select_seed{seed}", "--runs-dir", "runs/acc_select"]) for seed in range(3)],
      ("accuracy_planned", [e + "accuracy.py", "--methods", "dlgs-layer", "--densities", "0.1,0.01",
                            "--seeds", "0,1,2", "--plan-dir", r + "cluster", "--runs-dir",
                            "runs/acc_planned", "--out-dir", r + "accuracy_planned"]),
      ("accuracy_nodes", [e + "accuracy.py", "--methods", "dense,dlgs-layer,dlgs-layer@2l", "--densities",
                          "0.1", "--seeds", "0,1,2", "--node-size", "2", "--runs-dir",
                          "runs/acc_nodes", "--out-dir", r + "accuracy_nodes"]),
      ("accuracy_thresholds", [e + "accuracy.py", "--merge", ",".join(
          f"runs/acc_select_seed{seed}/results.json" for seed in range(3)),
          "--out-dir", r + "accuracy_thresholds"]),
      ("budget_share", [e + "budget_share.py"]),
      ("accuracy", [e + "accuracy.py", "--methods",
                    "dense,topk,lags,gtopk,dlgs,dlgs-paper,dlgs-whole1d"]),
      ("accuracy_head", [e + "accuracy.py", "--methods", "dense,dlgs-head,lags-head",
                         "--out-dir", r + "accuracy_head"]),
      ("accuracy_60ep", [e + "accuracy.py", "--methods", "dense,topk,lags,gtopk,dlgs,dlgs-head",
                         "--densities", "0.1", "--epochs", "60", "--out-dir",
                         r + "accuracy_60ep", "--runs-dir", "runs/accuracy_60ep"]),
      ("predict_resnet50_0.01", compare(
          "resnet50", 0.01, "dense,topk,dlgs,dlgs-paper", 8, 2,
          *profiled("profiled_resnet50_0.01", "profile_resnet50_0.01.json"),
          plans="cluster_resnet50")),
      ("predict_resnet20_perleaf", compare(
          "resnet20", 0.01, "dense,lags,dgc,terngrad", 6, 3,
          *profiled("resnet20_perleaf", "profile_resnet20_0.01.json"), warmup=1)),
      ("predict_resnet50_0.1", compare(
          "resnet50", 0.1, "dense,dlgs-paper,dgc,terngrad", 6, 2, "--profile",
          r + "compare/profile_resnet50_0.1.json", "--measure-profile")),
      ("update_program_resnet50", [
          e + "bench_cluster.py", "--models", "resnet50", "--image-size", "32", "--densities",
          "0.1", "--methods", "terngrad,dgc", "--steps", "5", "--warmup", "1",
          "--keep-profiles", "--out-dir", r + "compare/resnet50_update_program"]),
      ("sparsify", [e + "bench_sparsify.py"]),
      ("gpu_check", [e + "gpu_check.py"]),  # on a GPU: the device check, ~8 minutes
      ("gpu_profile", [e + "gpu_profile.py", "--methods", "topk", "dlgs-paper", "dlgs",
                       "--out-dir", r + "gpu_profile"]),  # on a GPU, ~1 minute
      ("gpu_profile_no_graphs", [e + "gpu_profile.py", "--methods", "topk", "dlgs-paper",
                                 "dlgs", "--out-dir", r + "gpu_profile/no_graphs"]),
      ("gpu_check_no_graphs", [e + "gpu_check.py", "--densities", "0.01", "--one-group",
                               "--no-forward-backward", "--budget-s", "150", "--out",
                               r + "gpu_check/gpu_no_graphs.json"]),  # on a GPU, ~3 minutes
      ("gpu_check_cpu", [e + "gpu_check.py", "--models", "vgg16", "resnet50", "--densities",
                         "0.01", "--methods", "dense", "dlgs-paper", "dlgs", "--one-group",
                         "--rounds", "5", "--no-forward-backward", "--out",
                         r + "gpu_check/cpu_finite_any.json"]),
      ("planner", [e + "bench_planner.py", "--profiles", "3"]),
      ("scaling", [e + "predict_scaling.py"]),
      ("scaling_0.1", [e + "predict_scaling.py", "--density", "0.1"]),
      ("nodes", [e + "predict_scaling.py", "--nodes", "2,4,8,16"]),
      ("hsdp_memory", [e + "hsdp_memory.py", "--out", r + "hsdp/resnet20_memory.json"]),
      ("hsdp_manual", [e + "hsdp_manual.py", "--out", r + "hsdp/manual.json"]),
      ("overlap", [e + "overlap_probe.py"]),
      ("overlap_interleaved", [e + "overlap_probe.py", "--out-dir",
                               r + "overlap_variants/interleaved_schedule"]),
      ("overlap_unpinned", [e + "overlap_probe.py", "--unpinned", "--out-dir",
                            r + "overlap_variants/unpinned"]),
      ("ring", ["-m", "dlgs_jax.sim.ring", "--out-dir", r + "ring"]),
      ("ring_8", ["-m", "dlgs_jax.sim.ring", "--nodes", "8", "--out-dir", r + "ring/nodes8"]),
  ]


def steps(full: bool, out: Path) -> list[tuple[str, list[str]]]:
  """(name, argv after the interpreter) of every step."""
  e = "experiments/"
  if full:
    return full_steps()
  return [
      ("sparsify", [e + "bench_sparsify.py", "--models", "resnet20", "--repeats", "3",
                    "--out", str(out / "bench_sparsify.json")]),
      ("gpu_check", [e + "gpu_check.py", "--small", "--models", "smallcnn", "--densities",
                     "0.1", "--reuse-every", "2", "--rounds", "1", "--out",
                     str(out / "gpu_check.json")]),
      ("planner", [e + "bench_planner.py", "--layers", "59", "161", "--profiles", "2",
                   "--out", str(out / "bench_planner.json")]),
      ("scaling", [e + "predict_scaling.py", "--workers", "2,4,8", "--out-dir",
                   str(out / "scaling")]),
      ("nodes", [e + "predict_scaling.py", "--nodes", "2,4", "--out-dir", str(out / "nodes")]),
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

  from dlgs_jax.cluster import netns
  outcomes = []
  for name, step_argv in plan:
    if name.startswith(CLUSTER_STEPS):
      reason = netns.unavailable_reason()
      if reason:
        print(f"== {name}: skipped: {reason}", flush=True)
        outcomes.append((name, "skipped", 0.0))
        continue
    extra = STEP_ENV.get(name, {})
    prefix = "".join(f"{k}={v} " for k, v in extra.items())
    print(f"== {name} (report section {section_of(name)}): {prefix}python "
          f"{' '.join(step_argv)}", flush=True)
    started = time.time()
    status = subprocess.run([sys.executable, *step_argv], cwd=ROOT,
                            env={**os.environ, **extra}).returncode
    outcomes.append((name, "ok" if status == 0 else f"failed ({status})",
                     time.time() - started))
  print("\n| step | outcome | seconds |\n|---|---|---|")
  for name, outcome, seconds in outcomes:
    print(f"| {name} | {outcome} | {seconds:.0f} |")
  return 1 if any(o.startswith("failed") for _, o, _ in outcomes) else 0


if __name__ == "__main__":
  sys.exit(main())
