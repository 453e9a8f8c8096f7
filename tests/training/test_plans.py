"""A run's plan file and profile: malformed files are named in one line."""

import pytest

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
