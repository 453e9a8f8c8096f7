"""A run's plan file and profile: malformed files are named in one line."""

import numpy as np
import pytest

from dlgs_jax.planning import network
from dlgs_jax.training.config import PlanConfig, RunConfig
from dlgs_jax.training import plans


@pytest.mark.parametrize("content", ["", "[]", '{"groups": 1}', "not json",
                                     '{"model": "m", "method": "dlgs", "density": 0.1, '
                                     '"workers": 2, "planner": "optimal", "order": ["a"], '
                                     '"groups": [["b"]]}'])
def test_a_file_that_is_not_a_plan_is_named(tmp_path, content):
  path = tmp_path / "plan.json"
  path.write_text(content)
  config = RunConfig(plan=PlanConfig(plan=str(path)))
  with pytest.raises(plans.PlanError) as error:
    plans.make_or_load_plan(config, mesh=None, paths=["a"], workers=2, log=print)
  assert str(error.value).startswith(f"--plan {str(path)!r} is not a plan file")


def test_auto_sends_by_the_exchange_the_modelled_network_prices_fastest():
  """Two workers: the all-gather; 256 workers on a 10 Gbit/s link: the owners, whose
  bytes stay flat. Each choice is `choice.for_method`'s, among what the method takes."""
  import dataclasses

  from dlgs_jax.compress.methods import MethodConfig
  from dlgs_jax.planning import choice
  from dlgs_jax.training.config import ModelConfig
  from dlgs_jax.workload import models, parallel

  base = RunConfig(model=ModelConfig("resnet20"),
                   method=MethodConfig("dlgs", density=0.01, collective="auto"),
                   plan=PlanConfig(bandwidth="10gbit", latency=0.0))
  mesh = parallel.data_mesh(1)
  size = sum(int(np.prod(s)) for s in models.leaf_shapes("resnet20", num_classes=10).values())
  chosen = {}
  for workers in (2, 256):
    lines = []
    resolved = plans.resolve_collective(base, mesh, workers, 10, lines.append)
    want = choice.for_method("dlgs", size, 0.01, workers, network.network_comm(
        workers, network.parse_bandwidth("10gbit"), 0.0))["collective"]
    assert resolved.method.collective == want and resolved.method.density == 0.01
    assert f"dlgs sends by {want}" in lines[0]
    chosen[workers] = want
  assert chosen == {2: "allgather", 256: "owners"}
  # Top-k takes no gTop-k reduction, whatever the network prices.
  topk = dataclasses.replace(base, method=MethodConfig("topk", density=0.01, collective="auto"))
  assert plans.resolve_collective(topk, mesh, 256, 10, print).method.collective in (
      "allgather", "owners")
  # What is not auto stays as given.
  assert plans.resolve_collective(RunConfig(), mesh, 4, 10, print) == RunConfig()
