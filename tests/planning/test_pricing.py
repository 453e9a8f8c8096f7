"""Pricing a method for the timeline model as a run executes it."""

from pathlib import Path

import pytest

from dlgs_jax.compress.methods import METHODS, VARIANTS
from dlgs_jax.planning import pricing
from dlgs_jax.planning.timeline import MODELLED, LinearCost, Profile


def test_a_plan_is_kept_under_its_model_method_and_density():
  assert pricing.plan_file("d", "vgg16", "dlgs", 0.010) == Path("d/plan_vgg16_dlgs_0.01.json")


def test_every_method_is_priced_as_the_benchmark_runs_it():
  profile = Profile(model="m", paths=["head/kernel", "bn/scale", "conv/kernel"],
                    sizes=[640, 16, 2304], t_forward=0.0, t_backward=[0.0] * 3, workers=4,
                    sparsify={m: LinearCost(1.0, 0.0) for m in MODELLED}, comm={},
                    dlgs_exact_fraction=0.6)
  shapes = {"head/kernel": (64, 10), "bn/scale": (16,), "conv/kernel": (3, 3, 16, 16)}
  dlgs = pricing.method_costs("dlgs", 0.1, profile, shapes)
  paper = pricing.method_costs("dlgs-paper", 0.1, profile, shapes)
  assert dlgs.exact_fraction == 0.6 and paper.exact_fraction is None  # the fixed schedule
  assert paper.method == "dlgs" and paper.fixed_collectives == 2
  assert pricing.method_costs("dgc", 0.01, profile, shapes).whole_layers == {1}
  assert dlgs.whole_layers == frozenset()
  # The profile's first layer in backward order is the head: dlgs-head sends it whole.
  assert pricing.method_costs("dlgs-head", 0.1, profile, shapes).whole_layers == {0}
  assert pricing.method_costs("lags-head", 0.1, profile, shapes).whole_layers == {0}
  assert pricing.method_costs("dlgs-whole1d", 0.1, profile, shapes).whole_layers == {1}
  assert pricing.method_costs("terngrad", 0.01, profile, shapes).density == 1.0
  assert set(pricing.PREDICTABLE) == set(METHODS) | set(VARIANTS)


def test_a_profile_times_the_updates_it_prices_and_nothing_else():
  # Variants are timed as their base method, once, in the model's order.
  assert pricing.profiled_methods(["dlgs-paper", "dense", "lags-head", "dgc", "dlgs"]) == [
      "dense", "lags", "dlgs", "dgc"]
  assert pricing.profiled_methods(["terngrad"]) == ["terngrad"]
  profile = Profile(model="m", paths=["conv/kernel"], sizes=[2304], t_forward=0.0,
                    t_backward=[0.0], workers=4, comm={},
                    sparsify={m: LinearCost(1e-3, 0.0) for m in ("dense", "dlgs")})
  pricing.require_update_costs(["dense", "dlgs", "dlgs-paper", "dlgs-head"], profile)
  # Priced without its update, Top-k would be predicted 1 ms too fast here: refused.
  with pytest.raises(ValueError, match="no update cost for 'topk' \\(it timed dense, dlgs\\)"):
    pricing.method_costs("topk", 0.01, profile, {"conv/kernel": (3, 3, 16, 16)})
  with pytest.raises(ValueError, match="no update cost for 'lags'"):
    pricing.require_update_costs(["dense", "lags-head"], profile)
