"""The update as the train step pays for it, and DLGS's measured refresh rate.

A program of its own prices memory-bound updates above what the train step pays
for them (experiments/performance_notes.md), so
each method's whole-model update is timed inside the step too, in paired rounds
with the gradients program (`measure_update_in_step`), and its fitted cost is
scaled to that where the rounds resolve it (`in_step_factors`,
`scale_update_costs`). How often DLGS's refresh rule recomputes a reused
threshold depends on how gradients drift, so it is measured by training one
worker for a few steps on real batches (`measure_refresh`).
"""

from __future__ import annotations
import time
from typing import Any, Callable, Optional, Sequence
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from dlgs_jax.compress import grouping
from dlgs_jax.compress.methods import MethodConfig
from dlgs_jax.compress.optimizer import OptimizerConfig, build_optimizer
from dlgs_jax.planning.timeline import LinearCost
from dlgs_jax.profiling.timing import median_interval
from dlgs_jax.profiling.update import PER_LEAF_METHODS, UPDATE_METHODS, dlgs_warmup_steps, one_message

# Dense training steps before those gradients are taken (`train_locally`): the
# benchmark times steps 3 to 23 of a run.
PROFILE_TRAIN_STEPS = 10


def local_training(model: nn.Module, params: Any, method: str, density: float, *,
                   reuse_every: int = 10, refresh_below: Optional[float] = 0.5
                   ) -> tuple[optax.GradientTransformation, Callable]:
  """One worker's training (``axis_name=None``) with `method`, training's optimizer and rate.

  Args:
    model: the Flax classifier.
    params: its params (their leaves name the optimizer's messages).
    method, density, reuse_every, refresh_below: as `dlgs-train`'s flags.

  Returns:
    (tx, step): `build_optimizer`'s chain, and the jitted
    ``step(params, batch_stats, opt_state, images uint8, labels) ->
    (params, batch_stats, opt_state)``.
  """
  from dlgs_jax.workload import losses

  optimizer = OptimizerConfig()
  config = MethodConfig(method, density=density, reuse_every=reuse_every,
                        refresh_below=refresh_below)
  tx = build_optimizer(config, optimizer, axis_name=None, schedule=optimizer.lr,
                       order=grouping.leaf_paths(params))

  @jax.jit
  def step(params, batch_stats, opt_state, x, y):
    grads, new = losses.batch_gradients(model, params, batch_stats, x, y)
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
  step moves that scale (most of ResNet-50's gradient values at 32x32 input).
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


# Paired rounds of `measure_update_in_step`: each times the gradients program
# and the gradients-plus-update program once.
IN_STEP_ROUNDS = 12
# The in-step update replaces the standalone one only where its confidence
# interval is at most this share of the standalone time wide: on a model whose
# update is a small part of the step (ResNet-20's dense optimizer against its
# backward pass) the paired difference is noise, and
# scaling by it made the predictions worse (experiments/README.md).
IN_STEP_RESOLUTION = 0.5


def measure_update_in_step(model: nn.Module, variables: dict, batches: tuple[np.ndarray, np.ndarray],
                           density: float, order: Sequence[str], *,
                           methods: Sequence[str] = UPDATE_METHODS, reuse_every: int = 10,
                           warmup_steps: Optional[int] = None, rounds: int = IN_STEP_ROUNDS,
                           barrier: Optional[Callable[[], Any]] = None) -> dict[str, dict]:
  """Each method's whole-model update as one worker's train step pays it, in paired rounds.

  Timed alone, a memory-bound update costs more than inside the step that
  computes its gradients, while selections that sort cost about the same (the
  dense optimizer, DLGS's reuse and exact steps on ResNet-50:
  experiments/performance_notes.md). In a round this
  times the gradients program (`losses.batch_gradients`) and the program
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
  from dlgs_jax.workload import losses

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
    return losses.batch_gradients(model, p, batch_stats, x, y)[0]

  out: dict[str, dict] = {}
  for method in methods:
    config = MethodConfig(method, density=density, reuse_every=reuse_every, refresh_below=None)
    tx = build_optimizer(config, OptimizerConfig(), axis_name=None, schedule=OptimizerConfig().lr,
                         groups=one_message(method, order), order=order)

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
  from dlgs_jax.workload import losses

  @jax.jit
  def with_update(p, s, x, y):
    updates, s = tx.update(losses.batch_gradients(model, p, batch_stats, x, y)[0], s, p)
    return optax.apply_updates(p, updates), s

  return with_update


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
  from dlgs_jax.compress.state import comm_stats

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
