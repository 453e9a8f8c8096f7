"""Checkpoints of a whole training run with orbax-checkpoint.

A checkpoint holds the `training.TrainState` (parameters, BatchNorm statistics,
the full optimizer state -- error-feedback residuals and DLGS thresholds of
every worker -- and the step) plus a JSON record: the run's identity (model,
method, density, world size, plan, ...), the data position and the plan.

Restoring first reads the JSON record and compares the identity with the run
asking for it; any difference in a key that changes what the saved arrays mean
(`IDENTITY_KEYS`) is refused with `CheckpointMismatch` before any array is read,
so a checkpoint is never silently misread. Saves are atomic (orbax writes to a
temporary directory and renames), so a process killed mid-save leaves the
previous checkpoint intact; leftovers are removed on the next start.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

# Keys of the run record that must match for a checkpoint to be restored.
IDENTITY_KEYS = ("model", "method", "density", "reuse_every", "collective", "workers",
                 "batch_size", "plan_id", "dataset", "num_examples", "image_shape",
                 "num_classes", "seed")


class CheckpointMismatch(ValueError):
  """A checkpoint belongs to a different run configuration."""


class Checkpointer:
  """Saves and restores training state plus a JSON run record.

  Args:
    directory: where checkpoints live (created; shared by all processes).
    run: this run's identity record (`IDENTITY_KEYS` and anything else).
    max_to_keep: how many of the most recent checkpoints are kept.
    asynchronous: write in a background thread (training continues meanwhile).
  """

  def __init__(self, directory, run: dict[str, Any], *, max_to_keep: int = 3,
               asynchronous: bool = True):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep!r}")
    missing = [k for k in IDENTITY_KEYS if k not in run]
    if missing:
      raise ValueError(f"run record lacks identity keys {missing}")
    self.run = dict(run)
    self.directory = os.path.abspath(os.fspath(directory))
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True,
            enable_async_checkpointing=asynchronous))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state: Any, *, data_position: dict[str, int],
           plan_json: Optional[str] = None, force: bool = False) -> bool:
    """Saves `state` as checkpoint `step` (every process must call this)."""
    record = {"run": self.run, "data": dict(data_position), "plan": plan_json, "step": int(step)}
    return self.manager.save(
        int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                           record=ocp.args.JsonSave(record)), force=force)

  def read_record(self, step: Optional[int] = None) -> dict[str, Any]:
    """The JSON record of checkpoint `step` (default: the latest)."""
    step = self._step(step)
    restored = self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))
    return restored["record"]

  def check(self, record: dict[str, Any]) -> None:
    """Raises `CheckpointMismatch` if `record` is from a different run configuration."""
    saved = record.get("run", {})
    differ = [(k, saved.get(k), self.run.get(k)) for k in IDENTITY_KEYS
              if _normal(saved.get(k)) != _normal(self.run.get(k))]
    if differ:
      text = "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, a, b in differ)
      raise CheckpointMismatch(
          f"checkpoint in {self.directory} was written by a different run configuration "
          f"({text}); use another --workdir or the original settings")

  def restore(self, target: Any, step: Optional[int] = None) -> tuple[Any, dict[str, Any]]:
    """Restores checkpoint `step` (default: latest) into the structure of `target`.

    Args:
      target: a state of this run (e.g. freshly initialised); its shapes, dtypes
        and shardings say how the arrays are laid out on this mesh.
      step: which checkpoint.

    Returns:
      (state, record).

    Raises:
      CheckpointMismatch: the checkpoint belongs to another configuration.
      FileNotFoundError: there is no checkpoint.
    """
    step = self._step(step)
    record = self.read_record(step)
    self.check(record)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
    restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    return restored["state"], record

  def wait(self) -> None:
    """Blocks until a background save has finished."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()

  def _step(self, step: Optional[int]) -> int:
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    return int(step)


def _normal(value):
  # JSON turns tuples into lists; compare them alike.
  if isinstance(value, (list, tuple)):
    return [_normal(v) for v in value]
  return value
