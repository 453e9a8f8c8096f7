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
