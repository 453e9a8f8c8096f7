"""A training run described as data: immutable configs that build the run's parts.

`RunConfig` holds one section per concern (model, data, method, optimizer,
schedule, planning, processes, checkpoints). It is what ``dlgs-train``'s flags
turn into, what a config file holds (JSON: data, never code), and what is
written to the workdir as ``config.json``; a program builds one in Python:

    config = RunConfig(model=ModelConfig("resnet20"),
                       method=method_config("dlgs-paper", density=0.01))
    config = config.replace(schedule=ScheduleConfig(epochs=4))
    train(config)   # dlgs_jax.training.loop
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import typing
from pathlib import Path
from typing import Any, Optional

from dlgs_jax.compress.methods import AUTO, ConfigError, MethodConfig
from dlgs_jax.compress.optimizer import OptimizerConfig
from dlgs_jax.planning import planner
from dlgs_jax.training.distributed import INIT_TIMEOUT

# "none": no planner (dense fuses everything into one message, LAGS/DLGS one per leaf).
PLANNERS = ("none",) + planner.PLANNERS
DATASETS = ("auto", "cifar10", "imagefolder", "synthetic")
CIFAR_MODELS = ("smallcnn", "resnet20", "vgg16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """name: smallcnn, resnet20, vgg16 or resnet50; sync_bn: BatchNorm statistics synchronised."""
  name: str = "resnet20"
  sync_bn: bool = False


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """The dataset and how it is batched.

  Attributes:
    dataset: auto (CIFAR models: cifar10; resnet50: imagefolder), cifar10,
      imagefolder or synthetic.
    data_dir: CIFAR-10's cifar-10-batches-bin/ or -py/, or an image folder
      with train/ and val/; None for CIFAR: the real subset embedded in the
      package.
    image_size: input side (imagefolder/synthetic); None: the model's.
    synthetic_examples: training examples with synthetic data.
    batch_size: examples per worker per step.
    eval_batch_size: examples per evaluation batch.
    augment: random crop and flip.
  """
  dataset: str = "auto"
  data_dir: Optional[str] = None
  image_size: Optional[int] = None
  synthetic_examples: int = 2048
  batch_size: int = 32
  eval_batch_size: int = 500
  augment: bool = True

  def kind(self, model: str) -> str:
    """The dataset `auto` resolves to for `model`."""
    if self.dataset != "auto":
      return self.dataset
    return "cifar10" if model in CIFAR_MODELS else "imagefolder"


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """How long the run is and when the learning rate drops.

  Attributes:
    epochs: epochs in all.
    steps: steps in all (None: every epoch).
    lr_decay_epochs: epochs after which lr is divided by 10; None: after 4/7
      and 6/7 of the steps (the paper's 80 and 120 of 140 epochs).
  """
  epochs: int = 2
  steps: Optional[int] = None
  lr_decay_epochs: Optional[tuple[float, ...]] = None

  def __post_init__(self):
    if self.lr_decay_epochs is not None:
      object.__setattr__(self, "lr_decay_epochs", tuple(self.lr_decay_epochs))

  def total_steps(self, steps_per_epoch: int) -> int:
    return self.epochs * steps_per_epoch if self.steps is None else self.steps

  def decay_boundaries(self, steps_per_epoch: int, total_steps: int) -> list[int]:
    """Steps after which the learning rate is divided by 10 (those inside the run)."""
    if self.lr_decay_epochs is not None:
      steps = sorted(int(round(e * steps_per_epoch)) for e in self.lr_decay_epochs)
    else:
      steps = [int(round(total_steps * 4 / 7)), int(round(total_steps * 6 / 7))]
    return [b for b in steps if 0 < b < total_steps]


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """Layer merging for the methods that take groups (dense, LAGS, DLGS).

  Attributes:
    planner: none, wfbp, single, greedy or optimal; none: dense fuses
      everything into one message, LAGS and DLGS's layer budget send each
      leaf alone, DLGS's message budget the transform's buckets.
    plan: a plan JSON (from ``dlgs-plan``) instead of planning.
    profile: plan from this profile JSON instead of measuring one.
    bandwidth: plan for a modelled network of this link bandwidth (e.g. 1gbit).
    latency: per-step latency with ``bandwidth``, seconds.
  """
  planner: str = "none"
  plan: Optional[str] = None
  profile: Optional[str] = None
  bandwidth: Optional[str] = None
  latency: float = 25e-6


# The mesh of a run with sliced parameters (`ProcessConfig.fsdp`): nodes, then a node's devices.
SLICED_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
  """Processes and devices (`jax.distributed`); None: from the environment.

  Attributes:
    workers: use the first N devices of all processes (None: all).
    coordinator: host:port of process 0.
    num_processes: process count.
    process_id: this process's id.
    local_devices: simulated CPU devices in this process (CPU only).
    flat: one data axis over every device. By default several processes
      (nodes) of several devices each run the two-level exchange: dense inside
      a process, the method between processes (`compress.hierarchical`).
    node_size: devices per node of the two-level exchange (consecutive
      processes' devices form a node, e.g. one process per GPU); None: each
      process is a node. 1, or every device in one node, runs flat.
    init_timeout: multi-process: seconds to wait for every process to join.
    simulate_workers: run this many workers on one device under ``jax.vmap``
      (one process; `sharded_step.data_parallel`), with the numerics and
      checkpoints of as many devices; None: one worker per device.
    fsdp: slice the model over this many consecutive devices (a node; HSDP,
      `workload.fsdp`): each holds 1/fsdp of the parameters, the optimizer's
      state and the residuals, and the method runs between nodes on the
      slices. None: every device holds the whole model.
  """
  workers: Optional[int] = None
  coordinator: Optional[str] = None
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  local_devices: Optional[int] = None
  flat: bool = False
  node_size: Optional[int] = None
  init_timeout: int = INIT_TIMEOUT
  simulate_workers: Optional[int] = None
  fsdp: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Where the run writes, and when it saves and checks itself.

  Attributes:
    workdir: metrics, summary, plan, config and checkpoints go here.
    resume: continue from the latest checkpoint in workdir.
    checkpoint_every: save every N steps (0: at the end of every epoch).
    keep: checkpoints kept.
    stop_after: leave after this many steps of this run with a checkpoint
      (time-limited jobs); 0: run to the end.
    check_every: verify every N steps that all workers hold identical
      parameters (0: only at the start and end).
    nonfinite_limit: stop the run when the loss has been non-finite this many
      steps in a row (no checkpoint is saved while it is non-finite).
  """
  workdir: str = "runs/train"
  resume: bool = False
  checkpoint_every: int = 0
  keep: int = 3
  stop_after: int = 0
  check_every: int = 100
  nonfinite_limit: int = 20


# Options that change neither what a checkpoint's arrays mean nor what the run
# computes: a run may resume with them changed. (The workers, the exchange, the
# plan's groups and the dataset are compared by what they resolve to, not by how
# they were given.)
FREE_OPTIONS = frozenset({
    "checkpoint.workdir", "checkpoint.resume", "checkpoint.checkpoint_every",
    "checkpoint.keep", "checkpoint.stop_after", "checkpoint.check_every",
    "checkpoint.nonfinite_limit",
    "processes.workers", "processes.coordinator", "processes.num_processes",
    "processes.process_id", "processes.local_devices", "processes.flat", "processes.node_size",
    "processes.init_timeout", "processes.simulate_workers", "processes.fsdp",
    "data.eval_batch_size",
    "data.data_dir", "plan.planner", "plan.plan", "plan.profile", "plan.bandwidth",
    "plan.latency"})

# Options a checkpoint written before they existed does not name, and the value
# that checkpoint ran with: DLGS selected a threshold per layer before its
# budget was an option, and aimed at 0.9 k before its aim was.
ADDED_OPTIONS = {"method.budget": "layer", "method.aim": 0.9}

SECTIONS = {"model": ModelConfig, "data": DataConfig, "method": MethodConfig,
            "optimizer": OptimizerConfig, "schedule": ScheduleConfig, "plan": PlanConfig,
            "processes": ProcessConfig, "checkpoint": CheckpointConfig}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything one training run needs; immutable (change it with `replace`)."""
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  method: MethodConfig = MethodConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  schedule: ScheduleConfig = ScheduleConfig()
  plan: PlanConfig = PlanConfig()
  processes: ProcessConfig = ProcessConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  seed: int = 0

  def replace(self, **changes) -> "RunConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
    """The config a `to_dict` (or a hand-written subset of it) describes.

    Raises:
      ConfigError: naming an unknown section or option.
    """
    kwargs = {}
    for key, value in data.items():
      if key == "seed":
        kwargs["seed"] = value
      elif key in SECTIONS:
        section = SECTIONS[key]
        if not isinstance(value, dict):
          raise ConfigError(key, value, f"a section is an object of options, e.g. "
                            f"{{\"{key}\": {{\"{dataclasses.fields(section)[0].name}\": ...}}}}")
        known = {f.name for f in dataclasses.fields(section)}
        unknown = sorted(set(value) - known)
        if unknown:
          near = {u: difflib.get_close_matches(u, known, n=1) for u in unknown}
          hint = "".join(f" ({u!r}: did you mean {m[0]!r}?)" for u, m in near.items() if m)
          raise ConfigError(f"{key}", unknown,
                            f"unknown options{hint}; {key} takes {sorted(known)}")
        kwargs[key] = section(**_typed_options(key, section, value))
      else:
        raise ConfigError("config", key, f"unknown section; sections: {sorted(SECTIONS)}, seed")
    return cls(**kwargs)

  def identity(self) -> dict[str, Any]:
    """Every option that a resumed run must share with its checkpoint, as
    ``{"section.option": value}`` (`FREE_OPTIONS` left out)."""
    flat = {"seed": self.seed}
    for section in SECTIONS:
      for key, value in dataclasses.asdict(getattr(self, section)).items():
        flat[f"{section}.{key}"] = list(value) if isinstance(value, tuple) else value
    taken = {f"method.{name}" for name in ("name",) + self.method.spec.options}
    return {k: v for k, v in flat.items()
            if k not in FREE_OPTIONS and (not k.startswith("method.") or k in taken)}

  def validate(self) -> "RunConfig":
    """Raises `ConfigError` naming the first bad value, before any work starts."""
    self.method.validate()
    self.optimizer.validate()
    _validate_run(self)
    check_used(self)
    return self


def _typed_options(section: str, cls, values: dict) -> dict:
  """`values` checked against `cls`'s field types (JSON lists become tuples).

  A config file is read as data: a string where a list belongs would split into
  characters, a number in quotes compare unequal to every number.

  Raises:
    ConfigError: naming the option, its value and the type it needs.
  """
  hints = typing.get_type_hints(cls)
  out = {}
  for option, value in values.items():
    hint = hints[option]
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
      hint = next(a for a in args if a is not type(None))
    if value is None and optional:
      out[option] = value
      continue
    origin = typing.get_origin(hint)
    if origin is tuple:
      item = typing.get_args(hint)[0]
      if not isinstance(value, (list, tuple)) or not all(_is_a(v, item) for v in value):
        raise ConfigError(f"{section}.{option}", value,
                          f"must be a list of {_KIND_NAMES[item].split()[-1]}s, e.g. "
                          f"{_example(item)}")
      out[option] = tuple(value)
    elif not _is_a(value, hint):
      raise ConfigError(f"{section}.{option}", value,
                        f"must be {'null or ' if optional else ''}{_KIND_NAMES[hint]}")
    else:
      out[option] = value
  return out


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is_a(value, kind) -> bool:
  if kind is bool:
    return isinstance(value, bool)
  if kind is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if kind is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  return isinstance(value, kind)


def _example(kind) -> str:
  return '["head"]' if kind is str else "[80, 120]"


# Step counts, seeds and sizes live in int32 on the devices.
INT32_MAX = 2**31 - 1


def _check_int(option: str, value, low: int, high: int = INT32_MAX) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
    raise ConfigError(option, value, f"must be an integer in [{low}, {high}]")


def _validate_counts(config: RunConfig) -> None:
  data, schedule, ckpt, processes = (config.data, config.schedule, config.checkpoint,
                                     config.processes)
  for option, value, low in (("epochs", schedule.epochs, 1), ("batch_size", data.batch_size, 1),
                             ("keep", ckpt.keep, 1),
                             ("checkpoint_every", ckpt.checkpoint_every, 0),
                             ("stop_after", ckpt.stop_after, 0),
                             ("check_every", ckpt.check_every, 0),
                             ("nonfinite_limit", ckpt.nonfinite_limit, 1),
                             ("eval_batch_size", data.eval_batch_size, 1),
                             ("synthetic_examples", data.synthetic_examples, 1),
                             ("seed", config.seed, 0)):
    _check_int(option, value, low)
  for option, value, low in (("steps", schedule.steps, 1), ("image_size", data.image_size, 8),
                             ("workers", processes.workers, 1),
                             ("num_processes", processes.num_processes, 1),
                             ("process_id", processes.process_id, 0),
                             ("node_size", processes.node_size, 1),
                             ("simulate_workers", processes.simulate_workers, 1),
                             ("fsdp", processes.fsdp, 1)):
    if value is not None:
      _check_int(option, value, low)
  _check_int("init_timeout", processes.init_timeout, 1)
  if processes.local_devices is not None:
    _check_int("local_devices", processes.local_devices, 1, 1024)
  _check_int("reuse_every", config.method.reuse_every, 1)


def _check_simulated_alone(config: RunConfig) -> None:
  """Refuses settings that place workers on devices or processes beside simulated workers."""
  processes = config.processes
  if processes.simulate_workers is None:
    return
  clashes = [f"{name} {value}" for name, value in (
      ("workers", processes.workers), ("node_size", processes.node_size),
      ("num_processes", processes.num_processes if processes.num_processes != 1 else None),
      ("coordinator", processes.coordinator)) if value is not None]
  if clashes:
    raise ConfigError("simulate_workers", processes.simulate_workers,
                      f"runs every worker on one device of one process: drop {clashes[0]}, "
                      f"or drop simulate_workers to use devices and processes as workers")
  if config.plan.planner != "none" and not config.plan.plan:
    raise ConfigError("simulate_workers", processes.simulate_workers,
                      f"has no network the planner {config.plan.planner!r} could measure or "
                      f"profile on one device: give a plan file (dlgs-plan), or planner none")


def _validate_schedule_and_plan(config: RunConfig) -> None:
  from dlgs_jax.planning.network import check_link

  plan, schedule = config.plan, config.schedule
  if schedule.lr_decay_epochs is not None and not all(
      isinstance(e, (int, float)) and math.isfinite(e) and e >= 0
      for e in schedule.lr_decay_epochs):
    raise ConfigError("lr_decay_epochs", ",".join(map(str, schedule.lr_decay_epochs)),
                      "give epochs >= 0")
  check_link(plan.bandwidth, plan.latency)
  data_dir = config.data.data_dir
  if data_dir is not None and Path(data_dir).exists() and not Path(data_dir).is_dir():
    raise ConfigError("data_dir", data_dir, "is a file, not a directory: give the folder that "
                      "holds the data set (for CIFAR-10, cifar-10-batches-bin/ or its parent)")
  for option, path in (("plan", plan.plan), ("profile", plan.profile)):
    if path is not None and not Path(path).is_file():
      raise ConfigError(option, path, "no such file")


def _validate_run(config: RunConfig) -> None:
  plan, data = config.plan, config.data
  if plan.planner not in PLANNERS:
    raise ConfigError("planner", plan.planner, f"choose from {PLANNERS}")
  if data.dataset not in DATASETS:
    raise ConfigError("dataset", data.dataset, "choose auto, cifar10, imagefolder or synthetic")
  _validate_counts(config)
  _check_simulated_alone(config)
  _validate_schedule_and_plan(config)
  method = config.method
  if not method.spec.takes_groups and (plan.planner != "none" or plan.plan):
    raise ConfigError("planner/--plan", plan.plan or plan.planner,
                      f"planning applies to dense, lags and dlgs, not {method.name}")
  if plan.plan and plan.planner != "none":
    raise ConfigError("plan", plan.plan, "give either --plan or --planner, not both")
  if config.processes.flat and config.processes.node_size is not None:
    raise ConfigError("node_size", config.processes.node_size,
                      "a flat exchange has no nodes: give either --flat or --node-size")
  _check_sliced(config)


def _check_sliced(config: RunConfig) -> None:
  """Refuses settings that sliced parameters (`fsdp`) cannot take."""
  processes, plan = config.processes, config.plan
  if processes.fsdp is None:
    return
  clashes = [f"--{name.replace('_', '-')}" for name, given in (
      ("flat", processes.flat), ("node_size", processes.node_size is not None),
      ("simulate_workers", processes.simulate_workers is not None),
      ("workers", processes.workers is not None)) if given]
  if clashes:
    raise ConfigError("fsdp", processes.fsdp, f"slices the model over the devices of a node, "
                      f"its nodes every fsdp consecutive devices of the run: drop {clashes[0]}")
  if plan.planner != "none" or plan.plan:
    raise ConfigError("fsdp", processes.fsdp, "runs each leaf's slice as its own message "
                      "(the planner groups whole leaves): give --planner none and no --plan")


# Planning options that only a planner reads.
PLANNER_OPTIONS = ("profile", "bandwidth", "latency")
# The option a sweep over methods shares: dense and TernGrad send everything whatever
# it says, and refusing it would break every loop over methods at one density.
SHARED_OPTIONS = ("density",)


def check_used(config: RunConfig, given: Optional[dict[str, Any]] = None) -> None:
  """Refuses an option the run would ignore: one its method does not take, or a planner's
  option without a planner.

  Args:
    config: the run.
    given: ``{section: {option: value}}`` set explicitly (command-line flags),
      refused even at their default; None: the options that differ from
      their defaults are checked.

  Raises:
    ConfigError: naming the first such option and what it applies to.
  """
  from dlgs_jax.compress.methods import METHODS

  def set_in(section: str, defaults) -> list[str]:
    if given is not None:
      return list(given.get(section, {}))
    values = getattr(config, section)
    return [f.name for f in dataclasses.fields(values)
            if getattr(values, f.name) != getattr(defaults, f.name)]

  method = config.method
  for option in set_in("method", MethodConfig()):
    if option not in ("name",) + SHARED_OPTIONS and option not in method.spec.options:
      takers = [name for name, m in METHODS.items() if option in m.options]
      raise ConfigError(option, getattr(method, option),
                        f"applies to {', '.join(takers)}, not {method.name}; the run would "
                        f"ignore it")
  plan = config.plan
  auto = method.collective == AUTO
  if auto and plan.bandwidth is None:
    raise ConfigError("collective", AUTO, "prices the exchanges on a modelled network: give "
                      "--bandwidth (and --latency) for the links between workers")
  if plan.planner == "none":
    for option in set_in("plan", PlanConfig()):
      # The network model is read by the collective's choice too.
      if option in PLANNER_OPTIONS and not (auto and option in ("bandwidth", "latency")):
        raise ConfigError(option, getattr(plan, option),
                          f"is read by a planner only: give --planner (one of "
                          f"{PLANNERS[1:]}), or drop it")
  elif "latency" in set_in("plan", PlanConfig()) and plan.bandwidth is None:
    raise ConfigError("latency", plan.latency, "models a network with --bandwidth: give both")


def load_config(path: str) -> RunConfig:
  """A JSON config file (`RunConfig.to_dict`'s layout, any subset).

  An input file is data: a Python file is refused, not run.

  Raises:
    ConfigError: for a file that cannot be read or holds no valid config.
  """
  file = Path(path)
  if not file.is_file():
    raise ConfigError("config", path, "no such file")
  if file.suffix == ".py":
    raise ConfigError("config", path, "a config file is JSON and a Python file would run "
                      "code: build the RunConfig in your program and call "
                      "dlgs_jax.training.loop.train(config)")
  try:
    data = json.loads(file.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError("config", path, f"not JSON ({e})") from None
  if not isinstance(data, dict):
    raise ConfigError("config", path, "a JSON config is an object of sections")
  return RunConfig.from_dict(data)


def with_overrides(config: RunConfig, overrides: dict[str, dict[str, Any]]) -> RunConfig:
  """`config` with some options replaced: ``{"method": {"density": 0.1}, "seed": {"seed": 1}}``."""
  changes = {}
  for section, values in overrides.items():
    if section == "seed":
      changes["seed"] = values["seed"]
    else:
      changes[section] = dataclasses.replace(getattr(config, section), **values)
  return config.replace(**changes)
