"""Meshes and array placement for data-parallel training with `jax.shard_map`.

Layout used throughout dlgs_jax: parameters are replicated; anything that is
per worker -- the batch, and the optimizer state that holds error-feedback
residuals -- carries a leading *worker axis* sharded over the data axis, so
inside `shard_map` each worker sees a leading axis of length 1 (`squeeze` /
`unsqueeze` drop and restore it). Everything here works with one process and
with many (`jax.distributed`): arrays are built from each process's local part.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def data_mesh(num_workers: Optional[int] = None, axis_name: str = "data") -> Mesh:
  """A 1-D mesh over the first `num_workers` devices of all processes (default: all)."""
  devices = jax.devices()
  if num_workers is None:
    num_workers = len(devices)
  if not 1 <= num_workers <= len(devices):
    raise ValueError(
        f"num_workers={num_workers!r} but {len(devices)} devices are available")
  return Mesh(np.asarray(devices[:num_workers]), (axis_name,))


def per_worker_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def replicate(tree: Any, mesh: Mesh) -> Any:
  """Places identical copies of `tree` on every device of `mesh`."""
  sharding = replicated_sharding(mesh)

  def place(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree_util.tree_map(place, tree)


def stack_per_worker(tree: Any, mesh: Mesh) -> Any:
  """Gives every worker its own copy of `tree` (leading worker axis, sharded)."""
  workers = mesh.devices.size
  sharding = per_worker_sharding(mesh)

  def place(x):
    x = np.asarray(x)
    shape = (workers,) + x.shape
    return jax.make_array_from_callback(
        shape, sharding, lambda index: np.broadcast_to(x, shape)[index])

  return jax.tree_util.tree_map(place, tree)


def shard_batch(local: Any, mesh: Mesh) -> Any:
  """Builds global per-worker arrays from this process's rows.

  Args:
    local: tree of arrays whose leading axis holds this process's workers'
      data, ``(local_workers, ...)``, in the order of this process's devices
      in `mesh`.
    mesh: the data mesh.
  """
  sharding = per_worker_sharding(mesh)
  return jax.tree_util.tree_map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local)


def local_worker_count(mesh: Mesh) -> int:
  """Workers (devices) of `mesh` that belong to this process."""
  return sum(d.process_index == jax.process_index() for d in mesh.devices.flat)


def squeeze(tree: Any) -> Any:
  """Drops the length-1 worker axis inside `shard_map`."""
  return jax.tree_util.tree_map(lambda x: x[0], tree)


def unsqueeze(tree: Any) -> Any:
  """Restores the worker axis inside `shard_map`."""
  return jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), tree)


def fetch(tree: Any) -> Any:
  """This process's view of `tree` as NumPy (addressable shards only).

  Replicated arrays come back whole; per-worker arrays come back as the rows of
  this process's workers.
  """
  def get(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    if x.sharding.is_fully_replicated:
      return np.asarray(shards[0].data)
    return np.concatenate([np.asarray(s.data) for s in shards])
  return jax.tree_util.tree_map(get, tree)
