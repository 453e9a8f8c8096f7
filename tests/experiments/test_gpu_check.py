"""The device check script, run on CPU at reduced sizes."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tests.experiments.test_experiments import load


def test_floor_pass_keeps_every_value_and_sends_those_over_the_threshold():
  check = load("gpu_check")
  rng = np.random.default_rng(0)
  grads = [rng.standard_normal(s).astype(np.float32) for s in ((7, 5), (13,))]
  residuals = [rng.standard_normal(g.shape).astype(np.float32) for g in grads]
  thresholds = [np.float32(1.0), np.float32(0.5)]
  out = check.floor_pass([jnp.asarray(g) for g in grads], [jnp.asarray(e) for e in residuals],
                         [jnp.asarray(t) for t in thresholds])
  for (sent, kept), g, e, t in zip(out, grads, residuals, thresholds):
    acc = e + g
    np.testing.assert_array_equal(np.asarray(sent), np.where(np.abs(acc) >= t, acc, 0))
    np.testing.assert_allclose(np.asarray(sent) + np.asarray(kept), acc, rtol=0, atol=1e-6)


def test_paired_ratio_is_the_median_of_per_round_ratios():
  check = load("gpu_check")
  cheap = lambda: jnp.zeros(())  # noqa: E731
  costly = lambda: jnp.sort(jnp.arange(200_000.0)[::-1])  # noqa: E731
  first, second, ratio = check.paired_ratio(cheap, costly, rounds=3)
  assert 0 < first < second and ratio > 1


@pytest.mark.slow
def test_gpu_check_runs_every_method_on_cpu_and_writes_its_table(tmp_path, capsys):
  check = load("gpu_check")
  out = tmp_path / "check.json"
  assert check.main(["--small", "--models", "smallcnn", "--densities", "0.1", "--reuse-every",
                     "2", "--rounds", "1", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["machine"]["backend"] == "cpu" and not result["skipped"]
  model = result["models"]["smallcnn"]
  assert model["forward_backward_ms"] > 0 and model["forward_backward_batch"] == 4
  rows = {(r["method"], r["grouping"]): r for r in result["rows"]}
  assert set(rows) == {("dense", "-"), ("topk", "-"), ("gtopk", "-"),
                       ("lags", "one group"), ("dlgs-paper", "one group"),
                       ("dlgs-layer", "one group"), ("dlgs-message", "one group"),
                       ("lags", "default"), ("dlgs-paper", "default"), ("dlgs-layer", "default"),
                       ("dlgs-message", "default")}
  for r in rows.values():
    assert r["update_ms"] > 0 and r["floor_ms"] > 0 and r["over_floor"] > 0
  # What the programs are made of: no method sorts its gradient (a top-k is an exact
  # threshold and a compaction); DLGS in one group runs one conditional or two on this
  # backend. gTop-k's merge is a sort by index and a top-k of its k candidates by design:
  # one merge, with one worker.
  for r in rows.values():
    assert r["sorts"] + r["top_k"] == (2 if r["method"] == "gtopk" else 0), r
  assert rows[("dlgs-paper", "one group")]["conditionals"] <= 2
  assert rows[("dlgs-paper", "one group")]["sorts"] + rows[("dlgs-paper", "one group")][
      "top_k"] == 0
  # The paper's schedule is exact on one step of each period of 2: every leaf, half the steps.
  assert rows[("dlgs-paper", "one group")]["exact_leaves_per_step"] == model["leaves"] / 2
  assert rows[("dlgs-paper", "default")]["exact_leaves_per_step"] == model["leaves"] / 2
  for r in rows.values():  # the update against what memory allows
    assert r["bandwidth_floor_ms"] > 0 and r["over_bandwidth_floor"] > 0
    # Every update reads the gradient and writes the update at least: dense's passes.
    assert r["passes"] >= rows[("dense", "-")]["passes"] >= 2, r
  assert result["machine"]["copy_bytes_per_s"] > 0
  assert result["machine"]["exact_running_sums"] is True
  # The whole step: forward, backward and update in one program, against dense's.
  steps = {r["method"]: r for r in result["whole_step"]}
  assert list(steps) == ["dense", "topk", "dlgs-paper", "dlgs-layer", "dlgs-message"]
  assert steps["dense"]["over_dense"] == 1.0 and steps["dense"]["batch"] == 4
  for r in steps.values():
    assert r["step_ms"] > 0 and r["over_dense"] == r["step_ms"] / steps["dense"]["step_ms"]
  table = result["table"].splitlines()
  assert len(table) == 2 + 11 + 3 + 5 and table[2].startswith("| smallcnn | 0.1 | dense | - |")
  assert table[-5].startswith("| smallcnn | 0.1 | dense | 4 | ") and table[-5].endswith(" 1.00 |")
  assert result["table"] in capsys.readouterr().out


@pytest.mark.slow
def test_gpu_check_stops_starting_work_once_its_budget_is_spent(tmp_path):
  check = load("gpu_check")
  out = tmp_path / "check.json"
  assert check.main(["--small", "--models", "smallcnn", "--densities", "0.1", "--rounds", "1",
                     "--budget-s", "0", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  assert result["rows"] == [] and result["whole_step"] == [] and len(result["skipped"]) == 11 + 5
  assert result["models"]["smallcnn"]["forward_backward_ms"] > 0
  assert check.main(["--small", "--models", "smallcnn", "--rounds", "1", "--budget-s", "0",
                     "--no-forward-backward", "--out", str(out)]) == 0
  assert json.loads(out.read_text())["models"]["smallcnn"]["forward_backward_ms"] is None
  assert check.main(["--small", "--models", "smallcnn", "--rounds", "1", "--budget-s", "0",
                     "--methods", "dense", "dlgs-message", "--one-group", "--no-forward-backward",
                     "--out", str(out)]) == 0
  assert sorted(json.loads(out.read_text())["skipped"]) == [
      "smallcnn 0.01 dense (-)", "smallcnn 0.01 dense (whole step)",
      "smallcnn 0.01 dlgs-message (one group)", "smallcnn 0.01 dlgs-message (whole step)",
      "smallcnn 0.1 dense (-)", "smallcnn 0.1 dlgs-message (one group)"]


@pytest.mark.parametrize("flags, message", [
    (["--densities", "0"], "--densities must be in"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_gpu_check_refuses_bad_flags_before_any_work(flags, message, capsys):
  check = load("gpu_check")
  with pytest.raises(SystemExit):
    check.parse_args(flags)
  assert message in capsys.readouterr().err
