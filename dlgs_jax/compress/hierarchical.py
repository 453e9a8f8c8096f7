"""Two-level exchange: dense inside a node, compressed between nodes.

A node's L devices share a fast link (NVLink, PCIe); nodes share a slow network.
`two_level` wraps any of this library's transforms so that only the slow link
carries compressed traffic, and each node sends one message, not L:

1. reduce-scatter the gradient densely over the fast axis: device j of a node
   holds slice j of every leaf, summed over the node's L devices (divided by L);
2. the wrapped transform runs on that slice with its own residuals, thresholds
   and groups, exchanging across the slow axis only (N nodes): per-device
   compressor state is 1/L of the parameters;
3. all-gather the slices over the fast axis.

The result is the mean over all N·L workers, bit-identical on every device and
typed replicated. Nothing is lost, in two-level form: with ``e[n, j]`` the
residual of device j of node n (a slice),
``N·L·update + L·Σ_{n,j} e_new[n, j] == Σ_workers grad + L·Σ_{n,j} e_old[n, j]``.
Systems users know do the same for dense all-reduce (Horovod's hierarchical
all-reduce, BytePS); here the compressor, its layer-wise budget and the merge
planner apply per slice.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dlgs_jax.compress import collectives, common, wire


class TwoLevelState(NamedTuple):
  """State of `two_level`."""
  inner: Any             # the wrapped transform's state over this device's slices (per device)
  fast_bytes: jax.Array  # float32[]: bytes a device sent over the fast link in the last step

  @property
  def count(self):
    return self.inner.count


def slice_shape(shape, fast_size: int) -> tuple:
  """Shape of one device's slice of a leaf: its dimensions kept, the last one ``ceil(n/L)``.

  The leading dimensions become 1, so a method that treats leaves by their
  number of dimensions (DGC's ``min_ndim``, a ``send_whole`` mask on ``x.ndim``) treats
  the slice as it would the leaf.
  """
  size = math.prod(shape)
  if not shape:
    return ()
  return (1,) * (len(shape) - 1) + (-(-size // fast_size),)


def two_level(make: Callable[[Any], optax.GradientTransformation], *, fast_axis: str,
              slow_axis, fast_size: int) -> optax.GradientTransformation:
  """Runs a transform between nodes on slices reduced densely within each node.

  Args:
    make: slow axis -> the transform (e.g. ``lambda axis: dlgs(0.01, axis_name=axis)``);
      it sees a tree of the parameters' paths whose leaves are this device's slices.
    fast_axis: the mesh axis of the devices within a node.
    slow_axis: the mesh axis (or axes) of the nodes.
    fast_size: L, the size of `fast_axis` (the slices' shapes depend on it).

  Returns:
    An `optax.GradientTransformation` with state `TwoLevelState`; inside
    shard_map its state is per device over both axes.

  Raises:
    ValueError: for a bad axis or size.
  """
  if not isinstance(fast_axis, str):
    raise ValueError(f"fast_axis must be a mesh axis name, got {fast_axis!r}")
  slow_axis = common.check_axis_name(slow_axis)
  if slow_axis is None or fast_axis in common.axes_of(slow_axis):
    raise ValueError(f"slow_axis must name the node axis, other than fast_axis "
                     f"{fast_axis!r}; got {slow_axis!r}")
  if isinstance(fast_size, bool) or not isinstance(fast_size, int) or fast_size < 1:
    raise ValueError(f"fast_size must be an integer >= 1, got {fast_size!r}")
  common.check_factory("two_level's make", make,
                       "lambda axis: dlgs_jax.dlgs(0.01, axis_name=axis)")
  inner = common.check_built("two_level's make", make(slow_axis))

  def slices_of(tree):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(slice_shape(jnp.shape(x), fast_size), jnp.result_type(x)),
        tree)

  def init_fn(params):
    return TwoLevelState(inner.init(jax.tree_util.tree_map(
        lambda s: jnp.zeros(s.shape, s.dtype), slices_of(params))), jnp.zeros((), jnp.float32))

  def update_fn(updates, state, params=None):
    if lax.axis_size(fast_axis) != fast_size:
      raise ValueError(f"fast_size {fast_size} does not match the mesh axis {fast_axis!r} of "
                       f"{lax.axis_size(fast_axis)} devices: the slices' shapes depend on it")
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    widths = [max(1, -(-x.size // fast_size)) for x in leaves]
    slices = _reduce_scatter(leaves, widths, fast_axis, fast_size)
    inner_params = None if params is None else slices_of(params)
    shaped = [s.reshape(slice_shape(x.shape, fast_size)).astype(x.dtype)
              for s, x in zip(slices, leaves)]
    sent, inner_state = inner.update(jax.tree_util.tree_unflatten(treedef, shaped),
                                     state.inner, inner_params)
    means = _all_gather(jax.tree_util.tree_leaves(sent), leaves, widths, fast_axis)
    # Reduce-scatter plus all-gather of float32 slices: a ring all-reduce's bytes.
    fast = wire.allreduce_bytes(sum(widths) * fast_size, fast_size)
    return (jax.tree_util.tree_unflatten(treedef, means),
            TwoLevelState(inner_state, jnp.asarray(fast, jnp.float32)))

  return common.with_passive_leaves(optax.GradientTransformation(init_fn, update_fn),
                                    common.axes_of(slow_axis) + (fast_axis,), TwoLevelState,
                                    "two_level")


def _reduce_scatter(leaves, widths, fast_axis, fast_size):
  """Slice j of every leaf, summed over the node's devices and divided by L (float32)."""
  rows = [jnp.pad(x.reshape(-1).astype(jnp.float32), (0, w * fast_size - x.size))
          .reshape(fast_size, w) for x, w in zip(leaves, widths)]
  buffer = jnp.concatenate(rows, axis=1)
  if fast_size > 1:
    buffer = lax.psum_scatter(buffer, fast_axis, scatter_dimension=0, tiled=True)
  mine = buffer.reshape(-1) / fast_size
  return jnp.split(mine, list(itertools.accumulate(widths))[:-1])


def _all_gather(sent, leaves, widths, fast_axis):
  """Every device's slices back into whole leaves (typed replicated)."""
  flat = jnp.concatenate([s.reshape(-1).astype(jnp.float32) for s in sent])
  rows = collectives.gather_replicated(flat, fast_axis)  # (L, M)
  out, start = [], 0
  for x, w in zip(leaves, widths):
    out.append(rows[:, start:start + w].reshape(-1)[:x.size].reshape(x.shape).astype(x.dtype))
    start += w
  return out
