"""DLGS's threshold rules: their checks, candidates and drift tests against NumPy."""
import jax.numpy as jnp
import numpy as np
import pytest

import dlgs_jax
from dlgs_jax.compress import rules
from dlgs_jax.compress.methods import MethodConfig, method_config
from tests.helpers import adapted_threshold


@pytest.mark.parametrize("make,match", [
    (lambda: rules.FixedReuse(0), r"FixedReuse\(every=0\) is invalid: every must be an integer"),
    (lambda: rules.FixedReuse(2.5), r"every=2.5"),
    (lambda: rules.FixedReuse(True), r"every=True"),
    (lambda: rules.RefreshReuse(below=1.5), r"RefreshReuse\(below=1.5\) is invalid"),
    (lambda: rules.RefreshReuse(below=-0.1), r"below=-0.1"),
    (lambda: rules.AdaptedReuse(below=True), r"below=True"),
    (lambda: rules.AdaptedReuse(candidates=1), r"candidates=1\).*use RefreshReuse"),
    (lambda: rules.AdaptedReuse(candidates=17), r"candidates=17"),
    (lambda: rules.AdaptedReuse(aim=0.0), r"aim=0.0"),
    (lambda: rules.AdaptedReuse(aim=2.5), r"aim=2.5.*\(0, 2\]"),
    (lambda: rules.AdaptedReuse(overflow=0.5), r"overflow=0.5"),
    (lambda: rules.AdaptedReuse(exact_below_k=-1), r"exact_below_k=-1"),
])
def test_a_bad_field_is_refused_in_one_line_naming_it(make, match):
  with pytest.raises(ValueError, match=match) as info:
    make()
  assert "\n" not in str(info.value)


def test_the_rules_are_exported_and_the_default_is_adapted():
  assert dlgs_jax.FixedReuse is rules.FixedReuse
  assert dlgs_jax.AdaptedReuse() == rules.AdaptedReuse(10, 0.5, 7, 0.9, 2.0, 16)
  with pytest.raises(ValueError, match="not a threshold rule"):
    rules.check_rule(None)


@pytest.mark.parametrize("candidates", [2, 3, 7, 16])
def test_candidates_are_eighth_powers_of_two_two_thirds_below_one(candidates):
  factors = rules.AdaptedReuse(candidates=candidates).factors()
  below = int(np.sum(factors < 1))
  assert len(factors) == candidates and below == (2 * candidates) // 3
  np.testing.assert_allclose(np.log2(factors) * 8, np.arange(-below, candidates - below),
                             atol=1e-5)


def test_the_adapted_target_is_the_aim_or_the_band_whichever_is_higher():
  assert rules.AdaptedReuse().target == 0.9
  assert rules.AdaptedReuse(below=0.95).target == 0.95


@pytest.mark.parametrize("aim", [0.9, 1.1])
def test_reused_thresholds_are_re_aimed_at_the_aim_times_k(aim):
  # Leaves rescaled from the draw their previous thresholds were exact for:
  # each new threshold is NumPy's interpolation at aim * k_l, and above 0.9
  # every leaf's threshold is lower than at 0.9, so it passes more values.
  rule = rules.AdaptedReuse(aim=aim)
  rng = np.random.default_rng(1)
  sizes, ks, scales = [3000, 2000, 900], [60, 40, 20], [0.8, 1.0, 1.1]
  leaves = [s * rng.standard_normal(n).astype(np.float32) for n, s in zip(sizes, scales)]
  previous = np.array([np.sort(np.abs(rng.standard_normal(n)))[-k] for n, k in zip(sizes, ks)],
                      np.float32)

  def count(thresholds, strides, which):
    assert list(strides) == [1] * len(which)
    return jnp.stack([jnp.sum((jnp.abs(leaves[i])[None] >= thresholds[j][:, None])
                              & (leaves[i] != 0)[None], axis=1, dtype=jnp.int32)
                      for j, i in enumerate(which)])

  got = np.asarray(rule.propose(jnp.asarray(previous), ks=ks, whole=[False] * 3, count=count,
                                sizes=sizes))
  want = [adapted_threshold(x, p, k, rule) for x, p, k in zip(leaves, previous, ks)]
  np.testing.assert_allclose(got, want, rtol=2e-6)
  passed = [int(np.sum(np.abs(x) >= t)) for x, t in zip(leaves, got)]
  assert all(abs(p - aim * k) <= 0.1 * k + 1 for p, k in zip(passed, ks)), (passed, ks)
  lower = np.asarray(rules.AdaptedReuse().propose(jnp.asarray(previous), ks=ks,
                                                  whole=[False] * 3, count=count, sizes=sizes))
  assert np.all(got <= lower) and (aim == 0.9 or np.all(got < lower))


def _reference(rule, passed, ks, capacities, sparse, live):
  passed, ks, capacities = map(np.asarray, (passed, ks, capacities))
  sparse, live = np.asarray(sparse), np.asarray(live)
  if isinstance(rule, rules.FixedReuse):
    return False
  if isinstance(rule, rules.RefreshReuse):
    low = np.ceil(rule.below * ks)
    return bool(np.any((((passed < low) & live) | (passed > capacities)) & sparse))
  counted = live & sparse
  short = np.minimum(passed, capacities)[counted].sum() < np.ceil(rule.below * ks[counted].sum())
  return bool(short or np.any((passed > rule.overflow * capacities) & sparse))


@pytest.mark.parametrize("rule", [rules.FixedReuse(), rules.RefreshReuse(),
                                  rules.AdaptedReuse(), rules.AdaptedReuse(overflow=1.5)])
def test_drift_tests_match_numpy(rule):
  rng = np.random.default_rng(0)
  ks = np.array([100, 40, 7, 300])
  capacities = np.array([120, 40, 7, 300])
  seen = set()
  for _ in range(200):
    passed = (ks * rng.uniform(0.3, 1.2, 4) ** 3).astype(np.int32)
    sparse = rng.uniform(size=4) < 0.8
    live = rng.uniform(size=4) < 0.8
    got = bool(rule.drifted(passed, ks, capacities, sparse, live))
    assert got == _reference(rule, passed, ks, capacities, sparse, live)
    seen.add(got)
  assert seen == ({False} if isinstance(rule, rules.FixedReuse) else {True, False})


@pytest.mark.parametrize("name,want", [
    ("dlgs", rules.AdaptedReuse()), ("dlgs-paper", rules.FixedReuse()),
    ("dlgs-refresh", rules.RefreshReuse()), ("dlgs-spend", rules.AdaptedReuse(aim=1.1))])
def test_the_method_table_names_each_rule(name, want):
  assert method_config(name).threshold_rule() == want
  assert MethodConfig(reuse_every=4, refresh_below=None).threshold_rule() == rules.FixedReuse(4)
