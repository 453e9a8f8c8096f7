"""How long the planners take, at ResNet-50's 161 leaves and beyond.

Profiles are random but realistic in range (leaf sizes 10..2M elements,
backward times 0..10 ms, comm alpha 10 us..2 ms); each planner runs on the same
profiles and the median wall time is reported, with the modelled iteration
time relative to the optimum.

    python experiments/bench_planner.py [--layers 59 161 320] [--profiles 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from dlgs_jax.planning import planner
from dlgs_jax.planning.timeline import LinearCost, MethodCosts, Profile, simulate


def random_profile(rng, layers):
  return Profile(
      model="random", paths=[f"layer{i}" for i in range(layers)],
      sizes=rng.integers(10, 2_000_000, layers), t_forward=float(rng.uniform(0.001, 0.02)),
      t_backward=rng.uniform(0.0, 0.01, layers) * (rng.random(layers) > 0.2), workers=16,
      sparsify={"dlgs": LinearCost(float(rng.uniform(0, 1e-3)), float(rng.uniform(0, 5e-9)))},
      comm={"allgather": LinearCost(float(rng.uniform(1e-5, 2e-3)), float(rng.uniform(1e-10, 1e-8)))})


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", nargs="+", type=int, default=[59, 161, 320])
  parser.add_argument("--profiles", type=int, default=5)
  parser.add_argument("--out", default="experiments/results/bench_planner.json")
  args = parser.parse_args(argv)
  costs = MethodCosts("dlgs", 0.01)
  rows = []
  for layers in args.layers:
    rng = np.random.default_rng(layers)
    profiles = [random_profile(rng, layers) for _ in range(args.profiles)]
    for name in planner.PLANNERS:
      times, ratios = [], []
      for profile in profiles:
        start = time.perf_counter()
        groups = planner.PLANNER_FUNCTIONS[name](profile, costs)
        times.append(time.perf_counter() - start)
        best = simulate(profile, planner.optimal(profile, costs), costs).t_iter
        ratios.append(simulate(profile, groups, costs).t_iter / best)
      rows.append({"layers": layers, "planner": name, "median_s": float(np.median(times)),
                   "max_s": float(np.max(times)), "t_iter_over_optimal": float(np.mean(ratios))})
  lines = ["| layers | planner | median s | max s | t_iter / optimal |", "|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['layers']} | {r['planner']} | {r['median_s']:.4f} | {r['max_s']:.4f} | "
                 f"{r['t_iter_over_optimal']:.3f} |")
  table = "\n".join(lines)
  print(table)
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"command": "python experiments/bench_planner.py " + " ".join(argv or []),
                             "machine": platform.platform(), "rows": rows, "table": table}, indent=2))
  print(f"\nwrote {out}")


if __name__ == "__main__":
  import sys
  main(sys.argv[1:])
