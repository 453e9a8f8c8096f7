"""An update timed as a run meets it: one reuse period on fresh gradients, from a warm state.

A threshold rule's cost depends on where in its schedule a step falls (the exact
step computes every threshold, the others reuse them), and on the residual it
starts from. The device check, the GPU profile and the selection benchmark all
time a transform's update over one whole period of its schedule, each step on a
gradient drawn afresh, from a state warmed over earlier periods.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dlgs_jax.compress import grouping, rules, transforms
from dlgs_jax.compress.state import comm_stats
from dlgs_jax.profiling import programs
from dlgs_jax.profiling.update import warm_state


def step_gradients(params, steps: int, seed: int = 0) -> list:
  """`steps` gradient trees shaped like `params`, each drawn afresh (standard normal).

  A gradient repeated on every step adds itself to each value a threshold
  leaves behind, step after step: the residual's largest values then grow
  without bound, adapted thresholds drift on most steps and the paper's
  schedule passes many times its buffer -- unlike training, whose gradients
  change from step to step.

  Args:
    params: a tree of arrays or `jax.ShapeDtypeStruct`s.
    steps: how many trees.
    seed: NumPy seed of the draws.

  Returns:
    A list of `steps` float32 trees.
  """
  rng = np.random.default_rng(seed)
  return [jax.tree_util.tree_map(
      lambda s: jnp.asarray(rng.standard_normal(s.shape).astype(np.float32)), params)
      for _ in range(steps)]


def schedule_period(tx, gradients: list, warm_periods: int = 2,
                    update: Optional[Callable] = None) -> tuple[Callable, float]:
  """One period of a transform's schedule, from a warmed-up state, and its exact counts.

  The state first takes ``warm_periods`` passes over `gradients` (the last one
  counts the exact leaves), so its residual is that of a run under way and its
  step count a multiple of ``len(gradients)`` (the schedule's exact step comes
  first in a period). Each call then runs the next period from where the last
  one left the state, which it donates as a training step does: XLA writes
  the new state over the old one rather than into fresh memory.

  Args:
    tx: a transform of this library (its state holds `CommStats`).
    gradients: one gradient tree per step of the period.
    warm_periods: passes over `gradients` before the first timed period (>= 1).
    update: ``tx.update`` compiled already, donating its state (`compiled_update`);
      None: ``jax.jit(tx.update, donate_argnums=1)``.

  Returns:
    ``(run, exact_leaves)``: ``run()`` applies the update once per gradient,
    carrying the state, and returns the last update; the mean number of leaves
    whose threshold was computed exactly per step of the last warm period.
  """
  if warm_periods < 1:
    raise ValueError(f"warm_periods must be >= 1, got {warm_periods}")
  update = jax.jit(tx.update, donate_argnums=1) if update is None else update
  state = warm_state(update, tx.init(gradients[0]), gradients, None,
                     (warm_periods - 1) * len(gradients))
  exact = []
  for grads in gradients:
    _, state = update(grads, state)
    exact.append(int(comm_stats(state).exact))
  carried = [state]

  def run():
    s, u = carried[0], None
    for grads in gradients:
      u, s = update(grads, s)
    carried[0] = s
    return u

  return run, float(np.mean(exact))


def compiled_update(tx, grads, donate: bool = True) -> tuple[Callable, dict[str, int], str]:
  """``tx.update`` compiled ahead of time for `grads`, the counts of that program, its HLO.

  Args:
    tx: the transform.
    grads: a gradient tree.
    donate: the update donates its state, as a training step does (each state
      is then used once).

  Returns:
    ``(update, counts, hlo)``: ``update(grads, state)`` runs the executable
    (a third argument, the parameters, is taken and ignored, as `warm_state`
    passes it); `counts` are `programs.count_hlo`'s of the optimized HLO.
  """
  state = tx.init(grads)
  executable = jax.jit(tx.update, donate_argnums=1 if donate else ()).lower(
      grads, state).compile()
  hlo = executable.as_text()

  def update(g, s, params: Any = None):
    del params
    return executable(g, s)

  return update, programs.count_hlo(hlo), hlo


def checked_updates(density: float, reuse_every: int, params) -> list[tuple[str, str, Any]]:
  """(method, grouping, transform) of every update the device check times, most important first.

  Dense, Top-k, gTop-k, then LAGS and DLGS: the paper's (fixed reuse, a
  threshold per layer), the adapted rule with a threshold per layer
  (``dlgs-layer``) and the default (the adapted rule, one threshold per
  message: ``dlgs-message``), first with every leaf in one group, then
  grouped by default. DLGS's rows name the budget, never the bare default.

  Args:
    density: the sparse methods' density.
    reuse_every: DLGS's period.
    params: the parameter tree (its leaf paths form the one group).
  """
  one = [grouping.leaf_paths(params)]
  paper = dict(thresholds=rules.FixedReuse(reuse_every), budget="layer")
  layer = dict(thresholds=rules.AdaptedReuse(reuse_every), budget="layer")
  message = dict(thresholds=rules.AdaptedReuse(reuse_every), budget="message")
  return [
      ("dense", "-", transforms.dense()),
      ("topk", "-", transforms.topk(density)),
      ("gtopk", "-", transforms.gtopk(density)),
      ("lags", "one group", transforms.lags(density, groups=one)),
      ("dlgs-paper", "one group", transforms.dlgs(density, groups=one, **paper)),
      ("dlgs-layer", "one group", transforms.dlgs(density, groups=one, **layer)),
      ("dlgs-message", "one group", transforms.dlgs(density, groups=one, **message)),
      ("lags", "default", transforms.lags(density)),
      ("dlgs-paper", "default", transforms.dlgs(density, **paper)),
      ("dlgs-layer", "default", transforms.dlgs(density, **layer)),
      ("dlgs-message", "default", transforms.dlgs(density, **message)),
  ]
