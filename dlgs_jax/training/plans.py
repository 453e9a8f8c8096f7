"""The layer grouping a run uses: a plan file, or one made here from a profile.

A plan is made on process 0 (from a given profile, or one measured on the run's
own mesh, optionally re-priced for a modelled network) and broadcast, so every
process sends the same messages.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from dlgs_jax.planning import network, planner
from dlgs_jax.planning.timeline import Profile
from dlgs_jax.training.config import RunConfig


class PlanError(ValueError):
  """A plan or profile that does not fit the run."""


def _load(load, flag: str, path: str):
  """`load(path)`, or a `PlanError` naming the flag and the file when it is not one."""
  try:
    return load(path)
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise PlanError(f"--{flag} {path!r} is not a {flag} file: {e}") from None


def backward_order_of(model, params, batch_stats, sample_shape) -> list[str]:
  """Leaf paths in the order their gradients become ready (traced from the model)."""
  import jax.numpy as jnp

  from dlgs_jax.compress import grouping
  from dlgs_jax.workload import losses

  def loss_fn(p, x):
    return jnp.sum(losses.apply_for_training(model, p, batch_stats, x)[0])

  return grouping.backward_order(loss_fn, params, jnp.zeros(sample_shape, jnp.float32))


def make_or_load_plan(config: RunConfig, mesh, paths: Sequence[str], workers: int,
                      log: Callable[[str], None]) -> Optional[planner.Plan]:
  """The plan every process uses (made on process 0 and broadcast), or None.

  Raises:
    PlanError: for a profile or plan made for another model, method or world.
  """
  settings = config.plan
  if settings.plan:
    plan = _load(planner.Plan.load, "plan", settings.plan)
  elif settings.planner == "none":
    return None
  else:
    plan = planner.broadcast_plan(_plan_here(config, mesh, workers, log))
  if plan.method != config.method.name:
    raise PlanError(f"the plan was made for method {plan.method!r}, "
                    f"this run uses {config.method.name!r}")
  try:
    plan.check_compatible(paths=paths, workers=workers)
  except ValueError as e:
    raise PlanError(str(e)) from None
  return plan


def _profile(config: RunConfig, mesh, workers: int, log) -> Profile:
  from dlgs_jax import profiling

  settings, method = config.plan, config.method
  if settings.profile:
    profile = _load(Profile.load, "profile", settings.profile)
    if profile.model != config.model.name:
      raise PlanError(f"--profile {settings.profile} is for model {profile.model!r}, "
                      f"not {config.model.name!r}")
  else:
    log(f"profiling {config.model.name} for the planner (every process measures; process 0's "
        "profile is used) ...")
    profile, _ = profiling.profile_model(
        config.model.name, density=method.density, batch_size=config.data.batch_size,
        image_size=config.data.image_size, mesh=mesh, reuse_every=method.reuse_every,
        seed=config.seed, refresh_below=method.refresh_below if method.name == "dlgs" else None,
        methods=(method.name,))
  if settings.bandwidth:
    profile = profile.with_comm(
        network.network_comm(workers, network.parse_bandwidth(settings.bandwidth),
                             settings.latency),
        workers, f"network modelled: {settings.bandwidth} links")
  return profile


def _plan_here(config: RunConfig, mesh, workers: int, log) -> Optional[planner.Plan]:
  import jax

  from dlgs_jax.workload import models

  profile = _profile(config, mesh, workers, log)
  if jax.process_index() != 0:
    return None
  method = config.method
  # With the refresh rule, DLGS recomputes thresholds as often as the profile
  # measured (None: the fixed schedule's cost).
  fraction = planner.dlgs_exact_fraction(profile, method.name, method.refresh_below)
  if fraction is not None:
    log(f"DLGS refresh rule: {fraction:.0%} of thresholds computed exactly per step "
        "(measured); the planner prices DLGS at that rate")
  shapes = models.leaf_shapes(config.model.name, image_size=config.data.image_size)
  return planner.make_plan(profile, method.name, method.density, config.plan.planner,
                           exact_fraction=fraction,
                           whole_layers=method.whole_layers(profile.paths, shapes),
                           wire_dtype=method.wire_dtype)
