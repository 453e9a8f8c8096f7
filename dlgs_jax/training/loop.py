"""The train loop: a `RunConfig` in, a trained, checkpointed and summarised run out.

`train` builds the run (data, mesh, model, plan, optimizer, train step),
restores the latest checkpoint when asked, trains epoch by epoch with a progress
bar, evaluates after each epoch, checks that every worker holds identical
parameters every ``check_every`` steps, and writes ``config.json``,
``metrics.jsonl``, ``summary.json`` and ``checkpoints/`` to the workdir.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from dlgs_jax.compress.methods import ConfigError
from dlgs_jax.compress.optimizer import build_optimizer
from dlgs_jax.training.config import CIFAR_MODELS, INT32_MAX, RunConfig
from dlgs_jax.training.metrics import MetricsLog, tree_sha256
from dlgs_jax.training.plans import PlanError, backward_order_of, make_or_load_plan
from dlgs_jax.training.preemption import PreemptionWatch


class RunError(Exception):
  """A run that cannot start or continue as configured (the message says why)."""


def load_data(config: RunConfig, model_shape):
  """(train set, test set, dataset name, crop padding) of the run's data section."""
  from dlgs_jax.workload import data

  settings, model_name = config.data, config.model.name
  kind = settings.kind(model_name)
  if kind == "cifar10":
    if settings.data_dir:
      train, test = data.load_cifar10(settings.data_dir)
      return train, test, f"cifar10:{os.path.abspath(settings.data_dir)}", 4
    train, test = data.load_embedded_cifar10()
    return train, test, "cifar10:embedded", 4
  size = settings.image_size or model_shape[0]
  if kind == "imagefolder":
    if not settings.data_dir:
      raise RunError(f"{model_name} needs --data-dir (an image folder with train/ and val/), "
                     "or --dataset synthetic")
    train, test = data.load_image_folder(settings.data_dir, size)
    return train, test, f"imagefolder:{os.path.abspath(settings.data_dir)}", max(1, size // 8)
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
  leader: bool
  dense_bytes: int = 0

  def log(self, message: str) -> None:
    if self.leader:
      print(message, flush=True)


def _mesh_and_data(config: RunConfig):
  from dlgs_jax.workload import models, parallel

  try:
    _, model_shape = models.create_model(config.model.name)
  except ValueError as e:
    raise RunError(f"--model: {e}") from None
  try:
    train_set, test_set, dataset_name, pad = load_data(config, model_shape)
  except ValueError as e:
    raise RunError(f"data: {e}") from None
  try:
    mesh = parallel.data_mesh(config.processes.workers)
  except ValueError as e:
    raise RunError(f"--workers: {e}") from None
  return train_set, test_set, dataset_name, pad, mesh


def build_run(config: RunConfig) -> Run:
  """The run `config` describes, at step 0 (nothing restored yet)."""
  import jax
  import numpy as np
  import optax

  from dlgs_jax import training
  from dlgs_jax.compress import grouping
  from dlgs_jax.workload import data, losses, models

  train_set, test_set, dataset_name, pad, mesh = _mesh_and_data(config)
  axis, workers = mesh.axis_names[0], int(mesh.devices.size)
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
  schedule = optax.piecewise_constant_schedule(config.optimizer.lr, {
      b: 0.1 for b in config.schedule.decay_boundaries(spe, total_steps) if 0 < b < total_steps})
  sample = np.zeros((1,) + train_set.image_shape, np.uint8)
  variables = losses.init_variables(model, sample, config.seed)
  # Traced outside shard_map, so without the SyncBN axis (same parameters).
  order = backward_order_of(model.clone(bn_axis_name=None), variables["params"],
                            variables.get("batch_stats", {}), sample.shape)
  leader = jax.process_index() == 0
  log = (lambda m: print(m, flush=True)) if leader else (lambda m: None)
  plan = make_or_load_plan(config, mesh, grouping.leaf_paths(variables["params"]), workers, log)
  warmup = dgc_warmup_steps(config, spe, total_steps)
  tx = build_optimizer(config.method, config.optimizer, axis_name=axis, schedule=schedule,
                       groups=plan.groups if plan is not None else None, order=order,
                       seed=config.seed, warmup_steps=warmup)
  return Run(
      config=config, workdir=Path(config.checkpoint.workdir), train_set=train_set,
      test_set=test_set, dataset_name=dataset_name, mesh=mesh, workers=workers,
      local_workers=[i for i, d in enumerate(mesh.devices.flat)
                     if d.process_index == jax.process_index()],
      steps_per_epoch=spe, total_steps=total_steps, epochs=math.ceil(total_steps / spe),
      schedule=schedule, plan=plan, order=order, warmup=warmup,
      state=training.train_state_from_variables(variables, tx, mesh),
      step_fn=training.make_train_step(model, tx, mesh, augment=config.data.augment, pad=pad,
                                       mean=train_set.mean, std=train_set.std, seed=config.seed),
      evaluate=training.make_eval_fn(model, train_set.mean, train_set.std),
      fingerprint=training.make_fingerprint_fn(mesh), leader=leader)


def run_identity(run: Run) -> dict:
  """What a checkpoint of this run must match: the config's identity and what it resolved to."""
  config, method, plan = run.config, run.config.method, run.plan
  identity = config.identity()
  identity.update({
      "workers": run.workers,
      "send_whole": method.whole_paths(run.order) if method.spec.layer_wise else None,
      "dgc_warmup_steps": run.warmup if method.spec.holds_momentum else None,
      "plan_id": (hashlib.sha256(json.dumps(plan.groups).encode()).hexdigest()[:16]
                  if plan is not None else f"default:{config.plan.planner}"),
      "dataset": run.dataset_name, "num_examples": int(len(run.train_set.labels)),
      "image_shape": list(run.train_set.image_shape), "num_classes": run.train_set.num_classes,
      "total_steps": run.total_steps,
  })
  return identity


def restore_or_start(run: Run, ckpt) -> int:
  """The step the run starts from: the latest checkpoint's with ``resume``, else 0.

  Raises:
    RunError: for a workdir holding checkpoints without ``resume``, or a
      checkpoint of another run.
  """
  from dlgs_jax.training import checkpoint

  directory = run.workdir / "checkpoints"
  if ckpt.latest_step() is None:
    if run.config.checkpoint.resume:
      run.log(f"--resume: no checkpoint in {directory}, starting from step 0")
    return 0
  if not run.config.checkpoint.resume:
    raise RunError(f"{directory} already holds checkpoints (latest step {ckpt.latest_step()}); "
                   "pass --resume to continue, or use another --workdir")
  try:
    try:
      run.state, record = ckpt.restore_latest_good(run.state)
    except checkpoint.CheckpointMismatch as e:
      if not set(e.differences) <= RESHARDABLE or "workers" not in e.differences:
        raise
      record = _restore_on_other_workers(run, ckpt, e.differences)
  except checkpoint.CheckpointMismatch as e:
    raise RunError(f"refusing to resume: {e}") from None
  except checkpoint.CheckpointCorrupt as e:
    raise RunError(str(e)) from None
  start = int(record["step"])
  run.log(f"resumed from step {start} (epoch {start // run.steps_per_epoch}, batch "
          f"{start % run.steps_per_epoch} of {run.steps_per_epoch})")
  return start


# What may differ when a run resumes on another number of workers: the count, and
# the steps an epoch-long schedule has with the new global batch.
RESHARDABLE = frozenset({"workers", "total_steps"})


def _restore_on_other_workers(run: Run, ckpt, differences: dict) -> dict:
  """Restores a checkpoint of another worker count onto this run's, residual mass kept."""
  import jax
  import numpy as np

  from dlgs_jax.training import reshard
  from dlgs_jax.workload import parallel

  def host(x, rows=None):
    shape = x.shape if rows is None else (rows,) + tuple(x.shape[1:])
    return np.zeros(shape, x.dtype)

  saved_workers = int(differences["workers"][0])
  state = run.state
  target = state._replace(
      params=jax.tree_util.tree_map(host, state.params),
      batch_stats=jax.tree_util.tree_map(host, state.batch_stats),
      opt_state=jax.tree_util.tree_map(lambda x: host(x, saved_workers), state.opt_state),
      step=host(state.step))
  restored, record = ckpt.restore_latest_good(target, allow=RESHARDABLE)
  row = reshard.redistribute(restored.opt_state, run.workers)
  run.state = state._replace(
      params=parallel.replicate(restored.params, run.mesh),
      batch_stats=parallel.replicate(restored.batch_stats, run.mesh),
      opt_state=parallel.stack_per_worker(row, run.mesh),
      step=parallel.replicate(restored.step, run.mesh))
  run.log(f"the checkpoint was written by {saved_workers} workers, this run has "
          f"{run.workers}: residuals redistributed with their sum kept"
          + (f"; the schedule now has {run.total_steps} steps (it had "
             f"{differences['total_steps'][0]})" if "total_steps" in differences else ""))
  return record


def train(config: RunConfig) -> dict:
  """Trains the run `config` describes; returns its summary (also in ``summary.json``).

  Raises:
    RunError: naming what stops the run before it starts (a workdir in use by
      another run, bad data, a checkpoint of another run, a plan for another
      model ...).
  """
  import jax

  from dlgs_jax.training.workdir import WorkdirBusy, lock_for_run

  config.validate()
  workdir = Path(config.checkpoint.workdir)
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    lock = lock_for_run(workdir, jax.process_index() == 0)
  except WorkdirBusy as e:
    raise RunError(str(e)) from None
  except OSError as e:
    raise RunError(f"--workdir {workdir}: {e.strerror or e}") from None
  try:
    return _train_locked(config, workdir)
  except Exception as e:
    failure = None if isinstance(e, RunError) else _write_failure(e)
    if failure is None:
      raise
    _remove_partial_checkpoints(workdir / "checkpoints")
    raise RunError(f"cannot write to {workdir}: {failure}; the last complete checkpoint "
                   "is kept") from None
  finally:
    if lock is not None:
      lock.release()


# What a failed write says, wherever it surfaces (orbax reports them as ValueError).
_WRITE_FAILURES = ("No space left on device", "Read-only file system", "Disk quota exceeded",
                   "Permission denied")


def _write_failure(error: Exception) -> Optional[str]:
  """The reason when `error` is a failed write to the disk, else None."""
  if isinstance(error, OSError):
    return error.strerror or str(error)
  return next((marker for marker in _WRITE_FAILURES if marker in str(error)), None)


def _remove_partial_checkpoints(directory: Path) -> None:
  """Deletes the temporary directories of checkpoints that were never completed."""
  import shutil

  if directory.is_dir():
    for entry in directory.iterdir():
      if "orbax-checkpoint-tmp" in entry.name:
        shutil.rmtree(entry, ignore_errors=True)


def _train_locked(config: RunConfig, workdir: Path) -> dict:
  from dlgs_jax.training import checkpoint, step

  try:
    run = build_run(config)
  except (PlanError, ConfigError) as e:
    raise RunError(str(e)) from None
  ckpt = checkpoint.Checkpointer(workdir / "checkpoints", run_identity(run),
                                 max_to_keep=config.checkpoint.keep,
                                 warn=lambda m: run.log(f"warning: {m}"))
  try:
    start = restore_or_start(run, ckpt)
  except RunError:
    ckpt.close()
    raise
  if run.leader:
    (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=1) + "\n")
    if run.plan is not None:
      run.plan.save(workdir / "plan.json")
  step.check_replicas_identical(run.fingerprint, run.state, start)
  _log_start(run)
  loop = _Loop(run, ckpt, start)
  try:
    with loop.watch:
      loop.run_epochs()
    loop.finish()
  except BaseException:
    loop.metrics_log.close()
    try:  # a failed background save raises again on close: the first error is the one
      ckpt.close()
    except Exception:
      pass
    raise
  loop.metrics_log.close()
  ckpt.close()
  return _summarize(run, loop)


def _log_start(run: Run) -> None:
  import jax

  from dlgs_jax.compress import wire

  config = run.config
  num_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(run.state.params))
  run.dense_bytes = wire.allreduce_bytes(num_params, run.workers)
  density = config.method.effective_density()
  run.log(f"{config.model.name} ({num_params:,} parameters), {run.dataset_name} "
          f"({len(run.train_set.labels):,} train / {len(run.test_set.labels):,} test), "
          f"{run.workers} workers ({jax.process_count()} processes) x batch "
          f"{config.data.batch_size}; {config.method.name}"
          + (f" density {density:g}" if density is not None else "")
          + (f" (warm-up {run.warmup} steps)" if run.warmup else "")
          + (f", {len(run.plan.groups)} planned groups ({run.plan.planner})" if run.plan else "")
          + f"; {run.epochs} epochs x {run.steps_per_epoch} steps = {run.total_steps} steps")


class _Loop:
  """The epochs of one run: steps, metrics, checkpoints, evaluations."""

  def __init__(self, run: Run, ckpt, start: int):
    self.run, self.ckpt, self.start = run, ckpt, start
    self.step = start
    self.history: list[dict] = []
    self.pending = None  # (step, metrics, epoch): resolved after the next step is dispatched
    self.last_done = time.perf_counter()
    self.started = time.perf_counter()
    self.result: Optional[dict] = None
    self.stopped = False  # by stop_after
    self.plan_json = run.plan.to_json() if run.plan is not None else None
    self.nonfinite = 0  # steps in a row whose loss was not finite
    self.watch = PreemptionWatch()
    self.metrics_log = MetricsLog(run.workdir / "metrics.jsonl", run.leader, start)

  def resolve(self, bar) -> None:
    """Records the pending step's metrics (read after the next step was dispatched)."""
    if self.pending is None:
      return
    run = self.run
    done_step, metrics, epoch = self.pending
    self.pending = None
    loss, accuracy = float(metrics["loss"]), float(metrics["accuracy"])
    now = time.perf_counter()
    step_time, self.last_done = now - self.last_done, now
    self.nonfinite = 0 if math.isfinite(loss) else self.nonfinite + 1
    if self.nonfinite:
      run.log(f"warning: non-finite loss at step {done_step}")
    limit = run.config.checkpoint.nonfinite_limit
    if self.nonfinite >= limit:
      latest = self.ckpt.latest_step()
      kept = (f"the last checkpoint (step {latest}) holds the state before" if latest is not None
              else "no checkpoint was saved")
      raise RunError(f"the loss has been non-finite for {limit} steps in a row (steps "
                     f"{done_step - limit + 1}-{done_step}); stopped without saving: {kept}. "
                     "Lower --lr, or check the data")
    record = {"step": done_step, "epoch": epoch, "loss": loss, "accuracy": accuracy,
              "lr": float(run.schedule(done_step - 1)), "step_time": step_time,
              "images_per_s": run.workers * run.config.data.batch_size / step_time}
    for key in ("bytes_sent", "selected", "skipped", "exact"):
      if key in metrics:
        record[key] = float(metrics[key])
    self.metrics_log.write(record)
    self.history.append(record)
    if bar is not None:
      bar.set_postfix(loss=f"{loss:.3f}", acc=f"{accuracy:.3f}",
                      img_s=f"{record['images_per_s']:.0f}", refresh=False)
      bar.update(1)

  def save(self, bar=None, force: bool = False) -> None:
    """Checkpoints the current step, unless its loss is not finite (checked first)."""
    self.resolve(bar)
    if self.nonfinite or not _all_finite(self.run.state.params):
      self.run.log(f"warning: no checkpoint at step {self.step}: the loss or the parameters "
                   "are not finite")
      return
    self.check_space()
    spe = self.run.steps_per_epoch
    position = {"epoch": self.step // spe, "batch": self.step % spe, "steps_per_epoch": spe}
    self.ckpt.save(self.step, self.run.state, data_position=position, plan_json=self.plan_json,
                   force=force)

  def check_space(self) -> None:
    """Raises `RunError` before a save that the disk cannot hold (every process agrees)."""
    import shutil

    import jax
    import numpy as np

    needed = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.run.state)) * 1.1 + 2**20
    free = shutil.disk_usage(self.ckpt.directory).free
    short = np.int32(free < needed)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      short = np.max(multihost_utils.process_allgather(short))
    if short:
      latest = self.ckpt.latest_step()
      raise RunError(f"not enough space to save step {self.step} in {self.ckpt.directory}: "
                     f"{needed / 1e6:.1f} MB needed, {free / 1e6:.1f} MB free; "
                     + (f"the last complete checkpoint (step {latest}) is kept" if latest
                        is not None else "no checkpoint was saved"))

  def run_epochs(self) -> None:
    run = self.run
    spe = run.steps_per_epoch
    for epoch in range(self.start // spe, run.epochs):
      steps_this_epoch = min(spe, run.total_steps - epoch * spe)
      self.train_epoch(epoch, steps_this_epoch)
      if self.stopped and self.step < epoch * spe + steps_this_epoch:
        break  # mid-epoch: its evaluation happens when the run resumes
      self.evaluate(epoch)
      if self.stopped:
        break

  def train_epoch(self, epoch: int, steps_this_epoch: int) -> None:
    from tqdm import tqdm

    from dlgs_jax.training import step as train_step
    from dlgs_jax.workload import data, parallel

    run, ckpt_settings = self.run, self.run.config.checkpoint
    spe = run.steps_per_epoch
    skip = self.start - epoch * spe if epoch == self.start // spe else 0
    batches = data.epoch_indices(len(run.train_set.labels), run.workers,
                                 run.config.data.batch_size, epoch, run.config.seed,
                                 run.local_workers)
    bar = tqdm(total=steps_this_epoch, initial=skip, desc=f"epoch {epoch + 1}/{run.epochs}",
               file=sys.stdout, leave=False, disable=None) if run.leader else None
    for batch_index, idx in enumerate(batches):
      if batch_index < skip:
        continue
      if batch_index >= steps_this_epoch:
        break
      images, labels = parallel.shard_batch(
          (run.train_set.images[idx], run.train_set.labels[idx]), run.mesh)
      run.state, metrics = run.step_fn(run.state, images, labels)
      self.step += 1
      self.resolve(bar)
      self.pending = (self.step, metrics, epoch)
      if self.watch.should_stop(self.step):
        self.stopped = True
        self.save(bar, force=True)
        break
      if ckpt_settings.check_every and self.step % ckpt_settings.check_every == 0:
        train_step.check_replicas_identical(run.fingerprint, run.state, self.step)
      end_of_epoch = batch_index + 1 == steps_this_epoch
      every = ckpt_settings.checkpoint_every
      if (every and self.step % every == 0) or (not every and end_of_epoch):
        self.save(bar)
      if ckpt_settings.stop_after and self.step - self.start >= ckpt_settings.stop_after:
        self.stopped = True
        break
    self.resolve(bar)
    if bar is not None:
      bar.close()

  def evaluate(self, epoch: int) -> None:
    import numpy as np

    from dlgs_jax.training import step as train_step

    run = self.run
    self.result = train_step.evaluate_dataset(run.evaluate, run.state.params,
                                              run.state.batch_stats, run.test_set,
                                              run.config.data.eval_batch_size)
    epoch_records = [r for r in self.history if r["epoch"] == epoch]
    record = {"step": self.step, "epoch": epoch, "event": "epoch_end", **self.result}
    if epoch_records:
      record.update(
          train_loss=float(np.mean([r["loss"] for r in epoch_records])),
          train_accuracy=float(np.mean([r["accuracy"] for r in epoch_records])),
          images_per_s=float(np.median([r["images_per_s"] for r in epoch_records])))
    self.metrics_log.write(record)
    run.log(f"epoch {epoch + 1:3d}/{run.epochs}  step {self.step}  "
            + (f"train loss {record['train_loss']:.4f}  train acc "
               f"{record['train_accuracy']:.3f}  {record['images_per_s']:.0f} img/s  "
               if epoch_records else "")
            + f"test loss {self.result['test_loss']:.4f}  "
              f"test acc {self.result['test_accuracy']:.3f}")

  def finish(self) -> None:
    from dlgs_jax.training import step as train_step

    train_step.check_replicas_identical(self.run.fingerprint, self.run.state, self.step)
    if self.ckpt.latest_step() != self.step:
      self.save(force=True)
    self.ckpt.wait()


@functools.cache
def _finite_fn():
  import jax
  import jax.numpy as jnp

  return jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))


def _all_finite(tree) -> bool:
  """Whether every value of `tree` is finite (one reduction on the devices)."""
  import jax
  import jax.numpy as jnp

  leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return bool(_finite_fn()(leaves)) if leaves else True


def _summarize(run: Run, loop: _Loop) -> dict:
  import jax
  import numpy as np

  from dlgs_jax.workload import parallel

  elapsed = time.perf_counter() - loop.started
  params_sha = tree_sha256(parallel.fetch((run.state.params, run.state.batch_stats)))
  opt_sha = tree_sha256(parallel.fetch(run.state.opt_state))
  # Every process reports its own copy, so runs can be compared across processes.
  print(f"process {jax.process_index()}: params_sha256 {params_sha} "
        f"local_opt_state_sha256 {opt_sha}", flush=True)
  history, batch = loop.history, run.config.data.batch_size
  times = [r["step_time"] for r in history[1:]] or [r["step_time"] for r in history]
  sent = [r["bytes_sent"] for r in history if "bytes_sent" in r]
  median = float(np.median(times)) if times else None
  summary = {
      "model": run.config.model.name, "method": run.config.method.name,
      "density": run.config.method.effective_density(),
      "workers": run.workers, "processes": jax.process_count(), "steps": loop.step,
      "steps_this_run": loop.step - loop.start, "seconds": elapsed,
      "median_step_time": median,
      "images_per_s": run.workers * batch / median if median else None,
      "bytes_sent_per_step": float(np.mean(sent)) if sent else None,
      "dense_bytes_per_step": run.dense_bytes,
      "final_test_loss": loop.result["test_loss"] if loop.result else None,
      "final_test_accuracy": loop.result["test_accuracy"] if loop.result else None,
      "plan_groups": len(run.plan.groups) if run.plan else None,
      "stopped_early": loop.stopped, "stopped_by": loop.watch.received,
      "params_sha256": params_sha, "opt_state_sha256_process0": opt_sha,
  }
  if run.leader and loop.stopped:
    why = loop.watch.received or "--stop-after"
    print(f"stopped by {why} after {loop.step - loop.start} steps at step {loop.step} of "
          f"{run.total_steps}, checkpoint saved; continue with --resume", flush=True)
  if run.leader:
    (run.workdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("summary: " + ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()),
        flush=True)
  return summary
