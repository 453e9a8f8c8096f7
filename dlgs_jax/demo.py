"""The package's main job: a short real DLGS training run on the embedded data.

A preset of `dlgs_jax.train`: SmallCNN on the real CIFAR-10 images shipped in
the package, 4 simulated workers on CPU devices of one process, DLGS at density
0.01 (thresholds reused for 10 steps), SGD with momentum, 10 epochs (about 290
steps). Any `dlgs-train` flag given here overrides the preset:

    dlgs-demo                       # the preset
    dlgs-demo --epochs 2 --density 0.1
    dlgs-demo --method dense        # the same run with dense all-reduce
"""

from __future__ import annotations

import sys
import time

PRESET = {
    "--model": "smallcnn", "--method": "dlgs", "--density": "0.01", "--reuse-every": "10",
    "--epochs": "10", "--batch-size": "32", "--lr": "0.05", "--local-devices": "4",
    "--check-every": "50",
}


def demo_args(argv) -> list[str]:
  """The preset with every flag of `argv` taking precedence."""
  argv = list(argv)
  given = {a.split("=")[0] for a in argv if a.startswith("--")}
  args = [x for flag, value in PRESET.items() if flag not in given for x in (flag, value)]
  if "--workdir" not in given:
    args += ["--workdir", time.strftime("runs/demo-%Y%m%d-%H%M%S")]
  return args + argv


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "-h" in argv or "--help" in argv:
    print(__doc__)
  import os
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # simulated workers are CPU devices
  from dlgs_jax import train
  return train.main(demo_args(argv))


if __name__ == "__main__":
  sys.exit(main())
