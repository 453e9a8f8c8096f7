"""Plan DLGS layer merging for a model: ``python -m dlgs_jax.plan``.

Measures (or loads) a profile, runs every planner, prints each one's groups,
predicted iteration time, breakdown and speedup over dense all-reduce, writes
the chosen plan and the profile as JSON and a Gantt chart of the timelines.

    python -m dlgs_jax.plan --model resnet20 --density 0.01
    python -m dlgs_jax.plan --model resnet20 --density 0.01 --bandwidth 1gbit --workers 16
    python -m dlgs_jax.plan --model vgg16 --profile runs/plan/vgg16_profile.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m dlgs_jax.plan", description=__doc__.splitlines()[0])
  parser.add_argument("--model", required=True, help="smallcnn, resnet20, vgg16 or resnet50")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--method", default="dlgs", help="method the plan is for (dlgs, lags, dense)")
  parser.add_argument("--planner", default="optimal", help="planner whose plan is written")
  parser.add_argument("--profile", help="load this profile JSON instead of measuring")
  parser.add_argument("--bandwidth", help="model the network instead: link bandwidth, e.g. 1gbit")
  parser.add_argument("--latency", type=float, default=25e-6, help="per-step latency (s) with --bandwidth")
  parser.add_argument("--workers", type=int, help="P for --bandwidth (default: the profile's)")
  parser.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices to measure collectives on (CPU only)")
  parser.add_argument("--batch-size", type=int, default=32, help="examples per worker")
  parser.add_argument("--image-size", type=int, help="input side (default: the model's)")
  parser.add_argument("--reuse-every", type=int, default=10)
  parser.add_argument("--refresh-below", default="0.5",
                      help="DLGS refresh rule, as in dlgs-train ('none': the paper's schedule); "
                      "with the rule on, DLGS is priced at the refresh rate the profile measured")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--in-step-rounds", type=int, default=None,
                      help="paired rounds timing each update inside the train step "
                           "(default: profiler.IN_STEP_ROUNDS; 0 keeps the standalone costs)")
  parser.add_argument("--out-dir", default="runs/plan")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if not args.profile:
    import jax
    # Only takes effect on the CPU backend; must precede the first device use.
    jax.config.update("jax_num_cpu_devices", args.devices)

  from dlgs_jax import planner, profiler, timeline
  from dlgs_jax.timeline import MethodCosts, Profile, simulate
  from dlgs_jax.train import parse_refresh_below

  if args.method not in timeline.METHODS:
    raise SystemExit(f"unknown --method {args.method!r}; choose from {timeline.METHODS}")
  if args.planner not in planner.PLANNERS:
    raise SystemExit(f"unknown --planner {args.planner!r}; choose from {planner.PLANNERS}")
  if args.in_step_rounds is not None and args.in_step_rounds < 0:
    raise SystemExit(f"--in-step-rounds must be >= 0, got {args.in_step_rounds}")
  try:
    refresh = parse_refresh_below(args.refresh_below)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  if args.profile:
    profile = Profile.load(args.profile)
    if profile.model != args.model:
      raise SystemExit(f"profile {args.profile} is for model {profile.model!r}, not {args.model!r}")
    print(f"profile {args.profile}: {profile.source}")
  else:
    print(f"measuring {args.model} on this machine ...", flush=True)
    profile, details = profiler.profile_model(
        args.model, density=args.density, batch_size=args.batch_size,
        image_size=args.image_size, reuse_every=args.reuse_every, repeats=args.repeats,
        in_step_rounds=(profiler.IN_STEP_ROUNDS if args.in_step_rounds is None
                        else args.in_step_rounds),
        methods=tuple(dict.fromkeys((args.method, "dense"))),
        refresh_below=refresh if args.method == "dlgs" else None,
        progress=lambda m: print("  " + m, flush=True))
    print(f"  backward: measured whole {details['backward_measured'] * 1e3:.2f} ms, sum of "
          f"layers timed alone {details['backward_sum_alone'] * 1e3:.2f} ms "
          f"({details['backward_difference'] * 100:+.1f}%); layer times scaled to the whole")
    path = out_dir / f"{args.model}_profile.json"
    profile.save(path)
    print(f"  wrote {path}")
  if args.bandwidth:
    workers = args.workers or profile.workers
    bits = profiler.parse_bandwidth(args.bandwidth)
    profile = profile.with_comm(
        profiler.network_comm(workers, bits, args.latency), workers,
        f"network modelled: {workers} workers, {args.bandwidth} links, {args.latency * 1e6:g} us latency")
  elif args.workers and args.workers != profile.workers:
    raise SystemExit("--workers needs --bandwidth (measured costs hold for the measured P only)")

  fraction = planner.dlgs_exact_fraction(profile, args.method, refresh)
  if args.method == "dlgs" and refresh is not None:
    if fraction is None:
      print("note: the profile has no measured refresh rate; DLGS is priced at the fixed "
            "schedule's cost")
    else:
      print(f"DLGS refresh rule: {fraction:.0%} of thresholds computed exactly per step "
            "(measured)")
  costs = MethodCosts(args.method, args.density, exact_fraction=fraction)
  dense_costs = MethodCosts("dense", 1.0)
  dense_time = simulate(profile, planner.optimal(profile, dense_costs), dense_costs).t_iter
  print(f"\n{args.model}, {args.method} at density {args.density:g}, P = {profile.workers}; "
        f"{profile.source}")
  print(f"dense all-reduce (optimal fusion): {dense_time * 1e3:.2f} ms per iteration\n")
  header = f"{'planner':8s} {'groups':>6s} {'t_iter ms':>10s} {'compute':>9s} {'sparsify':>9s} {'comm exp.':>9s} {'speedup':>8s}"
  print(header)
  print("-" * len(header))
  timelines = {}
  for name in planner.PLANNERS:
    groups = planner.PLANNER_FUNCTIONS[name](profile, costs)
    tl = simulate(profile, groups, costs)
    timelines[name] = tl
    print(f"{name:8s} {len(groups):6d} {tl.t_iter * 1e3:10.2f} {tl.compute * 1e3:9.2f} "
          f"{tl.sparsify * 1e3:9.2f} {tl.comm_exposed * 1e3:9.2f} {dense_time / tl.t_iter:7.2f}x")
  print()
  for name, tl in timelines.items():
    sizes = [sum(profile.sizes[i] for i in g) for g in tl.groups]
    print(f"{name}: {len(tl.groups)} groups, layers per group {[len(g) for g in tl.groups]}, "
          f"elements per group {sizes}")
  plan = planner.make_plan(profile, args.method, args.density, args.planner,
                           exact_fraction=fraction)
  plan_path = out_dir / f"{args.model}_{args.method}_{args.density:g}_{args.planner}_plan.json"
  plan.save(plan_path)
  png = out_dir / f"{args.model}_{args.method}_{args.density:g}_timeline.png"
  draw_gantt(profile, timelines, png, title=f"{args.model}, {args.method} density "
             f"{args.density:g}, P = {profile.workers}")
  print(f"\nwrote {plan_path}\nwrote {png}")
  return 0


def draw_gantt(profile, timelines, path, title=""):
  """One panel per planner: compute stream (forward, backward, sparsify) and comm stream."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.6 * len(timelines) + 0.8),
                           sharex=True, squeeze=False)
  colors = plt.get_cmap("tab20")
  for ax, (name, tl) in zip(axes[:, 0], timelines.items()):
    ax.broken_barh([(0, profile.t_forward * 1e3)], (10, 8), facecolors="0.6")
    for g, group in enumerate(tl.groups):
      color = colors(g % 20)
      bars = [(tl.backward_start[i] * 1e3, profile.t_backward[i] * 1e3) for i in group]
      ax.broken_barh(bars, (10, 8), facecolors=color, edgecolor="white", linewidth=0.3)
      ax.broken_barh([(tl.sparsify_start[g] * 1e3, tl.sparsify_time[g] * 1e3)], (10, 8),
                     facecolors="black")
      ax.broken_barh([(tl.comm_start[g] * 1e3, tl.comm_time[g] * 1e3)], (0, 8),
                     facecolors=color, edgecolor="black", linewidth=0.3)
    ax.set_yticks([4, 14], ["comm", "compute"])
    ax.set_title(f"{name}: {len(tl.groups)} groups, {tl.t_iter * 1e3:.2f} ms", fontsize=9,
                 loc="left")
  axes[-1, 0].set_xlabel("time (ms); grey: forward, colour: backward / message per group, "
                         "black: sparsification")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
