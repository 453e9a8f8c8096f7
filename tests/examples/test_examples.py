"""The scripts in examples/ run as a user runs them, and their loss falls."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
# The CNNs spend more time running their steps than compiling them, so they are compiled
# with optimisation (see tests.helpers.child_env); the transformer, the other way round.
@pytest.mark.parametrize("script, steps, optimize", [
    ("linen_cnn.py", 40, True), ("nnx_cnn.py", 40, True), ("nnx_transformer_lm.py", 40, False)])
def test_an_example_trains_and_sends_less_than_dense(script, steps, optimize):
  out = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--steps", str(steps)],
                       capture_output=True, text=True, timeout=600,
                       env=child_env(optimize=optimize), cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = re.findall(r"step +(\d+) +loss ([\d.]+) +sent +([\d.]+) kB per worker +"
                     r"\(dense fp32: ([\d.]+) kB", out.stdout)
  assert [int(step) for step, *_ in lines][-1] == steps
  losses = [float(loss) for _, loss, _, _ in lines]
  assert losses[-1] < losses[0] - 0.3, out.stdout
  for _, _, sent, dense in lines:  # DLGS at density 0.01: tens of times below dense
    assert float(sent) * 10 < float(dense)


@pytest.mark.slow
def test_the_language_model_trains_sliced_over_two_nodes_of_four_devices():
  """HSDP: each of a node's 4 devices holds a quarter of the model; DLGS between the 2
  nodes. Its loss falls as the dense run's does, sending a small share of dense's bytes."""
  runs = {}
  for method in ("dlgs", "dense"):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "nnx_transformer_lm.py"),
                          "--devices", "8", "--fsdp", "4", "--method", method, "--steps", "20"],
                         capture_output=True, text=True, timeout=600,
                         env=child_env(), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 nodes x 4 devices, each holding 1/4 of the model" in out.stdout
    runs[method] = [(float(loss), float(sent), float(dense)) for _, loss, sent, dense in
                    re.findall(r"step +(\d+) +loss ([\d.]+) +sent +([\d.]+) kB per worker +"
                               r"\(dense fp32: ([\d.]+) kB", out.stdout)]
  for method, lines in runs.items():
    assert lines[-1][0] < lines[0][0] - 0.3, (method, lines)
  # Dense sends its slice between nodes: what the line prints as dense's.
  assert runs["dense"][-1][1] == pytest.approx(runs["dense"][-1][2], rel=0.01)
  assert runs["dlgs"][-1][1] * 10 < runs["dlgs"][-1][2]
  # The loss DLGS reaches is near the dense run's (within 0.5 nats after 20 steps).
  assert runs["dlgs"][-1][0] < runs["dense"][-1][0] + 0.5
