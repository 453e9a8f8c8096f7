"""The exchange of one step: fused means (the sparse exchange runs in every transform's tests)."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from dlgs_jax.compress import exchange
from dlgs_jax.workload import parallel
from tests.compress.test_collectives import run


def test_fused_mean_is_one_collective_and_equals_the_mean():
  workers = 4
  rng = np.random.default_rng(7)
  tree = {"a": rng.standard_normal((workers, 3, 2)).astype(np.float32),
          "b": rng.integers(0, 5, (workers, 4)).astype(np.float32),
          "c": rng.standard_normal((workers,)).astype(np.float32)}
  out = run(lambda t: exchange.fused_mean(t, axis_name="data"), workers, tree)
  for name, value in tree.items():
    for w in range(workers):
      np.testing.assert_allclose(out[name][w], value.mean(0), rtol=1e-6, atol=1e-6)
  mesh = parallel.data_mesh(workers)
  fn = jax.shard_map(lambda t: exchange.fused_mean(t, axis_name="data"), mesh=mesh,
                     in_specs=P("data"), out_specs=P("data"))
  text = str(jax.make_jaxpr(fn)(tree))
  assert text.count("psum") == 1
