"""Moving a run's optimizer state onto another number of workers or node shape.

The per-worker parts of the optimizer state (this library's transform states)
carry a leading worker axis; the rest is replicated and kept as it is. Error-feedback
residuals (and DGC's velocity) hold gradient mass not yet applied: with P workers
it enters the updates as ``m = sum_w e_w / P``. On P' workers each worker starts
from m, so ``sum_w' e'_w / P'`` is the same mass and nothing is lost.
The other per-worker values: rows identical on every worker are kept; floats that
differ (DLGS's thresholds) take the workers' mean, to be recomputed at the next
exact step; integers that differ (the statistics of the last step) take worker 0's.

A two-level run (`compress.hierarchical`, N nodes of L devices) holds on device
(n, j) slice j of its node's residual, which enters the updates as
``m = sum_n r_n / N`` (``r_n``: node n's slices laid end to end in the leaf).
`change_exchange` rebuilds each leaf's m and deals it out again: each flat
worker starts from m; device j of every node of another shape from slice j of m.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import numpy as np

from dlgs_jax.compress import grouping
from dlgs_jax.compress.state import (DLGSState, SparseState, is_per_worker, leaf_residuals,
                                     with_leaf_residuals)

# State fields that hold gradient mass (`compress.state`): redistributed, their mass kept.
MASS_FIELDS = frozenset({"residuals", "velocity"})


def _field_names(path) -> set:
  return {getattr(key, "name", None) for key in path}


def _one_row(x: np.ndarray) -> np.ndarray:
  """A non-mass per-worker leaf for every new worker: the common row, a mean, or worker 0's."""
  if (x == x[:1]).all():
    return x[0]
  if np.issubdtype(x.dtype, np.floating):
    return x.astype(np.float64).mean(0).astype(x.dtype)
  return x[0]


def redistribute(opt_state: Any, workers: int) -> Any:
  """One worker's row of each per-worker leaf, for a flat run of any number of workers.

  Args:
    opt_state: host arrays; those of this library's states with a leading axis
      of the checkpoint's P workers (a flat exchange).
    workers: the new worker count P' (only used to check it).

  Returns:
    The tree without the worker axis: every new worker starts from it (place it
    with `workload.parallel.place_state`).

  Raises:
    ValueError: for a worker count below 1 or a leaf without a worker axis.
  """
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers!r}")

  def row(path, x):
    x = np.asarray(x)
    if x.ndim == 0:
      raise ValueError(f"optimizer state leaf {jax.tree_util.keystr(path)} has no worker axis")
    if _field_names(path) & MASS_FIELDS:
      # Summed in float64: the mass is kept to the rounding of one division.
      return (x.astype(np.float64).sum(0) / x.shape[0]).astype(x.dtype)
    return _one_row(x)

  def visit(node):
    return jax.tree_util.tree_map_with_path(row, node) if is_per_worker(node) else node

  return jax.tree_util.tree_map(visit, opt_state, is_leaf=is_per_worker)


def exchange_name(mesh) -> str:
  """A run identity's ``exchange``: "flat", "two-level NxL" for a node mesh (`nodes_of`), or
  "sliced NxL" for parameters sliced over the L devices of N nodes (``--fsdp``)."""
  if tuple(mesh.axis_names) == ("data", "fsdp"):
    return "sliced {}x{}".format(*mesh.devices.shape)
  if len(mesh.axis_names) == 2:
    return "two-level {}x{}".format(*mesh.devices.shape)
  return "flat"


def nodes_of(exchange: str) -> Optional[tuple[int, int]]:
  """(nodes, devices per node) of a run identity's ``exchange`` (`exchange_name`); None for "flat"."""
  if exchange == "flat":
    return None
  kind, _, shape = exchange.partition(" ")
  nodes, _, local = shape.partition("x")
  if kind not in ("two-level", "sliced") or not (nodes.isdigit() and local.isdigit()):
    raise ValueError(f"unknown exchange {exchange!r}: expected 'flat', 'two-level NxL' or "
                     f"'sliced NxL'")
  return int(nodes), int(local)


def whole_mass(x: np.ndarray, shape: tuple, fast_size: int) -> np.ndarray:
  """The mass m (float64, the leaf's `shape`) that every worker's residual rows put into updates.

  Args:
    x: ``(workers, ...)``: whole leaves (flat) or each device's slice (two-level).
    shape: the leaf's shape.
    fast_size: devices per node L; 1 for a flat exchange.
  """
  x = np.asarray(x, np.float64)
  if fast_size == 1:
    return x.sum(0).reshape(shape) / x.shape[0]
  nodes = x.shape[0] // fast_size
  laid = x.reshape(nodes, -1)[:, :math.prod(shape)]  # node n's slices end to end
  return (laid.sum(0) / nodes).reshape(shape)


def dealt_mass(mass: np.ndarray, workers: int, fast_size: int, row_shape: tuple,
               dtype) -> np.ndarray:
  """Every new worker's residual rows ``(workers, *row_shape)`` that put `mass` into updates.

  Args:
    mass: a leaf's mass (`whole_mass`).
    workers: the new run's workers (N' L').
    fast_size: the new run's devices per node L'; 1 for a flat exchange.
    row_shape: one worker's residual shape (the leaf's, or its slice's).
    dtype: the residuals' dtype.
  """
  if fast_size == 1:
    return np.broadcast_to(mass.reshape(row_shape), (workers,) + row_shape).astype(dtype)
  flat = mass.reshape(-1)
  width = row_shape[-1] if row_shape else 1
  slices = np.pad(flat, (0, fast_size * width - flat.size)).reshape(fast_size, width)
  rows = np.tile(slices, (workers // fast_size, 1))
  return rows.reshape((workers,) + row_shape).astype(dtype)


def change_exchange(opt_state: Any, target: Any, params: Any, old_fast: int,
                    new_fast: int) -> Any:
  """The optimizer state for another exchange (worker count, node shape, flat), mass kept.

  Args:
    opt_state: the checkpoint's, host arrays; this library's states with a
      leading axis of its workers.
    target: the new run's state (arrays or shapes): its structure and the new
      per-worker shapes.
    params: the parameters (or their shapes): the whole leaves behind the residuals.
    old_fast, new_fast: devices per node of the old and new exchanges (1: flat).

  Returns:
    `target`'s structure: per-worker leaves as full ``(workers, ...)`` host
    arrays (`workload.parallel.place_rows` places them), the other leaves as
    saved where both exchanges have them, else as in `target`.

  Raises:
    ValueError: when the two states hold different transforms.
  """
  old_nodes, new_nodes = _per_worker_nodes(opt_state), _per_worker_nodes(target)
  if [type(n) for n in old_nodes] != [type(n) for n in new_nodes]:
    raise ValueError(f"the checkpoint's transforms {[type(n).__name__ for n in old_nodes]} "
                     f"are not this run's {[type(n).__name__ for n in new_nodes]}")
  shapes = dict(zip(grouping.leaf_paths(params),
                    (tuple(np.shape(x)) for x in jax.tree_util.tree_leaves(params))))
  moved = iter([_move_node(old, new, shapes, old_fast, new_fast)
                for old, new in zip(old_nodes, new_nodes)])
  replaced = jax.tree_util.tree_map(lambda node: next(moved) if is_per_worker(node) else node,
                                    target, is_leaf=is_per_worker)
  return _keep_saved(opt_state, replaced)


def _per_worker_nodes(tree: Any) -> list:
  return [n for n in jax.tree_util.tree_leaves(tree, is_leaf=is_per_worker) if is_per_worker(n)]


def _move_node(old: Any, new: Any, shapes: dict, old_fast: int, new_fast: int) -> Any:
  """One transform's state for the new workers: mass dealt out again, the rest one row each."""
  fields = {}
  flat = isinstance(new, (DLGSState, SparseState))
  for name in new._fields:
    saved, wanted = getattr(old, name), getattr(new, name)
    if name in MASS_FIELDS and flat:
      fields[name] = _dealt_buffers(old, new, shapes, old_fast, new_fast)
    elif name in MASS_FIELDS:
      # The residual trees mirror the parameters: leaf i is parameter i's.
      rows = [dealt_mass(whole_mass(o, shape, old_fast), n.shape[0], new_fast,
                         tuple(n.shape[1:]), n.dtype)
              for o, n, shape in zip(jax.tree_util.tree_leaves(saved),
                                     jax.tree_util.tree_leaves(wanted), shapes.values())]
      fields[name] = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(wanted), rows)
    elif name == "thresholds" and flat:
      fields[name] = _thresholds_by_path(old, new)
    elif len(jax.tree_util.tree_leaves(saved)) != len(jax.tree_util.tree_leaves(wanted)):
      # Another exchange's field (the owners' thresholds, with another number of
      # groups or none saved): the new state's, measured afresh.
      fields[name] = wanted
    else:
      # Leaf by leaf: the groups' static labels (shapes of slices or of whole
      # leaves) are the new state's.
      rows = [_one_row_for(o, n) for o, n in zip(jax.tree_util.tree_leaves(saved),
                                                 jax.tree_util.tree_leaves(wanted))]
      fields[name] = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(wanted), rows)
  return type(new)(**fields)


def _one_row_for(saved, wanted):
  """`_one_row` of a saved per-worker leaf, for every new worker; the new one where shapes differ.

  A grouping that differs between the two exchanges (buckets of slices against
  buckets of whole leaves) gives per-group statistics of another length: those
  start afresh.
  """
  saved = np.asarray(saved)
  if saved.shape[1:] != tuple(wanted.shape[1:]):
    return np.asarray(wanted)
  return np.broadcast_to(_one_row(saved), wanted.shape).astype(wanted.dtype)


def _dealt_buffers(old: Any, new: Any, shapes: dict, old_fast: int, new_fast: int) -> tuple:
  """The new flat residual buffers (one per group) holding the saved residuals' mass."""
  saved = leaf_residuals(old)
  groups = new.stats.groups
  workers = new.residuals[0].shape[0]
  dealt = {path: dealt_mass(whole_mass(saved[path], shapes[path], old_fast), workers, new_fast,
                            tuple(shape), np.float64)
           for paths, leaf_shapes in zip(groups.paths, groups.shapes)
           for path, shape in zip(paths, leaf_shapes)}
  return with_leaf_residuals(new, dealt).residuals


def _thresholds_by_path(old: Any, new: Any) -> tuple:
  """Each leaf's saved threshold (one row, `_one_row`) in the new state's groups.

  A message's one threshold (DLGS's message budget) is each of its leaves'; a
  new message of several leaves takes the lowest of theirs: what passes it and
  does not fit waits in the residual, and the rule's drift test sees it.
  """
  saved = {}
  for paths, row in zip(old.stats.groups.paths, old.thresholds):
    row = np.asarray(row)
    for i, path in enumerate(paths):
      saved[path] = _one_row(row[:, i if row.shape[1] == len(paths) else 0])
  out = []
  for paths, wanted in zip(new.stats.groups.paths, new.thresholds):
    row = np.asarray([saved[path] for path in paths], np.float32)
    if wanted.shape[-1] != len(paths):
      row = row.min(keepdims=True)
    out.append(np.broadcast_to(row, wanted.shape).astype(wanted.dtype))
  return tuple(out)


def _keep_saved(saved: Any, target: Any) -> Any:
  """`target` with the saved values of its replicated parts wherever both trees have them.

  The two exchanges' states differ only around the transform's state (the
  two-level wrapper); the momentum and the rest of the chain match.
  """
  if _per_worker_nodes(target) and isinstance(target, tuple) and not is_per_worker(target) \
      and type(saved) is type(target) and len(saved) == len(target):
    parts = [_keep_saved(s, t) for s, t in zip(saved, target)]
    return type(target)(*parts) if hasattr(target, "_fields") else type(target)(parts)
  if _per_worker_nodes(target):
    return target
  same = jax.tree_util.tree_structure(saved) == jax.tree_util.tree_structure(target)
  return saved if same else target


def change_fsdp(saved: Any, target: Any) -> Any:
  """A step state of parameters sliced over a node (`workload.fsdp`) on another node size.

  The parameters are gathered whole and cut again; the optimizer's state that
  mirrors them (a momentum: a subtree shaped like the parameters) likewise;
  its other rows (a step count) are the same on every device and kept; this
  library's states move as `change_exchange` moves two-level slices, their
  mass kept.

  Args:
    saved: the checkpoint's `StepState`, host arrays, its ``params`` a
      `fsdp.ShardedParams` of L slices.
    target: the new run's `StepState` (arrays or shapes), L' slices.

  Returns:
    `target`'s layout as host arrays (`workload.sharded_step.place_sliced` places it).

  Raises:
    ValueError: for optimizer state that neither mirrors the parameters nor is
      the same on every device (it cannot be cut again).
  """
  from dlgs_jax.workload import fsdp

  old, new = saved.params, target.params
  whole = fsdp.whole(old)
  treedef = jax.tree_util.tree_structure(whole)
  sizes = [math.prod(shape) for shape in old.shapes]

  def mirrored(node) -> bool:
    return (not is_per_worker(node) and not isinstance(node, np.ndarray)
            and jax.tree_util.tree_structure(node) == treedef)

  def cut_again(saved_node, target_node):
    if mirrored(saved_node):
      return jax.tree_util.tree_map(
          lambda x, t, n: _recut(np.asarray(x), np.shape(t), n), saved_node, target_node,
          jax.tree_util.tree_unflatten(treedef, sizes))
    if is_per_worker(saved_node):
      return saved_node

    def same_rows(path, x, t):
      x = np.asarray(x)
      if not (x == x[:1]).all():
        raise ValueError(f"optimizer state {jax.tree_util.keystr(path)} differs between a "
                         f"node's devices and does not mirror the parameters: it cannot be cut "
                         f"for {new.size} devices")
      return np.broadcast_to(x[:1], np.shape(t)).astype(x.dtype)
    return jax.tree_util.tree_map_with_path(same_rows, saved_node, target_node)

  recut = jax.tree_util.tree_map(cut_again, saved.opt_state, target.opt_state,
                                 is_leaf=lambda n: mirrored(n) or is_per_worker(n))
  opt_state = change_exchange(recut, target.opt_state, whole, old.size, new.size)
  return type(saved)(fsdp.shard(whole, new.size), saved.model_state, opt_state, saved.step)


def _recut(rows: np.ndarray, shape: tuple, size: int) -> np.ndarray:
  """A leaf's rows of slices (L, ...) as rows of `shape` (L', ...): the first `size` values kept."""
  flat = rows.reshape(-1)[:size]
  out = np.zeros(math.prod(shape), rows.dtype)
  out[:size] = flat
  return out.reshape(shape)
