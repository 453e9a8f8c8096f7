"""Optimizer states of the communication transforms, and reading their statistics."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dlgs_jax.compress import segmented


@jax.tree_util.register_pytree_node_class
class MessageGroups:
  """The leaf paths (and shapes) of each message (group) a transform sends: static, no arrays.

  A pytree node without children, so it rides in a state's structure through
  jit, shard_map and checkpoints, and labels `CommStats.selected` and
  `CommStats.passed` entry by entry. Where the transform keeps a flat buffer
  per group (`DLGSState`, `SparseState`), the shapes say where each leaf lies
  in it (`leaf_residuals`).
  """

  def __init__(self, groups: Sequence[Sequence[str]] = (),
               shapes: Optional[Sequence[Sequence[tuple[int, ...]]]] = None):
    self.paths = tuple(tuple(group) for group in groups)
    self.shapes = (None if shapes is None else
                   tuple(tuple(tuple(int(d) for d in shape) for shape in group)
                         for group in shapes))

  def tree_flatten(self):
    return (), (self.paths, self.shapes)

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    paths, shapes = aux
    return cls(paths, shapes)

  def __eq__(self, other):
    return (isinstance(other, MessageGroups) and other.paths == self.paths
            and other.shapes == self.shapes)

  def __hash__(self):
    return hash((self.paths, self.shapes))

  def __len__(self):
    return len(self.paths)

  def __repr__(self):
    return f"MessageGroups({[list(g) for g in self.paths]})"


class CommStats(NamedTuple):
  """What one worker communicated: the last step, and a running total."""
  bytes_sent: jax.Array      # float32[]: bytes this worker put on the wire this step
  bytes_received: jax.Array  # float32[]: bytes this worker took off the wire this step
  selected: jax.Array        # int32[num_groups]: values this worker sent per group
  passed: jax.Array          # int32[num_groups]: values that met the selection rule (> selected when a buffer overflowed)
  skipped: jax.Array         # int32[]: steps skipped so far because a gradient was not finite
  exact: jax.Array           # int32[]: leaves whose threshold was computed exactly this step (DLGS; 0 for the others)
  total_sent: Any = None     # uint32[2]: bytes sent since init, (low, high) 32-bit words: `total_bytes`
  groups: Any = MessageGroups()  # static: the leaf paths (and shapes) of each group (no arrays)


# How `DLGSState` and `SparseState` keep their residuals, as a run's identity
# names it: checkpoints of runs before flat buffers held a tree of residuals
# shaped like the parameters (and one threshold per leaf) and name no layout.
LAYOUT = "flat buffers per group"


class DLGSState(NamedTuple):
  """State of `dlgs` (Ju et al. 2024, Algorithm 1).

  The residuals of a group's leaves lie end to end in one flat buffer, each
  leaf padded with zeros to a multiple of 32 values (`engine.Layout.buffer`):
  a step adds the gradients into it and selects over it in a fixed number of
  passes. `leaf_residuals` reads them back leaf by leaf.
  """
  count: jax.Array   # int32[]: steps taken (skipped steps not counted)
  residuals: tuple   # per group, float32[buffer] (the residual dtype): error feedback e, what was not sent yet
  thresholds: tuple  # per group, float32[leaves] (budget "layer": H_l of each leaf) or float32[1] (budget "message": the message's), exact every `every` steps
  stats: CommStats
  owner_thresholds: tuple = ()  # per group, float32[]: the owners' global threshold, exact every `every` steps (collective "owners"; () otherwise)


class SparseState(NamedTuple):
  """State of `lags`, `topk` and `gtopk`: residuals as `DLGSState`'s."""
  count: jax.Array   # int32[]: steps taken (skipped steps not counted)
  residuals: tuple   # per group, float32[buffer] (the residual dtype): error feedback e
  stats: CommStats
  owner_thresholds: tuple = ()  # per group, float32[]: the owners' global threshold of the last step (collective "owners"; () otherwise)


class DenseState(NamedTuple):
  """State of `dense`."""
  count: jax.Array   # int32[]: steps taken (skipped steps not counted)
  stats: CommStats


def is_per_worker(node: Any) -> bool:
  """Whether `node` is one of this library's transform states (per worker, with residuals)."""
  return isinstance(node, (DLGSState, SparseState, DenseState, TernGradState, DGCState))


def empty_stats(groups: Sequence[Sequence[str]],
                shapes: Optional[Sequence[Sequence[tuple[int, ...]]]] = None) -> CommStats:
  """The statistics before the first step, for messages of `groups` (lists of leaf paths).

  `shapes`, the leaves' shapes group by group, where the state keeps flat buffers.
  """
  groups = MessageGroups(groups, shapes)
  return CommStats(
      bytes_sent=jnp.zeros((), jnp.float32),
      bytes_received=jnp.zeros((), jnp.float32),
      selected=jnp.zeros((len(groups),), jnp.int32),
      passed=jnp.zeros((len(groups),), jnp.int32),
      skipped=jnp.zeros((), jnp.int32),
      exact=jnp.zeros((), jnp.int32),
      total_sent=jnp.zeros((2,), jnp.uint32),
      groups=groups,
  )


def step_stats(previous: CommStats, sent, received, selected, passed, exact=None) -> CommStats:
  """The statistics of a step that communicated, the running total carried on."""
  return previous._replace(
      bytes_sent=jnp.asarray(sent, jnp.float32), bytes_received=jnp.asarray(received, jnp.float32),
      selected=jnp.asarray(selected, jnp.int32), passed=jnp.asarray(passed, jnp.int32),
      exact=jnp.zeros((), jnp.int32) if exact is None else jnp.asarray(exact, jnp.int32),
      total_sent=_add_bytes(previous.total_sent, sent))


def skipped_stats(previous: CommStats) -> CommStats:
  """The statistics of a skipped step: nothing sent, one more skip, the total kept."""
  return empty_stats(previous.groups.paths, previous.groups.shapes)._replace(
      skipped=previous.skipped + 1, total_sent=previous.total_sent)


def _add_bytes(total: jax.Array, amount) -> jax.Array:
  """``total + round(amount)`` on (low, high) uint32 words, exact below 2^64 bytes."""
  amount = jnp.round(jnp.asarray(amount, jnp.float32))
  high = jnp.floor(amount / 2.0 ** 32)
  low = (amount - high * 2.0 ** 32).astype(jnp.uint32)  # exact: float32 integers
  new_low = total[0] + low
  carry = (new_low < low).astype(jnp.uint32)
  return jnp.stack([new_low, total[1] + high.astype(jnp.uint32) + carry])


def total_bytes(stats: CommStats):
  """Bytes sent since init as Python ints: one, or a list per worker with a worker axis.

  Each step adds its ``bytes_sent`` (a float32: exact below 2^24 bytes a step,
  rounded to float32's 24 significant bits above).
  """
  words = np.asarray(stats.total_sent, np.uint64)
  values = (words[..., 1] << np.uint64(32)) + words[..., 0]
  return int(values) if values.ndim == 0 else [int(v) for v in values]


def comm_stats(opt_state: Any) -> Optional[CommStats]:
  """Finds the `CommStats` inside any optimizer state (e.g. of an `optax.chain`).

  Args:
    opt_state: the state of a transform tree containing one of this library's
      transforms, possibly wrapped (chain, MultiSteps, ...).

  Returns:
    The first `CommStats` found (`comm_stats_by_path` gives them all), or ``None``.
  """
  return next(iter(comm_stats_by_path(opt_state).values()), None)


def comm_stats_by_path(opt_state: Any) -> dict[str, CommStats]:
  """Every `CommStats` inside an optimizer state, keyed by its path in the state.

  A chain with two compressors (e.g. one per parameter subset, through
  ``optax.multi_transform``) has two entries; a path reads as
  ``jax.tree_util.keystr`` writes it (``[0].stats`` for the first link of a chain).
  """
  found = jax.tree_util.tree_flatten_with_path(
      opt_state, is_leaf=lambda x: isinstance(x, CommStats))[0]
  return {jax.tree_util.keystr(path): leaf for path, leaf in found
          if isinstance(leaf, CommStats)}


def stats_summary(stats: CommStats) -> dict[str, float]:
  """Plain-Python numbers for a log line (averaged over a leading worker axis, if any)."""
  def scalar(x):
    return float(np.mean(np.asarray(x)))
  return {
      "bytes_sent": scalar(stats.bytes_sent),
      "bytes_received": scalar(stats.bytes_received),
      "selected": float(np.mean(np.asarray(stats.selected).sum(axis=-1))),
      "passed": float(np.mean(np.asarray(stats.passed).sum(axis=-1))),
      "skipped": float(np.max(np.asarray(stats.skipped))),
      "exact": float(np.mean(np.asarray(stats.exact))),
      "total_sent": float(np.mean(total_bytes(stats))),
  }


def comm_report(opt_state: Any) -> dict[str, dict]:
  """Every transform's statistics as plain Python, groups labelled by their leaf paths.

  Args:
    opt_state: an optimizer state (host arrays, e.g. from `workload.parallel.fetch`),
      with or without a leading worker axis on this library's states.

  Returns:
    A dict from each state's path to its numbers: ``bytes_sent``,
    ``bytes_received``, ``total_sent``, ``skipped`` and ``groups`` (a list of
    dicts with ``paths``, ``selected`` and ``passed``); per step and total,
    averaged over workers when there is a worker axis.
  """
  report = {}
  for path, stats in comm_stats_by_path(opt_state).items():
    summary = stats_summary(stats)
    selected = np.asarray(stats.selected).reshape(-1, len(stats.groups)).mean(0)
    passed = np.asarray(stats.passed).reshape(-1, len(stats.groups)).mean(0)
    report[path] = {
        "bytes_sent": summary["bytes_sent"], "bytes_received": summary["bytes_received"],
        "total_sent": summary["total_sent"], "skipped": summary["skipped"],
        "groups": [{"paths": list(paths), "selected": float(s), "passed": float(p)}
                   for paths, s, p in zip(stats.groups.paths, selected, passed)]}
  return report


def leaf_residuals(state: Any) -> dict[str, Any]:
  """The error-feedback residual of every leaf of a `DLGSState` or `SparseState`, by path.

  Args:
    state: the state (arrays or host arrays), with or without a leading
      worker axis on its buffers.

  Returns:
    ``{leaf path: residual}`` in the leaf's shape, after the worker axis if any.

  Raises:
    ValueError: for a state that keeps no flat residual buffers.
  """
  groups = getattr(getattr(state, "stats", None), "groups", None)
  if not isinstance(state, (DLGSState, SparseState)) or groups is None or groups.shapes is None:
    raise ValueError(f"leaf_residuals reads a DLGSState or SparseState, got "
                     f"{type(state).__name__}")
  out = {}
  for flat, paths, shapes in zip(state.residuals, groups.paths, groups.shapes):
    segs = segmented.segments_of([int(np.prod(shape, dtype=np.int64)) for shape in shapes])
    for path, shape, offset in zip(paths, shapes, segs.offsets):
      size = int(np.prod(shape, dtype=np.int64))
      out[path] = flat[..., offset:offset + size].reshape(flat.shape[:-1] + tuple(shape))
  return out


def with_leaf_residuals(state: Any, residuals: dict[str, Any]) -> Any:
  """`state` whose flat buffers hold `residuals`, given by leaf path: `leaf_residuals`'s inverse.

  Host arrays (NumPy), with any leading axes (a worker axis) before each
  leaf's shape; the leaves' padding in the buffers is zero.

  Args:
    state: a `DLGSState` or `SparseState` (its `stats.groups` say the layout).
    residuals: ``{leaf path: array}`` for every leaf of the state.

  Returns:
    The state with new ``residuals`` buffers, in the old buffers' dtypes.
  """
  groups = state.stats.groups
  buffers = []
  for flat, paths, shapes in zip(state.residuals, groups.paths, groups.shapes):
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    segs = segmented.segments_of(sizes)
    first = np.asarray(residuals[paths[0]])
    lead = first.shape[:first.ndim - len(shapes[0])]
    out = np.zeros(lead + (segs.length,), np.dtype(flat.dtype))
    for path, size, offset in zip(paths, sizes, segs.offsets):
      out[..., offset:offset + size] = np.asarray(residuals[path]).reshape(lead + (size,))
    buffers.append(out)
  return state._replace(residuals=tuple(buffers))


class TernGradState(NamedTuple):
  """State of `terngrad`."""
  count: jax.Array   # int32[]: steps taken (skipped steps not counted)
  key: jax.Array     # uint32[2]: raw PRNG key; folded with the step and worker index each step
  stats: CommStats


class DGCState(NamedTuple):
  """State of `dgc` (Lin et al. 2018)."""
  count: jax.Array   # int32[]: steps taken (skipped steps not counted)
  velocity: Any      # params-shaped tree, float32: momentum u, masked where values were sent
  residuals: Any     # params-shaped tree, float32: accumulated velocity v not sent yet (0 for dense leaves)
  key: jax.Array     # uint32[2]: raw PRNG key for threshold sampling
  stats: CommStats
