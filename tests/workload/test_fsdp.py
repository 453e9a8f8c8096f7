"""Parameters sliced over a node (HSDP) on 2 x 4 CPU devices: two_level's results, nothing lost."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dlgs_jax
from dlgs_jax.compress.hierarchical import two_level
from dlgs_jax.compress.state import is_per_worker, leaf_residuals
from dlgs_jax.workload import fsdp

NODES, LOCAL = 2, 4
# Sizes not divisible by L, a leaf smaller than L, a scalar.
PARAMS = {"w1": np.linspace(-1, 1, 6 * 9, dtype=np.float32).reshape(6, 9),
          "b1": np.zeros(9, np.float32), "w2": np.linspace(1, -1, 9 * 3, dtype=np.float32
                                                           ).reshape(9, 3),
          "b2": np.zeros(3, np.float32), "scale": np.ones((), np.float32)}
METHODS = {
    "dense": lambda axis: dlgs_jax.dense(axis_name=axis),
    "dlgs": lambda axis: dlgs_jax.dlgs(0.2, axis_name=axis, thresholds=dlgs_jax.AdaptedReuse(3)),
    "lags": lambda axis: dlgs_jax.lags(0.2, axis_name=axis),
    "topk": lambda axis: dlgs_jax.topk(0.2, axis_name=axis),
    "gtopk": lambda axis: dlgs_jax.gtopk(0.2, axis_name=axis),
    "dlgs-owners": lambda axis: dlgs_jax.dlgs(0.2, axis_name=axis, collective="owners"),
    "terngrad": lambda axis: dlgs_jax.terngrad(axis_name=axis, seed=0),
    "dgc": lambda axis: dlgs_jax.dgc(0.2, axis_name=axis, momentum=0.0, seed=0),
}


def loss_fn(params, batch):
  x, y = batch
  hidden = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((params["scale"] * (hidden @ params["w2"]) + params["b2"] - y) ** 2)


def batches(steps, rows=16):
  rng = np.random.default_rng(0)
  return [(rng.standard_normal((rows, 6)).astype(np.float32),
           rng.standard_normal((rows, 3)).astype(np.float32)) for _ in range(steps)]


def train(make, sliced: bool, steps: int):
  """Parameters after `steps` (whole, on the host) and the final state."""
  devices = jax.devices()[:NODES * LOCAL]
  if sliced:
    mesh = jax.make_mesh((NODES, LOCAL), ("data", "fsdp"), devices=devices)
    compressor = make("data")
  else:
    mesh = jax.make_mesh((NODES, LOCAL), ("node", "local"), devices=devices)
    compressor = two_level(make, fast_axis="local", slow_axis="node", fast_size=LOCAL)
  tx = optax.chain(compressor, optax.add_decayed_weights(1e-3), optax.sgd(0.1, momentum=0.9))
  dp = dlgs_jax.data_parallel(loss_fn, tx, mesh, fsdp_axis="fsdp" if sliced else None)
  state = dp.init(PARAMS)
  for batch in batches(steps):
    state, metrics = dp.step(state, jax.device_put(batch, dp.batch_sharding))
  return dp.whole_params(state), state, metrics


def test_slices_round_trip_and_gather_whole_inside_shard_map():
  sharded = fsdp.shard(PARAMS, LOCAL)
  assert sharded.slices["w1"].shape == (LOCAL, 1, 14) and sharded.slices["scale"].shape == (4,)
  for name, x in fsdp.whole(sharded).items():
    np.testing.assert_array_equal(x, PARAMS[name])
  mesh = jax.make_mesh((LOCAL,), ("fsdp",), devices=jax.devices()[:LOCAL])
  spec = jax.sharding.PartitionSpec("fsdp")
  placed = jax.device_put(sharded.slices, jax.sharding.NamedSharding(mesh, spec))
  gathered = jax.jit(jax.shard_map(
      lambda s: fsdp.gather(fsdp.rows(s), sharded.shapes, "fsdp"), mesh=mesh,
      in_specs=spec, out_specs=jax.sharding.PartitionSpec(), check_vma=False))(placed)
  for name, x in gathered.items():
    np.testing.assert_array_equal(np.asarray(x), PARAMS[name])


@pytest.mark.parametrize("name", ["dense", "dlgs"])
def test_hsdp_trains_as_two_level_does(name):
  """Its slices are two_level's: 20 steps end at two_level's parameters, up to float
  reassociation, every device of a node holding its own slice and every node the same."""
  got, state, metrics = train(METHODS[name], sliced=True, steps=20)
  want, _, _ = train(METHODS[name], sliced=False, steps=20)
  for key in PARAMS:
    np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6)
  assert not np.allclose(got["w1"], PARAMS["w1"])  # it trained
  # A leaf is held sliced: each device one row of the node's slices, the nodes alike.
  leaf = state.params.slices["w1"]
  assert leaf.shape == (LOCAL, 1, 14)
  assert {tuple(s.data.shape) for s in leaf.addressable_shards} == {(1, 1, 14)}
  by_row = {}
  for shard in leaf.addressable_shards:
    by_row.setdefault(shard.index[0].start, []).append(np.asarray(shard.data))
  assert all(len(copies) == NODES and all(np.array_equal(c, copies[0]) for c in copies)
             for copies in by_row.values())
  assert float(metrics["bytes_sent"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lags", "topk", "gtopk", "dlgs-owners", "terngrad", "dgc"])
def test_every_method_trains_sliced_as_two_level_does(name):
  got, _, _ = train(METHODS[name], sliced=True, steps=20)
  want, _, _ = train(METHODS[name], sliced=False, steps=20)
  for key in PARAMS:
    np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6)


def test_nothing_is_lost_on_the_slices():
  """One step of plain SGD (lr 1): the update is the mean over the N·L workers of what was
  sent, and P·update + L·Σ new residuals == Σ gradients (residuals start at zero)."""
  devices = jax.devices()[:NODES * LOCAL]
  mesh = jax.make_mesh((NODES, LOCAL), ("data", "fsdp"), devices=devices)
  tx = optax.chain(dlgs_jax.topk(0.2, axis_name="data"), optax.sgd(1.0))
  dp = dlgs_jax.data_parallel(loss_fn, tx, mesh, fsdp_axis="fsdp")
  state = dp.init(PARAMS)
  batch = batches(1)[0]
  new, _ = dp.step(state, jax.device_put(batch, dp.batch_sharding))
  update = {k: PARAMS[k] - v for k, v in dp.whole_params(new).items()}
  # Every worker's gradient of its rows of the batch, summed.
  rows = np.split(np.arange(16), NODES * LOCAL)
  grads = [jax.grad(loss_fn)(PARAMS, (batch[0][r], batch[1][r])) for r in rows]
  total = sum(float(np.sum(g[k])) for g in grads for k in PARAMS)
  node = next(n for n in jax.tree_util.tree_leaves(new.opt_state, is_leaf=is_per_worker)
              if is_per_worker(n))
  kept = sum(float(np.sum(np.asarray(x))) for x in jax.tree_util.tree_leaves(
      leaf_residuals(node)))
  sent = sum(float(np.sum(u)) for u in update.values())
  assert NODES * LOCAL * sent + LOCAL * kept == pytest.approx(total, rel=1e-4, abs=1e-4)
  assert kept != 0  # something stayed behind


@pytest.mark.parametrize("kwargs, message", [
    ({"fsdp_axis": "model"}, "fsdp_axis 'model' is not an axis of the mesh"),
    ({"fsdp_axis": "fsdp", "axis_name": ("data", "fsdp")}, "is also a data axis"),
])
def test_bad_fsdp_axes_are_named(kwargs, message):
  mesh = jax.make_mesh((NODES, LOCAL), ("data", "fsdp"), devices=jax.devices()[:8])
  with pytest.raises(ValueError, match=message):
    dlgs_jax.data_parallel(loss_fn, dlgs_jax.dense(axis_name="data"), mesh, **kwargs)


def _state_bytes(dp, params, batch):
  """Per-device bytes of the step's state, from the compiled program (`DataParallel.memory`)."""
  return dp.memory(dp.init(params), jax.device_put(batch, dp.batch_sharding))["state"]


@pytest.mark.parametrize("local", [2, 4, 8])
def test_a_device_holds_a_slice_of_the_replicated_state(local):
  """Parameters, momentum and residuals: 1/fsdp of what a replicated DLGS holds, within
  10% (the compiled program's memory analysis; the statistics and padding are the rest)."""
  params = {"w1": np.ones((96, 128), np.float32), "w2": np.ones((128, 40), np.float32)}
  batch = (np.ones((32, 96), np.float32), np.ones((32, 40), np.float32))

  def loss(p, b):
    return jnp.mean((jnp.tanh(b[0] @ p["w1"]) @ p["w2"] - b[1]) ** 2)

  def chain(axis):
    return optax.chain(dlgs_jax.dlgs(0.05, axis_name=axis), optax.sgd(0.1, momentum=0.9))

  devices = jax.devices()[:8]
  flat = dlgs_jax.data_parallel(loss, chain("data"), jax.make_mesh((8,), ("data",),
                                                                    devices=devices))
  sliced = dlgs_jax.data_parallel(
      loss, chain("data"), jax.make_mesh((8 // local, local), ("data", "fsdp"),
                                         devices=devices), fsdp_axis="fsdp")
  replicated, held = _state_bytes(flat, params, batch), _state_bytes(sliced, params, batch)
  assert replicated > 3 * 4 * (96 * 128 + 128 * 40)  # parameters, momentum, residuals
  assert held == pytest.approx(replicated / local, rel=0.10)


def test_an_nnx_module_trains_sliced_and_comes_back_whole():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.hidden, self.out = nnx.Linear(6, 9, rngs=rngs), nnx.Linear(9, 3, rngs=rngs)

    def __call__(self, x):
      return self.out(jnp.tanh(self.hidden(x)))

  mesh = jax.make_mesh((NODES, LOCAL), ("data", "fsdp"), devices=jax.devices()[:8])
  tx = optax.chain(dlgs_jax.dlgs(0.2, axis_name="data"), optax.sgd(0.1))
  dp = dlgs_jax.data_parallel(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), tx, mesh,
                              fsdp_axis="fsdp")
  model = Net(nnx.Rngs(0))
  before = np.asarray(model.hidden.kernel[...])
  state = dp.init(model)
  losses = []
  batch = jax.device_put(batches(1)[0], dp.batch_sharding)
  for _ in range(5):  # one batch again and again: its loss falls
    state, metrics = dp.step(state, batch)
    losses.append(float(metrics["loss"]))
  trained = dp.module(state)
  assert trained.hidden.kernel[...].shape == (6, 9) and losses[-1] < losses[0]
  assert not np.allclose(np.asarray(trained.hidden.kernel[...]), before)
