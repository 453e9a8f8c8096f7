import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dlgs_jax.compress import deep_gradient_compression as dgc_lib
from dlgs_jax.compress import selection
import dlgs_jax
from tests.helpers import random_grads, run_steps

# Large enough that thresholds are sampled (> 1024 values), plus dense leaves.
PARAMS = {"conv": jnp.zeros((3, 3, 16, 32)), "fc": jnp.zeros((64, 40)),
          "bias": jnp.zeros((40,)), "scale": jnp.zeros((32,))}
W = 4


def test_warmup_schedule_matches_the_paper():
  # Paper: 75%, 93.75%, 98.4375%, 99.6%, then 99.9% sparsity over four epochs.
  values = dgc_lib.warmup_densities(0.001, 0.25, 4)
  np.testing.assert_allclose(values, [0.25, 0.0629, 0.01581, 0.003976, 0.001], rtol=2e-3)
  ratios = np.asarray(values[1:]) / np.asarray(values[:-1])
  np.testing.assert_allclose(ratios, ratios[0], rtol=1e-9)  # exponential decay
  steps = 400  # 4 stages of 100 steps
  got = [dgc_lib.warmup_density(s, 0.001, warmup_steps=steps) for s in (0, 99, 100, 250, 399, 400, 10**6)]
  np.testing.assert_allclose(got, [values[0], values[0], values[1], values[2], values[3],
                                   0.001, 0.001])
  assert dgc_lib.warmup_density(5, 0.5, warmup_steps=10) == 0.5  # target above the start
  assert dgc_lib.warmup_density(5, 0.01, warmup_steps=0) == 0.01
  traced = jax.jit(lambda s: dgc_lib.warmup_stage(s, 400, 4))
  assert [int(traced(jnp.int32(s))) for s in (0, 150, 399, 5000)] == [0, 1, 3, 4]


def test_nothing_lost_on_the_velocity_accumulation_and_masking():
  rng = np.random.default_rng(0)
  momentum = 0.9
  tx = dgc_lib.dgc(0.01, axis_name="data", momentum=momentum)
  steps = [random_grads(PARAMS, W, rng) for _ in range(4)]
  updates, _, states = run_steps(tx, PARAMS, steps, W)
  u = {k: np.zeros((W,) + v.shape, np.float32) for k, v in PARAMS.items()}
  v = {k: np.zeros((W,) + x.shape, np.float32) for k, x in PARAMS.items()}
  for t, grads in enumerate(steps):
    state = states[t]
    for name in PARAMS:
      u_now = momentum * u[name] + grads[name]
      if PARAMS[name].ndim >= 2:
        accumulated = v[name] + u_now
        new_v = state.residuals[name]
        sent = accumulated - new_v  # per worker: what went out
        # nothing lost: P * mean == sum of what was sent; sent + kept == accumulated
        np.testing.assert_allclose(W * updates[t][name][0], sent.sum(0), rtol=1e-5, atol=1e-5)
        was_sent = (new_v == 0) & (accumulated != 0)
        np.testing.assert_allclose(sent[~was_sent], 0, atol=1e-5)
        # momentum factor masking: u is zero exactly where values were sent
        np.testing.assert_array_equal(state.velocity[name][was_sent], 0)
        np.testing.assert_allclose(state.velocity[name][~was_sent], u_now[~was_sent],
                                   rtol=1e-6, atol=1e-6)
      else:  # dense leaves: mean velocity, i.e. momentum SGD, and no residual
        np.testing.assert_allclose(updates[t][name][0], u_now.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(state.residuals[name], 0)
        np.testing.assert_allclose(state.velocity[name], u_now, rtol=1e-6, atol=1e-6)
      for w in range(1, W):
        np.testing.assert_array_equal(updates[t][name][w], updates[t][name][0])
      u[name] = np.asarray(state.velocity[name])
      v[name] = np.asarray(state.residuals[name])


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_selected_count_within_the_band(density):
  rng = np.random.default_rng(1)
  tx = dgc_lib.dgc(density, axis_name="data")
  steps = [random_grads(PARAMS, W, rng, scale=s) for s in (1.0, 3.0, 0.1)]
  # heavy tails and exact zeros in one step
  steps[2]["fc"][:, :32] = 0.0
  steps[2]["conv"] = steps[2]["conv"] ** 3
  _, _, states = run_steps(tx, PARAMS, steps, W)
  sparse_sizes = [3 * 3 * 16 * 32, 64 * 40]  # flatten order: conv, fc
  for state in states:
    for j, size in enumerate(sparse_sizes):
      k = selection.num_to_keep(density, size)
      count = state.stats.selected[:, j]
      assert np.all(count <= math.ceil(1.3 * k)), (count, k)
      assert np.all(count >= math.ceil(0.8 * k)), (count, k)


def test_estimated_threshold_refines_into_the_band():
  rng = np.random.default_rng(2)
  for dist in (rng.standard_normal(200_000), rng.standard_cauchy(200_000),
               np.where(rng.random(200_000) < 0.9, 0.0, rng.standard_normal(200_000))):
    v = jnp.asarray(dist, jnp.float32)
    k = 500
    t = jax.jit(lambda key, v: dgc_lib.estimate_threshold(
        key, v, k, sample_ratio=0.01, band=(0.8, 1.3), max_lowering=3))(jax.random.key(0), v)
    count = int(jnp.sum((jnp.abs(v) >= t) & (v != 0)))
    assert math.ceil(0.8 * k) <= count <= math.floor(1.3 * k), count


def test_warmup_buffers_shrink_with_the_density():
  rng = np.random.default_rng(3)
  tx = dgc_lib.dgc(0.01, axis_name="data", warmup_steps=4, warmup_start=0.2, warmup_stages=2)
  steps = [random_grads(PARAMS, W, rng) for _ in range(5)]
  _, _, states = run_steps(tx, PARAMS, steps, W)
  sent = [float(s.stats.bytes_sent[0]) for s in states]
  assert sent[0] == sent[1] > sent[2] == sent[3] > sent[4]
  densities = dgc_lib.warmup_densities(0.01, 0.2, 2)
  size = 64 * 40
  for t, d in zip((0, 2, 4), densities):
    k = selection.num_to_keep(d, size)
    assert np.all(states[t].stats.selected[:, 1] <= math.ceil(1.3 * k))
    assert np.all(states[t].stats.selected[:, 1] >= math.ceil(0.8 * k))


@pytest.mark.slow
@pytest.mark.parametrize("warmup_steps, reached", [
    (1, [0, 4]), (3, [0, 1, 2, 4]), (4, [0, 1, 2, 3, 4]), (8, [0, 1, 2, 3, 4])])
def test_a_short_warmup_builds_only_the_stages_its_steps_reach(warmup_steps, reached):
  rng = np.random.default_rng(5)
  stages, final = 4, 0.02
  tx, one_worker = (dgc_lib.dgc(final, axis_name=axis, warmup_steps=warmup_steps,
                                warmup_start=0.25, warmup_stages=stages)
                    for axis in ("data", None))
  assert sorted({dgc_lib.warmup_stage(t, warmup_steps, stages)
                 for t in range(warmup_steps + 1)}) == reached
  # The exchange's switch has one branch per reached stage, no more.
  grads = jax.tree_util.tree_map(lambda x: jnp.ones(x.shape), PARAMS)
  jaxpr = jax.make_jaxpr(one_worker.update)(grads, one_worker.init(PARAMS))

  def branch_counts(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "cond":
        yield len(eqn.params["branches"])
        for branch in eqn.params["branches"]:
          yield from branch_counts(branch.jaxpr)

  assert len(reached) in set(branch_counts(jaxpr.jaxpr))
  assert max(branch_counts(jaxpr.jaxpr)) == len(reached)
  # Every step still sends what its own stage's density asks for.
  steps = [random_grads(PARAMS, W, rng) for _ in range(warmup_steps + 2)]
  _, _, states = run_steps(tx, PARAMS, steps, W)
  size = 64 * 40
  for t, state in enumerate(states):
    k = selection.num_to_keep(
        dgc_lib.warmup_density(t, final, warmup_steps=warmup_steps, stages=stages), size)
    assert np.all(state.stats.selected[:, 1] <= math.ceil(1.3 * k)), (t, k)
    assert np.all(state.stats.selected[:, 1] >= math.ceil(0.8 * k)), (t, k)


def test_trains_with_plain_sgd_and_single_worker():
  target = jnp.asarray(np.random.default_rng(4).standard_normal((64, 40)), jnp.float32)
  params = {"fc": jnp.zeros((64, 40)), "bias": jnp.zeros((40,))}
  tx = optax.chain(dgc_lib.dgc(0.05, momentum=0.9), optax.sgd(0.02))

  def loss(p):
    return 0.5 * jnp.sum((p["fc"] - target) ** 2) + 0.5 * jnp.sum((p["bias"] - 1.0) ** 2)

  @jax.jit
  def step(p, s):
    g = jax.grad(loss)(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  start = float(loss(params))
  for _ in range(300):
    params, state = step(params, state)
  assert float(loss(params)) < 0.2 * start


def test_skip_and_bad_arguments():
  grads = random_grads(PARAMS, W, np.random.default_rng(5))
  grads["fc"][1, 0, 0] = np.inf
  updates, state, _ = run_steps(dgc_lib.dgc(0.01, axis_name="data"), PARAMS, [grads], W)
  assert all(np.all(u == 0) for u in jax.tree_util.tree_leaves(updates[0]))
  assert np.all(state.stats.skipped == 1) and np.all(state.count == 0)
  for kwargs, match in ((dict(momentum=1.0), "momentum"), (dict(sample_ratio=0), "sample_ratio"),
                        (dict(band=(1.2, 1.5)), "band"), (dict(warmup_steps=-1), "warmup_steps"),
                        (dict(clip_norm=0), "clip_norm")):
    with pytest.raises(ValueError, match=match):
      dgc_lib.dgc(0.01, **kwargs)


@pytest.mark.slow
def test_velocity_and_residuals_stay_float32_for_bfloat16_parameters_unless_told():
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), PARAMS)
  rng = np.random.default_rng(7)
  steps = [jax.tree_util.tree_map(lambda g: jnp.asarray(g, jnp.bfloat16),
                                  random_grads(PARAMS, W, rng)) for _ in range(2)]
  for dtype, expected in (("float32", jnp.float32), (jnp.bfloat16, jnp.bfloat16)):
    tx = dlgs_jax.dgc(0.1, axis_name="data", residual_dtype=dtype)
    updates, final, _ = run_steps(tx, params, steps, W)
    for tree in (final.velocity, final.residuals):
      assert all(x.dtype == expected for x in jax.tree_util.tree_leaves(tree))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(updates[-1]))
  with pytest.raises(ValueError, match="residual_dtype must be a floating dtype"):
    dlgs_jax.dgc(0.1, residual_dtype=jnp.int8)
