"""``dlgs-demo``: the package's main job, a short real DLGS training run on the embedded data.

A preset `RunConfig` for ``dlgs-train``: SmallCNN on the real CIFAR-10 images
shipped in the package, 4 simulated workers on CPU devices of one process, DLGS
at density 0.01 (thresholds reused for 10 steps), SGD with momentum, 10 epochs
(about 290 steps). Any ``dlgs-train`` flag given here overrides the preset:

    dlgs-demo                       # the preset
    dlgs-demo --epochs 2 --density 0.1
    dlgs-demo --method dense        # the same run with dense all-reduce
"""

from __future__ import annotations

import sys
import time

from dlgs_jax.compress.methods import MethodConfig
from dlgs_jax.compress.optimizer import OptimizerConfig
from dlgs_jax.training.config import (CheckpointConfig, DataConfig, ModelConfig, ProcessConfig,
                                      RunConfig, ScheduleConfig)


def preset() -> RunConfig:
  """The demo's run; its workdir is new for each call (``runs/demo-<time>``)."""
  return RunConfig(
      model=ModelConfig("smallcnn"),
      data=DataConfig(batch_size=32),
      method=MethodConfig("dlgs", density=0.01, reuse_every=10),
      optimizer=OptimizerConfig(lr=0.05),
      schedule=ScheduleConfig(epochs=10),
      processes=ProcessConfig(local_devices=4),
      checkpoint=CheckpointConfig(workdir=time.strftime("runs/demo-%Y%m%d-%H%M%S"),
                                  check_every=50))


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "-h" in argv or "--help" in argv:
    print(__doc__)
  import os
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # simulated workers are CPU devices
  from dlgs_jax.cli import train
  return train.main(argv, base=preset())


if __name__ == "__main__":
  sys.exit(main())
