import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from dlgs_jax.compress import grouping


class Deep(nn.Module):
  """12 layers: key order (Dense_0, Dense_1, Dense_10, ...) differs from execution order."""

  @nn.compact
  def __call__(self, x):
    for _ in range(12):
      x = nn.tanh(nn.Dense(3)(x))
    return x.sum()


def test_leaf_paths():
  tree = {"params": {"b": {"kernel": 1, "bias": 2}, "a": [3, 4]}}
  assert grouping.leaf_paths(tree) == [
      "params/a/0", "params/a/1", "params/b/bias", "params/b/kernel"]


def test_backward_order_follows_computation_not_key_order():
  model = Deep()
  x = jnp.ones((2, 3))
  params = model.init(jax.random.key(0), x)
  order = grouping.backward_order(lambda p, x: model.apply(p, x), params, x)
  assert sorted(order) == sorted(grouping.leaf_paths(params))
  layer_of = lambda path: int(path.split("/")[1].split("_")[1])
  layers = [layer_of(p) for p in order]
  # Each layer's two leaves are adjacent and layers come out last-to-first.
  assert layers == sorted(layers, reverse=True)
  assert layers[:2] == [11, 11] and layers[-2:] == [0, 0]
  # Key order would have put Dense_10 and Dense_11 right after Dense_1.
  assert grouping.leaf_paths(params)[4].startswith("params/Dense_10")


def test_backward_order_sees_through_jit():
  model = Deep()
  x = jnp.ones((2, 3))
  params = model.init(jax.random.key(0), x)
  loss = jax.jit(lambda p, x: model.apply(p, x))
  order = grouping.backward_order(loss, params, x)
  layers = [int(p.split("/")[1].split("_")[1]) for p in order]
  assert layers == sorted(layers, reverse=True)


def test_output_layer_is_the_module_whose_gradients_come_first():
  model = Deep()
  x = jnp.ones((2, 3))
  params = model.init(jax.random.key(0), x)
  order = grouping.backward_order(lambda p, x: model.apply(p, x), params, x)
  assert sorted(grouping.output_layer(order)) == ["params/Dense_11/bias",
                                                  "params/Dense_11/kernel"]
  # Dense_1 is not Dense_11's prefix: modules are matched whole.
  assert grouping.output_layer(["a/Dense_1/kernel", "a/Dense_11/kernel", "a/Dense_1/bias"]) == [
      "a/Dense_1/kernel", "a/Dense_1/bias"]
  with pytest.raises(ValueError, match="no parameters"):
    grouping.output_layer([])


def test_resolve_groups_default_and_errors():
  paths = ["a", "b", "c"]
  assert grouping.resolve_groups(paths, None) == [[2], [1], [0]]
  assert grouping.resolve_groups(paths, None, ["b", "a", "c"]) == [[1], [0], [2]]
  assert grouping.resolve_groups(paths, [["c", "b"], ["a"]], ["c", "b", "a"]) == [[2, 1], [0]]
  with pytest.raises(ValueError, match="empty group"):
    grouping.resolve_groups(paths, [["a", "b", "c"], []])
  with pytest.raises(ValueError, match="'d'"):
    grouping.resolve_groups(paths, None, ["a", "b", "d"])
  with pytest.raises(ValueError, match="missing"):
    grouping.resolve_groups(paths, None, ["a", "b"])


@pytest.mark.parametrize("sizes,limit,want", [
    ([5, 5, 5], 10, [[0, 1], [2]]),
    ([5, 20, 1, 1], 10, [[0], [1], [2, 3]]),  # a leaf over the limit travels alone
    ([3] * 7, 100, [list(range(7))]),
    ([1], 1, [[0]]),
])
def test_size_buckets_are_consecutive_runs_within_the_limit(sizes, limit, want):
  buckets = grouping.size_buckets(sizes, limit)
  assert buckets == want
  assert [i for b in buckets for i in b] == list(range(len(sizes)))
  assert all(sum(sizes[i] for i in b) <= limit or len(b) == 1 for b in buckets)


def test_default_groups_are_size_buckets_in_backward_order():
  paths = ["a", "b", "c", "d"]
  sizes = [4, 3, 2, grouping.BUCKET_VALUES]
  # No order: reverse flatten order, so "d" (over the limit) is alone and first.
  assert grouping.resolve_groups(paths, None, None, sizes) == [[3], [2, 1, 0]]
  order = ["b", "a", "c", "d"]
  assert grouping.resolve_groups(paths, None, order, sizes) == [[1, 0, 2], [3]]
  assert grouping.resolve_groups(paths, None, order) == [[1], [0], [2], [3]]
