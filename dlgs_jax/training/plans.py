"""The layer grouping a run uses: a plan file, or one made here from a profile.

A plan is made on process 0 (from a given profile, or one measured on the run's
own mesh, optionally re-priced for a modelled network) and broadcast, so every
process sends the same messages. With the two-level exchange (a node mesh) the
plan groups each device's slices: the network it prices is the one between
nodes (measured over the node axis with every device exchanging at once, or
modelled with the node's link shared by its devices) plus the fast link inside
a node (measured over the local axis).
"""

from __future__ import annotations

import math
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
  from dlgs_jax.workload import parallel

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
    plan.check_compatible(paths=paths, workers=workers,
                          fast_size=parallel.devices_per_node(mesh))
  except ValueError as e:
    raise PlanError(str(e)) from None
  return plan


def resolve_collective(config: RunConfig, mesh, workers: int, num_classes: int, log
                       ) -> RunConfig:
  """`config` with ``--collective auto`` resolved: the method's fastest exchange on its network.

  The exchanges are priced on the modelled network (``--bandwidth``,
  ``--latency``), so every process, and a resumed run, chooses alike. With
  two levels, each device sends its slice between nodes and shares its
  node's link.
  """
  import dataclasses

  from dlgs_jax.compress import methods
  from dlgs_jax.planning import choice
  from dlgs_jax.workload import models, parallel

  method = config.method
  if method.collective != methods.AUTO:
    return config
  fast_size = parallel.devices_per_node(mesh)
  between = workers // fast_size
  comm = network.network_comm(between, network.parse_bandwidth(config.plan.bandwidth) / fast_size,
                              config.plan.latency)
  shapes = models.leaf_shapes(config.model.name, num_classes=num_classes,
                             image_size=config.data.image_size)
  size = -(-sum(math.prod(shape) for shape in shapes.values()) // fast_size)
  priced = choice.for_method(method.name, size, method.density, between, comm)
  log(f"--collective auto: one message of {size:,} values at density {method.density:g} over "
      f"{between} {'nodes' if fast_size > 1 else 'workers'} at {config.plan.bandwidth}: "
      + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in priced["seconds"].items())
      + f"; {method.name} sends by {priced['collective']}")
  if priced["fastest"] != priced["collective"]:
    log(f"note: {priced['fastest']} would be faster than any exchange {method.name} takes")
  return dataclasses.replace(
      config, method=dataclasses.replace(method, collective=priced["collective"]))


def _fast_link(config: RunConfig, mesh, total: int, log):
  """The fast link's α-β cost inside a node, measured over the local axis (every process)."""
  from dlgs_jax import profiling
  from dlgs_jax.workload import parallel

  log(f"timing the all-reduce inside a node ({parallel.devices_per_node(mesh)} devices) for "
      "the planner ...")
  costs, _ = profiling.measure_comm(mesh, profiling.comm_grid(total), config.method.density,
                                    axis="local", kinds=("allreduce",))
  return costs["allreduce"]


def _profile(config: RunConfig, mesh, workers: int, log) -> Profile:
  from dlgs_jax import profiling
  from dlgs_jax.workload import parallel

  settings, method = config.plan, config.method
  fast_size = parallel.devices_per_node(mesh)
  between = workers // fast_size
  if settings.profile:
    profile = _load(Profile.load, "profile", settings.profile)
    if profile.model != config.model.name:
      raise PlanError(f"--profile {settings.profile} is for model {profile.model!r}, "
                      f"not {config.model.name!r}")
    if fast_size > 1 and not settings.bandwidth:
      log("measuring the collectives between nodes for the planner ...")
      comm, _ = profiling.measure_comm(mesh, profiling.comm_grid(sum(profile.sizes)),
                                       method.density, axis="node")
      profile = profile.with_comm(comm, between, f"measured between {between} nodes")
  else:
    log(f"profiling {config.model.name} for the planner (every process measures; process 0's "
        "profile is used) ...")
    profile, _ = profiling.profile_model(
        config.model.name, density=method.density, batch_size=config.data.batch_size,
        image_size=config.data.image_size, mesh=mesh, reuse_every=method.reuse_every,
        seed=config.seed, refresh_below=method.refresh_below if method.name == "dlgs" else None,
        methods=(method.name,), comm_axis="node" if fast_size > 1 else None,
        time_comm=not settings.bandwidth, progress=lambda phase: log(f"  {phase} ..."))
  if settings.bandwidth:
    # A node's devices share its link: each gets 1/fast_size of it.
    profile = profile.with_comm(
        network.network_comm(between, network.parse_bandwidth(settings.bandwidth) / fast_size,
                             settings.latency),
        between, f"network modelled: {settings.bandwidth} links"
        + (f" shared by {fast_size} devices" if fast_size > 1 else ""))
  return profile


def _plan_here(config: RunConfig, mesh, workers: int, log) -> Optional[planner.Plan]:
  import jax

  from dlgs_jax.workload import models, parallel

  profile = _profile(config, mesh, workers, log)
  fast_size = parallel.devices_per_node(mesh)
  fast_link = _fast_link(config, mesh, sum(profile.sizes), log) if fast_size > 1 else None
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
                           wire_dtype=method.wire_dtype, fast_size=fast_size,
                           fast_link=fast_link)
