"""The suite's CPU-time plugin records every test and sums them."""

import subprocess
import sys

from tests import cpu_time
from tests.helpers import ROOT, child_env


def test_each_test_is_charged_its_own_and_its_childrens_cpu(tmp_path):
  (tmp_path / "test_spin.py").write_text(
      "import subprocess, sys\n"
      "def test_child():\n"
      "  subprocess.run([sys.executable, '-c', 'sum(range(3 * 10**7))'], check=True)\n"
      "def test_idle():\n"
      "  pass\n")
  folder = tmp_path / "cpu"
  env = {**child_env(), "DLGS_TEST_CPU_DIR": str(folder), "PYTHONPATH": str(ROOT)}
  done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_time",
                         "-p", "no:cacheprovider", "-n", "0", str(tmp_path / "test_spin.py")],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stdout[-2000:]
  records = {r["test"].split("::")[1]: r for r in cpu_time.records(str(folder))}
  assert set(records) == {"test_child", "test_idle"}
  # The child's loop is charged to the test that waited for it, not to the idle one.
  assert records["test_child"]["cpu"] > 0.1 > records["test_idle"]["cpu"]
  text = cpu_time.summary(str(folder))
  assert text.startswith("2 tests, ") and "test_spin.py::test_child" in text
