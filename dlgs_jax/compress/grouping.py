"""Leaf names, the order in which gradients become ready, and leaf groups.

A *group* is a run of leaves that is packed into one buffer and sent with one
collective. Groups are contiguous runs in *backward order* -- the order in which
backpropagation produces the gradients (output layer first). Flax parameter
dicts flatten in key order ("Conv_10" before "Conv_2"), which is not that
order, so `backward_order` derives it from the gradient computation itself.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
from jax import tree_util


def leaf_paths(tree: Any) -> list[str]:
  """Slash-separated path of every leaf, in `jax.tree_util` flatten order.

  ``{"params": {"Dense_0": {"kernel": x}}}`` gives ``["params/Dense_0/kernel"]``.
  """
  with_paths, _ = tree_util.tree_flatten_with_path(tree)
  return [tree_util.keystr(path, simple=True, separator="/")
          for path, _ in with_paths]


def backward_order(
    loss_fn: Callable[..., Any], params: Any, *args: Any, has_aux: bool = False, **kwargs: Any
) -> list[str]:
  """Leaf paths of `params` in the order their gradients become ready.

  Traces ``jax.grad(loss_fn)(params, *args, **kwargs)`` to a jaxpr and ranks
  each gradient by the position of the equation that produces it (descending
  into nested jaxprs such as jitted sub-functions). Nothing is executed.

  Args:
    loss_fn: scalar function whose first argument is `params`.
    params: the parameter tree (arrays or `jax.ShapeDtypeStruct` shapes).
    *args: further arguments of `loss_fn` (a batch, a model state, ...): pytrees
      of arrays.
    has_aux: `loss_fn` returns ``(loss, anything)`` (as for ``jax.grad``), e.g.
      the updated model state.
    **kwargs: keyword arguments of `loss_fn`.

  Returns:
    Every leaf path of `params` exactly once, earliest-ready first.
  """
  # The other arguments are traced too: a Flax NNX model merged from them inside
  # the loss may then update its state (BatchNorm statistics) as it does in a step.
  grad_fn = jax.grad(loss_fn, has_aux=has_aux)
  closed = jax.make_jaxpr(lambda p, a: grad_fn(p, *a, **kwargs))(params, args)
  paths = leaf_paths(params)
  positions = _producer_positions(closed.jaxpr)
  ranked = []
  for flat_index, (path, var) in enumerate(zip(paths, closed.jaxpr.outvars)):
    # Gradients that are literals or inputs (unused parameters) exist from the
    # start; ties fall back to reverse flatten order.
    position = positions.get(_var_key(var), ())
    ranked.append((position, -flat_index, path))
  ranked.sort()
  return [path for _, _, path in ranked]


def output_layer(order: Sequence[str]) -> list[str]:
  """Leaf paths of the model's output layer (the classifier head).

  The output layer's gradients are the first to become ready, so it is the
  module of ``order[0]``; its leaves are the paths in that module (same path
  up to the last ``/``; Flax NNX paths end in the variable's ``/value``, which
  is not a part of the module's name).

  Args:
    order: every leaf path, earliest-ready first (`backward_order`).

  Returns:
    The output layer's leaf paths, in `order`'s order.

  Raises:
    ValueError: for an empty order.
  """
  if not order:
    raise ValueError("order is empty: the model has no parameters")
  module = _module_of(order[0])
  return [path for path in order if _module_of(path) == module]


def _module_of(path: str) -> str:
  if path.endswith("/value"):
    path = path[:-len("/value")]
  return path.rpartition("/")[0]


def _var_key(var) -> int:
  return id(var)


def _producer_positions(jaxpr, prefix=()) -> dict[int, tuple[int, ...]]:
  """Maps each output variable of `jaxpr` to the position of its producer.

  Positions are tuples so that a gradient produced inside equation 7's nested
  jaxpr at its equation 3 ranks as (7, 3): after everything in equations < 7
  and in the order the nested jaxpr computes it.
  """
  positions: dict[int, tuple[int, ...]] = {}
  for index, eqn in enumerate(jaxpr.eqns):
    sub = _sub_jaxpr(eqn)
    inner: dict[int, tuple[int, ...]] = {}
    if sub is not None and len(sub.outvars) == len(eqn.outvars):
      inner_positions = _producer_positions(sub, ())
      for outer_var, inner_var in zip(eqn.outvars, sub.outvars):
        if _var_key(inner_var) in inner_positions:
          inner[_var_key(outer_var)] = inner_positions[_var_key(inner_var)]
    for var in eqn.outvars:
      positions[_var_key(var)] = prefix + (index,) + inner.get(_var_key(var), ())
  return positions


def _sub_jaxpr(eqn):
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = eqn.params.get(name)
    if sub is None:
      continue
    return getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
  return None


# Default buckets hold up to this many values, the 25 MB of float32 that
# PyTorch DDP's buckets hold: each bucket is one message and its own fixed
# passes, so their number grows with the model's size, not with its number of
# leaves (ResNet-50: 161 leaves in 5 buckets, VGG16: 54 in 3, ResNet-20: 1).
BUCKET_VALUES = 25 * 2**20 // 4


def size_buckets(sizes: Sequence[int], limit: int = BUCKET_VALUES) -> list[list[int]]:
  """Consecutive runs of leaves of at most `limit` values (a larger leaf alone).

  Args:
    sizes: the leaves' sizes, in the order they are bucketed (backward order).
    limit: the most values a bucket holds (>= 1).

  Returns:
    Positions in `sizes`, one list per bucket, in order.
  """
  buckets: list[list[int]] = []
  total = 0
  for i, size in enumerate(sizes):
    if not buckets or total + size > limit:
      buckets.append([])
      total = 0
    buckets[-1].append(i)
    total += size
  return buckets


def resolve_groups(
    paths: Sequence[str],
    groups: Optional[Sequence[Sequence[str]]],
    order: Optional[Sequence[str]] = None,
    sizes: Optional[Sequence[int]] = None,
) -> list[list[int]]:
  """Validates `groups` and turns them into lists of flat leaf indices.

  Args:
    paths: every leaf path, in flatten order (`leaf_paths(params)`).
    groups: a partition of the leaf paths into runs, listed in backward order;
      ``None`` gives one group per leaf, in `order` (or reverse flatten order),
      or with `sizes` buckets of those leaves (`size_buckets`).
    order: the backward order of all leaves (e.g. from `backward_order`). When
      given, every group must be a contiguous run of it, and the groups must
      appear in it in order.
    sizes: the leaves' sizes in flatten order, to bucket them when `groups` is
      None.

  Returns:
    One list of flat leaf indices per group.

  Raises:
    ValueError: a group names an unknown leaf, a leaf is missing or repeated, a
      group is empty, or groups are not contiguous runs of `order`.
  """
  index_of = {path: i for i, path in enumerate(paths)}
  if order is not None:
    order = list(order)
    _check_partition(index_of, [order], what="order")
  if groups is None:
    sequence = [index_of[path] for path in (order if order is not None
                                             else list(reversed(paths)))]
    if sizes is None:
      return [[leaf] for leaf in sequence]
    return [[sequence[i] for i in bucket]
            for bucket in size_buckets([sizes[leaf] for leaf in sequence])]
  groups = [list(group) for group in groups]
  _check_partition(index_of, groups, what="groups")
  if order is not None:
    flat = [path for group in groups for path in group]
    if flat != order:
      position = {path: i for i, path in enumerate(order)}
      for group in groups:
        spots = [position[path] for path in group]
        if spots != list(range(spots[0], spots[0] + len(spots))):
          raise ValueError(
              f"group {group!r} is not a contiguous run of the backward order "
              f"(positions {spots})")
      raise ValueError(
          "groups are contiguous but not listed in backward order: "
          f"{[g[0] for g in groups]!r}")
  return [[index_of[path] for path in group] for group in groups]


def _check_partition(index_of, groups, *, what: str) -> None:
  seen: set[str] = set()
  for group in groups:
    if isinstance(group, str):
      raise ValueError(f"{what}: each group must be a list of leaf paths, got {group!r}")
    if not group:
      raise ValueError(f"{what}: empty group in {groups!r}")
    for path in group:
      if path not in index_of:
        raise ValueError(
            f"{what}: unknown leaf {path!r}; the parameters have {sorted(index_of)!r}")
      if path in seen:
        raise ValueError(f"{what}: leaf {path!r} appears more than once")
      seen.add(path)
  missing = [path for path in index_of if path not in seen]
  if missing:
    raise ValueError(f"{what}: leaves missing from every group: {missing!r}")
