"""The train loop: a `RunConfig` in, a trained, checkpointed and summarised run out.

`train` builds the run (data, mesh, model, plan, optimizer, train step),
restores the latest checkpoint when asked, trains epoch by epoch with a progress
bar, evaluates after each epoch, checks that every worker holds identical
parameters every ``check_every`` steps, and writes ``config.json``,
``metrics.jsonl``, ``summary.json`` and ``checkpoints/`` to the workdir.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

from dlgs_jax.compress.methods import ConfigError
from dlgs_jax.training.config import ADDED_OPTIONS, RunConfig
from dlgs_jax.training.outputs import MetricsLog, tree_sha256
from dlgs_jax.training.persistence.preemption import PreemptionWatch
from dlgs_jax.training.persistence.resume import restore_or_start
from dlgs_jax.training.plans import PlanError
from dlgs_jax.training.run import Run, RunError, build_run, run_identity


def train(config: RunConfig) -> dict:
  """Trains the run `config` describes; returns its summary (also in ``summary.json``).

  Raises:
    RunError: naming what stops the run before it starts (a workdir in use by
      another run, bad data, a checkpoint of another run, a plan for another
      model ...).
  """
  import jax

  from dlgs_jax.training.persistence.workdir import WorkdirBusy, lock_for_run

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
  from dlgs_jax.training import step
  from dlgs_jax.training.persistence import checkpoint

  try:
    run = build_run(config)
  except (PlanError, ConfigError) as e:
    raise RunError(str(e)) from None
  ckpt = checkpoint.Checkpointer(workdir / "checkpoints", run_identity(run),
                                 max_to_keep=config.checkpoint.keep,
                                 warn=lambda m: run.log(f"warning: {m}"),
                                 added=ADDED_OPTIONS)
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
  import math

  import jax

  from dlgs_jax.compress import wire
  from dlgs_jax.workload import fsdp

  config = run.config
  params = run.state.params
  num_params = (sum(math.prod(shape) for shape in params.shapes)
                if isinstance(params, fsdp.ShardedParams)
                else sum(int(x.size) for x in jax.tree_util.tree_leaves(params)))
  if isinstance(params, fsdp.ShardedParams):
    # Sliced: each device sends its 1/L slice between nodes, as two levels do.
    nodes, local = run.mesh.devices.shape
    run.dense_bytes = wire.allreduce_bytes(-(-num_params // local), nodes)
    run.log(f"parameters sliced over {nodes} nodes x {local} devices: each device holds 1/"
            f"{local} of the model, its optimizer state and residuals; "
            f"{config.method.name} between nodes on its slice")
  elif len(run.mesh.axis_names) == 2:
    # Two levels: bytes_sent counts a device's traffic between nodes, on its 1/L slice;
    # the dense figure is the same all-reduce's (Horovod's hierarchical one).
    nodes, local = run.mesh.devices.shape
    run.dense_bytes = wire.allreduce_bytes(-(-num_params // local), nodes)
    run.log(f"two-level exchange: {nodes} nodes x {local} devices, dense inside a node, "
            f"{config.method.name} between nodes on 1/{local} of the values per device")
  else:
    run.dense_bytes = wire.allreduce_bytes(num_params, run.workers)
  density = config.method.effective_density()
  run.log(f"{config.model.name} ({num_params:,} parameters), {run.dataset_name} "
          f"({len(run.train_set.labels):,} train / {len(run.test_set.labels):,} test), "
          f"{run.workers} workers ("
          + ("simulated on one device" if config.processes.simulate_workers else
             f"{jax.process_count()} processes") + ") x batch "
          f"{config.data.batch_size}; {config.method.name}"
          + (f" density {density:g}" if density is not None else "")
          + (f" (warm-up {run.warmup} steps)" if run.warmup else "")
          + (", a threshold per layer" if "budget" in config.method.spec.options
             and config.method.budget == "layer" else "")
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
    for key in ("bytes_sent", "selected", "passed", "skipped", "exact"):
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
                                              run.state.model_state, run.test_set,
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
  params_sha = tree_sha256(parallel.fetch((run.state.params, run.state.model_state)))
  opt_sha = tree_sha256(parallel.fetch(run.state.opt_state))
  if jax.process_count() > 1:  # each process reports its own copy, to compare across logs
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
    _report(run, summary)
  return summary


def _report(run: Run, summary: dict) -> None:
  """The curves' PNG and the closing lines (process 0)."""
  from dlgs_jax.training import outputs

  config = run.config
  density = config.method.effective_density()
  title = (f"{config.model.name}, {config.method.name}"
           + (f" density {density:g}" if density is not None else "")
           + f", {run.workers} workers")
  curves = outputs.draw_curves(outputs.epoch_records(run.workdir / "metrics.jsonl"),
                              run.workdir / outputs.CURVES, title)
  print("\n".join(outputs.closing_lines(summary, run.workdir, curves)), flush=True)
