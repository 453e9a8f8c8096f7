"""Deep Gradient Compression (Lin et al., ICLR 2018).

Per worker and step, for every leaf: momentum correction -- the velocity
``u = m*u + g`` is accumulated, not the raw gradient, ``v = v + u`` -- then the
values of v above a threshold are sent (sparse all-gather), v keeps the rest
(nothing is lost), and momentum factor masking zeroes u where values were
sent. Leaves with fewer than `min_ndim` dimensions (biases, BatchNorm) are sent
dense: their mean velocity is all-reduced, which is exactly momentum SGD.

Because momentum lives inside DGC, chain it with *plain* SGD, and put weight
decay before it so the decay term is part of the accumulated gradient, as in
the paper::

    tx = optax.chain(optax.add_decayed_weights(5e-4),
                     dlgs_jax.dgc(0.001, axis_name="data", momentum=0.9,
                                  warmup_steps=4 * steps_per_epoch),
                     optax.sgd(learning_rate))

Threshold: estimated from a random sample of each tensor (the k_s-th largest of
``sample_ratio`` of its values), then refined: while fewer than
``band[0] * k`` values pass, the threshold is lowered by 0.8x (at most
`max_lowering` times); if the count is still outside ``[band[0]*k, band[1]*k]``
the exact k-th largest is used. A worker sends at most ``ceil(band[1] * k)``
values per leaf (the buffer size; more that pass stay in v). So the values
selected per leaf lie in ``[min(ceil(band[0]*k), nonzeros), ceil(band[1]*k)]``.

Warm-up: the density starts at `warmup_start` and decays exponentially to
`density` in `warmup_stages` equal stages over `warmup_steps` (the paper's
0.25, 0.0625, 0.0156, 0.004, then 0.001 over four epochs); each stage has its
own buffer size, so early steps cost what they send, not the final capacity.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from dlgs_jax.compress import collectives, common
from dlgs_jax.compress import engine, exchange, grouping
from dlgs_jax.compress import segmented
from dlgs_jax.compress.state import DGCState, empty_stats, skipped_stats, step_stats

LOWERING_FACTOR = 0.8


def warmup_densities(density: float, warmup_start: float, stages: int) -> list[float]:
  """Density of each warm-up stage, then the target: ``stages + 1`` values.

  Stage i uses ``warmup_start * (density / warmup_start) ** (i / stages)``;
  never below `density` (a target above `warmup_start` needs no warm-up).
  """
  if density >= warmup_start or stages == 0:
    return [density]
  return [max(density, warmup_start * (density / warmup_start) ** (i / stages))
          for i in range(stages)] + [density]


def warmup_stage(step, warmup_steps: int, stages: int):
  """Index into `warmup_densities` for `step` (int or traced int32)."""
  if warmup_steps == 0 or stages == 0:
    return jnp.zeros((), jnp.int32) if isinstance(step, jax.Array) else 0
  if isinstance(step, jax.Array):
    return jnp.minimum(step.astype(jnp.int32) * stages // warmup_steps, stages)
  return min(int(step) * stages // warmup_steps, stages)


def warmup_density(step: int, density: float, *, warmup_steps: int, warmup_start: float = 0.25,
                   stages: int = 4) -> float:
  """The density DGC uses at `step`."""
  values = warmup_densities(density, warmup_start, stages if warmup_steps else 0)
  return values[min(warmup_stage(step, warmup_steps, stages), len(values) - 1)]


def estimate_threshold(key: jax.Array, v: jax.Array, k: int, *, sample_ratio: float,
                       band: tuple[float, float], max_lowering: int,
                       min_sample: int = 1024) -> jax.Array:
  """DGC's sampled threshold for keeping about k of ``|v|`` (see module docstring)."""
  magnitude = jnp.abs(v.reshape(-1)).astype(jnp.float32)
  n = magnitude.shape[0]
  sample_size = min(n, max(int(math.ceil(sample_ratio * n)), min_sample))
  if sample_size >= n:
    return segmented.exact_threshold(magnitude, k)  # small tensor: exact is as cheap
  positions = jax.random.randint(key, (sample_size,), 0, n)
  sample = magnitude[positions]
  k_sample = max(1, int(math.ceil(k / n * sample_size)))
  threshold = jnp.min(lax.top_k(sample, k_sample)[0])
  lower, upper = math.ceil(band[0] * k), math.floor(band[1] * k)

  def passing(t):
    return jnp.sum((magnitude >= t) & (magnitude > 0), dtype=jnp.int32)

  def too_few(carry):
    t, count, i = carry
    return (count < lower) & (i < max_lowering)

  def lower_it(carry):
    t, _, i = carry
    t = t * LOWERING_FACTOR
    return t, passing(t), i + 1

  threshold, count, _ = lax.while_loop(too_few, lower_it, (threshold, passing(threshold), 0))
  return lax.cond((count < lower) | (count > upper),
                  lambda: segmented.exact_threshold(magnitude, k),
                  lambda: threshold)


def dgc(
    density: float,
    *,
    axis_name=None,
    momentum: float = 0.9,
    sample_ratio: float = 0.01,
    warmup_steps: int = 0,
    warmup_start: float = 0.25,
    warmup_stages: int = 4,
    min_ndim: int = 2,
    band: tuple[float, float] = (0.8, 1.3),
    max_lowering: int = 3,
    clip_norm: Optional[float] = None,
    seed: int = 0,
    skip_nonfinite: bool = True,
    residual_dtype="float32",
) -> optax.GradientTransformation:
  """Deep Gradient Compression; see the module docstring for the algorithm.

  Args:
    density: final fraction of each sparsified leaf sent, in (0, 1].
    axis_name: data-parallel axis name; ``None`` = one worker.
    momentum: m of the momentum correction, in [0, 1).
    sample_ratio: fraction of a tensor sampled to estimate its threshold
      (at least 1024 values; smaller tensors use the exact threshold).
    warmup_steps: steps of density warm-up (0: none).
    warmup_start: density at the start of the warm-up.
    warmup_stages: equal stages of the exponential warm-up.
    min_ndim: leaves with fewer dimensions are sent dense.
    band: (lower, upper) multiples of k that the refined count must fall in;
      ``ceil(upper * k)`` is also the buffer size per leaf.
    max_lowering: how many times a too-high threshold is lowered by 0.8x
      before falling back to the exact k-th largest.
    clip_norm: local gradient clipping: each worker scales its gradient to a
      norm of at most ``clip_norm / sqrt(P)`` before momentum (the paper's
      local clipping); ``None`` disables it.
    seed: PRNG seed for the threshold samples (folded with step and worker).
    skip_nonfinite: skip steps with a non-finite gradient on any worker
      (velocity and residuals kept).
    residual_dtype: dtype of the velocity and the residuals of floating leaves
      (float32 whatever the parameters' dtype; the step computes in float32).

  Returns:
    An `optax.GradientTransformation` with state `DGCState`; its update is the
    mean over workers of what was sent (sparse v for large leaves, u for the
    dense ones). Follow it with plain SGD. ``stats.selected`` has one entry per
    sparsified leaf in flatten order, then one for all dense leaves together.

  Raises:
    ValueError: for an argument out of range.
  """
  axis_name = common.check_axis_name(axis_name)
  residual_dtype = common.check_residual_dtype(residual_dtype)
  lower, upper = _check_args(momentum, sample_ratio, warmup_steps, warmup_stages, max_lowering,
                             min_ndim, band, clip_norm)
  densities, reached, branch_of_stage = _warmup_plan(
      common.check_density(density), common.check_density(warmup_start), warmup_steps, warmup_stages)
  settings = _Settings(axis_name, momentum, sample_ratio, min_ndim, lower, upper, max_lowering,
                       clip_norm, warmup_steps, warmup_stages, densities, reached,
                       branch_of_stage)

  def init_fn(params):
    leaves, treedef, sparse, dense = _split(params, min_ndim)
    zeros = jax.tree_util.tree_unflatten(
        treedef, [jnp.zeros(x.shape, common.residual_dtype_for(x, residual_dtype))
                  for x in leaves])
    key = jax.random.key_data(jax.random.key(seed))
    return DGCState(jnp.zeros((), jnp.int32), zeros, zeros, key,
                    empty_stats(_group_paths(grouping.leaf_paths(params), sparse, dense)))

  def update_fn(updates, state, params=None):
    del params
    common.check_matches(updates, state.velocity, "the optimizer state")
    grads, treedef, sparse, dense = _split(updates, min_ndim)
    grads = [g.astype(jnp.float32) for g in grads]
    kept = [jax.tree_util.tree_leaves(state.velocity), jax.tree_util.tree_leaves(state.residuals)]
    velocity, residuals = ([x.astype(jnp.float32) for x in tree] for tree in kept)
    step = _Step(settings, state, grads, velocity, residuals, sparse, dense)
    means, (new_u, new_v, stats, count) = common.unless_nonfinite(
        skip_nonfinite, grads, axis_name, step.communicate, step.skip)
    new_u = [x.astype(old.dtype) for x, old in zip(new_u, kept[0])]
    new_v = [x.astype(old.dtype) for x, old in zip(new_v, kept[1])]
    original = jax.tree_util.tree_leaves(updates)
    unflatten = lambda leaves: jax.tree_util.tree_unflatten(treedef, leaves)
    return (unflatten([m.astype(g.dtype) for m, g in zip(means, original)]),
            DGCState(count, unflatten(new_u), unflatten(new_v), state.key, stats))

  return common.with_passive_leaves(optax.GradientTransformation(init_fn, update_fn), axis_name,
                                    DGCState, "dgc")


def _check_args(momentum, sample_ratio, warmup_steps, warmup_stages, max_lowering, min_ndim,
                band, clip_norm) -> tuple[float, float]:
  """Raises ValueError naming the first bad argument; returns the band as floats."""
  if not (isinstance(momentum, numbers.Real) and 0.0 <= momentum < 1.0):
    raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
  if not (isinstance(sample_ratio, numbers.Real) and 0.0 < sample_ratio <= 1.0):
    raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio!r}")
  for name, value in (("warmup_steps", warmup_steps), ("warmup_stages", warmup_stages),
                      ("max_lowering", max_lowering), ("min_ndim", min_ndim)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
  try:
    lower, upper = (float(b) for b in band)
  except (TypeError, ValueError):
    raise ValueError(f"band must be two numbers (lower, upper), got {band!r}") from None
  if not 0.0 < lower <= 1.0 <= upper:
    raise ValueError(f"band must satisfy 0 < lower <= 1 <= upper, got {band!r}")
  if clip_norm is not None and not (isinstance(clip_norm, numbers.Real) and clip_norm > 0):
    raise ValueError(f"clip_norm must be a positive number or None, got {clip_norm!r}")
  return lower, upper


def _warmup_plan(density: float, warmup_start: float, warmup_steps: int, warmup_stages: int):
  """(densities, stages some step reaches, stage -> branch) of the warm-up."""
  densities = warmup_densities(density, warmup_start, warmup_stages if warmup_steps else 0)
  # Each stage is a branch of its own exchange, compiled whether it runs or not;
  # a warm-up shorter than its stages skips some (e.g. 1 step of 4 stages: only
  # stages 0 and 4 run), so only the stages some step reaches are built.
  if len(densities) == 1:
    reached = [0]
  elif warmup_steps >= warmup_stages:
    # stage(step + 1) - stage(step) <= stages / warmup_steps <= 1: every stage is hit.
    reached = list(range(len(densities)))
  else:
    reached = sorted({warmup_stage(step, warmup_steps, warmup_stages)
                      for step in range(warmup_steps + 1)})
  # stage -> branch; a stage no step reaches never indexes this table.
  branch_of_stage = [min(i for i, r in enumerate(reached) if r >= stage)
                     for stage in range(len(densities))]
  return tuple(densities), tuple(reached), tuple(branch_of_stage)


@dataclasses.dataclass(frozen=True)
class _Settings:
  axis_name: object
  momentum: float
  sample_ratio: float
  min_ndim: int
  lower: float
  upper: float
  max_lowering: int
  clip_norm: Optional[float]
  warmup_steps: int
  warmup_stages: int
  densities: tuple   # density of each warm-up stage, then the target
  reached: tuple     # the stages some step reaches (one exchange branch each)
  branch_of_stage: tuple


def _split(tree, min_ndim: int):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  sparse = [i for i, x in enumerate(leaves) if x.ndim >= min_ndim]
  dense = [i for i, x in enumerate(leaves) if x.ndim < min_ndim]
  return leaves, treedef, sparse, dense


def _group_paths(paths, sparse, dense) -> list[list[str]]:
  """One message per sparsified leaf, then one fused message of the dense leaves."""
  return [[paths[i]] for i in sparse] + ([[paths[i] for i in dense]] if dense else [])


class _Step:
  """One update: momentum correction, the sparse and the dense exchange (or a skip)."""

  def __init__(self, settings: _Settings, state: DGCState, grads, velocity, residuals,
               sparse, dense):
    self.s, self.state = settings, state
    self.grads, self.velocity, self.residuals = grads, velocity, residuals
    self.sparse, self.dense = sparse, dense
    # One group per sparsified leaf, in flatten order (the order of stats.selected).
    self.sparse_layout = (engine.make_layout([grads[i] for i in sparse],
                                             [[str(j)] for j in range(len(sparse))], None)
                          if sparse else None)
    self.dense_layout = (engine.make_layout([grads[i] for i in dense], None, None,
                                            single_group=True) if dense else None)

  def clipped(self, g):
    s = self.s
    if s.clip_norm is None:
      return g
    workers = collectives.num_workers(s.axis_name)
    norm = jnp.sqrt(sum(jnp.sum(x * x) for x in g))
    scale = jnp.minimum(1.0, s.clip_norm / (math.sqrt(workers) * jnp.maximum(norm, 1e-30)))
    return [x * scale for x in g]

  def sparse_exchange(self, accumulated):
    """(means, new v, selected, passed, bytes) of the sparsified leaves at this step's stage."""
    s, state = self.s, self.state
    key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.key),
                                                state.count),
                             collectives.worker_index(s.axis_name))

    def branch(d):
      def run(_):
        select = engine.Selection("threshold", d, capacity_factor=s.upper)
        layout = self.sparse_layout
        flats, picked = [], []
        for j, v in enumerate(accumulated):
          threshold = estimate_threshold(
              jax.random.fold_in(key, j), v, select.leaf_k(layout, j),
              sample_ratio=s.sample_ratio, band=(s.lower, s.upper), max_lowering=s.max_lowering)
          flats.append(engine.Summed(layout.lay_out(j, accumulated), None))
          picked.append(engine.pick_at(select, layout, j, flats[-1], threshold[None]))
        out = exchange.sparse_exchange(layout, select, "allgather", flats, picked,
                                       axis_name=s.axis_name)
        means = [layout.cut(j, mean)[j] for j, mean in enumerate(out.means)]
        kept = [layout.cut(j, flat)[j] for j, flat in enumerate(out.residuals)]
        return (means,) + tuple(common.as_varying(
            (kept, out.selected, out.passed, out.bytes_sent), s.axis_name))
      return run

    stage = warmup_stage(state.count, s.warmup_steps, s.warmup_stages)
    if len(s.reached) == 1:
      return branch(s.densities[s.reached[0]])(None)
    return lax.switch(jnp.asarray(s.branch_of_stage, jnp.int32)[stage],
                      [branch(s.densities[r]) for r in s.reached], None)

  def communicate(self):
    s, sparse, dense = self.s, self.sparse, self.dense
    u = [s.momentum * a + b for a, b in zip(self.velocity, self.clipped(self.grads))]
    means = [None] * len(u)
    new_u, new_v = list(u), list(self.residuals)
    bytes_sent = jnp.zeros((), jnp.float32)
    selected, passed = [], []
    if sparse:
      accumulated = [self.residuals[i] + u[i] for i in sparse]
      sparse_means, sparse_v, sel, pas, sent = self.sparse_exchange(accumulated)
      for j, i in enumerate(sparse):
        sent_mask = (accumulated[j] != 0) & (sparse_v[j] == 0)
        means[i] = sparse_means[j]
        new_v[i] = sparse_v[j]
        new_u[i] = jnp.where(sent_mask, 0.0, u[i])  # momentum factor masking
      bytes_sent = bytes_sent + sent
      selected.append(sel)
      passed.append(pas)
    if dense:
      dense_means, sent, _ = exchange.dense_exchange(self.dense_layout, [u[i] for i in dense],
                                                   axis_name=s.axis_name)
      for j, i in enumerate(dense):
        means[i] = dense_means[j]
      size = jnp.asarray([self.dense_layout.group_size(0)], jnp.int32)
      bytes_sent = bytes_sent + sent
      selected.append(size)
      passed.append(size)
    stats = step_stats(self.state.stats, bytes_sent, bytes_sent, jnp.concatenate(selected),
                       jnp.concatenate(passed))
    return means, common.as_varying((new_u, new_v, stats, self.state.count + 1), s.axis_name)

  def skip(self):
    state = self.state
    means = [jnp.zeros(g.shape, jnp.float32) for g in self.grads]
    stats = skipped_stats(state.stats)
    return means, common.as_varying(
        (list(self.velocity), list(self.residuals), stats, state.count), self.s.axis_name)
