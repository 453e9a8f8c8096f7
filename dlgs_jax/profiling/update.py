"""Each method's local update cost (selection, error feedback, optimizer), fitted per message size.

Every method is timed on groups of the model's own leaves holding its real
gradients -- the last m leaves in backward order, up to the whole model
(`suffix_groups`) --, from the state a few updates on real batches leave. The
grouping methods send a group as one message; the per-leaf methods (the
registry's ``per_leaf``) each leaf as its own message in one program, fitted
as ``m * alpha + beta * elements`` (`fit_per_leaf`). DLGS's exact and reuse
steps are fitted apart and also amortised over its reuse period.
"""

from __future__ import annotations
import math
from typing import Any, Callable, Optional, Sequence
import jax
import jax.numpy as jnp
import numpy as np
import optax
from dlgs_jax.compress.methods import METHODS, MethodConfig, names
from dlgs_jax.compress.optimizer import OptimizerConfig, build_optimizer
from dlgs_jax.planning.timeline import LinearCost
from dlgs_jax.profiling.timing import fit_linear, median_seconds



# Every method the timeline model predicts.
UPDATE_METHODS = names(modelled=True)
# Methods that send every leaf as its own message (no planner merges them in
# the benchmark and by default in training): their update cost is only ever
# evaluated at leaf sizes, so it is fitted over leaf sizes only.
PER_LEAF_METHODS = tuple(m.name for m in METHODS.values() if m.per_leaf_update)


def fit_update(raw: dict[str, list], largest_leaf: int) -> dict[str, LinearCost]:
  """Fits each method's update cost over the message sizes it sends.

  The standalone update time grows faster than linearly with the message
  (three times the cost per value from 0.8M to 25M values for ResNet-50's
  LAGS), so one line through the whole range overprices the small messages of
  per-leaf methods several-fold (experiments/performance_notes.md). `PER_LEAF_METHODS`
  are fitted over the sizes up to `largest_leaf` (at least the two smallest);
  the others (one message for the model, or planned groups up to it) over all,
  or over "group_sizes" where `measure_update` timed them on groups of the
  model's own leaves (the methods listed in raw "grouped"). Per-leaf methods
  timed on groups (raw "group_leaves" present) are fitted by `fit_per_leaf`.

  Args:
    raw: `measure_update`'s raw timings ("sizes" and one list per method).
    largest_leaf: elements of the model's largest leaf.

  Returns:
    Cost per method in `raw`.
  """
  sizes = np.asarray(raw["sizes"], np.float64)
  in_leaf_range = sizes <= largest_leaf
  in_leaf_range[:2] = True
  costs = {}
  for method, times in raw.items():
    if method in ("sizes", "group_sizes", "group_leaves", "grouped", "values", "warmup_steps"):
      continue
    times = np.asarray(times, np.float64)
    if _timed_on_groups(raw, method) and method in PER_LEAF_METHODS and "group_leaves" in raw:
      costs[method] = fit_per_leaf(raw["group_leaves"], raw["group_sizes"], times)
    elif _timed_on_groups(raw, method):
      costs[method] = fit_linear(np.asarray(raw["group_sizes"], np.float64), times)
    elif method in PER_LEAF_METHODS:
      costs[method] = fit_linear(sizes[in_leaf_range], times[in_leaf_range])
    else:
      costs[method] = fit_linear(sizes, times)
  return costs


def fit_per_leaf(leaves: Sequence[int], elements: Sequence[int],
                 times: Sequence[float]) -> LinearCost:
  """Per-message cost of a per-leaf method, from programs that update many leaves.

  LAGS, DGC and TernGrad send every leaf as its own message, so a program
  updating m leaves of S elements in all costs ``m * alpha + beta * S``: alpha
  is the marginal cost of one more leaf *inside* a program, which is what the
  train step pays 161 times on ResNet-50 -- not the cost of launching a
  one-leaf program, which single-leaf timings put into alpha (ResNet-20:
  experiments/performance_notes.md). Least squares with both coefficients kept
  >= 0.

  Args:
    leaves: leaves per timed program (m).
    elements: elements per timed program (S).
    times: seconds per timed program.

  Returns:
    ``LinearCost(alpha, beta)``: the cost of one leaf of n elements is
    ``alpha + beta * n``.
  """
  m = np.asarray(leaves, np.float64)
  n = np.asarray(elements, np.float64)
  t = np.asarray(times, np.float64)
  if not (len(m) == len(n) == len(t)) or not len(t):
    raise ValueError(f"fit_per_leaf: need equal, non-empty lists, got {len(m)} leaf counts, "
                     f"{len(n)} sizes and {len(t)} times")
  if np.any(m < 1) or np.any(n <= 0):
    raise ValueError(f"fit_per_leaf: leaf counts must be >= 1 and sizes > 0, got "
                     f"{list(leaves)} and {list(elements)}")
  if len(t) > 1:
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([m, n], axis=1), t, rcond=None)
  else:
    alpha, beta = -1.0, -1.0
  if alpha < 0 or beta < 0:
    # Keep the one term that explains the times better on its own.
    only_beta = float(np.sum(n * t) / np.sum(n * n))
    only_alpha = float(np.sum(m * t) / np.sum(m * m))
    if np.sum((t - only_beta * n) ** 2) <= np.sum((t - only_alpha * m) ** 2):
      alpha, beta = 0.0, only_beta
    else:
      alpha, beta = only_alpha, 0.0
  return LinearCost(float(alpha), float(beta))


def _timed_on_groups(raw: dict[str, list], key: str) -> bool:
  """Whether raw timing `key` ("dlgs_exact" belongs to "dlgs") follows "group_sizes"."""
  method = "dlgs" if key in ("dlgs_exact", "dlgs_reuse") else key
  return method in raw.get("grouped", ())


def suffix_groups(leaf_sizes: Sequence[int], targets: Sequence[float]) -> list[int]:
  """How many of the last leaves (in backward order) make each timed group.

  A planned group is a run of adjacent layers sent as one message, so a
  group's update is timed on real adjacent leaves: the last m in backward
  order (the input side of the model, where the leaves are smallest), m chosen
  per target so that their total is nearest it in ratio.

  Args:
    leaf_sizes: elements per leaf, in backward order.
    targets: message sizes (elements) wanted.

  Returns:
    Sorted distinct leaf counts m (1 <= m <= len(leaf_sizes)).
  """
  if not len(leaf_sizes):
    raise ValueError("suffix_groups: no leaves")
  totals = np.cumsum(np.asarray(leaf_sizes, np.float64)[::-1])
  if np.any(totals <= 0):
    raise ValueError(f"suffix_groups: leaf sizes must be positive, got {list(leaf_sizes)}")
  logs = np.log(totals)
  return sorted({int(np.argmin(np.abs(logs - np.log(max(float(t), 1.0))))) + 1
                 for t in targets})


def update_grid(sizes: Sequence[int], points: int = 6) -> list[int]:
  """Message sizes at which `profile_model` times the updates.

  `points` sizes spaced geometrically from 4,096 to the model's total, plus
  the largest leaf, where the fit of `PER_LEAF_METHODS` ends.
  """
  total = int(sum(sizes))
  grid = {int(s) for s in np.geomspace(4096, max(total, 8192), points)}
  return sorted(grid | {max(int(max(sizes)), 4096)})




def training_optimizer(method: str, density: float, *, reuse_every: int = 10,
                       order: Sequence[str] = ("x",),
                       refresh_below: Optional[float] = 0.5) -> optax.GradientTransformation:
  """`method`'s local update (``axis_name=None``) chained with training's optimizer.

  The same chain `dlgs-train` and `dlgs_jax.cli.benchmark` build (weight decay and
  momentum SGD after the compressor), for a flat dict whose keys are `order`
  (backward order), sent as one group -- one message -- by the methods that
  group leaves (dense, DLGS; LAGS keeps one message per leaf). `refresh_below`
  is DLGS's refresh rule (None: the paper's fixed schedule).
  """
  order = list(order)
  config = MethodConfig(method, density=density, reuse_every=reuse_every,
                        refresh_below=refresh_below)
  return build_optimizer(config, OptimizerConfig(), axis_name=None, schedule=0.01,
                         groups=one_message(method, order), order=order)


def one_message(method: str, order: Sequence[str]) -> Optional[list]:
  """The groups a profile times `method` with: one message for the planned methods, else None."""
  return [list(order)] if METHODS[method].grouping == "optimal" else None


def measure_update(sizes: Sequence[int], density: float, *,
                   methods: Sequence[str] = UPDATE_METHODS, reuse_every: int = 10,
                   repeats: int = 5, barrier: Optional[Callable[[], Any]] = None,
                   leaf_shapes: Optional[Sequence[Sequence[int]]] = None,
                   leaf_grads: Optional[Sequence[Sequence[Any]]] = None,
                   warmup_steps: Optional[int] = None
                   ) -> tuple[dict[str, LinearCost], dict[str, Any]]:
  """Fits each method's whole local update time per message.

  Times `training_optimizer(method)` on each message: what a message costs
  between its gradients being ready and its collective, plus the optimizer's
  work on it afterwards. Communication is not included. Without the model's
  leaves, a message is one leaf of each of `sizes`, filled with normal noise.
  With `leaf_shapes` or `leaf_grads`, every method is timed instead on groups
  of the model's own leaves (the last m in backward order, `suffix_groups` of
  `sizes`): the grouping methods send a group as one message (what a planned
  group or a whole-model message runs), `PER_LEAF_METHODS` each of its leaves
  as its own message in the same program (fitted by `fit_per_leaf`).

  The values and the state matter, since a selection's cost depends on them:
  sorting ties is cheap, and ResNet-50's gradients at initialisation (32x32
  input) are mostly exact zeros, on which Top-k ran in less than half the time
  it takes after a few training steps (experiments/performance_notes.md;
  `train_locally`). So pass
  gradients from a model that has trained a few steps, as `profile_model`
  does; each timed step first runs `warmup_steps` updates, on all but the
  last batch of `leaf_grads` in turn, and is then timed on the last: the
  state it sees is one training leaves (residuals, momentum, thresholds).
  DLGS is timed with the refresh rule off, on an exact step (the warm-up ends
  at a multiple of `reuse_every`) and on the reuse step after it; the model
  mixes the two by the measured refresh rate.

  Args:
    sizes: message sizes (elements) to time.
    density: the methods' density.
    methods: the methods to time.
    reuse_every: DLGS reuse period: its cost is ``(exact + (s - 1) * reuse) / s``
      with the exact and the reuse step timed separately; both are also
      returned alone, as "dlgs_exact" and "dlgs_reuse".
    repeats: timed repetitions per point.
    barrier: see `median_seconds`.
    leaf_shapes: the model's parameter shapes in backward order.
    leaf_grads: the model's gradients on one or more batches: per batch, one
      array per leaf in backward order (shapes equal to `leaf_shapes` where
      both are given). Without them, two draws of normal noise.
    warmup_steps: updates before each timed step (default `reuse_every`;
      DLGS rounds it up to a multiple of `reuse_every`).

  Returns:
    (cost per method, the raw measurements: "sizes", one list of seconds per
    method, "warmup_steps", and with the model's leaves "group_sizes" -- the
    groups' elements --, "group_leaves" -- their leaf counts --, "grouped" --
    the methods timed on them, whose lists follow "group_sizes" -- and
    "values": "gradients" or "noise").

  Raises:
    ValueError: `leaf_grads` is empty, its batches differ in shape or disagree
      with `leaf_shapes`, or `warmup_steps` < 0.
  """
  warmup_steps = reuse_every if warmup_steps is None else warmup_steps
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
  rng = np.random.default_rng(0)
  keys = [m for m in methods] + (["dlgs_exact", "dlgs_reuse"] if "dlgs" in methods else [])
  raw: dict[str, Any] = {"sizes": [int(s) for s in sizes], **{m: [] for m in keys},
                         "warmup_steps": int(warmup_steps)}

  def noise(shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

  if leaf_grads is not None:
    if not len(leaf_grads):
      raise ValueError("leaf_grads: no batches")
    grad_shapes = [[tuple(int(d) for d in np.shape(g)) for g in batch] for batch in leaf_grads]
    if any(shapes != grad_shapes[0] for shapes in grad_shapes):
      raise ValueError(f"leaf_grads: the batches' leaves differ in shape: {grad_shapes}")
    if leaf_shapes is not None and [tuple(int(d) for d in s) for s in leaf_shapes] != grad_shapes[0]:
      raise ValueError(f"leaf_grads have shapes {grad_shapes[0]}, leaf_shapes say "
                       f"{[tuple(s) for s in leaf_shapes]}")
    leaf_shapes = grad_shapes[0]
  if leaf_shapes is not None:
    shapes = [tuple(int(d) for d in shape) for shape in leaf_shapes]
    batches = ([[jnp.asarray(g, jnp.float32) for g in batch] for batch in leaf_grads]
               if leaf_grads is not None else [[noise(s) for s in shapes] for _ in range(2)])
    counts = suffix_groups([int(np.prod(shape)) for shape in shapes], sizes)
    # Zero-padded keys: the dict flattens in backward order.
    messages = [[{f"{i:04d}": v for i, v in enumerate(batch[len(batch) - m:])}
                 for batch in batches] for m in counts]
    raw["group_sizes"] = [int(sum(int(np.prod(s)) for s in shapes[len(shapes) - m:]))
                          for m in counts]
    raw["group_leaves"] = list(counts)
    raw["grouped"] = list(methods)
    raw["values"] = "gradients" if leaf_grads is not None else "noise"
  else:
    # Two dimensions, so DGC sparsifies the message (it sends 1-D leaves whole).
    messages = [[{"x": noise((1, size))} for _ in range(2)] for size in sizes]

  for method in methods:
    for message in messages:
      order = list(message[0])
      # DLGS: the fixed schedule, so that the timed steps are exact and reuse as asked.
      tx = training_optimizer(method, density, reuse_every=reuse_every, order=order,
                              refresh_below=None if method == "dlgs" else 0.5)
      update = jax.jit(tx.update)
      params = {k: jnp.zeros(v.shape, jnp.float32) for k, v in message[0].items()}
      warm, timed = message[:-1] or message, message[-1]
      if method == "dlgs":
        exact_state, reuse_state = dlgs_timed_states(update, tx.init(params), warm, params,
                                                     reuse_every, warmup_steps)
        exact = median_seconds(lambda: update(timed, exact_state, params), repeats,
                               barrier=barrier)
        reuse = median_seconds(lambda: update(timed, reuse_state, params), repeats,
                               barrier=barrier)
        raw["dlgs_exact"].append(exact)
        raw["dlgs_reuse"].append(reuse)
        raw[method].append((exact + (reuse_every - 1) * reuse) / reuse_every)
      else:
        state = warm_state(update, tx.init(params), warm, params, warmup_steps)
        raw[method].append(median_seconds(lambda: update(timed, state, params), repeats,
                                          barrier=barrier))
  return fit_update(raw, max(raw["sizes"]) if leaf_shapes is None else
                    max(int(np.prod(s)) for s in leaf_shapes)), raw


def warm_state(update: Callable, state: Any, batches: Sequence[Any], params: Any,
               steps: int, first: int = 0) -> Any:
  """`state` after `steps` calls of ``update(grads, state, params)``.

  The grads cycle through `batches`, starting at ``batches[first % len(batches)]``.
  """
  for i in range(first, first + steps):
    state = update(batches[i % len(batches)], state, params)[1]
  return jax.block_until_ready(state)


def dlgs_warmup_steps(reuse_every: int, warmup_steps: int) -> int:
  """The smallest multiple of `reuse_every` >= max(`warmup_steps`, 1): the next DLGS step is exact."""
  return reuse_every * max(1, math.ceil(warmup_steps / reuse_every))


def dlgs_timed_states(update: Callable, state: Any, batches: Sequence[Any], params: Any,
                      reuse_every: int, warmup_steps: int) -> tuple[Any, Any]:
  """The two DLGS states `measure_update` times: before an exact step, and before a reuse step.

  `update` must run DLGS's fixed schedule (no refresh rule): thresholds are
  computed exactly when the step count is a multiple of `reuse_every`. The
  warm-up runs the smallest such count >= max(`warmup_steps`, 1); one more
  step gives the reuse state (with ``reuse_every == 1`` both are exact).

  Returns:
    (exact_state, reuse_state).
  """
  steps = dlgs_warmup_steps(reuse_every, warmup_steps)
  exact_state = warm_state(update, state, batches, params, steps)
  return exact_state, warm_state(update, exact_state, batches, params, 1, first=steps)


# Batches whose gradients `profile_model` times the updates on: the updates
# warm up on all but the last (see `measure_update`). Each is a copy of the
# model's gradients in memory (100 MB for ResNet-50).
UPDATE_BATCHES = 3
