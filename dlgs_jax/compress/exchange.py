"""One communication step of a transform: messages, collectives, means and residuals.

`sparse_exchange` sends what `engine.pick` chose, group by group, and gives
back each group's mean over workers and new residual, in its flat buffer;
`dense_exchange` all-reduces groups densely (tensor fusion) from the flat
leaf list of an `engine.Layout`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from dlgs_jax.compress import collectives, common, engine, owners, selection, wire
from dlgs_jax.compress.engine import Layout, Selection, concat_flat, split_flat


class Exchanged(NamedTuple):
  """One sparse communication step's results (`sparse_exchange`)."""
  means: list                # per group, float32[buffer]: the mean over workers, in the group's buffer (zeros when not applied)
  residuals: list            # per group, float32[buffer]: the new residual (the old one when not applied)
  selected: jax.Array        # int32[num_groups]: values this worker sent per group
  passed: jax.Array          # int32[num_groups]: values that met the selection rule (> selected on overflow)
  bytes_sent: jax.Array      # float32[]: bytes this worker put on the wire
  bytes_received: jax.Array  # float32[]: bytes this worker took off the wire
  applied: jax.Array         # bool[]: the step counted (every worker's gradients and message finite)
  owner_thresholds: list     # per group, float32[]: the owners' global threshold after the step ("owners"; [] otherwise)


def sparse_exchange(
    layout: Layout,
    select: Selection,
    collective: str,
    accumulated: Sequence[engine.Summed],
    picked: Sequence[engine.Picked],
    *,
    axis_name,
    wire_dtype: str = "float32",
    skip_nonfinite: bool = False,
    owner_thresholds: Optional[Sequence[jax.Array]] = None,
    exact: Optional[jax.Array] = None,
    after: Sequence[jax.Array] = (),
) -> Exchanged:
  """One sparse communication step over all groups, each in its flat buffer.

  Each group is one collective of the pairs `engine.pick` chose: positions in
  the group's buffer and their values. Its mean is one scatter over the
  buffer and its residual one scatter of what stays, whatever the number of
  leaves; the caller cuts the means into leaves.

  With `skip_nonfinite`, a step is skipped on every worker when any worker's
  g = residual + gradient holds a value that is not finite (a NaN or an
  infinity in a gradient, or a sum past the range; `engine.Picked.finite`):
  one flag is summed over workers, and it masks the received pairs and the
  k-sized residual writes -- not the dense means -- while each group's
  collective still waits for its own values only; a skipped step's residual
  is the old one, bit for bit (`engine.Summed.kept`).

  Args:
    layout: the static layout.
    select: the selection rule.
    collective: "allgather", "gtopk" or "owners" (`owners`).
    accumulated: per group, g = residual + gradient (`engine.accumulate`).
    picked: per group, what `engine.pick` chose.
    axis_name: the data-parallel axis.
    wire_dtype: the all-gather's value dtype; with "bfloat16" what rounding a
      sent value loses stays in the residual.
    skip_nonfinite: skip steps whose values are not finite; False: every
      step is applied.
    owner_thresholds: with "owners", per group the global threshold the
      owners keep by when the step is not `exact`.
    exact: with "owners", a bool scalar, the same on every worker: the owners
      keep their regions' exact top and measure the thresholds anew; None:
      every step is exact.
    after: what else reads the old residuals (the next thresholds, computed
      from g), finite on every applied step: the residuals are written after it.

  Returns:
    `Exchanged`.
  """
  applied = (collectives.all_agree(functools.reduce(jnp.logical_and,
                                                    [chosen.finite for chosen in picked]),
                                   axis_name) if skip_nonfinite else None)
  workers = collectives.num_workers(axis_name)
  ks = [select.group_k(layout, group) for group in range(len(accumulated))]
  values_of = [summed.at(chosen.positions) for summed, chosen in zip(accumulated, picked)]
  written = applied
  if applied is not None:
    # What still reads the old residuals (the messages' values, the next
    # thresholds) is finite on an applied step; tied to it, the write comes
    # after those reads, and XLA writes over the old residual in place
    # rather than copying it first.
    written = applied & common.all_finite(list(values_of) + list(after), None)
  if collective == "owners":
    # Every group's pairs reach their owners before the one conditional that
    # keeps what every owner keeps (`owners.keep`).
    received = [owners.to_owners(values, chosen.positions, summed.length, axis_name=axis_name)
                for summed, chosen, values in zip(accumulated, picked, values_of)]
    owned, found = owners.keep(received, [summed.length for summed in accumulated], ks,
                               axis_name=axis_name, exact=exact, thresholds=owner_thresholds)
  means, residuals, selected, passed, sent_bytes, received_bytes = [], [], [], [], [], []
  thresholds = []
  for group, (summed, chosen) in enumerate(zip(accumulated, picked)):
    length = summed.length
    positions = chosen.positions
    values = values_of[group]
    k = ks[group]
    if collective == "allgather":
      mean = collectives.sparse_allgather_mean(values, positions, length, axis_name=axis_name,
                                               wire_dtype=wire_dtype, apply=applied)
      sent, kept = positions, _unsent(values, wire_dtype)
      # The slots filled: every segment's first min(passed, capacity) values.
      count = jnp.sum(jnp.minimum(chosen.passed,
                                  jnp.asarray(select.capacities(layout, group), jnp.int32)))
      bytes_out = bytes_in = wire.allgather_bytes(positions.shape[0], workers, wire_dtype)
    else:
      # Both agree on about k positions and take every worker's whole value there:
      # those leave every residual, whole.
      if collective == "owners":
        mean, sent, measured = owners.share(summed.total(), owned[group], found[group],
                                            axis_name=axis_name, apply=applied)
        thresholds.append(measured if exact is None
                          else jnp.where(exact, measured, owner_thresholds[group]))
        bytes_out = bytes_in = wire.owners_bytes(positions.shape[0], k, workers)
      else:
        mean, sent = collectives.gtopk_mean(summed.total(), values, positions, k,
                                            axis_name=axis_name,
                                            apply=applied)
        bytes_out, bytes_in = wire.gtopk_bytes(k, workers, collectives.worker_index(axis_name))
      kept = jnp.zeros((), jnp.float32)
      count = selection.count_valid(sent, length)
    residuals.append(_written(summed, sent, kept, length, written))
    means.append(mean)
    selected.append(count)
    passed.append(jnp.sum(chosen.passed))
    sent_bytes.append(bytes_out)
    received_bytes.append(bytes_in)
  return Exchanged(means, residuals, jnp.stack(selected), jnp.stack(passed),
                   _total(sent_bytes), _total(received_bytes),
                   jnp.ones((), jnp.bool_) if applied is None else applied, thresholds)


def _total(amounts) -> jax.Array:
  return sum(amounts, jnp.zeros((), jnp.float32))


def _written(summed: engine.Summed, positions: jax.Array, kept, length: int, applied):
  """A group's new residual: g with what was sent at `positions` replaced by `kept`.

  When the step is not `applied`, the old residual is kept whole: g's terms
  are summed only where applied (`engine.Summed.kept`) and the scatter's
  positions are masked rather than its result.
  """
  if applied is None:
    return summed.total().at[positions].set(kept, mode="drop")
  return summed.kept(applied).at[jnp.where(applied, positions, length)].set(kept, mode="drop")


def _unsent(values: jax.Array, wire_dtype: str):
  """What rounding float32 `values` to the wire's dtype loses (0 for float32)."""
  if wire_dtype == "float32":
    return jnp.zeros((), values.dtype)
  return values - values.astype(jnp.bfloat16).astype(values.dtype)


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
