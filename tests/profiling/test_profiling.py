import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dlgs_jax
from dlgs_jax.workload import losses
from dlgs_jax.workload import data
from dlgs_jax.compress import grouping
from dlgs_jax.compress import wire
from dlgs_jax.workload import models
from dlgs_jax.workload import parallel
from dlgs_jax import profiling
from dlgs_jax.planning import planner
from dlgs_jax.planning import network
from dlgs_jax.planning.timeline import LinearCost, Profile
from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]


def test_fit_linear_recovers_coefficients_and_stays_nonnegative():
  x = np.asarray([1e3, 1e4, 1e5, 1e6])
  fit = profiling.fit_linear(x, 2e-4 + 3e-9 * x)
  assert fit.alpha == pytest.approx(2e-4, rel=1e-6) and fit.beta == pytest.approx(3e-9, rel=1e-6)
  falling = profiling.fit_linear(x, [4.0, 3.0, 2.0, 1.0])
  assert falling.beta == 0.0 and falling.alpha == 2.5
  negative_intercept = profiling.fit_linear(x, 1e-9 * x - 1e-5)
  assert negative_intercept.alpha == 0.0 and negative_intercept.beta > 0


@pytest.mark.parametrize("text,bits", [("1gbit", 1e9), ("10Gbit", 1e10), ("25gbps", 2.5e10),
                                       ("100mbit", 1e8), ("5e8", 5e8)])
def test_parse_bandwidth(text, bits):
  assert network.parse_bandwidth(text) == bits


@pytest.mark.parametrize("text", ["fast", "-1gbit", "0gbit"])
def test_parse_bandwidth_rejects(text):
  with pytest.raises(ValueError, match=text):
    network.parse_bandwidth(text)


def test_network_comm_alpha_beta():
  costs = network.network_comm(8, 1e9, latency=1e-5)
  assert costs["allreduce"] == LinearCost(14 * 1e-5, 8e-9)
  assert costs["allgather"] == LinearCost(7 * 1e-5, 8e-9)
  assert costs["gtopk"].alpha == pytest.approx((3 + 14) * 1e-5)
  with pytest.raises(ValueError, match="workers"):
    network.network_comm(0, 1e9)


@pytest.mark.slow
def test_measure_compute_orders_layers_and_checks_the_total():
  model = models.ResNetCifar(depth=8)
  images = jnp.asarray(np.random.default_rng(0).standard_normal((4, 32, 32, 3)), jnp.float32)
  labels = jnp.asarray([0, 1, 2, 3], jnp.int32)
  variables = model.init(jax.random.key(0), images, train=False)
  result = profiling.measure_compute(model, variables, images, labels, repeats=2, total_repeats=2)
  params = variables["params"]
  assert sorted(result["order"]) == sorted(grouping.leaf_paths(params))
  assert result["order"][0].startswith("Dense_0")  # the output layer is ready first
  assert all(t >= 0 for t in result["t_backward"])
  # Scaled to the measured whole backward; unscaled if noise made that <= 0.
  whole = result["backward_measured"] or result["backward_sum_alone"]
  assert sum(result["t_backward"]) == pytest.approx(whole, rel=1e-9)
  assert result["backward_sum_alone"] > 0 and math.isfinite(result["backward_difference"])
  # Every conv/BN layer got time on exactly one of its leaves.
  timed = {p.rsplit("/", 1)[0] for p, t in zip(result["order"], result["t_backward"]) if t > 0}
  assert len(timed) >= 10
  assert [len(result["totals_raw"][k]) for k in ("forward", "forward_backward")] == [2, 2]
  assert result["t_forward"] == pytest.approx(np.median(result["totals_raw"]["forward"]))


@pytest.mark.slow
def test_measure_compute_times_the_totals_on_the_train_steps_program():
  model = models.ResNetCifar(depth=8)
  images = jnp.asarray(np.random.default_rng(0).standard_normal((4, 32, 32, 3)), jnp.float32)
  labels = jnp.asarray([0, 1, 2, 3], jnp.int32)
  variables = model.init(jax.random.key(0), images, train=False)
  raw_images, raw_labels = data.benchmark_batches((32, 32, 3), 10, 3, 1, 4)
  batches = (raw_images[:, 0], raw_labels[:, 0])
  result = profiling.measure_compute(model, variables, images, labels, repeats=1,
                                    batches=batches, total_repeats=3)
  raw = result["totals_raw"]
  assert len(raw["forward"]) == len(raw["forward_backward"]) == 3
  assert result["t_forward"] == pytest.approx(np.median(raw["forward"]))
  backward = np.median(raw["forward_backward"]) - np.median(raw["forward"])
  assert result["backward_measured"] == pytest.approx(max(backward, 0.0))
  assert sorted(result["order"]) == sorted(grouping.leaf_paths(variables["params"]))
  assert result["order"][0].startswith("Dense_0")
  # Same order as on the float inputs: the order depends on the model only.
  plain = profiling.measure_compute(model, variables, images, labels, repeats=1, total_repeats=1)
  assert result["order"] == plain["order"]
  with pytest.raises(ValueError, match="total_repeats must be >= 1, got 0"):
    profiling.measure_compute(model, variables, images, labels, total_repeats=0)
  with pytest.raises(ValueError, match="got 0 and 0"):
    profiling.measure_compute(model, variables, images, labels,
                             batches=(raw_images[:0, 0], raw_labels[:0, 0]))


@pytest.mark.slow
def test_measure_comm_on_local_mesh():
  mesh = parallel.data_mesh(4)
  costs, raw = profiling.measure_comm(mesh, [64, 65536], 0.01, repeats=2, chain=3)  # k = 1 .. 656
  assert set(costs) == {"allreduce", "allgather", "gtopk"}
  for kind, cost in costs.items():
    points = raw[kind]
    assert len(points) == 2 and all(t > 0 for _, t in points)
    # The slope is the lone collectives' fit; the latency the marginal cost of one more
    # collective in a program, at the smallest size.
    assert cost.beta == profiling.fit_linear(*zip(*points)).beta
    latency = raw["latency"][kind]
    assert latency["bytes"] == points[0][0] and latency["lone"] == points[0][1]
    assert latency["chain"] == 3 and latency["chained"] > 0
    marginal = (latency["chained"] - latency["lone"]) / 2
    assert cost.alpha == pytest.approx(max(marginal - cost.beta * latency["bytes"], 0.0))
  lone, raw_lone = profiling.measure_comm(mesh, [64, 4096], 0.01, repeats=1, chain=1)
  assert "latency" not in raw_lone
  assert lone["allreduce"] == profiling.fit_linear(*zip(*raw_lone["allreduce"]))
  with pytest.raises(ValueError, match="chain must be >= 1, got 0"):
    profiling.measure_comm(mesh, [64], 0.01, chain=0)


def test_measure_comm_over_one_axis_of_a_node_mesh_counts_that_axis_workers():
  """Between nodes every device of a node exchanges at once; bytes are per that axis's size."""
  mesh = parallel.node_mesh(2)  # 8 devices: 4 nodes x 2
  assert dict(mesh.shape) == {"node": 4, "local": 2}
  costs, raw = profiling.measure_comm(mesh, [64, 4096], 0.01, repeats=1, chain=1, axis="node",
                                      kinds=("allreduce", "allgather"))
  assert set(costs) == {"allreduce", "allgather"}
  assert [b for b, _ in raw["allreduce"]] == [wire.allreduce_bytes(n, 4) for n in (64, 4096)]
  assert [b for b, _ in raw["allgather"]] == [wire.allgather_bytes(k, 4) for k in (1, 41)]
  fast, raw_fast = profiling.measure_comm(mesh, [64, 4096], 0.01, repeats=1, chain=1,
                                          axis="local", kinds=("allreduce",))
  assert [b for b, _ in raw_fast["allreduce"]] == [wire.allreduce_bytes(n, 2) for n in (64, 4096)]
  assert fast["allreduce"].beta >= 0
  with pytest.raises(ValueError, match="axis 'data' is not one of the mesh's axes"):
    profiling.measure_comm(mesh, [64], 0.01, axis="data")
  with pytest.raises(ValueError, match=r"kinds must be among .*'ring'"):
    profiling.measure_comm(mesh, [64], 0.01, axis="node", kinds=("ring",))


def _overlap_reference(x, message, rounds):
  """NumPy: per leaf, the sum over workers of work(leaf)[:message] * mean(work(leaf))."""
  v = x.astype(np.float64)
  for _ in range(rounds):
    v = np.sin(v) * 1.0001 + np.cos(v) * 0.5
  return (v[..., :message] * v.mean(axis=-1, keepdims=True)).sum(axis=0)


def test_overlap_programs_do_the_work_and_collectives_they_name():
  mesh = parallel.data_mesh(4)
  leaves, size, message, rounds = 3, 64, 5, 2
  x = np.random.default_rng(1).standard_normal((4, leaves, size)).astype(np.float32)
  xs = parallel.shard_batch(x, mesh)
  programs = profiling.overlap_programs(mesh, leaves=leaves, message=message, rounds=rounds)
  assert set(programs) == set(profiling.OVERLAP_PROGRAMS)
  out = {name: np.asarray(parallel.fetch(program(xs))) for name, program in programs.items()}
  expected = _overlap_reference(x, message, rounds)
  for name in ("independent", "chained"):
    assert out[name].shape == (4, leaves, message)
  # Every worker holds the sum over workers: the collective ran.
  np.testing.assert_allclose(out["independent"], np.broadcast_to(expected, out["independent"].shape),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out["collectives"],
                             np.broadcast_to(x[:, :, :message].sum(0), (4, leaves, message)),
                             rtol=1e-5, atol=1e-6)
  # compute: each worker its own message times the worker count, no exchange.
  for w in range(4):
    np.testing.assert_allclose(out["compute"][w], 4 * _overlap_reference(x[w:w + 1], message,
                                                                          rounds),
                               rtol=1e-4, atol=1e-5)
  # chained: leaf i's input moved by 1e-3 * leaf i-1's result, so leaf 0 is unchanged.
  chained_x = x.copy()
  prev = None
  for i in range(leaves):
    if prev is not None:
      chained_x[:, i, :message] += (prev * 1e-3).astype(np.float32)
    prev = _overlap_reference(chained_x[:, i:i + 1], message, rounds)[0]
  np.testing.assert_allclose(out["chained"][0], _overlap_reference(chained_x, message, rounds),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(out["chained"][:, 0], out["independent"][:, 0])
  assert np.abs(out["chained"][:, 1:] - out["independent"][:, 1:]).max() > 1e-3 * np.abs(
      expected[1:]).max()
  with pytest.raises(ValueError, match="rounds must be >= 1, got 3, 5, 0"):
    profiling.overlap_programs(mesh, leaves=3, message=5, rounds=0)


def test_measure_overlap_reports_the_hidden_share_of_its_timings():
  mesh = parallel.data_mesh(2)
  result = profiling.measure_overlap(mesh, leaves=2, size=256, message=8, rounds=1, repeats=3)
  seconds = result["seconds"]
  assert set(seconds) == set(profiling.OVERLAP_PROGRAMS) and min(seconds.values()) > 0
  assert all(len(result["samples"][k]) == 3 and seconds[k] == np.median(result["samples"][k])
             for k in seconds)
  assert result["hidden"] == pytest.approx(
      (seconds["compute"] + seconds["collectives"] - seconds["independent"])
      / min(seconds["compute"], seconds["collectives"]))
  assert result["workers"] == 2 and result["rounds"] == 1
  # The compiled order holds one all-gather per leaf, between the other instructions.
  schedule = result["schedule"]
  assert sum(n for kind, n in schedule if kind == "all-gather") == 2
  assert {kind for kind, _ in schedule} == {"all-gather", "other"}
  text = """HloModule m
%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %s = f32[4]{0} sine(%p)
}
ENTRY %main (a: f32[4]) -> (f32[8], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused
  %g = f32[8]{0} all-gather(%f), dimensions={0}
  %c = f32[] constant(1)
  %h = f32[4]{0} fusion(%f), kind=kLoop, calls=%fused
  %k = f32[4]{0} fusion(%h), kind=kLoop, calls=%fused
  %r = f32[4]{0} all-reduce(%k), to_apply=%add
  ROOT %t = (f32[8]{0}, f32[4]{0}) tuple(%g, %r)
}
"""
  assert profiling.collective_schedule(text) == [["other", 1], ["all-gather", 1], ["other", 2],
                                                ["all-reduce", 1]]
  with pytest.raises(ValueError, match="no ENTRY"):
    profiling.collective_schedule("HloModule m")
  assert profiling.overlap_hidden({"compute": 2.0, "collectives": 1.0, "independent": 2.0}) == 1.0
  assert profiling.overlap_hidden({"compute": 2.0, "collectives": 1.0, "independent": 3.5}) == -0.5
  with pytest.raises(ValueError, match=r"size \(4\) must be >= message \(8\)"):
    profiling.measure_overlap(mesh, size=4, message=8)


@pytest.mark.slow
def test_measure_update_fits_every_method():
  costs, raw = profiling.measure_update([4096, 65536], 0.01, repeats=2, reuse_every=4)
  assert set(costs) == set(profiling.UPDATE_METHODS) | {"dlgs_exact", "dlgs_reuse"}
  assert {"dgc", "terngrad"} <= set(costs)
  assert raw["sizes"] == [4096, 65536]
  for method in costs:
    assert len(raw[method]) == 2 and all(t > 0 for t in raw[method])
    assert costs[method](65536) > 0
  # DLGS: one exact step and reuse_every - 1 reuse steps per period.
  for exact, reuse, amortised in zip(raw["dlgs_exact"], raw["dlgs_reuse"], raw["dlgs"]):
    assert amortised == pytest.approx((exact + 3 * reuse) / 4)


def test_fit_update_fits_per_leaf_methods_over_leaf_sizes_only():
  # A superlinear cost, as the standalone updates measure: t = 1e-3 + 1e-15 n^2.
  sizes = [4096, 65536, 1_000_000, 20_000_000]
  times = [1e-3 + 1e-15 * n * n for n in sizes]
  raw = {"sizes": sizes, "lags": times, "dgc": times, "terngrad": times, "topk": times,
         "dlgs": times}
  costs = profiling.fit_update(raw, largest_leaf=1_000_000)
  leaf_range = profiling.fit_linear(sizes[:3], times[:3])
  whole_range = profiling.fit_linear(sizes, times)
  for method in profiling.PER_LEAF_METHODS:
    assert costs[method] == leaf_range
  # One message for the model (Top-k) or planned groups up to it (DLGS): every size.
  assert costs["topk"] == costs["dlgs"] == whole_range
  # At leaf sizes the leaf-range line is the closer one.
  for n in sizes[:3]:
    truth = 1e-3 + 1e-15 * n * n
    assert abs(leaf_range(n) - truth) < abs(whole_range(n) - truth)
  # A model whose leaves are all smaller than the grid still gets a line (two points).
  tiny = profiling.fit_update(raw, largest_leaf=100)
  assert tiny["lags"] == profiling.fit_linear(sizes[:2], times[:2])


def test_suffix_groups_pick_the_last_leaves_nearest_each_target():
  # Backward order: the last leaves are the model's input side.
  leaf_sizes = [100, 10, 1000, 1]
  totals = np.cumsum(leaf_sizes[::-1])  # 1, 1001, 1011, 1111
  counts = profiling.suffix_groups(leaf_sizes, [1, 900, 1111, 5000])
  assert counts == [1, 2, 4]
  for target, m in zip([1, 900, 1111], counts):
    assert np.argmin(np.abs(np.log(totals) - np.log(target))) + 1 == m
  with pytest.raises(ValueError, match="no leaves"):
    profiling.suffix_groups([], [10])
  with pytest.raises(ValueError, match=r"positive, got \[4, 0\]"):
    profiling.suffix_groups([4, 0], [10])


@pytest.mark.slow
def test_measure_update_times_grouping_methods_on_the_models_leaves():
  # Backward order: head first, input side last.
  shapes = [(64, 10), (10,), (32, 64), (64,), (3, 3, 3, 32)]
  sizes = [864, 3000, 3498]
  costs, raw = profiling.measure_update(sizes, 0.1, methods=("dense", "dlgs", "lags", "topk"),
                                       repeats=1, reuse_every=2, leaf_shapes=shapes)
  elements = [int(np.prod(s)) for s in shapes]
  counts = profiling.suffix_groups(elements, sizes)
  assert raw["group_sizes"] == [sum(elements[len(elements) - m:]) for m in counts]
  assert raw["group_sizes"][0] == 864 and raw["group_sizes"][-1] == sum(elements)
  assert raw["group_leaves"] == counts and raw["values"] == "noise"
  assert raw["grouped"] == ["dense", "dlgs", "lags", "topk"]
  for method in ("dense", "dlgs", "dlgs_exact", "dlgs_reuse", "topk", "lags"):
    assert len(raw[method]) == len(raw["group_sizes"])
  for method in ("dense", "dlgs", "dlgs_exact", "dlgs_reuse", "topk"):
    assert costs[method] == profiling.fit_linear(raw["group_sizes"], raw[method])
  # LAGS sends each leaf of a group as its own message: a cost per leaf.
  assert costs["lags"] == profiling.fit_per_leaf(counts, raw["group_sizes"], raw["lags"])
  # fit_update (what profile_model and refit_profile use) reads the same groups.
  refit = profiling.fit_update(raw, largest_leaf=max(elements))
  assert refit == costs


@pytest.mark.slow
def test_measure_update_times_the_models_gradients():
  rng = np.random.default_rng(3)
  # Mostly exact zeros, as ResNet-50's gradients at 32x32 input are; two batches.
  grads = [[np.where(rng.random(s) < 0.8, 0.0, rng.standard_normal(s)).astype(np.float32)
            for s in [(16, 10), (10,), (3, 3, 3, 16)]] for _ in range(2)]
  costs, raw = profiling.measure_update([160, 600], 0.1, methods=("topk", "terngrad"),
                                       repeats=1, leaf_grads=grads, warmup_steps=2)
  assert raw["values"] == "gradients" and raw["grouped"] == ["topk", "terngrad"]
  assert raw["warmup_steps"] == 2
  assert raw["group_sizes"][-1] == 160 + 10 + 432 and raw["group_leaves"][-1] == 3
  assert costs["terngrad"] == profiling.fit_per_leaf(raw["group_leaves"], raw["group_sizes"],
                                                    raw["terngrad"])
  with pytest.raises(ValueError, match=r"leaf_shapes say \[\(16, 10\), \(10,\), \(3, 3, 3, 15\)\]"):
    profiling.measure_update([160], 0.1, methods=("topk",), repeats=1, leaf_grads=grads,
                            leaf_shapes=[(16, 10), (10,), (3, 3, 3, 15)])
  with pytest.raises(ValueError, match="the batches' leaves differ in shape"):
    profiling.measure_update([160], 0.1, methods=("topk",), repeats=1,
                            leaf_grads=[grads[0], grads[1][:2]])
  with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
    profiling.measure_update([160], 0.1, methods=("topk",), leaf_grads=grads, warmup_steps=-1)


def test_fit_per_leaf_separates_the_per_leaf_cost_from_the_per_value_cost():
  leaves = [1, 3, 10, 40]
  elements = [500, 2_000, 90_000, 1_000_000]
  times = [4e-5 * m + 2e-9 * n for m, n in zip(leaves, elements)]
  fit = profiling.fit_per_leaf(leaves, elements, times)
  assert fit.alpha == pytest.approx(4e-5, rel=1e-6) and fit.beta == pytest.approx(2e-9, rel=1e-6)
  # Summed over a program's leaves the fitted cost gives the program's time.
  assert fit.alpha * 40 + fit.beta * 1_000_000 == pytest.approx(times[-1], rel=1e-9)
  # A per-leaf cost that would come out negative is dropped, not kept below zero.
  per_value = profiling.fit_per_leaf(leaves, elements, [3e-9 * n - 1e-6 * m
                                                       for m, n in zip(leaves, elements)])
  assert per_value.alpha == 0.0 and per_value.beta > 0
  per_leaf = profiling.fit_per_leaf(leaves, elements, [1e-3 * m - 1e-10 * n
                                                      for m, n in zip(leaves, elements)])
  assert per_leaf.beta == 0.0 and per_leaf.alpha > 0
  with pytest.raises(ValueError, match=r"got \[0, 3\] and \[500, 2000\]"):
    profiling.fit_per_leaf([0, 3], [500, 2000], [1.0, 2.0])
  with pytest.raises(ValueError, match="2 leaf counts, 2 sizes and 1 times"):
    profiling.fit_per_leaf([1, 3], [500, 2000], [1.0])


def linear_classifier():
  """Softmax regression on flattened pixels: its gradient has a NumPy closed form."""
  import flax.linen as nn

  class Linear(nn.Module):
    num_classes: int = 3

    @nn.compact
    def __call__(self, x, train=True):
      return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))

  return Linear()


def softmax_regression_grads(images, labels, w, b):
  """NumPy reference: gradient of the mean cross-entropy of a linear classifier."""
  x = np.asarray(data.normalize(jnp.asarray(images)), np.float64).reshape(len(images), -1)
  logits = x @ w + b
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  delta = (p - np.eye(w.shape[1])[labels]) / len(images)
  return {"kernel": x.T @ delta, "bias": delta.sum(0)}


def test_model_gradients_match_a_numpy_softmax_regression():
  model = linear_classifier()
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (5, 2, 2, 3), dtype=np.uint8)
  labels = np.asarray([0, 2, 1, 1, 0], np.int32)
  variables = model.init(jax.random.key(1), jnp.zeros((1, 2, 2, 3)))
  grads, twice = profiling.model_gradients(model, variables, np.stack([images, images]),
                                          np.stack([labels, labels]))
  for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(twice)):
    np.testing.assert_array_equal(a, b)
  expected = softmax_regression_grads(
      images, labels, *(np.asarray(variables["params"]["Dense_0"][k], np.float64)
                        for k in ("kernel", "bias")))
  for k in ("kernel", "bias"):
    np.testing.assert_allclose(grads["Dense_0"][k], expected[k], rtol=1e-4, atol=1e-6)


def test_train_locally_runs_trainings_optimizer_on_the_batches_in_turn():
  model = linear_classifier()
  rng = np.random.default_rng(2)
  images = rng.integers(0, 256, (2, 4, 2, 2, 3), dtype=np.uint8)
  labels = rng.integers(0, 3, (2, 4)).astype(np.int32)
  variables = model.init(jax.random.key(3), jnp.zeros((1, 2, 2, 3)))
  jax.tree_util.tree_map(np.testing.assert_array_equal, variables,
                         profiling.train_locally(model, variables, images, labels, 0))
  trained = profiling.train_locally(model, variables, images, labels, 3)
  assert set(trained) == {"params"}
  # NumPy reference: training's defaults (lr 0.1, weight decay 5e-4, momentum
  # 0.9), batches 0, 1, 0.
  lr, decay, momentum = 0.1, 5e-4, 0.9
  w = {k: np.asarray(v, np.float64) for k, v in variables["params"]["Dense_0"].items()}
  trace = {k: np.zeros_like(v) for k, v in w.items()}
  for i in (0, 1, 0):
    grads = softmax_regression_grads(images[i], labels[i], w["kernel"], w["bias"])
    for k in w:
      trace[k] = momentum * trace[k] + grads[k] + decay * w[k]
      w[k] = w[k] - lr * trace[k]
  for k in w:
    np.testing.assert_allclose(trained["params"]["Dense_0"][k], w[k], rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="got -1"):
    profiling.train_locally(model, variables, images, labels, -1)


def test_training_optimizer_sends_a_dlgs_group_as_one_message():
  tx = profiling.training_optimizer("dlgs", 0.25, order=["0000", "0001"])
  params = {"0000": jnp.zeros((8, 4)), "0001": jnp.zeros((4,))}
  # Distinct magnitudes, so exactly k values meet each exact threshold.
  grads = {"0000": jnp.arange(32.0).reshape(8, 4) - 7.5, "0001": jnp.arange(4.0) + 1.0}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  # One entry per message sent.
  assert dlgs_jax.compress.state.comm_stats(state).selected.shape == (1,)
  # One threshold over the message (the default budget): its k = 8 + 1 largest |g|,
  # all in the first leaf; a threshold per layer sends 8 of 32 and 1 of 4.
  assert int(np.count_nonzero(np.asarray(updates["0000"]))) == 9
  assert int(np.count_nonzero(np.asarray(updates["0001"]))) == 0


def test_update_grid_spans_the_model_and_ends_the_leaf_range():
  grid = profiling.update_grid([512] + [2_359_296] * 10)
  assert grid[0] == 4096 and grid[-1] == 512 + 23_592_960
  assert 2_359_296 in grid and grid == sorted(set(grid)) and len(grid) == 7
  # A model smaller than the grid's start is still timed over two sizes or more.
  small = profiling.update_grid([10, 20])
  assert small[0] == 4096 and small[-1] == 8192 and len(small) >= 2


def test_refit_profile_redoes_the_update_fit_from_raw_timings():
  sizes = [4096, 100_000, 10_000_000]
  times = [1e-4, 2e-3, 1.0]
  profile = Profile(model="m", paths=["a", "b"], sizes=[100_000, 9_900_000], overlap=False,
                    t_forward=0.1, t_backward=[0.1, 0.1], workers=4,
                    sparsify={"lags": LinearCost(0.0, 1e-7)}, comm={})
  again = profiling.refit_profile(profile, {"sparsify_raw": {"sizes": sizes, "lags": times}})
  assert again.sparsify["lags"] == profiling.fit_linear(sizes[:2], times[:2])
  assert again.sizes == profile.sizes and again.t_backward == profile.t_backward
  with pytest.raises(ValueError, match="no raw update timings"):
    profiling.refit_profile(profile, {"comm_raw": {}})


def test_median_interval_takes_the_sign_tests_order_statistics():
  def reference_j(n, confidence=0.95):
    # Largest j with 2 P(X <= j) <= 1 - confidence, X ~ binomial(n, 1/2); else 0.
    best = 0
    for j in range((n - 1) // 2 + 1):
      if 2 * sum(math.comb(n, i) for i in range(j + 1)) / 2 ** n <= 1 - confidence:
        best = j
    return best

  rng = np.random.default_rng(0)
  for n in (1, 2, 5, 8, 9, 12, 20, 41):
    values = rng.standard_normal(n)
    middle, lower, upper = profiling.median_interval(values)
    ordered = np.sort(values)
    j = reference_j(n)
    assert middle == pytest.approx(np.median(values))
    assert (lower, upper) == (ordered[j], ordered[n - 1 - j])
  # The textbook cases: 12 values -> 3rd to 10th, 20 -> 6th to 15th; 8 -> the whole range.
  assert profiling.median_interval(range(12))[1:] == (2.0, 9.0)
  assert profiling.median_interval(range(20))[1:] == (5.0, 14.0)
  assert profiling.median_interval(range(8))[1:] == (0.0, 7.0)
  with pytest.raises(ValueError, match="no values"):
    profiling.median_interval([])


def test_in_step_factors_use_only_the_differences_the_rounds_resolve():
  compute = [0.100, 0.130, 0.090, 0.110, 0.120, 0.100, 0.095, 0.140, 0.105, 0.100, 0.115, 0.125]
  # A 40 ms update that costs 20 ms +- 1 ms in the step: resolved, factor 0.5.
  steady = [c + 0.020 + 0.001 * (-1) ** i for i, c in enumerate(compute)]
  # A 2 ms update under +-10 ms of noise: unresolved, kept as timed alone.
  noisy = [c + 0.002 + 0.010 * (-1) ** i for i, c in enumerate(compute)]
  factors = profiling.in_step_factors(
      {"dense": {"compute": compute, "with_update": steady},
       "lags": {"compute": compute, "with_update": noisy},
       "topk": {"compute": compute, "with_update": steady}},
      {"dense": 0.040, "lags": 0.002})
  assert set(factors) == {"dense", "lags"}  # topk: no standalone price to scale
  dense = factors["dense"]
  assert dense["resolved"] and dense["factor"] == pytest.approx(0.020 / 0.040)
  assert dense["in_step"] == pytest.approx(0.020) and dense["alone"] == 0.040
  assert dense["lower"] == pytest.approx(0.019) and dense["upper"] == pytest.approx(0.021)
  assert not factors["lags"]["resolved"] and factors["lags"]["factor"] == 1.0
  # A resolved difference below zero prices the update at nothing, not below.
  free = profiling.in_step_factors({"dense": {"compute": compute,
                                             "with_update": [c - 0.001 for c in compute]}},
                                  {"dense": 0.040})
  assert free["dense"]["resolved"] and free["dense"]["factor"] == 0.0


def test_scaled_update_costs_price_the_whole_model_as_the_step_measured_it():
  sizes = [1000, 20_000, 300_000]
  costs = {"dense": LinearCost(1e-4, 1e-8), "lags": LinearCost(2e-4, 3e-8),
           "dlgs_exact": LinearCost(3e-4, 8e-8), "dlgs_reuse": LinearCost(1e-4, 2e-8),
           "dlgs": LinearCost((3e-4 + 9 * 1e-4) / 10, (8e-8 + 9 * 2e-8) / 10),
           "topk": LinearCost(1e-4, 5e-8)}
  alone = profiling.whole_model_update(costs, sizes)
  total = sum(sizes)
  assert alone["dense"] == pytest.approx(1e-4 + 1e-8 * total)
  # Per-leaf methods pay their cost once per leaf.
  assert alone["lags"] == pytest.approx(3 * 2e-4 + 3e-8 * total)
  measured = {"dense": 0.5 * alone["dense"], "lags": 0.8 * alone["lags"],
              "dlgs_exact": 0.9 * alone["dlgs_exact"], "dlgs_reuse": 0.6 * alone["dlgs_reuse"]}
  compute = [0.01] * 12
  rounds = {k: {"compute": compute, "with_update": [c + v for c in compute]}
            for k, v in measured.items()}
  factors = profiling.in_step_factors(rounds, alone)
  scaled = profiling.scale_update_costs(costs, factors, reuse_every=10)
  again = profiling.whole_model_update(scaled, sizes)
  for key, seconds in measured.items():
    assert again[key] == pytest.approx(seconds)
  assert scaled["topk"] == costs["topk"]
  exact, reuse = scaled["dlgs_exact"], scaled["dlgs_reuse"]
  assert scaled["dlgs"].alpha == pytest.approx((exact.alpha + 9 * reuse.alpha) / 10)
  assert scaled["dlgs"].beta == pytest.approx((exact.beta + 9 * reuse.beta) / 10)
  assert again["dlgs"] == pytest.approx((measured["dlgs_exact"] + 9 * measured["dlgs_reuse"]) / 10)


@pytest.mark.slow
def test_measure_update_in_step_pairs_the_step_with_and_without_the_update():
  model, shape = models.create_model("smallcnn")
  images, labels = data.benchmark_batches(shape, 10, 3, 1, 4)
  variables = profiling.train_locally(model, losses.init_variables(
      model, jnp.zeros((1,) + shape), 0), images[:, 0], labels[:, 0], 2)
  order = grouping.leaf_paths(variables["params"])
  raw = profiling.measure_update_in_step(model, variables, (images[:, 0], labels[:, 0]), 0.05,
                                        order, methods=("dlgs",), reuse_every=2,
                                        rounds=3)
  assert set(raw) == {"dlgs_exact", "dlgs_reuse"}
  for rounds in raw.values():
    assert len(rounds["compute"]) == len(rounds["with_update"]) == 3
    assert all(t > 0 for t in rounds["compute"] + rounds["with_update"])
  with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
    profiling.measure_update_in_step(model, variables, (images[:, 0], labels[:, 0]), 0.05, order,
                                    rounds=0)
  with pytest.raises(ValueError, match="need n >= 1 image and label batches, got 0 and 0"):
    profiling.measure_update_in_step(model, variables, (images[:0, 0], labels[:0, 0]), 0.05,
                                    order)


@pytest.mark.slow
def test_measure_refresh_counts_exact_thresholds_over_real_steps():
  model, shape = models.create_model("smallcnn")
  variables = model.init(jax.random.key(0), jnp.zeros((1,) + shape), train=False)
  images, labels = data.benchmark_batches(shape, 10, 4, 1, 8)
  images, labels = images[:, 0], labels[:, 0]
  # reuse_every=1: every threshold is exact on every step.
  assert profiling.measure_refresh(model, variables, images, labels, 0.05, reuse_every=1,
                                  steps=3) == 1.0
  # Counted steps 1..8 hold the schedule's step 4 (and 8): at least 2 of 8 all exact;
  # the rule adds early refreshes, never fewer.
  share = profiling.measure_refresh(model, variables, images, labels, 0.05, reuse_every=4,
                                   steps=9)
  assert 2 / 8 <= share <= 1.0
  with pytest.raises(ValueError, match="got 1"):
    profiling.measure_refresh(model, variables, images, labels, 0.05, steps=1)


def test_dlgs_timed_states_are_an_exact_step_and_a_reuse_step():
  # measure_update times DLGS (fixed schedule) from these two states: the
  # first step recomputes every threshold, the second reuses them all.
  tx = profiling.training_optimizer("dlgs", 0.05, reuse_every=4, order=["0000", "0001"],
                                   refresh_below=None)
  update = jax.jit(tx.update)
  rng = np.random.default_rng(1)
  params = {"0000": jnp.zeros((40, 25)), "0001": jnp.zeros((30, 20))}
  batches = [{k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
              for k, v in params.items()} for _ in range(3)]
  exact_state, reuse_state = profiling.dlgs_timed_states(update, tx.init(params), batches[:2],
                                                        params, 4, warmup_steps=5)

  def dlgs_state(state):
    return next(s for s in state if isinstance(s, dlgs_jax.compress.state.DLGSState))

  # The warm-up ends at the multiple of reuse_every at or after warmup_steps.
  assert int(dlgs_state(exact_state).count) == 8 and int(dlgs_state(reuse_state).count) == 9
  # The warm state is one training leaves: residuals hold the unsent mass.
  residuals = dlgs_jax.compress.state.leaf_residuals
  assert float(jnp.abs(residuals(dlgs_state(exact_state))["0000"]).max()) > 0
  _, after_exact = update(batches[2], exact_state, params)
  _, after_reuse = update(batches[2], reuse_state, params)
  assert int(dlgs_jax.compress.state.comm_stats(after_exact).exact) == 2
  assert int(dlgs_jax.compress.state.comm_stats(after_reuse).exact) == 0
  for new, old in zip(dlgs_state(after_reuse).thresholds, dlgs_state(reuse_state).thresholds):
    np.testing.assert_array_equal(new, old)
  # warm_state cycles the batches from `first`.
  manual = tx.init(params)
  for i in (1, 0, 1):
    manual = update(batches[i], manual, params)[1]
  cycled = profiling.warm_state(update, tx.init(params), batches[:2], params, 3, first=1)
  np.testing.assert_array_equal(residuals(dlgs_state(cycled))["0001"],
                                residuals(dlgs_state(manual))["0001"])


def run_cli(*args, timeout=600):
  env = child_env()
  return subprocess.run([sys.executable, "-m", "dlgs_jax.cli.plan", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_plan_cli_measures_plans_and_models_the_network(tmp_path):
  # The configuration test_train's on-the-fly planner profiles, so the suite's shared
  # compilation cache serves one of the two.
  out = run_cli("--model", "smallcnn", "--density", "0.01", "--batch-size", "8",
                "--repeats", "1", "--devices", "2", "--in-step-rounds", "0",
                "--out-dir", str(tmp_path))
  assert out.returncode == 0, out.stdout + out.stderr
  for name in ("wfbp", "single", "greedy", "optimal"):
    assert name in out.stdout
  # test_profile_model_times_updates_on_the_models_real_gradients covers the in-step rounds.
  assert "inside the step" not in out.stdout
  plan = json.loads((tmp_path / "smallcnn_dlgs_0.01_optimal_plan.json").read_text())
  assert plan["workers"] == 2 and plan["model"] == "smallcnn"
  assert (tmp_path / "smallcnn_dlgs_0.01_timeline.png").stat().st_size > 10_000
  profile = Profile.load(tmp_path / "smallcnn_profile.json")
  assert profile.num_layers == 16 and set(profile.comm) == {"allreduce", "allgather", "gtopk"}
  # DLGS with the refresh rule is priced at the refresh rate measured on real steps.
  assert set(profile.sparsify) == {"dlgs", "dlgs_exact", "dlgs_reuse", "dense"}
  assert 0.0 < profile.dlgs_exact_fraction <= 1.0
  assert f"{profile.dlgs_exact_fraction:.0%} of thresholds computed exactly" in out.stdout
  again = run_cli("--model", "smallcnn", "--density", "0.01", "--profile",
                  str(tmp_path / "smallcnn_profile.json"), "--bandwidth", "1gbit",
                  "--workers", "16", "--out-dir", str(tmp_path))
  assert again.returncode == 0, again.stdout + again.stderr
  assert "16 workers, 1gbit links" in again.stdout
  assert json.loads((tmp_path / "smallcnn_dlgs_0.01_optimal_plan.json").read_text())["workers"] == 16
  # 4 nodes of 8 devices: slices planned between nodes, each node's 10 Gbit/s shared by 8.
  nodes = run_cli("--model", "smallcnn", "--density", "0.01", "--profile",
                  str(tmp_path / "smallcnn_profile.json"), "--bandwidth", "10gbit",
                  "--workers", "4", "--node-size", "8", "--out-dir", str(tmp_path))
  assert nodes.returncode == 0, nodes.stdout + nodes.stderr
  assert "4 nodes x 8 devices (two-level)" in nodes.stdout
  assert "dense all-reduce (two-level, optimal fusion)" in nodes.stdout
  two_level = planner.Plan.load(tmp_path / "smallcnn_dlgs_0.01_optimal_plan.json")
  assert (two_level.workers, two_level.fast_size) == (4, 8)
  assert two_level.fast_link == {"alpha": 2 * 7 * 5e-6, "beta": 8 / 2400e9}
  assert Profile.from_dict(two_level.profile).comm["allgather"].beta == pytest.approx(8 / 1.25e9)
  wrong = run_cli("--model", "vgg16", "--profile", str(tmp_path / "smallcnn_profile.json"),
                  "--out-dir", str(tmp_path))
  assert wrong.returncode != 0 and "smallcnn" in wrong.stderr
  bad = run_cli("--model", "smallcnn", "--refresh-below", "often", "--out-dir", str(tmp_path))
  assert bad.returncode != 0 and "--refresh-below 'often' is invalid" in bad.stderr
  negative = run_cli("--model", "smallcnn", "--in-step-rounds", "-1", "--out-dir", str(tmp_path))
  assert negative.returncode != 0 and "--in-step-rounds -1 is invalid" in negative.stderr


@pytest.mark.slow
def test_profile_model_times_updates_on_the_models_real_gradients():
  model, shape = models.create_model("smallcnn")
  images, labels = data.benchmark_batches(shape, 10, 2, 1, 4)
  profile, details = profiling.profile_model(
      "smallcnn", density=0.05, batch_size=4, mesh=parallel.data_mesh(1), repeats=1,
      methods=("lags", "dense"), refresh_below=None, batches=(images[:, 0], labels[:, 0]),
      in_step_rounds=4)
  raw = details["sparsify_raw"]
  assert raw["values"] == "gradients" and raw["grouped"] == ["lags", "dense"]
  # The largest timed group is the whole model, in the profile's backward order.
  assert raw["group_sizes"][-1] == sum(profile.sizes)
  assert raw["group_leaves"][-1] == profile.num_layers
  fitted = {"lags": profiling.fit_per_leaf(raw["group_leaves"], raw["group_sizes"], raw["lags"]),
            "dense": profiling.fit_linear(raw["group_sizes"], raw["dense"])}
  # Then scaled to what the step pays, where the paired rounds resolve it.
  factors = details["update_in_step"]
  assert set(factors) == {"lags", "dense"}
  assert [len(details["update_in_step_raw"]["lags"][k]) for k in ("compute", "with_update")] == [
      4, 4]
  assert profile.sparsify == profiling.scale_update_costs(fitted, factors, 10)
  assert profiling.refit_profile(profile, details).sparsify == profile.sparsify
