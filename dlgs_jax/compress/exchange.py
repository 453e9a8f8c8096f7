"""One communication step of a transform: messages, collectives, means and residuals.

`sparse_exchange` sends what a `engine.Selection` picks, group by group, and
gives back the mean over workers and the new residual of every leaf;
`dense_exchange` all-reduces groups densely (tensor fusion). Both work on
flat leaf lists in the order of an `engine.Layout`.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from dlgs_jax.compress import collectives, common, engine, segmented, selection, wire
from dlgs_jax.compress.engine import Layout, Selection, concat_flat, split_flat


class Exchanged(NamedTuple):
  """One sparse communication step's results (`sparse_exchange`)."""
  means: list                # per leaf, float32 in its shape: the mean over workers (zeros when not applied)
  residuals: list            # per leaf, its residual's dtype: the new residual (the old one when not applied)
  selected: jax.Array        # int32[num_groups]: values this worker sent per group
  passed: jax.Array          # int32[num_groups]: values that met the selection rule (> selected on overflow)
  bytes_sent: jax.Array      # float32[]: bytes this worker put on the wire
  bytes_received: jax.Array  # float32[]: bytes this worker took off the wire
  applied: jax.Array         # bool[]: the step counted (every worker's gradients and message finite)


class _Message(NamedTuple):
  """A group's pairs before its collective."""
  values: jax.Array   # float[c]: the values sent, slot after slot
  indices: Any        # layer-wise: one int32 index buffer per leaf (local); else int32[c] into the group
  passed: jax.Array   # int32[]: values that met the rule
  flats: Any          # layer-wise: the leaves' accumulated values, flat; laid out: its `segmented.Values`; else the group's concatenation
  checked: list       # the arrays holding every value of g = e + grad the group sends from


def sparse_exchange(
    layout: Layout,
    select: Selection,
    collective: str,
    accumulated: Sequence[jax.Array],
    thresholds: Optional[Sequence[jax.Array]],
    *,
    axis_name,
    picked: Optional[Sequence[engine.Picked]] = None,
    wire_dtype: str = "float32",
    previous: Optional[Sequence[jax.Array]] = None,
    skip_nonfinite: bool = False,
) -> Exchanged:
  """One sparse communication step over all groups.

  Each group is one collective. With the all-gather and a layer-wise rule
  ("threshold", "layer_topk") the message holds each leaf's buffer in turn.
  A group DLGS selected laid out in one buffer (`engine.Picked`) sends
  positions in that buffer, and its mean and residual are one scatter each
  over it, cut back into leaves: kernels do not grow with its leaves. Leaf by
  leaf, indices are local to each leaf (`collectives.sparse_allgather_means`)
  and each leaf is scattered in place. Otherwise (Top-k, gTop-k) indices
  point into the concatenation of the group's leaves.

  With `skip_nonfinite`, a step is skipped on every worker when any worker's
  g = residual + gradient holds a value that is not finite (a NaN or an
  infinity in a gradient, or a sum past the range): one flag is summed over
  workers, and it masks the received pairs and the k-sized residual writes --
  not the dense means -- while each group's collective still waits for its
  own values only. A group laid out in one buffer is checked in one pass.

  Args:
    layout: the static layout.
    select: the selection rule.
    collective: "allgather" or "gtopk".
    accumulated: flat list of g = residual + gradient per leaf.
    thresholds: H_l per leaf (float32 scalars) for the "threshold" rule.
    axis_name: the data-parallel axis.
    picked: each group's selection (`engine.pick`); without it (DGC) each
      leaf's buffer is selected here from `thresholds`.
    wire_dtype: the all-gather's value dtype; with "bfloat16" what rounding a
      sent value loses stays in the residual.
    previous: the old residual per leaf, kept when the step is skipped
      (needed with `skip_nonfinite`).
    skip_nonfinite: skip steps whose values are not finite; False: every
      step is applied.

  Returns:
    `Exchanged`.
  """
  layer_wise = select.kind != "group_topk" and collective == "allgather"
  where = {leaf: (group, i) for group, leaves in enumerate(layout.groups)
           for i, leaf in enumerate(leaves)}
  local = {}  # group -> its leaves' index buffers, cut once

  def leaf_indices(leaf):
    """(int32[slots] local indices with sentinel = leaf size, int32 passed)."""
    if picked is not None:
      group, i = where[leaf]
      if group not in local:
        local[group] = picked[group].local()
      return local[group][i], picked[group].passed[i]
    # Thresholds given as they are (DGC's estimates).
    return segmented.threshold_indices(accumulated[leaf], thresholds[leaf],
                                       select.leaf_capacity(layout, leaf))

  def sender(group):
    # A float32 group only: the buffer is float32 (`segmented.lay_out`).
    if (layer_wise and picked is not None and picked[group].values.flat is not None
        and all(accumulated[leaf].dtype == jnp.float32 for leaf in layout.groups[group])):
      return _laid_out_message, _send_laid_out
    if layer_wise:
      return _layer_wise_message, _send_layer_wise
    return _group_message, _send_group

  # Every group's message first: the flag that skips a step needs all of them.
  messages = [sender(group)[0](layout, select, group, accumulated, leaf_indices, picked)
              for group in range(len(layout.groups))]
  applied = None
  if skip_nonfinite:
    applied = common.all_finite([a for m in messages for a in m.checked], axis_name)

  means: list[Any] = [None] * len(layout.paths)
  residuals: list[Any] = [None] * len(layout.paths)
  selected, passed, sent_bytes, received_bytes = [], [], [], []
  for group, message in enumerate(messages):
    send = sender(group)[1]
    count, bytes_out, bytes_in = send(layout, select, collective, group, message, means,
                                      residuals, axis_name=axis_name, wire_dtype=wire_dtype,
                                      applied=applied, previous=previous)
    selected.append(count)
    passed.append(message.passed)
    sent_bytes.append(bytes_out)
    received_bytes.append(bytes_in)
  return Exchanged(means, residuals, jnp.stack(selected), jnp.stack(passed),
                   _total(sent_bytes), _total(received_bytes),
                   jnp.ones((), jnp.bool_) if applied is None else applied)


def _total(amounts) -> jax.Array:
  return sum(amounts, jnp.zeros((), jnp.float32))


def _laid_out_message(layout, select, group, accumulated, leaf_indices, picked) -> _Message:
  del select, accumulated, leaf_indices
  chosen = picked[group]
  values = chosen.values.flat.at[chosen.positions].get(mode="fill", fill_value=0.0)
  return _Message(values, chosen.positions, jnp.sum(chosen.passed), chosen.values,
                  [chosen.values.flat])


def _send_laid_out(layout, select, collective, group, message, means, residuals, *,
                   axis_name, wire_dtype, applied, previous):
  """A laid-out group's all-gather: one scatter for its mean and one for its residual."""
  del select, collective
  leaves = layout.groups[group]
  segs, flat, positions = message.flats.segs, message.flats.flat, message.indices
  mean = collectives.sparse_allgather_mean(message.values, positions, segs.length,
                                           axis_name=axis_name, wire_dtype=wire_dtype,
                                           apply=applied)
  residual = flat.at[positions].set(_unsent(message.values, wire_dtype), mode="drop")
  shapes = [layout.shapes[leaf] for leaf in leaves]
  for leaf, value, kept in zip(leaves, segmented.cut(mean, segs, shapes),
                               segmented.cut(residual, segs, shapes)):
    means[leaf] = value
    # The cut copies the buffer into leaves anyway: a skip's select rides on it.
    residuals[leaf] = kept if applied is None else jnp.where(applied, kept, previous[leaf])
  size = wire.allgather_bytes(positions.shape[0], collectives.num_workers(axis_name), wire_dtype)
  return selection.count_valid(positions, segs.length), size, size


def _layer_wise_message(layout, select, group, accumulated, leaf_indices, picked) -> _Message:
  # Layer-wise selection needs no dense concatenation of the group: each
  # leaf's pairs go into its own slots of the one message, and its mean and
  # residual are scattered in place (on ResNet-50 the concatenation and
  # the split back cost more than the reuse step's selection).
  del select, picked
  leaves = layout.groups[group]
  sent, leaf_passed = zip(*(leaf_indices(leaf) for leaf in leaves))
  flats = [accumulated[leaf].reshape(-1) for leaf in leaves]
  values = jnp.concatenate([g.at[i].get(mode="fill", fill_value=0).astype(jnp.float32)
                            for g, i in zip(flats, sent)])
  return _Message(values, sent, sum(leaf_passed), flats, flats)


def _group_message(layout, select, group, accumulated, leaf_indices, picked) -> _Message:
  leaves = layout.groups[group]
  size = layout.group_size(group)
  flat = concat_flat([accumulated[leaf] for leaf in leaves])
  if select.kind == "group_topk":
    # The group's one segment: positions in it are indices into the concatenation.
    positions, group_passed = picked[group].positions, picked[group].passed[0]
    indices = jnp.where(positions < size, positions, size)
  else:
    parts, group_passed, offset = [], jnp.zeros((), jnp.int32), 0
    for leaf in leaves:
      local, one_passed = leaf_indices(leaf)
      parts.append(jnp.where(local < layout.sizes[leaf], local + offset, size))
      group_passed = group_passed + one_passed
      offset += layout.sizes[leaf]
    indices = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
  return _Message(flat.at[indices].get(mode="fill", fill_value=0), indices, group_passed, flat,
                  [flat])


def _send_layer_wise(layout, select, collective, group, message, means, residuals, *,
                     axis_name, wire_dtype, applied, previous):
  """A layer-wise group's all-gather; fills `means` and `residuals` of its leaves."""
  del select, collective
  leaves = layout.groups[group]
  indices = jnp.concatenate(message.indices)
  segments = [(i.shape[0], layout.sizes[leaf]) for leaf, i in zip(leaves, message.indices)]
  group_means = collectives.sparse_allgather_means(
      message.values, indices, segments, axis_name=axis_name, wire_dtype=wire_dtype,
      apply=applied)
  kept = _split_like(_unsent(message.values, wire_dtype), message.indices)
  for leaf, g, i, mean, k in zip(leaves, message.flats, message.indices, group_means, kept):
    means[leaf] = mean.reshape(layout.shapes[leaf])
    residuals[leaf] = _written(g, i, k, layout.sizes[leaf], applied,
                               None if previous is None else previous[leaf]
                               ).reshape(layout.shapes[leaf])
  count = sum(selection.count_valid(i, layout.sizes[leaf])
              for leaf, i in zip(leaves, message.indices))
  size = wire.allgather_bytes(indices.shape[0], collectives.num_workers(axis_name), wire_dtype)
  return count, size, size


def _send_group(layout, select, collective, group, message, means, residuals, *,
                axis_name, wire_dtype, applied, previous):
  """A concatenated group's all-gather or gTop-k; fills `means` and `residuals` of its leaves."""
  workers = collectives.num_workers(axis_name)
  size = layout.group_size(group)
  flat, values, sent = message.flats, message.values, message.indices
  kept = jnp.zeros((), flat.dtype)
  if collective == "allgather":
    mean = collectives.sparse_allgather_mean(values, sent, size, axis_name=axis_name,
                                             wire_dtype=wire_dtype, apply=applied)
    kept = _unsent(values.astype(jnp.float32), wire_dtype).astype(flat.dtype)
    bytes_out = bytes_in = wire.allgather_bytes(sent.shape[0], workers, wire_dtype)
  else:
    k = select.group_k(layout, group)
    mean, sent = collectives.gtopk_mean(flat, values, sent, k, axis_name=axis_name,
                                        apply=applied)
    bytes_out, bytes_in = wire.gtopk_bytes(k, workers, collectives.worker_index(axis_name))
  residual_group = split_flat(layout, group, flat.at[sent].set(kept, mode="drop"))
  for leaf, value in split_flat(layout, group, mean).items():
    means[leaf] = value
    residual = residual_group[leaf].astype(previous[leaf].dtype if previous is not None
                                           else flat.dtype)
    if applied is not None:
      # A group laid end to end is cut back into leaves anyway: the select rides on that copy.
      residual = jnp.where(applied, residual, previous[leaf])
    residuals[leaf] = residual
  return selection.count_valid(sent, size), bytes_out, bytes_in


def _written(g: jax.Array, indices: jax.Array, kept, size: int, applied, previous):
  """The new residual of a leaf: `g` with what was sent at `indices` replaced by `kept`.

  When the step is not `applied`, `previous` is kept: the select is fused into
  the copy the in-place scatter needs anyway, and the scatter's k indices are
  masked rather than its result.
  """
  if applied is None:
    return g.at[indices].set(kept.astype(g.dtype), mode="drop")
  base = jnp.where(applied, g, previous.reshape(-1).astype(g.dtype))
  return base.at[jnp.where(applied, indices, size)].set(kept.astype(g.dtype), mode="drop")


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


def fused_mean(tree, *, axis_name):
  """Mean over workers of every leaf of `tree` in one all-reduce: `dense_exchange` of one group.

  Small tensors (BatchNorm statistics, scalar metrics) each cost a collective's
  full latency when reduced one by one -- on a real network that latency, not
  the bytes, dominates. Leaves are cast to float32, laid end to end, reduced
  once and cut back (and cast back to their dtypes).
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if axis_name is None or not leaves:
    return tree
  as_float = [jnp.asarray(x, jnp.float32) for x in leaves]
  layout = engine.make_layout(jax.tree_util.tree_unflatten(treedef, as_float), None, None,
                              single_group=True)
  means, _, _ = dense_exchange(layout, as_float, axis_name=axis_name)
  return jax.tree_util.tree_unflatten(
      treedef, [m.reshape(jnp.shape(x)).astype(jnp.result_type(x)) for m, x in zip(means, leaves)])
