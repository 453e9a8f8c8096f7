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


def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      prog="dlgs-plan", description=__doc__.splitlines()[0])
  parser.add_argument("--model", required=True, help="smallcnn, resnet20, vgg16 or resnet50")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--method", default="dlgs", help="method the plan is for (dlgs, lags, dense)")
  parser.add_argument("--planner", default="optimal", help="planner whose plan is written")
  parser.add_argument("--collective", default="allgather",
                      help="topk/lags/dlgs: allgather, gtopk, owners, or auto: the exchange "
                      "the network prices fastest (dense bfloat16 among them), written to "
                      "<model>_<method>_<density>_collective.json")
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


def config_from_args(args):
  """The `PlanConfig` the flags describe, checked; exits naming the first bad flag."""
  from dlgs_jax.cli.train import flag_message, parse_refresh_below
  from dlgs_jax.compress.methods import ConfigError
  from dlgs_jax.training.plan_job import PlanConfig

  try:
    fields = {name: value for name, value in vars(args).items() if name != "refresh_below"}
    return PlanConfig(**fields, refresh_below=parse_refresh_below(args.refresh_below)).validate()
  except ConfigError as e:
    raise SystemExit(flag_message(e)) from None


def main(argv=None) -> int:
  config = config_from_args(parse_args(argv))
  if not config.profile:
    import jax
    # Only takes effect on the CPU backend; must precede the first device use.
    jax.config.update("jax_num_cpu_devices", config.devices)
  from dlgs_jax.training import plan_job

  try:
    paths = plan_job.run(config, progress=lambda line: print(line, flush=True))
  except plan_job.PlanJobError as e:
    raise SystemExit(str(e)) from None
  print("".join(f"\nwrote {path}" for path in paths.values()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
