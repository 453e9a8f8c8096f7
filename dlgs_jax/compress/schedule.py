"""Density that changes over training: `density_schedule`.

A sparse transform's density sizes its static buffers, so it cannot be an array
(``optax.inject_hyperparams`` makes it one). `density_schedule` builds one
transform per phase and switches between them on the step count; their states
have one structure (residuals, thresholds and statistics do not depend on the
density), so residuals carry over from phase to phase and nothing is lost at a
boundary. Typical use, the exponential warm-up of DGC (Lin et al. 2018, Sec. 3.3)
applied to DLGS::

    tx = dlgs_jax.density_schedule(
        lambda d: dlgs_jax.dlgs(d, axis_name="data"),
        {0: 0.25, 200: 0.0625, 400: 0.015625, 600: 0.01})
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from dlgs_jax.compress import common


class DensityScheduleState(NamedTuple):
  """State of `density_schedule`."""
  count: jax.Array  # int32[]: updates so far (the same on every worker: replicated)
  inner: Any        # the phases' common state (per worker, like any of this library's)


def density_schedule(factory: Callable[[float], optax.GradientTransformation],
                     boundaries: Mapping[int, float]) -> optax.GradientTransformation:
  """A transform whose density follows a piecewise-constant schedule.

  Args:
    factory: density -> transform (e.g. ``lambda d: dlgs(d, axis_name="data")``);
      called once per phase, here.
    boundaries: first step of each phase -> its density; must contain step 0.

  Returns:
    An `optax.GradientTransformation` with state `DensityScheduleState`.

  Raises:
    ValueError: for boundaries without step 0 or with a bad step, or phases
      whose states differ in structure.
  """
  if not isinstance(boundaries, Mapping) or 0 not in boundaries:
    raise ValueError(f"boundaries must map first steps to densities and contain step 0, "
                     f"got {boundaries!r}")
  for step in boundaries:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
      raise ValueError(f"boundaries' steps must be integers >= 0, got {step!r}")
  common.check_factory("density_schedule's factory", factory,
                       "lambda d: dlgs_jax.dlgs(d, axis_name='data')")
  starts = sorted(boundaries)
  phases = [common.check_built("density_schedule's factory", factory(boundaries[step]))
            for step in starts]

  def init_fn(params):
    states = [tx.init(params) for tx in phases]
    first = jax.tree_util.tree_structure(states[0])
    for step, state in zip(starts, states):
      if jax.tree_util.tree_structure(state) != first:
        raise ValueError(f"the transform for step {step} (density {boundaries[step]!r}) has "
                         f"a state of another structure than step 0's: the phases must be "
                         f"one method with one grouping")
    return DensityScheduleState(jnp.zeros((), jnp.int32), states[0])

  def update_fn(updates, state, params=None):
    phase = jnp.sum(state.count >= jnp.asarray(np.asarray(starts[1:], np.int32))).astype(
        jnp.int32) if len(starts) > 1 else jnp.zeros((), jnp.int32)
    branches = [lambda u, s, p, tx=tx: tx.update(u, s, p) for tx in phases]
    if len(branches) == 1:
      new_updates, inner = branches[0](updates, state.inner, params)
    else:
      new_updates, inner = lax.switch(phase, branches, updates, state.inner, params)
    return new_updates, DensityScheduleState(state.count + 1, inner)

  return optax.GradientTransformation(init_fn, update_fn)
