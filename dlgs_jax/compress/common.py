"""Argument checks and the non-finite skip shared by every transform of `compress`.

Non-finite gradients: when any worker's gradient contains a NaN or an infinity,
every worker skips the step; `unless_nonfinite` selects between the exchange's
result and the skip's, so each group's collective waits for its own gradients
only. `as_varying` gives both results the types shard_map's checks expect.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from dlgs_jax.compress import collectives, engine, grouping, segmented, wire
from dlgs_jax.compress.collectives import axes_of, types_checked, varying_axes


def check_static(name: str, value) -> None:
  """Refuses an array where a transform needs a Python number at construction.

  ``optax.inject_hyperparams`` turns every numeric argument into an array; the
  density and the other numbers of these transforms size static buffers and
  schedules, so the message says how to keep them static or schedule them.
  """
  if isinstance(value, (jax.Array, np.ndarray)):  # tracers are jax.Arrays too
    raise ValueError(
        f"{name} must be a Python number, got an array ({value!r}): it sizes static buffers "
        f"when the transform is built. optax.inject_hyperparams turns numeric arguments into "
        f"arrays: list them in its static_args (for dlgs: 'density', 'capacity_factor'); "
        f"to change the density over training, use dlgs_jax.density_schedule")


def check_density(density) -> float:
  check_static("density", density)
  if (isinstance(density, bool) or not isinstance(density, numbers.Real)
      or not 0.0 < float(density) <= 1.0):
    raise ValueError(f"density must be a number in (0, 1], got {density!r}")
  return float(density)


def check_collective(collective) -> str:
  if collective not in engine.SPARSE_COLLECTIVES:
    raise ValueError(
        f"unknown collective {collective!r}; expected one of {engine.SPARSE_COLLECTIVES}")
  return collective


def check_sparse_wire(dtype, collective: str) -> str:
  """A sparse message's value dtype; bfloat16 only for the all-gather."""
  dtype = wire.check_wire_dtype(dtype)
  if dtype == "bfloat16" and collective != "allgather":
    raise ValueError(f"wire_dtype 'bfloat16' works with the all-gather, not collective "
                     f"{collective!r}: its sums are formed on the way (gTop-k's all-reduce, "
                     f"the owners' regions), and their rounding could not be kept in any "
                     f"worker's residual; use wire_dtype='float32'")
  return dtype


def check_factory(argument: str, make, example: str) -> None:
  """Refuses a transform (or anything not callable) where a function building one is expected.

  Args:
    argument: the parameter's name, for the message.
    make: what was given.
    example: a call that would be right, for the message.
  """
  if isinstance(make, optax.GradientTransformation) or not callable(make):
    what = ("a built GradientTransformation" if isinstance(make, optax.GradientTransformation)
            else repr(make))
    raise ValueError(f"{argument} must be a function that builds the transform, got {what}: "
                     f"pass e.g. {example}")


def check_built(argument: str, built) -> optax.GradientTransformation:
  """Refuses what a factory argument returned unless it is a GradientTransformation."""
  if not isinstance(built, optax.GradientTransformation):
    raise ValueError(f"{argument} must return an optax.GradientTransformation, it returned "
                     f"{type(built).__name__}")
  return built


def check_groups(groups, order):
  """Accepts leaf-path groups or a plan-like object with ``.groups``/``.order``."""
  if groups is not None and hasattr(groups, "groups"):
    order = getattr(groups, "order", None) if order is None else order
    groups = groups.groups
  if groups is not None:
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
      raise ValueError(f"groups must be a list of lists of leaf paths, got {groups!r}")
    for group in groups:
      if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
        raise ValueError(f"each group must be a list of leaf paths, got {group!r}")
    groups = [list(group) for group in groups]
  if order is not None:
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
      raise ValueError(f"order must be a list of leaf paths, got {order!r}")
    order = list(order)
  return groups, order


def all_finite(leaves: Sequence[jax.Array], axis_name) -> jax.Array:
  """Whether every value of `leaves` is finite on every worker (bool scalar)."""
  ok = jnp.ones((), jnp.bool_)
  for leaf in leaves:
    ok = ok & segmented.finite(leaf)
  return collectives.all_agree(ok, axis_name)


def unless_nonfinite(skip_nonfinite: bool, grads: Sequence[jax.Array], axis_name,
                      communicate, skip):
  """``communicate()`` if every worker's `grads` and the means are finite, else ``skip()``.

  With `skip_nonfinite` False: ``communicate()``, no check.

  Both run, and the flag selects between their results leaf by leaf (as
  `optax.apply_if_finite` does), rather than a `lax.cond` running one of them:
  a cond's branches start only once its predicate is known, and the predicate
  needs every gradient of every worker, so every collective inside would wait
  for the end of the backward pass. Selected, a group's collective depends on
  that group's gradients only, and a backend with asynchronous collectives can
  run it while the backward pass goes on (the wait-free backpropagation DLGS
  pipelines with, Sec. 3 of the paper). On a skipped step the exchange's
  results, NaNs included, are discarded; every exchange has a fixed amount of
  work (bounded loops), so non-finite values cannot stall it.

  Args:
    skip_nonfinite: the transform's setting of that name.
    grads: this worker's gradient leaves.
    axis_name: the data axis (None: one worker).
    communicate, skip: functions of no argument returning pytrees of equal
      structure, shapes and dtypes.
  """
  if not skip_nonfinite:
    return communicate()
  sent, kept = communicate(), skip()
  # Finite gradients can still sum past the float range. The means are identical on
  # every worker, so each decides the same way without another collective.
  finite = all_finite(grads, axis_name) & all_finite(jax.tree_util.tree_leaves(sent[0]), None)
  return jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), sent, kept)


def as_varying(tree, axis_name):
  """Marks every leaf as varying over `axis_name` (shard_map's check_vma types).

  The per-worker state differs between workers by nature, and the skip and
  communicate results `unless_nonfinite` selects between must have equal
  types, so every state leaf is made varying. Updates are not: they come out of
  the collectives typed replicated.
  Without type checking (``check_vma=False``) this is a no-op.
  """
  axes = axes_of(axis_name)
  if not axes or not types_checked(axis_name):
    return tree

  def cast(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree_util.tree_map(cast, tree)


def check_mapped(grads, axis_name) -> None:
  """Refuses, before any work, an update that would not communicate as its transform says.

  Raises:
    ValueError: in one line with the fix, when `axis_name` is not a mapped axis
      here (no axis at all: the update was called outside shard_map, pmap and
      vmap), or when it is None while shard_map types the gradients as
      varying over a mesh axis, or vmap or pmap binds a named axis (the
      transform would compress locally and never communicate).
  """
  axes = axes_of(axis_name)
  missing = [axis for axis in axes if not collectives.is_bound(axis)]
  bound = collectives.bound_axes()
  if missing and not bound:
    raise ValueError(
        f"the update of a transform built with axis_name={axis_name!r} was called outside "
        f"any mapped axis: call it inside jax.shard_map, jax.pmap or jax.vmap over "
        f"{missing[0]!r} (or use dlgs_jax.data_parallel), or build it with axis_name=None "
        f"for one worker")
  if missing:
    raise ValueError(
        f"axis_name {missing[0]!r} is not an axis this update runs under (mapped here: "
        f"{list(bound)}): build the transform with the data axis of your mesh or map, "
        f"e.g. axis_name={bound[0]!r}")
  if not axes:
    varying = sorted(set().union(*(varying_axes(x) for x in jax.tree_util.tree_leaves(grads))),
                     key=str)
    if varying:
      raise ValueError(
          f"the gradients vary over the mesh axes {varying} but the transform was built "
          f"with axis_name=None, so it would never communicate: build it with "
          f"axis_name={varying[0]!r}")
    # vmap and pmap type nothing: a named axis there exists for collectives, and
    # each worker would train alone (the loss still falls: nothing else would say so).
    untyped = [axis for axis in bound if not types_checked(axis)]
    if untyped:
      raise ValueError(
          f"the transform was built with axis_name=None but runs under the mapped axes "
          f"{untyped}, so each worker would compress alone and never communicate: build "
          f"it with axis_name={untyped[0]!r} (or map without an axis name)")


def check_per_worker(grads, count, axis_name) -> None:
  """Refuses gradients or a state that shard_map types as replicated over the data axes.

  Only with shard_map's checks on (without them every value looks replicated).
  Gradients typed replicated were already summed over the workers by JAX (the
  gradient of parameters that entered shard_map replicated); compressing them
  would send a sum and divide it again. A state typed replicated was given with
  ``in_specs`` ``P()``: its residuals would be one worker's, kept as everyone's.

  Args:
    grads: the gradient tree given to the update.
    count: the state's step counter (every state has one, per worker).
    axis_name: the transform's data axis.

  Raises:
    ValueError: naming the first replicated gradient leaf or the state, and the fix.
  """
  axes = axes_of(axis_name)
  if not types_checked(axis_name):
    return
  for path, leaf in zip(grouping.leaf_paths(grads), jax.tree_util.tree_leaves(grads)):
    if not set(axes) <= varying_axes(leaf):
      raise ValueError(
          f"the gradient leaf {path!r} is typed replicated over {axis_name!r}: JAX already "
          f"summed it over the workers (the parameters entered shard_map replicated); take "
          f"the gradient at lax.pcast(params, {axis_name!r}, to='varying') so each worker's "
          f"own gradient reaches the compressor, or use dlgs_jax.data_parallel")
  if not set(axes) <= varying_axes(count):
    raise ValueError(
        f"the optimizer state is typed replicated over {axis_name!r} (in_specs P()), but "
        f"this transform's state is per worker: create it with "
        f"dlgs_jax.init_per_worker(tx, params, mesh), give shard_map in_specs "
        f"dlgs_jax.state_specs(state, {axis_name!r}) and drop the worker axis inside with "
        f"dlgs_jax.squeeze_state, or use dlgs_jax.data_parallel")


def check_matches(grads, reference, against: str) -> None:
  """Raises ValueError unless `grads` has `reference`'s structure and shapes.

  Args:
    grads: the gradient tree given to an update.
    reference: the tree the transform's state (or the parameters) was built for.
    against: what `reference` is, for the message (e.g. "the optimizer state").
  """
  leaves, treedef = jax.tree_util.tree_flatten(grads)
  reference_leaves, reference_def = jax.tree_util.tree_flatten(reference)
  if treedef != reference_def:
    raise ValueError(f"the gradients do not match {against}: the gradients have leaves "
                     f"{grouping.leaf_paths(grads)!r}, {against} has leaves "
                     f"{grouping.leaf_paths(reference)!r}")
  for path, leaf, ref in zip(grouping.leaf_paths(grads), leaves, reference_leaves):
    if tuple(jnp.shape(leaf)) != tuple(jnp.shape(ref)):
      raise ValueError(f"the gradient leaf {path!r} has shape {tuple(jnp.shape(leaf))}, in "
                       f"{against} it has shape {tuple(jnp.shape(ref))}{_worker_axis_hint(leaf, ref)}")


def _worker_axis_hint(leaf, ref) -> str:
  if tuple(jnp.shape(ref)) == (1,) + tuple(jnp.shape(leaf)):
    return (" (a per-worker state keeps its worker axis outside shard_map; drop it inside "
            "with dlgs_jax.squeeze_state)")
  return ""


def check_residual_dtype(dtype):
  """The residuals' dtype for floating leaves: a floating dtype (default float32)."""
  try:
    resolved = jnp.dtype(dtype)
  except TypeError:
    resolved = None
  if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
    raise ValueError(f"residual_dtype must be a floating dtype such as 'float32' or "
                     f"jnp.float32, got {dtype!r}")
  return resolved


def residual_dtype_for(leaf, residual_dtype):
  """`residual_dtype` for a floating leaf (bf16 params keep float32 residuals), else its own."""
  dtype = jnp.result_type(leaf)
  return residual_dtype if jnp.issubdtype(dtype, jnp.floating) else dtype


def round_into_buffers(layout, means: Sequence[jax.Array], residuals: Sequence[jax.Array],
                       grads: Sequence[jax.Array]):
  """(updates in the gradients' dtypes, flat residuals): what rounding a mean loses stays owed.

  The mean is computed in float32; a worker returns each leaf's part of it in
  its gradient's dtype (e.g. bfloat16), and the rounding error goes back into
  every worker's residual, so ``P * update + sum_w e_w`` still accounts for
  every bit of gradient mass. Groups whose leaves are all float32 are
  returned untouched.

  A mean past the gradient dtype's range (float16 tops out at 65504) is sent
  clipped to it, and the excess stays owed in the residual too: cast as it
  is, it would apply an infinity and leave minus that infinity in the residual.

  Args:
    layout: the transform's `engine.Layout`.
    means: per group, float32 [buffer]: the mean over workers.
    residuals: per group, float32 [buffer]: the new residual.
    grads: every leaf's gradient (flat list).

  Returns:
    ``(updates, residuals)``: the flat list of every leaf's update, and the
    residuals per group.
  """
  sent: list = [None] * len(grads)
  kept = []
  for group, (mean, residual) in enumerate(zip(means, residuals)):
    owed = {}
    for leaf, part in layout.cut(group, mean).items():
      dtype = jnp.result_type(grads[leaf])
      update = part.astype(dtype)
      if dtype != part.dtype:
        if jnp.issubdtype(dtype, jnp.floating):
          largest = float(jnp.finfo(dtype).max)
          update = jnp.clip(part, -largest, largest).astype(dtype)
        owed[leaf] = part - update.astype(part.dtype)
      sent[leaf] = update
    if owed:
      parts = [owed.get(leaf, jnp.zeros(layout.shapes[leaf], jnp.float32))
               for leaf in range(len(grads))]
      residual = residual + layout.lay_out(group, parts)
    kept.append(residual)
  return sent, kept


def check_buffers(grads, layout, residuals, groups) -> None:
  """Refuses, in one line, gradients that the state's flat buffers were not built for.

  Args:
    grads: the gradient tree given to an update.
    layout: its `engine.Layout`.
    residuals: the state's flat residual buffers, one per group.
    groups: the state's `state.MessageGroups` (the paths and shapes it was built for).

  Raises:
    ValueError: naming the leaves or shapes that differ, and the worker axis
      when a per-worker state kept it inside shard_map.
  """
  paths = [p for group in groups.paths for p in group]
  shapes = [s for group in (groups.shapes or ()) for s in group]
  given = dict(zip(layout.paths, layout.shapes))
  if sorted(paths) != sorted(given):
    raise ValueError(f"the gradients do not match the optimizer state: the gradients have "
                     f"leaves {list(layout.paths)!r}, the optimizer state has leaves "
                     f"{sorted(paths)!r}")
  for path, shape in zip(paths, shapes):
    if tuple(given[path]) != tuple(shape):
      raise ValueError(f"the gradient leaf {path!r} has shape {tuple(given[path])}, in the "
                       f"optimizer state it has shape {tuple(shape)}")
  if groups.paths != tuple(tuple(g) for g in layout.group_paths()):
    raise ValueError(f"the optimizer state was built for the groups {list(map(list, groups.paths))!r}, "
                     f"this transform groups the gradients as {layout.group_paths()!r}: give "
                     f"the update the state its own init returned")
  for group, flat in enumerate(residuals):
    length = layout.buffer(group).length
    if tuple(jnp.shape(flat)) != (length,):
      extra = (" (a per-worker state keeps its worker axis outside shard_map; drop it inside "
               "with dlgs_jax.squeeze_state)" if tuple(jnp.shape(flat))[1:] == (length,) else "")
      raise ValueError(f"the optimizer state's residual buffer of group {group} has shape "
                       f"{tuple(jnp.shape(flat))}, the gradients need ({length},){extra}")


def check_axis_name(axis_name):
  """The data axis as JAX takes it: None, a name, or a tuple of names (a list becomes a tuple).

  Raises:
    ValueError: naming anything else.
  """
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  if axis_name is None or isinstance(axis_name, str):
    return axis_name
  if isinstance(axis_name, tuple) and axis_name and all(isinstance(a, str) for a in axis_name):
    return axis_name
  raise ValueError(f"axis_name must be None, a mesh axis name or a list or tuple of them, "
                   f"got {axis_name!r}")


def is_passive(leaf) -> bool:
  """Leaves no transform communicates: integer and boolean leaves, and empty ones."""
  # The shape's product, not jnp.size: shape structs (`jax.eval_shape`, compiling
  # ahead of time) are leaves too, and jnp.size refuses them in newer JAX.
  return (not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
          or math.prod(np.shape(leaf)) == 0)


def check_state(state, state_type: type, method: str) -> None:
  """Refuses, in one line, a state that `method`'s init did not make.

  Args:
    state: what the update was given.
    state_type: the NamedTuple class of `method`'s state.
    method: the factory's name, for the message.

  Raises:
    ValueError: for a whole optax chain's state, another transform's state, or
      anything else, naming what was given and what to pass.
  """
  if isinstance(state, state_type):
    return
  given = type(state).__name__
  if isinstance(state, (tuple, list)) and not hasattr(state, "_fields"):
    hint = (f"a {given} of {len(state)} states is an optax chain's state: give it to the "
            f"chain's update (tx.update(grads, opt_state, params)), or give {method}'s update "
            f"its own element of it")
  elif hasattr(state, "_fields"):
    hint = (f"it is another transform's state: give {method}'s update the state its own "
            f"init returned")
  else:
    hint = f"give {method}'s update the state its own init returned"
  raise ValueError(f"{method}'s update got a {given} as its state, not the {state_type.__name__} "
                   f"its init returns: {hint}")


def with_passive_leaves(tx: optax.GradientTransformation, axis_name=None,
                        state_type: type = None, method: str = "the transform"
                        ) -> optax.GradientTransformation:
  """`tx` on the floating, non-empty leaves; every other leaf gets a zero update, no traffic.

  Passive leaves become empty subtrees (None) before `tx` sees the tree, so its
  state and messages hold only the leaves it communicates; a tree without passive
  leaves is handed over as it is. A state of another type than `state_type`
  (`check_state`), and gradients and state typed replicated over `axis_name`
  (`check_per_worker`), are refused first.
  """
  def strip(tree):
    return jax.tree_util.tree_map(lambda x: None if is_passive(x) else x, tree)

  def init_fn(params):
    leaves = jax.tree_util.tree_leaves(params)
    if leaves and all(is_passive(x) for x in leaves):
      kinds = sorted({f"{jnp.result_type(x)}{list(np.shape(x))}" for x in leaves})
      raise ValueError(f"the parameter tree has nothing to communicate: every leaf is "
                       f"integer, boolean or empty ({', '.join(kinds[:4])}); pass the "
                       f"floating-point parameters (e.g. nnx.state(model, nnx.Param))")
    return tx.init(strip(params))

  def update_fn(updates, state, params=None):
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    passive = [is_passive(x) for x in leaves]
    if state_type is not None:
      check_state(state, state_type, method)
    check_mapped(updates, axis_name)
    check_per_worker(strip(updates), state.count, axis_name)
    if not any(passive):
      return tx.update(updates, state, params)
    inner, state = tx.update(strip(updates), state, None if params is None else strip(params))
    active = iter(jax.tree_util.tree_leaves(inner))
    # Constants: typed replicated, like the communicated leaves' updates.
    merged = [jnp.zeros(jnp.shape(x), jnp.result_type(x)) if p else next(active)
              for x, p in zip(leaves, passive)]
    return jax.tree_util.tree_unflatten(treedef, merged), state

  return optax.GradientTransformation(init_fn, update_fn)
