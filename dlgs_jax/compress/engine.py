"""The machinery shared by every communication transform: what is sent.

A transform is described by a static `Layout` (which leaves exist, how they are
grouped, and where each leaf lies in its group's flat buffer), a `Selection`
(how a worker picks the values it sends) and a collective name. The sparse
transforms keep each group's error-feedback residual as one flat buffer in
that layout; `accumulate` adds a step's gradients into it once, `pick` chooses
every method's values over the whole buffer, `exchange` sends them, and
`transforms.py` wraps both into optax transformations.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dlgs_jax.compress import grouping
from dlgs_jax.compress import rules
from dlgs_jax.compress import segmented
from dlgs_jax.compress import selection

SELECTIONS = ("threshold", "layer_topk", "group_topk")
# Whose k a DLGS threshold answers for: each leaf's ("layer", the paper's), or
# its message's, one threshold over the group ("message").
BUDGETS = ("layer", "message")
SPARSE_COLLECTIVES = ("allgather", "gtopk", "owners")


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

  def group_shapes(self) -> list[list[tuple[int, ...]]]:
    """The leaf shapes of each group, in group order."""
    return [[self.shapes[leaf] for leaf in group] for group in self.groups]

  def buffer(self, group: int) -> segmented.Segments:
    """Where the group's leaves lie in its flat buffer (each padded to whole words)."""
    return segmented.segments_of([self.sizes[leaf] for leaf in self.groups[group]])

  def lay_out(self, group: int, leaves: Sequence[jax.Array]) -> jax.Array:
    """The group's leaves (taken from the flat leaf list `leaves`) as one float32 buffer."""
    return segmented.lay_out([leaves[leaf] for leaf in self.groups[group]], self.buffer(group))

  def cut(self, group: int, flat: jax.Array) -> dict[int, jax.Array]:
    """A group's flat buffer back into its leaves (leaf index -> array in its shape)."""
    leaves = self.groups[group]
    shapes = [self.shapes[leaf] for leaf in leaves]
    return dict(zip(leaves, segmented.cut(flat, self.buffer(group), shapes)))


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
  # "threshold" only: whose k a threshold answers for (`BUDGETS`): each leaf's
  # k_l ("layer"), or the group's sum_l k_l under one threshold ("message").
  budget: str = "layer"

  @property
  def one_segment(self) -> bool:
    """Whether a group is selected as one segment (Top-k, and DLGS's message budget)."""
    return self.kind == "group_topk" or self.budget == "message"

  def sent_whole(self, layout: Layout, leaf: int) -> bool:
    return not self.one_segment and layout.whole[leaf]

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
    return sum(self.capacities(layout, group))

  def segments(self, layout: Layout, group: int) -> segmented.Segments:
    """The group's buffer cut into what is selected apart: each leaf, or the whole group.

    A group selected as one (`one_segment`) is one segment over the same
    buffer: the leaves' padding is zeros, which never pass.
    """
    buffer = layout.buffer(group)
    if self.one_segment:
      return segmented.Segments((buffer.length,))
    return buffer

  def ks(self, layout: Layout, group: int) -> list[int]:
    """k of each segment (`segments`)."""
    if self.one_segment:
      return [self.group_k(layout, group)]
    return [self.leaf_k(layout, leaf) for leaf in layout.groups[group]]

  def capacities(self, layout: Layout, group: int) -> tuple[int, ...]:
    """Message slots of each segment (`segments`)."""
    if self.kind == "group_topk":
      return (self.group_k(layout, group),)
    if self.one_segment:
      return (min(layout.group_size(group),
                  int(math.ceil(self.capacity_factor * self.group_k(layout, group)))),)
    return tuple(self.leaf_capacity(layout, leaf) for leaf in layout.groups[group])

  def whole(self, layout: Layout, group: int) -> list[bool]:
    """Per segment, whether it is sent whole (`Layout.whole`)."""
    if self.one_segment:
      return [False]
    return [self.sent_whole(layout, leaf) for leaf in layout.groups[group]]


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


class Summed(NamedTuple):
  """g = e + grad of one group in its flat buffer (Algorithm 1, line 4), kept as its two terms.

  Each pass that reads g adds the terms itself, so XLA fuses the sum into the
  pass (the reuse step's selection reads e and the gradient once and writes
  nothing their size), and the new residual is the old one plus the gradient
  -- or plus nothing, on a skipped step -- which XLA writes over the old one in
  place when the state is donated. Written out, g would be one more buffer of
  the model's size, and keeping the old residual on a skipped step a select over it.
  """
  residual: jax.Array          # [buffer], the residuals' dtype: e
  laid: Optional[jax.Array]    # [buffer], the residuals' dtype: the gradient laid out; None: `residual` is g whole

  @property
  def length(self) -> int:
    return self.residual.shape[0]

  def total(self) -> jax.Array:
    """g, float32 [buffer], summed in the residuals' dtype as the residual keeps it."""
    if self.laid is None:
      return self.residual.astype(jnp.float32)
    return (self.residual + self.laid).astype(jnp.float32)

  def at(self, positions: jax.Array) -> jax.Array:
    """g at `positions` (float32; 0 at the sentinel, the buffer's length)."""
    take = lambda x: x.at[positions].get(mode="fill", fill_value=0)
    if self.laid is None:
      return take(self.residual).astype(jnp.float32)
    return (take(self.residual) + take(self.laid)).astype(jnp.float32)

  def samples(self, segs: segmented.Segments, leaves: Sequence[int], strides: Sequence[int]
              ) -> tuple[jax.Array, segmented.Segments]:
    """`segmented.leaf_samples` of g (float32), summed from each term's samples."""
    taken, sample_segs = segmented.leaf_samples(self.residual, segs, leaves, strides)
    if self.laid is not None:
      taken = taken + segmented.leaf_samples(self.laid, segs, leaves, strides)[0]
    return taken.astype(jnp.float32), sample_segs

  def kept(self, applied: Optional[jax.Array]) -> jax.Array:
    """g where the step is `applied` (None: always), e bit for bit where not (float32)."""
    if applied is None:
      return self.total()
    if self.laid is None:
      raise ValueError("a skipped step keeps the old residual: give Summed its two terms")
    # x + -0.0 is x for every x, the sign of a zero included (a subnormal x only
    # where the backend keeps subnormals; XLA:CPU flushes them to zero, so its sums
    # never leave one in a residual).
    return (self.residual + jnp.where(applied, self.laid, -0.0)).astype(jnp.float32)


def accumulate(layout: Layout, group: int, residual: jax.Array,
               grads: Sequence[jax.Array]) -> Summed:
  """g = e + grad of a group in its flat buffer, as its two terms (Algorithm 1, line 4).

  Args:
    layout: the static layout.
    group: the group.
    residual: its flat residual, in the residuals' dtype.
    grads: the flat list of every leaf's gradient.

  The sum is taken in the residuals' dtype, as the residual keeps it.
  """
  return Summed(residual, layout.lay_out(group, grads).astype(residual.dtype))


def propose(select: Selection, layout: Layout, group: int, summed: Summed,
            previous: jax.Array) -> jax.Array:
  """H_l of a group's leaves for this step, as ``select.rule`` proposes from the last ones.

  Reused as they are (`FixedReuse`, `RefreshReuse`) or re-aimed from a few
  candidates (`AdaptedReuse`). Nothing here waits for another group's
  gradients, and nothing is conditional.

  Args:
    select: the "threshold" selection.
    layout: the static layout.
    group: the group.
    summed: g = residual + gradient of the group (`accumulate`).
    previous: float32 [S], the group's thresholds of the last step, one per segment.
  """
  segs = select.segments(layout, group)
  ks, whole = select.ks(layout, group), select.whole(layout, group)
  return select.rule.propose(
      previous, ks=ks, whole=whole,
      count=lambda trials, strides, leaves: segmented.count_samples(
          *summed.samples(segs, leaves, strides), trials, strides),
      sizes=segs.sizes)


def initial_thresholds(select: Selection, layout: Layout, group: int) -> jax.Array:
  """A group's thresholds, one per segment, before its first step: 0, as the paper's list V starts.

  Every nonzero value passes 0, so the first step sends each leaf's first
  values in index order, as many as its buffer holds (what any step sends when
  more than its buffer pass), and keeps the rest owed; its exact thresholds
  are computed from its values (`settle`) and serve from the next step on.
  """
  return jnp.zeros((len(select.ks(layout, group)),), jnp.float32)


def settle(select: Selection, layout: Layout, accumulated: Sequence[Summed],
           picked: Sequence["Picked"], previous: Sequence[jax.Array], recompute: jax.Array
           ) -> tuple[list[jax.Array], jax.Array]:
  """The thresholds every group keeps for the next step: exact where due, else the proposals.

  A group's thresholds are computed exactly (`segmented.exact_thresholds`,
  the k_l-th largest ``|g_l|`` of this step's values) on the schedule's
  exact steps (`recompute`) and when the rule's drift test fails on the
  counts its proposal passed; the leaves the rule names (`every_step`, the
  default's leaves of small k) on every step. The step itself was selected
  with the proposal, so no group's message waits for a threshold computed
  from its own values or from another group's. One conditional for all
  groups runs the exact selects on the steps that need them, after every
  message is out; the few leaves of every step share one select outside it.

  Args:
    select: the "threshold" selection.
    layout: the static layout.
    accumulated: per group, g = residual + gradient (`accumulate`).
    picked: per group, what `pick` chose with the proposal.
    previous: per group, float32 [S], the thresholds this step started from,
      one per segment (`Selection.segments`: a leaf, or the whole message).
    recompute: bool scalar, the schedule's exact step.

  Returns:
    ``(thresholds, exact)``: per group float32 [S]; the int32 number of leaves
    whose threshold was computed exactly this step.
  """
  rule = select.rule
  groups = range(len(accumulated))
  ks = [select.ks(layout, g) for g in groups]
  whole = [select.whole(layout, g) for g in groups]
  few = [rule.every_step(k, w) for k, w in zip(ks, whole)]
  redo, counted = [], jnp.zeros((), jnp.int32)
  for g, (chosen, last) in enumerate(zip(picked, previous)):
    sparse = [not w for w in whole[g]]
    # Leaves recomputed on every step do not vote: their reused threshold is one
    # step old whatever the group does, and a leaf of k = 1 passing three values
    # would otherwise send its group to an exact step nearly every time.
    voting = [s and not f for s, f in zip(sparse, few[g])]
    drifted = rule.drifted(chosen.passed, ks[g], select.capacities(layout, g), voting, last > 0)
    redo.append(recompute | drifted)
    # Counted in leaves: a message's one threshold serves every leaf of it.
    per_segment = len(layout.groups[g]) if select.one_segment else 1
    counted = counted + (jnp.where(redo[-1], sum(sparse), sum(few[g]))
                         * per_segment).astype(jnp.int32)

  def everything(summed, leaves):
    """Exact thresholds of the listed leaves of every group, in one select (flat, in order)."""
    parts, sizes, kept = [], [], []
    for g, terms in enumerate(summed):
      if leaves[g]:
        samples, segs = terms.samples(select.segments(layout, g), leaves[g],
                                      [1] * len(leaves[g]))
        parts.append(samples)
        sizes += segs.sizes
        kept += [ks[g][i] for i in leaves[g]]
    laid = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    return segmented.kth_largest(laid, segmented.Segments(tuple(sizes)), kept)

  def per_group(found, leaves, default):
    out, start = [], 0
    for g, base in enumerate(default):
      n = len(leaves[g])
      out.append(selection.set_at(base, leaves[g], found[start:start + n]) if n else base)
      start += n
    return out

  proposals = [chosen.thresholds for chosen in picked]
  small = [[i for i, f in enumerate(fs) if f] for fs in few]
  if any(small):
    proposals = per_group(everything(accumulated, small), small, proposals)
  sparse_leaves = [[i for i, w in enumerate(ws) if not w] for ws in whole]

  def exact():
    # Every group's sparsified leaves end to end: one select for all of them
    # (a copy of their values, on the steps that recompute only). Leaves sent
    # whole keep their threshold, 0.
    return per_group(everything(accumulated, sparse_leaves), sparse_leaves, proposals)

  found = (lax.cond(functools.reduce(jnp.logical_or, redo), exact, lambda: proposals)
           if any(sparse_leaves) else proposals)
  return [jnp.where(r, f, p) for r, f, p in zip(redo, found, proposals)], counted


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["positions", "passed", "thresholds", "finite"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Picked:
  """A group's values that passed their thresholds, in fixed-capacity slots (`pick`)."""
  positions: jax.Array   # int32[sum(capacities)]: positions in the group's buffer, segment after segment; sentinel: the buffer's length
  passed: jax.Array      # int32[segments]: values that passed per segment (> its capacity on overflow)
  thresholds: Any        # float32[S]: the thresholds DLGS selected with, one per segment; None for the other kinds
  finite: jax.Array      # bool[]: every value of this worker's g in the group is finite


def pick(select: Selection, layout: Layout, group: int, summed: Summed,
         previous: Optional[jax.Array] = None) -> Picked:
  """A group's values to send, in fixed-capacity slots: one path for every kind.

  DLGS ("threshold") selects at the thresholds its rule proposes from
  `previous` (`propose`; `settle` then decides the next ones); LAGS
  ("layer_topk") at the exact k_l-th largest of every leaf and Top-k
  ("group_topk") at that of the whole group (one segment), on every step.
  Then one compaction over the buffer (`segmented.compact`).

  Args:
    select: the selection.
    layout: the static layout.
    group: the group.
    summed: g = residual + gradient of the group (`accumulate`).
    previous: DLGS only: float32 [S], the group's thresholds of the last step (per segment).
  """
  segs = select.segments(layout, group)
  ks, capacities = select.ks(layout, group), select.capacities(layout, group)
  if select.kind == "threshold":
    proposal = propose(select, layout, group, summed, previous)
    words, finite = segmented.pack_finite(summed.total(), proposal, segs)
    positions, passed = segmented.compact(words, segs, capacities)
    return Picked(positions, passed, proposal, finite)
  flat = summed.total()
  positions, passed = segmented.top(flat, segs, ks, capacities, select.whole(layout, group))
  return Picked(positions, passed, None, segmented.finite(flat))


def pick_at(select: Selection, layout: Layout, group: int, summed: Summed,
            thresholds: jax.Array) -> Picked:
  """A group's values at or above thresholds given as they are (DGC's estimates).

  Args:
    select: the selection (its capacities size the slots).
    layout: the static layout.
    group: the group.
    summed: its values laid out in its buffer.
    thresholds: float32 [L], one per leaf of the group.
  """
  segs = layout.buffer(group)
  words, finite = segmented.pack_finite(summed.total(), thresholds, segs)
  positions, passed = segmented.compact(words, segs, select.capacities(layout, group))
  return Picked(positions, passed, thresholds, finite)

