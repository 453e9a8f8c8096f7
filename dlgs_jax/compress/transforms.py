"""Gradient-communication transforms: DLGS and the methods it is compared with.

Every factory returns an `optax.GradientTransformation` whose update runs inside
`jax.shard_map`, `jax.pmap` or `jax.vmap` over the data axis `axis_name`
(``None``: one worker; ``jax.vmap`` simulates P workers on one device) and
outputs the *mean over workers* of what was communicated -- identical on every
worker, and typed replicated, so a step can return the parameters with
``out_specs`` ``P()`` with shard_map's checks on -- and it composes with any
optax optimizer placed after it::

    tx = optax.chain(dlgs_jax.dlgs(0.01, axis_name="data"),
                     optax.add_decayed_weights(5e-4),
                     optax.sgd(0.1, momentum=0.9))

The state of each sparse transform holds error-feedback residuals shaped like
the parameters. It is per worker: outside `shard_map` it has a leading worker
axis sharded over the data axes (`dlgs_jax.init_per_worker`), dropped inside
(`dlgs_jax.squeeze_state`). Gradients must be each worker's own: with the checks on,
gradients or a state typed replicated are refused (`common.check_per_worker`);
`dlgs_jax.data_parallel` builds a whole step that gets this right.

``axis_name=None`` means one worker, and nothing is communicated. Under a plain
`jax.jit` whose batch is sharded over devices, JAX itself all-reduces the
gradient densely before this transform sees it; the transform then compresses
an already-averaged gradient and reports 0 bytes sent, while the dense traffic
it exists to avoid has happened. Map the step instead (`dlgs_jax.data_parallel`,
or shard_map / pmap / vmap with the same `axis_name`). A forgotten `axis_name`
is refused (`common.check_mapped`) inside shard_map and under a vmap or pmap
with a named axis; under `jax.jit` it cannot be seen.

Non-finite gradients: when any worker's gradient contains a NaN or an infinity
(``skip_nonfinite=True``, the default), every worker skips the step -- the
update is all zeros, the residuals, thresholds and step count are kept, and
``stats.skipped`` goes up by one. Workers agree through one tiny all-reduce of a
flag, so they never diverge. Optimizers chained after this transform still see
the zero update (momentum keeps moving the weights, as it would for a zero
gradient). The exchange itself runs either way, so that each group's collective
waits for its own gradients only; the sparse transforms then mask the k-sized
received pairs and residual writes (`exchange.sparse_exchange`), the others
select between results (`common.unless_nonfinite`).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from dlgs_jax.compress import common, engine, exchange, rules, wire
from dlgs_jax.compress.state import (DenseState, DLGSState, SparseState, empty_stats,
                                     skipped_stats, step_stats)


def _sparse_transform(
    select: engine.Selection,
    collective: str,
    *,
    method: str,
    axis_name,
    groups,
    order,
    single_group: bool,
    skip_nonfinite: bool,
    whole=None,
    residual_dtype="float32",
    wire_dtype="float32",
) -> optax.GradientTransformation:
  """Residual + selection + sparse collective; a "threshold" selection keeps DLGS thresholds."""
  with_thresholds = select.kind == "threshold"
  reuse_every = select.rule.every if with_thresholds else None
  # The owners reuse their global threshold as the method reuses its own:
  # DLGS's period; Top-k and LAGS select exactly on every step.
  with_owners = collective == "owners"
  wire_dtype = common.check_sparse_wire(wire_dtype, collective)
  residual_dtype = common.check_residual_dtype(residual_dtype)
  axis_name = common.check_axis_name(axis_name)

  def layout_of(tree):
    return engine.make_layout(tree, groups, order, single_group=single_group,
                              buckets=not single_group, whole=whole)

  def init_fn(params):
    layout = layout_of(params)
    residuals = tuple(jnp.zeros((layout.buffer(g).length,), residual_dtype)
                      for g in range(len(layout.groups)))
    count = jnp.zeros((), jnp.int32)
    stats = empty_stats(layout.group_paths(), layout.group_shapes())
    # 0 until an exact step has measured them.
    owner_thresholds = (tuple(jnp.zeros((), jnp.float32) for _ in layout.groups)
                        if with_owners else ())
    if with_thresholds:
      thresholds = tuple(engine.initial_thresholds(select, layout, g)
                         for g in range(len(layout.groups)))
      return DLGSState(count, residuals, thresholds, stats, owner_thresholds)
    return SparseState(count, residuals, stats, owner_thresholds)

  def update_fn(updates, state, params=None):
    del params
    layout = layout_of(updates)
    common.check_buffers(updates, layout, state.residuals, state.stats.groups)
    grads = jax.tree_util.tree_leaves(updates)
    accumulated, picked = [], []
    for group in range(len(layout.groups)):
      summed = engine.accumulate(layout, group, state.residuals[group], grads)
      accumulated.append(summed)
      picked.append(engine.pick(select, layout, group, summed,
                                state.thresholds[group] if with_thresholds else None))
    owners_exact = None
    if with_owners and with_thresholds:
      # A threshold never measured (0: a fresh or resharded state) is measured now.
      owners_exact = ((state.count % reuse_every == 0)
                      | jnp.any(jnp.stack(state.owner_thresholds) <= 0))
    # The next thresholds read this step's g: the residuals are written after them.
    settled, exact = [], jnp.zeros((), jnp.int32)
    if with_thresholds:
      settled, exact = engine.settle(select, layout, accumulated, picked, state.thresholds,
                                     state.count % reuse_every == 0)
    out = exchange.sparse_exchange(
        layout, select, collective, accumulated, picked, axis_name=axis_name,
        wire_dtype=wire_dtype, skip_nonfinite=skip_nonfinite,
        owner_thresholds=state.owner_thresholds if with_owners else None, exact=owners_exact,
        after=settled)
    applied = out.applied
    keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(applied, a, b), new, old)
    stats = keep(step_stats(state.stats, out.bytes_sent, out.bytes_received, out.selected,
                            out.passed, exact), skipped_stats(state.stats))
    count = state.count + applied.astype(jnp.int32)
    sent, residuals = common.round_into_buffers(layout, out.means, out.residuals, grads)
    residuals = tuple(r.astype(old.dtype) for r, old in zip(residuals, state.residuals))
    thresholds = (tuple(keep(new, old) for new, old in zip(settled, state.thresholds))
                  if with_thresholds else None)
    owner_thresholds = tuple(keep(new, old) for new, old in
                             zip(out.owner_thresholds, state.owner_thresholds))
    residuals, thresholds, stats, count, owner_thresholds = common.as_varying(
        (residuals, thresholds, stats, count, owner_thresholds), axis_name)
    new_updates = jax.tree_util.tree_unflatten(layout.treedef, sent)
    if with_thresholds:
      return new_updates, DLGSState(count, residuals, thresholds, stats, owner_thresholds)
    return new_updates, SparseState(count, residuals, stats, owner_thresholds)

  return common.with_passive_leaves(optax.GradientTransformation(init_fn, update_fn), axis_name,
                                    DLGSState if with_thresholds else SparseState, method)


def dlgs(
    density: float,
    *,
    axis_name=None,
    thresholds: rules.ThresholdRule = rules.AdaptedReuse(),
    budget: str = "message",
    groups=None,
    order: Optional[Sequence[str]] = None,
    send_whole=None,
    collective: str = "allgather",
    capacity_factor: float = 1.0,
    skip_nonfinite: bool = True,
    residual_dtype="float32",
    wire_dtype="float32",
) -> optax.GradientTransformation:
  """Dynamic layer-wise gradient sparsification (Ju et al. 2024, Algorithm 1).

  Per leaf l: ``g = e + grad``; values with ``|g| >= H_l`` (and ``g != 0``) are
  sent and the rest stays in the residual e. With ``budget="layer"`` (the
  paper's) H_l is the k_l-th largest ``|g|`` of leaf l (``k_l = max(1,
  ceil(density * size_l))``); with ``budget="message"`` (the default) the
  leaves of a message share one threshold, the (sum_l k_l)-th largest of the
  message. Thresholds are computed exactly on step 0 and
  every ``thresholds.every`` steps, and reused until the next exact one: the
  exact top-k that LAGS pays every step is paid once a period. A step selects
  with the thresholds it starts from, and the exact ones of its values serve
  from the next step on, so no group's message waits for an exact select (the
  first step, which knows no threshold, keeps its values owed). `thresholds`
  says how reused thresholds are kept (`FixedReuse`, the paper), refreshed
  (`RefreshReuse`) or re-aimed every step (`AdaptedReuse`, the default; `rules`
  says why). A group's leaves live in one flat buffer and are selected
  together, in a fixed number of passes however many leaves it holds, and the
  exact selects of every group run in the update's one conditional.

  Static shapes need a fixed buffer: a message sends at most
  ``ceil(capacity_factor * sum_l k_l)`` values (``"layer"``: leaf l at most
  ``min(size_l, ceil(capacity_factor * k_l))``), the first ones in flat index
  order when more pass a reused threshold. What does not fit stays in
  the residual (nothing is lost; ``stats.passed`` exceeds ``stats.selected``).
  Buffers travel whole, so the bytes on the wire are those of the capacity.

  Args:
    density: fraction of each leaf sent, in (0, 1].
    axis_name: data-parallel axis name (or tuple of names); ``None`` = one worker
      (see the module docstring for a plain `jax.jit`).
    thresholds: the threshold rule, `rules.AdaptedReuse()` by default;
      ``FixedReuse(every=10)`` is the paper's.
    budget: whose k a threshold answers for. ``"message"`` (the default):
      one threshold per group (a message), the (sum_l k_l)-th largest of the
      whole group, computed and reused on the same schedule; each leaf then
      sends the share of the message's k that a global top-k gave it on the
      last exact step, as global Top-k would within the message, while the
      message is still sent as soon as its own gradients are ready. Leaves
      are not sent whole under it (`send_whole` must be None). ``"layer"``
      (the paper's): one threshold per leaf, the k_l-th largest of that
      leaf, so every leaf sends its density's share.
    groups: leaf-path groups (contiguous runs in backward order, listed in
      backward order), each packed into one buffer and sent in one collective;
      or a plan with ``.groups`` and ``.order``. ``None``: buckets of
      consecutive leaves (in `order`, else reverse flatten order) of up to
      `grouping.BUCKET_VALUES` values, as DDP buckets, so that the update's
      kernels grow with the model's size, not its number of leaves;
      ``[[path] for path in order]`` sends each leaf alone.
    order: backward order of all leaf paths (`grouping.backward_order`); when
      given, groups are checked to be contiguous runs of it and buckets follow it.
    send_whole: leaves sent whole (every nonzero value, in the same message),
      an optax-style mask (`engine.check_whole`): a tree of bools like the
      parameters, a callable returning one, or a list of leaf paths. Typical:
      the classifier head (`grouping.output_layer`), which a per-layer budget
      starves, or biases and norms (``lambda p: jax.tree.map(lambda x: x.ndim
      < 2, p)``, as DGC does). None (the paper): every leaf is sparsified.
    collective: "allgather" (all-gather pairs, scatter-add, divide by P:
      (P-1)·8k bytes a worker), "gtopk" (gTop-k reduction per group, keeping
      sum_l k_l values globally) or "owners" (pairs summed at the owners of
      hashed regions, each keeping its share of sum_l k_l, then all-gathered:
      bytes flat in P; `owners`).
    capacity_factor: buffer size per leaf in units of k_l (>= 1).
    skip_nonfinite: skip steps with non-finite gradients (module docstring).
    residual_dtype: dtype of the error-feedback residuals of floating leaves
      (float32 whatever the parameters' dtype: bfloat16 residuals would round
      away the small values they exist to keep).
    wire_dtype: dtype of the values in the all-gather's messages: "float32"
      (8-byte pairs) or "bfloat16" (6-byte pairs; what rounding a sent value
      loses stays in the sender's residual). Only with the all-gather: the
      other collectives form sums on the way.

  Returns:
    An `optax.GradientTransformation` with state `DLGSState`.

  Raises:
    ValueError: for a bad argument (at construction) or bad groups, a mask or
      a tree that does not match (at init/update).
  """
  density = common.check_density(density)
  common.check_static("capacity_factor", capacity_factor)
  if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
      or not 1.0 <= capacity_factor < math.inf):
    raise ValueError(f"capacity_factor must be a finite number >= 1 (it sizes each leaf's "
                     f"buffer; at most every value: size_l / k_l), got {capacity_factor!r}")
  rule = rules.check_rule(thresholds)
  if budget not in engine.BUDGETS:
    raise ValueError(f"budget={budget!r} is invalid: choose 'layer' (k_l per leaf, the "
                     f"paper's) or 'message' (one threshold per message)")
  if budget == "message" and send_whole is not None:
    raise ValueError(f"send_whole={send_whole!r} does not apply with budget='message': the "
                     f"message's one threshold already gives each leaf the share a global "
                     f"top-k would; pass send_whole=None or budget='layer'")
  groups, order = common.check_groups(groups, order)
  return _sparse_transform(
      engine.Selection("threshold", density, float(capacity_factor), rule, budget),
      common.check_collective(collective), method="dlgs", axis_name=axis_name, groups=groups,
      order=order, single_group=False, skip_nonfinite=skip_nonfinite,
      whole=engine.check_whole(send_whole), residual_dtype=residual_dtype,
      wire_dtype=wire_dtype)


def lags(
    density: float,
    *,
    axis_name=None,
    groups=None,
    order: Optional[Sequence[str]] = None,
    send_whole=None,
    collective: str = "allgather",
    skip_nonfinite: bool = True,
    residual_dtype="float32",
    wire_dtype="float32",
) -> optax.GradientTransformation:
  """Layer-wise adaptive gradient sparsification (LAGS, Shi et al. 2020).

  Exact top-k of every leaf on every step (the k-th largest ``|g|`` found
  without a sort, then a compaction; ties kept in index order), with error-feedback
  residuals. Arguments as in `dlgs` (`send_whole`, `wire_dtype` too); state
  `SparseState`.
  """
  density = common.check_density(density)
  groups, order = common.check_groups(groups, order)
  return _sparse_transform(
      engine.Selection("layer_topk", density), common.check_collective(collective),
      method="lags", axis_name=axis_name, groups=groups, order=order, single_group=False,
      skip_nonfinite=skip_nonfinite, whole=engine.check_whole(send_whole),
      residual_dtype=residual_dtype, wire_dtype=wire_dtype)


def _global_topk(density, collective: str, axis_name, skip_nonfinite: bool, residual_dtype,
                 wire_dtype="float32"):
  """One top-k over all leaves sent by `collective` (Top-k and gTop-k)."""
  return _sparse_transform(
      engine.Selection("group_topk", common.check_density(density)), collective,
      method="gtopk" if collective == "gtopk" else "topk", axis_name=axis_name,
      groups=None, order=None, single_group=True,
      skip_nonfinite=skip_nonfinite, residual_dtype=residual_dtype, wire_dtype=wire_dtype)


TOPK_COLLECTIVES = ("allgather", "owners")


def topk(
    density: float, *, axis_name=None, collective: str = "allgather",
    skip_nonfinite: bool = True, residual_dtype="float32", wire_dtype="float32",
) -> optax.GradientTransformation:
  """Top-k S-SGD: one global top-k over all leaves, all-gathered (O(kP) traffic).

  ``k = max(1, ceil(density * total_size))``; unsent values stay in the
  residuals; `wire_dtype` as in `dlgs`. With ``collective="owners"`` the
  workers' top-k are summed at the owners of hashed regions, each keeping its
  share of k, so the bytes do not grow with P (`owners`). State `SparseState`.
  """
  if collective not in TOPK_COLLECTIVES:
    raise ValueError(f"topk's collective must be one of {TOPK_COLLECTIVES}, got "
                     f"{collective!r}; for gTop-k's reduction use gtopk()")
  return _global_topk(density, collective, axis_name, skip_nonfinite, residual_dtype,
                      wire_dtype)


def gtopk(
    density: float, *, axis_name=None, skip_nonfinite: bool = True, residual_dtype="float32"
) -> optax.GradientTransformation:
  """gTop-k S-SGD (Shi et al., ICDCS 2019): global top-k of the *sum* over workers.

  Each worker offers its local top-k; ``collectives.gtopk_mean`` agrees on the
  global top-k indices in log2(P) pairwise rounds and then all-reduces the
  exact values there (k values), so a worker moves O(k log P) values, and no
  gradient mass is lost. State `SparseState`.
  """
  return _global_topk(density, "gtopk", axis_name, skip_nonfinite, residual_dtype)


def dense(
    *,
    axis_name=None,
    groups=None,
    order: Optional[Sequence[str]] = None,
    skip_nonfinite: bool = True,
    wire_dtype=None,
) -> optax.GradientTransformation:
  """Dense mean all-reduce with tensor fusion: one collective per group.

  ``groups=None`` fuses each leaf alone (wait-free backprop); pass
  ``[all paths]`` for one fused buffer. ``wire_dtype="bfloat16"`` sums in
  bfloat16 on the wire (half the bytes, and the rounding of the sum is lost:
  the bf16 all-reduce a sparse method is honestly compared with); None: the
  gradients' own dtype. State `DenseState`.
  """
  axis_name = common.check_axis_name(axis_name)
  if wire_dtype is not None:
    wire_dtype = wire.check_wire_dtype(wire_dtype)
  groups, order = common.check_groups(groups, order)

  def layout_of(tree):
    return engine.make_layout(tree, groups, order)

  def init_fn(params):
    return DenseState(jnp.zeros((), jnp.int32), empty_stats(layout_of(params).group_paths()))

  def update_fn(updates, state, params=None):
    if params is not None:
      common.check_matches(updates, params, "the parameters")
    layout = layout_of(updates)
    grads = jax.tree_util.tree_leaves(updates)
    num_groups = len(layout.groups)

    def communicate():
      means, sent, received = exchange.dense_exchange(layout, grads, axis_name=axis_name,
                                                    wire_dtype=wire_dtype)
      sizes = jnp.asarray([layout.group_size(g) for g in range(num_groups)], jnp.int32)
      stats = step_stats(state.stats, sent, received, sizes, sizes)
      return means, common.as_varying((stats, state.count + 1), axis_name)

    def skip():
      means = [jnp.zeros(g.shape, g.dtype if wire_dtype is None else wire_dtype)
               for g in grads]
      stats = skipped_stats(state.stats)
      return means, common.as_varying((stats, state.count), axis_name)

    means, (stats, count) = common.unless_nonfinite(
        skip_nonfinite, grads, axis_name, communicate, skip)
    new_updates = jax.tree_util.tree_unflatten(
        layout.treedef, [m.astype(g.dtype) for m, g in zip(means, grads)])
    return new_updates, DenseState(count, stats)

  return common.with_passive_leaves(optax.GradientTransformation(init_fn, update_fn), axis_name,
                                    DenseState, "dense")
