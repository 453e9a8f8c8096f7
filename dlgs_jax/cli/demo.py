"""``dlgs-demo``: the package's main job, a short real DLGS training run on the embedded data.

A preset `RunConfig` for ``dlgs-train``: SmallCNN on the real CIFAR-10 images
shipped in the package, 4 simulated workers on CPU devices of one process, DLGS
at density 0.01 (thresholds reused for 10 steps, one threshold for the model's
one message, the default budget), SGD with momentum, 10 epochs (290 steps).
Any ``dlgs-train`` flag given here overrides the preset:

    dlgs-demo                       # the preset
    dlgs-demo --epochs 2 --density 0.1
    dlgs-demo --method dense        # the same run with dense all-reduce
    dlgs-demo --budget layer        # a threshold per layer, the paper's budget

It ends by saying where the run went, what each worker sent against a dense
all-reduce, the accuracy next to dense's on the same preset, and what to try next.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from dlgs_jax.compress.methods import MethodConfig
from dlgs_jax.compress.optimizer import OptimizerConfig
from dlgs_jax.training.config import (CheckpointConfig, DataConfig, ModelConfig, ProcessConfig,
                                      RunConfig, ScheduleConfig)

# The preset's final test accuracy with a dense all-reduce (``dlgs-demo --method
# dense``), as measured for the docs' Getting started page, section "The demo".
DENSE_ACCURACY = 0.505
DENSE_CITED = "docs/getting_started.md, \"The demo\""

# What to try next: flags for the demo's own command (`demo_command`), then, in a
# checkout, other commands.
NEXT_FLAGS = (
    ("--method dense", "the same run with a dense all-reduce"),
    ("--budget layer", "a threshold per layer, k of each (the paper's budget)"),
    ("--density 0.025", "2.5 times the values a step"),
)
NEXT_COMMANDS = (
    ("bash scripts/docs.sh", "the docs, with DLGS in your own NNX or Linen step"),
)


def demo_command() -> str:
  """The demo's command as a fresh shell here runs it: the script in a checkout
  (``dlgs-demo`` lives in its .venv/bin, off the shell's PATH), else the entry point."""
  return "bash scripts/demo.sh" if Path("scripts/demo.sh").is_file() else "dlgs-demo"


def next_steps() -> list[tuple[str, str]]:
  """(command, what it shows) of each suggestion the demo ends with."""
  command = demo_command()
  steps = [(f"{command} {flags}", what) for flags, what in NEXT_FLAGS]
  return steps + (list(NEXT_COMMANDS) if command.startswith("bash") else [])


def preset(method: str = "dlgs") -> RunConfig:
  """The demo's run; its workdir is new for each call (``runs/demo-<time>``).

  Args:
    method: the method the run takes (``--method``), with its own defaults
      beside the preset's density.
  """
  return RunConfig(
      model=ModelConfig("smallcnn"),
      data=DataConfig(batch_size=32),
      method=MethodConfig(method, density=0.01, reuse_every=10),
      optimizer=OptimizerConfig(lr=0.05),
      schedule=ScheduleConfig(epochs=10),
      processes=ProcessConfig(local_devices=4),
      checkpoint=CheckpointConfig(workdir=time.strftime("runs/demo-%Y%m%d-%H%M%S"),
                                  check_every=50))


def trains_as_preset(config: RunConfig) -> bool:
  """Whether `config` is the preset's run but for its method, workdir and checkpoints:
  what the dense figure was measured on."""
  base = preset()
  same = dataclasses.replace(config, method=base.method, checkpoint=base.checkpoint)
  return same == base


def comparison_lines(config: RunConfig, summary: dict) -> list[str]:
  """The final accuracy next to dense's on the same preset, or how to measure it."""
  accuracy = summary.get("final_test_accuracy")
  dense = config.method.name == "dense"
  if accuracy is None or (dense and not trains_as_preset(config)):
    return []
  if not trains_as_preset(config):
    return ["for a dense baseline of these settings, run the same command with --method dense"]
  cited = f"measured for {DENSE_CITED}"
  if dense:
    return [f"dense on this preset: {accuracy:.1%} ({DENSE_ACCURACY:.1%} {cited})"]
  gap = 100 * (accuracy - DENSE_ACCURACY)
  return [f"accuracy: {config.method.name} {accuracy:.1%}, dense {DENSE_ACCURACY:.1%} on this "
          f"preset ({gap:+.1f} points; dense {cited})"]


def config_of(argv) -> RunConfig:
  """The run the demo's flags `argv` describe: the preset of their method, then each flag.

  Raises:
    SystemExit: naming a bad flag.
  """
  from dlgs_jax.cli import train
  method = getattr(train.build_parser("dlgs-demo").parse_args(argv), "method", None)
  return train.config_from_args(argv, base=preset(method or "dlgs"), prog="dlgs-demo")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "-h" in argv or "--help" in argv:
    print(__doc__)
  import os
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # simulated workers are CPU devices
  from dlgs_jax.cli import train
  config = config_of(argv)
  train.check_train_extra("dlgs-demo")
  summary = train.run(config, prog="dlgs-demo")
  import jax
  if jax.process_index() == 0:
    lines = comparison_lines(config, summary) + ["next:"] + [
        f"  {command:<44} {what}" for command, what in next_steps()]
    print("\n".join(lines), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
