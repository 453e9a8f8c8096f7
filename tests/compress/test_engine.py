"""Reused DLGS thresholds on a reuse step: adaptation, the group's recompute rule, settling."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlgs_jax.compress import engine
from dlgs_jax.compress import rules
from tests.helpers import adapted_threshold

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


def reuse_step(select, layout, leaves, previous, recompute=False):
  """A reuse step of one group, jitted: the thresholds it keeps (`engine.settle`), exact leaves."""

  @jax.jit
  def run(leaves, previous):
    flat = engine.Summed(layout.lay_out(0, leaves), None)
    picked = engine.pick(select, layout, 0, flat, previous)
    (thresholds,), exact = engine.settle(select, layout, [flat], [picked], [previous],
                                         jnp.asarray(recompute))
    return thresholds, exact

  return run([jnp.asarray(x) for x in leaves], jnp.asarray(previous, jnp.float32))


def passing(x, t):
  return int(np.sum((np.abs(x) >= t) & (x != 0)))


def kth_largest(x, k):
  return np.sort(np.abs(x))[::-1][k - 1]


@pytest.mark.slow
def test_adapted_thresholds_and_the_group_rule_match_numpy():
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
    got, exact = reuse_step(select, layout, leaves, previous)
    want = [adapted_threshold(x, p, k, rules.AdaptedReuse()) if k >= rules.AdaptedReuse().exact_below_k
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
  got, exact = reuse_step(select, layout, leaves, previous)
  assert int(exact) == (2 if recomputes else 0)
  if recomputes:
    np.testing.assert_array_equal(got, [kth_largest(leaves[0], 1000), kth_largest(leaves[1], 40)])
  else:
    assert passing(leaves[1], got[1]) == 0 and got[1] < previous[1]


def test_a_residual_piled_up_below_the_threshold_is_not_overshot():
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
  got, exact = reuse_step(select, layout, [leaf], np.array([1.0], np.float32))
  assert int(exact) == 0
  np.testing.assert_allclose(got, [adapted_threshold(leaf, 1.0, 100, rules.AdaptedReuse())], rtol=2e-6)
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
  got, exact = reuse_step(select, layout, leaves, previous)
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
  got, exact = reuse_step(select, layout, leaves, previous)
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
  got, exact = reuse_step(select, layout, leaves, previous)
  assert int(exact) == 2
  np.testing.assert_array_equal(got, [kth_largest(x, 500) for x in leaves])


def test_a_step_selects_with_the_proposal_and_keeps_exact_thresholds_when_due():
  # The schedule's exact step: the message holds what the reused thresholds
  # pass (no group waits for an exact select of its own values), and the
  # thresholds kept for the next step are the exact k_l-th largest of this
  # step's values. A step off the schedule keeps the proposal.
  layout = group_layout((3000, 300))
  select = engine.Selection("threshold", DENSITY, rule=rules.FixedReuse(10))
  rng = np.random.default_rng(9)
  leaves = [rng.standard_normal(n).astype(np.float32) for n in (3000, 300)]
  previous = np.array([2.0, 1.0], np.float32)

  @jax.jit
  def step(leaves, recompute):
    flat = engine.Summed(layout.lay_out(0, leaves), None)
    picked = engine.pick(select, layout, 0, flat, jnp.asarray(previous))
    kept, exact = engine.settle(select, layout, [flat], [picked], [jnp.asarray(previous)],
                                recompute)
    return picked.positions, picked.passed, kept[0], exact

  flat = np.concatenate([leaves[0], np.zeros(8, np.float32), leaves[1], np.zeros(20, np.float32)])
  for recompute in (True, False):
    positions, passed, kept, exact = step([jnp.asarray(x) for x in leaves],
                                          jnp.asarray(recompute))
    want = [passing(x, t) for x, t in zip(leaves, previous)]
    np.testing.assert_array_equal(passed, want)
    sent = np.asarray(positions)[np.asarray(positions) < flat.size]
    assert np.all(np.abs(flat[sent]) >= np.repeat(previous, [min(want[0], 300), min(want[1], 30)]))
    if recompute:
      np.testing.assert_array_equal(kept, [kth_largest(leaves[0], 300), kth_largest(leaves[1], 30)])
      assert int(exact) == 2
    else:
      np.testing.assert_array_equal(kept, previous)
      assert int(exact) == 0


def test_a_first_step_starts_from_zero_and_keeps_exact_thresholds():
  # Before its first step a group's thresholds are 0, as the paper's list V
  # starts: every nonzero value passes and each leaf sends its first values in
  # index order, a buffer's worth; the thresholds kept are this step's exact ones.
  layout = group_layout((1000, 64))
  leaves = [np.random.default_rng(3).standard_normal(n).astype(np.float32) for n in (1000, 64)]
  leaves[0][:5] = 0.0  # zeros never pass
  for rule in (rules.FixedReuse(), rules.RefreshReuse(), rules.AdaptedReuse()):
    select = engine.Selection("threshold", DENSITY, rule=rule)
    start = engine.initial_thresholds(select, layout, 0)
    np.testing.assert_array_equal(start, [0.0, 0.0])
    flat = layout.lay_out(0, [jnp.asarray(x) for x in leaves])
    picked = jax.jit(lambda v, t, s=select: engine.pick(s, layout, 0, engine.Summed(v, None),
                                                        t))(flat, start)
    positions = np.asarray(picked.positions)
    np.testing.assert_array_equal(positions[:100], np.arange(5, 105))
    np.testing.assert_array_equal(positions[100:], np.arange(1024, 1024 + 7))
    got, exact = reuse_step(select, layout, leaves, np.asarray(start), recompute=True)
    np.testing.assert_array_equal(got, [kth_largest(leaves[0], 100), kth_largest(leaves[1], 7)])
    assert int(exact) == 2


def test_summed_gives_g_and_keeps_the_old_residual_bit_for_bit_on_a_skipped_step():
  rng = np.random.default_rng(3)
  layout = group_layout(SIZES)
  segs = layout.buffer(0)
  residual = rng.standard_normal(segs.length).astype(np.float32)
  residual[:6] = [-0.0, 0.0, -0.0, 1e-30, -3.0, 0.0]  # signed zeros
  gradient = rng.standard_normal(segs.length).astype(np.float32)
  gradient[1] = -0.0
  summed = engine.Summed(jnp.asarray(residual), jnp.asarray(gradient))
  want = residual + gradient
  np.testing.assert_array_equal(np.asarray(summed.total()), want)
  positions = jnp.asarray([5, 0, segs.length, 17], jnp.int32)  # the sentinel gives 0
  np.testing.assert_array_equal(np.asarray(summed.at(positions)),
                                np.append(want, 0.0)[[5, 0, -1, 17]])
  samples, sample_segs = summed.samples(segs, [3, 1], [7, 1])
  np.testing.assert_array_equal(
      np.asarray(samples), np.asarray(engine.Summed(jnp.asarray(want), None).samples(
          segs, [3, 1], [7, 1])[0]))
  assert sample_segs.sizes == (-(-SIZES[3] // 7), SIZES[1])
  kept = jax.jit(summed.kept)
  np.testing.assert_array_equal(np.asarray(kept(jnp.asarray(True))), want)
  old = np.asarray(kept(jnp.asarray(False)))
  assert old.tobytes() == residual.tobytes()  # -0.0 stays -0.0
  with pytest.raises(ValueError, match="two terms"):
    engine.Summed(jnp.asarray(want), None).kept(jnp.asarray(False))
