"""Optimizer state moved onto another worker count: the residual mass is kept."""

import jax
import numpy as np
import optax
import pytest

import dlgs_jax
from dlgs_jax.compress.state import is_per_worker, leaf_residuals, with_leaf_residuals
from dlgs_jax.training.persistence import reshard


def per_worker_state(workers, rng):
  params = {"w": np.zeros((6, 4), np.float32), "b": np.zeros((4,), np.float32)}
  state = dlgs_jax.dlgs(0.25).init(params)
  rows = lambda x, f: np.stack([f(i, np.asarray(x)) for i in range(workers)])  # noqa: E731
  residuals = {k: rows(v, lambda i, x: rng.standard_normal(x.shape).astype(np.float32))
               for k, v in leaf_residuals(state).items()}
  thresholds = tuple(rows(v, lambda i, x: np.full(x.shape, i + 1, np.float32))
                     for v in state.thresholds)
  stats = state.stats._replace(selected=rows(state.stats.selected, lambda i, x: x + i))
  state = with_leaf_residuals(state, residuals)
  return state._replace(count=rows(state.count, lambda i, x: x + 7),
                        residuals=tuple(np.asarray(r) for r in state.residuals),
                        thresholds=thresholds,
                        stats=type(stats)(*[rows(f, lambda i, x: x) if j not in (2, 7) else f
                                            for j, f in enumerate(stats)]))


@pytest.mark.parametrize("old, new", [(2, 4), (4, 2), (3, 1), (2, 2)])
def test_the_residual_mass_is_kept_and_shared_values_stay(old, new):
  state = per_worker_state(old, np.random.default_rng(old))
  row = reshard.redistribute(state, new)
  kept = leaf_residuals(row)
  for key, e in leaf_residuals(state).items():
    # What the updates still owe: sum_w e_w / P, before and after.
    np.testing.assert_allclose(new * kept[key] / new, e.sum(0) / old, rtol=1e-6)
    np.testing.assert_allclose(new * kept[key], e.sum(0) * new / old, rtol=1e-6)
  assert int(row.count) == 7  # the same on every worker: kept
  for t in row.thresholds:
    np.testing.assert_allclose(t, np.mean(np.arange(1, old + 1)))
  np.testing.assert_array_equal(row.stats.selected, state.stats.selected[0])


def test_a_leaf_without_a_worker_axis_or_no_workers_are_refused():
  with pytest.raises(ValueError, match="has no worker axis"):
    reshard.redistribute(dlgs_jax.dlgs(0.25).init({"w": np.zeros(3, np.float32)}), 2)
  with pytest.raises(ValueError, match="workers must be >= 1"):
    reshard.redistribute({}, 0)


def test_replicated_parts_of_a_chain_are_kept_as_they_are():
  """Only this library's states carry a worker axis; an optax momentum is replicated."""
  rng = np.random.default_rng(0)
  trace = {"w": rng.standard_normal((6, 4)).astype(np.float32),
           "b": rng.standard_normal(4).astype(np.float32)}
  chain_state = (per_worker_state(3, rng), {"trace": trace})
  row = reshard.redistribute(chain_state, 2)
  assert all(row[1]["trace"][k] is trace[k] for k in trace)
  np.testing.assert_allclose(leaf_residuals(row[0])["w"],
                             leaf_residuals(chain_state[0])["w"].sum(0) / 3, rtol=1e-6)


PARAMS = {"w": np.zeros((6, 5), np.float32), "b": np.zeros((3,), np.float32)}


def exchange_state(workers, fast, rng, budget="layer"):
  """A chain (DLGS [in two levels], SGD momentum) with random per-worker residuals."""
  make = lambda axis: dlgs_jax.dlgs(0.25, axis_name=axis, budget=budget)  # noqa: E731
  tx = (make("data") if fast == 1 else
        dlgs_jax.two_level(make, fast_axis="local", slow_axis="node", fast_size=fast))
  chain = optax.chain(tx, optax.sgd(0.1, momentum=0.9))
  state = jax.tree_util.tree_map(np.asarray, chain.init(PARAMS))

  def per_worker(x):
    return np.stack([np.asarray(x)] * workers)

  state = jax.tree_util.tree_map(
      lambda node: jax.tree_util.tree_map(per_worker, node) if is_per_worker(node) else node,
      state, is_leaf=is_per_worker)
  inner = state[0].inner if fast > 1 else state[0]
  inner = with_leaf_residuals(inner, {k: rng.standard_normal(v.shape).astype(np.float32)
                                      for k, v in leaf_residuals(inner).items()})
  inner = inner._replace(thresholds=tuple(
      np.broadcast_to(np.arange(1, workers + 1, dtype=np.float32)[:, None], t.shape)
      for t in inner.thresholds))
  compressor = state[0]._replace(inner=inner) if fast > 1 else inner
  trace = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in PARAMS.items()}
  momentum = (state[1][0]._replace(trace=trace),) + tuple(state[1][1:])
  return (compressor, momentum)


def owed(state, fast):
  """NumPy: what each leaf's residuals still put into the updates (the mean over nodes of
  each node's slices laid end to end; flat: the mean over workers)."""
  inner = state[0].inner if fast > 1 else state[0]
  out = {}
  for key, e in leaf_residuals(inner).items():
    size, shape = PARAMS[key].size, PARAMS[key].shape
    if fast == 1:
      out[key] = e.astype(np.float64).mean(0)
    else:
      nodes = e.shape[0] // fast
      laid = [np.concatenate([e[n * fast + j].reshape(-1) for j in range(fast)])[:size]
              for n in range(nodes)]
      out[key] = np.mean(laid, axis=0).reshape(shape)
  return out


@pytest.mark.parametrize("old, new", [((2, 2), (4, 1)), ((4, 1), (2, 2)), ((2, 2), (1, 4)),
                                      ((1, 4), (4, 2)), ((3, 1), (2, 1))])
def test_another_exchange_gets_the_same_owed_mass_and_keeps_the_momentum(old, new):
  """(nodes, devices per node); 1 device per node: flat."""
  rng = np.random.default_rng(sum(old) + 3 * sum(new))
  saved = exchange_state(old[0] * old[1], old[1], rng)
  target = exchange_state(new[0] * new[1], new[1], np.random.default_rng(99))
  moved = reshard.change_exchange(saved, target, PARAMS, old[1], new[1])
  before, after = owed(saved, old[1]), owed(moved, new[1])
  for key in PARAMS:
    np.testing.assert_allclose(after[key], before[key], rtol=1e-6, atol=1e-7)
  inner = moved[0].inner if new[1] > 1 else moved[0]
  workers = new[0] * new[1]
  assert all(v.shape[0] == workers for v in inner.residuals)
  # Thresholds differ per worker: their mean, on every new worker.
  mean = np.mean(np.arange(1, old[0] * old[1] + 1))
  assert all(np.all(v == np.float32(mean)) for v in inner.thresholds)
  for key in PARAMS:  # the replicated momentum is the saved one
    np.testing.assert_array_equal(moved[1][0].trace[key], saved[1][0].trace[key])


@pytest.mark.parametrize("old, new", [((2, 1), (4, 1)), ((2, 1), (2, 2))])
def test_a_messages_one_threshold_moves_with_its_leaves(old, new):
  """DLGS's message budget keeps one threshold per message: it moves as the leaves'."""
  rng = np.random.default_rng(5)
  saved = exchange_state(old[0] * old[1], old[1], rng, budget="message")
  target = exchange_state(new[0] * new[1], new[1], np.random.default_rng(9), budget="message")
  moved = reshard.change_exchange(saved, target, PARAMS, old[1], new[1])
  before, after = owed(saved, old[1]), owed(moved, new[1])
  for key in PARAMS:
    np.testing.assert_allclose(after[key], before[key], rtol=1e-6, atol=1e-7)
  inner = moved[0].inner if new[1] > 1 else moved[0]
  mean = np.mean(np.arange(1, old[0] * old[1] + 1))
  assert [v.shape for v in inner.thresholds] == [(new[0] * new[1], 1)] * len(inner.thresholds)
  assert all(np.all(v == np.float32(mean)) for v in inner.thresholds)


def test_an_exchange_is_read_from_the_run_identity():
  assert reshard.nodes_of("flat") is None
  assert reshard.nodes_of("two-level 3x8") == (3, 8)
  with pytest.raises(ValueError, match="unknown exchange 'ring 2x2'"):
    reshard.nodes_of("ring 2x2")
  saved = exchange_state(4, 1, np.random.default_rng(0))
  with pytest.raises(ValueError, match=r"transforms \['DLGSState'\] are not this run's \[\]"):
    reshard.change_exchange(saved, ({}, saved[1]), PARAMS, 1, 1)


def _sliced_run(nodes, local, params):
  """A data-parallel step of DLGS + momentum with parameters sliced over `local` devices."""
  import jax.numpy as jnp

  def loss(p, b):
    return jnp.mean((jnp.tanh(b[0] @ p["w1"]) @ p["w2"] - b[1]) ** 2)

  mesh = jax.make_mesh((nodes, local), ("data", "fsdp"), devices=jax.devices()[:nodes * local])
  tx = optax.chain(dlgs_jax.dlgs(0.2, axis_name="data", thresholds=dlgs_jax.AdaptedReuse(3)),
                   optax.sgd(0.1, momentum=0.9))
  return dlgs_jax.data_parallel(loss, tx, mesh, fsdp_axis="fsdp"), mesh


@pytest.mark.parametrize("old, new", [((2, 4), (2, 2)), ((2, 4), (4, 2)), ((2, 2), (1, 8))])
def test_sliced_parameters_move_to_another_node_size_whole_and_with_their_mass(
    tmp_path, old, new):
  """Saved on N x L devices, resumed on N' x L': the parameters and the momentum whole as
  they were, the residuals' mass (sum over nodes / N) kept, and the run goes on."""
  from dlgs_jax.compress.state import leaf_residuals
  from dlgs_jax.training.persistence import checkpoint
  from dlgs_jax.workload import fsdp, parallel, sharded_step

  rng = np.random.default_rng(0)
  params = {"w1": rng.standard_normal((5, 7)).astype(np.float32),
            "w2": rng.standard_normal((7, 3)).astype(np.float32)}
  batch = (rng.standard_normal((8, 5)).astype(np.float32),
           rng.standard_normal((8, 3)).astype(np.float32))
  dp, _ = _sliced_run(*old, params)
  state = dp.init(params)
  for _ in range(2):
    state, _ = dp.step(state, jax.device_put(batch, dp.batch_sharding))
  ckpt = checkpoint.Checkpointer(tmp_path, {"run": 1}, asynchronous=False)
  ckpt.save(2, state, data_position={"epoch": 0, "batch": 2})
  saved, _ = ckpt.restore(dp.init(params))
  saved = parallel.fetch(saved)

  dp2, mesh2 = _sliced_run(*new, params)
  target = parallel.fetch(dp2.init(params))
  moved = reshard.change_fsdp(saved, target)
  assert jax.tree_util.tree_structure(moved) == jax.tree_util.tree_structure(target)
  for a, b in zip(jax.tree_util.tree_leaves(moved), jax.tree_util.tree_leaves(target)):
    assert np.shape(a) == np.shape(b)
  for key, x in fsdp.whole(moved.params).items():
    np.testing.assert_array_equal(x, fsdp.whole(saved.params)[key])
  momentum = lambda s, size: {k: v.reshape(-1)[:params[k].size]  # noqa: E731
                              for k, v in s.opt_state[1][0].trace.items()}
  for key in params:
    np.testing.assert_array_equal(momentum(moved, new[1])[key], momentum(saved, old[1])[key])

  def mass(s, nodes, local):
    out = {}
    for path, rows in leaf_residuals(s.opt_state[0]).items():
      laid = np.asarray(rows, np.float64).reshape(nodes, -1)[:, :params[path].size]
      out[path] = laid.sum(0) / nodes
    return out
  for key, m in mass(saved, *old).items():
    np.testing.assert_allclose(mass(moved, *new)[key], m, rtol=1e-6, atol=1e-7)
  assert any(np.any(m != 0) for m in mass(saved, *old).values())
  resumed = sharded_step.place_sliced(moved, mesh2, "fsdp")
  after, metrics = dp2.step(resumed, jax.device_put(batch, dp2.batch_sharding))
  assert np.isfinite(float(metrics["loss"])) and int(after.step) == 3
