"""TernGrad: stochastic ternary gradients, two bits per value (Wen et al. 2017).

Per leaf, every worker optionally clips its gradient at ``clip * std(g)``, the
workers agree on one scaler ``s = max over workers of max|g|`` (one `pmax` of a
vector with one entry per leaf), and each value becomes
``s * sign(g) * Bernoulli(|g| / s)`` -- unbiased: ``E[q] = g`` (for the clipped
g). The ternary values are packed four to a byte, all-gathered (one collective
per group), decoded and averaged, so a worker sends 1/16 of the float32 bytes.
There is no residual: the error is zero-mean noise, not deferred mass.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dlgs_jax.compress import collectives, common
from dlgs_jax.compress import engine
from dlgs_jax.compress import wire
from dlgs_jax.compress.state import TernGradState, empty_stats, skipped_stats, step_stats


def pack_ternary(values: jax.Array) -> jax.Array:
  """int8 values in {-1, 0, 1} -> uint8[ceil(n / 4)], four 2-bit codes per byte."""
  codes = (values.reshape(-1).astype(jnp.int32) + 1).astype(jnp.uint8)
  codes = jnp.pad(codes, (0, (-codes.shape[0]) % 4)).reshape(-1, 4)
  return (codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6))


def unpack_ternary(packed: jax.Array, size: int) -> jax.Array:
  """Inverse of `pack_ternary`: uint8[..., m] -> int8[..., size] in {-1, 0, 1}."""
  shifts = jnp.asarray([0, 2, 4, 6], jnp.uint8)
  codes = (packed[..., None] >> shifts) & jnp.uint8(3)
  codes = codes.reshape(packed.shape[:-1] + (-1,))[..., :size]
  return codes.astype(jnp.int8) - 1


def ternarize(key: jax.Array, g: jax.Array, scaler: jax.Array) -> jax.Array:
  """``sign(g) * Bernoulli(|g| / scaler)`` as int8 (all zeros when scaler is 0)."""
  ratio = jnp.where(scaler > 0, jnp.abs(g) / jnp.where(scaler > 0, scaler, 1.0), 0.0)
  keep = jax.random.uniform(key, g.shape, jnp.float32) < ratio
  return (jnp.sign(g) * keep).astype(jnp.int8)


def terngrad(
    *,
    axis_name=None,
    clip: Optional[float] = 2.5,
    seed: int = 0,
    groups=None,
    order: Optional[Sequence[str]] = None,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformation:
  """TernGrad (Wen et al., NeurIPS 2017): unbiased ternary gradients.

  Args:
    axis_name: data-parallel axis name; ``None`` = one worker.
    clip: clip each leaf at ``clip * std(leaf)`` (population std) before
      ternarising, as the public TernGrad code does (c = 2.5); ``None`` keeps
      the raw gradient (then ``s = max|g|``, the paper's form).
    seed: PRNG seed; each step uses ``fold_in(fold_in(key, step), worker)``, so
      draws differ per worker and per step and are reproducible.
    groups: leaf-path groups, each packed into one buffer and all-gathered in
      one collective (``None``: one group per leaf); or a plan.
    order: backward order of the leaf paths, to check the groups.
    skip_nonfinite: skip steps with a non-finite gradient on any worker.

  Returns:
    An `optax.GradientTransformation` with state `TernGradState`; its update is
    the mean over workers of the decoded ternary gradients.
  """
  axis_name = common.check_axis_name(axis_name)
  if clip is not None and (isinstance(clip, bool) or not isinstance(clip, numbers.Real)
                           or not float(clip) > 0):
    raise ValueError(f"clip must be a positive number or None, got {clip!r}")
  groups, order = common.check_groups(groups, order)

  def layout_of(tree):
    return engine.make_layout(tree, groups, order)

  def init_fn(params):
    layout = layout_of(params)
    key = jax.random.key_data(jax.random.key(seed))
    return TernGradState(jnp.zeros((), jnp.int32), key, empty_stats(layout.group_paths()))

  def update_fn(updates, state, params=None):
    if params is not None:
      common.check_matches(updates, params, "the parameters")
    layout = layout_of(updates)
    grads = [g.astype(jnp.float32) for g in jax.tree_util.tree_leaves(updates)]
    workers = collectives.num_workers(axis_name)

    def communicate():
      clipped = [_clip(g, clip) for g in grads]
      scalers = jnp.stack([jnp.max(jnp.abs(g)) for g in clipped])
      if axis_name is not None:
        scalers = lax.pmax(scalers, axis_name)  # shared, so ternary values can be summed
      key = jax.random.wrap_key_data(state.key)
      key = jax.random.fold_in(jax.random.fold_in(key, state.count),
                               collectives.worker_index(axis_name))
      ternary = [ternarize(jax.random.fold_in(key, i), g, scalers[i])
                 for i, g in enumerate(clipped)]
      means = [None] * len(grads)
      sent_bytes = wire.allreduce_bytes(len(grads), workers)  # the scalers
      selected, passed = [], []
      for group, leaves in enumerate(layout.groups):
        flat = engine.concat_flat([ternary[leaf] for leaf in leaves])
        packed = pack_ternary(flat)
        if axis_name is None:
          gathered = packed[None]
        else:
          gathered = collectives.gather_replicated(packed, axis_name)
        total = jnp.sum(unpack_ternary(gathered, flat.shape[0]).astype(jnp.int32), axis=0)
        for leaf, value in engine.split_flat(layout, group, total).items():
          means[leaf] = value.astype(jnp.float32) * scalers[leaf] / workers
        sent_bytes += wire.packed_allgather_bytes(packed.shape[0], workers)
        selected.append(jnp.asarray(flat.shape[0], jnp.int32))
        passed.append(jnp.sum(flat != 0, dtype=jnp.int32))
      sent = jnp.asarray(sent_bytes, jnp.float32)
      stats = step_stats(state.stats, sent, sent, jnp.stack(selected), jnp.stack(passed))
      return means, common.as_varying((stats, state.count + 1), axis_name)

    def skip():
      means = [jnp.zeros(shape, jnp.float32) for shape in layout.shapes]
      stats = skipped_stats(state.stats)
      return means, common.as_varying((stats, state.count), axis_name)

    means, (stats, count) = common.unless_nonfinite(
        skip_nonfinite, grads, axis_name, communicate, skip)
    new_updates = jax.tree_util.tree_unflatten(
        layout.treedef, [m.astype(g.dtype) for m, g in
                         zip(means, jax.tree_util.tree_leaves(updates))])
    return new_updates, TernGradState(count, state.key, stats)

  return common.with_passive_leaves(optax.GradientTransformation(init_fn, update_fn), axis_name,
                                    TernGradState, "terngrad")


def _clip(g: jax.Array, clip: Optional[float]) -> jax.Array:
  if clip is None:
    return g
  # A constant leaf (std 0, e.g. one value) is left alone rather than zeroed.
  std = jnp.std(g)
  bound = jnp.where(std > 0, clip * std, jnp.inf)
  return jnp.clip(g, -bound, bound)
