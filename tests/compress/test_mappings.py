"""Every transform under the three ways JAX maps workers: shard_map, pmap and vmap.

With ``jax.vmap(..., axis_name=)`` one device simulates P workers; the updates
and states must be those of P devices under ``jax.shard_map`` and ``jax.pmap``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dlgs_jax
from dlgs_jax.compress.hierarchical import two_level
from tests.compress.test_common import BUILDERS
from tests.helpers import random_grads, residual_tree, run_steps

PARAMS = {"conv": jnp.zeros((3, 3, 4, 8)), "dense": jnp.zeros((40, 10)), "bias": jnp.zeros((10,))}
WORKERS = 4
# Every transform (test_common's), DLGS also on the paper's schedule, both exact every 2 steps.
TRANSFORMS = {
    **BUILDERS,
    "dlgs": lambda axis: dlgs_jax.dlgs(0.1, axis_name=axis, thresholds=dlgs_jax.AdaptedReuse(2)),
    "dlgs-paper": lambda axis: dlgs_jax.dlgs(0.1, axis_name=axis,
                                             thresholds=dlgs_jax.FixedReuse(2)),
    "topk-owners": lambda axis: dlgs_jax.topk(0.1, axis_name=axis, collective="owners"),
}


def vmap_workers(f):
  """`f` over the workers simulated on one device by ``jax.vmap``."""
  return jax.jit(jax.vmap(f, axis_name="data"))


def pmap_workers(f):
  """`f` over one device per worker by ``jax.pmap``."""
  return jax.pmap(f, axis_name="data", devices=jax.devices()[:WORKERS])


def mapped(tx, steps, workers_map):
  """Updates per step and the final state of `tx`, its workers mapped by `workers_map`."""
  state = workers_map(lambda _: tx.init(PARAMS))(jnp.arange(WORKERS))
  fn = workers_map(tx.update)
  updates = []
  for grads in steps:
    u, state = fn(grads, state)
    updates.append(jax.tree_util.tree_map(np.asarray, u))
  return updates, jax.tree_util.tree_map(np.asarray, state)


def assert_same(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_vmap_pmap_and_shard_map_give_the_same_updates_and_states(name):
  rng = np.random.default_rng(0)
  steps = [random_grads(PARAMS, WORKERS, rng) for _ in range(3)]
  tx = TRANSFORMS[name]("data")
  by_shard_map, _, states = run_steps(tx, PARAMS, steps, WORKERS)
  by_vmap, vmap_state = mapped(tx, steps, vmap_workers)
  by_pmap, pmap_state = mapped(tx, steps, pmap_workers)
  for ours, theirs in ((by_vmap, by_shard_map), (by_pmap, by_shard_map)):
    for u, v in zip(ours, theirs):
      assert_same(u, v)
  assert_same(vmap_state, states[-1])
  assert_same(pmap_state, states[-1])
  # Every worker applies the same update.
  for leaf in jax.tree_util.tree_leaves(by_vmap[-1]):
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))


def test_vmap_simulates_32_workers_on_one_device_with_nothing_lost():
  workers = 32
  tx = dlgs_jax.dlgs(0.1, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(2))
  rng = np.random.default_rng(1)
  grads = random_grads(PARAMS, workers, rng)
  state = jax.vmap(lambda _: tx.init(PARAMS), axis_name="data")(jnp.arange(workers))
  update, state = jax.jit(jax.vmap(tx.update, axis_name="data"))(grads, state)
  assert jax.tree_util.tree_leaves(update)[0].devices() == {jax.devices()[0]}
  # P * mean + sum of the new residuals == sum of the gradients (residuals started at 0).
  for u, e, g in zip(jax.tree_util.tree_leaves(update),
                     jax.tree_util.tree_leaves(residual_tree(state, PARAMS)),
                     jax.tree_util.tree_leaves(grads)):
    np.testing.assert_allclose(workers * np.asarray(u[0]) + np.asarray(e).sum(0),
                               np.asarray(g).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("collective", ["allgather", "owners"])
def test_two_level_under_nested_vmap_matches_shard_map(collective):
  """Between nodes any sparse collective, each device on its slice (owners: its slice's regions)."""
  nodes, local = 2, 2
  rng = np.random.default_rng(2)
  steps = [{k: rng.standard_normal((nodes * local,) + v.shape).astype(np.float32)
            for k, v in PARAMS.items()} for _ in range(2)]
  make = lambda axis: dlgs_jax.dlgs(  # noqa: E731
      0.1, axis_name=axis, thresholds=dlgs_jax.AdaptedReuse(2), collective=collective)
  tx = two_level(make, fast_axis="local", slow_axis="node", fast_size=local)
  mesh = jax.make_mesh((nodes, local), ("node", "local"), devices=jax.devices()[:4])
  state = dlgs_jax.init_per_worker(tx, PARAMS, mesh)
  specs = dlgs_jax.state_specs(state, ("node", "local"))

  def step(g, s):
    u, s = tx.update(jax.tree_util.tree_map(lambda x: x[0], g), dlgs_jax.squeeze_state(s))
    return jax.tree_util.tree_map(lambda x: x[None], u), dlgs_jax.unsqueeze_state(s)

  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(("node", "local")), specs),
                                  out_specs=(P(("node", "local")), specs)))
  init = lambda _: tx.init(PARAMS)  # noqa: E731
  nested = lambda f: jax.vmap(jax.vmap(f, axis_name="local"), axis_name="node")  # noqa: E731
  vstate = nested(init)(jnp.zeros((nodes, local)))
  vstep = jax.jit(nested(tx.update))
  for grads in steps:
    u, state = sharded(jax.device_put(grads, NamedSharding(mesh, P(("node", "local")))), state)
    v, vstate = vstep(jax.tree_util.tree_map(lambda x: x.reshape((nodes, local) + x.shape[1:]),
                                             grads), vstate)
    for a, b in zip(jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(v)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b).reshape(a.shape), rtol=1e-6,
                                 atol=1e-7)
