"""dlgs-demo: the preset, the dense figure it cites, and what it prints at the end."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dlgs_jax.cli import demo
from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[2]


def config(*flags):
  return demo.config_of(list(flags))


def test_the_dense_figure_applies_to_the_preset_whatever_the_method_or_workdir():
  assert demo.trains_as_preset(config())
  assert demo.trains_as_preset(config("--method", "dense", "--workdir", "/tmp/x"))
  assert demo.trains_as_preset(config("--density", "0.1", "--budget", "layer", "--send-whole",
                                      "head"))
  assert not demo.trains_as_preset(config("--epochs", "2"))
  assert not demo.trains_as_preset(config("--seed", "1"))


def test_comparison_lines_cite_dense_or_say_how_to_measure_it():
  summary = {"final_test_accuracy": 0.38}
  line, = demo.comparison_lines(config(), summary)
  gap = 100 * (0.38 - demo.DENSE_ACCURACY)
  assert line.startswith(f"accuracy: dlgs 38.0%, dense {demo.DENSE_ACCURACY:.1%} on this preset "
                         f"({gap:+.1f} points")
  assert demo.comparison_lines(config("--epochs", "2"), summary) == [
      "for a dense baseline of these settings, run the same command with --method dense"]
  assert demo.comparison_lines(config("--method", "dense", "--epochs", "2"), summary) == []
  assert demo.comparison_lines(config(), {"final_test_accuracy": None}) == []


def test_the_docs_give_the_dense_figure_the_demo_cites():
  page = (ROOT / "docs" / "getting_started.md").read_text()
  section = page.split("## The demo\n", 1)[1].split("\n## ", 1)[0]
  assert f"{demo.DENSE_ACCURACY:.1%}" in section
  assert "bash scripts/demo.sh" in section


@pytest.mark.slow
def test_the_demo_ends_by_explaining_its_run(tmp_path):
  out = subprocess.run([sys.executable, "-m", "dlgs_jax.cli.demo", "--epochs", "1",
                        "--steps", "8", "--workdir", str(tmp_path / "demo")],
                       capture_output=True, text=True, timeout=600, env=child_env())
  assert out.returncode == 0, out.stderr[-3000:]
  tail = out.stdout[out.stdout.index("finished: 8 steps"):]
  assert f"wrote {tmp_path / 'demo'}/" in tail
  ratio = re.search(r"each worker sent ([\d.]+) kB a step; a dense float32 all-reduce sends "
                    r"([\d.]+) MB \((\d+)x less\)", tail)
  sent, dense, less = ratio.groups()
  assert abs(int(less) - 1000 * float(dense) / float(sent)) <= 1
  assert "for a dense baseline of these settings" in tail  # --epochs 1 is not the preset
  # Commands a fresh shell runs: in a checkout, the script (dlgs-demo is in .venv/bin).
  assert "next:" in tail and "bash scripts/demo.sh --method dense" in tail
  assert "sha256" not in out.stdout and "summary:" not in out.stdout
  assert (tmp_path / "demo" / "curves.png").exists()


def test_the_next_steps_are_commands_a_fresh_shell_runs(tmp_path, monkeypatch):
  """In a checkout, the script (which installs first); elsewhere, the entry point."""
  monkeypatch.chdir(ROOT)
  assert demo.next_steps()[0] == ("bash scripts/demo.sh --method dense",
                                  "the same run with a dense all-reduce")
  assert ("bash scripts/docs.sh", demo.NEXT_COMMANDS[0][1]) in demo.next_steps()
  monkeypatch.chdir(tmp_path)
  assert [c for c, _ in demo.next_steps()] == [
      "dlgs-demo --method dense", "dlgs-demo --budget layer", "dlgs-demo --density 0.025"]
  for command, _ in demo.next_steps():  # each one a run the demo takes
    config(*command.split()[1:])
