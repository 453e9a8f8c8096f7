"""Communication statistics: every compressor of a chain, groups labelled, an exact running total."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dlgs_jax
from dlgs_jax.compress import state as state_lib
from dlgs_jax.workload import parallel
from tests.helpers import random_grads, run_steps

PARAMS = {"conv": {"kernel": jnp.zeros((3, 3, 2, 4)), "bias": jnp.zeros((4,))},
          "head": {"kernel": jnp.zeros((16, 10)), "bias": jnp.zeros((10,))}}
ORDER = ["head/bias", "head/kernel", "conv/bias", "conv/kernel"]
W = 4


@pytest.mark.slow
@pytest.mark.parametrize("make, groups", [
    (lambda: dlgs_jax.dlgs(0.1, axis_name="data", order=ORDER, groups=[ORDER[:2], ORDER[2:]]),
     [ORDER[:2], ORDER[2:]]),
    (lambda: dlgs_jax.dense(axis_name="data", order=ORDER, groups=[ORDER]), [ORDER]),
    (lambda: dlgs_jax.topk(0.1, axis_name="data"),  # without an order: reverse flatten order
     [["head/kernel", "head/bias", "conv/kernel", "conv/bias"]]),
    (lambda: dlgs_jax.dgc(0.1, axis_name="data"),
     [["conv/kernel"], ["head/kernel"], ["conv/bias", "head/bias"]]),
    (lambda: dlgs_jax.terngrad(axis_name="data"),
     [["head/kernel"], ["head/bias"], ["conv/kernel"], ["conv/bias"]]),
], ids=["dlgs", "dense", "topk", "dgc", "terngrad"])
def test_groups_are_labelled_and_the_total_adds_every_step(make, groups):
  rng = np.random.default_rng(0)
  steps = [random_grads(PARAMS, W, rng) for _ in range(3)]
  _, _, states = run_steps(make(), PARAMS, steps, W)
  assert [list(g) for g in states[-1].stats.groups.paths] == groups
  per_step = [np.asarray(s.stats.bytes_sent) for s in states]
  assert all(p.min() > 0 for p in per_step)
  np.testing.assert_array_equal(dlgs_jax.compress.state.total_bytes(states[-1].stats),
                                np.round(sum(per_step)).astype(np.int64))


def test_the_running_total_carries_past_32_bits_and_skips_add_nothing():
  stats = state_lib.empty_stats([["a"]])
  for _ in range(3):
    stats = state_lib.step_stats(stats, 3.0e9, 3.0e9, jnp.ones(1), jnp.ones(1))
  assert dlgs_jax.compress.state.total_bytes(stats) == 9_000_000_000
  skipped = state_lib.skipped_stats(stats)
  assert dlgs_jax.compress.state.total_bytes(skipped) == 9_000_000_000
  assert int(skipped.skipped) == 1 and float(skipped.bytes_sent) == 0.0
  assert skipped.groups == stats.groups


def test_every_compressor_of_a_chain_is_reported():
  labels = {"conv": {"kernel": "sparse", "bias": "sparse"},
            "head": {"kernel": "dense", "bias": "dense"}}
  tx = optax.multi_transform({"sparse": dlgs_jax.dlgs(0.1, axis_name="data",
                                                      thresholds=dlgs_jax.AdaptedReuse(1)),
                              "dense": dlgs_jax.dense(axis_name="data")}, labels)
  rng = np.random.default_rng(1)
  _, final, _ = run_steps(tx, PARAMS, [random_grads(PARAMS, W, rng) for _ in range(2)], W)
  report = dlgs_jax.comm_report(final)
  assert len(report) == 2
  by_kind = {("dense" if "'dense'" in path else "sparse"): entry for path, entry in report.items()}
  # Dense: one message per leaf; DLGS: one bucket. Latest layer first (no
  # order given: reverse flatten order).
  assert [g["paths"] for g in by_kind["dense"]["groups"]] == [["head/kernel"], ["head/bias"]]
  assert by_kind["dense"]["groups"][0]["selected"] == 160
  assert [g["paths"] for g in by_kind["sparse"]["groups"]] == [["conv/kernel", "conv/bias"]]
  # At most the buffers, ceil(0.1 * 72) + ceil(0.1 * 8): the thresholds of the second step
  # are exact for the first step's values.
  assert 1 <= by_kind["sparse"]["groups"][0]["selected"] <= 8 + 1
  dense_step = dlgs_jax.compress.wire.allreduce_bytes(10, W) + dlgs_jax.compress.wire.allreduce_bytes(160, W)
  assert by_kind["dense"]["total_sent"] == round(2 * dense_step)


def test_labels_survive_placement_and_fetch():
  mesh = parallel.data_mesh(W)
  tx = optax.chain(dlgs_jax.lags(0.1, axis_name="data"), optax.sgd(0.1))
  placed = dlgs_jax.init_per_worker(tx, PARAMS, mesh)
  fetched = dlgs_jax.fetch(placed)
  assert fetched[0].stats.groups == tx.init(PARAMS)[0].stats.groups
  assert jax.tree_util.tree_structure(fetched) == jax.tree_util.tree_structure(placed)
