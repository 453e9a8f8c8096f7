import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dlgs_jax.workload import models
from dlgs_jax.workload import parallel


@pytest.mark.parametrize("name,count,leaves", [
    ("smallcnn", 591_466, None), ("resnet20", 269_722, None),
    ("vgg16", 14_728_266, None), ("resnet50", 25_557_032, 161)])
def test_parameter_counts(name, count, leaves):
  shapes = models.param_shapes(name)
  flat = jax.tree_util.tree_leaves(shapes)
  assert sum(int(np.prod(x.shape)) for x in flat) == count
  if leaves is not None:
    assert len(flat) == leaves


def test_unknown_model():
  with pytest.raises(ValueError, match="'alexnet'"):
    models.create_model("alexnet")


def test_sync_batchnorm_normalises_over_the_whole_global_batch():
  """With bn_axis_name, 4 workers x 2 examples give the outputs of one batch of 8."""
  workers = 4
  images = np.random.default_rng(0).standard_normal((workers * 2, 32, 32, 3)).astype(np.float32)
  images[:2] += 3.0  # worker 0's examples differ from the rest
  plain, _ = models.create_model("smallcnn")
  synced, _ = models.create_model("smallcnn", bn_axis_name="data")
  variables = plain.init(jax.random.key(0), images[:1], train=False)
  whole, whole_stats = jax.jit(lambda v, x: plain.apply(
      v, x, train=True, mutable=["batch_stats"]))(variables, images)
  mesh = parallel.data_mesh(workers)

  def per_worker(model):
    def step(v, x):
      logits, new = model.apply(v, x[0], train=True, mutable=["batch_stats"])
      return logits[None], jax.tree_util.tree_map(lambda s: s[None], new)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
                               out_specs=(P("data"), P("data")), check_vma=False))
    v = parallel.replicate(variables, mesh)
    x = parallel.shard_batch(images.reshape(workers, 2, 32, 32, 3), mesh)
    logits, stats = fn(v, x)
    return np.asarray(logits).reshape(workers * 2, -1), jax.tree_util.tree_map(np.asarray, stats)

  sync_logits, sync_stats = per_worker(synced)
  local_logits, _ = per_worker(plain)
  np.testing.assert_allclose(sync_logits, np.asarray(whole), rtol=2e-4, atol=2e-4)
  assert np.abs(local_logits - np.asarray(whole)).max() > 1e-2
  for got, expected in zip(jax.tree_util.tree_leaves(sync_stats),
                           jax.tree_util.tree_leaves(whole_stats)):
    for w in range(workers):  # every worker holds the global running statistics
      np.testing.assert_allclose(got[w], np.asarray(expected), rtol=2e-4, atol=1e-5)
