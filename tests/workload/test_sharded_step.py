"""The data-parallel step: shard_map's checks on, per-worker gradients, Linen, NNX and pytrees."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import dlgs_jax
from dlgs_jax.workload import parallel

W = 4
RNG = np.random.default_rng(0)
X = RNG.standard_normal((W * 6, 5)).astype(np.float32)
Y = RNG.standard_normal((W * 6, 3)).astype(np.float32)
PARAMS = {"w": RNG.standard_normal((5, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}


def mesh():
  return jax.make_mesh((W,), ("data",), devices=jax.devices()[:W])


def squared_error(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


COMPRESSORS = {
    "dense": lambda: dlgs_jax.dense(axis_name="data"),
    "dlgs": lambda: dlgs_jax.dlgs(0.3, axis_name="data"),
    "lags": lambda: dlgs_jax.lags(0.3, axis_name="data"),
    "topk": lambda: dlgs_jax.topk(0.3, axis_name="data"),
    "gtopk": lambda: dlgs_jax.gtopk(0.3, axis_name="data"),
    "dgc": lambda: dlgs_jax.dgc(0.3, axis_name="data"),
    "terngrad": lambda: dlgs_jax.terngrad(axis_name="data"),
}


def docs_style_step(tx, grad_at):
  """The step JAX's docs teach, with the worker axis of the library's state handled."""
  def step(params, opt_state, x, y):
    grads = jax.grad(squared_error)(grad_at(params), (x, y))
    updates, opt_state = tx.update(grads, dlgs_jax.squeeze_state(opt_state), params)
    return optax.apply_updates(params, updates), dlgs_jax.unsqueeze_state(opt_state)
  return step


def run_docs_style(tx, params, grad_at=lambda p: lax.pcast(p, "data", to="varying"),
                   state_specs=None):
  m = mesh()
  opt_state = dlgs_jax.init_per_worker(tx, params, m)
  specs = dlgs_jax.state_specs(opt_state, "data") if state_specs is None else state_specs
  fn = jax.jit(jax.shard_map(docs_style_step(tx, grad_at), mesh=m,
                             in_specs=(P(), specs, P("data"), P("data")),
                             out_specs=(P(), specs)))
  batch = jax.device_put((X.astype(params["w"].dtype), Y.astype(params["w"].dtype)),
                         NamedSharding(m, P("data")))
  return fn(dlgs_jax.workload.parallel.replicate(params, m), opt_state, *batch)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_the_docs_style_step_compiles_with_the_checks_on(name, dtype):
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), PARAMS)
  tx = optax.chain(COMPRESSORS[name](), optax.sgd(0.1, momentum=0.9))
  new_params, _ = run_docs_style(tx, params)
  # out_specs P() was accepted: JAX proved the parameters replicated. They moved.
  assert new_params["w"].dtype == dtype
  assert not np.array_equal(np.asarray(new_params["w"], np.float32),
                            np.asarray(params["w"], np.float32))


def test_dense_in_the_docs_style_step_is_sgd_on_the_mean_gradient():
  tx = optax.chain(dlgs_jax.dense(axis_name="data"), optax.sgd(0.1))
  new_params, _ = run_docs_style(tx, PARAMS)
  per_worker = [jax.grad(squared_error)(PARAMS, (X[i * 6:(i + 1) * 6], Y[i * 6:(i + 1) * 6]))
                for i in range(W)]
  for key in PARAMS:
    mean = np.mean([np.asarray(g[key]) for g in per_worker], axis=0)
    np.testing.assert_allclose(new_params[key], PARAMS[key] - 0.1 * mean, rtol=1e-5, atol=1e-6)


def test_gradients_jax_already_summed_are_refused():
  tx = dlgs_jax.dlgs(0.3, axis_name="data")
  with pytest.raises(ValueError, match=r"gradient leaf '(b|w)' is typed replicated over "
                                       r"'data'.*lax.pcast"):
    run_docs_style(tx, PARAMS, grad_at=lambda p: p)


def test_a_state_given_replicated_is_refused_naming_the_fix():
  tx = optax.chain(dlgs_jax.dlgs(0.3, axis_name="data"), optax.sgd(0.1))
  m = mesh()
  opt_state = dlgs_jax.workload.parallel.replicate(tx.init(PARAMS), m)

  def step(params, opt_state, x, y):
    grads = jax.grad(squared_error)(lax.pcast(params, "data", to="varying"), (x, y))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  fn = jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(), P(), P("data"), P("data")),
                             out_specs=(P(), P())))
  batch = jax.device_put((X, Y), NamedSharding(m, P("data")))
  with pytest.raises(ValueError, match="optimizer state is typed replicated.*init_per_worker"):
    fn(dlgs_jax.workload.parallel.replicate(PARAMS, m), opt_state, *batch)


def test_a_forgotten_axis_name_is_named_with_the_fix():
  """Without the collective the updates would differ per worker: refused before JAX's check."""
  tx = optax.chain(dlgs_jax.dlgs(0.3), optax.sgd(0.1))
  with pytest.raises(ValueError, match="built with axis_name=None, so it would never "
                     "communicate: build it with axis_name='data'"):
    run_docs_style(tx, PARAMS)


def test_a_state_left_with_its_worker_axis_is_named():
  tx = dlgs_jax.dlgs(0.3, axis_name="data")
  state = tx.init(PARAMS)
  # Each worker's state still holds the worker axis (size 1) that placement adds.
  stacked = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (W, 1) + x.shape), state)
  grads = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (W,) + x.shape), PARAMS)
  with pytest.raises(ValueError, match="drop it inside with dlgs_jax.squeeze_state"):
    jax.vmap(tx.update, axis_name="data")(grads, stacked)


def test_state_specs_and_placement_split_the_chain():
  m = mesh()
  tx = optax.chain(dlgs_jax.dlgs(0.3, axis_name="data"), optax.sgd(0.1, momentum=0.9))
  state = dlgs_jax.init_per_worker(tx, PARAMS, m)
  specs = dlgs_jax.state_specs(state, "data")
  assert state[0].residuals[0].shape == (W, 64)  # "w" and "b", each padded to 32 values
  assert specs[0].residuals[0] == P("data")
  assert state[1][0].trace["w"].shape == (5, 3)  # the momentum: replicated
  assert specs[1][0].trace["w"] == P()


# --- data_parallel -------------------------------------------------------------------------


def test_data_parallel_names_a_transform_on_another_axis_before_any_step_runs():
  tx = optax.chain(dlgs_jax.dlgs(0.3, axis_name="batch"), optax.sgd(0.1))
  dp = dlgs_jax.data_parallel(squared_error, tx, mesh())
  state = dp.init(PARAMS)
  batch = jax.device_put((X, Y), dp.batch_sharding)
  with pytest.raises(ValueError, match=r"axis_name 'batch' is not an axis this update runs "
                     r"under \(mapped here: \['data'\]\): .* axis_name='data'"):
    dp.compile(state, batch)


def test_data_parallel_on_cpu_waits_for_every_sixteenth_step():
  from dlgs_jax.workload import sharded_step

  tx = optax.chain(dlgs_jax.gtopk(0.3, axis_name="data"), optax.sgd(0.1))
  dp = dlgs_jax.data_parallel(squared_error, tx, mesh())
  assert dp.sync_every == sharded_step.CPU_SYNC_EVERY == 16
  state = dp.init(PARAMS)
  batch = jax.device_put((X, Y), dp.batch_sharding)
  waited = []
  real = jax.block_until_ready
  try:
    jax.block_until_ready = lambda x: waited.append(x) or real(x)
    for _ in range(2 * dp.sync_every + 3):
      state, metrics = dp.step(state, batch)
  finally:
    jax.block_until_ready = real
  assert len(waited) == 2 and all(m["loss"].is_ready() for m in waited)


def test_data_parallel_dense_matches_a_numpy_reference_over_steps():
  m = mesh()
  tx = optax.chain(dlgs_jax.dense(axis_name="data"), optax.sgd(0.05))
  dp = dlgs_jax.data_parallel(squared_error, tx, m)
  state = dp.init(PARAMS)
  batch = jax.device_put((X, Y), dp.batch_sharding)
  ref = {k: v.astype(np.float64) for k, v in PARAMS.items()}
  for _ in range(3):
    state, metrics = dp.step(state, batch)
    grads = [jax.grad(squared_error)(jax.tree_util.tree_map(np.float32, ref),
                                     (X[i * 6:(i + 1) * 6], Y[i * 6:(i + 1) * 6]))
             for i in range(W)]
    ref = {k: ref[k] - 0.05 * np.mean([np.asarray(g[k]) for g in grads], axis=0) for k in ref}
  for key in PARAMS:
    np.testing.assert_allclose(dlgs_jax.fetch(state.params)[key], ref[key], rtol=1e-4, atol=1e-6)
  assert int(state.step) == 3
  assert float(metrics["bytes_sent"]) == dlgs_jax.compress.wire.allreduce_bytes(15 + 3, W)


def test_a_compiled_step_runs_without_compiling_again_and_gives_the_same_steps():
  m = mesh()
  compiles = []

  def listen(event, seconds, **_):
    if event.endswith("backend_compile_duration"):
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    results = [run_steps_compiled_first(m, precompile, compiles) for precompile in (True, False)]
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  for key in PARAMS:
    np.testing.assert_array_equal(results[0][key], results[1][key])


def run_steps_compiled_first(m, precompile, compiles):
  """Three DLGS steps; with `precompile`, compiled by `compile` first and none compiled after."""
  tx = optax.chain(dlgs_jax.dlgs(0.3, axis_name="data"), optax.sgd(0.05))
  dp = dlgs_jax.data_parallel(squared_error, tx, m)
  state = dp.init(PARAMS)
  batch = jax.device_put((X, Y), dp.batch_sharding)
  if precompile:
    dp.compile(state, batch)
    compiled = len(compiles)
    assert compiled >= 1
  for _ in range(3):
    state, _ = dp.step(state, batch)
  if precompile:
    assert len(compiles) == compiled  # the steps ran the compiled program
  return dlgs_jax.fetch(state.params)


def count(jaxpr_text, primitive):
  return len(re.findall(rf" {primitive}(_invariant)?\[", jaxpr_text))


def test_micro_batches_accumulate_and_communicate_once():
  m = mesh()
  tx = optax.chain(dlgs_jax.dlgs(0.3, axis_name="data"), optax.sgd(0.05))
  batch = jax.device_put((X, Y), NamedSharding(m, P("data")))
  results = {}
  for parts in (1, 3):
    dp = dlgs_jax.data_parallel(squared_error, tx, m, micro_batches=parts)
    state, metrics = dp.step(dp.init(PARAMS), batch)
    results[parts] = (dlgs_jax.fetch(state.params), metrics)
  for key in PARAMS:  # mean of equal slices' gradients == the gradient of their union
    np.testing.assert_allclose(results[3][0][key], results[1][0][key], rtol=1e-5, atol=1e-6)
  assert float(results[3][1]["bytes_sent"]) == float(results[1][1]["bytes_sent"])
  dp = dlgs_jax.data_parallel(squared_error, tx, m, micro_batches=3)
  state = dp.init(PARAMS)
  text = str(jax.make_jaxpr(lambda s, b: dp.step(s, b))(state, batch))
  assert count(text, "all_gather") == 1  # one bucket's message, once per step
  with pytest.raises(ValueError, match="micro_batches=4 does not divide a worker's batch of 6"):
    dlgs_jax.data_parallel(squared_error, tx, m, micro_batches=4).step(dp.init(PARAMS), batch)
  # A batch that does not split over the workers: named before shard_map sees it.
  workers, rows = m.size, len(X) - 1
  message = (rf"^a batch leaf of shape \({rows}, \d+\) does not split over the {workers} "
             rf"workers: give every leaf a leading \(batch\) axis of a multiple of {workers}")
  for run in (dp.step, dp.compile):
    with pytest.raises(ValueError, match=message):
      run(state, (X[:-1], Y[:-1]))


@pytest.mark.parametrize("kwargs, message", [
    ({"micro_batches": 0}, "micro_batches must be an integer >= 1, got 0"),
    ({"axis_name": "model"}, "axis_name 'model' is not an axis of the mesh"),
    ({"seed": "one"}, "seed must be an integer or None, got 'one'"),
    ({"model_state": True}, r"loss_fn 'squared_error' must take \(params, model_state, batch\)"),
])
def test_bad_arguments_are_refused_before_any_work(kwargs, message):
  with pytest.raises(ValueError, match=message):
    dlgs_jax.data_parallel(squared_error, dlgs_jax.dense(axis_name="data"), mesh(), **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"simulate_workers": 0}, "simulate_workers must be an integer >= 1, got 0"),
    ({"simulate_workers": 2.0}, "simulate_workers must be an integer >= 1, got 2.0"),
    ({"simulate_workers": 4, "on": 4}, r"simulate_workers=4 runs every worker on one device, "
     r"but the mesh has 4 devices on axes \('data',\): give parallel.data_mesh\(1\)"),
])
def test_bad_simulated_workers_are_refused_before_any_work(kwargs, message):
  devices = kwargs.pop("on", 1)
  with pytest.raises(ValueError, match=message):
    dlgs_jax.data_parallel(squared_error, dlgs_jax.dense(axis_name="data"),
                           dlgs_jax.data_mesh(devices), **kwargs)


class NormedNet(nn.Module):
  """LinenNet without the bias ahead of BatchNorm, whose gradient is rounding noise
  alone (and so would be selected by chance)."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(8, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    return nn.Dense(3)(nn.relu(x))


@pytest.mark.parametrize("name", ["dlgs", "gtopk", "terngrad"])
def test_simulated_workers_on_one_device_match_as_many_devices(name):
  """P workers under vmap on one device: the same batches, keys, BatchNorm statistics,
  residuals and exchange as P devices, so after 20 steps the same parameters and
  per-worker states (gTop-k's pairwise rounds and TernGrad's per-worker keys too)."""
  model = NormedNet()
  variables = model.init(jax.random.key(0), X[:2], train=False)

  def loss_fn(params, batch_stats, batch, key):
    x, y = batch
    x = x + 0.1 * jax.random.normal(key, x.shape)  # a key per step and worker
    out, updates = model.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                               mutable=["batch_stats"])
    return jnp.mean((out - y) ** 2), (updates["batch_stats"], {"first": out[0, 0]})

  ends = []
  for m, simulated in ((mesh(), None), (dlgs_jax.data_mesh(1), W)):
    tx = optax.chain(COMPRESSORS[name](), optax.sgd(0.05, momentum=0.9))
    dp = dlgs_jax.data_parallel(loss_fn, tx, m, model_state=True, has_aux=True, seed=3,
                                simulate_workers=simulated)
    state = dp.init(variables["params"], variables["batch_stats"])
    assert dp.sync_every is None or simulated is None
    history = []
    for step in range(20):
      rows = np.roll(np.arange(len(X)), 5 * step)
      state, metrics = dp.step(state, jax.device_put((X[rows], Y[rows]), dp.batch_sharding))
      history.append({k: float(v) for k, v in metrics.items()})
    ends.append((dlgs_jax.fetch(state), history))
  (real, real_metrics), (simulated, simulated_metrics) = ends
  assert jax.tree_util.tree_structure(real) == jax.tree_util.tree_structure(simulated)
  for a, b in zip(jax.tree_util.tree_leaves(real), jax.tree_util.tree_leaves(simulated)):
    assert a.shape == b.shape  # per-worker states keep a row per worker
    # vmap batches each worker's matrix products into one, which XLA may round
    # in another order, and 20 steps of momentum carry it: float leaves agree to
    # 1e-4, counts exactly.
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert real_metrics[-1]["bytes_sent"] > 0
  for a, b in zip(real_metrics, simulated_metrics):
    assert a.keys() == b.keys()
    np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-5, atol=1e-6)


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    return nn.Dense(3)(nn.relu(x))


def test_linen_batch_stats_are_averaged_over_workers():
  m = mesh()
  model = LinenNet()
  variables = model.init(jax.random.key(0), X[:2], train=False)

  def loss_fn(params, batch_stats, batch):
    x, y = batch
    out, updates = model.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                               mutable=["batch_stats"])
    return jnp.mean((out - y) ** 2), (updates["batch_stats"], {"first": out[0, 0]})

  tx = optax.chain(dlgs_jax.lags(0.5, axis_name="data"), optax.sgd(0.01))
  dp = dlgs_jax.data_parallel(loss_fn, tx, m, model_state=True, has_aux=True)
  state = dp.init(variables["params"], variables["batch_stats"])
  state, metrics = dp.step(state, jax.device_put((X, Y), dp.batch_sharding))
  expected = np.mean([np.asarray(loss_fn(variables["params"], variables["batch_stats"],
                                         (X[i * 6:(i + 1) * 6], Y[i * 6:(i + 1) * 6]))[1][0]
                                 ["BatchNorm_0"]["mean"]) for i in range(W)], axis=0)
  np.testing.assert_allclose(dlgs_jax.fetch(state.model_state)["BatchNorm_0"]["mean"], expected,
                             rtol=1e-5, atol=1e-7)
  assert set(metrics) >= {"loss", "first", "bytes_sent", "selected", "passed"}
  assert float(metrics["passed"]) >= float(metrics["selected"]) > 0


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(5, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.norm(self.hidden(x))))


@pytest.mark.slow
def test_nnx_split_merge_step_updates_and_averages_its_state():
  m = mesh()
  graphdef, params, rest = nnx.split(NNXNet(nnx.Rngs(0)), nnx.Param, ...)

  def loss_fn(params, rest, batch):
    model = nnx.merge(graphdef, params, rest, copy=True)
    loss = jnp.mean((model(batch[0]) - batch[1]) ** 2)
    return loss, nnx.split(model, nnx.Param, ...)[2]

  order = dlgs_jax.backward_order(loss_fn, params, rest, (X[:6], Y[:6]), has_aux=True)
  assert dlgs_jax.output_layer(order) == ["head/bias/value", "head/kernel/value"]
  tx = optax.chain(dlgs_jax.dlgs(0.3, axis_name="data", send_whole=dlgs_jax.output_layer(order),
                                 budget="layer"), optax.sgd(0.01))
  dp = dlgs_jax.data_parallel(loss_fn, tx, m, model_state=True)
  state = dp.init(params, rest)
  state, _ = dp.step(state, jax.device_put((X, Y), dp.batch_sharding))
  new_rest = dlgs_jax.fetch(state.model_state)
  assert not np.allclose(new_rest["norm"]["mean"][...], 0.0)
  model = nnx.merge(graphdef, dlgs_jax.fetch(state.params), new_rest)
  model.eval()
  assert model(X[:2]).shape == (2, 3)


def test_a_prng_key_in_the_model_state_is_refused():
  m = mesh()

  def loss_fn(params, model_state, batch):
    return squared_error(params, batch), model_state

  tx = dlgs_jax.dense(axis_name="data")
  dp = dlgs_jax.data_parallel(loss_fn, tx, m, model_state=True)
  state = dp.init(PARAMS)._replace(model_state={"rng": jax.random.key(0)})
  with pytest.raises(ValueError, match=r"PRNG key at \['rng'\].*give data_parallel a seed"):
    dp.step(state, jax.device_put((X, Y), dp.batch_sharding))


def test_multisteps_around_a_compressor_is_refused_with_the_way_to_accumulate():
  tx = optax.MultiSteps(optax.chain(dlgs_jax.dlgs(0.3, axis_name="data"), optax.sgd(0.1)), 4)
  with pytest.raises(ValueError, match="inside optax.MultiSteps.*micro_batches=k"):
    dlgs_jax.init_per_worker(tx, PARAMS, mesh())
  with pytest.raises(ValueError, match="inside optax.MultiSteps"):
    dlgs_jax.data_parallel(squared_error, tx, mesh()).init(PARAMS)
  # MultiSteps wrapping no compressor (here the optimizer after it) is not refused.
  after = optax.chain(dlgs_jax.dlgs(0.3, axis_name="data"), optax.MultiSteps(optax.sgd(0.1), 4))
  assert dlgs_jax.init_per_worker(after, PARAMS, mesh())[0].residuals[0].shape == (W, 64)


def test_a_node_mesh_puts_each_process_on_a_row():
  node = parallel.node_mesh()
  assert node.axis_names == ("node", "local")
  assert node.devices.shape == (jax.process_count(), jax.local_device_count())
  assert parallel.data_axes(node) == ("node", "local")
  assert parallel.data_axes(mesh()) == "data"


@pytest.mark.parametrize("node_size", [1, 2, 4, 8])
def test_a_node_mesh_cuts_the_devices_into_nodes_of_the_given_size(node_size):
  node = parallel.node_mesh(node_size)
  assert node.devices.shape == (8 // node_size, node_size)
  # Consecutive devices share a node: the order every other mesh uses, cut in rows.
  assert list(node.devices.flat) == jax.devices()


@pytest.mark.parametrize("node_size, message", [
    (3, "node_size 3 does not cut 1 processes of 8 devices into whole nodes"),
    (16, "node_size 16 does not cut"), (0, "node_size must be an integer >= 1, got 0"),
    (2.0, "node_size must be an integer >= 1, got 2.0")])
def test_a_node_size_that_does_not_cut_the_devices_is_named(node_size, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    parallel.node_mesh(node_size)


# --- NNX modules ---------------------------------------------------------------------------


class _MLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(5, 32, rngs=rngs)
    self.norm = nnx.BatchNorm(32, rngs=rngs)
    self.out = nnx.Linear(32, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.norm(self.hidden(x))))


def test_nnx_quickstart_trains_the_module_and_gives_it_back():
  # The quickstart: an NNX module, DLGS before AdamW, data_parallel over 4 workers.
  mesh = dlgs_jax.data_mesh(W)
  tx = optax.chain(dlgs_jax.dlgs(0.1, axis_name="data"), optax.adamw(1e-2))
  dp = dlgs_jax.data_parallel(lambda model, b: jnp.mean((model(b[0]) - b[1]) ** 2), tx, mesh)
  model = _MLP(nnx.Rngs(0))
  state = dp.init(model)
  batch = jax.device_put((X, Y), dp.batch_sharding)
  losses = []
  for _ in range(40):
    state, metrics = dp.step(state, batch)
    losses.append(float(metrics["loss"]))
  trained = dp.module(state)

  assert isinstance(trained, _MLP) and losses[-1] < 0.5 * losses[0]
  assert 0 < float(metrics["bytes_sent"]) < dlgs_jax.compress.wire.allreduce_bytes(
      sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))), W)
  np.testing.assert_array_equal(np.asarray(trained.out.kernel[...]),
                                np.asarray(dlgs_jax.fetch(state.params)["out"]["kernel"][...]))
  assert not np.allclose(np.asarray(trained.out.kernel[...]), np.asarray(model.out.kernel[...]))
  # BatchNorm statistics moved (averaged over the workers after each step).
  assert np.abs(np.asarray(trained.norm.mean[...])).max() > 0
  trained.eval()
  assert trained(X[:2]).shape == (2, 3)


class _Wide(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(5, 16, rngs=rngs)
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def _nnx_squared_error(model, batch):
  return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def test_the_step_object_declares_its_fields_and_nothing_is_rebound():
  dp = dlgs_jax.data_parallel(_nnx_squared_error, optax.chain(
      dlgs_jax.dense(axis_name="data"), optax.sgd(0.1)), dlgs_jax.data_mesh(W))
  fields = {f.name for f in dataclasses.fields(dp)}
  assert {"loss_fn", "tx", "mesh", "axis_name", "wrt", "programs", "dispatched"} <= fields
  assert dp.wrt is nnx.Param and dp.loss_fn is _nnx_squared_error
  with pytest.raises(dataclasses.FrozenInstanceError):
    dp.loss_fn = squared_error
  batch = jax.device_put((X, Y), dp.batch_sharding)
  state_a = dp.init(_MLP(nnx.Rngs(0)))
  # A second init, of another module, leaves what stepping the first state computes alone:
  # each state carries its own graph.
  state_b = dp.init(_Wide(nnx.Rngs(1)))
  assert dp.loss_fn is _nnx_squared_error
  fresh = dlgs_jax.data_parallel(_nnx_squared_error, dp.tx, dp.mesh)
  state_a, metrics_a = dp.step(state_a, batch)
  expected, metrics_fresh = fresh.step(fresh.init(_MLP(nnx.Rngs(0))), batch)
  np.testing.assert_array_equal(np.asarray(metrics_a["loss"]), np.asarray(metrics_fresh["loss"]))
  for got, want in zip(jax.tree_util.tree_leaves(dlgs_jax.fetch(state_a.params)),
                       jax.tree_util.tree_leaves(dlgs_jax.fetch(expected.params))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  state_b, _ = dp.step(state_b, batch)
  assert isinstance(dp.module(state_a), _MLP) and isinstance(dp.module(state_b), _Wide)
  # The jit cache and the steps dispatched are there to read: a program per module.
  assert len(dp.programs) == 2 and dp.dispatched == [2]


def test_wrt_chooses_what_the_gradient_and_the_optimizer_see():
  only_out = nnx.All(nnx.Param, nnx.PathContains("out"))
  dp = dlgs_jax.data_parallel(_nnx_squared_error, optax.chain(
      dlgs_jax.dlgs(0.5, axis_name="data"), optax.sgd(0.1)), dlgs_jax.data_mesh(W),
      wrt=only_out)
  model = _Wide(nnx.Rngs(0))
  state = dp.init(model)
  assert set(dlgs_jax.fetch(state.params)) == {"out"}
  batch = jax.device_put((X, Y), dp.batch_sharding)
  for _ in range(3):
    state, _ = dp.step(state, batch)
  trained = dp.module(state)
  # The hidden layer rode along as model state, untouched; the head moved.
  np.testing.assert_array_equal(np.asarray(trained.hidden.kernel[...]),
                                np.asarray(model.hidden.kernel[...]))
  assert not np.allclose(np.asarray(trained.out.kernel[...]), np.asarray(model.out.kernel[...]))


def test_nnx_mistakes_are_named_with_the_fix():
  mesh = dlgs_jax.data_mesh(W)
  tx = optax.chain(dlgs_jax.dlgs(0.1, axis_name="data"), optax.sgd(0.1))
  with_state = dlgs_jax.data_parallel(lambda p, s, b: (0.0, s), tx, mesh, model_state=True)
  with pytest.raises(ValueError, match="with an nnx.Module, leave model_state=False"):
    with_state.init(_MLP(nnx.Rngs(0)))
  plain = dlgs_jax.data_parallel(squared_error, tx, mesh)
  with pytest.raises(ValueError, match=r"module\(state\) needs a state that init made from an "
                     "nnx.Module"):
    plain.module(plain.init(PARAMS))


def _pair(params, batch):
  return squared_error(params, batch), {"rows": 1.0}


def _per_row(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2, axis=1)


@pytest.mark.parametrize("loss_fn, kwargs, message", [
    (_pair, {}, r"^_pair returned a tuple of 2: return the scalar loss, or give data_parallel "
                r"has_aux=True for \(loss, metrics\)"),
    (squared_error, {"has_aux": True}, r"^squared_error must return \(loss, metrics\) with "
                                       r"has_aux=True, got one float32\[\] value"),
    (lambda p, s, b: squared_error(p, b), {"model_state": True},
     r"^<lambda> must return \(loss, new_model_state\) with model_state=True, got one"),
    (_per_row, {}, r"^_per_row must return a scalar loss, got shape \(6,\): take its mean"),
])
def test_a_loss_of_the_wrong_shape_is_named_with_the_fix(loss_fn, kwargs, message):
  dp = dlgs_jax.data_parallel(loss_fn, optax.chain(dlgs_jax.dlgs(0.3, axis_name="data"),
                                                   optax.sgd(0.1)), mesh(), **kwargs)
  state = dp.init(PARAMS, {} if kwargs.get("model_state") else None)
  with pytest.raises(ValueError, match=message):
    dp.step(state, jax.device_put((X, Y), dp.batch_sharding))


@pytest.mark.parametrize("tx, where", [
    # The order reversed: Adam's moments are each worker's; without a compressor, the update.
    (optax.chain(optax.adam(1e-2), dlgs_jax.dlgs(0.3, axis_name="data")),
     r"optimizer state at \[0\]\[0\]\.mu"),
    (optax.adam(1e-2), "update at "),
])
def test_a_transform_that_sees_each_workers_gradient_is_named_with_the_fix(tx, where):
  dp = dlgs_jax.data_parallel(squared_error, tx, mesh())
  with pytest.raises(ValueError, match=rf"^the {where}\['(b|w)'\] differs "
                     r"between workers: no dlgs_jax transform averaged the gradients before "
                     r"it; put one first in the chain, e.g. optax.chain\(dlgs_jax.dlgs\(0.01, "
                     r"axis_name='data'\), optax.adamw\(1e-3\)\)"):
    dp.step(dp.init(PARAMS), jax.device_put((X, Y), dp.batch_sharding))


def test_linen_variables_given_whole_as_the_parameters_are_named_with_the_fix():
  dp = dlgs_jax.data_parallel(squared_error, optax.chain(dlgs_jax.dlgs(0.3, axis_name="data"),
                                                         optax.sgd(0.1)), mesh())
  variables = {"params": PARAMS, "batch_stats": {"mean": np.zeros(3, np.float32)}}
  with pytest.raises(ValueError, match=r"^init got Linen variables holding 'batch_stats' as the "
                     r"parameters: give data_parallel model_state=True and "
                     r"init\(variables\['params'\], variables\['batch_stats'\]\)"):
    dp.init(variables)
  assert dp.init({"params": PARAMS}).step == 0  # Linen's variables without statistics: fine


@pytest.mark.parametrize("workers", [0, 9])
def test_a_mesh_of_more_workers_than_devices_says_how_to_get_devices(workers):
  with pytest.raises(ValueError, match=rf"^num_workers={workers} but 8 devices are available: "
                     r"ask for 1 to 8 workers \(on CPU, XLA_FLAGS=--xla_force_host_platform_"
                     r"device_count=N before JAX starts"):
    dlgs_jax.data_mesh(workers)
