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


def markdown(predictions, methods) -> str:
  rows = {}
  for p in predictions:
    rows.setdefault((p.model, p.bandwidth_bits, p.workers), {})[p.method] = p
  head = ("| model | link | P | dense ms (predicted) | "
          + " | ".join(f"{m} ms / speedup" for m in methods if m != "dense") + " | best |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for (model, bits, workers), by_method in rows.items():
    dense = by_method["dense"]
    cells = [f"{by_method[m].t_iter * 1e3:.2f} / {by_method[m].speedup_vs_dense:.2f}x"
             for m in methods if m != "dense"]
    best = min(by_method.values(), key=lambda x: x.t_iter).method
    lines.append(f"| {model} | {bits / 1e9:g} Gb/s | {workers} | {dense.t_iter * 1e3:.2f} | "
                 + " | ".join(cells) + f" | {best} |")
  return "\n".join(lines)


def plot(predictions, methods, path, density):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  models = list(dict.fromkeys(p.model for p in predictions))
  bandwidths = list(dict.fromkeys(p.bandwidth_bits for p in predictions))
  fig, axes = plt.subplots(len(models), len(bandwidths), squeeze=False,
                           figsize=(4 * len(bandwidths), 3 * len(models)), sharex=True)
  for r, model in enumerate(models):
    for c, bits in enumerate(bandwidths):
      ax = axes[r, c]
      for method in methods:
        pts = [p for p in predictions
               if p.model == model and p.bandwidth_bits == bits and p.method == method]
        ax.plot([p.workers for p in pts], [p.speedup_vs_dense for p in pts], marker="o",
                markersize=3, label=method)
      ax.set_xscale("log", base=2)
      ax.axhline(1.0, color="0.7", linewidth=0.8)
      ax.set_title(f"{model}, {bits / 1e9:g} Gb/s", fontsize=9)
      if c == 0:
        ax.set_ylabel("speedup over dense")
      if r == len(models) - 1:
        ax.set_xlabel("workers P")
  axes[0, 0].legend(fontsize=7)
  fig.suptitle(f"Predicted speedup over dense all-reduce, density {density:g} "
               "(compute measured, network modelled)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def load_profiles(paths):
  """(profiles, what was measured in each: file, source, forward and backward seconds)."""
  from dlgs_jax.planning.timeline import Profile

  profiles, measured = [], {}
  for path in paths:
    profile = Profile.load(path)
    profiles.append(profile)
    measured[profile.model] = {"file": str(path), "source": profile.source,
                               "t_forward": profile.t_forward,
                               "t_backward": sum(profile.t_backward)}
  return profiles, measured


def prepared(args, per: str, note: str = ""):
  """(bandwidths, the output folder, profiles, what each measured), the measurements printed."""
  from dlgs_jax.planning import network

  bandwidths = [network.parse_bandwidth(b) for b in args.bandwidths.split(",")]
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  profiles, measured = load_profiles(args.profiles)
  print(f"Measured (per {per}):")
  for model, m in measured.items():
    print(f"  {model}: forward {m['t_forward'] * 1e3:.2f} ms, backward "
          f"{m['t_backward'] * 1e3:.2f} ms{note}; {m['source']}")
  return bandwidths, out_dir, profiles, measured


def main(argv=None) -> int:
  args = parse_args(argv)
  from dlgs_jax.planning import scaling
  from dlgs_jax.planning.timeline import METHODS

  workers = [int(w) for w in args.workers.split(",")]
  bandwidths, out_dir, profiles, sources = prepared(args, "worker",
                                                    ", selection costs fitted")
  predictions = []
  for profile in profiles:
    predictions += scaling.predict(profile, workers=workers, bandwidths=bandwidths,
                                   density=args.density, latency=args.latency)
  print(f"Predicted: communication (alpha-beta, latency {args.latency * 1e6:g} us per step) "
        f"and iteration times; density {args.density:g}.\n")
  table = markdown(predictions, METHODS)
  print(table)
  tag = f"density{args.density:g}"
  json_path = out_dir / f"scaling_{tag}.json"
  with open(json_path, "w") as f:
    json.dump({"command": " ".join(["python", "experiments/predict_scaling.py"] + sys.argv[1:]),
               "measured": sources, "latency": args.latency, "density": args.density,
               "predictions": [p.to_dict() for p in predictions]}, f, indent=1)
  (out_dir / f"scaling_{tag}.md").write_text(table + "\n")
  png = out_dir / f"scaling_{tag}.png"
  plot(predictions, METHODS, png, args.density)
  print(f"\nwrote {json_path}\nwrote {png}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
