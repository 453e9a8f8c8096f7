"""Iteration time of every method on a real bandwidth-limited cluster of processes.

Builds an emulated cluster (`dlgs_jax.cluster`: one network namespace per
worker, tbf-shaped links, each worker pinned to its share of the cores), then
per model and density: measures a planner profile on that cluster (selection
costs depend on k; the update is timed for the methods of the run only, and a
kept profile without one of them is refused), plans dense fusion and DLGS
merging with the `optimal` planner, and for each method runs
`dlgs_jax.cli.benchmark` on all workers: median iteration time over --steps
repetitions after --warmup, its measured breakdown, bytes on the wire, speedup
over dense, and the timeline model's prediction next to the measurement.

    python experiments/bench_cluster.py                      # ResNet-20 + VGG16, P=4, 1 Gbit/s
    python experiments/bench_cluster.py --quick              # one model, fewer steps
    python experiments/bench_cluster.py --models resnet50 --image-size 32 --densities 0.01
    python experiments/bench_cluster.py --predict-only --densities 0.1,0.01   # new profiles only
    python experiments/bench_cluster.py --predict-only --keep-profiles --refit-profiles  # refit only

Writes results.json, results.md and breakdown_<model>.png under --out-dir. Runs
of other models or densities already in --out-dir's results.json are kept (a
configuration measured again replaces its old entry), so the suite can be run a
model at a time; every entry records the command that measured it. Dense and
TernGrad do not depend on the density and run once per invocation. Needs root.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dlgs_jax.cli.train import method_flags
from dlgs_jax.compress.methods import METHODS, base_method, configurations, density_free
from dlgs_jax.planning.pricing import (PREDICTABLE, method_costs, plan_file, profiled_methods,
                                       require_update_costs)

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="resnet20,vgg16")
  parser.add_argument("--methods",
                      default="dense,topk,lags,gtopk,dlgs,dlgs-paper,dlgs-head,dgc,terngrad",
                      help="benchmark methods, or a variant of dlgs-train's (dlgs-paper: the "
                      "paper's fixed threshold schedule; dlgs-head: the classifier head sent "
                      "whole; ...-whole1d: biases and BatchNorm parameters sent whole)")
  parser.add_argument("--densities", default="0.01")
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--bandwidth", default="1gbit")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--image-size", type=int)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--predict-only", action="store_true",
                      help="measure the profiles again and redo the predictions for the "
                      "configurations already measured in --out-dir (no timing runs)")
  parser.add_argument("--keep-profiles", action="store_true",
                      help="use the profiles already in --out-dir instead of measuring them")
  parser.add_argument("--refit-profiles", action="store_true",
                      help="with --keep-profiles: fit the update costs again from the raw "
                      "timings stored beside each profile (details.json) with the current "
                      "rule (profiling.fit_update), and save the profile")
  parser.add_argument("--quick", action="store_true",
                      help="ResNet-20 only, dense/topk/dlgs, 8 steps: a quick look")
  parser.add_argument("--out-dir", default=str(HERE / "results" / "cluster"))
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.refit_profiles and not args.keep_profiles:
    raise SystemExit("--refit-profiles refits kept profiles: give --keep-profiles too")
  if args.quick:
    args.models, args.methods, args.steps, args.warmup = "resnet20", "dense,topk,dlgs", 8, 2
  from dlgs_jax.cluster import netns
  from dlgs_jax.cluster import jobs
  from dlgs_jax.planning import planner
  from dlgs_jax import profiling
  from dlgs_jax.workload.models import leaf_shapes
  from dlgs_jax.planning.timeline import Profile, simulate

  job = jobs.start("bench_cluster.py", args.out_dir, argv=argv)
  out, started, command = job.out, job.started, job.command
  models = args.models.split(",")
  methods = args.methods.split(",")
  densities = [float(d) for d in args.densities.split(",")]
  common = ["--batch-size", str(args.batch_size)] + (
      ["--image-size", str(args.image_size)] if args.image_size else [])
  runs = set(configurations(methods, densities))
  results = []
  for model in models:
    with netns.EmulatedCluster(args.workers, args.bandwidth) as c:
      from dlgs_jax.cluster import launch

      def bench(extra):
        status = launch.launch(args.workers, ["--model", model, *common, *extra], grace=5,
                               module="dlgs_jax.cli.benchmark", coordinator=c.coordinator(),
                               wrap=c.wrap)
        if status != 0:
          raise SystemExit(f"benchmark failed with status {status}: {extra}")

      for density in densities:
        # Selection costs depend on k: each density gets its own profile.
        profile_path = out / f"profile_{model}_{density:g}.json"
        if args.keep_profiles and profile_path.exists():
          print(f"== {model}: using {profile_path}", flush=True)
        else:
          print(f"== {model}: profiling on the cluster at density {density:g}", flush=True)
          # Only the updates of the methods measured here: each one's timing
          # compiles the model's update programs (minutes for the per-leaf ones).
          timed = profiled_methods(methods)
          bench(["--profile-out", str(profile_path), "--density", str(density)]
                + (["--profile-methods", ",".join(timed)] if timed else []))
        profile = Profile.load(profile_path)
        try:
          require_update_costs([m for m in methods if (m, density) in runs], profile)
        except ValueError as error:
          raise SystemExit(f"{profile_path}: {error} (leave out --keep-profiles)") from None
        if args.refit_profiles:
          details_path = Path(f"{profile_path}.details.json")
          if not details_path.exists():
            raise SystemExit(f"--refit-profiles: no raw timings {details_path}")
          profile = profiling.refit_profile(profile, json.loads(details_path.read_text()))
          profile.save(profile_path)
        shapes = leaf_shapes(model, image_size=args.image_size)
        for method in methods:
          if (method, density) not in runs:
            continue
          result_path = out / f"run_{model}_{method}_{density:g}.json"
          plan_path = plan_file(out, model, method, density)
          plan_args, predicted = [], None
          base = base_method(method)
          if method in PREDICTABLE:
            costs = method_costs(method, density, profile, shapes)
            how = METHODS[base].grouping
            planned = how == "optimal"
            if planned and args.predict_only:
              # Predict the grouping that was measured, not a new plan.
              groups = planner.Plan.load(plan_path).group_indices(profile.paths)
            else:
              groups = planner.PLANNER_FUNCTIONS[how](profile, costs)
            predicted = simulate(profile, groups, costs).breakdown()
            if planned:
              if not args.predict_only:
                planner.make_plan(profile, base, costs.density, how,
                                  exact_fraction=costs.exact_fraction,
                                  whole_layers=costs.whole_layers).save(plan_path)
              plan_args = ["--plan", str(plan_path)]
          if args.predict_only:
            if not result_path.exists():
              raise SystemExit(f"--predict-only: no measurement {result_path}")
            result = json.loads(result_path.read_text())
            result.setdefault("command", command)
          else:
            print(f"== {model} {method} density {density:g}", flush=True)
            bench([*method_flags(method), "--density", str(density), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--out", str(result_path), *plan_args])
            result = json.loads(result_path.read_text())
            result.update(method=method, command=command, bandwidth=args.bandwidth,
                          steps=args.steps, warmup=args.warmup)
          result.update(predicted=predicted, profile=profile_path.name)
          # The run file keeps everything, so --predict-only can rebuild the entry.
          result_path.write_text(json.dumps(result, indent=1))
          results.append(result)
  results = merge(out / "results.json", results, args)
  for r in results:
    dense = next((x for x in results if x["model"] == r["model"] and x["method"] == "dense"),
                 None)
    r["speedup_vs_dense"] = (dense["median"]["step"] / r["median"]["step"]) if dense else None
  meta = {"workers": args.workers, "bandwidth": args.bandwidth,
          "last_command": command, "last_seconds": time.time() - started}
  (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
  table = markdown(results)
  (out / "results.md").write_text(table + "\n")
  print(table)
  for model in sorted({r["model"] for r in results}):
    plot(model, [r for r in results if r["model"] == model], out / f"breakdown_{model}.png", meta)
  return 0


def _key(result):
  density = None if density_free(result["method"]) else result["density"]
  return result["model"], result["method"], density


def merge(path: Path, new, args):
  """New results plus the old ones in `path` that they do not replace.

  Refuses to mix clusters: old results from another P or bandwidth would make
  the speedups meaningless.
  """
  if not path.exists():
    return new
  old = json.loads(path.read_text())
  meta = old.get("meta", {})
  if (meta.get("workers"), meta.get("bandwidth")) != (args.workers, args.bandwidth):
    raise SystemExit(f"{path} holds results for P={meta.get('workers')} at "
                     f"{meta.get('bandwidth')}, not P={args.workers} at {args.bandwidth}: "
                     "use another --out-dir")
  replaced = {_key(r) for r in new}
  kept = [r for r in old["results"] if _key(r) not in replaced]
  order = {m: i for i, m in enumerate(PREDICTABLE)}
  # dense first, then each density (largest first), TernGrad last.
  return sorted(kept + new, key=lambda r: (
      r["model"], {"dense": 0, "terngrad": 2}.get(r["method"], 1), -r["density"],
      order.get(r["method"], 99)))


def markdown(results) -> str:
  lines = ["| model | input | method | density | groups | steps | step ms | compute | sparsify "
           "| comm exposed | comm alone | MB sent/worker | exact thr. | speedup vs dense "
           "| predicted ms | pred. error |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    b, pred = r["breakdown"], r["predicted"]
    error = (f"{(pred['t_iter'] / r['median']['step'] - 1) * 100:+.0f}%" if pred else "")
    density = "-" if density_free(r["method"]) else f"{r['density']:g}"
    speedup = f"{r['speedup_vs_dense']:.2f}x" if r["speedup_vs_dense"] else ""
    shape = "x".join(str(n) for n in r["image_shape"][:2])
    # DLGS: share of leaf thresholds computed exactly per step (schedule + refresh rule).
    exact = (f"{100 * r['exact_leaves'] / r['leaves']:.0f}%"
             if r["method"].startswith("dlgs") and r.get("exact_leaves") is not None else "")
    lines.append(
        f"| {r['model']} | {shape}, b{r['batch_size']} | {r['method']} | {density} | "
        f"{r['plan_groups'] or ''} | {r['steps']} | "
        f"{r['median']['step'] * 1e3:.1f} | {b['compute'] * 1e3:.1f} | {b['sparsify'] * 1e3:.1f} | "
        f"{b['comm_exposed'] * 1e3:.1f} | {b['comm_alone'] * 1e3:.1f} | "
        f"{r['bytes_sent'] / 1e6:.2f} | {exact} | {speedup} | "
        + (f"{pred['t_iter'] * 1e3:.1f} | {error} |" if pred else " | |"))
  return "\n".join(lines)


def plot(model, results, path, meta):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from dlgs_jax.profiling import figures

  fig, ax = plt.subplots(figsize=(1.2 * len(results) + 2, 4))
  names = [r["method"] if density_free(r["method"]) else f"{r['method']}\n{r['density']:g}"
           for r in results]
  bottom = [0.0] * len(results)
  for key, color in (("compute", "tab:blue"), ("sparsify", "tab:orange"),
                     ("comm_exposed", "tab:red")):
    values = [r["breakdown"][key] * 1e3 for r in results]
    ax.bar(names, values, bottom=bottom, color=color, label=key.replace("_", " "))
    bottom = [b + v for b, v in zip(bottom, values)]
  for i, r in enumerate(results):
    if r["predicted"]:
      ax.plot([i - 0.4, i + 0.4], [r["predicted"]["t_iter"] * 1e3] * 2, color="black",
              linewidth=1.5, label="predicted" if i == 0 else None)
  ax.set_ylabel("ms per iteration")
  shape = "x".join(str(n) for n in results[0]["image_shape"][:2])
  figures.finish(fig, ax, path, f"{model} ({shape}): P={meta['workers']} at "
                 f"{meta['bandwidth']}, batch {results[0]['batch_size']} per worker "
                 f"(measured; black: timeline model)")


if __name__ == "__main__":
  sys.exit(main())
