"""``python -m dlgs_jax.cli.benchmark``: flags -> `BenchmarkConfig` -> one of four measurements.

Run one copy per process (e.g. under `dlgs_jax.cluster` or ``dlgs-launch
--module dlgs_jax.cli.benchmark``). By default it times one method's iteration
and its breakdown (`dlgs_jax.training.bench.breakdown`); ``--compare`` times several
methods' train steps in interleaved rounds (`dlgs_jax.training.bench.compare`);
``--profile-out`` measures a planner profile; ``--overlap-out`` asks whether the
runtime hides a collective behind independent work. Every setting is checked
before JAX's distributed runtime starts.
"""

from __future__ import annotations

import argparse
import sys

from dlgs_jax.compress.methods import ConfigError, MethodConfig
from dlgs_jax.planning.timeline import MODELLED


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m dlgs_jax.cli.benchmark",
                                   description=__doc__.splitlines()[0])
  add = parser.add_argument
  add("--model", default="resnet20")
  add("--method", default="dlgs")
  add("--density", type=float, default=0.01)
  add("--reuse-every", type=int, default=10)
  add("--refresh-below", default="0.5",
      help="DLGS refresh rule, as in dlgs-train ('none': the paper's schedule)")
  add("--min-ndim", type=int, default=0,
      help="DLGS/LAGS: leaves with fewer dimensions sent whole, as in dlgs-train")
  add("--send-whole", default="",
      help="DLGS/LAGS: leaves sent whole ('head': the output layer), as in dlgs-train")
  add("--batch-size", type=int, default=8)
  add("--image-size", type=int)
  add("--plan", help="plan JSON giving the method's groups")
  add("--steps", type=int, default=20, help="timed repetitions per program")
  add("--warmup", type=int, default=3)
  add("--batches", type=int, default=8,
      help="distinct batches per worker, taken in turn by the repetitions")
  add("--out", help="JSON result (written by process 0)")
  add("--profile-out", help="measure a planner profile instead, write it here")
  add("--profile-methods", default="", help="--profile-out: the methods whose update is timed "
      "(comma-separated; default every modelled method)")
  add("--overlap-out", help="measure whether collectives overlap independent work instead "
      "(profiling.measure_overlap), write the JSON here")
  add("--overlap-rounds", default="1,4", help="--overlap-out: work per collective, in "
      "elementwise passes over a leaf (comma-separated: one measurement each)")
  add("--overlap-leaves", type=int, default=32, help="--overlap-out: collectives per program")
  add("--overlap-size", type=int, default=200_000,
      help="--overlap-out: elements of work per collective")
  add("--compare", help="time the train steps of these methods or variants (comma-separated, "
      "e.g. dense,topk,dlgs-paper) interleaved in rounds instead")
  add("--rounds", type=int, default=8,
      help="--compare: rounds; each times --steps steps of every method")
  add("--plans", default="", help="--compare: METHOD=PLAN.json,... groups for dense/DLGS/LAGS "
      "methods; dense and DLGS methods without one send the model as one message, LAGS one "
      "message per leaf")
  add("--compile-slots", type=int, help="--compare: processes that compile at once, the "
      "others waiting their turn (a host whose memory the processes share; default: all)")
  return parser.parse_args(argv)


def parse_plans(text: str) -> dict:
  """``"dense=a.json,dlgs=b.json"`` -> ``{"dense": "a.json", "dlgs": "b.json"}``."""
  plans = {}
  for item in filter(None, text.split(",")):
    method, sep, path = item.partition("=")
    if not sep or not method or not path:
      raise ValueError(f"--plans entries are METHOD=PLAN.json, got {item!r}")
    plans[method] = path
  return plans


def profile_methods(args) -> tuple:
  """``--profile-methods`` checked (() for every modelled method)."""
  if not args.profile_methods:
    return ()
  if not args.profile_out:
    raise ValueError(f"--profile-methods is for --profile-out; got --profile-methods "
                     f"{args.profile_methods!r} without it")
  methods = args.profile_methods.split(",")
  unknown = [m for m in methods if m not in MODELLED]
  if unknown or len(set(methods)) != len(methods):
    raise ValueError(f"--profile-methods {args.profile_methods!r}: give distinct methods of "
                     f"{', '.join(MODELLED)}" + (f" (unknown: {', '.join(unknown)})"
                                                 if unknown else ""))
  return tuple(methods)


def overlap_rounds(text: str) -> tuple:
  try:
    return tuple(int(r) for r in text.split(","))
  except ValueError:
    raise ValueError(f"--overlap-rounds must be comma-separated integers, got {text!r}") from None


def benchmark_config(args):
  """The checked `BenchmarkConfig` of the flags."""
  from dlgs_jax.cli.train import parse_names, parse_refresh_below
  from dlgs_jax.training.bench.benchmark import BenchmarkConfig

  method = MethodConfig(args.method, density=args.density, reuse_every=args.reuse_every,
                        refresh_below=parse_refresh_below(args.refresh_below),
                        min_ndim=args.min_ndim, send_whole=parse_names(args.send_whole))
  return BenchmarkConfig(
      model=args.model, method=method, batch_size=args.batch_size, image_size=args.image_size,
      plan=args.plan, steps=args.steps, warmup=args.warmup, batches=args.batches, out=args.out,
      compare=tuple(args.compare.split(",")) if args.compare else (), rounds=args.rounds,
      plans=parse_plans(args.plans), compile_slots=args.compile_slots).validate()


def main(argv=None) -> int:
  from dlgs_jax.cli.train import flag_message

  args = parse_args(argv)
  try:
    config = benchmark_config(args)
    methods = profile_methods(args)
    rounds = overlap_rounds(args.overlap_rounds) if args.overlap_out else ()
    if args.overlap_out:
      from dlgs_jax.training.bench.benchmark import check_overlap
      check_overlap(rounds, args.overlap_leaves, args.overlap_size)
  except ConfigError as e:
    raise SystemExit(flag_message(e)) from None
  except ValueError as e:
    raise SystemExit(str(e)) from None
  from dlgs_jax.training import distributed
  distributed.initialize()

  from dlgs_jax.training.bench import benchmark
  from dlgs_jax.workload import parallel

  mesh = parallel.data_mesh()
  if args.overlap_out:
    benchmark.overlap(mesh, args.overlap_out, rounds=rounds, leaves=args.overlap_leaves,
                      size=args.overlap_size, repeats=args.steps)
  elif args.profile_out:
    benchmark.profile(config, mesh, args.profile_out, methods or None)
  elif config.compare:
    from dlgs_jax.training.bench.compare import compare
    compare(config, mesh)
  else:
    from dlgs_jax.training.bench.breakdown import breakdown
    breakdown(config, mesh)
  return 0


if __name__ == "__main__":
  sys.exit(main())
