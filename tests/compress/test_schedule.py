"""Density schedules: phases switch on the step, residuals carry over, nothing lost."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dlgs_jax
from tests.helpers import flat_workers, random_grads, residual_tree, run_steps

PARAMS = {"a": jnp.zeros((20, 10)), "b": jnp.zeros((30,))}
W = 4


@pytest.mark.parametrize("factory, k", [
    (lambda d: dlgs_jax.topk(d, axis_name="data"), lambda d: math.ceil(d * 230)),
    (lambda d: dlgs_jax.lags(d, axis_name="data"),
     lambda d: math.ceil(d * 200) + math.ceil(d * 30)),
], ids=["topk", "lags"])
def test_each_phase_sends_its_density_and_nothing_is_lost_at_a_boundary(factory, k):
  tx = dlgs_jax.density_schedule(factory, {0: 0.5, 2: 0.1, 3: 0.02})
  rng = np.random.default_rng(0)
  steps = [random_grads(PARAMS, W, rng) for _ in range(5)]
  updates, _, states = run_steps(tx, PARAMS, steps, W)
  densities = [0.5, 0.5, 0.1, 0.02, 0.02]
  old = np.zeros_like(flat_workers(steps[0]))
  for grads, update, state, density in zip(steps, updates, states, densities):
    assert np.asarray(state.inner.stats.selected)[0].sum() == k(density)
    new = flat_workers(residual_tree(state.inner, PARAMS))
    owed = (flat_workers(grads) + old).sum(0)
    np.testing.assert_allclose(W * flat_workers(update)[0] + new.sum(0), owed,
                               rtol=1e-5, atol=1e-5)
    old = new
  assert int(np.asarray(states[-1].count)[0]) == 5


def test_a_schedule_runs_in_data_parallel_with_the_checks_on():
  mesh = jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])
  x = np.random.default_rng(1).standard_normal((W * 4, 20)).astype(np.float32)

  def loss(params, batch):
    return jnp.mean((batch @ params["a"]) ** 2) + jnp.mean(params["b"] ** 2)

  params = {"a": np.ones((20, 10), np.float32), "b": np.ones(30, np.float32)}
  tx = optax.chain(dlgs_jax.density_schedule(lambda d: dlgs_jax.dlgs(d, axis_name="data"),
                                             {0: 0.5, 1: 0.05}), optax.sgd(0.01))
  dp = dlgs_jax.data_parallel(loss, tx, mesh)
  state = dp.init(params)
  sent = []
  for _ in range(2):
    state, metrics = dp.step(state, jax.device_put(x, dp.batch_sharding))
    sent.append(float(metrics["selected"]))
  # Thresholds start at 0: every buffer fills; then a (k 10) and b (k 2) pass more
  # than their buffers at the exact thresholds of density 0.5.
  assert sent == [100 + 15, 10 + 2]
  assert dlgs_jax.state_specs(state.opt_state, "data")[0].count == jax.sharding.PartitionSpec()


@pytest.mark.parametrize("boundaries, match", [
    ({1: 0.1}, "and contain step 0, got {1: 0.1}"),
    ({0: 0.1, -1: 0.2}, "integers >= 0, got -1"),
    ([0.1], "must map first steps to densities"),
])
def test_bad_boundaries_are_refused(boundaries, match):
  with pytest.raises(ValueError, match=match):
    dlgs_jax.density_schedule(lambda d: dlgs_jax.dlgs(d), boundaries)


def test_phases_of_different_methods_are_refused_at_init():
  tx = dlgs_jax.density_schedule(
      lambda d: dlgs_jax.dlgs(d) if d > 0.2 else dlgs_jax.lags(d), {0: 0.5, 10: 0.1})
  with pytest.raises(ValueError, match="step 10 .density 0.1. has a state of another structure"):
    tx.init(PARAMS)


def test_inject_hyperparams_says_what_to_do():
  tx = optax.inject_hyperparams(dlgs_jax.dlgs)(density=0.1)
  with pytest.raises(ValueError, match="density must be a Python number.*static_args.*"
                                       "density_schedule"):
    tx.init(PARAMS)
  static = ("density", "capacity_factor")
  tx = optax.inject_hyperparams(dlgs_jax.dlgs, static_args=static)(density=0.1)
  assert isinstance(tx.init(PARAMS).inner_state, dlgs_jax.compress.state.DLGSState)
