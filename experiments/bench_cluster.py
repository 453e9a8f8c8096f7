"""Iteration time of every method on a real bandwidth-limited cluster of processes.

Builds an emulated cluster (`dlgs_jax.cluster`: one network namespace per
worker, tbf-shaped links, each worker pinned to its share of the cores), then
per model: measures a planner profile on that cluster, plans dense fusion and
DLGS merging with the `optimal` planner, and for each method runs
`dlgs_jax.benchmark` on all workers: median iteration time over --steps
repetitions after --warmup, its measured breakdown, bytes on the wire, speedup
over dense, and the timeline model's prediction next to the measurement.

    python experiments/bench_cluster.py                      # ResNet-20 + VGG16, P=4, 1 Gbit/s
    python experiments/bench_cluster.py --quick              # one model, fewer steps
    python experiments/bench_cluster.py --models resnet50 --image-size 64 --batch-size 4

Writes results.json, results.md and breakdown_<model>.png under --out-dir. Needs root.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PREDICTABLE = ("dense", "topk", "lags", "gtopk", "dlgs")
GROUPING = {"dense": "optimal", "dlgs": "optimal", "lags": "wfbp", "topk": "single",
            "gtopk": "single"}


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="resnet20,vgg16")
  parser.add_argument("--methods", default="dense,topk,lags,gtopk,dlgs,dgc,terngrad")
  parser.add_argument("--densities", default="0.01")
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--bandwidth", default="1gbit")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--image-size", type=int)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--quick", action="store_true",
                      help="ResNet-20 only, dense/topk/dlgs, 8 steps: a quick look")
  parser.add_argument("--out-dir", default=str(HERE / "results" / "cluster"))
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.quick:
    args.models, args.methods, args.steps, args.warmup = "resnet20", "dense,topk,dlgs", 8, 2
  from dlgs_jax import cluster, planner
  from dlgs_jax.timeline import MethodCosts, Profile, simulate

  reason = cluster.unavailable_reason()
  if reason:
    print(f"cannot build the emulated cluster: {reason}", file=sys.stderr)
    return 2
  out = Path(args.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  models = args.models.split(",")
  methods = args.methods.split(",")
  densities = [float(d) for d in args.densities.split(",")]
  common = ["--batch-size", str(args.batch_size)] + (
      ["--image-size", str(args.image_size)] if args.image_size else [])
  results = []
  started = time.time()
  for model in models:
    with cluster.EmulatedCluster(args.workers, args.bandwidth) as c:
      from dlgs_jax import launch

      def bench(extra):
        status = launch.launch(args.workers, ["--model", model, *common, *extra], grace=5,
                               module="dlgs_jax.benchmark", coordinator=c.coordinator(),
                               wrap=c.wrap)
        if status != 0:
          raise SystemExit(f"benchmark failed with status {status}: {extra}")

      profile_path = out / f"profile_{model}.json"
      print(f"== {model}: profiling on the cluster", flush=True)
      bench(["--profile-out", str(profile_path), "--density", str(densities[0])])
      profile = Profile.load(profile_path)
      for density in densities:
        for method in methods:
          plan_args, predicted = [], None
          if method in PREDICTABLE:
            costs = MethodCosts(method, 1.0 if method == "dense" else density,
                                fixed_collectives=2)
            grouping = GROUPING[method]
            groups = planner.PLANNER_FUNCTIONS[grouping](profile, costs)
            predicted = simulate(profile, groups, costs).breakdown()
            if method in ("dense", "dlgs"):
              plan = planner.make_plan(profile, method, costs.density, grouping)
              plan_path = out / f"plan_{model}_{method}_{density:g}.json"
              plan.save(plan_path)
              plan_args = ["--plan", str(plan_path)]
          result_path = out / f"run_{model}_{method}_{density:g}.json"
          print(f"== {model} {method} density {density:g}", flush=True)
          bench(["--method", method, "--density", str(density), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--out", str(result_path), *plan_args])
          result = json.loads(result_path.read_text())
          result["predicted"] = predicted
          results.append(result)
  for r in results:
    dense = next((x for x in results if x["model"] == r["model"] and x["method"] == "dense"),
                 None)
    r["speedup_vs_dense"] = (dense["median"]["step"] / r["median"]["step"]) if dense else None
  meta = {"command": "python experiments/bench_cluster.py " + " ".join(sys.argv[1:]),
          "workers": args.workers, "bandwidth": args.bandwidth, "batch_size": args.batch_size,
          "seconds": time.time() - started}
  (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
  table = markdown(results)
  (out / "results.md").write_text(table + "\n")
  print(table)
  for model in models:
    plot(model, [r for r in results if r["model"] == model], out / f"breakdown_{model}.png", meta)
  return 0


def markdown(results) -> str:
  lines = ["| model | method | density | groups | step ms | compute | sparsify | comm exposed "
           "| comm alone | MB sent/worker | speedup vs dense | predicted ms | pred. error |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    b, pred = r["breakdown"], r["predicted"]
    error = (f"{(pred['t_iter'] / r['median']['step'] - 1) * 100:+.0f}%" if pred else "")
    lines.append(
        f"| {r['model']} | {r['method']} | {r['density']:g} | {r['plan_groups'] or ''} | "
        f"{r['median']['step'] * 1e3:.1f} | {b['compute'] * 1e3:.1f} | {b['sparsify'] * 1e3:.1f} | "
        f"{b['comm_exposed'] * 1e3:.1f} | {b['comm_alone'] * 1e3:.1f} | "
        f"{r['bytes_sent'] / 1e6:.2f} | "
        f"{r['speedup_vs_dense']:.2f}x | " + (f"{pred['t_iter'] * 1e3:.1f} | {error} |"
                                            if pred else " | |"))
  return "\n".join(lines)


def plot(model, results, path, meta):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(1.2 * len(results) + 2, 4))
  names = [f"{r['method']}\n{r['density']:g}" if r["method"] != "dense" else "dense"
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
  ax.set_title(f"{model}: P={meta['workers']} at {meta['bandwidth']}, batch {meta['batch_size']}"
               " per worker (measured; black: timeline model)", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
