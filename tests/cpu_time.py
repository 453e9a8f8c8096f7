"""Where the suite's time goes: each test's CPU seconds, its children's included.

The suite is CPU-bound on a 2-core machine, so a test's wall time says more about
what ran beside it than about its own cost. This plugin records, per test, the CPU
seconds of the pytest process and of the child processes it waited for:

  DLGS_TEST_CPU_DIR=/tmp/cpu bash scripts/test.sh -p tests.cpu_time
  python -m tests.cpu_time /tmp/cpu          # the costliest tests and files

Each pytest process (every xdist worker) appends one JSON line per test to
`<dir>/<pid>.jsonl`. The persistent compilation cache is shared by the whole run, so
a program's compilation is charged to whichever test compiles it first.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest


def cpu_seconds() -> float:
  """User + system seconds of this process and of its waited-for children."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  folder = os.environ.get("DLGS_TEST_CPU_DIR")
  cpu, wall = cpu_seconds(), time.monotonic()
  yield
  if folder:
    record = {"test": item.nodeid, "cpu": cpu_seconds() - cpu, "wall": time.monotonic() - wall}
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"{os.getpid()}.jsonl", "a") as f:
      f.write(json.dumps(record) + "\n")


def records(folder: str) -> list[dict]:
  """Every test's record in `folder`, from all the processes that wrote there."""
  return [json.loads(line) for path in sorted(Path(folder).glob("*.jsonl"))
          for line in path.read_text().splitlines()]


def summary(folder: str, top: int = 25) -> str:
  """The total, the `top` costliest tests and the costliest files, as text."""
  found = sorted(records(folder), key=lambda r: -r["cpu"])
  if not found:
    raise SystemExit(f"no records in {folder}: run pytest with -p tests.cpu_time and "
                     "DLGS_TEST_CPU_DIR set")
  files = collections.Counter()
  for r in found:
    files[r["test"].split("::")[0]] += r["cpu"]
  lines = [f"{len(found)} tests, {sum(r['cpu'] for r in found):.0f} CPU seconds",
           "", "  cpu s  wall s  test"]
  lines += [f"{r['cpu']:7.1f} {r['wall']:7.1f}  {r['test']}" for r in found[:top]]
  lines += ["", "  cpu s  file"] + [f"{cpu:7.1f}  {name}" for name, cpu in files.most_common(top)]
  return "\n".join(lines)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    raise SystemExit("usage: python -m tests.cpu_time DIR")
  print(summary(sys.argv[1]))
