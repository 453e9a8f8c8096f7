"""Measuring a `timeline.Profile` on the machine and mesh in use.

* Compute: the forward time and the whole backward time of a Flax model are
  timed under `jax.jit` (in `profile_model`: 20 times, on the train step's own
  program at trained params on real batches); per-layer backward times come from timing each
  parameter-owning module's VJP alone on the input it sees in the model
  (captured with `flax.linen.intercept_methods`). Their sum misses what lies
  between modules (activations, pooling, shortcuts), so they are scaled to the
  measured whole backward time; the unscaled difference is reported.
* Update: each method's whole local update as training runs it (selection,
  error-feedback bookkeeping -- residual add, gather, new residual -- and the
  optimizer after it) with ``axis_name=None``, fitted as
  ``alpha + beta * elements`` over the sizes the method's messages have
  (`fit_update`). Every method is timed on groups of the model's own leaves
  holding its real gradients -- the last m leaves in backward order, up to the
  whole model (`suffix_groups`) --, from the state a few updates on real
  batches leave (residuals, momentum, thresholds): the grouping methods (one message for the
  model, or planned groups) send a group as one message, the per-leaf methods
  (`PER_LEAF_METHODS`) each leaf as its own message in one program, fitted as
  ``m * alpha + beta * elements`` (`fit_per_leaf`). One leaf as large as the
  model is not what they run: on ResNet-50 at density 0.1 DLGS's update of
  one 25.6M-value leaf took 5.0 s, where the benchmark measured 0.52 s a step
  on the model's 161 leaves (the whole-model line predicted that step +191%);
  nor is normal noise what they select from (`measure_update`). DLGS's exact
  and reuse steps are fitted apart and also amortised over its reuse period.
  Timing the selection alone misses the bookkeeping, which on CPU costs more
  than the selection (ResNet-50 DLGS: 0.89 s measured against 0.18 s of
  selection). A program of its own also prices memory-bound updates above
  what the train step pays for them (ResNet-50: the dense optimizer 53 ms
  alone, 12 ms in the step), so each method's whole-model update is timed
  inside the step too, in paired rounds with the gradients program
  (`measure_update_in_step`), and its fitted cost is scaled to that where
  the rounds resolve it (`in_step_factors`, `scale_update_costs`).
* Refresh rate: how often DLGS's refresh rule recomputes a reused threshold
  depends on how gradients and residuals drift, so it is measured by training
  one worker for a few steps on real batches (`measure_refresh`).
* Communication: dense all-reduce, sparse all-gather and gTop-k timed on the
  current mesh over a range of message sizes and fitted as
  ``alpha + beta * bytes sent per worker``, alpha being the marginal cost of
  one more collective in a program (`measure_comm`); or, to look past this machine,
  `network_comm` builds the same costs from a latency and a link bandwidth.
* Overlap: whether the runtime hides a collective behind computation that does
  not depend on it (`measure_overlap`); the profile's ``overlap`` flag.

All timings are medians after warm-up. With several processes pass a
`barrier` (e.g. `multihost_utils.sync_global_devices`): every process then
starts each repetition together, as in training, so processes sharing a core
are timed sharing it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import time
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from dlgs_jax import collectives, grouping, parallel, selection, wire
from dlgs_jax.timeline import MODELLED, LinearCost, Profile


def median_seconds(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
                   barrier: Optional[Callable[[], Any]] = None,
                   samples: Optional[list] = None) -> float:
  """Median wall time of ``fn()`` (blocking on its result) after `warmup` calls.

  Args:
    fn: the call to time.
    repeats: timed calls.
    warmup: untimed calls first (compilation).
    barrier: called before each timed call, outside the timing (keeps the
      processes of a job in lockstep); None: no barrier.
    samples: if given, every timed call's seconds are appended to it.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    if barrier is not None:
      barrier()
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  if samples is not None:
    samples.extend(times)
  return float(np.median(times))


def fit_linear(x: Sequence[float], t: Sequence[float]) -> LinearCost:
  """Least-squares ``t = alpha + beta * x`` with both coefficients kept >= 0."""
  x = np.asarray(x, np.float64)
  t = np.asarray(t, np.float64)
  beta, alpha = np.polyfit(x, t, 1) if len(x) > 1 else (0.0, float(t[0]))
  if beta < 0:
    beta, alpha = 0.0, float(np.median(t))
  if alpha < 0:
    alpha, beta = 0.0, float(np.sum(x * t) / np.sum(x * x))
  return LinearCost(float(alpha), float(beta))


# ---------------------------------------------------------------- compute ---

_PARAM_MODULES = (nn.Conv, nn.Dense, nn.BatchNorm, nn.LayerNorm, nn.Embed, nn.GroupNorm)


def _subtree(tree, path):
  for name in path:
    tree = tree[name]
  return tree


def layer_backward_times(model: nn.Module, variables: dict, inputs: jax.Array, *,
                         repeats: int = 5, barrier: Optional[Callable[[], Any]] = None
                         ) -> dict[tuple[str, ...], float]:
  """Backward time of each parameter-owning module, timed alone (module path -> s)."""
  calls: list[tuple[nn.Module, tuple, dict]] = []

  def record(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and isinstance(context.module, _PARAM_MODULES):
      calls.append((context.module, args, kwargs))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    model.apply(variables, inputs, train=True, mutable=["batch_stats"])
  times: dict[tuple[str, ...], float] = {}
  for module, args, kwargs in calls:
    path = tuple(module.path)
    if path in times:
      continue
    overrides = {"axis_name": None} if hasattr(module, "axis_name") else {}
    alone = module.clone(parent=None, **overrides)
    module_vars = {c: _subtree(variables[c], path) for c in variables
                   if _has_path(variables[c], path)}
    params = module_vars.pop("params")

    def apply(p, x, alone=alone, module_vars=module_vars, kwargs=kwargs):
      if not module_vars:
        return alone.apply({"params": p}, x, **kwargs)
      # Statistics (BatchNorm) are updated in training mode: return only the output.
      return alone.apply({"params": p, **module_vars}, x, mutable=list(module_vars), **kwargs)[0]

    out, vjp_fn = jax.vjp(apply, params, args[0])
    cotangent = jnp.ones_like(out)
    run = jax.jit(lambda f, ct: f(ct))
    times[path] = median_seconds(lambda: run(vjp_fn, cotangent), repeats,
                                 barrier=barrier)
  return times


def _has_path(tree, path) -> bool:
  try:
    _subtree(tree, path)
    return True
  except (KeyError, TypeError):
    return False


# Timed calls of the forward and forward+backward totals: a compute-bound
# step's prediction is mostly this number, and 5 calls in lockstep on this
# project's CPU cluster strayed 20% from the runs' 20-call medians.
COMPUTE_TOTAL_REPEATS = 20


def measure_compute(model: nn.Module, variables: dict, images: jax.Array, labels: jax.Array,
                    *, repeats: int = 5, barrier: Optional[Callable[[], Any]] = None,
                    batches: Optional[tuple[np.ndarray, np.ndarray]] = None,
                    total_repeats: int = COMPUTE_TOTAL_REPEATS) -> dict[str, Any]:
  """Forward time, per-leaf backward times in backward order, and the check against the whole.

  The layers are timed alone on `images`, `repeats` times each; the forward
  and the forward+backward totals, which the per-layer times are scaled to
  and which decide a compute-bound step's prediction, `total_repeats` times.
  With `batches` the totals are timed on the train step's own program
  (`training.batch_loss` on raw uint8 batches, cycled through): a profile
  timed with 5 repeats on one noise batch measured ResNet-20's
  forward+backward at 82.7 ms where the benchmark's runs of the same session
  measured 68-69 ms (experiments/README.md).

  Args:
    model: the Flax classifier.
    variables: its variables ("params", maybe "batch_stats").
    images: float inputs for the per-layer timings and the backward order.
    labels: their int32 labels.
    repeats: timed calls per layer.
    barrier: see `median_seconds`.
    batches: (uint8 images [n, batch, H, W, C], int32 labels [n, batch]) to
      time the totals on; None: `images`, `labels`.
    total_repeats: timed calls of each total.

  Returns:
    dict with ``order`` (leaf paths), ``sizes``, ``t_forward``, ``t_backward``
    (scaled to the measured total; unscaled if that timed <= 0),
    ``backward_measured``, ``backward_sum_alone``, ``backward_difference``
    (relative: sum alone / measured - 1) and ``totals_raw`` (every timed
    call's seconds, "forward" and "forward_backward").

  Raises:
    ValueError: `total_repeats` < 1, or `batches` holds no batch.
  """
  if total_repeats < 1:
    raise ValueError(f"total_repeats must be >= 1, got {total_repeats!r}")
  params = variables["params"]
  others = {k: v for k, v in variables.items() if k != "params"}

  def loss_fn(p, x, y):
    if others:
      logits = model.apply({"params": p, **others}, x, train=True, mutable=list(others))[0]
    else:
      logits = model.apply({"params": p}, x, train=True)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

  order = grouping.backward_order(loss_fn, params, images, labels)
  if batches is None:
    inputs, total_loss = [(images, labels)], loss_fn
  else:
    from dlgs_jax import training

    if len(batches[0]) < 1 or len(batches[0]) != len(batches[1]):
      raise ValueError(f"batches: need n >= 1 image and label batches, got "
                       f"{len(batches[0])} and {len(batches[1])}")
    inputs = [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(*batches)]
    batch_stats = others.get("batch_stats", {})

    def total_loss(p, x, y):
      return training.batch_loss(model, p, batch_stats, x, y)[0]

  forward = jax.jit(total_loss)
  forward_backward = jax.jit(jax.value_and_grad(total_loss))
  turn = itertools.count()

  def cycled(program):
    return lambda: program(params, *inputs[next(turn) % len(inputs)])

  totals_raw: dict[str, list] = {"forward": [], "forward_backward": []}
  t_forward = median_seconds(cycled(forward), total_repeats, barrier=barrier,
                             samples=totals_raw["forward"])
  t_both = median_seconds(cycled(forward_backward), total_repeats, barrier=barrier,
                          samples=totals_raw["forward_backward"])
  t_backward_total = max(t_both - t_forward, 0.0)
  per_module = layer_backward_times(model, variables, images, repeats=repeats, barrier=barrier)
  paths = grouping.leaf_paths(params)
  sizes = dict(zip(paths, (int(x.size) for x in jax.tree_util.tree_leaves(params))))
  raw = {path: 0.0 for path in order}
  for module_path, t in per_module.items():
    prefix = "/".join(module_path) + "/"
    members = [p for p in order if p.startswith(prefix)]
    if members:
      raw[members[0]] += t  # the module's leaves become ready together
  total_alone = sum(raw.values())
  # On a busy machine forward+backward can time below the forward alone; the
  # layers timed alone are then the better estimate.
  scale = t_backward_total / total_alone if total_alone > 0 and t_backward_total > 0 else 1.0
  return {
      "order": order,
      "sizes": [sizes[p] for p in order],
      "t_forward": t_forward,
      "t_backward": [raw[p] * scale for p in order],
      "backward_measured": t_backward_total,
      "backward_sum_alone": total_alone,
      "backward_difference": (total_alone / t_backward_total - 1.0) if t_backward_total else 0.0,
      "totals_raw": totals_raw,
  }


# ----------------------------------------------------------------- update ---

# Every method the timeline model predicts.
UPDATE_METHODS = MODELLED
# Methods that send every leaf as its own message (no planner merges them in
# the benchmark and by default in training): their update cost is only ever
# evaluated at leaf sizes, so it is fitted over leaf sizes only.
PER_LEAF_METHODS = ("lags", "dgc", "terngrad")


def fit_update(raw: dict[str, list], largest_leaf: int) -> dict[str, LinearCost]:
  """Fits each method's update cost over the message sizes it sends.

  The standalone update time grows faster than linearly with the message
  (ResNet-50 LAGS: 2.4e-8 s per value at 0.8M values, 7.8e-8 at 25M), so one
  line through the whole range overprices the small messages of per-leaf
  methods: the line fitted up to 25M values priced ResNet-50's LAGS update at
  1.97 s where the runs measured 0.32 s (+53% on the step). `PER_LEAF_METHODS`
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
  one-leaf program, which single-leaf timings put into alpha (ResNet-20: 0.43
  ms per leaf, against 2-16 ms measured for all 65 leaves together). Least
  squares with both coefficients kept >= 0.

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


def refit_profile(profile: Profile, details: dict) -> Profile:
  """`profile` with its update costs fitted again from the raw timings in `details`.

  For profiles measured before a change of the fitting rule (`fit_update`):
  the raw timings are stored beside every profile (``details.json``). Where
  they hold in-step rounds (`measure_update_in_step`), the refitted costs are
  scaled by the factors those give against them (`in_step_factors`).

  Raises:
    ValueError: `details` has no raw update timings.
  """
  raw = details.get("sparsify_raw")
  if not raw or "sizes" not in raw:
    raise ValueError("these details hold no raw update timings ('sparsify_raw'); "
                     "measure the profile again")
  sparsify = fit_update(raw, max(profile.sizes))
  in_step_raw = details.get("update_in_step_raw")
  if in_step_raw:
    factors = in_step_factors(in_step_raw, whole_model_update(sparsify, profile.sizes))
    sparsify = scale_update_costs(sparsify, factors, int(details.get("reuse_every", 10)))
  return dataclasses.replace(profile, sparsify=sparsify)


def training_optimizer(method: str, density: float, *, reuse_every: int = 10,
                       order: Sequence[str] = ("x",),
                       refresh_below: Optional[float] = 0.5) -> optax.GradientTransformation:
  """`method`'s local update (``axis_name=None``) chained with training's optimizer.

  The same chain `dlgs-train` and `dlgs_jax.benchmark` build (weight decay and
  momentum SGD after the compressor), for a flat dict whose keys are `order`
  (backward order), sent as one group -- one message -- by the methods that
  group leaves (dense, DLGS; LAGS keeps one message per leaf). `refresh_below`
  is DLGS's refresh rule (None: the paper's fixed schedule).
  """
  from dlgs_jax import train

  settings = train.parse_args(["--method", method, "--density", str(density),
                               "--reuse-every", str(reuse_every), "--refresh-below",
                               "none" if refresh_below is None else str(refresh_below)])
  order = list(order)
  groups = [order] if method in ("dense", "dlgs") else None
  return train.build_optimizer(settings, None, 0.01, groups, order)


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
  input) are 81% exact zeros (Top-k over the 25.6M values: 2.0 s on them
  against 4.7 s on gradients after 10 training steps, 25% zeros; see
  `train_locally` and experiments/selection_values.py). So pass
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
# Dense training steps before those gradients are taken (`train_locally`): the
# benchmark times steps 3 to 23 of a run.
PROFILE_TRAIN_STEPS = 10


def model_gradients(model: nn.Module, variables: dict, images: np.ndarray,
                    labels: np.ndarray) -> list[dict]:
  """The training loss's gradient with respect to the params on each of some real batches.

  What a profile times the local updates on (`measure_update`): their
  selection costs depend on the values. One compiled program for all batches.

  Args:
    model: the Flax classifier.
    variables: its variables ("params", maybe "batch_stats").
    images: uint8 [n, batch_size, H, W, C].
    labels: int32 [n, batch_size].

  Returns:
    n gradient trees shaped like ``variables["params"]`` (float32 arrays).
  """
  from dlgs_jax import training

  batch_stats = variables.get("batch_stats", {})

  @jax.jit
  def grad_fn(p, x, y):
    return training.batch_gradients(model, p, batch_stats, x, y)[0]

  return [grad_fn(variables["params"], jnp.asarray(x), jnp.asarray(y))
          for x, y in zip(images, labels)]


def local_training(model: nn.Module, params: Any, method: str, density: float, *,
                   reuse_every: int = 10, refresh_below: Optional[float] = 0.5
                   ) -> tuple[optax.GradientTransformation, Callable]:
  """One worker's training (``axis_name=None``) with `method`, training's optimizer and rate.

  Args:
    model: the Flax classifier.
    params: its params (their leaves name the optimizer's messages).
    method, density, reuse_every, refresh_below: as `dlgs-train`'s flags.

  Returns:
    (tx, step): `train.build_optimizer`'s chain, and the jitted
    ``step(params, batch_stats, opt_state, images uint8, labels) ->
    (params, batch_stats, opt_state)``.
  """
  from dlgs_jax import train, training

  settings = train.parse_args(["--method", method, "--density", str(density),
                               "--reuse-every", str(reuse_every), "--refresh-below",
                               "none" if refresh_below is None else str(refresh_below)])
  train.check_args(settings)
  tx = train.build_optimizer(settings, None, settings.lr, None, grouping.leaf_paths(params))

  @jax.jit
  def step(params, batch_stats, opt_state, x, y):
    grads, new = training.batch_gradients(model, params, batch_stats, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), new.get("batch_stats", batch_stats),
            opt_state)

  return tx, step


def train_locally(model: nn.Module, variables: dict, images: np.ndarray, labels: np.ndarray,
                  steps: int, *, method: str = "dense", density: float = 1.0) -> dict:
  """`variables` after `steps` steps of one worker's training, batch i ``images[i % n]``.

  Gradients at initialisation are not the ones training sends: ResNets
  zero-initialise the last BatchNorm scale of each residual branch, so every
  other parameter of the branch has an exactly zero gradient until the first
  step moves that scale (81% of ResNet-50's gradient values at 32x32 input).
  A selection's cost depends on its values (sorting ties is cheap), so the
  profile times the updates on gradients taken after a few real steps.

  Args:
    model: the Flax classifier.
    variables: its variables ("params", maybe "batch_stats").
    images: uint8 [n, batch_size, H, W, C].
    labels: int32 [n, batch_size].
    steps: training steps (0 returns the values of `variables`).
    method, density: the optimizer's compressor (default dense SGD).

  Returns:
    The trained variables: "params" and, where the model has them, "batch_stats".

  Raises:
    ValueError: `steps` < 0.
  """
  if steps < 0:
    raise ValueError(f"steps must be >= 0, got {steps!r}")
  params, batch_stats = variables["params"], variables.get("batch_stats", {})
  tx, step = local_training(model, params, method, density)
  opt_state = tx.init(params)
  for i in range(steps):
    j = i % images.shape[0]
    params, batch_stats, opt_state = step(params, batch_stats, opt_state,
                                          jnp.asarray(images[j]), jnp.asarray(labels[j]))
  trained = {"params": params}
  if "batch_stats" in variables:
    trained["batch_stats"] = batch_stats
  return jax.block_until_ready(trained)


# ---------------------------------------------------------- update in step ---

# Paired rounds of `measure_update_in_step`: each times the gradients program
# and the gradients-plus-update program once.
IN_STEP_ROUNDS = 12
# The in-step update replaces the standalone one only where its confidence
# interval is at most this share of the standalone time wide: on a model whose
# update is a small part of the step (ResNet-20: the dense optimizer of 0.27M
# values against ~70 ms of backward) the paired difference is noise, and
# scaling by it made the predictions worse (experiments/README.md).
IN_STEP_RESOLUTION = 0.5


def measure_update_in_step(model: nn.Module, variables: dict, batches: tuple[np.ndarray, np.ndarray],
                           density: float, order: Sequence[str], *,
                           methods: Sequence[str] = UPDATE_METHODS, reuse_every: int = 10,
                           warmup_steps: Optional[int] = None, rounds: int = IN_STEP_ROUNDS,
                           barrier: Optional[Callable[[], Any]] = None) -> dict[str, dict]:
  """Each method's whole-model update as one worker's train step pays it, in paired rounds.

  Timed alone, a memory-bound update costs more than inside the step that
  computes its gradients: on ResNet-50 (32x32, batch 8, one process) the dense
  optimizer over 25.6M values took 53 ms alone and 12 ms inside the step, and
  DLGS's reuse step 340 ms against 255 ms, while selections that sort cost
  about the same (DLGS's exact step 1.45 s against 1.35 s). In a round this
  times the gradients program (`training.batch_gradients`) and the program
  the benchmark's `compress` runs -- those gradients, `method`'s local update
  (``axis_name=None``, training's optimizer and rate) and the params update
  -- once each, back to back on the same batch, their order alternating
  between rounds; the difference of the pair is the update's cost in the
  step. The two programs share the machine's drift within a round, which
  separate medians do not (`in_step_factors` reads the differences).

  Every method starts from `variables` and runs `warmup_steps` steps of the
  with-update program on the batches in turn (residuals, momentum and
  thresholds as training leaves them); each round then times both programs at
  that one state, as `measure_update` does. Dense and DLGS send the model as
  one message, the others as they always do. DLGS runs the fixed schedule and
  is timed at the state before an exact step ("dlgs_exact") and before the
  reuse step after it ("dlgs_reuse").

  Args:
    model: the Flax classifier.
    variables: its variables ("params", maybe "batch_stats"), e.g. after
      `train_locally`.
    batches: (uint8 images [n, batch, H, W, C], int32 labels [n, batch]).
    density: the methods' density.
    order: the params' leaf paths in backward order.
    methods: the methods to time.
    reuse_every: DLGS reuse period.
    warmup_steps: steps before the timed state (default `reuse_every`; DLGS
      rounds it up to a multiple of `reuse_every`).
    rounds: paired rounds per method (>= 1).
    barrier: see `median_seconds`.

  Returns:
    Per timed key ("dlgs" split into "dlgs_exact" and "dlgs_reuse"):
    ``{"compute": [seconds per round], "with_update": [seconds per round]}``.

  Raises:
    ValueError: `rounds` < 1, `warmup_steps` < 0 or `batches` holds no batch.
  """
  from dlgs_jax import train, training

  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds!r}")
  warmup_steps = reuse_every if warmup_steps is None else warmup_steps
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
  if len(batches[0]) < 1 or len(batches[0]) != len(batches[1]):
    raise ValueError(f"batches: need n >= 1 image and label batches, got "
                     f"{len(batches[0])} and {len(batches[1])}")
  inputs = [(jnp.asarray(x), jnp.asarray(y)) for x, y in zip(*batches)]
  params = variables["params"]
  batch_stats = variables.get("batch_stats", {})
  order = list(order)

  @jax.jit
  def compute(p, x, y):
    return training.batch_gradients(model, p, batch_stats, x, y)[0]

  out: dict[str, dict] = {}
  for method in methods:
    settings = train.parse_args(["--method", method, "--density", str(density),
                                 "--reuse-every", str(reuse_every), "--refresh-below", "none"])
    tx = train.build_optimizer(settings, None, settings.lr,
                               [order] if method in ("dense", "dlgs") else None, order)

    with_update = _with_update_program(model, batch_stats, tx)
    steps = dlgs_warmup_steps(reuse_every, warmup_steps) if method == "dlgs" else warmup_steps
    p, s = params, tx.init(params)
    for i in range(steps):
      p, s = with_update(p, s, *inputs[i % len(inputs)])
    states = {method: (p, s)}
    if method == "dlgs":
      states = {"dlgs_exact": (p, s),
                "dlgs_reuse": with_update(p, s, *inputs[steps % len(inputs)])}
    for key, (p, s) in jax.block_until_ready(states).items():
      programs = {"compute": lambda x, y, p=p: compute(p, x, y),
                  "with_update": lambda x, y, p=p, s=s: with_update(p, s, x, y)}
      for program in programs.values():  # compilation
        jax.block_until_ready(program(*inputs[0]))
      times: dict[str, list] = {"compute": [], "with_update": []}
      for r in range(rounds):
        x, y = inputs[r % len(inputs)]
        for name in (("compute", "with_update") if r % 2 == 0 else ("with_update", "compute")):
          if barrier is not None:
            barrier()
          start = time.perf_counter()
          jax.block_until_ready(programs[name](x, y))
          times[name].append(time.perf_counter() - start)
      out[key] = times
  return out


def _with_update_program(model: nn.Module, batch_stats: Any, tx: optax.GradientTransformation):
  """The benchmark's `compress` program: gradients, `tx`'s update, the params update."""
  from dlgs_jax import training

  @jax.jit
  def with_update(p, s, x, y):
    updates, s = tx.update(training.batch_gradients(model, p, batch_stats, x, y)[0], s, p)
    return optax.apply_updates(p, updates), s

  return with_update


def median_interval(values: Sequence[float], confidence: float = 0.95
                    ) -> tuple[float, float, float]:
  """The median of `values` and a distribution-free confidence interval for it.

  The interval is between order statistics chosen from the binomial(n, 1/2)
  distribution (the sign test's): with n values sorted (from 0),
  ``[v_j, v_(n-1-j)]`` misses the median with probability ``2 P(X <= j)``,
  X ~ binomial(n, 1/2); j is the largest for which that is at most
  ``1 - confidence`` (12 values at 95%: j = 2), and 0 -- the whole range --
  where even that is more.

  Returns:
    (median, lower, upper).
  """
  v = np.sort(np.asarray(values, np.float64))
  n = len(v)
  if n == 0:
    raise ValueError("median_interval: no values")
  j, below = 0, 1.0 / 2 ** n  # below: P(X <= j)
  while j + 1 <= (n - 1) // 2:
    wider = below + math.comb(n, j + 1) / 2 ** n
    if 2 * wider > 1.0 - confidence:
      break
    j, below = j + 1, wider
  return float(np.median(v)), float(v[j]), float(v[n - 1 - j])


def in_step_factors(in_step: dict[str, dict], alone: dict[str, float],
                    resolution: float = IN_STEP_RESOLUTION) -> dict[str, dict]:
  """How much of each standalone update time the train step pays, where measured well enough.

  Args:
    in_step: `measure_update_in_step`'s rounds per key.
    alone: per key, the standalone model's price of the same whole-model
      update (seconds): the fitted cost of the message(s) the in-step program
      sends.
    resolution: the largest confidence interval, as a share of the
      standalone time, that counts as resolved.

  Returns:
    Per key of both: ``{"in_step", "lower", "upper"}`` (median of the paired
    differences and its 95% interval, seconds), ``"alone"``, ``"resolved"``
    and ``"factor"``: ``max(in_step, 0) / alone`` where resolved, else 1.
  """
  factors = {}
  for key, rounds in in_step.items():
    if key not in alone:
      continue
    diffs = np.asarray(rounds["with_update"]) - np.asarray(rounds["compute"])
    middle, lower, upper = median_interval(diffs)
    base = float(alone[key])
    resolved = base > 0 and (upper - lower) <= resolution * base
    factors[key] = {"in_step": middle, "lower": lower, "upper": upper, "alone": base,
                    "resolved": bool(resolved),
                    "factor": max(middle, 0.0) / base if resolved else 1.0}
  return factors


def whole_model_update(costs: dict[str, LinearCost], sizes: Sequence[int]) -> dict[str, float]:
  """Each update cost priced for the whole model as `measure_update_in_step` runs it.

  `PER_LEAF_METHODS` pay their cost once per leaf; the others send the model
  as one message.
  """
  total = int(sum(sizes))
  return {key: (sum(cost(int(n)) for n in sizes) if key in PER_LEAF_METHODS else cost(total))
          for key, cost in costs.items()}


def scale_update_costs(costs: dict[str, LinearCost], factors: dict[str, dict],
                       reuse_every: int) -> dict[str, LinearCost]:
  """`costs` with each factor of `in_step_factors` applied to its key's cost.

  DLGS's amortised cost is rebuilt from its scaled exact and reuse costs,
  ``(exact + (reuse_every - 1) * reuse) / reuse_every``, as `measure_update`
  mixes their timings (a least-squares line of the mix is the mix of the
  lines, up to the fit's clipping at zero).
  """
  scaled = dict(costs)
  for key, factor in factors.items():
    if key in scaled:
      f = factor["factor"]
      scaled[key] = LinearCost(scaled[key].alpha * f, scaled[key].beta * f)
  if "dlgs" in scaled and {"dlgs_exact", "dlgs_reuse"} & set(factors):
    if {"dlgs_exact", "dlgs_reuse"} <= set(scaled):
      exact, reuse = scaled["dlgs_exact"], scaled["dlgs_reuse"]
      s = reuse_every
      scaled["dlgs"] = LinearCost((exact.alpha + (s - 1) * reuse.alpha) / s,
                                  (exact.beta + (s - 1) * reuse.beta) / s)
  return scaled


def measure_refresh(model: nn.Module, variables: dict, images: np.ndarray, labels: np.ndarray,
                    density: float, *, reuse_every: int = 10, refresh_below: float = 0.5,
                    steps: Optional[int] = None) -> float:
  """Share of DLGS leaf thresholds computed exactly per step, over real training steps.

  Trains one worker (``axis_name=None``) from `variables` with DLGS and
  training's optimizer and learning rate (`local_training`), batch i
  being ``images[i % len(images)]``, and counts `CommStats.exact`. The refresh
  rule recomputes a reused threshold when it passes too few or too many
  values, which depends on how the gradients drift from step to step: only
  real steps tell. Step 0 (every threshold is new) is not counted.

  Args:
    model: the Flax classifier.
    variables: its initial variables ("params", maybe "batch_stats").
    images: uint8 [batches, batch_size, H, W, C] (e.g. `data.benchmark_batches`
      for one worker).
    labels: int32 [batches, batch_size].
    density: DLGS density.
    reuse_every: the fixed schedule's period.
    refresh_below: the refresh rule's fraction of k.
    steps: training steps to run (default ``2 * reuse_every + 1``: two whole
      periods are counted).

  Returns:
    The mean over steps 1.. of (leaves computed exactly) / (leaves).
  """
  from dlgs_jax.state import comm_stats

  steps = 2 * reuse_every + 1 if steps is None else steps
  if steps < 2:
    raise ValueError(f"steps must be >= 2 (step 0 is not counted), got {steps!r}")
  params, batch_stats = variables["params"], variables.get("batch_stats", {})
  tx, step = local_training(model, params, "dlgs", density, reuse_every=reuse_every,
                            refresh_below=refresh_below)
  opt_state = tx.init(params)
  exact = []
  for i in range(steps):
    j = i % images.shape[0]
    params, batch_stats, opt_state = step(params, batch_stats, opt_state,
                                          jnp.asarray(images[j]), jnp.asarray(labels[j]))
    exact.append(int(comm_stats(opt_state).exact))
  return float(np.mean(exact[1:])) / len(grouping.leaf_paths(params))


# ---------------------------------------------------------- communication ---

def measure_comm(mesh: Mesh, sizes: Sequence[int], density: float, *,
                 repeats: int = 5, chain: int = 8
                 ) -> tuple[dict[str, LinearCost], dict[str, list]]:
  """Fits collective costs on `mesh` against bytes sent per worker.

  The slope ``beta`` is fitted over `sizes`, one collective per program. The
  latency ``alpha`` is the *marginal* cost of one more collective inside a
  program, measured at the smallest size as ``(T(chain) - T(1)) / (chain - 1)``
  with `chain` independent collectives in one jitted program. A lone
  collective's time also carries the cost of launching a program and of the
  workers' arrival skew, which a training step pays once, not once per
  collective: fitted from lone collectives, alpha came out 7.3-7.8 ms on the
  emulated cluster where LAGS's 59 collectives per step cost ~5.9 ms each.

  Args:
    mesh: the mesh whose collectives are timed (one axis).
    sizes: leaf sizes (elements); the sparse messages hold
      ``num_to_keep(density, size)`` values.
    density: fraction of values the sparse collectives send.
    repeats: timed calls per measurement.
    chain: collectives per program for the latency; 1 keeps the latency of
      the least-squares fit over lone collectives.

  Returns:
    (costs per collective kind, the raw measurements: ``(bytes, seconds)``
    per size and kind, and under ``"latency"`` per kind the bytes, the lone
    and the chained program's time and `chain`).
  """
  if chain < 1:
    raise ValueError(f"chain must be >= 1, got {chain}")
  axis = mesh.axis_names[0]
  workers = mesh.devices.size
  spec = PartitionSpec(axis)
  raw = {"allreduce": [], "allgather": [], "gtopk": []}
  rng = np.random.default_rng(0)

  def wrap(fn):
    return jax.jit(jax.shard_map(
        lambda *a: parallel.unsqueeze(fn(*parallel.squeeze(a))), mesh=mesh,
        in_specs=spec, out_specs=spec, check_vma=False))

  def programs(size, k, copies):
    # Distinct inputs per copy, so XLA cannot merge the collectives into one.
    def repeated(collective):
      return wrap(lambda v, i: sum(collective(v + j, i) for j in range(copies)))

    return {
        "allreduce": repeated(lambda v, i: collectives.dense_mean(v, axis_name=axis)),
        "allgather": repeated(lambda v, i: collectives.sparse_allgather_mean(
            v[:k], i, size, axis_name=axis)),
        "gtopk": repeated(lambda v, i: collectives.gtopk_mean(
            v, v[:k], i, k, axis_name=axis)[0]),
    }

  def inputs(size, k):
    x = parallel.shard_batch(rng.standard_normal((workers, size)).astype(np.float32), mesh)
    idx = parallel.shard_batch(
        np.stack([rng.choice(size, k, replace=False) for _ in range(workers)]).astype(np.int32),
        mesh)
    return x, idx

  def wire_bytes(size, k):
    return {"allreduce": wire.allreduce_bytes(size, workers),
            "allgather": wire.allgather_bytes(k, workers),
            "gtopk": wire.gtopk_bytes(k, workers)[0]}

  for size in sizes:
    k = selection.num_to_keep(density, size)
    x, idx = inputs(size, k)
    sent = wire_bytes(size, k)
    for kind, program in programs(size, k, 1).items():
      raw[kind].append((sent[kind], median_seconds(lambda: program(x, idx), repeats)))
  costs = {kind: fit_linear([b for b, _ in points], [t for _, t in points])
           for kind, points in raw.items()}
  if chain > 1:
    size = min(sizes)
    k = selection.num_to_keep(density, size)
    x, idx = inputs(size, k)
    sent = wire_bytes(size, k)
    raw["latency"] = {}
    for kind, program in programs(size, k, chain).items():
      lone = raw[kind][list(sizes).index(size)][1]
      chained = median_seconds(lambda: program(x, idx), repeats)
      marginal = (chained - lone) / (chain - 1)
      raw["latency"][kind] = {"bytes": sent[kind], "lone": lone, "chained": chained,
                              "chain": chain}
      beta = costs[kind].beta
      costs[kind] = LinearCost(max(marginal - beta * sent[kind], 0.0), beta)
  return costs, raw


OVERLAP_PROGRAMS = ("compute", "collectives", "independent", "chained")


def _overlap_work(v: jax.Array, rounds: int) -> jax.Array:
  for _ in range(rounds):
    v = jnp.sin(v) * 1.0001 + jnp.cos(v) * 0.5
  return v


def overlap_programs(mesh: Mesh, *, leaves: int, message: int, rounds: int
                     ) -> dict[str, Callable[[jax.Array], jax.Array]]:
  """The four programs `measure_overlap` times, on input float32[workers, leaves, size].

  Per leaf, "work" is `rounds` elementwise passes over the whole leaf, and its
  message is the first `message` values of the result times the result's mean
  (so the message needs the whole pass: XLA cannot slice the work away).

  * ``compute``: every leaf's work; the message is stacked `workers` times on
    the worker instead of all-gathered (same shapes, no collective).
  * ``collectives``: every leaf's first `message` input values all-gathered,
    one collective per leaf, no work.
  * ``independent``: work and all-gather per leaf; leaf i's collective
    depends on leaf i's work only, so a runtime may run it while the next
    leaves' work proceeds, as a planned group's collective could run under
    the rest of the backward pass.
  * ``chained``: the same, but leaf i's input depends on leaf i-1's gathered
    result, so nothing can overlap (the control).

  Every program returns float32[leaves, message] per worker: the sum over
  workers of each leaf's message (``compute``: `workers` times its own).
  """
  if min(leaves, message, rounds) < 1:
    raise ValueError(f"leaves, message and rounds must be >= 1, got {leaves}, {message}, "
                     f"{rounds}")
  axis = mesh.axis_names[0]
  workers = mesh.devices.size

  def send(v, mode):
    if mode == "collectives":
      msg = v[:message]
    else:
      v = _overlap_work(v, rounds)
      msg = v[:message] * jnp.mean(v)
    gathered = (jnp.stack([msg] * workers) if mode == "compute"
                else lax.all_gather(msg, axis))
    return jnp.sum(gathered, axis=0)

  def body(xs, mode):
    outs = []
    for i in range(leaves):
      v = xs[i]
      if mode == "chained" and outs:
        v = v.at[:message].add(outs[-1] * 1e-3)
      outs.append(send(v, "independent" if mode == "chained" else mode))
    return jnp.stack(outs)

  spec = PartitionSpec(axis)
  return {mode: jax.jit(jax.shard_map(
      lambda x, mode=mode: parallel.unsqueeze(body(parallel.squeeze(x), mode)),
      mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
          for mode in OVERLAP_PROGRAMS}


def measure_overlap(mesh: Mesh, *, leaves: int = 32, size: int = 200_000, message: int = 2_000,
                    rounds: int = 1, repeats: int = 7,
                    barrier: Optional[Callable[[], Any]] = None) -> dict[str, Any]:
  """Whether the runtime hides collectives behind independent computation.

  Times the four `overlap_programs` and reports the share of the smaller of
  the two parts (work, collectives) that the ``independent`` program hid::

      hidden = (T_compute + T_collectives - T_independent) / min(T_compute, T_collectives)

  1 means fully hidden, 0 nothing (the collectives block the computation, as
  `Profile.overlap` = False models), negative the interleaving cost extra.
  ``chained`` is the control that cannot overlap. This is the question of the
  paper's wait-free backpropagation (DLGS, Sec. 3): a group's collective
  running while the remaining backward computes. It is asked here on one
  program of independent work, not on a model's backward pass.

  Args:
    mesh: the mesh whose collectives are timed (one axis).
    leaves: pieces of work, each followed by its own collective.
    size: elements of each piece.
    message: values each piece all-gathers.
    rounds: elementwise passes per piece (more: more work per collective).
    repeats: timed calls per program.
    barrier: see `median_seconds`.

  Returns:
    ``{"seconds": {program: median}, "samples": {program: [seconds]},
    "hidden": ..., "leaves", "size", "message", "rounds", "workers"}``.
  """
  if size < message:
    raise ValueError(f"size ({size}) must be >= message ({message})")
  programs = overlap_programs(mesh, leaves=leaves, message=message, rounds=rounds)
  workers = mesh.devices.size
  x = parallel.shard_batch(np.random.default_rng(0).standard_normal(
      (workers, leaves, size)).astype(np.float32), mesh)
  # Compiled once, ahead of time: the timings and the schedule use the same executables.
  compiled = {name: program.lower(x).compile() for name, program in programs.items()}
  seconds, samples = {}, {}
  for name, program in compiled.items():
    samples[name] = []
    seconds[name] = median_seconds(lambda: program(x), repeats, barrier=barrier,
                                   samples=samples[name])
  schedule = collective_schedule(compiled["independent"].as_text())
  return {"seconds": seconds, "samples": samples, "hidden": overlap_hidden(seconds),
          "schedule": schedule, "leaves": leaves, "size": size, "message": message,
          "rounds": rounds, "workers": workers}


def collective_schedule(hlo_text: str) -> list[list]:
  """Where the collectives sit in a compiled program's entry computation.

  Run-length encoded over its instructions in the compiled order, parameters,
  constants and tuples left out: ``[["other", 18], ["all-gather", 6],
  ["other", 7]]`` says every collective was scheduled after all the work
  before it could overlap. For reporting; the text format is XLA's.
  """
  start = hlo_text.find("ENTRY")
  if start < 0:
    raise ValueError("no ENTRY computation in the HLO text")
  runs: list[list] = []
  for line in hlo_text[start:].splitlines()[1:]:
    if line.strip() == "}":
      break
    found = re.search(r"=\s+\S+\s+([a-z][a-z0-9-]*)\(", line)
    if not found or found.group(1) in ("parameter", "constant", "tuple", "get-tuple-element"):
      continue
    op = found.group(1)
    kind = op if op.startswith(("all-", "reduce-scatter", "collective-")) else "other"
    if runs and runs[-1][0] == kind:
      runs[-1][1] += 1
    else:
      runs.append([kind, 1])
  return runs


def overlap_hidden(seconds: dict[str, float]) -> float:
  """The ``hidden`` share of `measure_overlap` from its programs' seconds."""
  parts = (seconds["compute"], seconds["collectives"])
  if min(parts) <= 0:
    raise ValueError(f"compute and collectives times must be positive, got {parts}")
  return (sum(parts) - seconds["independent"]) / min(parts)


def parse_bandwidth(text: str) -> float:
  """'1gbit', '10Gbit', '25gbps', '100mbit' -> bits per second."""
  units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
  lowered = str(text).strip().lower()
  for unit, factor in units.items():
    if lowered.endswith(unit):
      number = lowered[:-len(unit)]
      break
  else:
    number, factor = lowered, 1.0
  try:
    value = float(number) * factor
  except ValueError:
    raise ValueError(f"bandwidth must look like '1gbit' or '25gbit', got {text!r}") from None
  if not np.isfinite(value) or value <= 0:
    raise ValueError(f"bandwidth must be positive, got {text!r}")
  return value


def network_comm(workers: int, bandwidth_bits: float, latency: float = 25e-6) -> dict[str, LinearCost]:
  """α-β costs of each collective for `workers` on links of `bandwidth_bits`.

  Latency terms count the sequential steps of each algorithm: 2(P-1) for a ring
  all-reduce, P-1 for a ring all-gather, and for gTop-k its pairwise rounds
  plus the 2(P-1) steps of the exact k-value all-reduce. Bandwidth terms use
  the bytes per worker of `wire`.
  """
  if workers < 1:
    raise ValueError(f"workers must be >= 1, got {workers!r}")
  if not bandwidth_bits > 0 or not latency >= 0:
    raise ValueError(f"bad network: bandwidth {bandwidth_bits!r}, latency {latency!r}")
  beta = 8.0 / bandwidth_bits
  p2 = 1 << (workers.bit_length() - 1)
  rounds = (p2 - 1).bit_length() + (2 if workers > p2 else 0)
  return {
      "allreduce": LinearCost(2 * (workers - 1) * latency, beta),
      "allgather": LinearCost((workers - 1) * latency, beta),
      "gtopk": LinearCost((rounds + 2 * (workers - 1)) * latency, beta),
  }


def profile_model(name: str, *, density: float, batch_size: int = 32,
                  image_size: Optional[int] = None, mesh: Optional[Mesh] = None,
                  reuse_every: int = 10, repeats: int = 5, seed: int = 0,
                  methods: Sequence[str] = UPDATE_METHODS,
                  refresh_below: Optional[float] = 0.5,
                  batches: Optional[tuple[np.ndarray, np.ndarray]] = None,
                  barrier: Optional[Callable[[], Any]] = None,
                  in_step_rounds: int = IN_STEP_ROUNDS,
                  progress: Callable[[str], None] = lambda message: None) -> tuple[Profile, dict]:
  """Measures a full profile of model `name` on this machine.

  Args:
    name: a `models.MODELS` name.
    density: density used to size the sparse messages of the benchmarks.
    batch_size: examples per worker.
    image_size: input side length (default: the model's own).
    mesh: the mesh whose collectives are timed (default: all devices); with one
      device no communication cost is measured.
    reuse_every: DLGS reuse period for its amortised update cost.
    repeats: timing repeats per measurement.
    seed: initialisation seed.
    methods: the methods whose update cost is measured.
    refresh_below: DLGS's refresh rule; when "dlgs" is among `methods` and
      this is not None, the share of thresholds it recomputes per step is
      measured (`measure_refresh`) into ``profile.dlgs_exact_fraction``.
    batches: (uint8 images [n, batch_size, H, W, C], labels [n, batch_size])
      for the refresh measurement and for the gradients the updates are timed
      on: `PROFILE_TRAIN_STEPS` dense steps on the first batches
      (`train_locally`), then the next `UPDATE_BATCHES` batches' gradients at
      the trained params (`model_gradients`); the forward and backward totals
      are timed at those params on all of them in turn; default: one worker's
      `data.benchmark_batches` (real CIFAR-10 images at 32x32x3).
    barrier: see `median_seconds`; pass one when several processes profile
      together.
    in_step_rounds: paired rounds per method of `measure_update_in_step`;
      each update cost is scaled to what the train step pays for it where
      those rounds resolve it (`in_step_factors`); 0 keeps the standalone
      costs.
    progress: called with a message before each phase.

  Returns:
    (profile, details) where details holds the raw measurements, the
    backward-time check and the in-step factors ("update_in_step").
  """
  from dlgs_jax import data, models, training

  model, shape = models.create_model(name)
  if image_size is not None:
    shape = (image_size, image_size, shape[2])
  if batches is None:
    # Twice the reuse period: enough distinct batches for `measure_refresh`.
    batches = data.benchmark_batches(shape, model.num_classes, 2 * reuse_every, 1, batch_size)
    batches = (batches[0][:, 0], batches[1][:, 0])
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.standard_normal((batch_size,) + shape).astype(np.float32))
  labels = jnp.asarray(rng.integers(0, model.num_classes, batch_size).astype(np.int32))
  variables = training.init_variables(model, images[:1], seed)
  trained = train_locally(model, variables, batches[0], batches[1], PROFILE_TRAIN_STEPS)
  progress("timing forward, backward and each layer's backward")
  # At the trained params, on the real batches: what the benchmark's steps run.
  compute = measure_compute(model, trained, images, labels, repeats=repeats, barrier=barrier,
                            batches=batches)
  total = sum(compute["sizes"])
  progress(f"timing the local update of {', '.join(methods)}")
  after = (PROFILE_TRAIN_STEPS + np.arange(UPDATE_BATCHES)) % batches[0].shape[0]
  leaf_grads = []
  for grads in model_gradients(model, trained, batches[0][after], batches[1][after]):
    grad_of = dict(zip(grouping.leaf_paths(grads), jax.tree_util.tree_leaves(grads)))
    leaf_grads.append([grad_of[p] for p in compute["order"]])
  sparsify, sparsify_raw = measure_update(
      update_grid(compute["sizes"]), density, methods=methods, reuse_every=reuse_every,
      repeats=repeats, barrier=barrier, leaf_grads=leaf_grads)
  in_step_raw, in_step = {}, {}
  if in_step_rounds:
    progress(f"timing the updates inside the step ({in_step_rounds} paired rounds each)")
    in_step_raw = measure_update_in_step(model, trained, batches, density, compute["order"],
                                         methods=methods, reuse_every=reuse_every,
                                         rounds=in_step_rounds, barrier=barrier)
    in_step = in_step_factors(in_step_raw, whole_model_update(sparsify, compute["sizes"]))
    sparsify = scale_update_costs(sparsify, in_step, reuse_every)
  mesh = mesh or parallel.data_mesh()
  workers = int(mesh.devices.size)
  comm, comm_raw = {}, {}
  if workers > 1:
    progress(f"timing collectives on {workers} workers")
    comm_grid = sorted({int(s) for s in np.geomspace(4096, max(total, 8192), 5)})
    comm, comm_raw = measure_comm(mesh, comm_grid, density, repeats=repeats)
  fraction = None
  if "dlgs" in methods and refresh_below is not None:
    progress("measuring how often DLGS's refresh rule recomputes thresholds")
    fraction = measure_refresh(model, variables, *batches, density, reuse_every=reuse_every,
                               refresh_below=refresh_below)
  # Measured on the emulated cluster (`measure_overlap`, experiments/overlap_probe.py):
  # XLA's CPU backend hides none of a collective's time behind independent work
  # (a gloo collective blocks its thread); GPU backends run collectives
  # asynchronously.
  overlap = jax.default_backend() != "cpu"
  profile = Profile(
      model=name, paths=compute["order"], sizes=compute["sizes"], overlap=overlap,
      t_forward=compute["t_forward"], t_backward=compute["t_backward"], workers=workers,
      sparsify=sparsify, comm=comm, dlgs_exact_fraction=fraction,
      source=(f"measured on {jax.default_backend()} ({workers} devices of "
              f"{jax.devices()[0].device_kind}), batch {batch_size} per worker, "
              f"input {shape}"))
  details = {key: compute[key] for key in
             ("backward_measured", "backward_sum_alone", "backward_difference", "totals_raw")}
  details.update(sparsify_raw=sparsify_raw, comm_raw=comm_raw, reuse_every=reuse_every,
                 update_in_step_raw=in_step_raw, update_in_step=in_step)
  return profile, details
