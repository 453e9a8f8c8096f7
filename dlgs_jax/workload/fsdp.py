"""Parameters sharded over the devices of a node (HSDP): the slices `two_level` cuts, kept.

A model too big to replicate on every device is still replicated across
nodes, but inside a node each of its L devices holds one slice of every leaf:
the leaf's values in flat order, zero-padded to a multiple of L, cut into L
runs of ``ceil(n/L)`` (`hierarchical.slice_shape`, the cut `two_level` makes).
Its gradient, optimizer state and residuals are then slices too.

`data_parallel(..., fsdp_axis=...)` runs the step on such parameters
(`ShardedParams`): the forward pass all-gathers every leaf over the node
(`gather`), the backward pass's transpose of that all-gather reduce-scatters
the gradient over the node (the fast link, dense), and the compressor
exchanges each device's slices between nodes only.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from dlgs_jax.compress.collectives import axes_of
from dlgs_jax.compress.hierarchical import slice_shape
from dlgs_jax.compress.state import is_per_worker
from dlgs_jax.workload import parallel


@jax.tree_util.register_pytree_with_keys_class
class ShardedParams:
  """The parameters as slices over a node's devices, and the leaves' whole shapes.

  A pytree: its one child, ``slices``, is a tree like the parameters whose
  leaves are ``(L, *slice_shape)`` arrays sharded over the node axis (one row
  a device; ``(1, *slice_shape)`` inside ``shard_map``); the whole shapes and
  L are static, so they ride through jit, shard_map and checkpoints.
  """

  def __init__(self, slices: Any, shapes: tuple, size: int):
    self.slices = slices
    self.shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
    self.size = int(size)

  def tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey("slices"), self.slices),), (self.shapes, self.size)

  def tree_flatten(self):
    return (self.slices,), (self.shapes, self.size)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def __repr__(self):
    return f"ShardedParams(size={self.size}, shapes={self.shapes})"


def shard(params: Any, size: int) -> ShardedParams:
  """Host parameters cut into `size` slices per leaf (NumPy, not placed).

  Args:
    params: a tree of arrays.
    size: L, the devices of a node.

  Returns:
    `ShardedParams` whose leaves are ``(L, *slice_shape(leaf))`` NumPy arrays.
  """
  leaves, treedef = jax.tree_util.tree_flatten(params)
  shapes = tuple(np.shape(x) for x in leaves)
  cut = []
  for x in leaves:
    x = np.asarray(x)
    width = _width(x.shape, size)
    flat = np.zeros(width * size, x.dtype)
    flat[:x.size] = x.reshape(-1)
    cut.append(flat.reshape((size,) + slice_shape(x.shape, size)))
  return ShardedParams(jax.tree_util.tree_unflatten(treedef, cut), shapes, size)


def whole(params: ShardedParams) -> Any:
  """`shard`'s inverse on host arrays: every leaf whole again."""
  leaves, treedef = jax.tree_util.tree_flatten(params.slices)
  out = [np.asarray(x).reshape(-1)[:math.prod(shape)].reshape(shape)
         for x, shape in zip(leaves, params.shapes)]
  return jax.tree_util.tree_unflatten(treedef, out)


def gather(slices: Any, shapes: tuple, axis: str) -> Any:
  """Inside ``shard_map``: every leaf whole, from the node's devices' slices.

  Its transpose (the backward pass) is a reduce-scatter: each device gets the
  gradient of its own slice, summed over the node.

  Args:
    slices: a tree of this device's slices (``slice_shape`` each).
    shapes: the leaves' whole shapes, in flatten order.
    axis: the mesh axis of a node's devices.
  """
  leaves, treedef = jax.tree_util.tree_flatten(slices)
  out = [lax.all_gather(x.reshape(-1), axis, tiled=True)[:math.prod(shape)].reshape(shape)
         for x, shape in zip(leaves, shapes)]
  return jax.tree_util.tree_unflatten(treedef, out)


def initial(tx, params: Any, shape: dict, axis: str) -> tuple[ShardedParams, Any]:
  """The sliced parameters and the optimizer's initial state, on the host.

  The optimizer's state is each slice's: ``tx.init`` runs on every slice; this
  library's states then get one row a device of the mesh (in its order), the
  rest one row a device of the node.

  Args:
    tx: the optimizer.
    params: the whole parameters, the same in every process.
    shape: the mesh's axis sizes by name, in its order (``mesh.shape``).
    axis: the axis of a node's devices.
  """
  size = shape[axis]
  sharded = shard(params, size)
  per_slice = [tx.init(jax.tree_util.tree_map(lambda x, j=j: x[j], sharded.slices))
               for j in range(size)]
  along = list(shape).index(axis)
  # Device d of the mesh (in its order) holds slice j of its node.
  slice_of = [index[along] for index in np.ndindex(*shape.values())]

  def per_device(*nodes):
    if is_per_worker(nodes[0]):
      return jax.tree_util.tree_map(lambda *x: np.stack([x[j] for j in slice_of]), *nodes)
    return np.stack(nodes)

  return sharded, jax.tree_util.tree_map(per_device, *per_slice, is_leaf=is_per_worker)


def place(params: ShardedParams, opt_state: Any, mesh, axis: str) -> tuple[ShardedParams, Any]:
  """Host slices and optimizer state placed: the slices and the optimizer's own rows
  over `axis`, this library's states one row a device of the mesh."""
  sliced = placer(mesh, PartitionSpec(axis))
  opt_state = parallel.map_state(placer(mesh, PartitionSpec(tuple(mesh.axis_names))), sliced,
                                 opt_state)
  return (ShardedParams(jax.tree_util.tree_map(sliced, params.slices), params.shapes,
                        params.size), opt_state)


def placer(mesh, spec: PartitionSpec) -> Callable:
  """A host array -> that array placed on `mesh` by `spec`, each device taking its part."""
  sharding = NamedSharding(mesh, spec)

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return put


def on_slices(loss: Callable, sharded: ShardedParams, axis: str) -> Callable:
  """`loss` on a device's slices: the whole leaves gathered over the node first."""
  def sliced_loss(slices, model_state, batch, key):
    return loss(gather(slices, sharded.shapes, axis), model_state, batch, key)
  return sliced_loss


def check_axis(fsdp_axis, mesh, axis_name, simulate_workers) -> None:
  """Refuses an fsdp axis the mesh lacks, one the data axes name, or simulated workers."""
  if not isinstance(fsdp_axis, str) or fsdp_axis not in mesh.axis_names:
    raise ValueError(f"fsdp_axis {fsdp_axis!r} is not an axis of the mesh {mesh.axis_names}: "
                     f"give the axis of a node's devices, e.g. jax.make_mesh((nodes, "
                     f"devices), ('data', 'fsdp')) and fsdp_axis='fsdp'")
  if axis_name is not None and fsdp_axis in axes_of(
      tuple(axis_name) if isinstance(axis_name, list) else axis_name):
    raise ValueError(f"fsdp_axis {fsdp_axis!r} is also a data axis ({axis_name!r}): the "
                     f"compressor exchanges over the other axes; drop it from axis_name")
  if len(mesh.axis_names) < 2:
    raise ValueError(f"fsdp_axis {fsdp_axis!r} needs a data axis besides it; the mesh has only "
                     f"{mesh.axis_names}")
  if simulate_workers is not None:
    raise ValueError("simulate_workers runs every worker on one device, which holds whole "
                     "parameters: drop simulate_workers or fsdp_axis")




def rows(tree: Any) -> Any:
  """Inside ``shard_map``: a tree of ``(1, ...)`` rows as the rows' contents."""
  return jax.tree_util.tree_map(lambda x: x[0], tree)


def unrows(tree: Any) -> Any:
  """`rows`' inverse."""
  return jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), tree)


def _width(shape, size: int) -> int:
  return max(1, -(-math.prod(shape) // size))
