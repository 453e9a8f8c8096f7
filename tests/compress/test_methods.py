"""The method registry: each method declared once, configs that build compressors."""

import jax
import numpy as np
import pytest

import dlgs_jax
from dlgs_jax.compress import methods
from dlgs_jax.compress.methods import ConfigError, MethodConfig, method_config
from dlgs_jax.compress.optimizer import OptimizerConfig, build_optimizer
from dlgs_jax.compress import grouping
from dlgs_jax.workload import models


def test_every_method_and_variant_builds_its_transform():
  params = {"w": np.ones((4, 8), np.float32), "b": np.ones((8,), np.float32)}
  order = ["b", "w"]
  states = {"dense": dlgs_jax.compress.state.DenseState, "topk": dlgs_jax.compress.state.SparseState,
            "lags": dlgs_jax.compress.state.SparseState, "gtopk": dlgs_jax.compress.state.SparseState,
            "dlgs": dlgs_jax.compress.state.DLGSState, "dgc": dlgs_jax.compress.state.DGCState,
            "terngrad": dlgs_jax.compress.state.TernGradState}
  assert set(states) == set(methods.METHODS)
  for name in [*methods.METHODS, *methods.VARIANTS]:
    config = method_config(name, density=0.25)
    tx = config.compressor(order=order)
    assert isinstance(tx.init(params), states[config.name]), name
  assert method_config("dlgs-paper").refresh_below is None
  assert method_config("lags-head", min_ndim=1).send_whole == ("head",)
  both = method_config("dlgs-paper-head")
  assert both.refresh_below is None and both.send_whole == ("head",)


def test_declared_properties_select_the_methods_other_layers_use():
  assert methods.names(planner_prices=True) == ("dense", "topk", "lags", "gtopk", "dlgs")
  assert methods.names(modelled=True) == tuple(methods.METHODS)
  assert methods.names(uses_density=False) == ("dense", "terngrad")
  assert methods.names(takes_groups=True) == ("dense", "lags", "dlgs")
  assert [m.name for m in methods.METHODS.values() if m.per_leaf_update] == [
      "lags", "dgc", "terngrad"]
  assert methods.base_method("dlgs-head") == "dlgs"
  with pytest.raises(ValueError, match="unknown method 'sgd'"):
    methods.base_method("sgd")


def test_configurations_run_density_free_methods_once():
  assert methods.configurations(["dense", "topk", "dlgs", "terngrad"], [0.1, 0.01]) == [
      ("dense", 0.1), ("topk", 0.1), ("dlgs", 0.1), ("terngrad", 0.1), ("topk", 0.01),
      ("dlgs", 0.01)]
  assert methods.configurations(["dlgs-paper"], [0.1, 0.01]) == [
      ("dlgs-paper", 0.1), ("dlgs-paper", 0.01)]
  assert methods.configurations(["dlgs"], []) == []


@pytest.mark.parametrize("config, option", [
    (MethodConfig(density=0.0), "density"),
    (MethodConfig(density=float("nan")), "density"),
    (MethodConfig(density="0.1"), "density"),
    (MethodConfig(density=True), "density"),
    (MethodConfig(name="sgd"), "method"),
    (MethodConfig(reuse_every=0), "reuse_every"),
    (MethodConfig(refresh_below=1.5), "refresh_below"),
    (MethodConfig(candidates=0), "candidates"),
    (MethodConfig(candidates=2.0), "candidates"),
    (MethodConfig(refresh_below=None, candidates=3), "candidates"),
    (MethodConfig(aim=0.0), "aim"),
    (MethodConfig(aim=2.5), "aim"),
    (MethodConfig(refresh_below=None, aim=1.0), "aim"),
    (MethodConfig(candidates=1, aim=1.0), "aim"),
    (MethodConfig(min_ndim=-1), "min_ndim"),
    (MethodConfig(name="topk", min_ndim=2), "min_ndim"),
    (MethodConfig(name="dgc", send_whole=("head",)), "send_whole"),
    (MethodConfig(collective="ring"), "collective"),
    (MethodConfig(terngrad_clip=-1.0), "terngrad_clip"),
    (MethodConfig(budget="global"), "budget"),
    (MethodConfig(budget="message", send_whole=("head",)), "send_whole"),
    (MethodConfig(min_ndim=2), "min_ndim"),
])
def test_bad_options_are_named(config, option):
  with pytest.raises(ConfigError) as error:
    config.validate()
  assert error.value.option == option and repr(error.value.value) in str(error.value)


def test_the_default_budget_is_a_message_and_the_per_layer_variants_name_theirs():
  assert MethodConfig().budget == "message" and method_config("dlgs") == method_config(
      "dlgs-message")
  per_layer = [name for name, v in methods.VARIANTS.items()
               if v.base == "dlgs" and v.options.get("budget") == "layer"]
  assert {"dlgs-paper", "dlgs-layer", "dlgs-head", "dlgs-paper-head", "dlgs-whole1d",
          "dlgs-owners"} <= set(per_layer)
  for name in per_layer:
    assert method_config(name).validate().budget == "layer"
  # Every DLGS variant that sends a leaf whole names the budget that can.
  for name, v in methods.VARIANTS.items():
    if v.base == "dlgs" and ("send_whole" in v.options or "min_ndim" in v.options):
      assert name in per_layer


def test_send_whole_names_the_head_or_given_leaves_and_rejects_unknown_ones():
  order = ["Dense_1/bias", "Dense_1/kernel", "Conv_0/kernel", "Dense_0/kernel"]
  assert MethodConfig().whole_paths(order) == []
  assert MethodConfig(send_whole=("head",)).whole_paths(order) == [
      "Dense_1/bias", "Dense_1/kernel"]
  assert MethodConfig(send_whole=("Conv_0/kernel", "head", "Dense_1/bias")).whole_paths(
      order) == ["Conv_0/kernel", "Dense_1/bias", "Dense_1/kernel"]
  with pytest.raises(ConfigError, match="no leaf 'Conv_0/bias'"):
    MethodConfig(send_whole=("head", "Conv_0/bias")).whole_paths(order)
  shapes = {"Dense_1/bias": (10,), "Dense_1/kernel": (8, 10), "Conv_0/kernel": (3, 3, 1, 8),
            "Dense_0/kernel": (4, 8)}
  assert MethodConfig(min_ndim=2, send_whole=("Conv_0/kernel",)).whole_layers(
      order, shapes) == {0, 2}
  assert MethodConfig("dgc").whole_layers(order, shapes) == {0}
  assert MethodConfig("topk").whole_layers(order, shapes) == frozenset()


def test_a_message_budget_without_a_plan_takes_the_buckets_not_one_message_a_leaf():
  shapes = models.param_shapes("smallcnn")
  order = list(reversed(grouping.leaf_paths(shapes)))
  groups = lambda config: jax.eval_shape(  # noqa: E731
      config.compressor(order=order).init, shapes).stats.groups.paths
  assert groups(MethodConfig("dlgs", budget="layer")) == tuple((path,) for path in order)
  assert groups(MethodConfig("dlgs")) == groups(MethodConfig("dlgs", budget="message"))
  assert groups(MethodConfig("dlgs")) == (tuple(order),)
  planned = [order[:2], order[2:]]
  assert MethodConfig("dlgs", budget="message").compressor(order=order, groups=planned).init(
      shapes).stats.groups.paths == tuple(map(tuple, planned))


@pytest.mark.slow
def test_the_config_builds_the_method_it_describes():
  """dlgs with the head sent whole on one worker: the head whole, every other leaf a
  buffer's worth of its values at most; the exact thresholds kept are each leaf's k-th
  largest (they serve on the next step)."""
  shapes = models.param_shapes("smallcnn")
  paths = grouping.leaf_paths(shapes)
  leaves = jax.tree_util.tree_leaves(shapes)
  rng = np.random.default_rng(0)
  grads = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(shapes),
      [rng.standard_normal(x.shape).astype(np.float32) for x in leaves])
  order = list(reversed(paths))
  config = MethodConfig("dlgs", density=0.05, send_whole=("head",), budget="layer")
  tx = config.compressor(order=order)
  sent, state = jax.jit(tx.update)(grads, tx.init(grads))
  head = set(config.whole_paths(order))
  assert head == {"Dense_1/bias", "Dense_1/kernel"}
  thresholds = dict(zip((p for group in state.stats.groups.paths for p in group),
                        np.concatenate([np.asarray(t) for t in state.thresholds])))
  for path, g, s in zip(paths, jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(sent)):
    g, s = np.asarray(g).ravel(), np.asarray(s).ravel()
    if path in head:
      np.testing.assert_array_equal(s, g)
      assert thresholds[path] == 0.0
      continue
    k = max(1, int(np.ceil(0.05 * g.size)))
    chosen = np.flatnonzero(s)
    assert 0 < len(chosen) <= k, path
    np.testing.assert_array_equal(s[chosen], g[chosen])
    assert thresholds[path] == np.sort(np.abs(g))[-k], path


def test_the_optimizer_puts_weight_decay_after_the_exchange_except_for_dgc():
  params = {"w": np.full((16,), 2.0, np.float32)}
  grads = {"w": np.zeros((16,), np.float32)}
  optimizer = OptimizerConfig(lr=0.1, momentum=0.0, weight_decay=0.5)
  tx = build_optimizer(MethodConfig("dense"), optimizer, axis_name=None, schedule=0.1,
                       order=["w"])
  updates, _ = tx.update(grads, tx.init(params), params)
  # Nothing was sent (zero gradients), yet the decay moved the parameters: after the exchange.
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * 2.0)
  dgc = build_optimizer(MethodConfig("dgc", density=0.25), optimizer, axis_name=None,
                        schedule=0.1, order=["w"])
  assert isinstance(dgc.init(params)[1], dlgs_jax.compress.state.DGCState)
  with pytest.raises(ConfigError, match="momentum"):
    OptimizerConfig(momentum=1.0).validate()
