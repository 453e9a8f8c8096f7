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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlgs_jax.compress.hierarchical import slice_shape


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


def rows(tree: Any) -> Any:
  """Inside ``shard_map``: a tree of ``(1, ...)`` rows as the rows' contents."""
  return jax.tree_util.tree_map(lambda x: x[0], tree)


def unrows(tree: Any) -> Any:
  """`rows`' inverse."""
  return jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), tree)


def _width(shape, size: int) -> int:
  return max(1, -(-math.prod(shape) // size))
