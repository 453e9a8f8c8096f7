"""A run: what `train` builds from a `RunConfig` before its first step.

`build_run` loads the data, makes the mesh, model, plan, optimizer and train step;
`run_identity` is what a checkpoint of the run must match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

from dlgs_jax.compress.optimizer import build_optimizer
from dlgs_jax.training.config import CIFAR_MODELS, INT32_MAX, SLICED_AXES, RunConfig
from dlgs_jax.training.plans import backward_order_of, make_or_load_plan, resolve_collective


class RunError(Exception):
  """A run that cannot start or continue as configured (the message says why)."""


# Drops are padded to a multiple of this, so that a run and the same run extended
# by a drop or two compile one program: XLA fuses a schedule of more or fewer
# scalar ops differently, which rounds the first steps' updates differently.
_DROP_SLOTS = 8


def step_decay(lr: float, boundaries, factor: float = 0.1) -> Callable:
  """The learning rate `lr`, multiplied by `factor` at each of `boundaries` (steps).

  The values are optax's `piecewise_constant_schedule`'s, bit for bit (each drop
  multiplies the previous float32 value); the program is one table look-up whose
  shape depends on the number of drops only past each `_DROP_SLOTS`.

  Args:
    lr: the learning rate before the first drop.
    boundaries: increasing steps; from each one on, the rate is `factor` times lower.
    factor: the multiplier at each drop.

  Returns:
    A schedule: step count -> float32 learning rate.
  """
  import jax.numpy as jnp
  import numpy as np

  values = [np.float32(lr)]
  for _ in boundaries:
    values.append(np.float32(factor) * values[-1])
  slots = max(_DROP_SLOTS, -(-len(boundaries) // _DROP_SLOTS) * _DROP_SLOTS)
  steps = np.full(slots, INT32_MAX, np.int32)
  steps[:len(boundaries)] = boundaries
  values = np.array(values + [values[-1]] * (slots - len(boundaries)), np.float32)

  def schedule(count):
    return jnp.asarray(values)[jnp.sum(jnp.asarray(count) >= steps)]

  return schedule


def load_data(config: RunConfig, model_shape):
  """(train set, test set, dataset name, crop padding) of the run's data section.

  A data directory is named by its resolved path, so that a run resumed from another
  working directory, or through a symlink, finds its checkpoints' dataset.
  """
  from dlgs_jax.workload import data

  settings, model_name = config.data, config.model.name
  kind = settings.kind(model_name)
  if kind == "cifar10":
    if settings.data_dir:
      train, test = data.load_cifar10(settings.data_dir)
      return train, test, f"cifar10:{os.path.realpath(settings.data_dir)}", 4
    train, test = data.load_embedded_cifar10()
    return train, test, "cifar10:embedded", 4
  size = settings.image_size or model_shape[0]
  if kind == "imagefolder":
    if not settings.data_dir:
      raise RunError(f"{model_name} needs --data-dir (an image folder with train/ and val/), "
                     "or --dataset synthetic")
    train, test = data.load_image_folder(settings.data_dir, size)
    return train, test, f"imagefolder:{os.path.realpath(settings.data_dir)}", max(1, size // 8)
  shape = (size, size, model_shape[2])
  classes = 10 if model_name in CIFAR_MODELS else 1000
  train = data.synthetic(settings.synthetic_examples, shape, classes, seed=config.seed)
  test = data.synthetic(max(settings.eval_batch_size, 256), shape, classes, seed=config.seed + 1)
  return train, test, f"synthetic:{settings.synthetic_examples}x{shape}", max(1, size // 8)


def dgc_warmup_steps(config: RunConfig, steps_per_epoch: int, total_steps: int) -> int:
  """DGC's density warm-up in steps, capped at a quarter of the run (0 for other methods)."""
  if not config.method.spec.holds_momentum:
    return 0
  return min(int(round(config.method.dgc_warmup_epochs * steps_per_epoch)), total_steps // 4)


@dataclasses.dataclass
class Run:
  """Everything `train` builds before the first step."""
  config: RunConfig
  workdir: Path
  train_set: Any
  test_set: Any
  dataset_name: str
  mesh: Any
  workers: int
  local_workers: list
  steps_per_epoch: int
  total_steps: int
  epochs: int
  schedule: Callable
  plan: Any
  order: list
  warmup: int
  state: Any
  step_fn: Callable
  evaluate: Callable
  fingerprint: Callable
  # Devices per node (None: flat) -> this run's optimizer for that exchange: what
  # a checkpoint of another exchange was written with (`resume`).
  optimizer_for: Callable
  leader: bool
  dense_bytes: int = 0

  def log(self, message: str) -> None:
    if self.leader:
      print(message, flush=True)


def _mesh_and_data(config: RunConfig):
  import jax

  from dlgs_jax.workload import models, parallel

  try:
    _, model_shape = models.create_model(config.model.name)
  except ValueError as e:
    raise RunError(f"--model: {e}") from None
  try:
    train_set, test_set, dataset_name, pad = load_data(config, model_shape)
  except ValueError as e:
    raise RunError(f"data: {e}") from None
  node_size, note = node_size_of(config)
  simulated = config.processes.simulate_workers
  if simulated is not None and jax.process_count() > 1:
    raise RunError(f"--simulate-workers {simulated}: runs every worker in one process, this run "
                   f"has {jax.process_count()}: start one process, or drop --simulate-workers")
  sliced = config.processes.fsdp
  try:
    mesh = (parallel.node_mesh(sliced, axis_names=SLICED_AXES) if sliced is not None
            else parallel.node_mesh(node_size) if node_size is not None
            else parallel.data_mesh(1 if simulated else config.processes.workers))
  except ValueError as e:
    option = ("--fsdp" if sliced is not None else "--node-size"
              if config.processes.node_size is not None else "--workers")
    raise RunError(f"{option}: {e}") from None
  return train_set, test_set, dataset_name, pad, mesh, note


def node_size_of(config: RunConfig) -> tuple[Optional[int], Optional[str]]:
  """Devices per node of the two-level exchange (None: flat), and why it runs flat if it does.

  The exchange is two-level when the nodes are given (`--node-size`), or when
  several processes of several devices each are all used (each process a node).

  Raises:
    RunError: for `--node-size` with `--workers` less than every device.
  """
  import jax

  processes, local = jax.process_count(), jax.local_device_count()
  total, given = processes * local, config.processes.node_size
  every_device = config.processes.workers in (None, total)
  if (config.processes.flat or config.processes.simulate_workers is not None
      or config.processes.fsdp is not None):
    return None, None
  if given is None:
    return (local if processes > 1 and local > 1 and every_device else None), None
  if not every_device:
    raise RunError(f"--node-size {given}: the two-level exchange uses every device "
                   f"({total}), not --workers {config.processes.workers}")
  if given == 1:
    return None, "--node-size 1: one device per node, so the exchange is flat"
  if given == total:
    return None, (f"--node-size {given}: every device is in one node, nothing crosses a "
                  f"slow link, so the exchange is flat")
  return given, None


def build_run(config: RunConfig) -> Run:
  """The run `config` describes, at step 0 (nothing restored yet)."""
  import jax
  import numpy as np

  from dlgs_jax import training
  from dlgs_jax.compress import grouping
  from dlgs_jax.workload import data, losses, models, parallel

  train_set, test_set, dataset_name, pad, mesh, note = _mesh_and_data(config)
  sliced = tuple(mesh.axis_names) == SLICED_AXES
  two_level = len(mesh.axis_names) == 2 and not sliced
  simulated = config.processes.simulate_workers
  axis, workers = parallel.data_axes(mesh), simulated or int(mesh.devices.size)
  leader = jax.process_index() == 0
  log = (lambda m: print(m, flush=True)) if leader else (lambda m: None)
  config = resolve_collective(config, mesh, workers, train_set.num_classes, log)
  model, _ = models.create_model(config.model.name, num_classes=train_set.num_classes,
                                 bn_axis_name=axis if config.model.sync_bn else None)
  try:
    spe = data.steps_per_epoch(len(train_set.labels), workers, config.data.batch_size)
  except ValueError as e:
    raise RunError(f"--batch-size {config.data.batch_size}: {e}") from None
  total_steps = config.schedule.total_steps(spe)
  if total_steps > INT32_MAX:
    raise RunError(f"{total_steps} steps in all ({config.schedule.epochs} epochs x {spe}) do "
                   f"not fit the int32 step counter: give fewer --epochs or --steps")
  schedule = step_decay(config.optimizer.lr, config.schedule.decay_boundaries(spe, total_steps))
  sample = np.zeros((1,) + train_set.image_shape, np.uint8)
  variables = losses.init_variables(model, sample, config.seed)
  # Traced outside shard_map, so without the SyncBN axis (same parameters).
  order = backward_order_of(model.clone(bn_axis_name=None), variables["params"],
                            variables.get("batch_stats", {}), sample.shape)
  if note:
    log(note)
  plan = make_or_load_plan(config, mesh, grouping.leaf_paths(variables["params"]), workers, log)
  warmup = dgc_warmup_steps(config, spe, total_steps)

  def optimizer_for(fast_size):
    return build_optimizer(config.method, config.optimizer,
                           axis_name=("node", "local") if fast_size else "data",
                           schedule=schedule, groups=plan.groups if plan is not None else None,
                           order=order, seed=config.seed, warmup_steps=warmup,
                           fast_size=fast_size)

  tx = optimizer_for(parallel.devices_per_node(mesh) if two_level else None)
  return Run(
      config=config, workdir=Path(config.checkpoint.workdir), train_set=train_set,
      test_set=test_set, dataset_name=dataset_name, mesh=mesh, workers=workers,
      local_workers=(list(range(workers)) if simulated else
                     [i for i, d in enumerate(mesh.devices.flat)
                      if d.process_index == jax.process_index()]),
      steps_per_epoch=spe, total_steps=total_steps, epochs=math.ceil(total_steps / spe),
      schedule=schedule, plan=plan, order=order, warmup=warmup,
      state=training.train_state_from_variables(variables, tx, mesh, simulated,
                                                fsdp_axis=SLICED_AXES[1] if sliced else None),
      step_fn=training.make_train_step(model, tx, mesh, augment=config.data.augment, pad=pad,
                                       mean=train_set.mean, std=train_set.std, seed=config.seed,
                                       simulate_workers=simulated,
                                       fsdp_axis=SLICED_AXES[1] if sliced else None),
      evaluate=training.make_eval_fn(model, train_set.mean, train_set.std),
      fingerprint=training.make_fingerprint_fn(mesh, SLICED_AXES[1] if sliced else None),
      leader=leader,
      optimizer_for=optimizer_for)


def run_identity(run: Run) -> dict:
  """What a checkpoint of this run must match: the config's identity and what it resolved to."""
  from dlgs_jax.compress import state as states
  from dlgs_jax.training.persistence import reshard
  from dlgs_jax.workload import data

  config, method, plan = run.config, run.config.method, run.plan
  identity = config.identity()
  identity.update({
      "workers": run.workers,
      "exchange": reshard.exchange_name(run.mesh),
      "send_whole": method.whole_paths(run.order) if method.spec.layer_wise else None,
      "dgc_warmup_steps": run.warmup if method.spec.holds_momentum else None,
      "plan_id": (hashlib.sha256(json.dumps(plan.groups).encode()).hexdigest()[:16]
                  if plan is not None else f"default:{config.plan.planner}"),
      # The data by its kind and content, not its path: a copy elsewhere resumes,
      # other files at the same path do not.
      "dataset": run.dataset_name.split(":")[0], "data_sha256": data.content_digest(run.train_set),
      "num_examples": int(len(run.train_set.labels)),
      "image_shape": list(run.train_set.image_shape), "num_classes": run.train_set.num_classes,
      "total_steps": run.total_steps,
      "state_layout": states.LAYOUT,
  })
  return identity
