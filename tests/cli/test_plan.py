"""dlgs-plan's input checks: every bad flag or file is one line, before any measuring."""

import json

import pytest

from dlgs_jax.cli import plan


@pytest.mark.parametrize("flags, message", [
    (["--density", "0"], "--density 0.0 is invalid: must be in (0, 1]"),
    (["--density", "nan"], "--density nan is invalid"),
    (["--latency", "-1"], "--latency -1.0 is invalid: must be a number of seconds >= 0"),
    (["--bandwidth", "0gbit"], "--bandwidth '0gbit' is invalid: bandwidth must be positive"),
    (["--bandwidth", "foo"], "--bandwidth 'foo' is invalid"),
    (["--reuse-every", "-3"], "--reuse-every -3 is invalid"),
    (["--workers", "0"], "--workers 0 is invalid"),
    (["--refresh-below", "often"], "--refresh-below 'often' is invalid"),
    (["--method", "sgd"], "--method 'sgd' is invalid: choose one of"),
    (["--planner", "best"], "--planner 'best' is invalid: choose one of"),
    (["--in-step-rounds", "-1"], "--in-step-rounds -1 is invalid: must be >= 0"),
    (["--profile", "/nonexistent.json"], "--profile '/nonexistent.json' is invalid: no such file"),
    (["--node-size", "0"], "--node-size 0 is invalid: must be >= 1"),
    (["--node-size", "4"], "--node-size 4 is invalid: needs --bandwidth, the link between nodes"),
    (["--node-size", "4", "--bandwidth", "1gbit", "--fast-bandwidth", "fast"],
     "--fast-bandwidth 'fast' is invalid"),
    (["--fast-latency", "-1"], "--fast-latency -1.0 is invalid"),
    (["--collective", "ring"], "--collective 'ring' is invalid"),
    (["--method", "dense", "--collective", "auto"],
     "--collective 'auto' is invalid: applies to topk, lags, dlgs, not dense"),
])
def test_bad_flags_are_named_before_anything_runs(tmp_path, flags, message):
  with pytest.raises(SystemExit) as stop:
    plan.main(["--model", "smallcnn", "--out-dir", str(tmp_path), *flags])
  assert message in str(stop.value.code)
  assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("content", ["", "[1, 2]", '{"model": "smallcnn"}', "\x00\x01garbage",
                                     '{"model": "smallcnn", "paths": 3, "sizes": [], '
                                     '"t_forward": 0, "t_backward": [], "workers": 1}'])
def test_a_file_that_is_not_a_profile_is_one_line(tmp_path, content):
  path = tmp_path / "profile.json"
  path.write_text(content)
  with pytest.raises(SystemExit) as stop:
    plan.main(["--model", "smallcnn", "--profile", str(path), "--out-dir", str(tmp_path / "o")])
  text = str(stop.value.code)
  assert text.startswith(f"--profile {str(path)!r} is not a profile") and "\n" not in text
  json.dumps(text)


def test_the_flags_become_one_checked_config(tmp_path):
  from dlgs_jax.compress.methods import ConfigError
  from dlgs_jax.training.plan_job import PlanConfig

  config = plan.config_from_args(plan.parse_args(
      ["--model", "vgg16", "--refresh-below", "none", "--bandwidth", "1gbit", "--workers", "16",
       "--out-dir", str(tmp_path)]))
  assert config == PlanConfig(model="vgg16", refresh_below=None, bandwidth="1gbit", workers=16,
                              out_dir=str(tmp_path))
  # The config checks itself, with the factories' own rules, without a command line.
  with pytest.raises(ConfigError, match=r"density 1.5 is invalid: must be in \(0, 1\]"):
    PlanConfig(model="vgg16", density=1.5).validate()


def test_auto_records_the_exchange_the_network_prices_fastest(tmp_path, capsys):
  from pathlib import Path
  profile = Path(__file__).resolve().parents[2] / "experiments/results/profiles/vgg16_gpu.json"
  for workers, chosen in (("64", "owners"), ("2", "allgather")):
    out = tmp_path / workers
    assert plan.main(["--model", "vgg16", "--profile", str(profile), "--bandwidth", "10gbit",
                      "--latency", "0", "--workers", workers, "--collective", "auto",
                      "--out-dir", str(out)]) == 0
    record = json.loads((out / "vgg16_dlgs_0.01_collective.json").read_text())
    assert record["chosen"] == chosen and record["workers"] == int(workers)
    assert min(record["seconds"], key=record["seconds"].get) == chosen
  assert "fastest: allgather" in capsys.readouterr().out
  # Top-k cannot take gTop-k's reduction: at 256 workers, where DLGS would, it is left out.
  for method, chosen in (("dlgs", "gtopk"), ("topk", "owners")):
    out = tmp_path / method
    assert plan.main(["--model", "vgg16", "--method", method, "--profile", str(profile),
                      "--bandwidth", "10gbit", "--workers", "256", "--collective", "auto",
                      "--out-dir", str(out)]) == 0
    record = json.loads((out / f"vgg16_{method}_0.01_collective.json").read_text())
    assert record["chosen"] == chosen
    assert ("gtopk" in record["seconds"]) == (method == "dlgs")
