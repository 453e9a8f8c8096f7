"""Predicted iteration time on N nodes of L GPUs: flat against two-level exchanges.

Measured: each profile's forward, per-layer backward and selection times (the H100
profiles by default; see each profile's `source`). Predicted: everything that
involves a link -- the network between nodes (α-β, shared by a node's L GPUs), the
fast link inside a node -- and the iteration times that follow from the timeline
model (`dlgs_jax.planning.scaling.predict_nodes` says how each exchange is priced).

    python experiments/predict_nodes.py
    python experiments/predict_nodes.py --local 4 --fast-bandwidth 64GB --bandwidths 25gbit

Writes a JSON of every prediction, a markdown table and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The GPU profiles of the models a node of 8 GPUs trains (see each profile's `source`).
DEFAULT_PROFILES = [HERE / "results" / "profiles" / f"{m}_gpu.json" for m in ("vgg16", "resnet50")]


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--profiles", nargs="+", default=[str(p) for p in DEFAULT_PROFILES],
                      help="measured profile JSON files (default: VGG16 and ResNet-50, H100)")
  parser.add_argument("--nodes", default="2,4,8,16", help="comma-separated node counts N")
  parser.add_argument("--local", type=int, default=8, help="GPUs per node L")
  parser.add_argument("--bandwidths", default="10gbit,25gbit,100gbit",
                      help="comma-separated bandwidths between nodes")
  parser.add_argument("--fast-bandwidth", type=float, default=300e9,
                      help="bytes/s per GPU on the link inside a node (300e9: NVLink-class)")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--latency", type=float, default=25e-6, help="network step latency, s")
  parser.add_argument("--fast-latency", type=float, default=5e-6, help="fast-link step latency, s")
  parser.add_argument("--out-dir", default=str(HERE / "results" / "nodes"))
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  from dlgs_jax.planning import network, scaling
  from dlgs_jax.profiling import figures

  nodes = [int(n) for n in args.nodes.split(",")]
  bandwidths = [network.parse_bandwidth(b) for b in args.bandwidths.split(",")]
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  profiles, measured = scaling.load_profiles(args.profiles)
  print("\n".join(scaling.measured_lines(measured, "GPU")))
  predictions = []
  for profile in profiles:
    predictions += scaling.predict_nodes(
        profile, nodes=nodes, local=args.local, bandwidths=bandwidths,
        fast_bandwidth=args.fast_bandwidth, density=args.density, latency=args.latency,
        fast_latency=args.fast_latency)
  labels = [label for label, *_ in scaling.NODE_CONFIGS]
  print(f"Predicted: both links and the iteration times; {args.local} GPUs per node, fast "
        f"link {args.fast_bandwidth / 1e9:g} GB/s, density {args.density:g}.\n")
  table = scaling.speedup_table(predictions, labels, args.local)
  print(table)
  stem = f"nodes_local{args.local}_density{args.density:g}"
  (out_dir / f"{stem}.json").write_text(json.dumps({
      "command": " ".join(["python", "experiments/predict_nodes.py"] + sys.argv[1:]),
      "measured": measured, "local": args.local, "fast_bandwidth": args.fast_bandwidth,
      "latency": args.latency, "fast_latency": args.fast_latency, "density": args.density,
      "predictions": [p.to_dict() for p in predictions]}, indent=1))
  (out_dir / f"{stem}.md").write_text(table + "\n")
  figures.speedup_grid(predictions, labels, out_dir / f"{stem}.png",
                       f"Predicted speedup over dense all-reduce, density {args.density:g} "
                       "(compute measured, network modelled)")
  print(f"\nwrote {out_dir / stem}.json, .md, .png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
