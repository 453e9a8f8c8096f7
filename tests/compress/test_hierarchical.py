"""Two-level exchange on 8 CPU devices as 2x4 and 4x2 meshes: means, nothing lost, identical."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dlgs_jax
from dlgs_jax.compress.hierarchical import TwoLevelState, slice_shape, two_level
from dlgs_jax.compress.state import leaf_residuals

# Sizes not divisible by L, a leaf smaller than L, a scalar.
PARAMS = {"kernel": jnp.zeros((5, 7)), "bias": jnp.zeros((3,)), "scale": jnp.zeros(())}
AXES = ("node", "local")
SPARSE = {
    "dlgs": lambda axis: dlgs_jax.dlgs(0.2, axis_name=axis, thresholds=dlgs_jax.AdaptedReuse(2)),
    "lags": lambda axis: dlgs_jax.lags(0.2, axis_name=axis),
    "topk": lambda axis: dlgs_jax.topk(0.2, axis_name=axis),
    "gtopk": lambda axis: dlgs_jax.gtopk(0.2, axis_name=axis),
}


def run(make, shape, steps, params=PARAMS, fast_size=None):
  """(updates per step as seen by every device, states per step) of the two-level transform."""
  nodes, local = shape
  mesh = jax.make_mesh(shape, AXES, devices=jax.devices()[:nodes * local])
  tx = two_level(make, fast_axis="local", slow_axis="node", fast_size=fast_size or local)
  state = dlgs_jax.init_per_worker(tx, params, mesh)
  specs = dlgs_jax.state_specs(state, AXES)

  def step(g, s):
    u, s = tx.update(jax.tree_util.tree_map(lambda x: x[0], g), dlgs_jax.squeeze_state(s))
    return jax.tree_util.tree_map(lambda x: x[None], u), dlgs_jax.unsqueeze_state(s)

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(AXES), specs),
                             out_specs=(P(AXES), specs)))
  updates, states = [], []
  for grads in steps:
    u, state = fn(jax.device_put(grads, NamedSharding(mesh, P(AXES))), state)
    updates.append(jax.tree_util.tree_map(np.asarray, u))
    states.append(dlgs_jax.fetch(state))
  return updates, states


def random_steps(shape, count, seed=0):
  rng = np.random.default_rng(seed)
  workers = shape[0] * shape[1]
  return [{k: rng.standard_normal((workers,) + v.shape).astype(np.float32)
           for k, v in PARAMS.items()} for _ in range(count)]


def whole(residual, shape, leaf_shape):
  """Sum over every device of its slices, placed back where they came from."""
  nodes, local = shape
  size = math.prod(leaf_shape)
  rows = np.asarray(residual).reshape(nodes, local, -1).sum(0)  # (L, width)
  return rows.reshape(-1)[:size].reshape(leaf_shape)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_dense_two_level_is_the_mean_over_every_worker(shape):
  steps = random_steps(shape, 1)
  updates, states = run(lambda axis: dlgs_jax.dense(axis_name=axis), shape, steps)
  for key, g in steps[0].items():
    np.testing.assert_allclose(updates[0][key][0], g.mean(0), rtol=1e-5, atol=1e-6)
  # Only the N-node all-reduce of 1/L of the values crosses the slow link.
  width = sum(max(1, -(-math.prod(v.shape) // shape[1])) for v in PARAMS.values())
  assert states[0].inner.stats.bytes_sent[0] == pytest.approx(
      dlgs_jax.compress.wire.allreduce_bytes(width, shape[0]))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("name", sorted(SPARSE))
def test_nothing_lost_in_two_level_form_and_identical_everywhere(name, shape):
  """N·L·update + L·Σ e_new == Σ grad + L·Σ e_old, each e summed over devices' slices."""
  nodes, local = shape
  steps = random_steps(shape, 3, seed=1)
  updates, states = run(SPARSE[name], shape, steps)
  old = {k: np.zeros(v.shape, np.float32) for k, v in PARAMS.items()}
  for grads, update, state in zip(steps, updates, states):
    for key, leaf in PARAMS.items():
      u = update[key]
      for device in range(1, nodes * local):
        np.testing.assert_array_equal(u[device], u[0])
      new = whole(leaf_residuals(state.inner)[key], shape, leaf.shape)
      np.testing.assert_allclose(nodes * local * u[0] + local * new,
                                 grads[key].sum(0) + local * old[key], rtol=1e-5, atol=1e-5)
      old[key] = new
  assert any(np.count_nonzero(update[k][0]) for k in PARAMS)  # the last step sent


@pytest.mark.parametrize("make", [lambda axis: dlgs_jax.dgc(0.2, axis_name=axis),
                                  lambda axis: dlgs_jax.terngrad(axis_name=axis)],
                         ids=["dgc", "terngrad"])
def test_dgc_and_terngrad_run_on_slices_identically_everywhere(make):
  updates, states = run(make, (2, 4), random_steps((2, 4), 2, seed=2))
  for key in PARAMS:
    for device in range(1, 8):
      np.testing.assert_array_equal(updates[-1][key][device], updates[-1][key][0])
  assert isinstance(states[-1], TwoLevelState)


def test_per_device_state_is_a_slice_of_the_parameters():
  tx = two_level(SPARSE["dlgs"], fast_axis="local", slow_axis="node", fast_size=4)
  state = tx.init({"w": jnp.zeros((64, 32)), "b": jnp.zeros((10,))})
  residuals = leaf_residuals(state.inner)
  assert residuals["w"].shape == (1, 512)   # 2048 / 4, dimensions kept
  assert residuals["b"].shape == (3,)       # ceil(10 / 4)
  assert slice_shape((), 4) == ()


def test_two_level_in_data_parallel_on_a_two_axis_mesh_matches_flat_dense():
  mesh = jax.make_mesh((2, 4), AXES, devices=jax.devices()[:8])
  x = np.random.default_rng(3).standard_normal((16, 5)).astype(np.float32)
  params = {"kernel": np.ones((5, 7), np.float32), "bias": np.zeros(7, np.float32)}

  def loss(p, batch):
    return jnp.mean((batch @ p["kernel"] + p["bias"]) ** 2)

  results = []
  for tx in (two_level(lambda axis: dlgs_jax.dense(axis_name=axis), fast_axis="local",
                       slow_axis="node", fast_size=4),
             dlgs_jax.dense(axis_name=AXES)):
    dp = dlgs_jax.data_parallel(loss, optax.chain(tx, optax.sgd(0.1)), mesh)
    state, _ = dp.step(dp.init(params), jax.device_put(x, dp.batch_sharding))
    results.append(dlgs_jax.fetch(state.params))
  for key in params:
    np.testing.assert_allclose(results[0][key], results[1][key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"fast_axis": 1, "slow_axis": "node", "fast_size": 4}, "fast_axis must be a mesh axis"),
    ({"fast_axis": "local", "slow_axis": None, "fast_size": 4}, "slow_axis must name the node"),
    ({"fast_axis": "local", "slow_axis": "local", "fast_size": 4}, "other than fast_axis"),
    ({"fast_axis": "local", "slow_axis": "node", "fast_size": 0}, "fast_size must be an integer"),
])
def test_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    two_level(SPARSE["dlgs"], **kwargs)


def test_a_fast_size_other_than_the_local_axis_is_named():
  with pytest.raises(ValueError, match="fast_size 2 does not match the mesh axis 'local' of 4"):
    run(SPARSE["dlgs"], (2, 4), random_steps((2, 4), 1), fast_size=2)
