"""Checkpoints of a whole training run with orbax-checkpoint, verified end to end.

A checkpoint holds the run's `StepState` (parameters, model state such as BatchNorm
statistics, the full optimizer state -- error-feedback residuals and DLGS thresholds of
every worker -- and the step) plus a JSON record: the run's identity (every
setting that changes what the saved arrays mean or what the run computes), the
data position, the plan, a fingerprint of every saved array and a SHA-256 of the
record itself.

Restoring reads the newest checkpoint's record and compares the identity with
the run asking for it: any difference is refused with `CheckpointMismatch`,
naming each differing setting, before any array is read. The arrays are then
restored and their fingerprints compared with the record's. A checkpoint that
cannot be read, whose record or arrays fail their checks, or that lacks a part
is reported in one line and the next older one is tried; a state that does not
verify is never returned. Saves are atomic (orbax writes to a temporary
directory and renames), so a process killed mid-save leaves the previous
checkpoints intact.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec


class CheckpointMismatch(ValueError):
  """A checkpoint belongs to a different run configuration.

  Attributes:
    differences: ``{setting: (checkpoint's value, this run's value)}``.
  """

  def __init__(self, message: str, differences: dict):
    super().__init__(message)
    self.differences = differences


class CheckpointCorrupt(RuntimeError):
  """No checkpoint in the directory passed its checks."""


def _bits(leaf: jax.Array) -> jax.Array:
  """The raw bits of `leaf` as uint32 values (any dtype up to 32 bits)."""
  leaf = jnp.asarray(leaf)
  if leaf.dtype == jnp.bool_:
    return leaf.astype(jnp.uint32).reshape(-1)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize]
  return jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32).reshape(-1)


def _fingerprints(leaves):
  prints = []
  for leaf in leaves:
    bits = _bits(leaf)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    prints.append(jnp.stack([jnp.sum(bits), jnp.sum(bits * weights)]))
  return jnp.stack(prints) if prints else jnp.zeros((0, 2), jnp.uint32)


def tree_fingerprints(tree: Any) -> list[list[int]]:
  """Two wrapping sums (plain and position-weighted) of the raw bits of each leaf.

  Computed on the devices over the global arrays, so every process gets the same
  numbers for a tree sharded over many; any flipped bit changes a leaf's pair.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  shardings = [x.sharding for x in leaves if isinstance(x, jax.Array)]
  out = None
  if shardings and isinstance(shardings[0], NamedSharding):
    out = NamedSharding(shardings[0].mesh, PartitionSpec())
  result = jax.jit(_fingerprints, out_shardings=out)(leaves)
  return np.asarray(result).astype(np.int64).tolist()


def record_digest(record: dict[str, Any]) -> str:
  """SHA-256 of a record's canonical JSON, its own ``digest`` left out."""
  body = {k: v for k, v in record.items() if k != "digest"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Checkpointer:
  """Saves and restores training state plus a verified JSON run record.

  Args:
    directory: where checkpoints live (created; shared by all processes).
    identity: this run's identity, a flat dict of settings; a checkpoint is
      restored only into a run of the same identity.
    max_to_keep: how many of the most recent checkpoints are kept.
    asynchronous: write in a background thread (training continues meanwhile).
    warn: called with a one-line message for each checkpoint passed over.
    added: identity settings older checkpoints do not name, each with the
      value such a checkpoint ran with (compared as if it had named it).
  """

  def __init__(self, directory, identity: dict[str, Any], *, max_to_keep: int = 3,
               asynchronous: bool = True, warn: Optional[Callable[[str], None]] = None,
               added: Optional[dict[str, Any]] = None):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep!r}")
    if not identity:
      raise ValueError("a checkpointer needs the run's identity (a non-empty dict)")
    self.identity = dict(identity)
    self.added = dict(added or {})
    self.warn = warn or (lambda message: None)
    self.directory = os.path.abspath(os.fspath(directory))
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True,
            enable_async_checkpointing=asynchronous))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: Any, *, data_position: dict[str, int],
           plan_json: Optional[str] = None, force: bool = False) -> bool:
    """Saves `state` as checkpoint `step` (every process must call this)."""
    record = {"identity": self.identity, "data": dict(data_position), "plan": plan_json,
              "step": int(step), "fingerprints": tree_fingerprints(state)}
    record["digest"] = record_digest(record)
    return self.manager.save(
        int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                           record=ocp.args.JsonSave(record)), force=force)

  def read_record(self, step: Optional[int] = None) -> dict[str, Any]:
    """The verified JSON record of checkpoint `step` (default: the latest).

    Raises:
      CheckpointCorrupt: the record cannot be read or fails its digest.
    """
    step = self._step(step)
    try:
      restored = self.manager.restore(
          step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))
      record = dict(restored["record"])
    except Exception as e:  # orbax raises many kinds for a damaged directory
      raise CheckpointCorrupt(f"its record cannot be read ({_first_line(e)})") from None
    if record.get("digest") != record_digest(record):
      raise CheckpointCorrupt("its record does not match its SHA-256")
    return record

  def check(self, record: dict[str, Any], allow: frozenset = frozenset()) -> None:
    """Raises `CheckpointMismatch` naming every setting that differs from this run's.

    Args:
      record: a checkpoint's record.
      allow: settings that may differ (the caller deals with them).
    """
    saved = dict(record.get("identity", {}))
    for key, value in self.added.items():
      if key in self.identity and key not in saved:
        saved[key] = value
    keys = sorted(set(saved) | set(self.identity))
    differ = {k: (saved.get(k), self.identity.get(k)) for k in keys
              if _normal(saved.get(k)) != _normal(self.identity.get(k))}
    if set(differ) - set(allow):
      text = "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in differ.items())
      raise CheckpointMismatch(
          f"checkpoint in {self.directory} was written by a different run configuration "
          f"({text}); use another --workdir or the original settings", differ)

  def restore(self, target: Any, step: Optional[int] = None, *,
              allow: frozenset = frozenset()) -> tuple[Any, dict[str, Any]]:
    """Restores and verifies checkpoint `step` into the structure of `target`.

    Args:
      target: a state of this run (e.g. freshly initialised); its shapes, dtypes
        and shardings say how the arrays are laid out on this mesh.
      step: which checkpoint (default: the latest).
      allow: identity settings that may differ (`check`).

    Returns:
      (state, record).

    Raises:
      CheckpointMismatch: the checkpoint belongs to another configuration.
      CheckpointCorrupt: it cannot be read or does not verify.
      FileNotFoundError: there is no checkpoint.
    """
    step = self._step(step)
    record = self.read_record(step)
    self.check(record, allow)
    # Device arrays come back laid out like the target's; host arrays as host arrays.
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x, target)
    try:
      restored = self._restore_state(step, abstract)
    except Exception as e:
      raise CheckpointCorrupt(f"its arrays cannot be read ({_first_line(e)})") from None
    if tree_fingerprints(restored) != record.get("fingerprints"):
      raise CheckpointCorrupt("its arrays do not match the fingerprints it was saved with")
    return restored, record

  def restore_latest_good(self, target: Any, *, allow: frozenset = frozenset()
                          ) -> tuple[Any, dict[str, Any]]:
    """The newest checkpoint that restores and verifies; each one passed over is warned of.

    Raises:
      CheckpointMismatch: a readable checkpoint belongs to another configuration
        (never passed over: the directory is another run's).
      CheckpointCorrupt: no checkpoint verifies.
      FileNotFoundError: there is no checkpoint.
    """
    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    for i, step in enumerate(steps):
      restored, problem = None, None
      try:
        restored = self.restore(target, step, allow=allow)
      except CheckpointCorrupt as e:
        problem = str(e)
      # Every process takes the same checkpoint: one that any process could not read
      # is passed over by all.
      if _everywhere(problem is None):
        return restored
      problem = problem or "another process could not read it"
      following = f"; trying step {steps[i + 1]}" if i + 1 < len(steps) else ""
      self.warn(f"checkpoint step {step} in {self.directory} is damaged: {problem}{following}")
    raise CheckpointCorrupt(f"no checkpoint in {self.directory} passes its checks (steps "
                            f"{', '.join(map(str, steps))}); move the directory away to start "
                            "afresh")

  def wait(self) -> None:
    """Blocks until a background save has finished."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()

  def _restore_state(self, step: int, abstract: Any) -> Any:
    """The saved state laid out like `abstract`, under today's field names or older ones."""
    def restore(item):
      return self.manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(item)))["state"]

    try:
      return restore(abstract)
    except ValueError as error:
      first = error
    # The same arrays in the same order: only the names orbax keys them by
    # differ, or the fields added since (which hold no arrays) are missing.
    for dropped in (False, True):
      older = _as_older(abstract, dropped)
      if older is None:
        continue
      try:
        return _from_older(abstract, restore(older), dropped)
      except ValueError:
        pass
    raise first

  def _step(self, step: Optional[int]) -> int:
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    return int(step)


# Field names a state once had: checkpoints of runs before the step state had one
# type name the model state "batch_stats".
OLDER_FIELD_NAMES = {"model_state": "batch_stats"}


def _added_since(node: Any, name: str, value: Any) -> bool:
  """Whether field `name` is one older checkpoints lack: empty, and empty by default."""
  default = getattr(type(node), "_field_defaults", {}).get(name, None)
  return (isinstance(value, tuple) and not value and isinstance(default, tuple)
          and not default)


def _changed(node: Any, dropped: bool) -> bool:
  return any(OLDER_FIELD_NAMES.get(name, name) != name
             or (dropped and _added_since(node, name, value))
             for name, value in zip(node._fields, node))


def _as_older(tree: Any, dropped: bool) -> Optional[Any]:
  """`tree` as older checkpoints laid it out, or None where that is `tree` itself.

  A named tuple with a renamed field becomes a dict under the older names;
  with `dropped`, so does one with a field added since (an empty tuple by
  default, as `DLGSState.owner_thresholds` is for most exchanges), without it.
  """
  def walk(node):
    if hasattr(node, "_fields"):
      children = {name: walk(value) for name, value in zip(node._fields, node)}
      if not _changed(node, dropped):
        return type(node)(**children)
      return {OLDER_FIELD_NAMES.get(name, name): value for name, value in children.items()
              if not (dropped and _added_since(node, name, getattr(node, name)))}
    if isinstance(node, (list, tuple)):
      return type(node)(walk(value) for value in node)
    if type(node) is dict:
      return {key: walk(value) for key, value in node.items()}
    return node

  older = walk(tree)
  same = jax.tree_util.tree_structure(older) == jax.tree_util.tree_structure(tree)
  return None if same else older


def _from_older(template: Any, saved: Any, dropped: bool) -> Any:
  """`_as_older`'s inverse: `saved` laid out as `template`, the added fields empty."""
  if hasattr(template, "_fields"):
    if not _changed(template, dropped):
      return type(template)(*(_from_older(t, s, dropped) for t, s in zip(template, saved)))
    return type(template)(**{
        name: () if dropped and _added_since(template, name, value)
        else _from_older(value, saved[OLDER_FIELD_NAMES.get(name, name)], dropped)
        for name, value in zip(template._fields, template)})
  if isinstance(template, (list, tuple)):
    return type(template)(_from_older(t, s, dropped) for t, s in zip(template, saved))
  if type(template) is dict:
    return {key: _from_older(value, saved[key], dropped) for key, value in template.items()}
  return saved


def _everywhere(ok: bool) -> bool:
  """Whether `ok` holds in every process of the job."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


def _first_line(error: Exception) -> str:
  text = str(error).strip().splitlines()
  if not text:
    return type(error).__name__
  # TensorStore appends the repr of a bound method after this phrase: noise to a user.
  head = text[0].split(". See full TensorStore details")[0]
  return f"{type(error).__name__}: {head[:200]}"


def _normal(value):
  # JSON turns tuples into lists; compare them alike.
  if isinstance(value, (list, tuple)):
    return [_normal(v) for v in value]
  return value
