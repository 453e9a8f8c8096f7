"""The wheel `pip install .` builds holds the package whole and trains outside the checkout."""
import json
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import ROOT, child_env


@pytest.mark.slow
def test_the_wheel_holds_the_package_and_trains_without_the_repository(tmp_path):
  built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
  assert built.returncode == 0, built.stderr[-3000:]
  wheel, = (tmp_path / "dist").glob("dlgs_jax-*.whl")
  with zipfile.ZipFile(wheel) as archive:
    names = set(archive.namelist())
    archive.extractall(tmp_path / "site")
    metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
  packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "dlgs_jax").rglob("__init__.py")}
  assert all(f"{package}/__init__.py" in names for package in packages), packages
  assert "dlgs_jax/workload/cifar10_subset.npz" in names
  assert any(n.endswith("licenses/LICENSE") for n in names)
  assert "License-Expression: Apache-2.0" in metadata
  assert "Provides-Extra: train" in metadata
  # Run from elsewhere with only the unpacked wheel importable: no file of the checkout.
  env = child_env()
  env["PYTHONPATH"] = str(tmp_path / "site")
  run = tmp_path / "run"
  code = ("import sys, dlgs_jax; from dlgs_jax.cli import train; "
          "print(dlgs_jax.__file__); sys.exit(train.main(sys.argv[1:]))")
  done = subprocess.run(
      [sys.executable, "-c", code, "--model", "smallcnn", "--method", "dlgs", "--steps", "3",
       "--batch-size", "8", "--local-devices", "2", "--check-every", "0", "--workdir", str(run)],
      env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  assert done.stdout.splitlines()[0].startswith(str(tmp_path / "site"))
  assert json.loads((run / "summary.json").read_text())["steps"] == 3
