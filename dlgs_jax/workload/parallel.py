"""Meshes and array placement for data-parallel training with `jax.shard_map`.

Layout used throughout dlgs_jax: parameters are replicated; anything that is
per worker -- the batch, and the states of this library's transforms, which
hold error-feedback residuals -- carries a leading *worker axis* sharded over
the data axes, so inside `shard_map` each worker sees a leading axis of length 1
(`squeeze` / `unsqueeze` drop and restore it). The other parts of an optimizer
state (an optax momentum, the states of `optax.chain`'s other links) are the
same on every worker and replicated: `init_per_worker`, `state_specs`,
`squeeze_state` and `unsqueeze_state` place and view a whole optimizer state so. Everything here works with one process and
with many (`jax.distributed`): arrays are built from each process's local part.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dlgs_jax.compress.state import is_per_worker


def data_mesh(num_workers: Optional[int] = None, axis_name: str = "data") -> Mesh:
  """A 1-D mesh over the first `num_workers` devices of all processes (default: all)."""
  devices = jax.devices()
  if num_workers is None:
    num_workers = len(devices)
  if not 1 <= num_workers <= len(devices):
    raise ValueError(
        f"num_workers={num_workers!r} but {len(devices)} devices are available: ask for 1 to "
        f"{len(devices)} workers (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
        f"before JAX starts, or dlgs-train's --local-devices, gives N devices)")
  return Mesh(np.asarray(devices[:num_workers]), (axis_name,))


def node_mesh(node_size: Optional[int] = None, axis_names=("node", "local")) -> Mesh:
  """A 2-D mesh of nodes (rows) by the devices of a node (the second axis).

  Devices are taken in process order (each process's as `jax.devices` lists them) and cut
  into rows of `node_size`: with one process per GPU (SLURM's one task per GPU,
  block distribution) a node's processes are consecutive, so their GPUs share a
  row; with one process per node, a row is a process.

  Args:
    node_size: devices per node; None: each process is a node.
    axis_names: (node axis, local axis).

  Raises:
    ValueError: when processes hold different numbers of devices, or
      `node_size` does not divide the devices or would split a process's
      devices over nodes where a node holds several processes.
  """
  by_process: dict[int, list] = {}
  for device in jax.devices():
    by_process.setdefault(device.process_index, []).append(device)
  counts = {len(devices) for devices in by_process.values()}
  if len(counts) != 1:
    raise ValueError(f"processes hold different numbers of devices "
                     f"({ {p: len(d) for p, d in sorted(by_process.items())} }); a node mesh "
                     f"needs the same number in each")
  local = counts.pop()
  devices = [d for p in sorted(by_process) for d in by_process[p]]
  node_size = local if node_size is None else node_size
  if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
    raise ValueError(f"node_size must be an integer >= 1, got {node_size!r}")
  if len(devices) % node_size or (node_size % local and local % node_size):
    raise ValueError(f"node_size {node_size} does not cut {len(by_process)} processes of "
                     f"{local} devices into whole nodes: give a divisor of {len(devices)} "
                     f"that is a multiple or divisor of {local}")
  return Mesh(np.asarray(devices, dtype=object).reshape(-1, node_size), tuple(axis_names))


def devices_per_node(mesh: Mesh) -> int:
  """Devices per node of a node mesh (`node_mesh`); 1 for a flat (one-axis) mesh."""
  return mesh.shape[mesh.axis_names[1]] if len(mesh.axis_names) == 2 else 1


def per_worker_sharding(mesh: Mesh) -> NamedSharding:
  """A leading worker axis split over all of the mesh's axes."""
  return NamedSharding(mesh, PartitionSpec(data_axes(mesh)))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def replicate(tree: Any, mesh: Mesh) -> Any:
  """Places identical copies of `tree` on every device of `mesh`."""
  sharding = replicated_sharding(mesh)
  return jax.tree_util.tree_map(lambda x: _from_host(x, sharding), tree)


def _from_host(x: Any, sharding: NamedSharding) -> jax.Array:
  """A host array placed with `sharding`, each device taking its part (any process count)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def stack_per_worker(tree: Any, mesh: Mesh, workers: Optional[int] = None) -> Any:
  """Gives every worker its own copy of `tree` (leading worker axis, sharded).

  `workers`: the worker count where it is not the mesh's devices (workers
  simulated on one device, `sharded_step.data_parallel`'s ``simulate_workers``).
  """
  workers = mesh.devices.size if workers is None else workers
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
    if x.sharding.is_fully_replicated:  # scalars included: they have no axis to sort by
      return np.asarray(x.addressable_shards[0].data)
    # One shard per row block: an array split over one axis of a 2-D mesh (the
    # slices of sliced parameters) is replicated over the other, a copy a device.
    shards = {s.index[0].start or 0: s for s in x.addressable_shards}
    return np.concatenate([np.asarray(shards[start].data) for start in sorted(shards)])
  return jax.tree_util.tree_map(get, tree)


def map_state(per_worker, replicated, opt_state: Any) -> Any:
  """Applies `per_worker` to the leaves of this library's states, `replicated` to the rest.

  Raises:
    ValueError: when one of this library's states is inside ``optax.MultiSteps``.
  """
  check_not_multisteps(opt_state)

  def visit(node):
    if is_per_worker(node):
      return jax.tree_util.tree_map(per_worker, node)
    return replicated(node)
  return jax.tree_util.tree_map(visit, opt_state, is_leaf=is_per_worker)


def check_not_multisteps(opt_state: Any) -> None:
  """Refuses this library's transforms inside ``optax.MultiSteps``, saying what to do instead.

  MultiSteps runs the transform it wraps on every micro-step -- its collective
  included -- and keeps the result of every k-th only: accumulating would not
  cut traffic, and the statistics would describe the last kept step.
  """
  import optax  # pylint: disable=g-import-not-at-top

  wrapped = [node for node in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.MultiStepsState))
             if isinstance(node, optax.MultiStepsState)]
  for node in wrapped:
    if any(is_per_worker(x) for x in jax.tree_util.tree_leaves(
        node.inner_opt_state, is_leaf=is_per_worker)):
      raise ValueError(
          "a dlgs_jax transform is inside optax.MultiSteps, which runs it (and its "
          "collective) on every micro-step and keeps every k-th result: accumulation would "
          "not cut traffic. Accumulate before the compressor instead: "
          "dlgs_jax.data_parallel(..., micro_batches=k), or sum the micro-batches' gradients "
          "in your step and call the transform once")


def data_axes(mesh: Mesh, axis_name=None):
  """The mesh's data axes as a transform takes them: `axis_name`, or every mesh axis."""
  if axis_name is not None:
    return tuple(axis_name) if isinstance(axis_name, list) else axis_name
  names = tuple(mesh.axis_names)
  return names[0] if len(names) == 1 else names


def state_specs(opt_state: Any, axis_name) -> Any:
  """`PartitionSpec`s for an optimizer state: per worker for this library's states, else ``P()``.

  Args:
    opt_state: the state (or its shapes) of an optimizer containing transforms
      of this library.
    axis_name: the data axis or axes.

  Returns:
    A tree of the state's structure, for shard_map's ``in_specs``/``out_specs``.
  """
  return map_state(lambda _: PartitionSpec(axis_name), lambda _: PartitionSpec(),
                         opt_state)


def place_state(opt_state: Any, mesh: Mesh, workers: Optional[int] = None) -> Any:
  """Places one worker's optimizer state on `mesh`: per-worker parts stacked, the rest replicated.

  `workers` as in `stack_per_worker` (default: the mesh's devices).
  """
  return map_state(lambda x: stack_per_worker(x, mesh, workers),
                   lambda node: replicate(node, mesh), opt_state)


def place_rows(opt_state: Any, mesh: Mesh, workers: Optional[int] = None) -> Any:
  """Places an optimizer state whose per-worker parts hold every worker's row (host arrays).

  Unlike `place_state`, each worker gets its own row ``x[w]`` (e.g. residual
  slices that differ per device); the rest is replicated. `workers` as in
  `stack_per_worker`.
  """
  sharding = per_worker_sharding(mesh)
  workers = mesh.devices.size if workers is None else workers

  def rows(x):
    if np.shape(x)[:1] != (workers,):
      raise ValueError(f"a per-worker leaf of shape {np.shape(x)} has no row per worker "
                       f"({workers})")
    return _from_host(x, sharding)

  return map_state(rows, lambda node: replicate(node, mesh), opt_state)


def init_per_worker(tx, params: Any, mesh: Mesh) -> Any:
  """``tx.init(params)``, placed for a data-parallel step on `mesh` (`place_state`).

  Pass it to shard_map with ``in_specs`` `state_specs` and drop the worker
  axis inside with `squeeze_state`.
  """
  return place_state(tx.init(params), mesh)


def squeeze_state(opt_state: Any) -> Any:
  """Inside shard_map: drops the worker axis of the per-worker parts of an optimizer state."""
  return map_state(squeeze, lambda node: node, opt_state)


def unsqueeze_state(opt_state: Any) -> Any:
  """Inside shard_map: restores the worker axis `squeeze_state` dropped."""
  return map_state(unsqueeze, lambda node: node, opt_state)
