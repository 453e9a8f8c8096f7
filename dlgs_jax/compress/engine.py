"""The machinery shared by every communication transform: what is sent.

A transform is described by a static `Layout` (which leaves exist, how they are
grouped), a `Selection` (how a worker picks the values it sends) and a
collective name. `pick` chooses every method's values; `exchange` sends
them, and `transforms.py` wraps both into optax transformations.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlgs_jax.compress import collectives
from dlgs_jax.compress import grouping
from dlgs_jax.compress import rules
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
  whole: tuple[bool, ...]          # per leaf: sent whole (`resolve_whole`)

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
    buckets: bool = False,
    whole=None,
) -> Layout:
  """Builds the `Layout` of `tree` (arrays or shape structs).

  Args:
    tree: the parameter (or gradient) tree.
    groups: leaf-path groups, or ``None``.
    order: backward order of the leaf paths, or ``None``.
    single_group: put every leaf in one group (global top-k methods).
    buckets: with no `groups`, bucket the leaves by size
      (`grouping.size_buckets`) instead of one group per leaf.
    whole: the leaves sent whole, a mask as `check_whole` accepts; None: none.

  Raises:
    ValueError: from `grouping.resolve_groups` or `resolve_whole`, or for an
      empty tree.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if not leaves:
    raise ValueError("the parameter tree has no leaves")
  paths = grouping.leaf_paths(tree)
  sizes = [int(np.prod(leaf.shape, dtype=np.int64)) for leaf in leaves]
  resolved = grouping.resolve_groups(paths, groups, order, sizes if buckets else None)
  if single_group:
    resolved = [[leaf for group in resolved for leaf in group]]
  for leaf, size in zip(leaves, sizes):
    if size >= 2**31:
      raise ValueError(f"a leaf of shape {leaf.shape} is too large for int32 indices")
  return Layout(
      treedef=treedef,
      paths=tuple(paths),
      shapes=tuple(tuple(leaf.shape) for leaf in leaves),
      dtypes=tuple(jnp.result_type(leaf) for leaf in leaves),
      groups=tuple(tuple(group) for group in resolved),
      whole=resolve_whole(whole, tree, paths),
  )


def check_whole(whole):
  """Validates a send-whole mask once, when a transform is built.

  Accepted, as optax's masks are: None (no leaf); a callable taking the
  parameter tree and returning a tree of Python bools like it; a tree of
  bools like the parameters; or, as `groups` name leaves, a list of leaf
  paths (`grouping.leaf_paths`, e.g. `grouping.output_layer`).

  Raises:
    ValueError: for anything else, naming the value and the forms accepted.
  """
  if whole is None or callable(whole):
    return whole
  if isinstance(whole, (list, tuple)) and not whole:
    return None  # no leaf, as None
  if isinstance(whole, (str, bytes)):
    raise ValueError(f"send_whole={whole!r} is a single string: pass a list of leaf paths, "
                     f"e.g. [{whole!r}]")
  if isinstance(whole, (list, tuple)) and whole and all(isinstance(p, str) for p in whole):
    return tuple(whole)
  leaves = jax.tree_util.tree_leaves(whole)
  if not all(isinstance(leaf, (bool, np.bool_)) for leaf in leaves):
    raise ValueError(
        f"send_whole={whole!r} is not a mask: pass a tree of Python bools shaped like the "
        f"parameters, a callable params -> such a tree (e.g. lambda p: jax.tree.map("
        f"lambda x: x.ndim < 2, p) for biases and norms), or a list of leaf paths")
  return whole


def resolve_whole(whole, tree, paths: Sequence[str]) -> tuple[bool, ...]:
  """Per leaf of `tree` (flatten order), whether the mask `whole` sends it whole.

  Raises:
    ValueError: a path the tree lacks, or a mask (or a callable's result)
      that is not a tree of bools shaped like `tree`.
  """
  if whole is None:
    return (False,) * len(paths)
  if isinstance(whole, tuple) and all(isinstance(p, str) for p in whole):
    unknown = sorted(set(whole) - set(paths))
    if unknown:
      raise ValueError(f"send_whole names leaves the tree does not have: {unknown!r}; "
                       f"its leaves are {list(paths)!r}")
    return tuple(path in whole for path in paths)
  mask = whole(tree) if callable(whole) else whole
  treedef = jax.tree_util.tree_structure(tree)
  try:
    flags = treedef.flatten_up_to(mask)
  except (ValueError, TypeError) as e:
    raise ValueError(f"send_whole's mask is not shaped like the parameters ({treedef}): "
                     f"{str(e).splitlines()[0]}") from None
  if not all(isinstance(flag, (bool, np.bool_)) for flag in flags):
    raise ValueError(f"send_whole's mask must hold Python bools (one per leaf), got "
                     f"{[type(f).__name__ for f in flags][:4]}...: decide from shapes and "
                     f"paths (x.ndim < 2), not from values")
  return tuple(bool(flag) for flag in flags)


@dataclasses.dataclass(frozen=True)
class Selection:
  """How a worker picks the values it sends.

  kind:
    "threshold": |g| >= H_l per leaf into a buffer of `capacity(leaf)` (DLGS);
    "layer_topk": exact top-k per leaf (LAGS);
    "group_topk": exact top-k over each whole group (Top-k, gTop-k).

  Every kind selects the same way (`pick`): values at or above a threshold,
  compacted into fixed buffers; a top-k is the threshold recomputed exactly on
  every step (the k-th largest ``|g|``, `segmented.exact_thresholds`) into a
  buffer of k: every value above it, then its ties in index order
  (`segmented.compact_top`) -- no sort. The per-leaf kinds send
  the leaves the layout marks whole (`Layout.whole`) in full, inside the same
  message.
  """
  kind: str
  density: float
  capacity_factor: float = 1.0
  # "threshold" only: how reused thresholds are recomputed and aimed
  # (`rules`); None: the thresholds given are used as they are (DGC).
  rule: Optional[rules.ThresholdRule] = None

  def sent_whole(self, layout: Layout, leaf: int) -> bool:
    return self.kind != "group_topk" and layout.whole[leaf]

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
  `recompute`; otherwise the reused thresholds, as ``select.rule`` says
  (`rules`): kept (`FixedReuse`, `RefreshReuse`) or re-aimed (`AdaptedReuse`,
  `_adapted`, its leaves of small k exact). The group recomputes exactly (one
  conditional per group) when the rule's drift test says so.

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
  rule = select.rule
  ks = [select.leaf_k(layout, leaf) for leaf in leaves]
  whole = [select.sent_whole(layout, leaf) for leaf in leaves]
  sparse = sum(not w for w in whole)
  exact = lambda: segmented.exact_thresholds(values, ks, whole)
  if rule is None or isinstance(rule, rules.FixedReuse):
    thresholds = lax.cond(recompute, exact, lambda: previous)
    return thresholds, values.pack(thresholds), recompute.astype(jnp.int32) * sparse
  capacities = np.array([select.leaf_capacity(layout, leaf) for leaf in leaves])
  adapts = isinstance(rule, rules.AdaptedReuse)
  few = [i for i, (k, w) in enumerate(zip(ks, whole))
         if adapts and k < rule.exact_below_k and not w]
  aimed = [i for i, w in enumerate(whole) if not w and i not in few]
  chosen = _adapted(rule, values, previous, ks, aimed) if adapts and aimed else previous
  if few:
    chosen = chosen.at[np.asarray(few)].set(_exact_subset(values, few, [ks[i] for i in few]))
  words = values.pack(chosen)
  passed = segmented.passing_counts(words, values.segs)
  redo = recompute | rule.drifted(passed, ks, capacities, [not w for w in whole],
                                  previous > 0)

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


def _adapted(rule: rules.AdaptedReuse, values: segmented.Values, previous: jax.Array, ks,
             aimed: Sequence[int]) -> jax.Array:
  """Thresholds of the `aimed` leaves aimed at ``rule.target * k_l`` values, float32 [L].

  The candidates are ``rule.factors()`` multiples of `previous`; their counts
  fall with the threshold. Between the last candidate passing more than the
  target and the next one, the threshold is interpolated linearly (count
  against threshold): below a reused threshold, where the residual piles up,
  the count is close to linear, and interpolating log(count) against
  log(threshold) there overshot to 2-3 times the buffer (ResNet-20, density
  0.01). A leaf whose every candidate passes more (fewer) takes the highest
  (lowest) one. The other leaves (sent whole, or exact on every step) keep
  `previous` and are not counted.
  """
  aimed_at = np.asarray(aimed)
  factors = rule.factors()
  trials = previous[aimed_at][:, None] * factors[None, :]
  strides = [selection.coprime_stride(min(_MAX_COUNT_STRIDE, ks[i] // _COUNTED_NEAR_K),
                                      values.segs.sizes[i]) for i in aimed]
  counts = values.count_at(trials, strides, aimed).astype(jnp.float32) + 0.5
  target = jnp.asarray(rule.target * np.asarray(ks, np.float32)[aimed_at])[:, None]
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


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["values", "positions", "passed"], meta_fields=["capacities"])
@dataclasses.dataclass(frozen=True)
class Picked:
  """A group's values that passed their thresholds, in fixed-capacity slots (`pick`)."""
  values: segmented.Values     # the group's g = e + grad: laid out, or leaf by leaf
  positions: jax.Array         # int32[sum(capacities)]: buffer positions, leaf after leaf; sentinel segs.length
  passed: jax.Array            # int32[L]: values that passed per leaf (> its capacity on overflow)
  capacities: tuple[int, ...]  # slots per leaf

  def local(self) -> list[jax.Array]:
    """Each leaf's slots as indices into the leaf (sentinel: its size)."""
    return segmented.local_indices(self.positions, self.values.segs, self.capacities)


def pick(select: Selection, layout: Layout, accumulated: Sequence[jax.Array],
         previous: Optional[Sequence[jax.Array]] = None,
         recompute: Optional[jax.Array] = None):
  """Every group's values to send, in fixed-capacity slots: one path for every kind.

  DLGS ("threshold") takes `step_thresholds` from `previous` on the schedule
  `recompute` says; LAGS ("layer_topk") the exact k_l-th largest of every leaf
  and Top-k ("group_topk") that of the whole group (one segment), on every
  step. Then one compaction per group (`segmented.compact`).

  Returns:
    ``(thresholds, picked, exact)``: float32 scalars per leaf (DLGS; None for
    the others); per group its `Picked` (for `exchange.sparse_exchange`); the
    int32 number of leaves whose threshold was computed exactly.
  """
  thresholds: list[Any] = [None] * len(layout.sizes)
  picked = []
  exact = jnp.zeros((), jnp.int32)
  for group, leaves in enumerate(layout.groups):
    if select.kind == "group_topk":
      parts = [concat_flat([accumulated[leaf] for leaf in leaves])]
      ks, whole = [select.group_k(layout, group)], [False]
      segs = segmented.segments_of([layout.group_size(group)])
    else:
      parts = [accumulated[leaf] for leaf in leaves]
      ks = [select.leaf_k(layout, leaf) for leaf in leaves]
      whole = [select.sent_whole(layout, leaf) for leaf in leaves]
      segs = segmented.segments_of([layout.sizes[leaf] for leaf in leaves])
    capacities = (tuple(ks) if select.kind == "group_topk" else
                  tuple(select.leaf_capacity(layout, leaf) for leaf in leaves))
    values = segmented.values_of(parts, segs, segmented.lay_out_by_default(segs.length))
    if select.kind == "threshold":
      found, words, group_exact = step_thresholds(
          select, layout, leaves, values, jnp.stack([previous[leaf] for leaf in leaves]),
          recompute)
      exact = exact + group_exact
      for i, leaf in enumerate(leaves):
        thresholds[leaf] = found[i]
      positions, passed = segmented.compact(words, values.segs, capacities)
    else:
      found = segmented.exact_thresholds(values, ks, whole)
      at_or_above = values.pack(found)
      above = values.pack(jnp.nextafter(found, jnp.inf))
      positions, passed = segmented.compact_top(above, at_or_above & ~above, values.segs,
                                                capacities)
    picked.append(Picked(values, positions, passed, capacities))
  return (thresholds if select.kind == "threshold" else None), picked, exact
