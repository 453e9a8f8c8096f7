"""Reused DLGS thresholds on a reuse step: adaptation and the group's recompute rule."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlgs_jax.compress import engine
from dlgs_jax.compress import rules
from dlgs_jax.compress import segmented

DENSITY = 0.1
# Leaves of one group: k = 500, 30, 7 and 2 values; all counted exactly (stride 1);
# the last two below rules.AdaptedReuse().exact_below_k.
SIZES = (5000, 300, 64, 16)
FEW = 2


def rule_of(candidates):
  """Reuse with `candidates` thresholds a step: one is the refresh rule."""
  return rules.RefreshReuse() if candidates == 1 else rules.AdaptedReuse(candidates=candidates)


def group_layout(sizes):
  tree = {f"l{i}": jax.ShapeDtypeStruct((n,), jnp.float32) for i, n in enumerate(sizes)}
  paths = [f"l{i}" for i in range(len(sizes))]
  return engine.make_layout(tree, [paths], paths)


def reuse_step(select, layout, leaves, previous, laid_out):
  """`engine.step_thresholds` on a reuse step, jitted: (thresholds, exact leaves)."""
  group = list(layout.groups[0])

  @jax.jit
  def run(leaves, previous):
    values = segmented.values_of(leaves, segmented.segments_of(layout.sizes), laid_out)
    thresholds, _, exact = engine.step_thresholds(select, layout, group, values, previous,
                                                  jnp.asarray(False))
    return thresholds, exact

  return run([jnp.asarray(x) for x in leaves], jnp.asarray(previous, jnp.float32))


def passing(x, t):
  return int(np.sum((np.abs(x) >= t) & (x != 0)))


def kth_largest(x, k):
  return np.sort(np.abs(x))[::-1][k - 1]


def adapted_reference(x, previous, k, candidates, refresh_below):
  """NumPy: the threshold interpolated linearly between the candidates that bracket 0.9 k."""
  factors = rules.AdaptedReuse(candidates=candidates).factors()
  trials = np.float32(previous) * factors
  counts = np.array([passing(x, t) for t in trials]) + 0.5
  target = max(0.9, refresh_below) * k
  lo = min(max(int(np.sum(counts > target)) - 1, 0), len(factors) - 2)
  rise = counts[lo] - target
  span = counts[lo] - counts[lo + 1]
  part = min(max(rise / span if span > 0 else float(rise > 0), 0.0), 1.0)
  return previous * (factors[lo] + part * (factors[lo + 1] - factors[lo]))


@pytest.mark.slow
@pytest.mark.parametrize("laid_out", [False, True])
def test_adapted_thresholds_and_the_group_rule_match_numpy(laid_out):
  # The previous thresholds are exact for another draw; this step's values are
  # that draw rescaled, so the reused thresholds pass too few or too many.
  # Every leaf's adapted threshold matches the NumPy interpolation (the two
  # leaves of k < 16: their exact one), and the group recomputes exactly when,
  # by NumPy, its leaves together pass fewer than half its k or one leaf more
  # than twice its buffer.
  layout = group_layout(SIZES)
  select = engine.Selection("threshold", DENSITY, rule=rules.AdaptedReuse())
  ks = [select.leaf_k(layout, leaf) for leaf in range(len(SIZES))]
  rng = np.random.default_rng(0)
  seen = set()
  for scale in (0.2, 0.7, 1.0, 1.3, 4.0, 10.0):
    old = [rng.standard_normal(n).astype(np.float32) for n in SIZES]
    previous = np.array([kth_largest(x, k) for x, k in zip(old, ks)], np.float32)
    leaves = [(scale * rng.standard_normal(n)).astype(np.float32) for n in SIZES]
    got, exact = reuse_step(select, layout, leaves, previous, laid_out)
    want = [adapted_reference(x, p, k, 7, 0.5) if k >= rules.AdaptedReuse().exact_below_k
            else kth_largest(x, k) for x, p, k in zip(leaves, previous, ks)]
    passed = np.array([passing(x, t) for x, t in zip(leaves, want)])
    redo = (np.minimum(passed, ks).sum() < math.ceil(0.5 * sum(ks))
            or np.any(passed > rules.AdaptedReuse().overflow * np.array(ks)))
    if redo:
      np.testing.assert_array_equal(got, [kth_largest(x, k) for x, k in zip(leaves, ks)])
    else:
      np.testing.assert_allclose(got, want, rtol=2e-6)
    assert int(exact) == (len(SIZES) if redo else FEW), scale
    seen.add(bool(redo))
  assert seen == {True, False}


@pytest.mark.parametrize("candidates,recomputes", [(7, False), (1, True)])
def test_one_leaf_off_its_band_recomputes_the_group_only_under_the_refresh_rule(
    candidates, recomputes):
  # A small leaf's reused threshold passes nothing while the large leaf's
  # passes about k: adapted thresholds keep the group's reuse (the leaf
  # re-aims on the next step), the refresh rule recomputes the whole group.
  layout = group_layout((10000, 400))
  select = engine.Selection("threshold", DENSITY, rule=rule_of(candidates))
  rng = np.random.default_rng(1)
  leaves = [rng.standard_normal(n).astype(np.float32) for n in (10000, 400)]
  previous = np.array([kth_largest(leaves[0], 1000), 100.0], np.float32)
  got, exact = reuse_step(select, layout, leaves, previous, laid_out=False)
  assert int(exact) == (2 if recomputes else 0)
  if recomputes:
    np.testing.assert_array_equal(got, [kth_largest(leaves[0], 1000), kth_largest(leaves[1], 40)])
  else:
    assert passing(leaves[1], got[1]) == 0 and got[1] < previous[1]


@pytest.mark.parametrize("laid_out", [False, True])
def test_a_residual_piled_up_below_the_threshold_is_not_overshot(laid_out):
  # Error feedback piles values up just below a reused threshold H: here 60
  # values above H and 3000 spread evenly over [0.8 H, H). The count is linear
  # there, so the adapted threshold passes close to 0.9 k = 90 and the group
  # keeps it; interpolating log count against log threshold between the
  # candidates 2^(-1/8) H and H (1305 and 60 values) would pick 0.989 H and
  # pass ~230, past twice the buffer of 100.
  layout = group_layout((10000,))
  select = engine.Selection("threshold", 0.01, rule=rules.AdaptedReuse())
  rng = np.random.default_rng(5)
  values = np.concatenate([rng.uniform(1.0, 1.5, 60), rng.uniform(0.8, 1.0, 3000),
                           rng.uniform(0.0, 0.3, 6940)]).astype(np.float32)
  leaf = values * rng.choice([-1.0, 1.0], values.size).astype(np.float32)
  got, exact = reuse_step(select, layout, [leaf], np.array([1.0], np.float32), laid_out)
  assert int(exact) == 0
  np.testing.assert_allclose(got, [adapted_reference(leaf, 1.0, 100, 7, 0.5)], rtol=2e-6)
  assert 75 <= passing(leaf, got[0]) <= 105, passing(leaf, got[0])


def test_a_leaf_far_over_its_buffer_recomputes_the_group():
  # Every candidate of the second leaf passes all 640 values (buffer 64):
  # more than twice the buffer, so the group takes exact thresholds.
  layout = group_layout((5000, 640))
  select = engine.Selection("threshold", DENSITY, rule=rules.AdaptedReuse())
  rng = np.random.default_rng(2)
  leaves = [rng.standard_normal(n).astype(np.float32) + 0.0 for n in (5000, 640)]
  leaves[1] = np.sign(leaves[1]) * (1.0 + np.abs(leaves[1]))
  previous = np.array([kth_largest(leaves[0], 500), 1e-3], np.float32)
  got, exact = reuse_step(select, layout, leaves, previous, laid_out=True)
  assert int(exact) == 2
  np.testing.assert_array_equal(got, [kth_largest(leaves[0], 500), kth_largest(leaves[1], 64)])


@pytest.mark.parametrize("candidates", [7, 1])
def test_a_leaf_with_nothing_to_send_does_not_make_its_group_recompute(candidates):
  # A kernel whose gradient is all zeros (its exact threshold 0) passes
  # nothing; beside a leaf whose reused threshold sends its k, the group keeps
  # its thresholds. Counted as short, the zero leaf (half the group's k) would
  # make the group recompute on every step.
  layout = group_layout((5000, 5000))
  select = engine.Selection("threshold", DENSITY, rule=rule_of(candidates))
  rng = np.random.default_rng(4)
  leaves = [rng.standard_normal(5000).astype(np.float32), np.zeros(5000, np.float32)]
  previous = np.array([kth_largest(leaves[0], 500), 0.0], np.float32)
  got, exact = reuse_step(select, layout, leaves, previous, laid_out=False)
  assert int(exact) == 0
  assert got[1] == 0.0 and passing(leaves[0], got[0]) >= 250


def test_a_zero_leaf_that_fills_past_its_buffer_still_recomputes():
  # Threshold 0 lets every nonzero value pass: once the leaf holds more than
  # twice its buffer of them, the group recomputes and finds its threshold.
  layout = group_layout((5000, 5000))
  select = engine.Selection("threshold", DENSITY, rule=rules.AdaptedReuse())
  rng = np.random.default_rng(5)
  leaves = [rng.standard_normal(5000).astype(np.float32) for _ in range(2)]
  previous = np.array([kth_largest(leaves[0], 500), 0.0], np.float32)
  got, exact = reuse_step(select, layout, leaves, previous, laid_out=True)
  assert int(exact) == 2
  np.testing.assert_array_equal(got, [kth_largest(x, 500) for x in leaves])


def test_on_cpu_a_group_is_laid_out_up_to_its_size_limit_and_kept_leaf_by_leaf_past_it():
  assert jax.default_backend() == "cpu"
  limit = segmented.CPU_LAY_OUT_MAX
  assert segmented.lay_out_by_default(limit) and not segmented.lay_out_by_default(limit + 1)
  # `pick` asks per group, by the group's padded length: a small bucket beside a
  # large one is laid out, the large one is not.
  tree = {"big": jax.ShapeDtypeStruct((limit + 1,), jnp.float32),
          "small": jax.ShapeDtypeStruct((96,), jnp.float32)}
  layout = engine.make_layout(tree, [["big"], ["small"]], ["big", "small"])
  select = engine.Selection("layer_topk", 0.01)
  _, picked, _ = jax.eval_shape(
      lambda ls: engine.pick(select, layout, ls), [jnp.zeros(l.shape) for l in (
          tree["big"], tree["small"])])
  big, small = picked
  assert big.values.flat is None and big.values.leaves is not None
  assert small.values.flat is not None and small.values.flat.shape == (96,)


def test_a_forced_view_holds_inside_its_block_only():
  with segmented.forced_view(False):
    assert not segmented.lay_out_by_default(96)
    with segmented.forced_view(None):  # None: the rule's own choice, here the forced one
      assert not segmented.lay_out_by_default(96)
  with segmented.forced_view(True):
    assert segmented.lay_out_by_default(segmented.CPU_LAY_OUT_MAX + 1)
  assert segmented.lay_out_by_default(96)
  assert not segmented.lay_out_by_default(segmented.CPU_LAY_OUT_MAX + 1)
  with pytest.raises(RuntimeError), segmented.forced_view(False):
    raise RuntimeError("restored on the way out")
  assert segmented.lay_out_by_default(96)
