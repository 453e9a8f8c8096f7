"""The README is a front page whose quickstart runs and prints what the README says."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
  return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_install_and_quickstart_come_first_on_a_short_page():
  lines = README.splitlines()
  assert len(lines) <= 150
  headings = [i for i, line in enumerate(lines) if line.startswith("## ")]
  assert [lines[i] for i in headings[:2]] == ["## Install", "## Quickstart"]
  assert headings[1] < 35  # both on the first screen
  assert "pip install ." in section("Install") and "bash scripts/test.sh" in section("Install")
  assert (ROOT / ".ci" / "run").read_text().strip().endswith("bash scripts/test.sh")


def test_every_linked_page_exists():
  for target in re.findall(r"\]\(([^)#]+)\)", README):
    if not target.startswith("http"):
      assert (ROOT / target).exists(), target


@pytest.mark.slow
def test_the_quickstart_runs_and_sends_what_the_readme_says():
  code = re.search(r"```python\n(.*?)```", section("Quickstart"), re.S).group(1)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=child_env(), cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = re.findall(r"step (\d+)  loss ([\d.]+)  bytes sent per worker (\d+)", out.stdout)
  assert [int(r[0]) for r in rows] == [0, 100, 200]
  assert float(rows[-1][1]) < 0.8 * float(rows[0][1])
  text = " ".join(section("Quickstart").split())
  values, dense, sent = re.search(r"this model's ([\d,]+) parameters sends ([\d,]+) bytes a "
                                  r"worker each step; DLGS sends about (\d+)", text).groups()
  values = int(values.replace(",", ""))
  assert values == (32 * 64 + 64) + (64 * 10 + 10)
  assert int(dense.replace(",", "")) == 2 * 3 / 4 * 4 * values  # ring all-reduce, 4 workers
  assert all(abs(int(r[2]) - int(sent)) <= 0.1 * int(sent) for r in rows)
