"""Measure compute profiles (forward, per-layer backward, selection costs) of the models.

Writes one `timeline.Profile` JSON per model to
``experiments/results/profiles/<model>_<backend>.json`` -- the input of
`predict_scaling.py` and of ``python -m dlgs_jax.cli.plan --profile``. On one device
no communication is measured (use ``--bandwidth`` in the consumers).

    python experiments/profile_models.py --models resnet20 vgg16 resnet50
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

from dlgs_jax import profiling

DEFAULT_BATCH = {"resnet20": 32, "vgg16": 32, "resnet50": 64, "smallcnn": 32}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=["resnet20", "vgg16", "resnet50"])
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--batch-size", type=int, help="per worker (default: the paper's)")
  parser.add_argument("--image-size", type=int, help="input side for resnet50 (default 224)")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--out-dir", default="experiments/results/profiles")
  args = parser.parse_args(argv)
  out_dir = Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  backend = jax.default_backend()
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
  for name in args.models:
    batch = args.batch_size or DEFAULT_BATCH.get(name, 32)
    image = args.image_size if name == "resnet50" else None
    profile, details = profiling.profile_model(
        name, density=args.density, batch_size=batch, image_size=image, mesh=mesh,
        repeats=args.repeats, progress=lambda m, name=name: print(f"{name}: {m}", flush=True))
    path = out_dir / f"{name}_{backend}.json"
    profile.save(path)
    (out_dir / f"{name}_{backend}_details.json").write_text(json.dumps(details, indent=1))
    print(f"{name}: forward {profile.t_forward * 1e3:.2f} ms, backward "
          f"{details['backward_measured'] * 1e3:.2f} ms (layers alone sum to "
          f"{details['backward_sum_alone'] * 1e3:.2f} ms, {details['backward_difference'] * 100:+.1f}%), "
          f"update per message: dlgs {profile.sparsify['dlgs']}, lags {profile.sparsify['lags']}; "
          f"wrote {path}",
          flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
