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
import numpy as np
import orbax.checkpoint as ocp


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


# The position weight of the fingerprints' second sum (Knuth's multiplicative hash).
_WEIGHT = 2654435761
# Values a shard is read in at a time: bounds the host memory the sums take.
_CHUNK = 1 << 22


def _bits(values: np.ndarray) -> np.ndarray:
  """The raw bits of `values` (any dtype up to 32 bits) as flat uint64 values."""
  values = np.ascontiguousarray(values).reshape(-1)
  if values.dtype == np.bool_:
    return values.astype(np.uint64)
  unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[values.dtype.itemsize]
  return values.view(unsigned).astype(np.uint64)


def _shard_sums(values: np.ndarray, index: tuple, shape: tuple[int, ...]) -> np.ndarray:
  """The two sums of one shard of an array of `shape`, mod 2**32, as uint64 [2].

  Each value's raw bits b at flat position i of the whole array count as b and
  b * (i * _WEIGHT + 1); every product and sum is taken mod 2**32, so a leaf's
  sums are the sums of its shards' sums whatever the order.
  """
  if not shape:  # a scalar: one value at position 0
    values, index, shape = values.reshape(1), (), (1,)
  starts = [s.start or 0 for s in index] + [0] * (len(shape) - len(index))
  strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
  step = max(1, _CHUNK // max(1, int(np.prod(values.shape[1:], dtype=np.int64))))
  plain = weighted = 0
  for first in range(0, values.shape[0], step):
    chunk = values[first:first + step]
    # Flat positions in the whole array of this chunk's values, in C order (uint64
    # products wrap mod 2**64, which keeps them right mod 2**32).
    position = np.zeros((), np.uint64)
    for d, length in enumerate(chunk.shape):
      offset = starts[d] + (first if d == 0 else 0)
      axis = np.arange(offset, offset + length, dtype=np.uint64) * np.uint64(strides[d])
      position = position[..., None] + axis
    bits = _bits(chunk)
    weights = (position.reshape(-1) * np.uint64(_WEIGHT) + np.uint64(1)) & np.uint64(0xFFFFFFFF)
    plain += int(bits.sum(dtype=np.uint64))
    weighted += int(np.sum(bits * weights, dtype=np.uint64))
  return np.asarray([plain % 2**32, weighted % 2**32], np.uint64)


def _leaf_sums(leaf) -> np.ndarray:
  """This process's part of a leaf's two sums: every addressable shard it holds first."""
  if not isinstance(leaf, jax.Array):
    values = np.asarray(leaf)
    return _shard_sums(values, (), values.shape)
  total = np.zeros(2, np.uint64)
  for shard in leaf.addressable_shards:
    if shard.replica_id == 0:  # a replicated value is counted by one holder only
      total = total + _shard_sums(np.asarray(shard.data), shard.index, leaf.shape)
  return total % np.uint64(2**32)


def tree_fingerprints(tree: Any) -> list[list[int]]:
  """Two wrapping sums (plain and position-weighted) of the raw bits of each leaf.

  Read from the shards on the host, so no program is compiled (a checkpoint of a
  model of many leaves saves and verifies without one), and summed over processes,
  so every process gets the same numbers for a tree sharded over many; any flipped
  bit changes a leaf's pair.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return []
  sums = np.stack([_leaf_sums(leaf) for leaf in leaves]).astype(np.int64)
  # Leaves spread over processes: each holds a part of the sums. (A process-local
  # leaf is whole in every process, and its own sums are already the whole's.)
  spread = np.asarray([isinstance(x, jax.Array) and not x.is_fully_addressable
                       for x in leaves])
  if spread.any():
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    # In 16-bit halves: JAX (without x64) would take int64 sums as int32.
    halves = np.stack([sums & 0xFFFF, sums >> 16]).astype(np.int32)
    every = np.asarray(multihost_utils.process_allgather(halves)).astype(np.int64)
    total = every[:, 0].sum(axis=0) + (every[:, 1].sum(axis=0) << 16)  # [leaves, 2]
    sums = np.where(spread[:, None], total, sums)
  return (sums % 2**32).tolist()


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
