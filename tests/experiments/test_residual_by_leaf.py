"""Per-leaf residual statistics read back from an orbax checkpoint."""

import json

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.experiments.test_experiments import load


def write_run(tmp_path, residual, thresholds, params, groups, step=7):
  """A work directory as `dlgs-train` leaves it: plan.json and checkpoints/<step>/state."""
  state = {"params": params,
           "opt_state": [{"residuals": [residual], "thresholds": [thresholds]}]}
  ocp.PyTreeCheckpointer().save((tmp_path / "checkpoints" / str(step) / "state").resolve(), state)
  (tmp_path / "plan.json").write_text(json.dumps({"groups": groups}))
  return tmp_path


def test_rows_follow_the_padded_layout_of_worker_0(tmp_path):
  tool = load("residual_by_leaf")
  rng = np.random.default_rng(0)
  params = {"head": {"kernel": np.zeros((5, 3), np.float32), "bias": np.zeros(3, np.float32)},
            "stem": {"kernel": np.zeros((40,), np.float32)}}
  order = ["head/bias", "head/kernel", "stem/kernel"]
  sizes = [3, 15, 40]
  # Each leaf starts on a whole 32-value word: offsets 0, 32, 64.
  offsets = np.concatenate([[0], np.cumsum([-(-n // 32) * 32 for n in sizes])[:-1]])
  residual = rng.normal(size=(2, 128)).astype(np.float32)
  residual[0, 64:104] *= 1000.0  # the stem's backlog, on worker 0 only
  threshold = 0.5
  run = write_run(tmp_path, residual, np.array([[threshold], [9.0]], np.float32),
                  params, [order])
  out = tmp_path / "rows.json"
  assert tool.main([str(run), "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["leaves"]
  assert [r["leaf"] for r in rows] == order and [r["size"] for r in rows] == sizes
  for row, offset, n in zip(rows, offsets, sizes):
    values = np.abs(residual[0, offset:offset + n])
    assert row["threshold"] == threshold
    assert row["mean_abs"] == pytest.approx(values.mean(), rel=1e-6)
    assert row["max_abs"] == pytest.approx(values.max(), rel=1e-6)
    assert row["share_at_or_above_threshold"] == pytest.approx(np.mean(values >= threshold))
  assert rows[2]["share_at_or_above_threshold"] > 0.9 > rows[0]["share_at_or_above_threshold"]


def test_a_threshold_per_leaf_is_read_leaf_by_leaf(tmp_path):
  tool = load("residual_by_leaf")
  params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
  residual = np.tile(np.arange(64, dtype=np.float32), (1, 1))
  run = write_run(tmp_path, residual, np.array([[2.0, 40.0]], np.float32), params, [["a", "b"]])
  state = tool.restore_numpy((run / "checkpoints" / "7" / "state").resolve())
  rows = tool.leaf_rows(state, [["a", "b"]])
  # a: values 0-3 against 2.0; b: values 32-35 against 40.0.
  assert [r["share_at_or_above_threshold"] for r in rows] == [0.5, 0.0]
  assert [r["threshold"] for r in rows] == [2.0, 40.0]


def test_a_missing_step_names_the_steps_there_are(tmp_path):
  tool = load("residual_by_leaf")
  run = write_run(tmp_path, np.zeros((1, 32), np.float32), np.ones((1, 1), np.float32),
                  {"a": np.zeros(4, np.float32)}, [["a"]])
  with pytest.raises(SystemExit, match=r"--step 3 has no checkpoint .* it holds \[7\]"):
    tool.main([str(run), "--step", "3"])
