"""Predicted iteration time and speedup over dense for P = 2..64 on 1/10/25 Gb/s.

Measured: each profile's forward, per-layer backward and selection times (see the
profile's `source`). Predicted: everything that involves the network, from an
α-β model (`dlgs_jax.planning.network.network_comm`), and the iteration times that follow
from the timeline model. See `dlgs_jax.planning.scaling` for how each method is grouped.

    python experiments/predict_scaling.py
    python experiments/predict_scaling.py --profiles runs/plan/resnet20_profile.json --density 0.1

Writes a JSON of every prediction, a markdown table and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_PROFILES = [HERE / "results" / "profiles" / f"{m}_gpu.json"
                    for m in ("resnet20", "vgg16", "resnet50")]


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--profiles", nargs="+", default=[str(p) for p in DEFAULT_PROFILES],
                      help="measured profile JSON files (default: the H100 profiles)")
  parser.add_argument("--workers", default="2,4,8,16,32,64", help="comma-separated P values")
  parser.add_argument("--bandwidths", default="1gbit,10gbit,25gbit",
                      help="comma-separated link bandwidths")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--latency", type=float, default=25e-6, help="per-step latency, seconds")
  parser.add_argument("--out-dir", default=str(HERE / "results" / "scaling"))
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  from dlgs_jax.planning import network, scaling
  from dlgs_jax.profiling import figures

  workers = [int(w) for w in args.workers.split(",")]
  bandwidths = [network.parse_bandwidth(b) for b in args.bandwidths.split(",")]
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  profiles, sources = scaling.load_profiles(args.profiles)
  print("\n".join(scaling.measured_lines(sources, "worker", ", selection costs fitted")))
  predictions = []
  for profile in profiles:
    predictions += scaling.predict(profile, workers=workers, bandwidths=bandwidths,
                                   density=args.density, latency=args.latency,
                                   methods=scaling.PREDICTABLE)
  print(f"Predicted: communication (alpha-beta, latency {args.latency * 1e6:g} us per step) "
        f"and iteration times; density {args.density:g}.\n")
  table = scaling.speedup_table(predictions, scaling.PREDICTABLE)
  print(table)
  tag = f"density{args.density:g}"
  json_path = out_dir / f"scaling_{tag}.json"
  with open(json_path, "w") as f:
    json.dump({"command": " ".join(["python", "experiments/predict_scaling.py"] + sys.argv[1:]),
               "measured": sources, "latency": args.latency, "density": args.density,
               "predictions": [p.to_dict() for p in predictions]}, f, indent=1)
  (out_dir / f"scaling_{tag}.md").write_text(table + "\n")
  png = out_dir / f"scaling_{tag}.png"
  figures.speedup_grid(predictions, scaling.PREDICTABLE, png,
                       f"Predicted speedup over dense all-reduce, density {args.density:g} "
                       "(compute measured, network modelled)")
  print(f"\nwrote {json_path}\nwrote {png}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
