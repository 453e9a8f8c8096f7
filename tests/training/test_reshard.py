"""Optimizer state moved onto another worker count: the residual mass is kept."""

import numpy as np
import pytest

import dlgs_jax
from dlgs_jax.training import reshard


def per_worker_state(workers, rng):
  params = {"w": np.zeros((6, 4), np.float32), "b": np.zeros((4,), np.float32)}
  state = dlgs_jax.dlgs(0.25).init(params)
  rows = lambda x, f: np.stack([f(i, np.asarray(x)) for i in range(workers)])  # noqa: E731
  residuals = {k: rows(v, lambda i, x: rng.standard_normal(x.shape).astype(np.float32))
               for k, v in state.residuals.items()}
  thresholds = {k: rows(v, lambda i, x: np.float32(i + 1)) for k, v in state.thresholds.items()}
  stats = state.stats._replace(selected=rows(state.stats.selected, lambda i, x: x + i))
  return state._replace(count=rows(state.count, lambda i, x: x + 7), residuals=residuals,
                        thresholds=thresholds,
                        stats=type(stats)(*[rows(f, lambda i, x: x) if j != 2 else f
                                            for j, f in enumerate(stats)]))


@pytest.mark.parametrize("old, new", [(2, 4), (4, 2), (3, 1), (2, 2)])
def test_the_residual_mass_is_kept_and_shared_values_stay(old, new):
  state = per_worker_state(old, np.random.default_rng(old))
  row = reshard.redistribute(state, new)
  for key, e in state.residuals.items():
    # What the updates still owe: sum_w e_w / P, before and after.
    np.testing.assert_allclose(new * row.residuals[key] / new, e.sum(0) / old, rtol=1e-6)
    np.testing.assert_allclose(new * row.residuals[key], e.sum(0) * new / old, rtol=1e-6)
  assert int(row.count) == 7  # the same on every worker: kept
  for key, t in state.thresholds.items():
    assert float(row.thresholds[key]) == pytest.approx(np.mean(np.arange(1, old + 1)))
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
  np.testing.assert_allclose(row[0].residuals["w"],
                             chain_state[0].residuals["w"].sum(0) / 3, rtol=1e-6)
