"""``dlgs-train`` (also ``python -m dlgs_jax.cli.train``): flags -> `RunConfig` -> a run.

One process or many (`jax.distributed`; see ``dlgs-launch``), any number of
devices each; every device is one worker.

    dlgs-train --model resnet20 --method dlgs --density 0.01 --epochs 2
    dlgs-train --model resnet20 --method dlgs --planner optimal --bandwidth 1gbit
    dlgs-train --model vgg16 --data-dir ~/data/cifar-10-batches-bin --epochs 140 --lr 0.1
    dlgs-train --config runs/x/config.json --seed 1     # a config file, flags override it

Optimizer: the compressor (which averages gradients across workers), weight
decay, then SGD with momentum (DGC: decay, DGC, plain SGD). The learning rate is
divided by 10 after 4/7 and 6/7 of the steps unless ``--lr-decay-epochs`` says
otherwise. Writes to ``--workdir``: ``config.json``, ``metrics.jsonl``,
``summary.json``, ``plan.json`` (when planned) and ``checkpoints/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Callable, Optional

from dlgs_jax.compress.methods import METHODS, ConfigError
from dlgs_jax.training.config import (PLANNERS, RunConfig, check_used, load_config,
                                      with_overrides)


def parse_refresh_below(text: str) -> Optional[float]:
  """``--refresh-below``: a fraction of k in [0, 1], or None for 'none' (the paper's schedule)."""
  if text == "none":
    return None
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not 0.0 <= value <= 1.0:
    raise ConfigError("refresh_below", text, "must be a number in [0, 1] or 'none'")
  return value


def parse_names(text: str) -> tuple[str, ...]:
  """Comma-separated names (``--send-whole``); '' gives none."""
  return tuple(name.strip() for name in text.split(",") if name.strip())


def parse_epochs(text: str) -> tuple[float, ...]:
  """``--lr-decay-epochs``: comma-separated numbers."""
  try:
    return tuple(float(e) for e in text.split(",") if e.strip())
  except ValueError:
    raise ConfigError("lr_decay_epochs", text, "give comma-separated numbers") from None


def format_refresh_below(value: Optional[float]) -> str:
  return "none" if value is None else repr(value)


@dataclasses.dataclass(frozen=True)
class Flag:
  """One flag: the config option it sets, how its text becomes a value, and back."""
  flag: str
  section: str
  option: str
  help: str
  parse: Callable = str
  action: Optional[str] = None  # "store_true" / "store_false": a switch
  format: Callable = str

  def text(self, value) -> list[str]:
    """The command-line words that set `value` (for configs passed on to child processes)."""
    if self.action:
      return [self.flag] if value == (self.action == "store_true") else []
    return [self.flag, self.format(value)]


_M, _D, _S, _P, _O = "method", "data", "schedule", "plan", "optimizer"
FLAGS = (
    Flag("--model", "model", "name", "smallcnn, resnet20, vgg16 or resnet50"),
    Flag("--method", _M, "name", f"one of {tuple(METHODS)}"),
    Flag("--density", _M, "density", "fraction of values sent (sparse methods)", float),
    Flag("--reuse-every", _M, "reuse_every", "DLGS: exact threshold every this many steps", int),
    Flag("--refresh-below", _M, "refresh_below",
         "DLGS: recompute a group's reused thresholds early when they send fewer than this "
         "fraction of k (or overflow the buffers); 'none': the paper's fixed schedule",
         parse_refresh_below, format=format_refresh_below),
    Flag("--candidates", _M, "candidates", "DLGS: thresholds each leaf tries on a reuse step, "
         "multiples 2^(j/8) of its reused one, interpolated between (leaves of k < 16: exact "
         "every step); 1: the reused one only", int),
    Flag("--aim", _M, "aim", "DLGS, adapted rule: the count each reused threshold is re-aimed "
         "at, as a fraction of k, in (0, 2]; what the step before sent has left the residual, "
         "so about 1.1 sends k, but past 1 the buffer overflows and the leaves laid out "
         "last can wait indefinitely", float),
    Flag("--budget", _M, "budget", "DLGS: 'message' (one threshold per message, its leaves' "
         "k together: the default) or 'layer' (a threshold per leaf, k_l each: the paper's)"),
    Flag("--min-ndim", _M, "min_ndim", "lags/dlgs: leaves with fewer dimensions are sent whole; "
         "0: every leaf is sparsified (the paper)", int),
    Flag("--send-whole", _M, "send_whole", "lags/dlgs: leaves sent whole, comma-separated leaf "
         "paths, or 'head' for the output layer; '': none (the paper)", parse_names,
         format=",".join),
    Flag("--collective", _M, "collective", "topk/lags/dlgs collective: allgather, owners (bytes flat in the workers) or (lags/dlgs) gtopk"),
    Flag("--wire-dtype", _M, "wire_dtype", "dense/topk/lags/dlgs: the values' dtype on the "
         "wire, float32 or bfloat16 (dense: a bf16 all-reduce; sparse: 6-byte pairs, the "
         "rounding kept in the residuals)"),
    Flag("--dgc-warmup-epochs", _M, "dgc_warmup_epochs", "DGC: epochs of exponential density "
         "warm-up from 0.25 (capped at a quarter of the run)", float),
    Flag("--terngrad-clip", _M, "terngrad_clip",
         "TernGrad: clip at this many standard deviations (0: no clipping)", float),
    Flag("--planner", _P, "planner", f"layer merging for dense/lags/dlgs, one of {PLANNERS}; "
         "'none': dense fuses everything into one message, lags/dlgs send each leaf alone"),
    Flag("--plan", _P, "plan", "use this plan JSON (from dlgs-plan) instead of planning"),
    Flag("--profile", _P, "profile", "plan from this profile JSON instead of measuring one"),
    Flag("--bandwidth", _P, "bandwidth", "plan for a modelled network of this link bandwidth "
         "(e.g. 1gbit)"),
    Flag("--latency", _P, "latency", "per-step latency with --bandwidth, seconds", float),
    Flag("--epochs", _S, "epochs", "epochs in all", int),
    Flag("--steps", _S, "steps", "stop after this many steps in all (default: all epochs)", int),
    Flag("--batch-size", _D, "batch_size", "examples per worker per step", int),
    Flag("--lr", _O, "lr", "base learning rate", float),
    Flag("--lr-decay-epochs", _S, "lr_decay_epochs", "comma-separated epochs after which lr is "
         "divided by 10 (default: 4/7 and 6/7 of the run)", parse_epochs,
         format=lambda v: ",".join(map(repr, v))),
    Flag("--momentum", _O, "momentum", "SGD momentum", float),
    Flag("--nesterov", _O, "nesterov", "Nesterov momentum", action="store_true"),
    Flag("--weight-decay", _O, "weight_decay", "weight decay", float),
    Flag("--sync-bn", "model", "sync_bn", "synchronise BatchNorm statistics across workers",
         action="store_true"),
    Flag("--no-augment", _D, "augment", "no random crop/flip", action="store_false"),
    Flag("--dataset", _D, "dataset", "auto (CIFAR models: cifar10; resnet50: imagefolder), "
         "cifar10, imagefolder, synthetic"),
    Flag("--data-dir", _D, "data_dir", "CIFAR-10's cifar-10-batches-bin/ or -py/, or an image folder with train/ and "
         "val/; default for CIFAR: the real subset embedded in the package"),
    Flag("--image-size", _D, "image_size", "input side (imagefolder/synthetic; default: the "
         "model's)", int),
    Flag("--synthetic-examples", _D, "synthetic_examples", "training examples with synthetic "
         "data", int),
    Flag("--eval-batch-size", _D, "eval_batch_size", "examples per evaluation batch", int),
    Flag("--workers", "processes", "workers", "use the first N devices of all processes "
         "(default: all)", int),
    Flag("--coordinator", "processes", "coordinator",
         "multi-process: host:port of process 0 (or DLGS_COORDINATOR_ADDRESS)"),
    Flag("--num-processes", "processes", "num_processes",
         "multi-process: process count (or DLGS_NUM_PROCESSES)", int),
    Flag("--process-id", "processes", "process_id",
         "multi-process: this process's id (or DLGS_PROCESS_ID)", int),
    Flag("--init-timeout", "processes", "init_timeout",
         "multi-process: seconds to wait for every process to join", int),
    Flag("--local-devices", "processes", "local_devices",
         "simulated CPU devices in this process (CPU only; or DLGS_LOCAL_DEVICES)", int),
    Flag("--flat", "processes", "flat", "one data axis over all devices; by default several "
         "processes of several devices exchange densely inside a process and compress "
         "between processes", action="store_true"),
    Flag("--node-size", "processes", "node_size", "devices per node of the two-level exchange: "
         "consecutive processes' devices form a node (e.g. one process per GPU); default: "
         "each process is a node", int),
    Flag("--fsdp", "processes", "fsdp", "slice the model over N consecutive devices (a node): "
         "each holds 1/N of the parameters, optimizer state and residuals; the method runs "
         "between nodes (HSDP)", int),
    Flag("--simulate-workers", "processes", "simulate_workers", "run N workers on one device "
         "under jax.vmap: the numerics, bytes and checkpoints of N devices (one process)", int),
    Flag("--workdir", "checkpoint", "workdir", "where the run writes"),
    Flag("--resume", "checkpoint", "resume", "continue from the latest checkpoint in --workdir; "
         "more --epochs or --steps extend a run whose steps taken keep their learning rate",
         action="store_true"),
    Flag("--checkpoint-every", "checkpoint", "checkpoint_every",
         "save every N steps (0: at the end of every epoch)", int),
    Flag("--keep", "checkpoint", "keep", "checkpoints kept", int),
    Flag("--stop-after", "checkpoint", "stop_after", "leave after this many steps of this run "
         "with a checkpoint (continue with --resume); 0: run to the end", int),
    Flag("--check-every", "checkpoint", "check_every", "verify every N steps that all workers "
         "hold identical parameters (0: only at the start and end)", int),
    Flag("--nonfinite-limit", "checkpoint", "nonfinite_limit", "stop when the loss has been "
         "non-finite this many steps in a row (no checkpoint is saved meanwhile)", int),
    Flag("--seed", "seed", "seed", "parameter, data-order and method seed", int),
)
FLAG_OF = {(f.section, f.option): f.flag for f in FLAGS}


_DEFAULTS = RunConfig()


def _default(flag: Flag):
  if flag.section == "seed":
    return _DEFAULTS.seed
  return getattr(getattr(_DEFAULTS, flag.section), flag.option)


def build_parser(prog: str = "dlgs-train", description: str = "") -> argparse.ArgumentParser:
  """Every flag, with ``SUPPRESS`` defaults: only the flags given appear in the namespace."""
  parser = argparse.ArgumentParser(prog=prog, description=description or __doc__.splitlines()[0],
                                   argument_default=argparse.SUPPRESS)
  parser.add_argument("--config", help="a JSON config file (a run's config.json, or any "
                      "subset of its sections); flags override it")
  for flag in FLAGS:
    help_text = f"{flag.help} (default: {_default(flag)!r})"
    if flag.action:
      parser.add_argument(flag.flag, action="store_true", help=help_text)
    else:
      parser.add_argument(flag.flag, help=help_text)
  return parser


def overrides(namespace: argparse.Namespace) -> dict[str, dict]:
  """{section: {option: value}} of the flags given, their text parsed."""
  found: dict[str, dict] = {}
  for flag in FLAGS:
    name = flag.flag[2:].replace("-", "_")
    if not hasattr(namespace, name):
      continue
    text = getattr(namespace, name)
    if flag.action:
      value = flag.action == "store_true"
    else:
      try:
        value = flag.parse(text)
      except ValueError:
        if isinstance(flag.parse, type):
          raise ConfigError(flag.option, text, f"must be {flag.parse.__name__}") from None
        raise
    found.setdefault(flag.section, {})[flag.option] = value
  return found


def config_from_args(argv=None, base: Optional[RunConfig] = None, prog: str = "dlgs-train"
                     ) -> RunConfig:
  """The checked `RunConfig` that `argv` describes: `base` or ``--config``, then each flag.

  Raises:
    SystemExit: naming the bad flag and value.
  """
  namespace = build_parser(prog).parse_args(argv)
  try:
    config = base or RunConfig()
    if getattr(namespace, "config", None):
      try:
        config = load_config(namespace.config)
      except ConfigError as e:
        raise SystemExit(f"{prog}: --config {namespace.config}: {e}") from None
    given = overrides(namespace)
    config = with_overrides(config, given).validate()
    check_used(config, given)
    return config
  except ConfigError as e:
    raise SystemExit(f"{prog}: {flag_message(e)}") from None
  except TypeError as e:  # a config file's option of the wrong kind
    raise SystemExit(f"{prog}: --config: {e}") from None


def flag_message(error: ConfigError) -> str:
  """A `ConfigError` in the command line's words (``--density 0.0 is invalid: ...``)."""
  flags = [f.flag for f in FLAGS if f.option == error.option]
  name = flags[0] if len(flags) == 1 else "--" + error.option.replace("_", "-")
  return f"{name} {error.value!r} is invalid: {error.rule}"


def config_flags(config: RunConfig, sections=("method",)) -> list[str]:
  """The flags that set `config`'s options of `sections` (for a child process's command line)."""
  words = []
  for flag in FLAGS:
    if flag.section in sections:
      value = getattr(getattr(config, flag.section), flag.option)
      if value != _default(flag) or flag.option == "name":
        words += flag.text(value)
  return words


def method_flags(name: str) -> list[str]:
  """The ``dlgs-train`` flags that select a method or a variant (``dlgs-paper`` ->
  ``--method dlgs --refresh-below none --budget layer``)."""
  from dlgs_jax.compress.methods import method_config

  return config_flags(RunConfig(method=method_config(name)))


def run(config: RunConfig, prog: str = "dlgs-train") -> dict:
  """Starts `jax.distributed` where the config asks for it, then trains; the run's summary.

  Raises:
    SystemExit: one line naming what stopped the run.
  """
  from dlgs_jax.training import distributed, loop

  processes = config.processes
  try:
    distributed.initialize(processes.coordinator, processes.num_processes, processes.process_id,
                           local_cpu_devices=processes.local_devices,
                           init_timeout=processes.init_timeout)
  except ValueError as e:
    raise SystemExit(f"{prog}: {e}") from None
  try:
    return loop.train(config)
  except (loop.RunError, ConfigError) as e:
    raise SystemExit(f"{prog}: {e}") from None


# What a run imports from the "train" extra (progress bars, checkpoints).
TRAIN_EXTRA = ("tqdm", "orbax.checkpoint")


def check_train_extra(prog: str = "dlgs-train") -> None:
  """Refuses to start without the "train" extra, before anything is built.

  Raises:
    SystemExit: naming the missing modules and the install command.
  """
  import importlib.util

  def missing(name: str) -> bool:
    try:
      return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:  # the parent package is missing too
      return True

  absent = [name for name in TRAIN_EXTRA if missing(name)]
  if absent:
    raise SystemExit(f"{prog}: needs the 'train' extra (missing {', '.join(absent)}): "
                     f"pip install 'dlgs_jax[train]'")


def main(argv=None) -> int:
  config = config_from_args(argv)
  check_train_extra()
  run(config)
  return 0


if __name__ == "__main__":
  sys.exit(main())
