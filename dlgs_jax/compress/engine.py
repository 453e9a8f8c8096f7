"""The machinery shared by every communication transform.

A transform is described by a static `Layout` (which leaves exist, how they are
grouped), a `Selection` (how a worker picks the values it sends) and a
collective name. `sparse_exchange` and `dense_exchange` run one step of it on
flat leaf lists; `transforms.py` wraps them into optax transformations.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlgs_jax.compress import collectives
from dlgs_jax.compress import grouping
from dlgs_jax.compress import segmented
from dlgs_jax.compress import selection
from dlgs_jax.compress import wire

SELECTIONS = ("threshold", "layer_topk", "group_topk")
SPARSE_COLLECTIVES = ("allgather", "gtopk")


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static description of a parameter tree and its grouping."""
  treedef: Any
  paths: tuple[str, ...]           # leaf paths in flatten order
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[Any, ...]
  groups: tuple[tuple[int, ...], ...]  # flat leaf indices, groups in backward order

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(int(np.prod(shape, dtype=np.int64)) for shape in self.shapes)

  def group_size(self, group: int) -> int:
    return sum(self.sizes[leaf] for leaf in self.groups[group])

  def group_paths(self) -> list[list[str]]:
    """The leaf paths of each group, in group order (what `CommStats.groups` labels)."""
    return [[self.paths[leaf] for leaf in group] for group in self.groups]


def make_layout(
    tree: Any,
    groups: Optional[Sequence[Sequence[str]]],
    order: Optional[Sequence[str]],
    *,
    single_group: bool = False,
) -> Layout:
  """Builds the `Layout` of `tree` (arrays or shape structs).

  Args:
    tree: the parameter (or gradient) tree.
    groups: leaf-path groups, or ``None``.
    order: backward order of the leaf paths, or ``None``.
    single_group: put every leaf in one group (global top-k methods).

  Raises:
    ValueError: from `grouping.resolve_groups`, or for an empty tree.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if not leaves:
    raise ValueError("the parameter tree has no leaves")
  paths = grouping.leaf_paths(tree)
  resolved = grouping.resolve_groups(paths, groups, order)
  if single_group:
    resolved = [[leaf for group in resolved for leaf in group]]
  for leaf in leaves:
    if int(np.prod(leaf.shape, dtype=np.int64)) >= 2**31:
      raise ValueError(f"a leaf of shape {leaf.shape} is too large for int32 indices")
  return Layout(
      treedef=treedef,
      paths=tuple(paths),
      shapes=tuple(tuple(leaf.shape) for leaf in leaves),
      dtypes=tuple(jnp.result_type(leaf) for leaf in leaves),
      groups=tuple(tuple(group) for group in resolved),
  )


@dataclasses.dataclass(frozen=True)
class Selection:
  """How a worker picks the values it sends.

  kind:
    "threshold": |g| >= H_l per leaf into a buffer of `capacity(leaf)` (DLGS);
    "layer_topk": exact top-k per leaf (LAGS);
    "group_topk": exact top-k over each whole group (Top-k, gTop-k).
  """
  kind: str
  density: float
  capacity_factor: float = 1.0
  # "threshold" only: recompute a group's reused thresholds early when they
  # pass too few values (`_drifted`); None: the paper's fixed schedule.
  refresh_below: Optional[float] = None
  # Per-leaf kinds only: leaves with fewer dimensions (biases, normalisation
  # scales) are sent whole, inside the same message.
  min_ndim: int = 0
  # Per-leaf kinds only: leaves with these paths (e.g. the classifier head) are
  # sent whole, inside the same message.
  whole_paths: frozenset = frozenset()
  # "threshold" with refresh_below only: thresholds tried per leaf on a reuse
  # step, multiples of the reused one (`candidate_factors`); 1: the refresh rule.
  candidates: int = 1

  def sent_whole(self, layout: Layout, leaf: int) -> bool:
    return self.kind != "group_topk" and (
        len(layout.shapes[leaf]) < self.min_ndim or layout.paths[leaf] in self.whole_paths)

  def check_paths(self, layout: Layout) -> None:
    """Raises ValueError when a path of `whole_paths` is not a leaf of the tree."""
    unknown = sorted(set(self.whole_paths) - set(layout.paths))
    if unknown:
      raise ValueError(f"send_whole names leaves the tree does not have: {unknown!r}; "
                       f"its leaves are {list(layout.paths)!r}")

  def leaf_k(self, layout: Layout, leaf: int) -> int:
    size = layout.sizes[leaf]
    if self.sent_whole(layout, leaf):
      return size
    return selection.num_to_keep(self.density, size)

  def leaf_capacity(self, layout: Layout, leaf: int) -> int:
    k = self.leaf_k(layout, leaf)
    if self.kind == "threshold":
      return min(layout.sizes[leaf], int(math.ceil(self.capacity_factor * k)))
    return k

  def group_k(self, layout: Layout, group: int) -> int:
    """Values the group keeps globally (k of gTop-k)."""
    if self.kind == "group_topk":
      return selection.num_to_keep(self.density, layout.group_size(group))
    return sum(self.leaf_k(layout, leaf) for leaf in layout.groups[group])

  def buffer_length(self, layout: Layout, group: int) -> int:
    """Pairs a worker puts in the group's message before the collective."""
    if self.kind == "group_topk":
      return self.group_k(layout, group)
    return sum(self.leaf_capacity(layout, leaf) for leaf in layout.groups[group])


def concat_flat(leaves: Sequence[jax.Array]) -> jax.Array:
  if len(leaves) == 1:
    return leaves[0].reshape(-1)
  dtype = jnp.result_type(*leaves)
  return jnp.concatenate([leaf.reshape(-1).astype(dtype) for leaf in leaves])


def split_flat(layout: Layout, group: int, flat: jax.Array) -> dict[int, jax.Array]:
  """Cuts a group's flat vector back into its leaves (leaf index -> array)."""
  out = {}
  offset = 0
  for leaf in layout.groups[group]:
    size = layout.sizes[leaf]
    out[leaf] = flat[offset:offset + size].reshape(layout.shapes[leaf])
    offset += size
  return out


def lay_out_by_default() -> bool:
  """Whether selection lays every leaf out in one buffer on this backend (`segmented.Values`).

  On accelerators one pass over one buffer replaces a few kernels per leaf; on
  CPU, where launches cost nothing, passes over the leaves as they are avoid
  writing a copy of the model that XLA:CPU allocates afresh every step.
  """
  return jax.default_backend() != "cpu"


def candidate_factors(candidates: int) -> np.ndarray:
  """Multipliers of a reused threshold tried on a reuse step: ``2^(j/8)``, two thirds below 1.

  Below, because right after an exact step the values sent leave the residual
  and the old threshold passes too few values (ResNet-20, density 0.1: 38% of k).
  Close together, because error feedback piles the residual up just below the
  threshold, where a few percent change the count several-fold.
  """
  below = (2 * (candidates - 1) + 2) // 3
  return (2.0 ** (np.arange(-below, candidates - below) / 8)).astype(np.float32)


# Leaves that keep fewer values than this take their exact threshold on every
# step, without the candidates: their counts move by whole values, too coarse
# to aim with. With candidates, 32 of ResNet-20's 39 BatchNorm leaves (k = 1 at
# density 0.01) passed nothing on a reuse step, and accuracy fell ~4 points;
# picking the candidate that passed one value instead overflowed on nearly
# every step. Their values are few (ResNet-20: 2.4K of 270K).
ALWAYS_EXACT_BELOW_K = 16


# Counting candidates on every stride-th value keeps about this many values of
# a leaf near k_l in the count: a relative error of ~3%, against the ~9% step
# between candidates.
_COUNTED_NEAR_K = 1024
_MAX_COUNT_STRIDE = 15


def step_thresholds(
    select: Selection, layout: Layout, leaves: Sequence[int], values: segmented.Values,
    previous: jax.Array, recompute: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """H_l of a group's leaves for this step, all of them at once.

  The exact k_l-th largest ``|g_l|`` (`segmented.exact_thresholds`) when
  `recompute`; otherwise the reused thresholds, adapted when
  ``select.refresh_below`` is set (`_adapted`): each leaf counts the values
  passing at ``select.candidates`` multiples of its threshold and
  interpolates between the two that bracket its target count, and leaves of
  k_l < `ALWAYS_EXACT_BELOW_K` take their exact threshold. The group
  recomputes exactly (one conditional per group) when `_drifted` says so.
  With one candidate this is the refresh rule; without ``refresh_below`` the
  paper's fixed schedule.

  Args:
    select: the "threshold" selection.
    layout: the static layout.
    leaves: the group's leaf indices, L of them.
    values: g = residual + gradient of those leaves.
    previous: float32 [L], their thresholds of the last step.
    recompute: bool scalar, the schedule's exact step.

  Returns:
    ``(thresholds, words, exact)``: float32 [L]; the packed passing masks
    (`segmented.pack`) at those thresholds; int32 number of leaves whose
    threshold was computed exactly.
  """
  ks = [select.leaf_k(layout, leaf) for leaf in leaves]
  whole = [select.sent_whole(layout, leaf) for leaf in leaves]
  sparse = sum(not w for w in whole)
  exact = lambda: segmented.exact_thresholds(values, ks, whole)
  if select.refresh_below is None:
    thresholds = lax.cond(recompute, exact, lambda: previous)
    return thresholds, values.pack(thresholds), recompute.astype(jnp.int32) * sparse
  capacities = np.array([select.leaf_capacity(layout, leaf) for leaf in leaves])
  few = [i for i, (k, w) in enumerate(zip(ks, whole))
         if k < ALWAYS_EXACT_BELOW_K and not w and select.candidates > 1]
  aimed = [i for i, w in enumerate(whole) if not w and i not in few]
  chosen = _adapted(select, values, previous, ks, aimed)
  if few:
    chosen = chosen.at[np.asarray(few)].set(_exact_subset(values, few, [ks[i] for i in few]))
  words = values.pack(chosen)
  passed = segmented.passing_counts(words, values.segs)
  redo = recompute | _drifted(select, passed, ks, capacities, whole, previous > 0)

  def recomputed():
    thresholds = exact()
    return thresholds, values.pack(thresholds)

  thresholds, words = lax.cond(redo, recomputed, lambda: (chosen, words))
  return thresholds, words, jnp.where(redo, sparse, len(few)).astype(jnp.int32)


def _exact_subset(values: segmented.Values, leaves: Sequence[int], ks) -> jax.Array:
  """`segmented.exact_thresholds` of some of a group's leaves (float32 [len(leaves)])."""
  sizes = [values.segs.sizes[i] for i in leaves]
  subset = segmented.values_of([values.leaf(i) for i in leaves], segmented.segments_of(sizes),
                               values.flat is not None)
  return segmented.exact_thresholds(subset, ks, [False] * len(leaves))


# With adaptation a leaf may pass up to this many times its buffer before its
# group recomputes: the buffer then holds the first passing values in index
# order, all of them among the leaf's ~2 k_l largest, and the rest wait in the
# residual.
OVERFLOW_FACTOR = 2


def _drifted(select: Selection, passed: jax.Array, ks, capacities, whole, live: jax.Array
             ) -> jax.Array:
  """Whether a group's reused thresholds are too far off, bool scalar.

  The refresh rule (one candidate) checks each leaf: fewer than
  ``refresh_below * k_l`` or more than its buffer. Adapted thresholds re-aim
  every step, so one leaf off by a little for one step is corrected on the
  next; asking every leaf of a merged group to land in its band made a group
  of ResNet-20's 59 leaves recompute on every step at density 0.01 (and 0.1).
  With adaptation the group recomputes when its leaves together send fewer
  than ``refresh_below`` of the group's k, or one leaf passes more than
  `OVERFLOW_FACTOR` times its buffer.

  A leaf whose threshold is 0 (`live` false: its last exact step found fewer
  than k_l nonzero values) sends every nonzero value it has, so it cannot
  send too few: it counts in neither the leaf's check nor the group's (a
  ResNet-50 whose last BatchNorm scale of each block starts at zero has many
  such kernels in its first steps; recomputing cannot make them send more).
  """
  sparse = ~np.asarray(whole)
  ks = np.asarray(ks)
  if select.candidates == 1:
    low = np.ceil(select.refresh_below * ks).astype(np.int64)
    return jnp.any((((passed < low) & live) | (passed > capacities)) & sparse)
  counted = live & sparse
  sent = jnp.sum(jnp.where(counted, jnp.minimum(passed, capacities), 0))
  short = sent < jnp.ceil(select.refresh_below * jnp.sum(jnp.where(counted, ks, 0)))
  overflow = jnp.any((passed > OVERFLOW_FACTOR * capacities) & sparse)
  return short | overflow


def _adapted(select: Selection, values: segmented.Values, previous: jax.Array, ks,
             aimed: Sequence[int]) -> jax.Array:
  """Thresholds of the `aimed` leaves aimed at `adaptation_target` values, float32 [L].

  The candidates are `candidate_factors` multiples of `previous`; their counts
  fall with the threshold. Between the last candidate passing more than the
  target and the next one, the threshold is interpolated linearly (count
  against threshold): below a reused threshold, where the residual piles up,
  the count is close to linear, and interpolating log(count) against
  log(threshold) there overshot to 2-3 times the buffer (ResNet-20, density
  0.01). A leaf whose every candidate passes more (fewer) takes the highest
  (lowest) one. The other leaves (sent whole, or exact on every step) keep
  `previous` and are not counted.
  """
  if select.candidates == 1 or not aimed:
    return previous
  aimed_at = np.asarray(aimed)
  factors = candidate_factors(select.candidates)
  trials = previous[aimed_at][:, None] * factors[None, :]
  strides = [selection.coprime_stride(min(_MAX_COUNT_STRIDE, ks[i] // _COUNTED_NEAR_K),
                                      values.segs.sizes[i]) for i in aimed]
  counts = values.count_at(trials, strides, aimed).astype(jnp.float32) + 0.5
  target = jnp.asarray(adaptation_target(select) * np.asarray(ks, np.float32)[aimed_at])[:, None]
  last_above = jnp.sum(counts > target, axis=1) - 1
  lo = jnp.clip(last_above, 0, len(factors) - 2)[:, None]
  c_lo = jnp.take_along_axis(counts, lo, axis=1)
  c_hi = jnp.take_along_axis(counts, lo + 1, axis=1)
  rise = c_lo - target
  span = c_lo - c_hi
  part = jnp.where(span > 0, rise / jnp.where(span > 0, span, 1.0), (rise > 0).astype(jnp.float32))
  part = jnp.clip(part, 0.0, 1.0)[:, 0]
  f_lo = jnp.asarray(factors)[lo[:, 0]]
  f_hi = jnp.asarray(factors)[lo[:, 0] + 1]
  return previous.at[aimed_at].set(previous[aimed_at] * (f_lo + part * (f_hi - f_lo)))


# Adapted thresholds aim below k_l: a leaf passing more than its buffer sends
# its first passing values in index order, not its largest, and a linear
# interpolation lands under its target where the counts are convex (the tail).
_AIM = 0.9


def adaptation_target(select: Selection) -> float:
  """Values an adapted threshold aims to pass, as a fraction of k_l (within the band)."""
  return max(_AIM, select.refresh_below)


def threshold_indices(select: Selection, layout: Layout, leaves: Sequence[int],
                      values: segmented.Values, words: jax.Array
                      ) -> tuple[list[jax.Array], jax.Array]:
  """Each leaf's buffer of passing indices (local, sentinel = its size) and its passed count."""
  capacities = [select.leaf_capacity(layout, leaf) for leaf in leaves]
  positions, passed = segmented.compact(words, values.segs, capacities)
  return segmented.local_indices(positions, values.segs, capacities), passed


def select_threshold(select: Selection, layout: Layout, accumulated: Sequence[jax.Array],
                     previous: Sequence[jax.Array], recompute: jax.Array):
  """DLGS's selection, group by group: `step_thresholds`, then `threshold_indices`.

  Returns:
    ``(thresholds, chosen, exact)``: float32 scalars per leaf; per leaf its
    index buffer and passed count (for `sparse_exchange`); the int32 number of
    leaves whose threshold was computed exactly.
  """
  thresholds: list[Any] = [None] * len(layout.sizes)
  chosen: list[Any] = [None] * len(layout.sizes)
  exact = jnp.zeros((), jnp.int32)
  for leaves in layout.groups:
    values = segmented.values_of([accumulated[leaf] for leaf in leaves],
                                 segmented.segments_of([layout.sizes[leaf] for leaf in leaves]),
                                 lay_out_by_default())
    found, words, group_exact = step_thresholds(
        select, layout, leaves, values, jnp.stack([previous[leaf] for leaf in leaves]),
        recompute)
    indices, passed = threshold_indices(select, layout, leaves, values, words)
    for i, leaf in enumerate(leaves):
      thresholds[leaf] = found[i]
      chosen[leaf] = (indices[i], passed[i])
    exact = exact + group_exact
  return thresholds, chosen, exact


def sparse_exchange(
    layout: Layout,
    select: Selection,
    collective: str,
    accumulated: Sequence[jax.Array],
    thresholds: Optional[Sequence[jax.Array]],
    *,
    axis_name,
    chosen: Optional[Sequence[tuple[jax.Array, jax.Array]]] = None,
    wire_dtype: str = "float32",
):
  """One sparse communication step over all groups.

  Each group is one collective. With the all-gather and a layer-wise rule
  ("threshold", "layer_topk") the message holds each leaf's buffer in turn,
  indices local to the leaf (`collectives.sparse_allgather_means`); otherwise
  indices point into the concatenation of the group's leaves.

  Args:
    layout: the static layout.
    select: the selection rule.
    collective: "allgather" or "gtopk".
    accumulated: flat list of g = residual + gradient per leaf.
    thresholds: H_l per leaf (float32 scalars) for the "threshold" rule.
    axis_name: the data-parallel axis.
    chosen: for the "threshold" rule, per leaf its index buffer and the
      int32 number of values that passed (`select_threshold`); without it
      each leaf's buffer is selected here from `thresholds`.
    wire_dtype: the all-gather's value dtype; with "bfloat16" what rounding a
      sent value loses stays in the residual.

  Returns:
    ``(means, residuals, selected, passed, bytes_sent, bytes_received)``:
    leaf lists of the worker mean (float32) and of the new residual, int32
    arrays [num_groups], and float32 scalars.
  """
  workers = collectives.num_workers(axis_name)
  rank = collectives.worker_index(axis_name)
  means: list[Any] = [None] * len(layout.paths)
  residuals: list[Any] = [None] * len(layout.paths)
  selected, passed = [], []
  bytes_sent = jnp.zeros((), jnp.float32)
  bytes_received = jnp.zeros((), jnp.float32)

  def leaf_indices(leaf):
    """(int32[slots] local indices with sentinel = leaf size, int32 passed)."""
    if select.kind == "threshold":
      capacity = select.leaf_capacity(layout, leaf)
      if chosen is not None:
        return chosen[leaf]
      return selection.threshold_indices(accumulated[leaf], thresholds[leaf], capacity)
    local = selection.topk_indices(accumulated[leaf], select.leaf_k(layout, leaf))
    return local, jnp.asarray(local.shape[0], jnp.int32)

  for group, leaves in enumerate(layout.groups):
    size = layout.group_size(group)
    if select.kind != "group_topk" and collective == "allgather":
      # Layer-wise selection needs no dense concatenation of the group: each
      # leaf's pairs go into its own slots of the one message, and its mean and
      # residual are scattered in place (on ResNet-50 the concatenation and
      # the split back cost more than the reuse step's selection).
      sent, leaf_passed = zip(*(leaf_indices(leaf) for leaf in leaves))
      flats = [accumulated[leaf].reshape(-1) for leaf in leaves]
      values = jnp.concatenate([g.at[i].get(mode="fill", fill_value=0).astype(jnp.float32)
                                for g, i in zip(flats, sent)])
      indices = jnp.concatenate(sent)
      segments = [(i.shape[0], layout.sizes[leaf]) for leaf, i in zip(leaves, sent)]
      group_means = collectives.sparse_allgather_means(values, indices, segments,
                                                       axis_name=axis_name, wire_dtype=wire_dtype)
      kept = _split_like(_unsent(values, wire_dtype), sent)
      for leaf, g, i, mean, k in zip(leaves, flats, sent, group_means, kept):
        means[leaf] = mean.reshape(layout.shapes[leaf])
        residuals[leaf] = g.at[i].set(k.astype(g.dtype), mode="drop").reshape(
            layout.shapes[leaf])
      group_selected = sum(selection.count_valid(i, layout.sizes[leaf])
                           for leaf, i in zip(leaves, sent))
      group_passed = sum(leaf_passed)
      sent_bytes = received_bytes = wire.allgather_bytes(indices.shape[0], workers, wire_dtype)
    else:
      flat = concat_flat([accumulated[leaf] for leaf in leaves])
      if select.kind == "group_topk":
        indices = selection.topk_indices(flat, select.group_k(layout, group))
        group_passed = jnp.asarray(indices.shape[0], jnp.int32)
      else:
        parts, group_passed, offset = [], jnp.zeros((), jnp.int32), 0
        for leaf in leaves:
          leaf_size = layout.sizes[leaf]
          local, leaf_passed = leaf_indices(leaf)
          parts.append(jnp.where(local < leaf_size, local + offset, size))
          group_passed = group_passed + leaf_passed
          offset += leaf_size
        indices = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
      values = flat.at[indices].get(mode="fill", fill_value=0)
      kept = jnp.zeros((), flat.dtype)
      if collective == "allgather":
        mean = collectives.sparse_allgather_mean(values, indices, size, axis_name=axis_name,
                                                 wire_dtype=wire_dtype)
        sent, kept = indices, _unsent(values.astype(jnp.float32), wire_dtype).astype(flat.dtype)
        sent_bytes = received_bytes = wire.allgather_bytes(indices.shape[0], workers, wire_dtype)
      else:
        k = select.group_k(layout, group)
        mean, sent = collectives.gtopk_mean(flat, values, indices, k, axis_name=axis_name)
        sent_bytes, received_bytes = wire.gtopk_bytes(k, workers, rank)
      residual = flat.at[sent].set(kept, mode="drop")
      means_group = split_flat(layout, group, mean)
      residual_group = split_flat(layout, group, residual)
      for leaf in leaves:
        means[leaf] = means_group[leaf]
        residuals[leaf] = residual_group[leaf].astype(accumulated[leaf].dtype)
      group_selected = selection.count_valid(sent, size)
    selected.append(group_selected)
    passed.append(group_passed)
    bytes_sent = bytes_sent + sent_bytes
    bytes_received = bytes_received + received_bytes
  return (means, residuals, jnp.stack(selected), jnp.stack(passed),
          bytes_sent, bytes_received)


def _unsent(values: jax.Array, wire_dtype: str):
  """What rounding float32 `values` to the wire's dtype loses (0 for float32)."""
  if wire_dtype == "float32":
    return jnp.zeros((), values.dtype)
  return values - values.astype(jnp.bfloat16).astype(values.dtype)


def _split_like(kept: jax.Array, parts: Sequence[jax.Array]) -> list:
  """`kept` cut like the concatenation of `parts` (a scalar is every part's)."""
  if kept.ndim == 0:
    return [kept] * len(parts)
  bounds = list(itertools.accumulate(p.shape[0] for p in parts))[:-1]
  return jnp.split(kept, bounds)


def dense_exchange(layout: Layout, updates: Sequence[jax.Array], *, axis_name,
                   wire_dtype: Optional[str] = None):
  """Mean all-reduce with tensor fusion: one collective per group.

  Args:
    layout: the static layout.
    updates: one worker's leaves.
    axis_name: the data-parallel axis.
    wire_dtype: the dtype summed on the wire ("bfloat16": the usual bf16
      all-reduce); None: the leaves' own.

  Returns:
    ``(means, bytes_sent, bytes_received)``.
  """
  workers = collectives.num_workers(axis_name)
  means: list[Any] = [None] * len(layout.paths)
  total_bytes = 0.0
  for group, leaves in enumerate(layout.groups):
    flat = concat_flat([updates[leaf] for leaf in leaves])
    if wire_dtype is not None:
      flat = flat.astype(wire_dtype)
    mean = collectives.dense_mean(flat, axis_name=axis_name)
    for leaf, value in split_flat(layout, group, mean).items():
      means[leaf] = value
    total_bytes += wire.allreduce_bytes(flat.shape[0], workers, flat.dtype.itemsize)
  sent = jnp.asarray(total_bytes, jnp.float32)
  return means, sent, sent
