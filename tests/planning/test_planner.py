import json
import time

import numpy as np
import pytest

from dlgs_jax.planning import planner
from dlgs_jax.planning.timeline import LinearCost, MethodCosts, Profile, simulate


def random_profile(rng, layers, workers=8, overlap=True):
  sizes = rng.integers(10, 2_000_000, layers)
  return Profile(overlap=overlap,
      model="random", paths=[f"layer{i}" for i in range(layers)], sizes=sizes,
      t_forward=float(rng.uniform(0.001, 0.02)),
      t_backward=rng.uniform(0.0, 0.01, layers) * (rng.random(layers) > 0.2),
      workers=workers,
      sparsify={"dlgs": LinearCost(float(rng.uniform(0, 1e-3)), float(rng.uniform(0, 5e-9))),
                "lags": LinearCost(float(rng.uniform(0, 1e-3)), float(rng.uniform(0, 5e-8)))},
      comm={kind: LinearCost(float(rng.uniform(1e-5, 2e-3)), float(rng.uniform(1e-10, 1e-8)))
            for kind in ("allgather", "allreduce", "gtopk")})


@pytest.mark.parametrize("seed", range(12))
def test_optimal_equals_brute_force_and_beats_the_others(seed):
  rng = np.random.default_rng(seed)
  profile = random_profile(rng, int(rng.integers(1, 13)), overlap=seed % 3 != 0)
  method = ["dlgs", "dense", "lags", "gtopk"][seed % 4]
  costs = MethodCosts(method, float(rng.choice([0.1, 0.01, 0.001])))
  best = simulate(profile, planner.brute_force(profile, costs), costs).t_iter
  found = simulate(profile, planner.optimal(profile, costs), costs).t_iter
  assert found == pytest.approx(best, rel=1e-12, abs=1e-15)
  for name in ("greedy", "wfbp", "single"):
    other = simulate(profile, planner.PLANNER_FUNCTIONS[name](profile, costs), costs).t_iter
    assert found <= other + 1e-15, name


@pytest.mark.parametrize("seed", range(6))
def test_optimal_equals_brute_force_with_layers_sent_whole(seed):
  rng = np.random.default_rng(100 + seed)
  layers = int(rng.integers(2, 12))
  profile = random_profile(rng, layers, overlap=seed % 2 == 0)
  whole = frozenset(int(i) for i in rng.choice(layers, size=max(1, layers // 3), replace=False))
  costs = MethodCosts(["dlgs", "lags"][seed % 2], 0.01, whole_layers=whole)
  best = simulate(profile, planner.brute_force(profile, costs), costs).t_iter
  found = simulate(profile, planner.optimal(profile, costs), costs).t_iter
  assert found == pytest.approx(best, rel=1e-12, abs=1e-15)
  # make_plan prices the whole layers: its prediction is the model's with them,
  # which sends more than the same groups all sparsified.
  plan = planner.make_plan(profile, costs.method, 0.01, "optimal", whole_layers=whole)
  index = {path: i for i, path in enumerate(profile.paths)}
  groups = [[index[p] for p in g] for g in plan.groups]
  assert plan.predicted == simulate(profile, groups, costs).breakdown()
  plain = MethodCosts(costs.method, 0.01)
  assert simulate(profile, groups, costs).comm > simulate(profile, groups, plain).comm


def test_optimal_merges_small_layers_when_latency_dominates():
  sizes = [100] * 6
  profile = Profile(model="m", paths=[str(i) for i in range(6)], sizes=sizes, t_forward=0.0,
                    t_backward=[1e-4] * 6, workers=4, sparsify={},
                    comm={"allgather": LinearCost(1e-2, 0.0)})
  costs = MethodCosts("dlgs", 0.1)
  assert planner.optimal(profile, costs) == [list(range(6))]
  # With free latency and real bandwidth cost, sending each layer as soon as
  # it is ready overlaps best.
  profile2 = Profile(model="m", paths=[str(i) for i in range(6)], sizes=sizes, t_forward=0.0,
                     t_backward=[1e-2] * 6, workers=4, sparsify={},
                     comm={"allgather": LinearCost(0.0, 1e-5)})
  assert planner.optimal(profile2, costs) == [[i] for i in range(6)]


def test_optimal_is_fast_for_resnet50_leaf_count():
  rng = np.random.default_rng(0)
  profile = random_profile(rng, 161)
  costs = MethodCosts("dlgs", 0.01)
  start = time.perf_counter()
  groups = planner.optimal(profile, costs)
  elapsed = time.perf_counter() - start
  assert [i for g in groups for i in g] == list(range(161))
  # Not a timing assertion on noisy machines: just a generous sanity bound.
  assert elapsed < 30
  assert simulate(profile, groups, costs).t_iter <= simulate(
      profile, planner.greedy(profile, costs), costs).t_iter


def test_plan_json_round_trip_and_checks(tmp_path):
  rng = np.random.default_rng(1)
  profile = random_profile(rng, 5)
  plan = planner.make_plan(profile, "dlgs", 0.01, "optimal")
  assert plan.order == list(profile.paths)
  assert [p for g in plan.groups for p in g] == plan.order
  assert plan.predicted["t_iter"] == pytest.approx(
      simulate(profile, [[profile.paths.index(p) for p in g] for g in plan.groups],
               MethodCosts("dlgs", 0.01)).t_iter)
  plan.save(tmp_path / "plan.json")
  loaded = planner.Plan.load(tmp_path / "plan.json")
  assert loaded == plan
  assert Profile.from_dict(loaded.profile) == profile
  assert loaded.profile_id == planner.profile_id(profile)
  loaded.check_compatible(paths=list(reversed(profile.paths)), workers=8, model="random")
  with pytest.raises(ValueError, match="4 workers|8 workers"):
    loaded.check_compatible(paths=profile.paths, workers=4)
  with pytest.raises(ValueError, match="resnet20"):
    loaded.check_compatible(paths=profile.paths, workers=8, model="resnet20")
  with pytest.raises(ValueError, match="does not match"):
    loaded.check_compatible(paths=profile.paths[:-1] + ("other",), workers=8)
  assert loaded.fast_size == 1 and loaded.fast_link is None
  with pytest.raises(ValueError, match=r"made for 8 workers, this run has 4 nodes x 2 devices"):
    loaded.check_compatible(paths=profile.paths, workers=8, fast_size=2)
  # A plan written before the two-level fields existed loads as a flat one.
  old = json.loads(plan.to_json())
  del old["fast_size"], old["fast_link"]
  assert planner.Plan.from_json(json.dumps(old)) == plan
  # Groups as positions: in the profile's order and in any other.
  indices = loaded.group_indices(profile.paths)
  assert [[profile.paths[i] for i in g] for g in indices] == loaded.groups
  assert sorted(i for g in indices for i in g) == list(range(len(profile.paths)))
  backwards = list(reversed(profile.paths))
  assert [[backwards[i] for i in g] for g in loaded.group_indices(backwards)] == loaded.groups
  with pytest.raises(ValueError, match=repr(profile.paths[-1])):
    loaded.group_indices(profile.paths[:-1])


def test_make_plan_bad_input():
  profile = random_profile(np.random.default_rng(2), 3)
  with pytest.raises(ValueError, match="fastest"):
    planner.make_plan(profile, "dlgs", 0.01, "fastest")
  with pytest.raises(ValueError, match="sgd"):
    planner.make_plan(profile, "sgd", 0.01, "optimal")
  with pytest.raises(ValueError, match="1.5"):
    planner.make_plan(profile, "dlgs", 1.5, "optimal")
  with pytest.raises(ValueError, match=r"^not a valid plan \(one dlgs-plan writes\): missing "
                     r"\['density', .*'workers'\], unknown \['densty'\]$"):
    planner.Plan.from_json("{\"model\": 1, \"densty\": 0.1}")
  with pytest.raises(ValueError, match=r"^not a valid plan: not JSON"):
    planner.Plan.from_json("{model")
  with pytest.raises(ValueError, match="no 'allgather'"):
    planner.make_plan(Profile(model="m", paths=["a"], sizes=[3], t_forward=0.0,
                              t_backward=[0.0], workers=2, sparsify={}, comm={}),
                      "dlgs", 0.1, "wfbp")


def test_make_plan_prices_dlgs_at_the_measured_refresh_rate():
  # A costly exact step makes merging pay off only when thresholds are often
  # recomputed: with the fixed schedule (amortised "dlgs", free here) the
  # planner keeps layers apart; at an exact fraction of 1 it merges, paying
  # the exact step's fixed cost fewer times.
  profile = Profile(model="m", paths=[f"l{i}" for i in range(4)], sizes=[1000] * 4,
                    t_forward=0.0, t_backward=[1e-3] * 4, workers=4, overlap=True,
                    sparsify={"dlgs": LinearCost(0.0, 0.0),
                              "dlgs_exact": LinearCost(5e-3, 0.0),
                              "dlgs_reuse": LinearCost(0.0, 0.0)},
                    comm={"allgather": LinearCost(1e-4, 1e-7)})
  schedule = planner.make_plan(profile, "dlgs", 0.1, "optimal")
  refresh = planner.make_plan(profile, "dlgs", 0.1, "optimal", exact_fraction=1.0)
  assert len(schedule.groups) == 4 and len(refresh.groups) == 1
  groups = [[profile.paths.index(p) for p in g] for g in refresh.groups]
  costs = MethodCosts("dlgs", 0.1, exact_fraction=1.0)
  assert refresh.predicted["t_iter"] == pytest.approx(simulate(profile, groups, costs).t_iter)
  assert refresh.predicted["t_iter"] < simulate(profile, [[0], [1], [2], [3]], costs).t_iter
  with pytest.raises(ValueError, match="dlgs only"):
    planner.make_plan(profile, "lags", 0.1, "optimal", exact_fraction=0.5)


def test_dlgs_exact_fraction_only_for_dlgs_with_the_refresh_rule():
  profile = random_profile(np.random.default_rng(3), 2)
  measured = Profile.from_dict({**profile.to_dict(), "dlgs_exact_fraction": 0.7})
  assert planner.dlgs_exact_fraction(measured, "dlgs", 0.5) == 0.7
  assert planner.dlgs_exact_fraction(measured, "dlgs", None) is None  # the paper's schedule
  assert planner.dlgs_exact_fraction(measured, "lags", 0.5) is None
  assert planner.dlgs_exact_fraction(profile, "dlgs", 0.5) is None  # not measured


def test_a_two_level_plan_prices_slices_and_names_its_node_shape(tmp_path):
  """Between 4 nodes of 2 devices: each group is selected and sent on 1/2 slices, and the
  whole message crosses the fast link; the plan keeps the shape and refuses another."""
  rng = np.random.default_rng(3)
  profile = random_profile(rng, 6, workers=4)  # the workers between which messages go: nodes
  fast = LinearCost(1e-5, 1e-10)
  plan = planner.make_plan(profile, "dlgs", 0.01, "optimal", fast_size=2, fast_link=fast)
  costs = MethodCosts("dlgs", 0.01, fast_size=2, fast_link=fast)
  groups = [[profile.paths.index(p) for p in g] for g in plan.groups]
  assert plan.predicted["t_iter"] == pytest.approx(simulate(profile, groups, costs).t_iter)
  assert plan.predicted["t_iter"] == pytest.approx(
      simulate(profile, planner.optimal(profile, costs), costs).t_iter)
  assert plan.fast_size == 2 and plan.fast_link == {"alpha": 1e-5, "beta": 1e-10}
  plan.save(tmp_path / "plan.json")
  loaded = planner.Plan.load(tmp_path / "plan.json")
  assert loaded == plan
  loaded.check_compatible(paths=profile.paths, workers=8, fast_size=2)
  with pytest.raises(ValueError, match=r"made for 4 nodes x 2 devices \(two-level, slices of "
                     r"1/2\), this run has 8 workers$"):
    loaded.check_compatible(paths=profile.paths, workers=8)
  with pytest.raises(ValueError, match="this run has 2 nodes x 4 devices"):
    loaded.check_compatible(paths=profile.paths, workers=8, fast_size=4)
