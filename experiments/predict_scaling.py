"""Predicted iteration time and speedup over dense: P workers, or N nodes of L GPUs.

Measured: each profile's forward, per-layer backward and selection times (see the
profile's `source`). Predicted: everything that involves a link, from an α-β
model (`dlgs_jax.planning.network.network_comm`), and the iteration times that
follow from the timeline model (`dlgs_jax.planning.scaling` says how each method
is grouped and each exchange priced).

    python experiments/predict_scaling.py                  # P = 2..64 on 1/10/25 Gb/s
    python experiments/predict_scaling.py --density 0.1
    python experiments/predict_scaling.py --nodes 2,4,8,16 # nodes of 8 GPUs: flat and two-level
    python experiments/predict_scaling.py --nodes 2,4 --local 4 --fast-bandwidth 64e9

Writes a JSON of every prediction, a markdown table and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROFILES = HERE / "results" / "profiles"


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--profiles", nargs="+",
                      help="measured profile JSON files (default: the H100 profiles; with "
                      "--nodes, VGG16's and ResNet-50's)")
  parser.add_argument("--workers", default="2,4,8,16,32,64", help="comma-separated P values")
  parser.add_argument("--nodes", help="comma-separated node counts N: predict nodes of --local "
                      "GPUs, flat against two-level exchanges, instead of P workers")
  parser.add_argument("--local", type=int, default=8, help="with --nodes: GPUs per node L")
  parser.add_argument("--bandwidths", help="comma-separated link bandwidths (between nodes); "
                      "default 1gbit,10gbit,25gbit (with --nodes 10gbit,25gbit,100gbit)")
  parser.add_argument("--fast-bandwidth", type=float, default=300e9,
                      help="with --nodes: bytes/s per GPU inside a node (300e9: NVLink-class)")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--latency", type=float, default=25e-6, help="per-step latency, seconds")
  parser.add_argument("--fast-latency", type=float, default=5e-6,
                      help="with --nodes: fast-link step latency, seconds")
  parser.add_argument("--out-dir", help="default: experiments/results/scaling (with --nodes, "
                      "experiments/results/nodes)")
  args = parser.parse_args(argv)
  nodes = args.nodes is not None
  models = ("vgg16", "resnet50") if nodes else ("resnet20", "vgg16", "resnet50")
  args.profiles = args.profiles or [str(PROFILES / f"{m}_gpu.json") for m in models]
  args.bandwidths = args.bandwidths or ("10gbit,25gbit,100gbit" if nodes
                                        else "1gbit,10gbit,25gbit")
  args.out_dir = args.out_dir or str(HERE / "results" / ("nodes" if nodes else "scaling"))
  return args


def predictions_of(args, profiles, bandwidths):
  """(predictions, their labels, the table's ``local``, the file stem, what was predicted)."""
  from dlgs_jax.planning import scaling

  predictions = []
  if args.nodes is None:
    workers = [int(w) for w in args.workers.split(",")]
    for profile in profiles:
      predictions += scaling.predict(profile, workers=workers, bandwidths=bandwidths,
                                     density=args.density, latency=args.latency,
                                     methods=scaling.PREDICTABLE)
    return (predictions, scaling.PREDICTABLE, None, f"scaling_density{args.density:g}",
            f"communication (alpha-beta, latency {args.latency * 1e6:g} us per step) and "
            f"iteration times; density {args.density:g}")
  nodes = [int(n) for n in args.nodes.split(",")]
  for profile in profiles:
    predictions += scaling.predict_nodes(
        profile, nodes=nodes, local=args.local, bandwidths=bandwidths,
        fast_bandwidth=args.fast_bandwidth, density=args.density, latency=args.latency,
        fast_latency=args.fast_latency)
  return (predictions, [label for label, *_ in scaling.NODE_CONFIGS], args.local,
          f"nodes_local{args.local}_density{args.density:g}",
          f"both links and the iteration times; {args.local} GPUs per node, fast link "
          f"{args.fast_bandwidth / 1e9:g} GB/s, density {args.density:g}")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  from dlgs_jax.planning import network, scaling
  from dlgs_jax.profiling import figures

  bandwidths = [network.parse_bandwidth(b) for b in args.bandwidths.split(",")]
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  profiles, measured = scaling.load_profiles(args.profiles)
  print("\n".join(scaling.measured_lines(measured, "worker" if args.nodes is None else "GPU")))
  predictions, labels, local, stem, what = predictions_of(args, profiles, bandwidths)
  print(f"Predicted: {what}.\n")
  table = scaling.speedup_table(predictions, labels, local)
  print(table)
  settings = {"latency": args.latency, "density": args.density}
  if args.nodes is not None:
    settings.update(local=args.local, fast_bandwidth=args.fast_bandwidth,
                    fast_latency=args.fast_latency)
  (out_dir / f"{stem}.json").write_text(json.dumps({
      "command": " ".join(["python", "experiments/predict_scaling.py"] + argv),
      "measured": measured, **settings,
      "predictions": [p.to_dict() for p in predictions]}, indent=1))
  (out_dir / f"{stem}.md").write_text(table + "\n")
  figures.speedup_grid(predictions, labels, out_dir / f"{stem}.png",
                       f"Predicted speedup over dense all-reduce, density {args.density:g} "
                       "(compute measured, network modelled)")
  print(f"\nwrote {out_dir / stem}.json, .md, .png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
