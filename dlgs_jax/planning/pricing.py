"""How the timeline model prices a method as a run executes it, and where its plan is kept.

The cluster benchmarks predict each method's step from a measured profile: a
variant (``dlgs-paper``, ``dlgs-head``, ``*-whole1d``) is priced as its base
method with its own options, and a method whose update the profile did not time
is refused rather than priced at nothing.
"""

from __future__ import annotations

from pathlib import Path

from dlgs_jax.compress.methods import METHODS, VARIANTS, base_method, density_free, method_config
from dlgs_jax.planning import planner
from dlgs_jax.planning.timeline import MODELLED, MethodCosts

# Every method and variant: the timeline model predicts them all.
PREDICTABLE = tuple(METHODS) + tuple(VARIANTS)


# Small all-reduces every train step pays besides the gradient messages.
FIXED_COLLECTIVES = 2


def plan_file(directory, model: str, method: str, density: float) -> Path:
  """Where the cluster benchmark keeps `method`'s plan, and the comparisons and accuracy runs read it."""
  return Path(directory) / f"plan_{model}_{method}_{density:g}.json"


def require_update_costs(methods, profile) -> None:
  """Raises ValueError unless `profile` timed the update of each predictable method of `methods`.

  A variant needs its base method's update. The timeline model prices a method
  whose update a profile did not time at nothing, and a prediction without its
  update is no prediction of that method.
  """
  for base in profiled_methods(methods):
    if base not in profile.sparsify:
      raise ValueError(
          f"the {profile.model} profile has no update cost for {base!r} (it timed "
          f"{', '.join(sorted(profile.sparsify)) or 'none'}); measure it again with {base} "
          f"among the profiled methods")


def method_costs(method: str, density: float, profile, shapes) -> MethodCosts:
  """The timeline model's costs of `method` (a method or a variant) as the benchmark runs it.

  Args:
    method: a method or a variant of `dlgs_jax.compress.methods`.
    density: the run's density.
    profile: the profile measured for this model and density.
    shapes: leaf path -> parameter shape (DGC sends leaves of < 2 dims whole).

  Returns:
    The `MethodCosts` the timeline model simulates the method's step with.

  Raises:
    ValueError: the profile did not time the method's update.
  """
  require_update_costs([method], profile)
  # The variant's own options say whether the refresh rule is on (dlgs-paper: off)
  # and which leaves go whole (dlgs-head, *-whole1d; DGC: leaves of < 2 dims).
  config = method_config(method)
  base = config.name
  return MethodCosts(base, 1.0 if density_free(base) else density,
                     fixed_collectives=FIXED_COLLECTIVES,
                     exact_fraction=planner.dlgs_exact_fraction(profile, base, config.refresh_below),
                     whole_layers=config.whole_layers(profile.paths, shapes),
                     collective=(config.collective if "collective" in config.spec.options
                                 else None))


def profiled_methods(methods) -> list[str]:
  """The modelled methods whose update a profile for `methods` (or variants) must time."""
  bases = {base_method(method) for method in methods if method in PREDICTABLE}
  return [method for method in MODELLED if method in bases]
