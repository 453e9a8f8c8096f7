"""``dlgs-plan`` (also ``python -m dlgs_jax.cli.plan``): plan DLGS layer merging for a model.

Measures (or loads) a profile, runs every planner, prints each one's groups,
predicted iteration time, breakdown and speedup over dense all-reduce, writes
the chosen plan and the profile as JSON and a Gantt chart of the timelines.

    python -m dlgs_jax.cli.plan --model resnet20 --density 0.01
    python -m dlgs_jax.cli.plan --model resnet20 --density 0.01 --bandwidth 1gbit --workers 16
    python -m dlgs_jax.cli.plan --model vgg16 --profile runs/plan/vgg16_profile.json
    python -m dlgs_jax.cli.plan --model vgg16 --profile p.json --bandwidth 25gbit \
        --workers 4 --node-size 8                 # 4 nodes of 8 GPUs, two-level exchange
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      prog="dlgs-plan", description=__doc__.splitlines()[0])
  parser.add_argument("--model", required=True, help="smallcnn, resnet20, vgg16 or resnet50")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--method", default="dlgs", help="method the plan is for (dlgs, lags, dense)")
  parser.add_argument("--planner", default="optimal", help="planner whose plan is written")
  parser.add_argument("--profile", help="load this profile JSON instead of measuring")
  parser.add_argument("--bandwidth", help="model the network instead: link bandwidth, e.g. 1gbit")
  parser.add_argument("--latency", type=float, default=25e-6, help="per-step latency (s) with --bandwidth")
  parser.add_argument("--workers", type=int, help="P for --bandwidth (default: the profile's); "
                      "with --node-size, the nodes")
  parser.add_argument("--node-size", type=int, help="plan a two-level exchange of nodes of this "
                      "many devices (dlgs-train --node-size): each device's slices between "
                      "nodes over --bandwidth links, which a node's devices share")
  parser.add_argument("--fast-bandwidth", default="2400gbit",
                      help="with --node-size: the link inside a node (default 300 GB/s)")
  parser.add_argument("--fast-latency", type=float, default=5e-6,
                      help="with --node-size: per-step latency (s) inside a node")
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
                           "(default: profiling.IN_STEP_ROUNDS; 0 keeps the standalone costs)")
  parser.add_argument("--out-dir", default="runs/plan")
  return parser.parse_args(argv)


def check(args) -> "float | None":
  """Exits naming the bad flag unless the flags make sense; returns the refresh rule."""
  from dlgs_jax.cli.train import flag_message, parse_refresh_below
  from dlgs_jax.compress.methods import ConfigError
  from dlgs_jax.planning import planner, timeline

  if args.method not in timeline.METHODS:
    raise SystemExit(f"unknown --method {args.method!r}; choose from {timeline.METHODS}")
  if args.planner not in planner.PLANNERS:
    raise SystemExit(f"unknown --planner {args.planner!r}; choose from {planner.PLANNERS}")
  if args.in_step_rounds is not None and args.in_step_rounds < 0:
    raise SystemExit(f"--in-step-rounds must be >= 0, got {args.in_step_rounds}")
  try:
    _check_numbers(args)
    return parse_refresh_below(args.refresh_below)
  except ConfigError as e:
    raise SystemExit(flag_message(e)) from None


def _check_numbers(args) -> None:
  """Raises `ConfigError` for the first flag out of its range."""

  from dlgs_jax.compress.methods import ConfigError, MethodConfig
  from dlgs_jax.planning.network import check_link

  MethodConfig(args.method, density=args.density, reuse_every=args.reuse_every).validate()
  for option, value, low in (("workers", args.workers, 1), ("devices", args.devices, 1),
                             ("node_size", args.node_size, 1),
                             ("batch_size", args.batch_size, 1), ("repeats", args.repeats, 1),
                             ("image_size", args.image_size, 8)):
    if value is not None and value < low:
      raise ConfigError(option, value, f"must be >= {low}")
  check_link(args.bandwidth, args.latency)
  check_link(args.fast_bandwidth, args.fast_latency, prefix="fast_")
  if (args.node_size or 1) > 1 and not args.bandwidth:
    raise ConfigError("node_size", args.node_size, "needs --bandwidth, the link between nodes "
                      "(the collectives a profile measured are flat)")
  if args.profile is not None and not Path(args.profile).is_file():
    raise ConfigError("profile", args.profile, "no such file")


def measured_profile(args, refresh, out_dir: Path):
  """The profile of ``--profile``, or one measured here (and written to `out_dir`)."""
  from dlgs_jax import profiling
  from dlgs_jax.planning.timeline import Profile

  if args.profile:
    try:
      profile = Profile.load(args.profile)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise SystemExit(f"--profile {args.profile!r} is not a profile: {e}") from None
    if profile.model != args.model:
      raise SystemExit(f"profile {args.profile} is for model {profile.model!r}, not {args.model!r}")
    print(f"profile {args.profile}: {profile.source}")
    return profile
  print(f"measuring {args.model} on this machine ...", flush=True)
  profile, details = profiling.profile_model(
      args.model, density=args.density, batch_size=args.batch_size,
      image_size=args.image_size, reuse_every=args.reuse_every, repeats=args.repeats,
      in_step_rounds=(profiling.IN_STEP_ROUNDS if args.in_step_rounds is None
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
  return profile


def on_network(args, profile):
  """`profile` re-priced for ``--bandwidth`` links (unchanged without it).

  With ``--node-size L`` the links join nodes, each shared by its L devices,
  and ``--workers`` counts nodes.
  """
  from dlgs_jax.planning import network

  if args.bandwidth:
    workers = args.workers or profile.workers
    local = args.node_size or 1
    bits = network.parse_bandwidth(args.bandwidth)
    between = f"{workers} nodes of {local} devices" if local > 1 else f"{workers} workers"
    return profile.with_comm(
        network.network_comm(workers, bits / local, args.latency), workers,
        f"network modelled: {between}, {args.bandwidth} links, "
        f"{args.latency * 1e6:g} us latency")
  if args.workers and args.workers != profile.workers:
    raise SystemExit("--workers needs --bandwidth (measured costs hold for the measured P only)")
  return profile


def exchange_costs(args) -> dict:
  """`MethodCosts`' two-level arguments for ``--node-size`` (none for a flat exchange)."""
  from dlgs_jax.planning import network

  local = args.node_size or 1
  if local == 1:
    return {}
  fast = network.network_comm(local, network.parse_bandwidth(args.fast_bandwidth),
                              args.fast_latency)["allreduce"]
  return {"fast_size": local, "fast_link": fast}


def exact_fraction(args, profile, refresh):
  """DLGS's measured share of exact thresholds (None: the fixed schedule's price)."""
  from dlgs_jax.planning import planner

  fraction = planner.dlgs_exact_fraction(profile, args.method, refresh)
  if args.method == "dlgs" and refresh is not None:
    if fraction is None:
      print("note: the profile has no measured refresh rate; DLGS is priced at the fixed "
            "schedule's cost")
    else:
      print(f"DLGS refresh rule: {fraction:.0%} of thresholds computed exactly per step "
            "(measured)")
  return fraction


def compare_planners(args, profile, costs) -> dict:
  """Prints every planner's groups and predicted breakdown; returns their timelines."""
  from dlgs_jax.planning import planner
  from dlgs_jax.planning.timeline import MethodCosts, simulate

  two_level = costs.fast_size > 1
  dense_costs = MethodCosts("dense", 1.0, fast_size=costs.fast_size, fast_link=costs.fast_link)
  dense_time = simulate(profile, planner.optimal(profile, dense_costs), dense_costs).t_iter
  print(f"\n{args.model}, {args.method} at density {args.density:g}, {_world(args, profile)}; "
        f"{profile.source}")
  print(f"dense all-reduce ({'two-level, ' if two_level else ''}optimal fusion): "
        f"{dense_time * 1e3:.2f} ms per iteration\n")
  header = (f"{'planner':8s} {'groups':>6s} {'t_iter ms':>10s} {'compute':>9s} "
            f"{'sparsify':>9s} {'comm exp.':>9s} {'speedup':>8s}")
  print(header)
  print("-" * len(header))
  timelines = {}
  for name in planner.PLANNERS:
    tl = simulate(profile, planner.PLANNER_FUNCTIONS[name](profile, costs), costs)
    timelines[name] = tl
    print(f"{name:8s} {len(tl.groups):6d} {tl.t_iter * 1e3:10.2f} {tl.compute * 1e3:9.2f} "
          f"{tl.sparsify * 1e3:9.2f} {tl.comm_exposed * 1e3:9.2f} {dense_time / tl.t_iter:7.2f}x")
  print()
  for name, tl in timelines.items():
    sizes = [sum(profile.sizes[i] for i in g) for g in tl.groups]
    print(f"{name}: {len(tl.groups)} groups, layers per group {[len(g) for g in tl.groups]}, "
          f"elements per group {sizes}")
  return timelines


def _world(args, profile) -> str:
  local = args.node_size or 1
  return (f"{profile.workers} nodes x {local} devices (two-level)" if local > 1
          else f"P = {profile.workers}")


def main(argv=None) -> int:
  args = parse_args(argv)
  refresh = check(args)
  if not args.profile:
    import jax
    # Only takes effect on the CPU backend; must precede the first device use.
    jax.config.update("jax_num_cpu_devices", args.devices)
  from dlgs_jax.planning import planner
  from dlgs_jax.planning.gantt import draw_gantt
  from dlgs_jax.planning.timeline import MethodCosts

  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  profile = on_network(args, measured_profile(args, refresh, out_dir))
  fraction = exact_fraction(args, profile, refresh)
  exchange = exchange_costs(args)
  costs = MethodCosts(args.method, args.density, exact_fraction=fraction, **exchange)
  timelines = compare_planners(args, profile, costs)
  plan = planner.make_plan(profile, args.method, args.density, args.planner,
                           exact_fraction=fraction, **exchange)
  plan_path = out_dir / f"{args.model}_{args.method}_{args.density:g}_{args.planner}_plan.json"
  plan.save(plan_path)
  png = out_dir / f"{args.model}_{args.method}_{args.density:g}_timeline.png"
  draw_gantt(profile, timelines, png, title=f"{args.model}, {args.method} density "
             f"{args.density:g}, {_world(args, profile)}")
  print(f"\nwrote {plan_path}\nwrote {png}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
