"""Run configs: defaults, files, overrides and the checks made before any work."""

import json

import pytest

from dlgs_jax.compress.methods import ConfigError, MethodConfig
from dlgs_jax.training.config import (RunConfig, ScheduleConfig, load_config, with_overrides)


def test_learning_rate_schedule_divides_by_ten_at_four_and_six_sevenths():
  assert ScheduleConfig().decay_boundaries(10, 1400) == [800, 1200]  # 80, 120 of 140 epochs
  assert ScheduleConfig(lr_decay_epochs=(1, 2.5)).decay_boundaries(10, 1400) == [10, 25]
  assert ScheduleConfig(epochs=3).total_steps(7) == 21
  assert ScheduleConfig(epochs=3, steps=5).total_steps(7) == 5


def test_a_config_survives_its_json_and_overrides_replace_single_options(tmp_path):
  config = RunConfig(method=MethodConfig("dlgs", density=0.05, refresh_below=None,
                                         send_whole=("head",)),
                     schedule=ScheduleConfig(lr_decay_epochs=(1.0, 2.0)), seed=4)
  path = tmp_path / "config.json"
  path.write_text(json.dumps(config.to_dict()))
  assert load_config(str(path)) == config
  changed = with_overrides(config, {"method": {"density": 0.1}, "seed": {"seed": 1}})
  assert changed.method.density == 0.1 and changed.method.refresh_below is None
  assert changed.seed == 1 and config.seed == 4  # immutable


@pytest.mark.parametrize("changes, option", [
    ({"schedule": ScheduleConfig(epochs=0)}, "epochs"),
    ({"schedule": ScheduleConfig(steps=0)}, "steps"),
    ({"method": MethodConfig("topk"), "plan": None}, "planner/--plan"),
])
def test_bad_runs_are_refused_naming_the_option(changes, option):
  from dlgs_jax.training.config import PlanConfig
  if changes.get("plan", 1) is None:
    changes["plan"] = PlanConfig(planner="optimal")
  with pytest.raises(ConfigError) as error:
    RunConfig().replace(**changes).validate()
  assert error.value.option == option


def test_config_files_that_hold_no_config_are_refused(tmp_path):
  (tmp_path / "list.json").write_text("[1]")
  (tmp_path / "broken.json").write_text("{")
  for name, message in (("list.json", "object of sections"), ("broken.json", "not JSON"),
                        ("missing.json", "no such file")):
    with pytest.raises(ConfigError, match=message):
      load_config(str(tmp_path / name))
  with pytest.raises(ConfigError, match="unknown section"):
    RunConfig.from_dict({"optimiser": {}})


def test_a_python_config_file_is_refused_without_running_it(tmp_path):
  # An input file is data: the file below would leave a mark if it ran.
  ran = tmp_path / "ran"
  (tmp_path / "c.py").write_text(f"open({str(ran)!r}, 'w').close()\n"
                                 "def get_config():\n  raise SystemExit('ran')\n")
  with pytest.raises(ConfigError, match=r"c.py' is invalid: a config file is JSON and a Python "
                     r"file would run code: .*dlgs_jax.training.loop.train\(config\)") as error:
    load_config(str(tmp_path / "c.py"))
  assert "\n" not in str(error.value) and not ran.exists()
