"""A finished run's closing lines and curves."""

import json

import numpy as np
import pytest
from PIL import Image

from dlgs_jax.training import outputs


def write_metrics(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 9, "lo')


def epoch(e, step, acc):
  return {"step": step, "epoch": e, "event": "epoch_end", "test_accuracy": acc,
          "test_loss": 1 - acc, "train_loss": 1.2 - acc, "train_accuracy": acc + 0.01}


def test_epoch_records_keep_one_per_epoch_the_later_when_evaluated_twice(tmp_path):
  path = tmp_path / "metrics.jsonl"
  # A run ended mid-epoch 1 (step 70), then extended: epoch 1 evaluated again at 118.
  write_metrics(path, [{"step": 1, "loss": 2.0}, epoch(0, 59, 0.2), epoch(1, 70, 0.25),
                       {"step": 71, "loss": 1.9}, epoch(1, 118, 0.3), epoch(2, 140, 0.35)])
  found = outputs.epoch_records(path)
  assert [(r["epoch"], r["step"]) for r in found] == [(0, 59), (1, 118), (2, 140)]


def test_curves_are_a_png_of_two_panels(tmp_path):
  records = [epoch(e, 10 * (e + 1), 0.1 * e) for e in range(5)]
  assert outputs.draw_curves(records, tmp_path / "c.png", "title")
  image = np.asarray(Image.open(tmp_path / "c.png").convert("L"))
  assert image.shape == (340, 900)
  assert (image < 128).mean() > 0.01  # axes, lines and labels drawn, not a blank page
  assert not outputs.draw_curves([], tmp_path / "none.png")
  assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("sent,dense,expected", [
    (47384.0, 2365864.0, "each worker sent 47.4 kB a step; a dense float32 all-reduce sends "
                         "2.37 MB (50x less)"),
    (1.618e6, 1.618e6, "(1.00x)"),
    (1.45e6, 3.55e6, "sent 1.45 MB a step; a dense float32 all-reduce sends 3.55 MB (2.4x less)"),
    (512.0, 3.2e9, "512 B a step; a dense float32 all-reduce sends 3.2 GB (6250000x less)")])
def test_traffic_is_compared_with_a_dense_all_reduce(sent, dense, expected):
  line = outputs.traffic_line({"bytes_sent_per_step": sent, "dense_bytes_per_step": dense})
  assert expected in line
  assert outputs.traffic_line({"bytes_sent_per_step": None, "dense_bytes_per_step": dense}) == ""


def test_closing_lines_say_the_result_and_every_file(tmp_path):
  summary = {"seconds": 90.0, "steps_this_run": 30, "steps": 50, "final_test_accuracy": 0.4123,
             "final_test_loss": 1.61, "bytes_sent_per_step": 1000.0,
             "dense_bytes_per_step": 100000.0, "stopped_early": False}
  lines = outputs.closing_lines(summary, tmp_path, curves=True)
  assert lines[0] == ("finished: 30 steps in 1.5 min (step 50 of the run); test accuracy "
                      "41.2%, test loss 1.610")
  assert "(100x less)" in lines[1] and lines[2] == f"wrote {tmp_path}/"
  assert [line.split()[0] for line in lines[3:]] == [name for name, _ in outputs.WORKDIR_FILES]
  stopped = outputs.closing_lines(dict(summary, stopped_early=True), tmp_path, curves=False)
  assert stopped[0].startswith("stopped: 30 steps")
  assert not any(outputs.CURVES in line for line in stopped)
