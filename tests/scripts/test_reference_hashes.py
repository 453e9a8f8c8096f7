"""The refactoring guard: two hash files compared, and a difference named and failed."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reference_hashes.py"


def compare(tmp_path, before: dict, after: dict):
  paths = []
  for name, hashes in (("before", before), ("after", after)):
    paths.append(tmp_path / f"{name}.json")
    paths[-1].write_text(json.dumps(hashes))
  return subprocess.run([sys.executable, str(SCRIPT), "--compare", *map(str, paths)],
                        capture_output=True, text=True, timeout=120)


def test_identical_hashes_pass_and_a_changed_or_missing_method_is_named(tmp_path):
  same = compare(tmp_path, {"dense": "a", "dlgs": "b"}, {"dense": "a", "dlgs": "b"})
  assert same.returncode == 0 and same.stdout.strip() == "identical"
  changed = compare(tmp_path, {"dense": "a", "dlgs": "b", "topk": "c"},
                    {"dense": "a", "dlgs": "x"})
  assert changed.returncode == 1 and changed.stdout.strip() == "changed: dlgs, topk"
